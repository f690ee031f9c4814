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

}  // namespace mg::proto
