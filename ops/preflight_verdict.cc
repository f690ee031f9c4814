#include "ops/preflight_verdict.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <set>
#include <utility>

#include <fmt/format.h>

#include "ops/preflight.h"

namespace mg::preflight {

std::string rate_text(double bytes_per_s) {
  if (bytes_per_s >= 1e9) return fmt::format("{:.2f} GB/s", bytes_per_s / 1e9);
  if (bytes_per_s >= 1e6) return fmt::format("{:.0f} MB/s", bytes_per_s / 1e6);
  return fmt::format("{:.2f} MB/s", bytes_per_s / 1e6);
}

std::string node_name(int r, const std::vector<std::string>& nodes) {
  return r >= 0 && r < static_cast<int>(nodes.size()) ? fmt::format("node {} ({})", r, nodes[static_cast<std::size_t>(r)])
                                                      : fmt::format("node {}", r);
}

std::string names(const std::vector<int>& rs, const std::vector<std::string>& nodes) {
  std::string out;
  for (std::size_t i = 0; i < rs.size(); ++i) {
    if (i) out += i + 1 == rs.size() ? " and " : ", ";
    out += node_name(rs[i], nodes);
  }
  return out;
}

void add_unique(std::vector<int>& v, int x) {
  if (std::find(v.begin(), v.end(), x) == v.end()) v.push_back(x);
}
std::vector<int> shifts(int n) {
  std::vector<int> s;
  for (int k = 1; k < n; k *= 2) s.push_back(k);
  return s;
}

nlohmann::json to_json(const NodeReport& r) {
  nlohmann::json rec = nlohmann::json::array();
  for (const auto& x : r.received) rec.push_back({{"from", x.from}, {"bytes", x.bytes}, {"seconds", x.seconds}});
  return {{"rank", r.rank},           {"unreachable", r.unreachable}, {"waited_on", r.waited_on},
          {"errors", r.errors},       {"allreduce_s", r.allreduce_s}, {"allreduce_wrong", r.allreduce_wrong},
          {"received", rec},          {"flooded", r.flooded}};
}

NodeReport node_report_from_json(const nlohmann::json& j) {
  NodeReport r;
  r.rank = j.at("rank").get<int>();
  r.unreachable = j.at("unreachable").get<std::vector<int>>();
  r.waited_on = j.at("waited_on").get<std::vector<int>>();
  r.errors = j.at("errors").get<std::vector<std::string>>();
  r.allreduce_s = j.at("allreduce_s").get<double>();
  r.allreduce_wrong = j.at("allreduce_wrong").get<long long>();
  r.flooded = j.value("flooded", std::string());
  for (const auto& x : j.at("received"))
    r.received.push_back({x.at("from").get<int>(), x.at("bytes").get<double>(), x.at("seconds").get<double>()});
  return r;
}

Verdict judge(const std::vector<NodeReport>& reports, const std::vector<std::string>& nodes, double slow_fraction,
              double seconds) {
  Verdict v;
  const int n = static_cast<int>(nodes.size());
  // A node whose data port strangers flooded: its peers' connections may have been among
  // those turned away, so what failed between nodes names nobody (as a flood of the
  // control port does).
  std::string flooded;
  for (const auto& r : reports)
    if (!r.flooded.empty() && r.rank >= 0 && r.rank < n)
      flooded += fmt::format("{}{}'s data port: {}", flooded.empty() ? "" : "; ", node_name(r.rank, nodes), r.flooded);
  auto fail = [&](std::vector<int> named, const std::string& what, bool between_nodes = true) {
    std::sort(named.begin(), named.end());
    v.named = std::move(named);
    v.line = fmt::format("preflight failed after {:.2f} s: {}", seconds, what);
    if (between_nodes && !flooded.empty()) {
      v.named.clear();
      v.line += fmt::format("; but nobody is named: strangers flooded {} (find what connects to that port; a token, "
                            "--token-file, lets nodes prove they belong)",
                            flooded);
    }
    return v;
  };
  std::vector<const NodeReport*> by_rank(static_cast<std::size_t>(n), nullptr);
  for (const auto& r : reports)
    if (r.rank >= 0 && r.rank < n) by_rank[static_cast<std::size_t>(r.rank)] = &r;

  // Broken: never came, or stopped answering.
  {
    std::vector<int> absent, silent;
    for (int r = 0; r < n; ++r) {
      const NodeReport* p = by_rank[static_cast<std::size_t>(r)];
      if (!p || !p->reached) absent.push_back(r);
      else if (!p->reported) silent.push_back(r);
    }
    if (!absent.empty())
      return fail(absent, fmt::format("{} did not reach the coordinator, {}, at MASTER_ADDR:MASTER_PORT "
                                      "(is its agent running, and can it reach that address?)",
                                      names(absent, nodes), node_name(0, nodes)),
                  /*between_nodes=*/false);
    if (!silent.empty())
      return fail(silent, fmt::format("{} stopped answering during the check (stopped or overloaded?)",
                                      names(silent, nodes)),
                  /*between_nodes=*/false);
  }
  // Connections that failed: blame a node nobody reaches, else one that reaches nobody.
  {
    std::vector<int> tried(static_cast<std::size_t>(n)), failed_to(static_cast<std::size_t>(n));
    std::vector<std::pair<int, int>> pairs;
    for (int r = 0; r < n; ++r)
      for (int s : shifts(n)) {
        const int t = (r + s) % n;
        ++tried[static_cast<std::size_t>(t)];
        const auto& u = by_rank[static_cast<std::size_t>(r)]->unreachable;
        if (std::find(u.begin(), u.end(), t) != u.end()) {
          ++failed_to[static_cast<std::size_t>(t)];
          pairs.emplace_back(r, t);
        }
      }
    if (!pairs.empty()) {
      std::vector<int> nobody_reaches, reaches_nobody;
      for (int t = 0; t < n; ++t)
        if (tried[static_cast<std::size_t>(t)] > 0 && failed_to[static_cast<std::size_t>(t)] == tried[static_cast<std::size_t>(t)])
          nobody_reaches.push_back(t);
      if (!nobody_reaches.empty()) {
        std::string detail;  // one of the errors, as an example
        const std::string to = fmt::format("-> node {}:", nobody_reaches.front());
        for (const auto* p : by_rank)
          for (const auto& e : p->errors)
            if (detail.empty() && e.find(to) != std::string::npos) detail = " (" + e + ")";
        return fail(nobody_reaches, fmt::format("no node can connect to {}: its port is unreachable{}; check its "
                                                "firewall and the address it advertises (--local_addr)",
                                                names(nobody_reaches, nodes), detail));
      }
      for (int r = 0; r < n; ++r)
        if (by_rank[static_cast<std::size_t>(r)]->unreachable.size() == shifts(n).size()) reaches_nobody.push_back(r);
      if (!reaches_nobody.empty())
        return fail(reaches_nobody, fmt::format("{} cannot connect to any of its peers ({}); check its routes and "
                                                "firewall",
                                                names(reaches_nobody, nodes),
                                                by_rank[static_cast<std::size_t>(reaches_nobody.front())]->errors.empty()
                                                    ? std::string("refused")
                                                    : by_rank[static_cast<std::size_t>(reaches_nobody.front())]->errors.front()));
      std::vector<int> all;
      std::string list;
      for (auto [a, b] : pairs) {
        add_unique(all, a);
        add_unique(all, b);
        if (!list.empty()) list += ", ";
        list += fmt::format("{} -> {}", a, b);
      }
      return fail(all, fmt::format("some connections between nodes failed ({}); check the firewall between {}", list,
                                   names(all, nodes)));
    }
  }
  // Data that never came: the node most waited on.
  {
    std::map<int, int> waited;
    for (const auto* p : by_rank)
      for (int w : p->waited_on) ++waited[w];
    if (!waited.empty()) {
      int most = 0;
      for (auto [r, c] : waited) most = std::max(most, c);
      std::vector<int> named;
      for (auto [r, c] : waited)
        if (c == most) named.push_back(r);
      std::string detail;
      for (const auto* p : by_rank)
        if (!p->errors.empty()) {
          detail = fmt::format(" (node {}: {})", p->rank, p->errors.front());
          break;
        }
      return fail(named, fmt::format("{} sent nothing its peers could receive within the time-out{}", names(named, nodes),
                                     detail));
    }
  }
  // A wrong sum.
  {
    std::vector<int> wrong;
    for (const auto* p : by_rank)
      if (p->allreduce_wrong > 0) wrong.push_back(p->rank);
    if (!wrong.empty())
      return fail(wrong, fmt::format("the all-reduce gave wrong sums on {}: data is corrupted between nodes",
                                     names(wrong, nodes)));
  }
  for (const auto* p : by_rank) v.allreduce_s = std::max(v.allreduce_s, p->allreduce_s);
  // Slow links.
  struct Link {
    int from, to;
    double rate;
  };
  std::vector<Link> links;
  for (const auto* p : by_rank)
    for (const auto& x : p->received)
      if (x.bytes > 0 && x.seconds > 0) links.push_back({x.from, p->rank, x.bytes / x.seconds});
  if (!links.empty()) {
    std::vector<double> rates;
    for (const auto& l : links) rates.push_back(l.rate);
    std::sort(rates.begin(), rates.end());
    const std::size_t m = rates.size();
    v.median_rate = m % 2 ? rates[m / 2] : (rates[m / 2 - 1] + rates[m / 2]) / 2;
    const double floor = slow_fraction * v.median_rate;
    std::map<int, double> send_best, recv_best;
    for (const auto& l : links) send_best[l.from] = std::max(send_best[l.from], l.rate);
    std::set<int> slow_senders;
    for (auto [r, best] : send_best)
      if (best < floor) slow_senders.insert(r);
    for (const auto& l : links)
      if (!slow_senders.count(l.from)) recv_best[l.to] = std::max(recv_best[l.to], l.rate);
    std::vector<int> named;
    std::vector<std::string> what;
    for (int r = 0; r < n; ++r) {
      const bool s = slow_senders.count(r) > 0;
      const bool rcv = recv_best.count(r) && recv_best[r] < floor;
      if (!s && !rcv) continue;
      named.push_back(r);
      if (s && rcv)
        what.push_back(fmt::format("{} sends at {} and receives at {}", node_name(r, nodes), rate_text(send_best[r]),
                                   rate_text(recv_best[r])));
      else if (s)
        what.push_back(fmt::format("{} sends at {}", node_name(r, nodes), rate_text(send_best[r])));
      else
        what.push_back(fmt::format("{} receives at {}", node_name(r, nodes), rate_text(recv_best[r])));
    }
    if (!named.empty()) {
      std::string list;
      for (std::size_t i = 0; i < what.size(); ++i) list += (i ? "; " : "") + what[i];
      const double inv = 1 / slow_fraction;
      const std::string frac = std::abs(inv - std::round(inv)) < 1e-9 ? fmt::format("1/{:.0f}", inv)
                                                                       : fmt::format("{:g}", slow_fraction);
      return fail(named, fmt::format("slow: {} at best, while the median link runs at {} (slow: below {} of it)",
                                     list, rate_text(v.median_rate), frac));
    }
    // The figures, the slowest node named.
    int slowest = -1;
    double slowest_rate = 0;
    for (auto [r, best] : send_best)
      if (slowest < 0 || best < slowest_rate) {
        slowest = r;
        slowest_rate = best;
      }
    v.ok = true;
    v.line = fmt::format("preflight passed in {:.2f} s: {} nodes, all-reduce {:.1f} ms, point-to-point median {} "
                         "(slowest sender {} at {})",
                         seconds, n, v.allreduce_s * 1e3, rate_text(v.median_rate), node_name(slowest, nodes),
                         rate_text(slowest_rate));
    return v;
  }
  v.ok = true;
  v.line = fmt::format("preflight passed in {:.2f} s: {} node{}, nothing to measure between nodes", seconds, n,
                       n == 1 ? "" : "s");
  return v;
}

}  // namespace mg::preflight
