#include "proto/accept_backoff.h"

#include <fmt/format.h>

namespace mg::proto {

std::optional<std::string> LogLimiter::admit(const std::string& line, Clock::time_point now) {
  if (last_ && now - *last_ < every_) {
    ++left_out_;
    return std::nullopt;
  }
  last_ = now;
  if (left_out_ == 0) return line;
  return fmt::format("{} (and {} more in the second before)", line, std::exchange(left_out_, 0));
}

std::optional<std::string> PauseEpisode::paused(const std::string& why) {
  if (pauses_++ > 0) return std::nullopt;
  return fmt::format("accept failed: {}; pausing accepts for {} ms at a time until one succeeds", why,
                     kAcceptPause.count());
}

std::optional<std::string> PauseEpisode::accepted() {
  if (pauses_ == 0) return std::nullopt;
  const std::size_t n = std::exchange(pauses_, 0);
  return fmt::format("accepts resumed after {} pause{} of {} ms", n, n == 1 ? "" : "s", kAcceptPause.count());
}

}  // namespace mg::proto
