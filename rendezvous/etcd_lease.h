// LeaseGuard: the policy of an etcd agent's own lease (#34), pure like rdzv::Job and the
// ClientMachine: it owns no thread and never reads the clock. EtcdLink (etcd_backend.h)
// feeds it the lease's grants and keep-alive answers, the decisions it tells the agent, the
// agent's rejoin() and a tick, each with the time, and carries out the commands it returns
// (tests/etcd_lease_test.cc drives it with a fake clock).
//
// Fence. etcd deletes an agent's alive key once its lease goes unrenewed for its TTL; the
// other agents then declare it lost and go on without it. A keep-alive sent at S and
// answered keeps the lease until S + TTL at the earliest (etcd counts from its receipt), so
// a node running a round whose last answered keep-alive was sent at S stops its workers at
// S + TTL - margin (margin: half a keep-alive interval, at most half the TTL), before etcd
// may expire the lease: a Restart for the agent whose reason starts "this node fenced
// itself" (its one line) and the round reported failed, under its own id, for when etcd
// hears it before the lease is gone (the job restarts the round, as for a fenced node of a
// daemon).
// Rejoin. The agent's rejoin() after a fence waits for a word on the lease: renewed (the
// lease lived through the cut): the join goes under the agent's id; gone (a keep-alive
// answered with TTL 0, its alive key deleted, or its loss in the job's log): it re-enters
// as a newcomer, under a new identity (a new lease, its alive key and its join in one
// transaction), since the job's log keeps a lost agent lost. A lease found gone while the
// round runs (the fence never fired: the agent was stopped, say) stops the workers first.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <variant>
#include <vector>

namespace mg::rdzv::etcd {

namespace lease_cmd {
// Tell the agent a Restart with `why` (its workers stop; it calls rejoin() once they did).
// `report_round` > 0: append a failure of that round under the current id (the fence).
struct Stop {
  std::string why;
  int report_round = 0;
};
struct Join {};     // append the join under the current identity
struct Reenter {};  // a new lease and identity: the alive key and the join in one transaction
}  // namespace lease_cmd
using LeaseCommand = std::variant<lease_cmd::Stop, lease_cmd::Join, lease_cmd::Reenter>;
using LeaseCommands = std::vector<LeaseCommand>;

class LeaseGuard {
 public:
  using Clock = std::chrono::steady_clock;
  // keep_alive_ms: the job's keep-alive interval (the margin is half of it, at most half the TTL).
  // endpoint: what the fence's line names ("http://10.0.0.4:2379").
  LeaseGuard(int keep_alive_ms, std::string endpoint);

  // A lease granted (at the start, and at each re-entry) or renewed: `sent` is when its
  // request left, `ttl_s` its TTL in etcd's answer. A renewal with TTL 0: the lease is gone.
  // Answers for another lease than the current one are stale and ignored.
  LeaseCommands granted(std::int64_t lease, std::int64_t ttl_s, Clock::time_point sent);
  LeaseCommands renewed(std::int64_t lease, std::int64_t ttl_s, Clock::time_point sent);
  // The current lease is gone (its alive key deleted, the agent's loss in the job's log).
  LeaseCommands gone(const std::string& why);
  // Decisions told to the agent.
  void assigned(int round);  // its workers run that round
  void restarted();          // a Restart: its workers stop, then it calls rejoin()
  void waiting();            // a Standby: no workers, waiting for a place
  void ended();              // Abort or Done: no fence ever again
  // The agent's rejoin() (its workers stopped).
  LeaseCommands rejoin();
  LeaseCommands tick(Clock::time_point now);

  // When a running round fences (nullopt: not running, or no lease yet).
  std::optional<Clock::time_point> fence_at() const;
  std::chrono::milliseconds margin() const;
  bool fenced() const { return fenced_; }

 private:
  enum class Phase { kWaiting, kRunning, kStopping, kEnded };
  LeaseCommands join_or_reenter();

  int keep_alive_ms_;
  std::string endpoint_;
  Phase phase_ = Phase::kWaiting;
  int round_ = 0;
  std::int64_t lease_ = 0, ttl_s_ = 0;
  std::optional<Clock::time_point> renewed_sent_;  // the last answered keep-alive's (or grant's) send time
  bool gone_ = false;          // the current lease is known gone
  bool fenced_ = false;        // fenced, and no word on the lease since
  bool join_pending_ = false;  // rejoin() waits for that word
  bool reentering_ = false;    // a Reenter under way (until granted())
};

}  // namespace mg::rdzv::etcd
