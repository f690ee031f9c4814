// Splits a byte stream into lines for relaying. Complete lines come out whole; a line
// longer than the limit comes out in pieces of at most `max_line` bytes, each but the last
// flagged `cut`; finish() flushes a last line that had no newline. Pure: no I/O.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace mg {

class LineSplitter {
 public:
  explicit LineSplitter(std::size_t max_line) : max_line_(max_line ? max_line : 1) {}

  // Calls sink(std::string_view line_without_newline, bool cut) for each line or piece.
  template <typename Sink>
  void feed(std::string_view data, Sink&& sink) {
    while (!data.empty()) {
      const auto nl = data.find('\n');
      const std::size_t room = max_line_ - pending_.size();
      if (nl != std::string_view::npos && nl <= room) {
        if (pending_.empty()) {
          sink(data.substr(0, nl), false);
        } else {
          pending_.append(data.substr(0, nl));
          sink(std::string_view(pending_), false);
          pending_.clear();
        }
        data.remove_prefix(nl + 1);
      } else if (nl == std::string_view::npos && data.size() <= room) {
        pending_.append(data);
        return;
      } else {
        pending_.append(data.substr(0, room));
        data.remove_prefix(room);
        // A newline right after a full piece ends the line there: no empty continuation.
        const bool ends_here = !data.empty() && data.front() == '\n';
        sink(std::string_view(pending_), !ends_here);
        pending_.clear();
        if (ends_here) data.remove_prefix(1);
      }
    }
  }

  template <typename Sink>
  void finish(Sink&& sink) {
    if (!pending_.empty()) sink(std::string_view(pending_), false);
    pending_.clear();
  }

  bool has_pending() const { return !pending_.empty(); }

 private:
  std::size_t max_line_;
  std::string pending_;
};

}  // namespace mg
