#include "rendezvous/challenge_rate.h"

#include <arpa/inet.h>

#include <algorithm>
#include <cstring>

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

std::string ChallengeRate::bucket_of(const std::string& address) {
  in6_addr a6{};
  if (::inet_pton(AF_INET6, address.c_str(), &a6) != 1) return address;  // IPv4 (or not an address): itself
  char buf[INET6_ADDRSTRLEN] = {};
  if (IN6_IS_ADDR_V4MAPPED(&a6)) return ::inet_ntop(AF_INET, &a6.s6_addr[12], buf, sizeof(buf)) ? buf : address;
  std::memset(&a6.s6_addr[8], 0, 8);  // its /64: one site's addresses are one bucket
  return ::inet_ntop(AF_INET6, &a6, buf, sizeof(buf)) ? std::string(buf) + "/64" : address;
}

bool ChallengeRate::take(const std::string& address, Clock::time_point now) {
  const std::string key = bucket_of(address);
  auto it = buckets_.find(key);
  if (it == buckets_.end()) {
    if (o_.burst == 0) return false;
    if (buckets_.size() >= o_.max_addresses) {
      prune(now);
      // Only full buckets are forgotten: a depleted one is never reset to make room; the
      // new address waits (next()) until one fills.
      if (buckets_.size() >= o_.max_addresses) return false;
    }
    it = buckets_.emplace(key, Bucket{o_.burst, now}).first;
  }
  Bucket& b = it->second;
  refill(b, now);
  if (b.tokens == 0) return false;
  --b.tokens;  // (a full bucket's refill starts now: refill() set `since`)
  return true;
}

void ChallengeRate::give_back(const std::string& address, Clock::time_point now) {
  auto it = buckets_.find(bucket_of(address));
  if (it == buckets_.end()) return;  // forgotten meanwhile: it is full
  refill(it->second, now);
  if (it->second.tokens < o_.burst) ++it->second.tokens;
  if (it->second.tokens >= o_.burst) buckets_.erase(it);
}

ChallengeRate::Clock::time_point ChallengeRate::next(const std::string& address, Clock::time_point now) const {
  auto it = buckets_.find(bucket_of(address));
  if (it == buckets_.end()) {
    if (buckets_.size() < o_.max_addresses || o_.burst == 0) return now;
    // The table is full: room comes when the first bucket fills.
    Clock::time_point first = Clock::time_point::max();
    for (const auto& [k, b] : buckets_) first = std::min(first, full_at(b));
    return std::max(first, now);
  }
  Bucket b = it->second;
  refill(b, now);
  return b.tokens > 0 ? now : b.since + o_.refill;
}

void ChallengeRate::prune(Clock::time_point now) {
  for (auto it = buckets_.begin(); it != buckets_.end();)
    it = full_at(it->second) <= now ? buckets_.erase(it) : std::next(it);
}

}  // namespace mg::rdzv
