// ClientMachine's rejoin (rendezvous/client_machine.h, #34): a node whose takeover search
// ended with no host while the machines answer waits to rejoin the job, trying its targets in
// turn; a server there of another run of the job id is passed over, and where nothing names
// this node's run any more it joins such a server afresh (review s38-late M1).
#include <algorithm>

#include <fmt/format.h>

#include "rendezvous/client_machine.h"

namespace mg::rdzv {

using std::chrono::milliseconds;

void ClientMachine::next_rejoin_target(Clock::time_point now) {
  Takeover& t = *takeover_;
  // The last host first (only cut off, it still hosts the job), then the nodes that could
  // have taken over, then the job's former hosts; never this node itself, which never hosts
  // on its own side.
  std::vector<std::pair<std::string, int>> targets{{t.lost_addr, t.lost_port}};
  for (const auto& c : t.candidates)
    if (c.group_rank != t.self_rank) targets.emplace_back(c.addr, c.port);
  for (const auto& h : job_hosts_)  // the endpoint (its host only cut off may host on), hosts lost since
    if (std::find(targets.begin(), targets.end(), h) == targets.end()) targets.push_back(h);
  const bool pass_done = t.turn > 0 && t.turn % targets.size() == 0;
  // Every target of the last full pass proved that it hosts no round of this node's run (a
  // Welcome of another run or none, a proven NotHosting of another run or none): the job goes
  // on as the run found (its agent was started again at the endpoint, and nobody took this
  // one over), joined afresh. Refusals and silence prove nothing (a REJECT firewall, a
  // partition: the run may go on beyond it), nor does a node of this run that hosts nothing:
  // the node keeps trying, and ends at the deadline, never joining afresh (review s39 H1).
  if (!t.other_host.empty() && pass_done && !t.pass_unsure) return try_fresh(now);
  if (pass_done) t.pass_unsure = false;
  if (now >= t.rejoin_deadline) {
    std::string reason = t.lost + "; no survivor could take over";
    if (!t.tried.empty()) reason += " (" + t.tried + ")";
    reason += fmt::format("; no host of the job answered this node within join_timeout ({} s)",
                          opts_.join.join_timeout_ms / 1000.0);
    if (!t.unproven.empty())
      reason += fmt::format(" (the server at {} is an older mglaunch: its Welcome names no run, so it cannot show that "
                            "it hosts this node's run, and a node rejoining does not join it; upgrade it)",
                            t.unproven);
    takeover_.reset();
    return end_host_lost(reason);
  }
  const auto& [host, port] = targets[t.turn++ % targets.size()];
  connect_candidate(host, port, now);
}

void ClientMachine::try_fresh(Clock::time_point now) {
  Takeover& t = *takeover_;
  t.fresh = true;
  t.pass_unsure = t.positive = t.refused = false;
  opts_.host = t.other_host;
  opts_.port = t.other_port;
  // One keep-alive interval, past the rejoin deadline too: a server that answered a moment ago.
  arm(ClientTimer::kTakeover, now + milliseconds(opts_.join.keep_alive_ms));
  refused_ = 0;
  try_connect();
}

bool ClientMachine::takeover_welcomed(const proto::Welcome& w, Clock::time_point now) {
  Takeover& t = *takeover_;
  const std::string& run = opts_.join.run;
  // This node's run, or a node told none (a server before #37): as before. A daemon that
  // knows no such job yet (restarted without a journal) takes the run its nodes name. A
  // server before Welcome's run whose job ran rounds (an older build's taker) is the job's
  // in the takeover search, as the recall takes it (review s39 M1): passed over, this node
  // could take over beside it.
  // Waiting to rejoin, such a server proves nothing: it may be the endpoint's agent started
  // again, running another run, and joined as the job's it would bypass the rule that a
  // rejoining node joins afresh only after a pass in which every target proved that it hosts
  // none of this node's run. Neither joined nor counted as such proof: the node keeps trying,
  // and at the rejoin deadline it ends (exit 3) naming it (review s39-late L4).
  const bool older_server_of_job = older_server_ran_rounds(w);
  if (!run.empty() && older_server_of_job && t.rejoining) {
    t.unproven = host_port(opts_.host, opts_.port);
    next_candidate({}, now);
    return false;
  }
  if (run.empty() || w.run == run || (w.run.empty() && w.host_agent.empty()) || older_server_of_job) return true;
  if (t.fresh) {
    join_fresh(now);
    return true;
  }
  // An agent's server of another run (or of none yet: its own join, which mints one, is yet
  // to come) would refuse this node's join of its run and end it (Job::join_of_other_run).
  t.positive = true;
  if (!w.run.empty()) {
    t.other_host = opts_.host;
    t.other_port = opts_.port;
  }
  const std::string said = w.run.empty() ? std::string("hosts no run of the job yet")
                                         : fmt::format("serves another run of the job id ({}, this node's {})", w.run, run);
  next_candidate(said, now);
  return false;
}

void ClientMachine::join_fresh(Clock::time_point now) {
  out_.push_back(cmd::Notice{fmt::format(
      "run {} of job '{}' runs at none of its hosts this node can reach, and {} at {} serves another run of the job "
      "id: this node joins it there as a fresh node (its last run's epoch and group rank left behind)",
      opts_.join.run, opts_.join.job_id, host_agent_.empty() ? std::string("a daemon") : host_agent_,
      host_port(opts_.host, opts_.port))});
  opts_.join.run.clear();
  opts_.join.epoch = 0;
  opts_.join.last_group_rank = -1;
  forget_voters();
  restarts_seen_ = 0;
  standby_ = false;  // a standby of the old run joins as a plain newcomer
  standby_of_.reset();
  // Nothing of the old run's rounds is kept (review s39 L2): a loss of the new server before
  // its first assignment never takes over, nor names survivors of, the old run's round, and
  // heartbeats carry no round of it. Its former hosts are not the new run's: the endpoint
  // (first) and the new server remain.
  last_.reset();
  current_.reset();
  pending_.reset();
  round_ = 0;
  const auto endpoint = job_hosts_.front();
  job_hosts_.assign({endpoint});
  if (std::pair{opts_.host, opts_.port} != endpoint) job_hosts_.emplace_back(opts_.host, opts_.port);
  deadline_ = now + milliseconds(opts_.join.join_timeout_ms);
  waiting_since_ = now;
}

}  // namespace mg::rdzv
