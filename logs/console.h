// Console: the single writer of relayed worker lines and the agent's own notices. Lines
// are appended to one buffer per stream and handed on as whole buffers, so a line is
// never split or interleaved with another worker's.
//
// Two modes:
//  - synchronous (out_fd, err_fd, timestamps): flush() writes with blocking write() calls;
//    for callers without an event loop to protect.
//  - asynchronous (io, out_fd, err_fd, timestamps): flush(), write() and write_file()
//    only queue; writer threads (stdout, stderr, log files) do the blocking write() calls,
//    so a stalled stdout (a paused terminal, a slow pipe reader) or a stalled log file
//    system never stops the event loop (heartbeats, signals, exits). The queue is bounded by back-pressure: above `high_water` bytes
//    queued on a stream congested() is true and the readers of worker pipes are expected
//    to stop reading and call when_uncongested(); their callbacks run on `io` once every
//    stream is below a quarter of it. The destructor writes what is queued (blocking, as
//    a synchronous console would) and joins the writers.
//
// On a terminal a stream is "live" (live()): a worker's output goes out as it comes, partial
// lines included (progress bars, prompts), through relay(), which puts the prefix at the
// start of each visual line (after a '\r' too). A line is still never mixed with another
// worker's: when another worker (or a notice) writes while one worker's line is open, that
// line is ended with a newline first, and its continuation gets its prefix again. When
// stdout and stderr are the same terminal they share one queue and one open line. A
// progress bar's open line (redrawn after a '\r') that another worker interrupts is wiped
// instead ("\r" + erase to the end of the line; not with TERM=dumb) and comes back at its
// next redraw; when its worker's output ends, or before a notice (write()), it ends with a
// newline and keeps its last state. Pipes and files keep whole lines, byte for byte
// (line()), except that a worker's unfinished line may go out through relay() too (a '\r'
// progress bar, a raw line above the limit): then another worker's line ends it with a
// newline first, so each line of the file is one worker's.
// Owned by the agent; every member function is called from the io_context's thread.
#pragma once

#include <sys/ioctl.h>

#include <cstddef>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <boost/asio/io_context.hpp>

#include "logs/line_splitter.h"

namespace mg {

class Console {
 public:
  static constexpr std::size_t kDefaultHighWater = 1 << 20;
  static constexpr std::size_t kFlushSoonMax = 256 * 1024;
  // Columns of a --timestamps stamp ("2024-01-31T12:34:56.789 ").
  static constexpr std::size_t kStampWidth = 24;

  Console(int out_fd, int err_fd, bool timestamps);
  Console(boost::asio::io_context& io, int out_fd, int err_fd, bool timestamps,
          std::size_t high_water = kDefaultHighWater);
  ~Console();
  Console(const Console&) = delete;
  Console& operator=(const Console&) = delete;

  // stream: 0 stdout, 1 stderr. `prefix` like "[rank3]:". A cut piece gets a marker.
  void line(int stream, std::string_view prefix, std::string_view text, bool cut);
  // A run of complete lines (each ending in '\n', from LineSplitter::feed_runs), as one
  // line() call per line or piece of `max_line` bytes would append them, in bulk.
  void lines(int stream, std::string_view prefix, std::string_view run, std::size_t max_line);
  // True when `stream` is a terminal: use relay() for it instead of line().
  bool live(int stream) const { return live_[stream]; }
  // The size of the terminal the console writes to (stdout's, else stderr's); nullopt
  // when neither is a terminal or its size is unknown.
  std::optional<winsize> window_size() const;
  // Lines get a time stamp (--timestamps).
  bool timestamps() const { return timestamps_; }
  // Live output of one worker stream (`who` and its `state` identify it): see above.
  void relay(int stream, const void* who, LiveLine& state, std::string_view prefix, std::string_view data);
  // The worker stream ended: its open line, if any, gets its newline; a progress bar that
  // another worker's output wiped shows its last state again, on a line of its own.
  void end_relay(int stream, const void* who, LiveLine& state, std::string_view prefix);
  // `who` is going away: forget it (without writing anything).
  void forget(const void* who);
  // Writes (or queues) what is buffered; called after each batch of lines from one read.
  void flush();
  // As flush(), once the io_context has run the handlers that are ready now (asynchronous
  // mode; synchronous: at once): the lines of several workers' reads in one event-loop
  // round go to each writer as one buffer, one wake-up and one write. Above kFlushSoonMax
  // bytes buffered it flushes at once, so back-pressure (congested()) still sees them.
  void flush_soon();
  // Starts a batch: refreshes the timestamp used by line().
  void begin_batch();
  // Writes (or queues) `text` as is, after everything before it on that stream.
  void write(int stream, std::string_view text);
  // Log files: writes (or queues) `data` to `fd`; close_file closes fd after what was
  // queued for it. In asynchronous mode one writer thread serves every log file and their
  // queue counts for congested() too. The console owns fd from the first call on.
  void write_file(int fd, std::string_view data);
  void close_file(int fd);

  // Asynchronous mode: too much is queued; stop producing. Always false when synchronous.
  bool congested() const;
  // Runs `resume` on the io_context once the console is no longer congested (at once,
  // posted, if it is not). The io_context keeps running meanwhile.
  void when_uncongested(std::function<void()> resume);

  static constexpr std::string_view kCutMarker = " [mglaunch: line continues]";

 private:
  struct Async;
  void init_live();
  int queue_of(int stream) const { return same_tty_ ? 0 : stream; }
  // Ends the open line of queue q: with a newline, or wiped when `interrupted` (another
  // worker writes) and it is a progress bar on a terminal that can erase.
  void break_line(int q, bool interrupted = true);
  bool live_[2] = {false, false};
  bool same_tty_ = false;             // stdout and stderr are one terminal: one queue, one open line
  bool can_clear_ = false;            // the terminal knows "erase to the end of the line" (TERM is set, not dumb)
  const void* owner_[2] = {nullptr, nullptr};  // whose line is open on each queue
  LiveLine* owner_line_[2] = {nullptr, nullptr};
  int fds_[2];
  bool timestamps_;
  std::string stamp_;
  std::string stamped_;  // stamp_ + a prefix, for lines() with timestamps
  std::string buf_[2];
  bool flush_posted_ = false;
  std::shared_ptr<int> alive_ = std::make_shared<int>(0);  // expires with the console: a posted flush checks it
  std::unique_ptr<Async> async_;  // null: synchronous
};

// Writes all of `data` to fd, retrying on EINTR/partial writes; gives up silently on
// errors (a closed console must not kill the agent). process/fd.h's write_fully says
// whether everything was written.
void write_all(int fd, std::string_view data);

// Opens an output file (a trace, a metrics log) for writing without ever blocking: a FIFO
// that no process reads is refused (ENXIO) instead of hanging the agent before any worker
// starts. The descriptor returned is blocking again (the console's writer thread writes it).
// -1 with errno set on failure. `flags` adds O_TRUNC or O_APPEND.
int open_output_file(const std::string& path, int flags);

}  // namespace mg
