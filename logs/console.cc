#include "logs/console.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <iterator>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdlib>
#include <condition_variable>
#include <ctime>
#include <deque>
#include <mutex>
#include <optional>
#include <thread>

#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/post.hpp>
#include <fmt/format.h>

#include "process/fd.h"
#include "process/thread.h"

namespace mg {

namespace asio = boost::asio;

namespace {

// writev() of `parts`, all of them, retrying on EINTR and partial writes; whether
// everything was written.
bool write_fully(int fd, std::vector<std::string>& parts) {
  std::vector<iovec> iov;
  iov.reserve(parts.size());
  for (auto& p : parts)
    if (!p.empty()) iov.push_back({p.data(), p.size()});
  std::size_t i = 0;
  while (i < iov.size()) {
    const ssize_t n = ::writev(fd, &iov[i], static_cast<int>(std::min<std::size_t>(iov.size() - i, IOV_MAX)));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    for (auto left = static_cast<std::size_t>(n); left > 0;) {
      const std::size_t take = std::min(left, iov[i].iov_len);
      iov[i].iov_base = static_cast<char*>(iov[i].iov_base) + take;
      iov[i].iov_len -= take;
      left -= take;
      if (iov[i].iov_len == 0) ++i;
    }
  }
  return true;
}

// Queue entries of one file are written together (one writev) up to this many bytes, so a
// writer that fell behind catches up in few system calls and without copying.
constexpr std::size_t kMaxWrite = 1024 * 1024;
// Written buffers kept for reuse (per stream), so a steady relay neither allocates nor
// faults in fresh pages for each batch.
constexpr std::size_t kSpareBuffers = 4;

}  // namespace

void write_all(int fd, std::string_view data) { write_fully(fd, data); }

// The asynchronous half. `queued`, `waiting` are shared with the writer threads (atomics);
// the queues are under their stream's mutex; `waiters` and `guard` belong to the io thread.
// Streams: 0 stdout, 1 stderr, 2 log files (one writer for all of them).
struct Console::Async {
  struct Item {
    int fd = -1;
    std::string data;
    bool close = false;  // close fd once what came before is written
  };
  struct Stream {
    std::mutex m;
    std::condition_variable cv;
    std::deque<Item> q;
    std::vector<std::string> spares;  // written buffers, cleared, for spare()
    bool stop = false;
    std::atomic<std::size_t> queued{0};
    std::thread thread;
  };
  static constexpr int kFiles = 2;

  Async(asio::io_context& io, int out_fd, int err_fd, std::size_t high_water)
      : io(io), high(high_water ? high_water : 1), low(high / 4), fds{out_fd, err_fd} {}  // writers start on demand

  ~Async() {
    for (auto& s : streams) {
      {
        std::lock_guard<std::mutex> lk(s.m);
        s.stop = true;
      }
      s.cv.notify_one();
    }
    for (auto& s : streams)
      if (s.thread.joinable()) s.thread.join();  // after writing what was queued
  }

  void push(int stream, std::string data) {
    if (data.empty()) return;
    push_item(stream, {fds[stream], std::move(data), false});
  }

  // A cleared buffer with room from an earlier batch of `stream`, if one came back.
  std::string spare(int stream) {
    auto& s = streams[stream];
    std::lock_guard<std::mutex> lk(s.m);
    if (s.spares.empty()) return {};
    std::string b = std::move(s.spares.back());
    s.spares.pop_back();
    return b;
  }

  void push_item(int stream, Item item) {
    auto& s = streams[stream];
    // A stream's writer starts with its first item: a run with quiet workers starts no thread.
    if (!s.thread.joinable()) s.thread = signal_free_thread([this, &s] { run(s); });
    s.queued += item.data.size();
    {
      std::lock_guard<std::mutex> lk(s.m);
      s.q.push_back(std::move(item));
    }
    s.cv.notify_one();
  }

  bool above(std::size_t limit) const {
    return std::any_of(std::begin(streams), std::end(streams), [&](const Stream& s) { return s.queued.load() > limit; });
  }

  // Writer thread of one stream: blocking writes of whole queue entries, in order; the
  // entries for one file that are queued together go out in one writev().
  void run(Stream& s) {
    std::vector<int> failed;  // fds that failed (a closed console): skip their data
    std::vector<std::string> parts;
    for (;;) {
      int fd = -1;
      bool close = false;
      std::size_t bytes = 0;
      {
        std::unique_lock<std::mutex> lk(s.m);
        s.cv.wait(lk, [&] { return s.stop || !s.q.empty(); });
        if (s.q.empty()) return;
        fd = s.q.front().fd;
        while (!s.q.empty() && s.q.front().fd == fd && !close && (parts.empty() || bytes < kMaxWrite)) {
          Item& it = s.q.front();
          close = it.close;
          bytes += it.data.size();
          parts.push_back(std::move(it.data));
          s.q.pop_front();
        }
      }
      const bool bad = std::find(failed.begin(), failed.end(), fd) != failed.end();
      if (!bad && bytes > 0 && !write_fully(fd, parts)) failed.push_back(fd);
      if (close) {
        ::close(fd);
        failed.erase(std::remove(failed.begin(), failed.end(), fd), failed.end());
      }
      {
        std::lock_guard<std::mutex> lk(s.m);
        for (auto& p : parts) {
          if (s.spares.size() >= kSpareBuffers || p.capacity() > kMaxWrite) break;
          p.clear();
          s.spares.push_back(std::move(p));
        }
      }
      parts.clear();
      s.queued -= bytes;
      if (waiting.load() && !above(low)) asio::post(io, [this] { resume(); });
    }
  }

  void when_uncongested(std::function<void()> f) {
    waiters.push_back(std::move(f));
    if (!guard) guard.emplace(io.get_executor());  // paused readers are no reason to stop
    waiting = true;
    if (!above(low)) asio::post(io, [this] { resume(); });  // drained meanwhile
  }

  // io thread: runs the paused readers once the queues are low.
  void resume() {
    if (waiters.empty() || above(low)) return;
    auto ready = std::move(waiters);
    waiters.clear();
    waiting = false;
    guard.reset();
    for (auto& f : ready) f();
  }

  asio::io_context& io;
  const std::size_t high, low;
  const int fds[2];
  Stream streams[3];
  std::atomic<bool> waiting{false};
  std::vector<std::function<void()>> waiters;
  std::optional<asio::executor_work_guard<asio::io_context::executor_type>> guard;
};

Console::Console(int out_fd, int err_fd, bool timestamps) : fds_{out_fd, err_fd}, timestamps_(timestamps) {
  init_live();
}

Console::Console(asio::io_context& io, int out_fd, int err_fd, bool timestamps, std::size_t high_water)
    : fds_{out_fd, err_fd}, timestamps_(timestamps), async_(std::make_unique<Async>(io, out_fd, err_fd, high_water)) {
  init_live();
}

void Console::init_live() {
  for (int s = 0; s < 2; ++s) live_[s] = ::isatty(fds_[s]) == 1;
  const char* term = std::getenv("TERM");
  can_clear_ = term && *term && std::string_view(term) != "dumb";
  struct stat a{}, b{};
  same_tty_ = live_[0] && live_[1] && ::fstat(fds_[0], &a) == 0 && ::fstat(fds_[1], &b) == 0 && a.st_rdev == b.st_rdev;
}

std::optional<winsize> Console::window_size() const {
  for (int s = 0; s < 2; ++s) {
    winsize ws{};
    if (live_[s] && ::ioctl(fds_[s], TIOCGWINSZ, &ws) == 0 && ws.ws_col > 0) return ws;
  }
  return std::nullopt;
}

void Console::break_line(int q, bool interrupted) {
  if (!owner_[q]) return;
  // A progress bar on a terminal that another worker interrupts is wiped, not ended: it
  // comes back with its next redraw, below what came in between, so two workers' bars
  // share one line instead of one line per update. Anything else (a bar whose worker's
  // output ended, before a notice, everything in a pipe or a file) ends with a newline.
  const bool wipe = interrupted && live_[q] && can_clear_ && owner_line_[q]->redrawn;
  buf_[q].append(wipe ? "\r\x1b[K" : "\n");
  owner_line_[q]->wiped = wipe;
  owner_line_[q]->ended = !wipe;
  owner_line_[q]->at_start = true;
  owner_line_[q]->cr_pending = false;
  owner_line_[q]->redrawn = false;
  owner_[q] = nullptr;
  owner_line_[q] = nullptr;
}

void Console::relay(int stream, const void* who, LiveLine& state, std::string_view prefix, std::string_view data) {
  const int q = queue_of(stream);
  if (owner_[q] && owner_line_[q] != &state) break_line(q);
  if (timestamps_) {
    const std::string p = stamp_ + std::string(prefix);
    live_relay(buf_[q], state, p, data);
  } else {
    live_relay(buf_[q], state, prefix, data);
  }
  if (!state.at_start) {
    owner_[q] = who;
    owner_line_[q] = &state;
  } else if (owner_line_[q] == &state) {
    owner_[q] = nullptr;
    owner_line_[q] = nullptr;
  }
}

void Console::end_relay(int stream, const void* who, LiveLine& state, std::string_view prefix) {
  const int q = queue_of(stream);
  if (owner_line_[q] == &state) break_line(q, false);  // its last state stays
  else if (state.wiped) relay(stream, who, state, prefix, "\n");  // a wiped bar shows its last state again
  state = LiveLine{};
}

void Console::forget(const void* who) {
  for (int q = 0; q < 2; ++q)
    if (owner_[q] == who) {
      owner_[q] = nullptr;
      owner_line_[q] = nullptr;
    }
}

Console::~Console() {
  flush();
  async_.reset();  // blocks until the queues are written
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
  const int q = queue_of(stream);
  break_line(q);
  std::string& b = buf_[q];
  b.append(stamp_);
  b.append(prefix);
  b.append(text);
  if (cut) b.append(kCutMarker);
  b.push_back('\n');
}

void Console::lines(int stream, std::string_view prefix, std::string_view run, std::size_t max_line) {
  const int q = queue_of(stream);
  break_line(q);
  if (!stamp_.empty()) {
    stamped_.assign(stamp_).append(prefix);
    prefix = stamped_;
  }
  append_prefixed_lines(buf_[q], prefix, run, max_line, kCutMarker);
}

void Console::flush() {
  for (int s = 0; s < 2; ++s) {
    if (buf_[s].empty()) continue;
    if (async_) {
      async_->push(s, std::move(buf_[s]));
      buf_[s] = async_->spare(s);
    } else {
      write_all(fds_[s], buf_[s]);
      buf_[s].clear();
    }
  }
}

void Console::flush_soon() {
  if (!async_) {
    flush();
    return;
  }
  if (buf_[0].size() + buf_[1].size() > kFlushSoonMax) {
    flush();
    return;
  }
  if (flush_posted_) return;
  flush_posted_ = true;
  asio::post(async_->io, [this, alive = std::weak_ptr<int>(alive_)] {
    if (alive.expired()) return;
    flush_posted_ = false;
    flush();
  });
}

void Console::write(int stream, std::string_view text) {
  stream = queue_of(stream);
  break_line(stream, false);  // a notice: the bar above it keeps its last state
  flush();
  if (async_) {
    async_->push(stream, std::string(text));
  } else {
    write_all(fds_[stream], text);
  }
}

void Console::write_file(int fd, std::string_view data) {
  if (data.empty()) return;
  if (async_) {
    async_->push_item(Async::kFiles, {fd, std::string(data), false});
  } else {
    write_all(fd, data);
  }
}

void Console::close_file(int fd) {
  if (async_) {
    async_->push_item(Async::kFiles, {fd, {}, true});
  } else {
    ::close(fd);
  }
}

bool Console::congested() const { return async_ && async_->above(async_->high); }

void Console::when_uncongested(std::function<void()> resume) {
  if (!async_) {
    resume();
    return;
  }
  async_->when_uncongested(std::move(resume));
}

int open_output_file(const std::string& path, int flags) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC | O_NONBLOCK | flags, 0644);
  if (fd < 0) return -1;
  if (const int fl = ::fcntl(fd, F_GETFL); fl >= 0) ::fcntl(fd, F_SETFL, fl & ~O_NONBLOCK);
  return fd;
}

}  // namespace mg
