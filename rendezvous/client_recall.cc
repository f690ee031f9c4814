// ClientMachine's Recall (rendezvous/client_machine.h, #34 H1): an agent restarted on a node
// of a job looks for the job at the hosts its record names before it hosts a fresh job (or
// joins the endpoint), and job_hosts(), what that record names.
#include <algorithm>
#include <utility>

#include <fmt/format.h>

#include "rendezvous/client_machine.h"

#include "rendezvous/auth.h"

namespace mg::rdzv {

using std::chrono::milliseconds;

void ClientMachine::recall(std::vector<std::pair<std::string, int>> hosts, std::string run, Clock::time_point until,
                           int epoch, std::string record, int voters,
                           std::vector<std::pair<std::string, int>> voter_hosts, bool self_voter) {
  // This node's own takeover address, bound again, answers "recalling": never a target
  // (review s39-late H1).
  const std::pair<std::string, int> own{opts_.join.addr, opts_.join.takeover_port};
  auto not_a_target = [&](const auto& h) { return h.first.empty() || h.second <= 0 || h == own; };
  hosts.erase(std::remove_if(hosts.begin(), hosts.end(), not_a_target), hosts.end());
  voter_hosts.erase(std::remove_if(voter_hosts.begin(), voter_hosts.end(), not_a_target), voter_hosts.end());
  if (hosts.size() > kMaxRecallHosts) hosts.resize(kMaxRecallHosts);
  if (hosts.empty() || run.empty()) return;
  Recall r;
  r.targets = std::move(hosts);
  r.run = std::move(run);
  r.epoch = epoch;
  r.until = until;
  r.record = std::move(record);
  // (No voters' addresses, an older record: the every-host rule, never a majority of any answers.)
  r.voters = voter_hosts.empty() ? 0 : std::max(0, voters);
  r.voter_hosts = std::move(voter_hosts);
  r.self_voter = self_voter;
  r.endpoint_host = opts_.host;
  r.endpoint_port = opts_.port;
  recall_ = std::move(r);
}

void ClientMachine::start_recall(Clock::time_point now) {
  // The recall is part of the wait join_timeout bounds: it ends by then at the latest.
  recall_->until = std::min(recall_->until, now + milliseconds(opts_.join.join_timeout_ms));
  next_recall_target(now);
}

void ClientMachine::next_recall_target(Clock::time_point now, const std::string& why_previous, bool positive) {
  Recall& r = *recall_;
  if (!why_previous.empty()) {
    r.tried += fmt::format("{}{}: {}", r.tried.empty() ? "" : "; ", host_port(opts_.host, opts_.port), why_previous);
    r.all_positive = r.all_positive && positive;
    // Only a voter's answer counts toward the majority, each voter once a pass (review
    // s39-late H2): the endpoint and former hosts are no voters of the record's epoch.
    const std::pair<std::string, int> at{opts_.host, opts_.port};
    if (positive && std::find(r.voter_hosts.begin(), r.voter_hosts.end(), at) != r.voter_hosts.end() &&
        std::find(r.counted.begin(), r.counted.end(), at) == r.counted.end()) {
      r.counted.push_back(at);
      ++r.positives;
    }
  }
  drop_connection();
  cancel(ClientTimer::kTakeover);
  const bool pass_over = !r.pausing && r.turn > 0 && r.turn % r.targets.size() == 0;
  // A round after the record's epoch needs a majority of its voters (rdzv::Job): a strict
  // majority that is in no round of the run proves there is none. This node counts itself
  // only when it is one of those voters: a standby that registered after that round closed
  // is not, and counting itself could call a live job's record stale (review s40-recall M1).
  const long long self = r.self_voter ? 1 : 0;
  const bool majority = r.voters > 0 && 2 * (static_cast<long long>(r.positives) + self) > r.voters;
  if ((r.voters == 0 && pass_over && r.all_positive) || (!r.pausing && majority)) {
    // The job's run is over (a whole job stopped and rerun: every node answers so at once).
    // A fresh start, as without a record.
    out_.push_back(cmd::Notice{fmt::format(
        "this node's record of job '{}' (run {}, from its agent's last run) is stale: {} of that run ({}); starting "
        "as a fresh node of the job",
        opts_.join.job_id, r.run,
        r.voters > 0 ? fmt::format("a majority of its last round's {} voters ({}) answered that they run no round",
                                   r.voters,
                                   r.self_voter ? fmt::format("this node and {} more", r.positives)
                                                : fmt::format("{} of them; this node is none", r.positives))
                     : std::string("every host it names answered that it runs no host"),
        r.tried)});
    opts_.host = r.endpoint_host;
    opts_.port = r.endpoint_port;
    recall_.reset();
    out_.push_back(cmd::RecallEnded{});
    return;
  }
  if (now >= r.until && r.turn >= r.targets.size()) {  // (one pass at least)
    // Silence or refusals (a machine gone, a partition, a firewall that rejects) prove
    // nothing: the job may run on beyond them, and a fresh start here would fork it (review
    // s38 H1b). The node ends instead (exit 3), naming the record.
    const std::string& said = r.last.empty() ? r.tried : r.last;
    return lost(fmt::format(
        "this node has a record of job '{}' (run {}{}), and within join_timeout ({} s) not every host it names "
        "answered that the run is over ({}): the job may run on beyond a partition, so this node does not start it "
        "afresh. If the job is over, remove {} and start again",
        opts_.join.job_id, r.run, r.record.empty() ? std::string() : ", " + r.record, opts_.join.join_timeout_ms / 1000.0,
        said, r.record.empty() ? std::string("that record") : r.record));
  }
  if (pass_over) {
    // Not every host answered so: the next pass after a pause (a node of the run restarted
    // in a moment answers then, a survivor may host by then).
    r.pausing = true;
    r.last = std::exchange(r.tried, {});
    r.all_positive = true;
    r.positives = 0;
    r.counted.clear();
    arm(ClientTimer::kTakeover, std::min(r.until, now + std::min(milliseconds(500), milliseconds(opts_.join.keep_alive_ms))));
    return;
  }
  r.pausing = false;
  const auto& [host, port] = r.targets[r.turn++ % r.targets.size()];
  opts_.host = host;
  opts_.port = port;
  // A silent host is passed over after one keep-alive interval, at `until` at the latest, the
  // first pass's too (up to 1,024 silent hosts): the end past `until` names the record, not
  // the watchdog's (review s39 L5).
  arm(ClientTimer::kTakeover, std::min(r.until, now + milliseconds(opts_.join.keep_alive_ms)));
  refused_ = 0;
  try_connect();
}

bool ClientMachine::recall_welcomed(const proto::Welcome& w, Clock::time_point now) {
  Recall& r = *recall_;
  // A server before Welcome's run (review s38 L3): one that proved the key (or with no key
  // to prove) and ran rounds of the job is taken for the job's (the takeover search's rule).
  if (w.run != r.run && !older_server_ran_rounds(w)) {
    next_recall_target(now,
                       w.run.empty() ? std::string("runs no round of the job")
                                     : fmt::format("runs another run of the job ({})", w.run),
                       /*positive=*/true);
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
  out_.push_back(cmd::RecallWelcomed{r.run});
  recall_.reset();
  cancel(ClientTimer::kTakeover);
  return true;
}

void ClientMachine::not_hosting(const proto::Frame& f, Clock::time_point now) {
  proto::NotHosting n;
  try {
    n = proto::from_frame<proto::NotHosting>(f);
  } catch (const proto::ProtocolError& e) {
    return failed_attempt(fmt::format("bad message from {}: {}", host_port(opts_.host, opts_.port), e.what()), now);
  }
  // With a key, only an agent that holds it can say so (its proof over this connection's nonce).
  const bool proven = key_.empty() || auth::equal_ct(n.proof, auth::not_hosting_proof(key_, nonce_, n.run,
                                                                                    n.recalling ? n.epoch : -1));
  if (recall_) {
    if (!proven) return next_recall_target(now, "answered that it hosts nothing, without proving this job's key");
    if (n.job_id != opts_.join.job_id)
      return next_recall_target(now, fmt::format("alive, an agent of another job ('{}')", n.job_id), /*positive=*/true);
    if (n.run == recall_->run && n.recalling) {
      // Restarted too, looking for the run: in no round of it after its record's epoch. One
      // with a newer epoch was in a round this node's record does not know (review s39 H1).
      const bool newer = n.epoch > recall_->epoch;
      return next_recall_target(
          now, fmt::format("alive, restarted too, looking for that run (its record's epoch {}{})", n.epoch,
                           newer ? ", newer than this node's" : ""),
          /*positive=*/!newer);
    }
    if (n.run == recall_->run)  // a node of the run: the job may run on, hosted elsewhere
      return next_recall_target(now, "alive, a node of that run, not hosting it");
    return next_recall_target(
        now, n.run.empty() ? std::string("alive, not hosting, in no run yet")
                           : fmt::format("alive, not hosting, in another run ({})", n.run),
        /*positive=*/true);
  }
  // A takeover search passes over a node of another run, or of none (restarted, it will
  // never host this one: review s39-listen L1), at once.
  if (takeover_ && !takeover_->asking && !takeover_->rejoining && proven && n.job_id == opts_.join.job_id &&
      !opts_.join.run.empty() && n.run != opts_.join.run)
    return next_candidate(n.run.empty() ? std::string("alive, in no run")
                                        : fmt::format("alive, a node of another run ({})", n.run),
                          now);
  // Waiting to rejoin, a proven "not hosting" of another run or none is a positive answer
  // that this node's run is not there (the pass's proof for a fresh join, review s39 H1).
  // One of this node's own run is not: that node lives, the run may go on elsewhere.
  if (takeover_ && takeover_->rejoining && proven && n.run != opts_.join.run) {
    takeover_->positive = true;
    return next_candidate(n.job_id != opts_.join.job_id ? fmt::format("alive, an agent of another job ('{}')", n.job_id)
                          : n.run.empty()               ? std::string("alive, not hosting, in no run yet")
                                                        : fmt::format("alive, not hosting, in another run ({})", n.run),
                          now);
  }
  // Anywhere else it is what a takeover socket said before it listened (a refused connect):
  // alive, and not hosting yet (a candidate that has not noticed the loss is waited for).
  drop_connection();
  refused_connect(/*refused=*/true, "alive, not hosting", now);
}

ClientCommands ClientMachine::recall_ended(bool hosting, Clock::time_point now) {
  if (closed_ || recall_) return {};
  // It hosts the job: it offers no takeover, and its takeover socket, bound on, is its vote socket.
  if (hosting) opts_.join.vote_port = std::exchange(opts_.join.takeover_port, 0);
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

bool ClientMachine::job_self_voter() const {
  return std::find(voters_.begin(), voters_.end(), opts_.join.agent_id) != voters_.end();
}

int ClientMachine::job_voters() const {
  // The Job's own voter set of the epoch this node was last told (the Assignment's or the
  // Standby's list), never a count made up here (review s39-late M2). 0 where it lists none
  // (more than kMaxListedNodes voters, an older server, or none of that epoch): a recall then
  // keeps the every-host rule.
  if (host_agent_.empty() || !ever_welcomed_ || voters_epoch_ != opts_.join.epoch) return 0;
  // Their addresses are of their own epoch's message (review s40 L1), and a host older than
  // standby_nodes lists more voters than nodes but no standby's address: a majority of
  // voters not all named would count too few answers, so the every-host rule (review s40 L3).
  const auto [s, a] = voters_message();
  if ((s ? s->epoch : a ? a->epoch : -1) != voters_epoch_) return 0;
  const auto& nodes = s ? s->nodes : a->nodes;
  if (voters_.size() > nodes.size() && (s ? s->standby_nodes : a->standby_nodes).empty()) return 0;
  return static_cast<int>(voters_.size());
}

std::pair<const proto::Standby*, const proto::Assignment*> ClientMachine::voters_message() const {
  const proto::Standby* s = standby_ && standby_of_ ? &*standby_of_ : nullptr;
  // A Standby of an older epoch than the Assignment's voters (a host that missed that round),
  // or one that lists no nodes (a taker's before its round, of the seed's epoch: review s41-b
  // L4): the Assignment's addresses go with those voters (review s40 L1), of the same run only
  // (another run's epochs count from 1 again: review s41-b L6).
  if (s && (s->epoch != voters_epoch_ || s->nodes.empty()) && last_ && last_->epoch == voters_epoch_ &&
      last_->run == s->run)
    s = nullptr;
  return {s, s || !last_ ? nullptr : &*last_};
}

std::vector<std::pair<std::string, int>> ClientMachine::voter_addresses(bool with_self) const {
  std::vector<std::pair<std::string, int>> out;
  if (host_agent_.empty() || !ever_welcomed_) return out;
  const auto [s, a] = voters_message();
  if (!s && !a) return out;
  for (const auto& c : takeover_candidates(s ? s->nodes : a->nodes, s ? s->takeover_ports : a->takeover_ports, {}, 0))
    if (with_self || !a || c.group_rank != a->group_rank) out.emplace_back(c.addr, c.port);
  // The standbys among the voters too: a whole rerun with as many standbys as nodes has no
  // majority without their answers (review s39-late M1).
  const std::pair<std::string, int> own{opts_.join.addr, opts_.join.takeover_port};
  for (const auto& c : takeover_candidates(s ? s->standby_nodes : a->standby_nodes,
                                           s ? s->standby_takeover_ports : a->standby_takeover_ports, {}, 0))
    if (with_self || std::pair{c.addr, c.port} != own) out.emplace_back(c.addr, c.port);
  // The host's vote socket (review s40-recall M1): never in the takeover lists above.
  const std::pair<std::string, int> host_vote{s ? s->host_vote_addr : a->host_vote_addr,
                                              s ? s->host_vote_port : a->host_vote_port};
  const std::pair<std::string, int> own_vote{opts_.join.addr, opts_.join.vote_port};
  if (!host_vote.first.empty() && host_vote.second > 0 && (with_self || host_vote != own_vote))
    out.push_back(host_vote);
  return out;
}

std::vector<std::pair<std::string, int>> ClientMachine::job_voter_hosts() const {
  std::vector<std::pair<std::string, int>> out;
  for (auto& t : voter_addresses(/*with_self=*/true))
    if (t.second > 0 && out.size() < kMaxRecallHosts && std::find(out.begin(), out.end(), t) == out.end())
      out.push_back(std::move(t));
  return out;
}

ClientMachine ClientMachine::own_server_welcomed() const {
  ClientMachine m = *this;
  // Its own server sent the frame, so it has sent its Welcome too, which this client may not
  // have read yet (a tokenless Join goes with the Hello): host = this agent (review s41-e M1).
  if (!m.ever_welcomed_) {
    m.host_agent_ = opts_.join.agent_id;
    m.ever_welcomed_ = true;
  }
  return m;
}

RecordFields ClientMachine::record_after(const proto::Assignment& a) const {
  ClientMachine m = own_server_welcomed();  // (a copy: nothing of this node's state changes)
  m.take(a, Clock::time_point{});
  return {m.job_hosts(), m.job_voters(), m.job_voters_epoch(), m.job_self_voter(), m.job_voter_hosts(), m.job_epoch()};
}

RecordFields ClientMachine::record_after(const proto::Standby& s) const {
  ClientMachine m = own_server_welcomed();
  m.take_standby(s);
  return {m.job_hosts(), m.job_voters(), m.job_voters_epoch(), m.job_self_voter(), m.job_voter_hosts(), m.job_epoch()};
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
  for (const auto& [h, p] : voter_addresses(/*with_self=*/false)) add(h, p);
  return out;
}

}  // namespace mg::rdzv
