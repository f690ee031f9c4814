#include "rendezvous/challenge_rate.h"

#include <algorithm>

namespace mg::rdzv {

void ChallengeRate::refill(Bucket& b, Clock::time_point now) const {
  if (b.tokens >= o_.burst) {
    b.since = now;
    return;
  }
  if (now <= b.since) return;
  const auto earned = static_cast<std::size_t>((now - b.since) / o_.refill);
  if (b.tokens + earned >= o_.burst) {
    b.tokens = o_.burst;
    b.since = now;
  } else {
    b.tokens += earned;
    b.since += o_.refill * static_cast<long>(earned);  // the part of a token under way is kept
  }
}

ChallengeRate::Clock::time_point ChallengeRate::full_at(const Bucket& b) const {
  return b.tokens >= o_.burst ? b.since : b.since + o_.refill * static_cast<long>(o_.burst - b.tokens);
}

bool ChallengeRate::take(const std::string& address, Clock::time_point now) {
  auto it = buckets_.find(address);
  if (it == buckets_.end()) {
    if (o_.burst == 0) return false;
    if (buckets_.size() >= o_.max_addresses) {
      prune(now);
      if (buckets_.size() >= o_.max_addresses)
        buckets_.erase(std::min_element(buckets_.begin(), buckets_.end(), [&](const auto& a, const auto& b) {
          return full_at(a.second) < full_at(b.second);
        }));
    }
    it = buckets_.emplace(address, Bucket{o_.burst, now}).first;
  }
  Bucket& b = it->second;
  refill(b, now);
  if (b.tokens == 0) return false;
  --b.tokens;  // (a full bucket's refill starts now: refill() set `since`)
  return true;
}

void ChallengeRate::give_back(const std::string& address, Clock::time_point now) {
  auto it = buckets_.find(address);
  if (it == buckets_.end()) return;  // forgotten meanwhile: it is full
  refill(it->second, now);
  if (it->second.tokens < o_.burst) ++it->second.tokens;
  if (it->second.tokens >= o_.burst) buckets_.erase(it);
}

ChallengeRate::Clock::time_point ChallengeRate::next(const std::string& address, Clock::time_point now) const {
  auto it = buckets_.find(address);
  if (it == buckets_.end()) return now;
  Bucket b = it->second;
  refill(b, now);
  return b.tokens > 0 ? now : b.since + o_.refill;
}

void ChallengeRate::prune(Clock::time_point now) {
  for (auto it = buckets_.begin(); it != buckets_.end();)
    it = full_at(it->second) <= now ? buckets_.erase(it) : std::next(it);
}

}  // namespace mg::rdzv
