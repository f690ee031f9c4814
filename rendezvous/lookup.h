// Name lookups that cannot hold the agent or the daemon. getaddrinfo cannot be cancelled
// and waits on a DNS server that never answers for as long as resolv.conf says (glibc:
// attempts x timeout, 90 s with "timeout:30 attempts:3"), while signals and timers must
// still be served and a stop must end in its bound (#35). So every lookup of a name runs on
// a thread of its own that takes no signals (process/thread.h), and its caller either gets
// the answer on its io_context (Lookups) or waits for it at most a bound (lookup_within).
// A lookup nobody waits for any more is abandoned: its thread ends when getaddrinfo
// returns, and its answer is dropped. Addresses (numeric hosts) are parsed in place.
#pragma once

#include <sys/socket.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/steady_timer.hpp>

#include "process/thread.h"

namespace mg::rdzv {

// How long a lookup may take before its caller goes on without it (as "no answer").
inline constexpr std::chrono::seconds kLookupBound{20};

struct Addresses {
  std::vector<boost::asio::ip::tcp::endpoint> found;  // in getaddrinfo's order; empty on error
  std::string error;                                  // why none: gai_strerror's text, or no answer in time
  bool timed_out = false;                             // the bound passed before an answer
};

// Runs `f` (a lookup: getaddrinfo, getnameinfo) on a thread of its own that takes no signals
// and returns its result, or nullopt once `bound` has passed first (the thread is then
// abandoned: it ends when `f` returns, and its result is dropped). `f` must own what it uses.
template <class T, class F>
std::optional<T> run_within(std::chrono::milliseconds bound, F f) {
  struct Answer {
    std::mutex m;
    std::condition_variable cv;
    std::optional<T> value;
  };
  auto answer = std::make_shared<Answer>();
  signal_free_thread([answer, f = std::move(f)]() mutable {
    T value = f();
    std::lock_guard g(answer->m);
    answer->value = std::move(value);
    answer->cv.notify_all();
  }).detach();
  std::unique_lock lk(answer->m);
  if (!answer->cv.wait_for(lk, bound, [&] { return answer->value.has_value(); })) return std::nullopt;
  return std::move(answer->value);
}

// The addresses of `host` for TCP port `port` (`family`: AF_UNSPEC, AF_INET or AF_INET6;
// `passive`: AI_PASSIVE, for binding), waiting at most `bound`. Blocks the caller: for code
// that runs before an event loop serves signals, or on a thread of its own.
Addresses lookup_within(const std::string& host, int port, std::chrono::milliseconds bound = kLookupBound,
                        int family = AF_UNSPEC, bool passive = false);

// The addresses of `host` for TCP port `port`, waiting until `deadline` at most (and at most
// kLookupBound) and, when `cancel_fd` >= 0, until it is readable: for code on a thread of its
// own that is told to stop through a pipe (the preflight check, ops/preflight_net.cc). On
// cancel the error is "cancelled"; past the deadline timed_out is set.
Addresses lookup_until(const std::string& host, int port, std::chrono::steady_clock::time_point deadline,
                       int cancel_fd = -1, int family = AF_UNSPEC, bool passive = false);

// The lookups of one owner on its io_context. The answers arrive there; destroying the
// owner, or cancel(), abandons the lookups under way (their `done` never runs). Use on the
// io_context's thread only; destroy it before the io_context.
class Lookups {
 public:
  explicit Lookups(boost::asio::io_context& io);
  ~Lookups();
  Lookups(const Lookups&) = delete;
  Lookups& operator=(const Lookups&) = delete;

  // `done` runs on the io_context once, with the answer or, when `bound` passed first, with
  // timed_out set (posted, never from inside start()).
  void start(const std::string& host, int port, std::chrono::milliseconds bound, std::function<void(Addresses)> done,
             int family = AF_UNSPEC);
  void cancel();
  std::size_t pending() const { return pending_.size(); }

 private:
  struct Shared;  // what a lookup's thread may touch: alive, under a mutex
  struct Pending {
    std::function<void(Addresses)> done;
    std::unique_ptr<boost::asio::steady_timer> timer;
  };
  void deliver(std::uint64_t id, Addresses a);

  boost::asio::io_context& io_;
  std::shared_ptr<Shared> shared_;
  std::map<std::uint64_t, Pending> pending_;
  std::uint64_t next_ = 0;
};

}  // namespace mg::rdzv
