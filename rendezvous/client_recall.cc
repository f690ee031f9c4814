// ClientMachine's Recall (rendezvous/client_machine.h, #34 H1): an agent restarted on a node
// of a job looks for the job at the hosts its record names before it hosts a fresh job (or
// joins the endpoint), and job_hosts(), what that record names.
#include <algorithm>

#include <fmt/format.h>

#include "rendezvous/client_machine.h"

namespace mg::rdzv {

using std::chrono::milliseconds;

void ClientMachine::recall(std::vector<std::pair<std::string, int>> hosts, std::string run, Clock::time_point until,
                           int epoch) {
  hosts.erase(std::remove_if(hosts.begin(), hosts.end(), [](const auto& h) { return h.first.empty() || h.second <= 0; }),
              hosts.end());
  if (hosts.size() > kMaxRecallHosts) hosts.resize(kMaxRecallHosts);
  if (hosts.empty() || run.empty()) return;
  Recall r;
  r.targets = std::move(hosts);
  r.run = std::move(run);
  r.epoch = epoch;
  r.until = until;
  r.endpoint_host = opts_.host;
  r.endpoint_port = opts_.port;
  recall_ = std::move(r);
}

void ClientMachine::start_recall(Clock::time_point now) {
  // The recall is part of the wait join_timeout bounds: it ends by then at the latest (a
  // whole job rerun at once finds no record's host running the job, review M2).
  recall_->until = std::min(recall_->until, now + milliseconds(opts_.join.join_timeout_ms));
  next_recall_target(now);
}

void ClientMachine::next_recall_target(Clock::time_point now, const std::string& why_previous) {
  Recall& r = *recall_;
  if (!why_previous.empty())
    r.tried += fmt::format("{}{}: {}", r.tried.empty() ? "" : "; ", host_port(opts_.host, opts_.port), why_previous);
  drop_connection();
  cancel(ClientTimer::kTakeover);
  const bool pass_over = !r.pausing && r.turn > 0 && r.turn % r.targets.size() == 0;
  if (pass_over && now >= r.until) {
    // Nobody runs the job's run at any host the record names: the record is stale (the job
    // ended, or every node of it is gone). A fresh start, as without a record.
    out_.push_back(cmd::Notice{fmt::format(
        "this node's record of job '{}' (run {}, from its agent's last run) is stale: no host it names runs that run "
        "({}); starting as a fresh node of the job",
        opts_.join.job_id, r.run, r.tried)});
    opts_.host = r.endpoint_host;
    opts_.port = r.endpoint_port;
    recall_.reset();
    out_.push_back(cmd::RecallEnded{});
    return;
  }
  if (pass_over) {
    // Every host refused or failed at once: the survivors may not have taken the job over
    // yet (their takeover sockets refuse until then). The next pass after a pause.
    r.pausing = true;
    r.tried.clear();
    arm(ClientTimer::kTakeover, std::min(r.until, now + std::min(milliseconds(500), milliseconds(opts_.join.keep_alive_ms))));
    return;
  }
  r.pausing = false;
  const auto& [host, port] = r.targets[r.turn++ % r.targets.size()];
  opts_.host = host;
  opts_.port = port;
  // A silent host is passed over after one keep-alive interval.
  arm(ClientTimer::kTakeover, now + milliseconds(opts_.join.keep_alive_ms));
  refused_ = 0;
  try_connect();
}

bool ClientMachine::recall_welcomed(const proto::Welcome& w, Clock::time_point now) {
  Recall& r = *recall_;
  if (w.run != r.run) {
    next_recall_target(now, w.run.empty() ? std::string("runs no round of the job")
                                          : fmt::format("runs another run of the job ({})", w.run));
    return false;
  }
  if (const int newest = std::max(w.last_round_epoch, w.round_epoch); newest < r.epoch) {
    // A host of the run left behind (one SIGSTOPped and resumed, a minority's): the job's
    // rounds went on elsewhere after this node's last (review s38 M3).
    next_recall_target(now, fmt::format("a stale host of the run (its newest round's epoch {}, this node's record's {})",
                                        newest, r.epoch));
    return false;
  }
  out_.push_back(cmd::Notice{fmt::format(
      "job '{}' runs on at {} (hosted by {}) since this node's agent last ran (run {}); joining it there as a new "
      "member",
      opts_.join.job_id, host_port(opts_.host, opts_.port), w.host_agent.empty() ? "a daemon" : w.host_agent, r.run)});
  recall_.reset();
  cancel(ClientTimer::kTakeover);
  return true;
}

ClientCommands ClientMachine::recall_ended(bool hosting, Clock::time_point now) {
  if (closed_ || recall_) return {};
  if (hosting) opts_.join.takeover_port = 0;  // it hosts the job: it offers no takeover
  deadline_ = now + milliseconds(opts_.join.join_timeout_ms);  // a fresh start's
  waiting_since_ = now;  // (the watchdog's join_timeout too: the recall's time is not the start's)
  refused_ = 0;
  try_connect();
  return take_out();
}

std::string ClientMachine::why_no_takeover_of_self() const {
  if (!last_) return {};
  std::size_t others = 0;
  for (const auto& c : takeover_candidates(*last_, {}, 0)) others += c.group_rank != last_->group_rank;
  return why_no_takeover(restarts_seen_, opts_.join.max_restarts, others, standbys_, opts_.join.min_nodes);
}

std::vector<std::pair<std::string, int>> ClientMachine::job_hosts() const {
  std::vector<std::pair<std::string, int>> out;
  if (host_agent_.empty() || !ever_welcomed_) return out;
  auto add = [&](const std::string& h, int p) {
    const std::pair<std::string, int> t{h, p};
    if (p > 0 && out.size() < kMaxRecallHosts && std::find(out.begin(), out.end(), t) == out.end()) out.push_back(t);
  };
  if (!takeover_ && !seek_ && !recall_) add(opts_.host, opts_.port);  // the server it is joined to
  for (const auto& [h, p] : job_hosts_) add(h, p);
  if (standby_ && standby_of_) {
    for (const auto& c : takeover_candidates(standby_of_->nodes, standby_of_->takeover_ports, {}, 0)) add(c.addr, c.port);
  } else if (last_) {
    for (const auto& c : takeover_candidates(*last_, {}, 0))
      if (c.group_rank != last_->group_rank) add(c.addr, c.port);
  }
  return out;
}

}  // namespace mg::rdzv
