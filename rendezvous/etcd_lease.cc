#include "rendezvous/etcd_lease.h"

#include <algorithm>

#include <fmt/format.h>

namespace mg::rdzv::etcd {

using std::chrono::milliseconds;

LeaseGuard::LeaseGuard(int keep_alive_ms, std::string endpoint)
    : keep_alive_ms_(keep_alive_ms), endpoint_(std::move(endpoint)) {}

milliseconds LeaseGuard::margin() const {
  return std::min(milliseconds(keep_alive_ms_ / 2), milliseconds(ttl_s_ * 1000 / 2));
}

std::optional<LeaseGuard::Clock::time_point> LeaseGuard::fence_at() const {
  if (phase_ != Phase::kRunning || !renewed_sent_ || gone_) return std::nullopt;
  return *renewed_sent_ + milliseconds(ttl_s_ * 1000) - margin();
}

LeaseCommands LeaseGuard::granted(std::int64_t lease, std::int64_t ttl_s, Clock::time_point sent) {
  lease_ = lease;
  ttl_s_ = std::max<std::int64_t>(1, ttl_s);
  renewed_sent_ = sent;
  gone_ = fenced_ = reentering_ = false;
  // A re-entry's join went with its grant; a rejoin() that waited meanwhile is answered by it.
  join_pending_ = false;
  return {};
}

LeaseCommands LeaseGuard::renewed(std::int64_t lease, std::int64_t ttl_s, Clock::time_point sent) {
  if (lease != lease_ || gone_ || reentering_) return {};
  if (ttl_s <= 0) return gone(fmt::format("etcd ({}) answered that this agent's lease is gone", endpoint_));
  ttl_s_ = ttl_s;
  renewed_sent_ = std::max(renewed_sent_.value_or(sent), sent);
  if (!fenced_) return {};
  // The lease lived through the silence: the node is still in the job under its id. Its
  // reported failure restarts the round; its join goes in now if its workers stopped.
  fenced_ = false;
  if (!join_pending_) return {};
  join_pending_ = false;
  return {lease_cmd::Join{}};
}

LeaseCommands LeaseGuard::gone(const std::string& why) {
  if (gone_ || reentering_ || lease_ == 0) return {};
  gone_ = true;
  fenced_ = false;
  switch (phase_) {
    case Phase::kRunning:
      // The fence did not fire (the agent was stopped, or its clock jumped): the job went on
      // without this node. Its workers stop; its rejoin() re-enters.
      phase_ = Phase::kStopping;
      return {lease_cmd::Stop{fmt::format("this node's etcd lease expired ({}): the job went on without it; its "
                                          "workers stop and it joins again",
                                          why)}};
    case Phase::kStopping:
      if (!join_pending_) return {};  // its rejoin() re-enters
      return join_or_reenter();
    case Phase::kWaiting: return join_or_reenter();
    case Phase::kEnded: return {};
  }
  return {};
}

void LeaseGuard::assigned(int round) {
  phase_ = Phase::kRunning;
  round_ = round;
  join_pending_ = false;
}

void LeaseGuard::restarted() {
  if (phase_ != Phase::kEnded) phase_ = Phase::kStopping;
}

void LeaseGuard::waiting() {
  if (phase_ != Phase::kEnded) phase_ = Phase::kWaiting;
}

void LeaseGuard::ended() { phase_ = Phase::kEnded; }

LeaseCommands LeaseGuard::rejoin() {
  if (phase_ == Phase::kEnded) return {};
  phase_ = Phase::kWaiting;
  if (fenced_ && !gone_) {  // no word on the lease since the fence: is this node still in the job?
    join_pending_ = true;
    return {};
  }
  return join_or_reenter();
}

LeaseCommands LeaseGuard::join_or_reenter() {
  join_pending_ = false;
  if (reentering_) return {};
  if (!gone_) return {lease_cmd::Join{}};
  reentering_ = true;
  return {lease_cmd::Reenter{}};
}

LeaseCommands LeaseGuard::tick(Clock::time_point now) {
  const auto at = fence_at();
  if (!at || now < *at) return {};
  fenced_ = true;
  phase_ = Phase::kStopping;
  const auto silent = std::chrono::duration_cast<milliseconds>(now - *renewed_sent_);
  return {lease_cmd::Stop{
      fmt::format("this node fenced itself: its etcd lease was last renewed {:.1f} s ago (etcd at {} unreachable); "
                  "etcd may expire it after {} s, and the others then go on without this node; its workers stop so "
                  "that a cut-off node never trains beside them; waiting to rejoin",
                  silent.count() / 1000.0, endpoint_, ttl_s_),
      round_}};
}

}  // namespace mg::rdzv::etcd
