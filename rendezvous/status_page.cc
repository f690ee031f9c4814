#include "rendezvous/status_page.h"

#include <charconv>
#include <string_view>

#include "proto/text.h"
#include "rendezvous/auth.h"

namespace mg::rdzv {

namespace {

constexpr const char* kPage = R"html(<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>mglaunch-rdzv</title>
<style>
body{font:14px system-ui,sans-serif;margin:1.5em;color:#222}
h1{font-size:1.3em;margin:0 0 .3em}
table{border-collapse:collapse;margin:.6em 0 1.2em}
th,td{border:1px solid #ccc;padding:.25em .6em;text-align:left;vertical-align:top}
th{background:#f3f3f3}
.node-standby{color:#555;font-style:italic}
.state-running{color:#07690b}.state-failed{color:#b00020}.state-restarting{color:#a05a00}.state-done{color:#555}
#events{font-family:monospace;font-size:12px;max-height:22em;overflow:auto;border:1px solid #ddd;padding:.4em;margin:0}
#events li{list-style:none;white-space:pre-wrap}
#auth{display:none;margin:.5em 0}
small{color:#666}
</style></head><body>
<h1>mglaunch-rdzv</h1>
<div id="status">loading…</div>
<form id="auth"><label>Rendezvous token: <input id="token" type="password" autocomplete="off"></label>
<button id="connect" type="submit">Connect</button></form>
<h2>Jobs</h2>
<table><thead><tr><th>job</th><th>state</th><th>round</th><th>restarts</th><th>nodes</th></tr></thead>
<tbody id="jobs"></tbody></table>
<h2>Events</h2>
<ul id="events"></ul>
<script>
"use strict";
let since = 0;
const headers = () => {
  const t = sessionStorage.getItem("mglaunch-token");
  return t ? {"Authorization": "Bearer " + t} : {};
};
const text = (tag, value, cls) => {
  const e = document.createElement(tag);
  e.textContent = value;
  if (cls) e.className = cls;
  return e;
};
function showJobs(jobs) {
  const body = document.getElementById("jobs");
  body.replaceChildren();
  for (const j of jobs) {
    const tr = document.createElement("tr");
    tr.dataset.job = j.id;
    tr.append(text("td", j.id, "id"), text("td", j.state, "state state-" + j.state), text("td", j.round, "round"),
              text("td", j.restart_count + " of " + j.max_restarts, "restarts"));
    const nodes = document.createElement("td");
    nodes.className = "nodes";
    nodes.append(...j.nodes.map(n => text("div", n.host + " (" + n.addr + ")" + (n.nproc ? " x" + n.nproc : "") + " " +
                                          n.status, "node node-" + n.status)));
    if (j.standby_nodes) nodes.append(text("small", j.standby_nodes + " standby"));
    if (j.root_cause) nodes.append(text("small", "root cause: " + j.root_cause));
    if (j.journal) nodes.append(text("small", " (from the --state-dir journal)"));
    tr.append(nodes);
    body.append(tr);
  }
}
function showEvents(events) {
  const list = document.getElementById("events");
  for (const e of events) {
    since = Math.max(since, e.seq);
    list.prepend(text("li", new Date(e.unix_ms).toLocaleTimeString() + "  " + e.text));
  }
  while (list.children.length > 200) list.lastChild.remove();
}
async function poll() {
  try {
    const [jobs, events] = await Promise.all([fetch("api/jobs", {headers: headers()}),
                                              fetch("api/events?since=" + since, {headers: headers()})]);
    if (jobs.status === 401) {
      document.getElementById("status").textContent =
          sessionStorage.getItem("mglaunch-token") ? "wrong token" : "this daemon needs its token";
      document.getElementById("auth").style.display = "block";
    } else if (jobs.ok && events.ok) {
      document.getElementById("status").textContent = "connected";
      document.getElementById("auth").style.display = "none";
      showJobs(await jobs.json());
      showEvents(await events.json());
    } else {
      document.getElementById("status").textContent = "error " + jobs.status;
    }
  } catch (err) {
    document.getElementById("status").textContent = "daemon unreachable";
  }
  setTimeout(poll, 500);
}
document.getElementById("auth").addEventListener("submit", ev => {
  ev.preventDefault();
  sessionStorage.setItem("mglaunch-token", document.getElementById("token").value);
});
poll();
</script></body></html>
)html";

// A query value: %XX and '+' decoded (a bad escape is kept as it is).
std::string percent_decoded(std::string_view v) {
  std::string out;
  for (std::size_t i = 0; i < v.size(); ++i) {
    unsigned char c = 0;
    if (v[i] == '%' && i + 2 < v.size() &&
        std::from_chars(v.data() + i + 1, v.data() + i + 3, c, 16).ptr == v.data() + i + 3) {
      out += static_cast<char>(c);
      i += 2;
    } else {
      out += v[i] == '+' ? ' ' : v[i];
    }
  }
  return out;
}

HttpResponse json(const nlohmann::json& j) {
  return {200, "application/json", proto::dump_json(j)};
}

}  // namespace

HttpResponse serve_status(const Server& server, const std::string& token, const HttpRequest& req) {
  if (req.method != "GET" && req.method != "HEAD") return {405, "text/plain; charset=utf-8", "only GET and HEAD\n"};
  const auto q = req.target.find('?');
  const std::string path = req.target.substr(0, q);
  if (path == "/" || path == "/index.html") return {200, "text/html; charset=utf-8", kPage};
  if (!path.starts_with("/api/")) return {404, "text/plain; charset=utf-8", "not found\n"};
  if (!token.empty() && !auth::equal_ct(req.authorization, "Bearer " + token))
    return {401, "application/json", R"({"error":"this daemon needs its token: Authorization: Bearer TOKEN"})"};
  if (path == "/api/jobs") return json(server.jobs_json());
  if (path == "/api/events") {
    std::uint64_t since = 0;
    if (q != std::string::npos) {
      const std::string query = req.target.substr(q + 1);
      if (query.starts_with("since=")) std::from_chars(query.data() + 6, query.data() + query.size(), since);
    }
    return json(server.events_json(since));
  }
  if (path == "/api/history") {
    // ?job=ID (percent-encoded): that job's journaled events (--state-dir).
    const std::string query = q == std::string::npos ? std::string() : req.target.substr(q + 1);
    if (!query.starts_with("job=")) return {400, "application/json", R"({"error":"give ?job=ID"})"};
    auto events = server.history_json(percent_decoded(query.substr(4)));
    if (events.is_null()) return {404, "application/json", R"x({"error":"no history of this job (is --state-dir set?)"})x"};
    return json(events);
  }
  return {404, "application/json", R"({"error":"not found"})"};
}

}  // namespace mg::rdzv
