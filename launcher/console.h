// Console: the agent's single writer of relayed worker lines. Lines are appended to one
// buffer per stream and written with whole-buffer write() calls, so a line is never split
// or interleaved with another worker's. Owned by the agent; single-threaded.
#pragma once

#include <string>
#include <string_view>

namespace mg {

class Console {
 public:
  Console(int out_fd, int err_fd, bool timestamps) : fds_{out_fd, err_fd}, timestamps_(timestamps) {}

  // stream: 0 stdout, 1 stderr. `prefix` like "[rank3]:". A cut piece gets a marker.
  void line(int stream, std::string_view prefix, std::string_view text, bool cut);
  // Writes what is buffered; called after each batch of lines from one read.
  void flush();
  // Starts a batch: refreshes the timestamp used by line().
  void begin_batch();

  static constexpr std::string_view kCutMarker = " [mglaunch: line continues]";

 private:
  int fds_[2];
  bool timestamps_;
  std::string stamp_;
  std::string buf_[2];
};

// Writes all of `data` to fd, retrying on EINTR/partial writes; gives up silently on
// errors (a closed console must not kill the agent).
void write_all(int fd, std::string_view data);

}  // namespace mg
