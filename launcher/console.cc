#include "launcher/console.h"

#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <ctime>

#include <fmt/format.h>

namespace mg {

void write_all(int fd, std::string_view data) {
  while (!data.empty()) {
    ssize_t n = ::write(fd, data.data(), data.size());
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    data.remove_prefix(static_cast<std::size_t>(n));
  }
}

void Console::begin_batch() {
  if (!timestamps_) return;
  using namespace std::chrono;
  auto now = system_clock::now();
  std::time_t t = system_clock::to_time_t(now);
  std::tm tm{};
  ::localtime_r(&t, &tm);
  auto ms = duration_cast<milliseconds>(now.time_since_epoch()).count() % 1000;
  stamp_ = fmt::format("{:04}-{:02}-{:02}T{:02}:{:02}:{:02}.{:03} ", tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday,
                       tm.tm_hour, tm.tm_min, tm.tm_sec, ms);
}

void Console::line(int stream, std::string_view prefix, std::string_view text, bool cut) {
  std::string& b = buf_[stream];
  b.append(stamp_);
  b.append(prefix);
  b.append(text);
  if (cut) b.append(kCutMarker);
  b.push_back('\n');
}

void Console::flush() {
  for (int s = 0; s < 2; ++s) {
    if (buf_[s].empty()) continue;
    write_all(fds_[s], buf_[s]);
    buf_[s].clear();
  }
}

}  // namespace mg
