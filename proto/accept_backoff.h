// One rule for every acceptor of ours that a peer can exhaust (the agent's store, the
// control socket): after an accept error such as EMFILE the pending connection stays in
// the backlog and accept would fail again at once, so the server keeps serving the
// connections it has and pauses its accepts for kAcceptPause instead of spinning; and what
// it logs about it (or about clients it refuses) comes at most once a second, the next line
// counting those left out (PauseEpisode: the pauses themselves, one line when an episode
// starts and one when it ends). Pure but for pause_accepts(), a template over the caller's Asio
// timer, so this room includes no Boost.
#pragma once

#include <chrono>
#include <cstddef>
#include <optional>
#include <string>
#include <utility>

namespace mg::proto {

inline constexpr std::chrono::milliseconds kAcceptPause{100};

// At most one line per `every`; a line admitted after some were left out says how many.
class LogLimiter {
 public:
  using Clock = std::chrono::steady_clock;
  explicit LogLimiter(Clock::duration every = std::chrono::seconds(1)) : every_(every) {}
  // The line to log now ("LINE (and N more in the second before)" after N left out), or
  // nullopt when a line went out less than `every` before `now`.
  std::optional<std::string> admit(const std::string& line, Clock::time_point now);

 private:
  Clock::duration every_;
  std::optional<Clock::time_point> last_;
  std::size_t left_out_ = 0;
};

// One episode of accept pauses: from an accept that fails (EMFILE) to the next connection
// accepted. A server out of descriptors pauses every kAcceptPause, ten times a second; it
// logs the episode's first pause and, when accepts work again, one line with the count, so
// an episode of any length is two lines and does not push real events out of a log ring.
class PauseEpisode {
 public:
  // An accept failed with `why` and accepts pause: the line to log at an episode's first
  // pause, nullopt for the pauses after it.
  std::optional<std::string> paused(const std::string& why);
  // A connection was accepted: the line that ends an episode ("accepts resumed after N
  // pauses"), nullopt when none was under way.
  std::optional<std::string> accepted();
  std::size_t pauses() const { return pauses_; }  // in the episode under way (0: none)

 private:
  std::size_t pauses_ = 0;
};

// Arms `timer` (an asio::steady_timer) for kAcceptPause and calls `resume` when it fires,
// not when it is cancelled (the server stopping).
template <typename Timer, typename Resume>
void pause_accepts(Timer& timer, Resume resume) {
  timer.expires_after(kAcceptPause);
  timer.async_wait([resume = std::move(resume)](const auto& ec) {
    if (!ec) resume();
  });
}

}  // namespace mg::proto
