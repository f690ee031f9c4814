// The daemon's operator log (#38): one line per job event, naming nodes by their host and
// advertised address, as text or (--json-log) one JSON object per line. Real mglaunch-rdzv
// on 127.0.0.1, real agents on 127.0.0.2-4 (--local_addr), fake_worker as the workload.
#include <catch2/catch.hpp>

#include <signal.h>
#include <sys/stat.h>

#include <fstream>

#include <nlohmann/json.hpp>

#include "rendezvous/journal.h"
#include "support/proc.h"
#include "support/rdzv_fixture.h"

using namespace mgtest;
using namespace std::chrono_literals;

namespace {

// The daemon's JSON lines (every one must parse).
std::vector<nlohmann::json> json_lines(const std::string& err) {
  std::vector<nlohmann::json> out;
  for (const auto& l : split_lines(err)) {
    INFO(l);
    auto j = nlohmann::json::parse(l, nullptr, false);
    CHECK(j.is_object());
    if (j.is_object()) out.push_back(std::move(j));
  }
  return out;
}

// The first event of `kind` at or after index `from` whose fields hold `match`; -1 if none.
long find_event(const std::vector<nlohmann::json>& events, const std::string& kind, std::size_t from,
                const nlohmann::json& match = nlohmann::json::object()) {
  for (std::size_t i = from; i < events.size(); ++i) {
    if (events[i].value("event", "") != kind) continue;
    bool all = true;
    for (const auto& [k, v] : match.items()) all = all && events[i].contains(k) && events[i][k] == v;
    if (all) return static_cast<long>(i);
  }
  return -1;
}

}  // namespace

TEST_CASE("daemon log (#38): a lost node, the restart, a standby promoted in its place and the end, one event each, "
          "JSON with --json-log, nodes named by their advertised address") {
  Daemon d = start_daemon({}, {"--json-log"});
  const std::vector<std::string> flags{"--max_restarts=1",
                                       "--rdzv_conf=last_call_timeout=120,keep_alive_interval=1,keep_alive_max_attempt=3"};
  const std::vector<std::string> worker{"when-restart-below", "1", "print", "up", "hang", "120"};
  Proc a = spawn(agent_argv(d.endpoint, "oplog", 2, "1:2", 1, flags, worker));
  Proc b = spawn(agent_argv(d.endpoint, "oplog", 3, "1:2", 1, flags, worker));
  REQUIRE(eventually([&] { return a.out().find("up") != std::string::npos && b.out().find("up") != std::string::npos; },
                     60s));
  Proc s = spawn(agent_argv(d.endpoint, "oplog", 4, "1:2", 1, flags, worker));
  REQUIRE(eventually([&] { return d.proc.err().find("\"standby\"") != std::string::npos || !pid_alive(s.pid); }, 30s));
  ::kill(a.pid, SIGKILL);  // 127.0.0.2
  for (auto* p : {&b, &s}) {
    REQUIRE(p->wait(90s));
    INFO(p->err());
    CHECK(p->exit_code() == 0);
  }
  a.wait(10s);
  REQUIRE(eventually([&] { return d.proc.err().find("\"done\"") != std::string::npos; }, 10s));
  ::kill(d.proc.pid, SIGTERM);
  REQUIRE(d.proc.wait(10s));
  const std::string err = d.proc.err();
  INFO(err);
  const auto events = json_lines(err);
  for (const auto& e : events) {
    CHECK(e.contains("time"));
    CHECK(e.contains("text"));
    // Never a TCP source address (127.0.0.1:PORT): every node is named by its advertised one.
    CHECK(e["text"].get<std::string>().find("127.0.0.1:") == std::string::npos);
  }
  const long created = find_event(events, "created", 0, {{"job", "oplog"}, {"min_nodes", 1}, {"max_nodes", 2}});
  REQUIRE(created >= 0);
  CHECK(find_event(events, "joined", 0, {{"addr", "127.0.0.2"}, {"role", "active"}}) >= 0);
  CHECK(find_event(events, "joined", 0, {{"addr", "127.0.0.3"}, {"role", "active"}}) >= 0);
  const long round1 = find_event(events, "round_started", 0, {{"round", 1}, {"nodes", 2}, {"world_size", 2}});
  REQUIRE(round1 >= 0);
  const long standby = find_event(events, "standby", static_cast<std::size_t>(round1), {{"addr", "127.0.0.4"}});
  REQUIRE(standby >= 0);
  const long lost = find_event(events, "node_lost", static_cast<std::size_t>(standby),
                               {{"addr", "127.0.0.2"}, {"cause", "connection closed"}});
  REQUIRE(lost >= 0);
  CHECK_THAT(events[lost]["text"].get<std::string>(),
             Catch::Matches("job 'oplog': node .* \\(127\\.0\\.0\\.2, agent .*\\) lost \\(connection closed\\): its "
                            "connection closed.*"));
  const long restart = find_event(events, "restart", static_cast<std::size_t>(lost), {{"restart_count", 1}, {"cause", "node lost"}});
  REQUIRE(restart >= 0);
  CHECK_THAT(events[restart]["text"].get<std::string>(), Catch::Contains("restart 1 of 1: node ") &&
                                                             Catch::Contains("(127.0.0.2) lost: its connection closed"));
  const long promoted = find_event(events, "promoted", static_cast<std::size_t>(restart), {{"addr", "127.0.0.4"}});
  REQUIRE(promoted >= 0);
  CHECK(events[promoted]["replaces"] == events[lost]["host"]);
  const long round2 = find_event(events, "round_started", static_cast<std::size_t>(promoted),
                                 {{"round", 2}, {"restart_count", 1}, {"nodes", 2}});
  REQUIRE(round2 >= 0);
  const long done = find_event(events, "done", static_cast<std::size_t>(round2), {{"round", 2}, {"nodes", 2}});
  REQUIRE(done >= 0);
  CHECK(events[done]["text"] == "job 'oplog' done: round 2, 2 nodes, 1 restart spent");
  CHECK(find_event(events, "failed", 0) < 0);
}

TEST_CASE("daemon log (#38): an agent without the daemon's token is named with its address and told a token is "
          "needed, not 'unexpected message type'") {
  Daemon d = start_daemon({{"MGLAUNCH_RDZV_TOKEN", "s3cret"}});
  Proc a = spawn(agent_argv(d.endpoint, "tokenless", 2, "2", 1, {"--rdzv_conf=join_timeout=5"}, {"print", "up"}),
                 {{"MGLAUNCH_RDZV_TOKEN", kUnset}, {"MGLAUNCH_RDZV_JOB_TOKEN", kUnset}});
  REQUIRE(a.wait(60s));
  CHECK(a.exit_code() != 0);
  REQUIRE(eventually([&] { return d.proc.err().find("sent no proof") != std::string::npos; }, 10s));
  ::kill(d.proc.pid, SIGTERM);
  REQUIRE(d.proc.wait(10s));
  INFO(d.proc.err());
  CHECK_THAT(d.proc.err(), Catch::Matches("(.|\n)*mglaunch-rdzv: agent .* \\(127\\.0\\.0\\.2, connected from "
                                          "127\\.0\\.0\\.1:[0-9]+\\) sent no proof for job 'tokenless': this daemon "
                                          "requires a token; give the agent the same one \\(MGLAUNCH_RDZV_TOKEN, or "
                                          "the job's key from --job-token as MGLAUNCH_RDZV_JOB_TOKEN\\)\n(.|\n)*"));
  CHECK_THAT(d.proc.err(), !Catch::Contains("unexpected message type"));
  INFO(a.err());
  CHECK_THAT(a.err(), Catch::Contains("token"));
}

namespace {

// A daemon journaling in `dir`, at `endpoint`, with its status page (its port: http_port).
struct JournalingDaemon {
  Daemon d;
  int http_port = 0;
};
JournalingDaemon journaling_daemon(const std::string& endpoint, const std::string& dir) {
  JournalingDaemon j{{spawn({kRdzvDaemon, "--listen", endpoint, "--state-dir", dir, "--http", "127.0.0.1:0"}), endpoint}};
  REQUIRE(eventually([&] { return split_lines(j.d.proc.out()).size() > 1 || !pid_alive(j.d.proc.pid); }, 10s));
  INFO(j.d.proc.err());
  REQUIRE_THAT(j.d.proc.out(), Catch::Contains("listening on"));
  j.http_port = port_on_line(j.d, 1);
  return j;
}

nlohmann::json api(int port, const std::string& path) {
  auto j = nlohmann::json::parse(body_of(http_request(port, path)), nullptr, false);
  INFO(path);
  REQUIRE(!j.is_discarded());
  return j;
}

nlohmann::json job_of(const nlohmann::json& jobs, const std::string& id) {
  for (const auto& j : jobs)
    if (j["id"] == id) return j;
  return nullptr;
}

std::vector<std::string> kinds_of(const nlohmann::json& events) {
  std::vector<std::string> out;
  for (const auto& e : events) out.push_back(e.value("event", ""));
  return out;
}

}  // namespace

TEST_CASE("daemon --state-dir (#38): a daemon SIGKILLed and restarted keeps the ended job's history and the running "
          "job's, on its status API") {
  const std::string dir = make_temp_dir();
  const std::string endpoint = "127.0.0.1:" + std::to_string(free_loopback_port());
  auto first = journaling_daemon(endpoint, dir);
  // 1:2, not 1: a one-node job needs no rendezvous.
  const std::vector<std::string> flags{"--rdzv_conf=last_call_timeout=0.5"};
  Proc ended = spawn(agent_argv(endpoint, "ended", 2, "1:2", 1, flags, {"print", "up"}));
  REQUIRE(ended.wait(60s));
  CHECK(ended.exit_code() == 0);
  const std::string go = make_temp_dir() + "/go";
  Proc running = spawn(agent_argv(endpoint, "running", 3, "1:2", 1, flags, {"print", "up", "wait-file", go}));
  REQUIRE(eventually([&] { return running.out().find("up") != std::string::npos; }, 60s));
  ::kill(first.d.proc.pid, SIGKILL);
  REQUIRE(first.d.proc.wait(5s));

  auto second = journaling_daemon(endpoint, dir);
  // The ended job is on the status API from the journal, with its history.
  const auto jobs = api(second.http_port, "/api/jobs");
  INFO(jobs.dump());
  const auto was = job_of(jobs, "ended");
  REQUIRE(was.is_object());
  CHECK(was["state"] == "done");
  CHECK(was["journal"] == true);
  CHECK(was["round"] == 1);
  CHECK(was["nodes"][0]["addr"] == "127.0.0.2");
  CHECK(kinds_of(api(second.http_port, "/api/history?job=ended")) ==
        std::vector<std::string>{"created", "joined", "round_started", "done"});
  bool seen = false;
  for (const auto& e : api(second.http_port, "/api/events")) seen = seen || e["text"] == "job 'ended' done: round 1, 1 node, 0 restarts spent";
  CHECK(seen);
  // The running job re-registers with the restarted daemon and ends; its history runs on.
  REQUIRE(eventually([&] { return running.err().find("re-registered round 1") != std::string::npos; }, 30s));
  std::ofstream(go) << "go\n";
  REQUIRE(running.wait(60s));
  CHECK(running.exit_code() == 0);
  REQUIRE(eventually([&] { return job_of(api(second.http_port, "/api/jobs"), "running").value("state", "") == "done"; },
                     10s));
  CHECK(kinds_of(api(second.http_port, "/api/history?job=running")) ==
        std::vector<std::string>{"created", "joined", "round_started", "created", "joined", "done"});
  ::kill(second.d.proc.pid, SIGTERM);
  REQUIRE(second.d.proc.wait(10s));
  CHECK(second.d.proc.exit_code() == 0);
}

TEST_CASE("daemon --state-dir (#38): a missing or unusable directory, a damaged journal and one in use get one line "
          "and exit 2 or 4, and a cut last line is truncated with a warning") {
  const std::string dir = make_temp_dir();
  auto daemon = [](const std::string& state_dir) {
    return run({kRdzvDaemon, "--listen", "127.0.0.1:0", "--state-dir", state_dir}, {}, 20s);
  };
  auto one_error_line = [](const Result& r, int code, const std::string& what) {
    INFO(r.err);
    CHECK(r.code == code);
    CHECK(split_lines(r.err).size() == 1);
    CHECK_THAT(r.err, Catch::StartsWith("mglaunch-rdzv: error: --state-dir") && Catch::Contains(what));
  };
  one_error_line(daemon(dir + "/missing"), 2, "create it first");
  std::ofstream(dir + "/file") << "x\n";
  one_error_line(daemon(dir + "/file"), 2, "is not a directory");
  one_error_line(daemon(""), 2, "--state-dir is empty");

  const std::string damaged = dir + "/damaged";
  REQUIRE(::mkdir(damaged.c_str(), 0700) == 0);
  std::ofstream(damaged + "/journal.jsonl") << "{\"event\":\"created\",\"job\":\"a\",\"unix_ms\":1}\nnot json\n"
                                            << "{\"event\":\"done\",\"job\":\"a\",\"unix_ms\":2}\n";
  one_error_line(daemon(damaged), 4, "journal.jsonl line 2 is not a journal event");

  const std::string cut = dir + "/cut";
  REQUIRE(::mkdir(cut.c_str(), 0700) == 0);
  const std::string whole = "{\"event\":\"created\",\"job\":\"a\",\"unix_ms\":1,\"text\":\"job 'a' created\"}\n";
  std::ofstream(cut + "/journal.jsonl") << whole << "{\"event\":\"do";
  Daemon d{spawn({kRdzvDaemon, "--listen", "127.0.0.1:0", "--state-dir", cut}), ""};
  REQUIRE(eventually([&] { return d.proc.out().find("listening on") != std::string::npos || !pid_alive(d.proc.pid); }, 10s));
  INFO(d.proc.err());
  CHECK_THAT(d.proc.err(), Catch::Contains("mglaunch-rdzv: warning: --state-dir: ") &&
                               Catch::Contains("journal.jsonl's last 12 bytes were not a whole event") &&
                               Catch::Contains("truncated"));
  CHECK(read_file(cut + "/journal.jsonl") == whole);
  // A second daemon on the same directory is refused while the first runs.
  one_error_line(daemon(cut), 4, "is in use by another mglaunch-rdzv");
  ::kill(d.proc.pid, SIGTERM);
  REQUIRE(d.proc.wait(10s));
}

TEST_CASE("journal (#38): events come back after a reopen, a job's summary follows them, and the files stay bounded") {
  const std::string dir = make_temp_dir();
  auto event = [](const std::string& kind, const std::string& job, std::int64_t ms) {
    return nlohmann::json{{"event", kind}, {"job", job}, {"unix_ms", ms}, {"text", kind + " " + job}, {"round", 1},
                          {"restart_count", 0}};
  };
  {
    std::string warning;
    mg::rdzv::Journal j(dir, warning);
    CHECK(warning.empty());
    j.record(event("created", "a", 1));
    auto failed = event("failed", "a", 2);
    failed["why"] = "node n (10.0.0.2) lost: its connection closed";
    j.record(failed);
    j.record(event("created", "b", 3));
  }
  {
    std::string warning;
    mg::rdzv::Journal j(dir, warning);
    REQUIRE(j.jobs().size() == 2);
    const auto& a = j.jobs().at("a").summary;
    CHECK(a["state"] == "failed");
    CHECK(a["root_cause"] == "node n (10.0.0.2) lost: its connection closed");
    CHECK(j.jobs().at("b").summary["state"] == "joining");
    CHECK(j.last_events(2).size() == 2);
    CHECK(j.last_events(2).back()["job"] == "b");
  }
  // Past its bound the journal moves to journal.1.jsonl: two files at most, each bounded.
  const std::string small = make_temp_dir();
  {
    std::string warning;
    mg::rdzv::Journal j(small, warning, 1000);
    for (int i = 0; i < 100; ++i) j.record(event("joined", "c", i));
  }
  CHECK(read_file(small + "/journal.jsonl").size() <= 1000);
  CHECK(read_file(small + "/journal.1.jsonl").size() <= 1000);
  std::string warning;
  mg::rdzv::Journal again(small, warning, 1000);
  CHECK(warning.empty());
  CHECK(again.jobs().at("c").events.back()["unix_ms"] == 99);
}
