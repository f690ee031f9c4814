#include "baremetal/hostfile.h"

#include <algorithm>
#include <charconv>
#include <map>
#include <set>

#include <fmt/format.h>

#include "cli/errors.h"

namespace mg {

namespace {

std::string_view trim(std::string_view s) {
  const auto b = s.find_first_not_of(" \t\r");
  if (b == std::string_view::npos) return {};
  return s.substr(b, s.find_last_not_of(" \t\r") - b + 1);
}

bool valid_host(std::string_view h) {
  if (h.empty() || h.size() > 255 || h.front() == '-') return false;
  return std::all_of(h.begin(), h.end(), [](char c) {
    // No '@' (it separates hosts in --include/--exclude; give users with -l or ~/.ssh/config).
    return std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '-' || c == '_' || c == ':' || c == '[' ||
           c == ']';
  });
}

bool to_int(std::string_view s, int& v) {
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  return !s.empty() && ec == std::errc{} && p == s.data() + s.size();
}

// "h1:0,1@h2" -> {h1: {0,1}, h2: {}} (empty set: the whole host), keeping the order.
std::vector<std::pair<std::string, std::set<int>>> parse_selection(const std::string& flag, const std::string& text) {
  std::vector<std::pair<std::string, std::set<int>>> out;
  std::string_view rest = text;
  if (trim(rest).empty()) throw UsageError(fmt::format("{} is empty: use HOST[:SLOT,...]@HOST...", flag));
  while (true) {
    const auto at = rest.find('@');
    std::string_view item = trim(rest.substr(0, at));
    const auto colon = item.find(':');
    std::string host(trim(item.substr(0, colon)));
    if (!valid_host(host))
      throw UsageError(fmt::format("bad {} '{}': '{}' is not a host name (use HOST[:SLOT,...]@HOST...)", flag, text,
                                   host));
    std::set<int> slots;
    if (colon != std::string_view::npos) {
      std::string_view list = item.substr(colon + 1);
      while (true) {
        const auto comma = list.find(',');
        int v = -1;
        std::string_view one = trim(list.substr(0, comma));
        if (!to_int(one, v) || v < 0 || v >= kMaxSlots)
          throw UsageError(fmt::format("bad {} '{}': slot '{}' of {} is not a number in 0..{}", flag, text, one, host,
                                       kMaxSlots - 1));
        slots.insert(v);
        if (comma == std::string_view::npos) break;
        list = list.substr(comma + 1);
      }
    }
    auto it = std::find_if(out.begin(), out.end(), [&](const auto& p) { return p.first == host; });
    if (it != out.end())
      throw UsageError(fmt::format("bad {} '{}': host {} is named twice", flag, text, host));
    out.emplace_back(std::move(host), std::move(slots));
    if (at == std::string_view::npos) break;
    rest = rest.substr(at + 1);
  }
  return out;
}

}  // namespace

std::vector<HostEntry> parse_hostfile(std::string_view text, const std::string& source) {
  std::vector<HostEntry> hosts;
  std::set<std::string> seen;
  int line_no = 0;
  while (!text.empty()) {
    ++line_no;
    const auto nl = text.find('\n');
    std::string_view line = text.substr(0, nl);
    text = nl == std::string_view::npos ? std::string_view{} : text.substr(nl + 1);
    if (auto hash = line.find('#'); hash != std::string_view::npos) line = line.substr(0, hash);
    line = trim(line);
    if (line.empty()) continue;
    auto where = [&] { return fmt::format("{}:{}", source, line_no); };
    const auto sp = line.find_first_of(" \t");
    HostEntry e;
    e.line = line_no;
    e.host = std::string(line.substr(0, sp));
    if (!valid_host(e.host)) {
      const auto at = e.host.find('@');
      throw UsageError(
          at != std::string::npos
              ? fmt::format("{}: '{}' names a user: give the host alone ('{}') and the user in ~/.ssh/config or "
                            "--ssh-opts \"-l {}\"",
                            where(), e.host, e.host.substr(at + 1), e.host.substr(0, at))
              : fmt::format("{}: '{}' is not a host name (letters, digits, '.', '-', '_', ':' and [IPv6] only, "
                            "not starting with '-'); lines are 'HOST slots=N' or 'HOST'",
                            where(), e.host.size() > 64 ? e.host.substr(0, 64) + "..." : e.host));
    }
    if (sp != std::string_view::npos) {
      std::string_view rest = trim(line.substr(sp));
      if (rest.starts_with("slots") && !rest.starts_with("slots=") && rest.find('=') != std::string_view::npos)
        throw UsageError(fmt::format("{}: '{}' after {}: write slots=N without spaces around '='", where(), rest,
                                     e.host));
      if (!rest.starts_with("slots=") || rest.find_first_of(" \t") != std::string_view::npos)
        throw UsageError(fmt::format("{}: unexpected '{}' after {}; lines are 'HOST slots=N' or 'HOST'", where(),
                                     rest, e.host));
      if (!to_int(rest.substr(6), e.slots) || e.slots < 1 || e.slots > kMaxSlots)
        throw UsageError(fmt::format("{}: bad '{}': slots must be a whole number in 1..{} (or leave slots= out: "
                                     "the host detects its workers)",
                                     where(), rest.size() > 64 ? std::string(rest.substr(0, 64)) + "..." : std::string(rest),
                                     kMaxSlots));
    }
    if (!seen.insert(e.host).second)
      throw UsageError(fmt::format("{}: host {} is listed twice; give it one line with slots=N", where(), e.host));
    if (static_cast<int>(hosts.size()) >= kMaxHosts)
      throw UsageError(fmt::format("{}: more than {} hosts: split the job into several hostfiles", where(), kMaxHosts));
    hosts.push_back(std::move(e));
  }
  if (hosts.empty()) throw UsageError(fmt::format("hostfile {} lists no host; add lines 'HOST slots=N'", source));
  return hosts;
}

std::vector<HostEntry> select_hosts(std::vector<HostEntry> hosts, const std::string& include,
                                    const std::string& exclude) {
  if (!include.empty() && !exclude.empty())
    throw UsageError("--include and --exclude cannot be used together; pick one");
  if (include.empty() && exclude.empty()) return hosts;
  const bool inc = !include.empty();
  const std::string flag = inc ? "--include" : "--exclude";
  const auto sel = parse_selection(flag, inc ? include : exclude);
  std::map<std::string, std::set<int>> by_host;
  for (const auto& item : sel) {
    const std::string& h = item.first;  // (a plain name: clang 14 cannot capture bindings)
    const std::set<int>& s = item.second;
    auto it = std::find_if(hosts.begin(), hosts.end(), [&](const HostEntry& e) { return e.host == h; });
    if (it == hosts.end())
      throw UsageError(fmt::format("{} names host {}, which is not in the hostfile", flag, h));
    for (int slot : s)
      if (it->slots > 0 && slot >= it->slots)
        throw UsageError(fmt::format("{} names slot {} of {}, which has slots={} (0..{})", flag, slot, h, it->slots,
                                     it->slots - 1));
    if (!inc && !s.empty() && it->slots == 0)
      throw UsageError(fmt::format("--exclude names slots of {}, whose slot count is unknown; give it 'slots=N' in "
                                   "the hostfile",
                                   h));
    by_host[h] = s;
  }
  std::vector<HostEntry> out;
  for (auto& e : hosts) {
    auto it = by_host.find(e.host);
    if (inc) {
      if (it == by_host.end()) continue;
      if (!it->second.empty()) e.slot_ids.assign(it->second.begin(), it->second.end());
    } else if (it != by_host.end()) {
      if (it->second.empty()) continue;  // the whole host
      for (int s = 0; s < e.slots; ++s)
        if (!it->second.count(s)) e.slot_ids.push_back(s);
      if (e.slot_ids.empty()) continue;
      if (static_cast<int>(e.slot_ids.size()) == e.slots) e.slot_ids.clear();
    }
    out.push_back(std::move(e));
  }
  if (out.empty()) throw UsageError(fmt::format("{} leaves no host to run on", flag));
  return out;
}

}  // namespace mg
