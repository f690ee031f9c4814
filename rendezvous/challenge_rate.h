// How often one address may have a proof of the job key checked (D7, issue #35): a token
// bucket per source address, whatever number of connections the address opens. A
// challenge takes a token; a correct proof gives it back (an agent that knows the key
// costs nothing), a wrong proof or a challenge left unanswered keeps it, and tokens come
// back one per `refill`, up to `burst`. So an address has at most burst + t/refill wrong
// proofs checked in any t, be it one connection or a thousand. An IPv6 address counts as
// its /64 (one site has 2^64 of them), an IPv4-mapped one as its IPv4 address. Pure: the
// time is passed in.
#pragma once

#include <chrono>
#include <cstddef>
#include <map>
#include <string>

namespace mg::rdzv {

class ChallengeRate {
 public:
  using Clock = std::chrono::steady_clock;
  struct Options {
    std::size_t burst = 4;                          // tokens of an address never seen (or long quiet)
    Clock::duration refill = std::chrono::seconds(5);  // one token back per refill
    std::size_t max_addresses = 4096;               // the table's bound (see take())
  };
  ChallengeRate() : ChallengeRate(Options{}) {}
  explicit ChallengeRate(Options o) : o_(o) {}

  // Takes a token for one challenge to `address` at `now`; false when it has none left.
  // At its bound the table forgets only full buckets (a full bucket is the same as no
  // entry); when none is full, a new address gets no token until one is (next()), so the
  // table never grows past `max_addresses` and a depleted bucket is never reset.
  bool take(const std::string& address, Clock::time_point now);
  // A correct proof: the token its challenge took comes back.
  void give_back(const std::string& address, Clock::time_point now);
  // When `address` has a token (`now` when it has one already; for a new address while the
  // table is full, when its first bucket fills).
  Clock::time_point next(const std::string& address, Clock::time_point now) const;
  // Forgets the addresses whose bucket is full at `now` (they are as if never seen).
  void prune(Clock::time_point now);
  std::size_t size() const { return buckets_.size(); }
  const Options& options() const { return o_; }
  // The bucket `address` counts in: an IPv4 address itself, an IPv4-mapped IPv6 one its
  // IPv4 address, another IPv6 address its /64 ("2001:db8:1:2::/64").
  static std::string bucket_of(const std::string& address);

 private:
  // The bucket as of `since`: `tokens` whole tokens, plus one more each `refill` after it.
  struct Bucket {
    std::size_t tokens = 0;
    Clock::time_point since;
  };
  void refill(Bucket& b, Clock::time_point now) const;
  Clock::time_point full_at(const Bucket& b) const;
  Options o_;
  std::map<std::string, Bucket> buckets_;
};

}  // namespace mg::rdzv
