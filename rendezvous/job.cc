#include "rendezvous/job.h"

#include <algorithm>

#include <fmt/format.h>

namespace mg::rdzv {

using namespace std::chrono;

Actions Job::broadcast(const proto::Wire& f, SessionId except) const {
  Actions out;
  out.reserve(members_.size() + joined_.size());
  for (const auto& [s, n] : members_)
    if (s != except) out.push_back({s, f});
  for (const auto& [s, n] : joined_)
    if (s != except && !members_.contains(s)) out.push_back({s, f});
  return out;
}

Actions Job::join(SessionId s, const proto::Join& j, Clock::time_point now) {
  last_activity_ = now;
  // A node re-registering a round that ended while it was away hears how it ended.
  if (j.resume_round > 0 && j.resume_round == round_) {
    if (state_ == State::kFailed && abort_) return {{s, proto::to_wire(*abort_)}};
    if (state_ == State::kDone) return {{s, proto::to_wire(proto::Done{})}};
    if (state_ == State::kRestarting) return {{s, proto::to_wire(proto::Restart{restart_count_, restart_reason_})}};
  }
  if (finished())
    return {{s, proto::to_wire(proto::Error{fmt::format("job '{}' has already finished; use a new --rdzv_id", id_)})}};
  if (!configured_) {
    config_ = j;
    configured_ = true;
    first_join_ = now;
  } else if (j.min_nodes != config_.min_nodes || j.max_nodes != config_.max_nodes) {
    return {{s, proto::to_wire(proto::Error{fmt::format("job '{}' runs with --nnodes={}:{}, this node asked for {}:{}",
                                                         id_, config_.min_nodes, config_.max_nodes, j.min_nodes,
                                                         j.max_nodes)})}};
  }
  if (j.resume_round > 0) {
    if (auto bad = check_resume(s, j); !bad.empty())
      return {{s, proto::to_wire(proto::Error{fmt::format("job '{}': re-registration refused: {}", id_, bad)})}};
    // A restarted server learns the running round back from its nodes.
    if (members_.empty()) {
      round_ = j.resume_round;
      restart_count_ = j.resume_restart_count;
      expected_members_ = static_cast<std::size_t>(std::max(1, j.resume_group_world_size));
      rebuilding_ = true;
    }
    joined_.erase(s);
    members_[s] = {j, now, j.resume_done};
    if (members_.size() >= expected_members_) rebuilding_ = false;
    state_ = State::kRunning;
    return maybe_done();
  }
  if (state_ == State::kRunning) {
    if (members_.contains(s)) return {};
    if (static_cast<int>(members_.size()) >= config_.max_nodes)
      return {{s, proto::to_wire(proto::Error{fmt::format("job '{}' is full ({} nodes)", id_, config_.max_nodes)})}};
    // Scale up: everybody re-joins a new round with the newcomer; no restart is spent.
    joined_[s] = {j, now};
    state_ = State::kRestarting;
    Actions out;
    const auto restart = proto::to_wire(proto::Restart{restart_count_, "a node joined: scaling up"});
    for (const auto& [m, n] : members_) out.push_back({m, restart});
    members_.clear();
    last_call_deadline_.reset();
    return out;
  }
  if (state_ == State::kRestarting || state_ == State::kJoining) {
    if (joined_.empty()) first_join_ = now;
    joined_[s] = {j, now};
    const int n = static_cast<int>(joined_.size());
    if (n >= config_.max_nodes) return close_round(now);
    if (n >= config_.min_nodes && !last_call_deadline_) last_call_deadline_ = now + milliseconds(config_.last_call_ms);
  }
  return {};
}

std::string Job::check_resume(SessionId s, const proto::Join& j) const {
  if (!joined_.empty()) return "other nodes are waiting for a new round";
  if (members_.empty()) {
    if (state_ != State::kJoining || round_ != 0) return "the job is not being rebuilt";
    if (j.resume_group_world_size < 1 || j.resume_group_rank < 0 || j.resume_group_rank >= j.resume_group_world_size)
      return "the claimed group rank or size is out of range";
    return {};
  }
  if (!rebuilding_ || state_ != State::kRunning) return "the job is not being rebuilt";
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
  nlohmann::json j = {{"id", id_},
                      {"state", kStates[static_cast<int>(state_)]},
                      {"round", round_},
                      {"restart_count", restart_count_},
                      {"max_restarts", config_.max_restarts},
                      {"min_nodes", config_.min_nodes},
                      {"max_nodes", config_.max_nodes},
                      {"nodes", nodes}};
  if (abort_) j["root_cause"] = abort_->reason;
  return j;
}

std::size_t Job::approx_bytes() const {
  std::size_t bytes = sizeof(Job) + id_.size();
  for (const auto* m : {&joined_, &members_})
    for (const auto& [s, n] : *m)
      bytes += sizeof(Node) + 64 + n.join.job_id.size() + n.join.agent_id.size() + n.join.host.size() + n.join.addr.size();
  return bytes;
}

Actions Job::close_round(Clock::time_point now) {
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
  ++round_;
  proto::Assignment a;
  a.round = round_;
  a.group_world_size = static_cast<int>(nodes.size());
  a.restart_count = restart_count_;
  a.master_addr = nodes.front().second.join.addr;
  a.master_port = nodes.front().second.join.master_port;
  a.world_size = 0;
  for (const auto& [s, n] : nodes) {
    // The node list rides along for jobs up to kMaxListedNodes (10,000 nodes would make
    // every assignment 120 KB and the round 1.2 GB). It is encoded once for every node.
    if (nodes.size() <= proto::kMaxListedNodes) a.nodes.push_back(n.join.addr);
    a.world_size += n.join.nproc;
  }
  const proto::AssignmentEncoder assignment(a);
  members_.clear();
  int offset = 0;
  for (std::size_t i = 0; i < nodes.size(); ++i) {
    auto& [s, n] = nodes[i];
    out.push_back({s, assignment(static_cast<int>(i), offset)});
    offset += n.join.nproc;
    n.last_seen = now;
    members_.emplace_hint(members_.end(), s, std::move(n));
  }
  last_call_deadline_.reset();
  expected_members_ = members_.size();
  rebuilding_ = false;
  state_ = State::kRunning;
  return out;
}

Actions Job::heartbeat(SessionId s, Clock::time_point now) {
  last_activity_ = now;
  if (auto it = members_.find(s); it != members_.end()) it->second.last_seen = now;
  if (auto it = joined_.find(s); it != joined_.end()) it->second.last_seen = now;
  return {};
}

Actions Job::fail_or_restart(const proto::WorkerFailed& root_cause, const std::string& reason, SessionId lost,
                             Clock::time_point now) {
  members_.erase(lost);
  joined_.erase(lost);
  const int survivors = static_cast<int>(members_.size());
  if (restart_count_ < config_.max_restarts && survivors >= 1) {
    ++restart_count_;
    state_ = State::kRestarting;
    restart_reason_ = reason;
    first_join_ = now;
    Actions out;
    const auto restart = proto::to_wire(proto::Restart{restart_count_, reason});
    for (const auto& [s, n] : members_) out.push_back({s, restart});
    members_.clear();
    return out;
  }
  state_ = State::kFailed;
  abort_ = proto::Abort{root_cause, reason};
  auto out = broadcast(proto::to_wire(*abort_));
  members_.clear();
  joined_.clear();
  return out;
}

Actions Job::worker_failed(SessionId s, const proto::WorkerFailed& f, Clock::time_point now) {
  last_activity_ = now;
  if (state_ != State::kRunning || !members_.contains(s) || f.round != round_) return {};
  const std::string reason = fmt::format("rank {} on {} exited with {}", f.rank, f.host, f.exit_code);
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
  auto out = broadcast(proto::to_wire(proto::Done{}));
  members_.clear();
  return out;
}

Actions Job::disconnected(SessionId s, Clock::time_point now, std::string_view why) {
  last_activity_ = now;
  joined_.erase(s);
  auto it = members_.find(s);
  if (it == members_.end()) {
    if (joined_.size() < static_cast<std::size_t>(config_.min_nodes)) last_call_deadline_.reset();
    return {};
  }
  if (state_ != State::kRunning || it->second.done) {
    members_.erase(it);
    return {};
  }
  proto::WorkerFailed rc;
  rc.round = round_;
  rc.host = it->second.join.host;
  rc.rank = -1;
  rc.exit_code = 1;
  rc.message = fmt::format("node {} ({}) lost: {}", it->second.join.host, it->second.join.addr, why);
  ++disconnects_;
  return fail_or_restart(rc, rc.message, s, now);
}

Actions Job::tick(Clock::time_point now) {
  if (!configured_ || finished()) return {};
  if ((state_ == State::kJoining || state_ == State::kRestarting) && !joined_.empty()) {
    if (last_call_deadline_ && now >= *last_call_deadline_) return close_round(now);
    if (now - first_join_ >= milliseconds(config_.join_timeout_ms)) {
      proto::WorkerFailed rc;
      rc.rank = -1;
      rc.message = fmt::format("only {} of at least {} nodes joined job '{}' within join_timeout", joined_.size(),
                               config_.min_nodes, id_);
      state_ = State::kFailed;
      abort_ = proto::Abort{rc, rc.message};
      auto out = broadcast(proto::to_wire(*abort_));
      joined_.clear();
      return out;
    }
  }
  if (state_ == State::kRunning) {
    const auto limit = milliseconds(config_.keep_alive_ms) * config_.keep_alive_max_attempt;
    for (const auto& [s, n] : members_) {
      if (n.done || now - n.last_seen <= limit) continue;
      proto::WorkerFailed rc;
      rc.round = round_;
      rc.host = n.join.host;
      rc.rank = -1;
      rc.exit_code = 1;
      rc.message = fmt::format("node {} ({}) missed {} heartbeats ({} ms apart): hung or unreachable", n.join.host,
                               n.join.addr, config_.keep_alive_max_attempt, config_.keep_alive_ms);
      ++missed_heartbeats_;
      auto out = fail_or_restart(rc, rc.message, s, now);
      // The silent node is told too, in case it is only slow.
      out.push_back({s, proto::to_wire(proto::Abort{rc, rc.message})});
      return out;
    }
  }
  return {};
}

}  // namespace mg::rdzv
