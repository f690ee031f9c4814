#include "rendezvous/job.h"

#include <algorithm>
#include <tuple>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>

namespace mg::rdzv {

using namespace std::chrono;

JobEvent& Job::emit(JobEvent::Kind kind, const proto::Join* n) {
  if (events_.size() >= kMaxPendingEvents)  // nobody takes them: the older half goes (amortized O(1))
    events_.erase(events_.begin(), events_.begin() + static_cast<std::ptrdiff_t>(kMaxPendingEvents / 2));
  JobEvent& e = events_.emplace_back();
  e.kind = kind;
  e.job = id_;
  e.round = round_;
  e.restart_count = restart_count_;
  e.max_restarts = config_.max_restarts;
  if (!run_open_) {  // a run not settled is not journaled (review s38-late M2)
    e.run = run_;
    e.epoch = epoch_;
  }
  if (n) {
    e.host = n->host;
    e.addr = n->addr;
    e.agent = n->agent_id;
  }
  return e;
}

Actions Job::broadcast(const proto::Wire& f, SessionId except) const {
  Actions out;
  out.reserve(members_.size() + joined_.size() + standby_.size());
  for (const auto& [s, n] : members_)
    if (s != except) out.push_back({s, f});
  for (const auto& [s, n] : joined_)
    if (s != except && !members_.contains(s)) out.push_back({s, f});
  for (const auto& [s, n] : standby_)
    if (s != except) out.push_back({s, f});
  return out;
}

SessionId Job::host_agent_session() const {
  if (host_agent_id_.empty()) return 0;
  for (const auto* nodes : {&members_, &joined_, &standby_})
    for (const auto& [s, n] : *nodes)
      if (n.join.agent_id == host_agent_id_) return s;
  return 0;
}

Actions Job::make_standby(SessionId s, const proto::Join& j, Clock::time_point now) {
  if (standby_.size() >= static_cast<std::size_t>(proto::kMaxNodes))
    return {{s, proto::to_wire(proto::Error{fmt::format("job '{}' is full ({} nodes) and has {} standbys already", id_,
                                                         config_.max_nodes, standby_.size())})}};
  standby_[s] = {j, now};
  const auto position = static_cast<int>(std::distance(standby_.begin(), standby_.find(s))) + 1;
  emit(JobEvent::Kind::kStandby, &j).position = position;
  Actions out{{s, proto::StandbyEncoder(standby_fields())(position)}};
  auto told = tell_standby_count();
  out.insert(out.end(), told.begin(), told.end());
  return out;
}

proto::Standby Job::standby_fields() const {
  proto::Standby m;
  m.active_nodes = static_cast<int>(state_ == State::kRunning ? std::max(members_.size(), expected_members_)
                                                               : joined_.size() + rejoining_.size());
  m.round = round_;
  m.restart_count = restart_count_;
  m.nodes = round_nodes_;
  m.takeover_ports = round_ports_;
  m.standby_nodes = round_standby_nodes_;
  m.standby_takeover_ports = round_standby_ports_;
  std::tie(m.host_vote_addr, m.host_vote_port) = round_host_vote_;
  // The last round's epoch and voters. After take_over() epoch_ is a value no round had (its
  // first is one more) while voters_ are the seed's: a standby told that pair would report
  // the seed's voters as a newer epoch's, and a host it joins later would adopt them
  // (adopt_voters()) and count a stale majority (#34).
  m.epoch = last_round_epoch_;
  m.voters = voters_;
  m.run = run_;
  return m;
}

Actions Job::tell_standby_count() const {
  if (state_ != State::kRunning) return {};  // the next assignment carries it
  const auto w = proto::to_wire(proto::Heartbeat{round_, static_cast<int>(standby_.size())});
  Actions out;
  out.reserve(members_.size());
  for (const auto& [s, n] : members_) out.push_back({s, w});
  return out;
}

Actions Job::promote_standbys(Clock::time_point now) {
  const auto max = static_cast<std::size_t>(config_.max_nodes);
  const auto reserved = static_cast<std::size_t>(takeover_ ? takeover_reserved_ : 0);
  while (!standby_.empty() && joined_.size() + rejoining_.size() + reserved < max) {
    auto promoted = joined_.insert(standby_.extract(standby_.begin())).position;
    emit(JobEvent::Kind::kPromoted, &promoted->second.join).replaces = lost_host_;
  }
  const int n = static_cast<int>(joined_.size());
  if (n >= config_.max_nodes) return close_round(now);
  if (n >= config_.min_nodes && !last_call_deadline_) last_call_deadline_ = now + milliseconds(config_.last_call_ms);
  return {};
}

template <class Nodes>
void Job::keep_places(Nodes& nodes) const {
  if (placed_.empty()) return;
  const std::size_t n = nodes.size();
  std::vector<std::pair<int, std::size_t>> kept;  // (group rank in the last round, index)
  std::vector<std::size_t> others;                 // standbys and newcomers, in first-round order
  for (std::size_t i = 0; i < n; ++i) {
    auto p = placed_.find(nodes[i].second.join.agent_id);
    if (p != placed_.end()) kept.emplace_back(p->second, i);
    else others.push_back(i);
  }
  if (kept.empty()) return;
  std::sort(kept.begin(), kept.end());
  bool exact = kept.back().first >= 0 && static_cast<std::size_t>(kept.back().first) < n && kept.front().first >= 0;
  for (std::size_t k = 1; exact && k < kept.size(); ++k) exact = kept[k].first != kept[k - 1].first;
  std::vector<std::size_t> order(n, SIZE_MAX);
  if (exact) {  // every node that stays keeps its group rank
    for (auto [rank, i] : kept) order[static_cast<std::size_t>(rank)] = i;
  } else {  // the round shrank below a kept rank: the nodes that stay close up, in order
    for (std::size_t k = 0; k < kept.size(); ++k) order[k] = kept[k].second;
  }
  std::size_t next = 0;
  for (auto& slot : order)
    if (slot == SIZE_MAX) slot = others[next++];
  Nodes placed;
  placed.reserve(n);
  for (auto i : order) placed.push_back(std::move(nodes[i]));
  nodes = std::move(placed);
}

Actions Job::join(SessionId s, const proto::Join& j, Clock::time_point now) {
  // A node of another run of this job id (other_run()): join_of_other_run().
  if (other_run(j))
    if (auto out = join_of_other_run(s, j, now)) return std::move(*out);
  // The voters a join brings count (adopt_voters()); they never stay with its node (a
  // thousand nodes' lists would be megabytes).
  if (!j.voters.empty()) {
    if (configured_ && !finished() && j.min_nodes == config_.min_nodes && j.max_nodes == config_.max_nodes)
      adopt_voters(j);
    proto::Join bare = j;
    bare.voters.clear();
    return join(s, bare, now);
  }
  last_activity_ = now;
  // A node re-registering a round that ended while it was away hears how it ended.
  if (j.resume_round > 0 && j.resume_round == round_) {
    if (state_ == State::kFailed && abort_) return {{s, proto::to_wire(*abort_)}};
    if (state_ == State::kDone) return {{s, proto::to_wire(proto::Done{})}};
    if (state_ == State::kRestarting) return {{s, proto::to_wire(proto::Restart{restart_count_, restart_reason_})}};
  }
  if (finished())
    return {{s, proto::to_wire(proto::Error{fmt::format("job '{}' has already finished; use a new --rdzv_id", id_)})}};
  if (standby_.contains(s)) return {};
  if (!configured_) {
    config_ = j;
    configured_ = true;
    first_join_ = now;
    auto& e = emit(JobEvent::Kind::kCreated, &j);
    e.min_nodes = j.min_nodes;
    e.max_nodes = j.max_nodes;
    e.max_restarts = j.max_restarts;
    if (j.resume_round > 0) {
      e.how = "re-registered";
      e.round = j.resume_round;
    }
  } else if (j.min_nodes != config_.min_nodes || j.max_nodes != config_.max_nodes) {
    return {{s, proto::to_wire(proto::Error{fmt::format("job '{}' runs with --nnodes={}:{}, this node asked for {}:{}",
                                                         id_, config_.min_nodes, config_.max_nodes, j.min_nodes,
                                                         j.max_nodes)})}};
  }
  if (j.resume_round > 0) {
    if (auto back = resume_after_outage(s, j, now)) return std::move(*back);
    if (auto held = hold_other_run(s, j, now)) return std::move(*held);
    Actions dropped = newer_than_rebuild(j) ? drop_rebuild(j) : Actions{};
    // A restarted server where a new node (a replacement, started meanwhile) joined before
    // the running round's nodes came back: their round wins, the new node waits as its
    // standby (else every survivor was refused and the job wedged until join_timeout).
    // A claim that would end the job at once (resume_done) is refused as before.
    std::vector<std::pair<SessionId, Node>> waiting;
    if (!j.resume_done && members_.empty() && state_ == State::kJoining && round_ == 0 && !joined_.contains(s))
      while (!joined_.empty()) {
        auto h = joined_.extract(joined_.begin());
        waiting.emplace_back(h.key(), std::move(h.mapped()));
      }
    if (auto bad = check_resume(s, j); !bad.empty()) {
      for (auto& w : waiting) joined_.insert(std::move(w));  // they wait on as before
      return {{s, proto::to_wire(proto::Error{fmt::format("job '{}': re-registration refused: {}", id_, bad)})}};
    }
    if (!waiting.empty()) last_call_deadline_.reset();
    // A restarted server learns the running round back from its nodes.
    if (members_.empty()) {
      placed_.clear();
      round_ = j.resume_round;
      restart_count_ = j.resume_restart_count;
      rebuild_run(j);
      expected_members_ = static_cast<std::size_t>(std::max(1, j.resume_group_world_size));
      rebuilding_ = true;
      rebuild_since_ = now;
    } else if (run_open_ && !j.run.empty()) {
      rebuild_run(j);  // a rebuild that claimed no run takes the first run named
    }
    joined_.erase(s);
    members_[s] = {j, now, j.resume_done};
    placed_[j.agent_id] = j.resume_group_rank;
    emit(JobEvent::Kind::kJoined, &j).how = "re-registered";
    if (members_.size() >= expected_members_) rebuilding_ = false;
    state_ = State::kRunning;
    Actions out = maybe_done();
    out.insert(out.begin(), dropped.begin(), dropped.end());
    for (auto& [ws, wn] : waiting) {
      auto told = make_standby(ws, wn.join, now);
      out.insert(out.end(), told.begin(), told.end());
    }
    return out;
  }
  // A standby re-registering with a restarted server waits for the round its nodes rebuild
  // (or, if none of them comes back within join_timeout, hears that the job failed: tick).
  if (j.resume_standby && state_ == State::kJoining && round_ == 0 && joined_.empty()) return make_standby(s, j, now);
  if (takeover_ && state_ == State::kRestarting && !joined_.contains(s)) {
    // The job taken over after its host's loss: a standby that followed takes a place the
    // survivors leave free at once; a survivor keeps its group rank.
    if (j.resume_standby) {
      Actions out = make_standby(s, j, now);
      auto more = promote_standbys(now);
      out.insert(out.end(), more.begin(), more.end());
      return out;
    }
    // A survivor's claim takes its kept place once; a newcomer (no rank of the seed's round)
    // or a second claim of a rank already placed is taken as a newcomer's join.
    const int r = j.last_group_rank;
    const bool in_round = r >= 0 && (takeover_->world_size <= 0 || r < takeover_->world_size);
    const auto mine = placed_.find(j.agent_id);
    const bool again = mine != placed_.end() && mine->second == r;  // the same survivor, a new session
    const bool taken = std::any_of(placed_.begin(), placed_.end(), [&](const auto& p) { return p.second == r; });
    if (in_round && !taken) {
      takeover_reserved_ = std::max(0, takeover_reserved_ - 1);
      placed_[j.agent_id] = r;
    } else if (!again) {
      placed_.erase(j.agent_id);
    }
  }
  if (state_ == State::kRunning) {
    if (members_.contains(s)) return {};
    // A full round (or one being rebuilt to its size) takes the newcomer as a standby.
    if (std::max(members_.size(), expected_members_) >= static_cast<std::size_t>(config_.max_nodes))
      return make_standby(s, j, now);
    // Scale up: everybody re-joins a new round with the newcomer; no restart is spent.
    joined_[s] = {j, now};
    emit(JobEvent::Kind::kJoined, &j).how = "new";
    state_ = State::kRestarting;
    {
      auto& e = emit(JobEvent::Kind::kRestart, &j);
      e.cause = "scale-up";
      e.why = "a node joined: scaling up";
    }
    Actions out;
    const auto restart = proto::to_wire(proto::Restart{restart_count_, "a node joined: scaling up"});
    rejoining_.clear();
    for (const auto& [m, n] : members_) {
      out.push_back({m, restart});
      rejoining_.emplace(m, n);
    }
    members_.clear();
    last_call_deadline_.reset();
    return out;
  }
  if (state_ == State::kRestarting || state_ == State::kJoining) {
    // The places of the nodes told to restart are theirs: a newcomer beyond them waits.
    // So are the places kept for a taken-over job's survivors (a survivor's own was freed above).
    const auto kept = static_cast<std::size_t>(takeover_ ? takeover_reserved_ : 0);
    const bool survivor = rejoining_.erase(s) > 0;
    if (!survivor && !joined_.contains(s) &&
        joined_.size() + rejoining_.size() + kept >= static_cast<std::size_t>(config_.max_nodes))
      return make_standby(s, j, now);
    if (joined_.empty()) first_join_ = now;
    if (!joined_.contains(s))
      emit(JobEvent::Kind::kJoined, &j).how = survivor || (takeover_ && j.last_group_rank >= 0) ? "survivor" : "new";
    joined_[s] = {j, now};
    const int n = static_cast<int>(joined_.size());
    if (n >= config_.max_nodes) return close_round(now);
    if (n >= config_.min_nodes && !last_call_deadline_) last_call_deadline_ = now + milliseconds(config_.last_call_ms);
  }
  return {};
}

Actions Job::fail_job(const proto::WorkerFailed& root_cause, const std::string& reason, bool final) {
  state_ = State::kFailed;
  {
    auto& e = emit(JobEvent::Kind::kFailed);
    e.host = root_cause.host;
    e.rank = root_cause.rank;
    e.exit_code = root_cause.exit_code;
    e.why = reason;
  }
  abort_ = proto::Abort{root_cause, reason, final};
  auto out = broadcast(proto::to_wire(*abort_));  // every member, waiting node and standby
  members_.clear();
  joined_.clear();
  standby_.clear();
  rejoining_.clear();
  return out;
}

std::optional<Actions> Job::resume_after_outage(SessionId s, const proto::Join& j, Clock::time_point now) {
  // A restarted server rebuilds its round from these (check_resume decides).
  if ((state_ == State::kJoining && round_ == 0) || rebuilding_) return std::nullopt;
  if (state_ == State::kRunning && j.resume_round == round_ && j.resume_restart_count == restart_count_) {
    // A node of the running round whose connection was lost (an outage of its own, the
    // server never restarted) re-registers: its new session takes the old one's place and its
    // workers go on. Only a node of the round (its agent id) may; others are refused below.
    auto old = std::find_if(members_.begin(), members_.end(),
                            [&](const auto& m) { return m.first != s && m.second.join.agent_id == j.agent_id; });
    if (old == members_.end()) return std::nullopt;
    Node n = std::move(old->second);
    members_.erase(old);
    n.last_seen = now;
    n.done = n.done || j.resume_done;
    emit(JobEvent::Kind::kJoined, &n.join).how = "reconnected";
    members_[s] = std::move(n);
    return maybe_done();
  }
  if (std::pair(j.resume_restart_count, j.resume_round) < std::pair(restart_count_, round_)) {
    // The job went on without this node (it was cut off, or away long enough to be dropped):
    // its round is over. It stops its workers (if it has not fenced them already) and joins
    // again, as a newcomer: in the next round or as a standby (#34). Never an Error that
    // ends the node while its workers run on.
    return Actions{{s, proto::to_wire(proto::Restart{
                           restart_count_, fmt::format("round {} of job '{}' went on without this node (it is at round "
                                                       "{}, restart {}): stop and join again",
                                                       j.resume_round, id_, round_, restart_count_)})}};
  }
  return std::nullopt;
}

std::string Job::check_resume(SessionId s, const proto::Join& j) const {
  if (!joined_.empty()) return "other nodes are waiting for a new round";
  if (members_.empty()) {
    if (state_ != State::kJoining || round_ != 0) return "the job is not being rebuilt";
    if (j.resume_group_world_size < 1 || j.resume_group_rank < 0 || j.resume_group_rank >= j.resume_group_world_size)
      return "the claimed group rank or size is out of range";
    // An agent's server never restarts: no round of another run is rebuilt in its job; a
    // daemon's job whose run it kept (--state-dir) rebuilds none of an older run.
    if (resume_of_other_run(j)) return fmt::format("its run {} is not this job's ({})", j.run, run_);
    return {};
  }
  if (!rebuilding_ || state_ != State::kRunning) return "the job is not being rebuilt";
  if (other_run(j)) return fmt::format("its run {} is not the rebuilt round's ({})", j.run, run_);
  if (members_.contains(s)) return "this connection is already registered";
  if (j.resume_round != round_ || j.resume_restart_count != restart_count_ ||
      static_cast<std::size_t>(j.resume_group_world_size) != expected_members_)
    return fmt::format("round {} restart {} of {} nodes does not match the job's round {} restart {} of {} nodes",
                       j.resume_round, j.resume_restart_count, j.resume_group_world_size, round_, restart_count_,
                       expected_members_);
  for (const auto& [id, n] : members_) {
    if (n.join.resume_group_rank == j.resume_group_rank) return fmt::format("group rank {} is taken", j.resume_group_rank);
    if (n.join.agent_id == j.agent_id) return fmt::format("agent '{}' is registered already", j.agent_id);
  }
  return {};
}

nlohmann::json Job::describe(Clock::time_point now) const {
  static constexpr const char* kStates[] = {"joining", "running", "restarting", "done", "failed"};
  nlohmann::json nodes = nlohmann::json::array();
  auto add = [&](const Node& n, const char* status) {
    if (nodes.size() >= proto::kMaxListedNodes) return;
    nodes.push_back({{"host", n.join.host},
                     {"addr", n.join.addr},
                     {"nproc", n.join.nproc},
                     {"status", n.done ? "done" : status},
                     {"last_seen_ms", duration_cast<milliseconds>(now - n.last_seen).count()}});
  };
  for (const auto& [s, n] : members_) add(n, "running");
  for (const auto& [s, n] : joined_)
    if (!members_.contains(s)) add(n, "waiting");
  for (const auto& [s, n] : standby_) add(n, "standby");
  nlohmann::json j = {{"id", id_},
                      {"state", kStates[static_cast<int>(state_)]},
                      {"round", round_},
                      {"restart_count", restart_count_},
                      {"max_restarts", config_.max_restarts},
                      {"min_nodes", config_.min_nodes},
                      {"max_nodes", config_.max_nodes},
                      {"standby_nodes", standby_.size()},
                      {"nodes", nodes}};
  if (abort_) j["root_cause"] = abort_->reason;
  return j;
}

std::size_t Job::approx_bytes() const {
  std::size_t bytes = sizeof(Job) + id_.size();
  for (const auto* m : {&joined_, &members_, &standby_, &rejoining_, &held_})
    for (const auto& [s, n] : *m)
      bytes += sizeof(Node) + 64 + n.join.job_id.size() + n.join.agent_id.size() + n.join.host.size() + n.join.addr.size();
  for (const auto& [agent, rank] : placed_) bytes += 64 + agent.size();
  for (const auto* l : {&round_nodes_, &round_standby_nodes_})
    for (const auto& n : *l) bytes += 40 + n.size();
  return bytes;
}

Actions Job::close_round(Clock::time_point now) {
  if (const auto short_of = short_of_majority()) {
    if (!quorum_told_) {  // once per round waited for; the join_timeout's root cause says it again
      quorum_told_ = true;
      auto& e = emit(JobEvent::Kind::kNoQuorum);
      e.nodes = short_of->present;
      e.voters = short_of->voters;
      e.previous_voters = short_of->previous;
    }
    return {};
  }
  // Nodes are moved, not copied: at 100,000 nodes a copy of the round is ~25 MB.
  std::vector<std::pair<SessionId, Node>> nodes;
  nodes.reserve(joined_.size());
  while (!joined_.empty()) {
    auto h = joined_.extract(joined_.begin());
    nodes.emplace_back(h.key(), std::move(h.mapped()));
  }
  // Explicit --node_rank first, then by (address, agent id): the same on every run.
  std::sort(nodes.begin(), nodes.end(), [](const auto& a, const auto& b) {
    const auto& x = a.second.join;
    const auto& y = b.second.join;
    const int rx = x.node_rank < 0 ? INT32_MAX : x.node_rank, ry = y.node_rank < 0 ? INT32_MAX : y.node_rank;
    return std::tie(rx, x.addr, x.agent_id) < std::tie(ry, y.addr, y.agent_id);
  });
  Actions out;
  out.reserve(nodes.size());
  if (static_cast<int>(nodes.size()) > config_.max_nodes) {
    const auto full = proto::to_wire(proto::Error{fmt::format("job '{}' is full ({} nodes)", id_, config_.max_nodes)});
    for (auto i = static_cast<std::size_t>(config_.max_nodes); i < nodes.size(); ++i) out.push_back({nodes[i].first, full});
    nodes.resize(static_cast<std::size_t>(config_.max_nodes));
  }
  // Every rank must fit RANK's 32 bits (#23 D9): the nodes that would push the world past
  // 2^31-1 ranks are refused like those of a full job (overflow-safe sum).
  {
    long long ranks = 0;
    std::size_t fit = 0;
    while (fit < nodes.size() && ranks + nodes[fit].second.join.nproc <= INT32_MAX)
      ranks += nodes[fit++].second.join.nproc;
    if (fit < nodes.size()) {
      const auto too_many = proto::to_wire(proto::Error{fmt::format(
          "job '{}' would have more than {} ranks (2^31-1) with this node; use fewer workers per node", id_, INT32_MAX)});
      for (auto i = fit; i < nodes.size(); ++i) out.push_back({nodes[i].first, too_many});
      nodes.resize(fit);
    }
  }
  if (run_open_) settle_run(nodes);
  keep_places(nodes);
  ++round_;
  // The epoch: one more than any this job or a joining node has seen (a node that took the
  // job over learns the highest from its survivors' joins).
  for (const auto& [s, n] : nodes) learn_epoch(n.join);
  if (epoch_ < INT32_MAX) ++epoch_;
  last_round_epoch_ = epoch_;
  quorum_told_ = took_over_ = voters_host_closed_ = false;
  proto::Assignment a;
  a.epoch = epoch_;
  a.run = run_;
  a.round = round_;
  a.group_world_size = static_cast<int>(nodes.size());
  a.restart_count = restart_count_;
  a.master_addr = nodes.front().second.join.addr;
  a.master_port = nodes.front().second.join.master_port;
  a.world_size = 0;
  a.standbys = static_cast<int>(standby_.size());
  round_nodes_.clear();
  round_ports_.clear();
  for (const auto& [s, n] : nodes) {
    // The node list rides along for jobs up to kMaxListedNodes (10,000 nodes would make
    // every assignment 120 KB and the round 1.2 GB). It is encoded once for every node.
    if (nodes.size() <= proto::kMaxListedNodes) {
      a.nodes.push_back(n.join.addr);
      a.takeover_ports.push_back(n.join.takeover_port);
      round_nodes_.push_back(n.join.addr);
      round_ports_.push_back(n.join.takeover_port);
    }
    a.world_size += n.join.nproc;
  }
  // The voters of this epoch: its nodes, then the standbys registered now (not listed past
  // kMaxListedNodes: no majority is counted for such a job). The last epoch's stay counted
  // beside them for the next round (joint majority, has_quorum()).
  prev_voters_ = adopted_voters_.empty() ? std::move(voters_) : std::move(adopted_voters_);
  voters_.clear();
  adopted_voters_.clear();
  adopted_epoch_ = 0;
  round_standby_nodes_.clear();
  round_standby_ports_.clear();
  round_host_vote_ = {};
  // The host's vote socket: counted in a recall, never a takeover candidate (review s40-recall M1);
  // only this server's own agent's (a former host keeps a dead one: review s41-b M1).
  auto vote = [&](const proto::Join& j) {
    voters_.push_back(j.agent_id);
    if (j.takeover_port == 0 && j.vote_port > 0 && !host_agent_id_.empty() && j.agent_id == host_agent_id_)
      round_host_vote_ = {j.addr, j.vote_port};
  };
  if (nodes.size() + standby_.size() <= proto::kMaxListedNodes) {
    for (const auto& [s, n] : nodes) vote(n.join);
    for (const auto& [s, n] : standby_) {  // (with their takeover addresses: review s39-late M1)
      vote(n.join);
      round_standby_nodes_.push_back(n.join.addr);
      round_standby_ports_.push_back(n.join.takeover_port);
    }
  }
  a.voters = voters_;
  a.standby_nodes = round_standby_nodes_;
  a.standby_takeover_ports = round_standby_ports_;
  std::tie(a.host_vote_addr, a.host_vote_port) = round_host_vote_;
  {
    auto& e = emit(JobEvent::Kind::kRoundStarted);
    e.nodes = a.group_world_size;
    e.world_size = a.world_size;
    for (std::size_t i = 0; i < nodes.size() && i < JobEvent::kListedMembers; ++i)
      e.members.emplace_back(nodes[i].second.join.host, nodes[i].second.join.addr);
  }
  const proto::AssignmentEncoder assignment(a);
  members_.clear();
  placed_.clear();
  rejoining_.clear();  // one that comes back after the last call finds the round closed
  int offset = 0;
  for (std::size_t i = 0; i < nodes.size(); ++i) {
    auto& [s, n] = nodes[i];
    out.push_back({s, assignment(static_cast<int>(i), offset)});
    offset += n.join.nproc;
    n.last_seen = now;
    placed_[n.join.agent_id] = static_cast<int>(i);
    members_.emplace_hint(members_.end(), s, std::move(n));
  }
  last_call_deadline_.reset();
  takeover_.reset();
  takeover_reserved_ = 0;
  expected_members_ = members_.size();
  rebuilding_ = false;
  state_ = State::kRunning;
  // The standbys left out hold the new round's takeover candidates (encoded once).
  if (!standby_.empty()) {
    const proto::StandbyEncoder told(standby_fields());
    int position = 0;
    for (const auto& [s, n] : standby_) out.push_back({s, told(++position)});
  }
  return out;
}

Actions Job::heartbeat(SessionId s, Clock::time_point now) {
  last_activity_ = now;
  if (auto it = members_.find(s); it != members_.end()) it->second.last_seen = now;
  if (auto it = joined_.find(s); it != joined_.end()) it->second.last_seen = now;
  if (auto it = standby_.find(s); it != standby_.end()) it->second.last_seen = now;
  if (auto it = rejoining_.find(s); it != rejoining_.end()) it->second.last_seen = now;
  return {};
}

Actions Job::fail_or_restart(const proto::WorkerFailed& root_cause, const std::string& reason, SessionId lost,
                             Clock::time_point now) {
  members_.erase(lost);
  joined_.erase(lost);
  const std::size_t survivors = members_.size();
  if (restart_count_ < config_.max_restarts && survivors + standby_.size() >= 1) {
    ++restart_count_;
    state_ = State::kRestarting;
    restart_reason_ = reason;
    restart_host_ = root_cause.host;
    const bool node_lost = lost != 0 || root_cause.rank < 0;
    lost_host_ = node_lost ? root_cause.host : std::string();
    first_join_ = now;
    {
      auto& e = emit(JobEvent::Kind::kRestart);
      e.host = root_cause.host;
      e.cause = node_lost ? "node lost" : "worker failed";
      e.why = reason;
    }
    Actions out;
    const auto restart = proto::to_wire(proto::Restart{restart_count_, reason});
    rejoining_.clear();
    for (const auto& [s, n] : members_) {
      out.push_back({s, restart});
      rejoining_.emplace(s, n);
    }
    members_.clear();
    last_call_deadline_.reset();
    // The places the survivors leave free go to standbys now, not after a join wait.
    auto more = promote_standbys(now);
    out.insert(out.end(), more.begin(), more.end());
    return out;
  }
  return fail_job(root_cause, reason);
}

std::string failed_who(const proto::WorkerFailed& f) {
  return f.rank >= 0 ? fmt::format("rank {} on {}", f.rank, f.host) : fmt::format("node {}", f.host);
}

std::string failure_text(const proto::WorkerFailed& f) {
  if (f.rank < 0 && !f.message.empty()) return fmt::format("{} (exit code {})", f.message, f.exit_code);
  return fmt::format("{} exited with {}", failed_who(f), f.exit_code);
}

Actions Job::worker_failed(SessionId s, const proto::WorkerFailed& f, Clock::time_point now) {
  last_activity_ = now;
  if (state_ != State::kRunning || !members_.contains(s) || f.round != round_) return {};
  const std::string reason = failure_text(f);
  {
    auto& e = emit(JobEvent::Kind::kWorkerFailed, &members_.at(s).join);
    e.rank = f.rank;
    e.exit_code = f.exit_code;
    e.signal = f.signal;
    e.why = proto::truncate_text(f.message, 500);
  }
  // The failing node stays a member: it re-joins (or aborts) like the others.
  return fail_or_restart(f, reason, 0, now);
}

Actions Job::node_done(SessionId s, int round, Clock::time_point now) {
  last_activity_ = now;
  auto it = members_.find(s);
  if (state_ != State::kRunning || it == members_.end() || round != round_) return {};
  it->second.done = true;
  return maybe_done();
}

Actions Job::maybe_done() {
  if (members_.size() < expected_members_ ||
      !std::all_of(members_.begin(), members_.end(), [](const auto& m) { return m.second.done; }))
    return {};
  state_ = State::kDone;
  emit(JobEvent::Kind::kDone).nodes = static_cast<int>(members_.size());
  auto out = broadcast(proto::to_wire(proto::Done{}));
  members_.clear();
  standby_.clear();
  return out;
}

Actions Job::disconnected(SessionId s, Clock::time_point now, std::string_view why) {
  last_activity_ = now;
  if (auto sb = standby_.find(s); sb != standby_.end()) {
    if (!finished()) emit(JobEvent::Kind::kStandbyLost, &sb->second.join).why = why;
    standby_.erase(sb);
    return tell_standby_count();
  }
  if (auto w = joined_.find(s); w != joined_.end() && !members_.contains(s) && !finished()) {
    auto& e = emit(JobEvent::Kind::kNodeLost, &w->second.join);
    e.cause = "connection closed";
    e.why = fmt::format("{}, waiting for round {}", why, round_ + 1);
  }
  // A node told to restart is lost too when its connection closes before it re-joined: an
  // event, as when it goes silent (drop_silent_rejoining), since it counted for
  // hears_majority() and its host may now have to look for the job (review s36 M1).
  if (auto r = rejoining_.find(s); r != rejoining_.end()) {
    if (!finished()) {
      auto& e = emit(JobEvent::Kind::kNodeLost, &r->second.join);
      e.cause = "connection closed";
      e.why = fmt::format("{}, told to restart for round {}", why, round_ + 1);
    }
    rejoining_.erase(r);
  }
  joined_.erase(s);
  held_.erase(s);
  auto it = members_.find(s);
  if (it == members_.end()) {
    if (joined_.size() < static_cast<std::size_t>(config_.min_nodes)) last_call_deadline_.reset();
    // A node lost between rounds leaves its place to a standby.
    if (state_ == State::kRestarting && !standby_.empty()) return promote_standbys(now);
    return {};
  }
  if (state_ != State::kRunning || it->second.done) {
    members_.erase(it);
    return {};
  }
  const proto::WorkerFailed rc = lost_cause(it->second.join, why);
  {
    auto& e = emit(JobEvent::Kind::kNodeLost, &it->second.join);
    e.cause = "connection closed";
    e.why = std::string(why);
  }
  ++disconnects_;
  return fail_or_restart(rc, rc.message, s, now);
}

proto::WorkerFailed Job::lost_cause(const proto::Join& j, std::string_view why) const {
  proto::WorkerFailed rc;
  rc.round = round_;
  rc.host = j.host;
  rc.rank = -1;
  rc.exit_code = 1;
  rc.message = fmt::format("node {} ({}) lost: {}", j.host, j.addr, why);
  return rc;
}

Actions Job::tell_lost(SessionId s, State before) const {
  if (before != State::kRunning || state_ == State::kDone) return {};
  if (state_ == State::kFailed) return abort_ ? Actions{{s, proto::to_wire(*abort_)}} : Actions{};
  return {{s, proto::to_wire(proto::Restart{restart_count_, restart_reason_})}};
}

Actions Job::tick(Clock::time_point now) {
  if (!configured_ || finished()) return refuse_held({});
  // Every silent standby is dropped (and told, in case it is only slow) before it could be
  // given a place it cannot take; the tick's other deadlines are then checked all the same.
  Actions out = rebuilding_ ? drop_silent_standbys(now) : refuse_held(drop_silent_standbys(now));
  auto rejoin = drop_silent_rejoining(now);
  out.insert(out.end(), std::make_move_iterator(rejoin.begin()), std::make_move_iterator(rejoin.end()));
  if (finished()) return out;
  auto rest = tick_deadlines(now);
  out.insert(out.end(), std::make_move_iterator(rest.begin()), std::make_move_iterator(rest.end()));
  return out;
}

Clock::duration Job::silent_limit(const proto::Join& j) {
  return milliseconds(j.keep_alive_ms) * j.keep_alive_max_attempt;
}

Actions Job::drop_silent_standbys(Clock::time_point now) {
  Actions out;
  for (auto it = standby_.begin(); it != standby_.end();) {
    const auto limit_ms = duration_cast<milliseconds>(silent_limit(it->second.join)).count();
    if (now - it->second.last_seen <= silent_limit(it->second.join)) {
      ++it;
      continue;
    }
    out.push_back({it->first, proto::to_wire(proto::Error{fmt::format(
                                  "standby dropped from job '{}': no heartbeat for more than {} ms", id_, limit_ms)})});
    emit(JobEvent::Kind::kStandbyLost, &it->second.join).why =
        fmt::format("dropped: no heartbeat for more than {} ms", limit_ms);
    it = standby_.erase(it);
  }
  if (!out.empty()) {
    auto told = tell_standby_count();
    out.insert(out.end(), told.begin(), told.end());
  }
  return out;
}

Actions Job::drop_silent_rejoining(Clock::time_point now) {
  if (state_ != State::kRestarting) return {};
  bool dropped = false;
  for (auto it = rejoining_.begin(); it != rejoining_.end();) {
    if (now - it->second.last_seen <= silent_limit(it->second.join)) {
      ++it;
      continue;
    }
    // Silent since before its Restart went out, or since: cut off (or hung). It is lost like a
    // silent member: its place goes to a standby, and it is no voter of the next round.
    auto& e = emit(JobEvent::Kind::kNodeLost, &it->second.join);
    e.cause = "heartbeat timeout";
    e.why = fmt::format("told to restart for round {}, then missed {} heartbeats ({} ms apart): hung or unreachable",
                        round_ + 1, it->second.join.keep_alive_max_attempt, it->second.join.keep_alive_ms);
    ++missed_heartbeats_;
    it = rejoining_.erase(it);
    dropped = true;
  }
  if (!dropped || standby_.empty()) return {};
  return promote_standbys(now);
}

Actions Job::tick_deadlines(Clock::time_point now) {
  if (state_ == State::kJoining && round_ == 0 && joined_.empty() && members_.empty() && !standby_.empty() &&
      now - first_join_ >= milliseconds(config_.join_timeout_ms)) {
    proto::WorkerFailed rc;
    rc.rank = -1;
    rc.message = fmt::format("no node of job '{}' re-registered its round within join_timeout after the rendezvous "
                             "server restarted: nothing to stand by for", id_);
    return fail_job(rc, rc.message);
  }
  if (takeover_ && state_ == State::kRestarting && now >= takeover_->deadline) {
    // The survivors that did not come are gone: their places go to the standbys.
    takeover_reserved_ = 0;
    if (auto closed = promote_standbys(now); state_ == State::kRunning) return closed;
    const TakeoverSeed seed = std::move(*takeover_);
    takeover_.reset();
    if (static_cast<int>(joined_.size()) < config_.min_nodes) {
      // Nobody else can come: the lost host's address is where late nodes would look.
      proto::WorkerFailed rc;
      rc.round = round_;
      rc.host = seed.lost_host;
      rc.rank = -1;
      rc.exit_code = kHostLostExitCode;
      rc.message = fmt::format("{}; only {} of at least {} nodes re-joined the node that took over", seed.reason,
                               joined_.size(), config_.min_nodes);
      return fail_job(rc, rc.message, /*final=*/false);  // (the host lost may be only cut off)
    }
    // This host heard a majority until now (hears_majority()); its shortfall counts from
    // here. Its "no majority" may have been told once already inside the window (a short last
    // call, a full round) and answered "majority": it is told again, so that the agent asks
    // and seeks (review s38 M2).
    if (short_of_majority()) {
      quorum_told_ = false;
      return close_round(now);
    }
  }
  if ((state_ == State::kJoining || state_ == State::kRestarting) && !joined_.empty()) {
    if (last_call_deadline_ && now >= *last_call_deadline_) {
      auto closed = close_round(now);
      if (state_ == State::kRunning) return closed;  // else it waits for a majority, to join_timeout
    }
    if (now - first_join_ >= milliseconds(config_.join_timeout_ms)) {
      proto::WorkerFailed rc;
      rc.rank = -1;
      rc.message = fmt::format("only {} of at least {} nodes joined job '{}' within join_timeout", joined_.size(),
                               config_.min_nodes, id_);
      const auto short_of = short_of_majority();
      if (short_of)
        rc.message = fmt::format("no majority of job '{}''s {} voters{} within join_timeout: {} of them joined or standing by, {} needed "
                                 "(a network partition may have cut this side off; the majority's side goes on)",
                                 id_, short_of->voters, short_of->previous ? " of the epoch before" : "",
                                 short_of->present, short_of->voters / 2 + 1);
      if (state_ == State::kRestarting && !restart_reason_.empty()) {
        // The restart's cause is the job's: the node lost, not a join that came too late.
        rc.round = round_;
        rc.host = restart_host_;
        rc.message += fmt::format(" after restart {} ({})", restart_count_, restart_reason_);
      }
      return fail_job(rc, rc.message, /*final=*/!short_of);  // (a minority's end: the majority goes on)
    }
  }
  if (state_ == State::kRunning && rebuilding_ && members_.size() < expected_members_ &&
      now - rebuild_since_ >= milliseconds(config_.join_timeout_ms)) {
    // A node of the round the restarted server rebuilds never came back: it is lost, as if
    // its connection had closed (else the nodes that came back waited for it for ever).
    std::set<int> back;
    for (const auto& [s, n] : members_) back.insert(n.join.resume_group_rank);
    std::vector<int> missing;
    for (int r = 0; r < static_cast<int>(expected_members_) && missing.size() < 8; ++r)
      if (!back.contains(r)) missing.push_back(r);
    proto::WorkerFailed rc;
    rc.round = round_;
    rc.rank = -1;
    rc.exit_code = 1;
    rc.message = fmt::format("{} of the {} nodes of round {} (group rank {}) lost: not re-registered with the "
                             "restarted rendezvous server within join_timeout ({} s)",
                             expected_members_ - members_.size(), expected_members_, round_,
                             fmt::join(missing, ","), config_.join_timeout_ms / 1000.0);
    rebuilding_ = false;
    expected_members_ = members_.size();
    {
      auto& e = emit(JobEvent::Kind::kNodeLost);
      e.cause = "not re-registered";
      e.why = rc.message;
    }
    ++disconnects_;
    return fail_or_restart(rc, rc.message, 0, now);
  }
  if (state_ == State::kRunning) {
    for (const auto& [s, n] : members_) {
      if (n.done || now - n.last_seen <= silent_limit(n.join)) continue;
      proto::WorkerFailed rc;
      rc.round = round_;
      rc.host = n.join.host;
      rc.rank = -1;
      rc.exit_code = 1;
      rc.message = fmt::format("node {} ({}) missed {} heartbeats ({} ms apart): hung or unreachable", n.join.host,
                               n.join.addr, n.join.keep_alive_max_attempt, n.join.keep_alive_ms);
      {
        auto& e = emit(JobEvent::Kind::kNodeLost, &n.join);
        e.cause = "heartbeat timeout";
        e.why = fmt::format("missed {} heartbeats ({} ms apart): hung or unreachable", n.join.keep_alive_max_attempt,
                            n.join.keep_alive_ms);
      }
      ++missed_heartbeats_;
      const SessionId lost = s;  // `s` and `n` refer into members_, which fail_or_restart() empties
      auto out = fail_or_restart(rc, rc.message, lost, now);
      // The silent node is told too, in case it is only slow (or its side of a cut hears the
      // host): as the others, a Restart when the job goes on, so that it stops its workers
      // and joins again (#34); the Abort only when the job failed.
      auto told = tell_lost(lost, State::kRunning);
      out.insert(out.end(), told.begin(), told.end());
      return out;
    }
  }
  return {};
}

}  // namespace mg::rdzv
