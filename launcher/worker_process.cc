#include "launcher/worker_process.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/ioctl.h>
#include <sys/wait.h>
#include <termios.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include <boost/asio/post.hpp>
#include <boost/asio/readable_pipe.hpp>
#include <boost/asio/steady_timer.hpp>
#include <fmt/format.h>

#include "cli/errors.h"
#include "launcher/report.h"
#include "process/reap.h"

namespace mg {

namespace asio = boost::asio;
using error_code = boost::system::error_code;

namespace {

// How long after the exit we keep reading a worker's pipes (a grandchild may hold them).
constexpr std::chrono::milliseconds kDrainTimeout{2000};

// A pseudo-terminal for one worker stream: {master, slave}, both close-on-exec; the slave
// passes bytes as they are written (raw: no "\n" -> "\r\n") and has `size` when it is known.
// {-1, -1} when none can be had (no /dev/ptmx, the pty limit): the caller uses a pipe.
std::array<int, 2> open_worker_pty(const std::optional<winsize>& size) {
  const int m = ::posix_openpt(O_RDWR | O_NOCTTY | O_CLOEXEC);
  if (m < 0) return {-1, -1};
  char name[64];
  int sl = -1;
  if (::grantpt(m) == 0 && ::unlockpt(m) == 0 && ::ptsname_r(m, name, sizeof(name)) == 0)
    sl = ::open(name, O_RDWR | O_NOCTTY | O_CLOEXEC);
  termios t{};
  if (sl < 0 || ::tcgetattr(sl, &t) != 0) {
    if (sl >= 0) ::close(sl);
    ::close(m);
    return {-1, -1};
  }
  ::cfmakeraw(&t);
  ::tcsetattr(sl, TCSANOW, &t);
  if (size) ::ioctl(m, TIOCSWINSZ, &*size);
  return {m, sl};
}

// The columns `text` takes on a terminal: its UTF-8 characters, escape sequences aside.
std::size_t display_width(std::string_view text) {
  std::size_t n = 0;
  for (std::size_t i = 0; i < text.size(); ++i) {
    const auto c = static_cast<unsigned char>(text[i]);
    if (c == 0x1b && i + 1 < text.size() && text[i + 1] == '[') {  // CSI: ESC [ ... final byte
      i += 2;
      while (i < text.size() && !(text[i] >= 0x40 && text[i] <= 0x7e)) ++i;
      continue;
    }
    if ((c & 0xc0) != 0x80 && c >= 0x20 && c != 0x7f) ++n;
  }
  return n;
}

// A worker's terminal size: the real one less the columns its prefix (and time stamp) takes
// on each line, so a full-width line of the worker (a progress bar) still fits, at least 1.
std::optional<winsize> worker_window(const Console& console, const std::string& prefix) {
  auto size = console.window_size();
  if (!size) return size;
  const std::size_t used = display_width(prefix) + (console.timestamps() ? Console::kStampWidth : 0);
  size->ws_col = static_cast<unsigned short>(size->ws_col > used + 1 ? size->ws_col - used : 1);
  size->ws_xpixel = 0;  // no longer the real window's pixels
  return size;
}

// Pagers a worker on a pseudo-terminal would start read that terminal, which nobody
// writes to: they would wait forever. Unless the user chose one, they print instead.
constexpr const char* kPagerVars[] = {"PAGER", "GIT_PAGER", "MANPAGER", "SYSTEMD_PAGER"};

}  // namespace

struct WorkerProcess::Impl {
  explicit Impl(asio::io_context& io) : pipes{asio::readable_pipe(io), asio::readable_pipe(io)}, drain(io) {}
  std::array<asio::readable_pipe, 2> pipes;
  std::array<std::array<char, 64 * 1024>, 2> bufs;
  std::array<bool, 2> open{false, false};
  std::array<bool, 2> pty{false, false};  // the stream is a pseudo-terminal's master, not a pipe
  std::array<int, 2> files{-1, -1};  // log files; the console closes them
  std::array<std::unique_ptr<LineSplitter>, 2> splitters;
  asio::steady_timer drain;
};

WorkerProcess::WorkerProcess(asio::io_context& io, WorkerSpec spec, Console& console, DoneHandler on_done)
    : io_(io), spec_(std::move(spec)), console_(console), on_done_(std::move(on_done)), impl_(std::make_unique<Impl>(io)) {
  prefix_ = spec_.prefix;
  for (int s = 0; s < 2; ++s) {
    impl_->splitters[s] = std::make_unique<LineSplitter>(spec_.max_line_bytes);
    if (!spec_.log_file[s].empty()) {
      // O_NONBLOCK only for the open (a FIFO without a reader must not hang the agent);
      // the console's writer thread writes blocking. Appended, not truncated: every run has
      // a directory of its own (logs/log_layout.cc), and a second process of one local rank
      // in one attempt (a standby's pre-started worker replaced by another) must not erase
      // what the first one wrote.
      const int fd = ::open(spec_.log_file[s].c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC | O_NONBLOCK, 0666);
      if (fd < 0) {
        spawn_error_ = fmt::format("cannot open log file {}: {}", spec_.log_file[s], std::strerror(errno));
        continue;
      }
      ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
      impl_->files[s] = fd;
    }
  }
  start_ = std::chrono::steady_clock::now();
  int failed_status = exit_code::kNotFound << 8;  // reported when nothing could be started
  const int nstreams = spec_.merge_streams ? 1 : 2;
  int ends[2][2] = {{-1, -1}, {-1, -1}};
  for (int s = 0; s < nstreams && spawn_error_.empty(); ++s) {
    // A stream shown on a terminal: the worker writes to a terminal too (isatty, its size).
    // Not when the stream goes to a log file too (--tee): that file gets what a pipe gets.
    if (spec_.terminal && spec_.console[s] && console_.live(s) && spec_.log_file[s].empty()) {
      const auto pty = open_worker_pty(worker_window(console_, prefix_));
      if (pty[0] >= 0) {
        ends[s][0] = pty[0];
        ends[s][1] = pty[1];
        impl_->pty[s] = true;
        continue;
      }
    }
    if (::pipe2(ends[s], O_CLOEXEC) != 0)
      spawn_error_ = fmt::format("cannot start {}: pipe: {}", spec_.executable, std::strerror(errno));
  }
  int devnull = -1;
  if (spawn_error_.empty() && spec_.stdin_fd < 0) {
    devnull = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (devnull < 0) spawn_error_ = fmt::format("cannot open /dev/null: {}", std::strerror(errno));
  }
  if (spawn_error_.empty()) {
    std::vector<std::string> pager_env;  // PAGER=cat and the like, for a worker on a pty
    if (impl_->pty[0] || impl_->pty[1])
      for (const char* var : kPagerVars) {
        const std::string eq = std::string(var) + "=";
        if (std::none_of(spec_.env.begin(), spec_.env.end(), [&](const std::string& kv) { return kv.starts_with(eq); }))
          pager_env.push_back(eq + "cat");
      }
    std::vector<const char*> envp, argv;
    envp.reserve(spec_.env.size() + pager_env.size() + 1);
    for (const auto& kv : spec_.env) envp.push_back(kv.c_str());
    for (const auto& kv : pager_env) envp.push_back(kv.c_str());
    envp.push_back(nullptr);
    argv.reserve(spec_.argv.size() + 1);
    for (const auto& a : spec_.argv) argv.push_back(a.c_str());
    argv.push_back(nullptr);
    cpu_set_t cpu_set;
    CPU_ZERO(&cpu_set);
    for (int c : spec_.cpus)
      if (c >= 0 && c < CPU_SETSIZE) CPU_SET(c, &cpu_set);
    SpawnRequest req;
    req.path = spec_.executable.c_str();
    req.argv = argv.data();
    req.envp = envp.data();
    req.fds[0] = spec_.stdin_fd >= 0 ? spec_.stdin_fd : devnull;
    req.fds[1] = ends[0][1];
    req.fds[2] = spec_.merge_streams ? ends[0][1] : ends[1][1];
    req.cpus = spec_.cpus.empty() ? nullptr : &cpu_set;
    req.nofile = spec_.nofile;
    req.own_group = !spec_.in_agent_group;
    SpawnError error;
    pid_ = spawn_process(req, error);
    if (pid_ < 0) {
      // A step in the child (the exec) failed: exit 127 as from a shell, with the reason.
      spawn_error_ = fmt::format("cannot start {}: {}", spec_.executable, error.message());
      if (error.no_child() && (error.code == EAGAIN || error.code == ENOMEM)) {  // a limit of the machine
        failed_status = exit_code::kResource << 8;
        spawn_error_ += "; " + process_limit_text();
      }
    } else if (prefix_.find(kPrefixPidMark) != std::string::npos) {
      prefix_ = replace_prefix_pid(std::move(prefix_), pid_);  // ${pid} in the line prefix template
    }
  }
  if (devnull >= 0) ::close(devnull);
  for (int s = 0; s < 2; ++s) {
    if (ends[s][1] >= 0) ::close(ends[s][1]);
    if (ends[s][0] < 0) continue;
    if (!spawn_error_.empty()) {
      ::close(ends[s][0]);
      continue;
    }
    impl_->pipes[s].assign(ends[s][0]);
    impl_->open[s] = true;
  }
  if (!spawn_error_.empty()) {
    // Report the failure from the event loop, never from inside the constructor.
    asio::post(io_, [this, failed_status, alive = std::weak_ptr<int>(alive_)] {
      if (!alive.expired()) on_exit(failed_status);
    });
    return;
  }
  for (int s = 0; s < 2; ++s)
    if (impl_->open[s]) read_more(s);
}

bool WorkerProcess::kill_and_reap(std::chrono::steady_clock::time_point deadline) {
  if (held_) {
    release();
    return true;
  }
  if (pid_ <= 0 || exited_ || left_behind_) return !left_behind_;
  if (spec_.in_agent_group) signal_family(SIGKILL);
  else ::killpg(pid_, SIGKILL);
  int status = 0;
  if (reap_by(pid_, deadline, status)) {
    exited_ = true;  // (the handle goes: on_exit's report is not wanted)
    status_ = status;
    return true;
  }
  left_behind_ = true;
  return false;
}

WorkerProcess::~WorkerProcess() {
  alive_.reset();  // before the pipes close: the reads they cancel find the handle gone
  kill_and_reap(std::chrono::steady_clock::now() + kReapBound);
  for (int fd : impl_->files)
    if (fd >= 0) console_.close_file(fd);  // after what is queued for it
  console_.forget(this);
}

void WorkerProcess::signal_family(int sig) {
  if (!exited_) ::kill(pid_, sig);  // (an unreaped pid is still ours)
  const pid_t self = ::getpid(), group = ::getpgrp();
  for (const auto& p : descendants_of(scan_family(self), self))
    if (p.pgrp == group && p.pid != pid_) signal_same_process(p, sig);
}

void WorkerProcess::signal_group(int sig) {
  if (pid_ <= 0) return;
  if (spec_.in_agent_group) {
    signal_family(sig);
    return;
  }
  // The unreaped leader (alive, or a zombie held) holds the group id: it cannot name
  // another group. Reaped, it was released after its group's SIGKILL: nothing is left.
  if (!exited_ || held_) ::killpg(pid_, sig);
}

void WorkerProcess::release() {
  if (!held_) return;
  ::killpg(pid_, SIGKILL);  // while the zombie still holds the id
  int status = 0;
  reap_by(pid_, std::chrono::steady_clock::now() + kReapBound, status);  // a zombie: at once
  held_ = false;
}

void WorkerProcess::window_changed() {
  bool any = false;
  const auto size = worker_window(console_, prefix_);
  for (int s = 0; s < 2; ++s) {
    if (!impl_->pty[s] || !impl_->open[s] || !size) continue;
    ::ioctl(impl_->pipes[s].native_handle(), TIOCSWINSZ, &*size);
    any = true;
  }
  // The pty is nobody's controlling terminal, so the kernel tells no one: the agent does.
  if (any && pid_ > 0 && !exited_) signal_group(SIGWINCH);
}

void WorkerProcess::reassign(int rank, const std::string& prefix) {
  spec_.rank = rank;
  prefix_ = prefix.find(kPrefixPidMark) != std::string::npos ? replace_prefix_pid(prefix, pid_) : prefix;
}

bool WorkerProcess::on_terminal(int s) const { return impl_->pty[s]; }

double WorkerProcess::duration_s() const {
  auto end = exited_ ? end_ : std::chrono::steady_clock::now();
  return std::chrono::duration<double>(end - start_).count();
}

void WorkerProcess::read_more(int s) {
  if ((spec_.console[s] || impl_->files[s] >= 0) && console_.congested()) {
    // Back-pressure: the worker blocks on its full pipe until the console caught up.
    paused_[s] = true;
    console_.when_uncongested([this, s, alive = std::weak_ptr<int>(alive_)] {
      if (alive.expired()) return;
      paused_[s] = false;
      if (impl_->open[s]) read_more(s);
    });
    return;
  }
  // A handle dropped with its pipes open (a retired worker still running) cancels this read:
  // the handler then comes after the handle is gone and must not touch it.
  impl_->pipes[s].async_read_some(asio::buffer(impl_->bufs[s]), [this, s, alive = std::weak_ptr<int>(alive_)](
                                                                    error_code ec, std::size_t n) {
    if (alive.expired()) return;
    if (n > 0) on_data(s, std::string_view(impl_->bufs[s].data(), n));
    if (ec) {
      close_stream(s);
      return;
    }
    read_more(s);
  });
}

void WorkerProcess::emit(int s, std::string_view line, bool cut, bool to_console) {
  if (to_console) console_.line(s, prefix_, line, cut);
  if (keeps_tail(s)) {  // stderr: keep the last lines for the failure report
    if (tail_.size() == spec_.tail_lines) tail_.pop_front();
    tail_.emplace_back(line.substr(0, 512));
  }
}

void WorkerProcess::keep_tail(int s, std::string_view run) {
  // Only the last tail_lines lines of the run can stay in the tail (each line gives at
  // least one entry): emitting just those leaves the tail as emitting every line would.
  if (spec_.tail_lines == 0 || run.empty()) return;
  std::size_t pos = run.size() - 1;  // the newline that ends the run's last line
  std::size_t start = 0;
  for (std::size_t k = 0; k < spec_.tail_lines; ++k) {
    const void* prev = pos > 0 ? ::memrchr(run.data(), '\n', pos) : nullptr;
    if (!prev) {
      start = 0;
      break;
    }
    pos = static_cast<std::size_t>(static_cast<const char*>(prev) - run.data());
    start = pos + 1;
  }
  for_each_piece(run.substr(start), impl_->splitters[s]->max_line(),
                 [&](std::string_view line, bool cut) { emit(s, line, cut, false); });
}

void WorkerProcess::on_data(int s, std::string_view data) {
  if (spec_.tap[s]) spec_.tap[s](data, false);
  if (impl_->files[s] >= 0) console_.write_file(impl_->files[s], data);
  const bool show = spec_.console[s];
  LineSplitter& splitter = *impl_->splitters[s];
  auto tail_only = [&](std::string_view run) { keep_tail(s, run); };
  auto tail_line = [&](std::string_view line, bool cut) { emit(s, line, cut, false); };
  if (show && console_.live(s)) {
    // A terminal: shown at once, partial lines included; the splitter only keeps the tail.
    console_.begin_batch();
    console_.relay(s, this, live_[s], prefix_, data);
    console_.flush();
    if (keeps_tail(s)) splitter.feed_runs(data, tail_only, tail_line);
    return;
  }
  if (!show) {
    if (keeps_tail(s)) splitter.feed_runs(data, tail_only, tail_line);
    return;
  }
  // A pipe or a file: whole lines, byte for byte; the complete ones in bulk.
  console_.begin_batch();
  if (open_line_[s]) {
    // The rest of a line that went out unfinished (below): as it comes, up to its end.
    const void* nl = ::memchr(data.data(), '\n', data.size());
    const std::size_t head = nl ? static_cast<std::size_t>(static_cast<const char*>(nl) - data.data()) + 1 : data.size();
    console_.relay(s, this, live_[s], prefix_, data.substr(0, head));
    splitter.feed_runs(data.substr(0, head), tail_only, tail_line);  // it holds the line too: it must see its end
    data.remove_prefix(head);
    if (nl) open_line_[s] = false;
    if (data.empty()) {
      console_.flush_soon();
      return;
    }
  }
  // Raw lines (no prefix, no time stamp) are never cut: a line above the limit goes out in
  // pieces as it comes, with nothing added.
  const bool raw = prefix_.empty() && !console_.timestamps();
  splitter.feed_runs(
      data,
      [&](std::string_view run) {
        console_.lines(s, prefix_, run, raw ? std::string_view::npos : splitter.max_line());
        if (keeps_tail(s)) keep_tail(s, run);
      },
      [&](std::string_view line, bool cut) {
        if (raw && (cut || open_line_[s])) {
          console_.relay(s, this, live_[s], prefix_, line);
          if (!cut) console_.relay(s, this, live_[s], prefix_, "\n");
          open_line_[s] = cut;
          emit(s, line, cut, false);
          return;
        }
        emit(s, line, cut, true);
      });
  if (splitter.has_pending()) {
    if (!open_line_[s]) {
      // A progress bar ("\r 10%|#  |") goes out now, not when its line ends, as a worker
      // writing to the pipe itself would show it; each update gets the prefix (relay()).
      // Only the unfinished end of this read is looked at: nothing per line.
      const void* nl = ::memrchr(data.data(), '\n', data.size());
      const std::size_t from = nl ? static_cast<std::size_t>(static_cast<const char*>(nl) - data.data()) + 1 : 0;
      open_line_[s] = ::memchr(data.data() + from, '\r', data.size() - from) != nullptr;
    }
    // (Already open: the rest of a raw line that was cut just now.)
    if (open_line_[s]) console_.relay(s, this, live_[s], prefix_, splitter.pending());
  }
  console_.flush_soon();
}

void WorkerProcess::close_stream(int s) {
  if (!impl_->open[s]) return;
  impl_->open[s] = false;
  const bool live = spec_.console[s] && (console_.live(s) || open_line_[s]);
  if (live) console_.end_relay(s, this, live_[s], prefix_);
  open_line_[s] = false;
  impl_->splitters[s]->finish([&](std::string_view line, bool cut) { emit(s, line, cut, spec_.console[s] && !live); });
  if (spec_.tap[s]) spec_.tap[s]({}, true);
  console_.flush();
  error_code ec;
  impl_->pipes[s].close(ec);
  maybe_done();
}

void WorkerProcess::on_exit(int status, bool held) {
  if (exited_) return;
  exited_ = true;
  held_ = held;
  status_ = status;
  end_ = std::chrono::steady_clock::now();
  if (impl_->open[0] || impl_->open[1]) arm_drain();
  maybe_done();
}

void WorkerProcess::arm_drain() {
  impl_->drain.expires_after(kDrainTimeout);
  impl_->drain.async_wait([this, alive = std::weak_ptr<int>(alive_)](error_code ec) {
    if (ec || alive.expired()) return;
    // Time spent paused by a congested console does not count: what is in the pipe
    // is still to be shown.
    if ((impl_->open[0] && paused_[0]) || (impl_->open[1] && paused_[1])) {
      arm_drain();
      return;
    }
    for (int s = 0; s < 2; ++s) {
      error_code ignored;
      if (impl_->open[s]) impl_->pipes[s].cancel(ignored);
    }
  });
}

void WorkerProcess::pause_drain() {
  drain_paused_ = true;
  if (exited_ && !done_) impl_->drain.cancel();
}

void WorkerProcess::resume_drain() {
  if (!drain_paused_) return;  // a SIGCONT without a stop before it: the drain goes on as it is
  drain_paused_ = false;
  if (exited_ && !done_ && (impl_->open[0] || impl_->open[1])) arm_drain();
}

void WorkerProcess::maybe_done() {
  if (done_ || !exited_ || impl_->open[0] || impl_->open[1]) return;
  done_ = true;
  impl_->drain.cancel();
  on_done_(*this);
}

}  // namespace mg
