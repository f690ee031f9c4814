#include "launcher/worker_process.h"

#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <linux/close_range.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <dirent.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstring>

#include <boost/asio/post.hpp>
#include <boost/asio/readable_pipe.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/process/v2/posix/default_launcher.hpp>
#include <boost/process/v2/process.hpp>
#include <boost/process/v2/stdio.hpp>
#include <fmt/format.h>

namespace mg {

namespace asio = boost::asio;
namespace bp = boost::process::v2;

bool mark_cloexec_above_stderr() {
#if defined(SYS_close_range) && defined(CLOSE_RANGE_CLOEXEC)
  if (::syscall(SYS_close_range, 3U, ~0U, CLOSE_RANGE_CLOEXEC) == 0) return true;
#endif
  return mark_cloexec_above_stderr_by_listing();
}

bool mark_cloexec_above_stderr_by_listing() {
  const int dir = ::open("/proc/self/fd", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir < 0) return false;
  alignas(8) char buf[4096];
  for (;;) {
    const long n = ::syscall(SYS_getdents64, dir, buf, sizeof(buf));
    if (n <= 0) break;
    for (long off = 0; off < n;) {
      struct Dirent64 {
        ino64_t d_ino;
        off64_t d_off;
        unsigned short d_reclen;
        unsigned char d_type;
        char d_name[1];
      };
      const auto* e = reinterpret_cast<const Dirent64*>(buf + off);
      off += e->d_reclen;
      int fd = 0;
      const char* c = e->d_name;
      if (*c < '0' || *c > '9') continue;
      for (; *c >= '0' && *c <= '9'; ++c) fd = fd * 10 + (*c - '0');
      if (fd > 2 && fd != dir) ::fcntl(fd, F_SETFD, FD_CLOEXEC);
    }
  }
  ::close(dir);
  return true;
}

namespace {

// How long after the exit we keep reading a worker's pipes (a grandchild may hold them).
constexpr std::chrono::milliseconds kDrainTimeout{2000};

// Boost.Process initializer: the environment (parent side) and, in the child between fork
// and exec, a process group of its own, death with the agent, default signal handling.
struct ChildSetup {
  const char* const* envp;
  pid_t parent;
  const cpu_set_t* cpus;  // nullptr: keep the agent's affinity

  bp::error_code on_setup(bp::posix::default_launcher& launcher, const bp::filesystem::path&, const char* const*) {
    launcher.env = envp;
    return {};
  }
  bp::error_code on_exec_setup(bp::posix::default_launcher&, const bp::filesystem::path&, const char* const*) {
    // Nothing of the agent (rendezvous sockets, other workers' pipes, log files) may reach
    // the worker. Close-on-exec rather than close: Boost's exec-error pipe must stay open
    // until the exec succeeds.
    if (!mark_cloexec_above_stderr()) return {errno, bp::system_category()};
    if (::setpgid(0, 0) != 0) return {errno, bp::system_category()};
    if (::prctl(PR_SET_PDEATHSIG, SIGKILL) != 0) return {errno, bp::system_category()};
    if (::getppid() != parent) ::_exit(128 + SIGKILL);  // the agent died before prctl
    if (cpus && ::sched_setaffinity(0, sizeof(cpu_set_t), cpus) != 0) return {errno, bp::system_category()};
    ::signal(SIGPIPE, SIG_DFL);                         // the agent ignores it; workers must not inherit that
    sigset_t none;
    sigemptyset(&none);
    ::sigprocmask(SIG_SETMASK, &none, nullptr);
    return {};
  }
};

}  // namespace

std::optional<ProcStat> parse_proc_stat(std::string_view text) {
  // "pid (comm) S ppid pgrp ...": comm is everything up to the LAST ')'.
  const auto open = text.find('(');
  const auto close = text.rfind(')');
  if (open == std::string_view::npos || close == std::string_view::npos || close < open) return std::nullopt;
  auto number = [](std::string_view& t, long& out) {
    while (!t.empty() && t.front() == ' ') t.remove_prefix(1);
    bool neg = !t.empty() && t.front() == '-';
    if (neg) t.remove_prefix(1);
    if (t.empty() || t.front() < '0' || t.front() > '9') return false;
    out = 0;
    while (!t.empty() && t.front() >= '0' && t.front() <= '9') {
      out = out * 10 + (t.front() - '0');
      if (out > (1L << 31)) return false;
      t.remove_prefix(1);
    }
    if (neg) out = -out;
    return true;
  };
  ProcStat st;
  long v = 0;
  std::string_view head = text.substr(0, open);
  if (!number(head, v) || v <= 0) return std::nullopt;
  st.pid = static_cast<pid_t>(v);
  std::string_view rest = text.substr(close + 1);
  while (!rest.empty() && rest.front() == ' ') rest.remove_prefix(1);
  if (rest.empty()) return std::nullopt;
  st.state = rest.front();
  rest.remove_prefix(1);
  if (!number(rest, v)) return std::nullopt;
  st.ppid = static_cast<pid_t>(v);
  if (!number(rest, v)) return std::nullopt;
  st.pgrp = static_cast<pid_t>(v);
  return st;
}

std::vector<ProcStat> scan_processes() {
  std::vector<ProcStat> out;
  DIR* d = ::opendir("/proc");
  if (!d) return out;
  std::string path, text;
  char buf[1024];
  while (dirent* e = ::readdir(d)) {
    if (e->d_name[0] < '1' || e->d_name[0] > '9') continue;
    path = fmt::format("/proc/{}/stat", e->d_name);
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) continue;  // gone meanwhile
    const ssize_t n = ::read(fd, buf, sizeof(buf));
    ::close(fd);
    if (n <= 0) continue;
    if (auto st = parse_proc_stat(std::string_view(buf, static_cast<std::size_t>(n)))) out.push_back(*st);
  }
  ::closedir(d);
  return out;
}

std::vector<ProcStat> descendants_of(const std::vector<ProcStat>& table, pid_t root) {
  std::vector<ProcStat> out;
  std::vector<pid_t> frontier{root};
  // Breadth-first over parent links; bounded by the table (each pid is taken once).
  std::vector<bool> taken(table.size(), false);
  while (!frontier.empty()) {
    std::vector<pid_t> next;
    for (std::size_t i = 0; i < table.size(); ++i) {
      if (taken[i] || table[i].pid == root) continue;
      if (std::find(frontier.begin(), frontier.end(), table[i].ppid) == frontier.end()) continue;
      taken[i] = true;
      next.push_back(table[i].pid);
      if (table[i].state != 'Z') out.push_back(table[i]);
    }
    frontier = std::move(next);
  }
  return out;
}

struct WorkerProcess::Impl {
  explicit Impl(asio::io_context& io) : pipes{asio::readable_pipe(io), asio::readable_pipe(io)}, drain(io) {}
  std::array<asio::readable_pipe, 2> pipes;
  std::array<std::array<char, 64 * 1024>, 2> bufs;
  std::array<bool, 2> open{false, false};
  std::array<int, 2> files{-1, -1};  // log files; the console closes them
  std::array<std::unique_ptr<LineSplitter>, 2> splitters;
  std::unique_ptr<bp::basic_process_handle<asio::io_context::executor_type>> handle;
  asio::steady_timer drain;
};

WorkerProcess::WorkerProcess(asio::io_context& io, WorkerSpec spec, Console& console, DoneHandler on_done)
    : io_(io), spec_(std::move(spec)), console_(console), on_done_(std::move(on_done)), impl_(std::make_unique<Impl>(io)) {
  prefix_ = fmt::format("[rank{}]:", spec_.rank);
  for (int s = 0; s < 2; ++s) {
    impl_->splitters[s] = std::make_unique<LineSplitter>(spec_.max_line_bytes);
    if (!spec_.log_file[s].empty()) {
      // O_NONBLOCK only for the open (a FIFO without a reader must not hang the agent);
      // the console's writer thread writes blocking.
      const int fd = ::open(spec_.log_file[s].c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NONBLOCK, 0666);
      if (fd < 0) {
        spawn_error_ = fmt::format("cannot open log file {}: {}", spec_.log_file[s], std::strerror(errno));
        continue;
      }
      ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
      impl_->files[s] = fd;
    }
  }
  std::vector<const char*> envp;
  envp.reserve(spec_.env.size() + 1);
  for (const auto& kv : spec_.env) envp.push_back(kv.c_str());
  envp.push_back(nullptr);
  std::vector<std::string> args(spec_.argv.begin() + 1, spec_.argv.end());

  start_ = std::chrono::steady_clock::now();
  bp::error_code ec;
  if (spawn_error_.empty()) {
    cpu_set_t cpu_set;
    CPU_ZERO(&cpu_set);
    for (int c : spec_.cpus)
      if (c >= 0 && c < CPU_SETSIZE) CPU_SET(c, &cpu_set);
    bp::posix::default_launcher launcher;
    auto proc = launcher(io.get_executor(), ec, bp::filesystem::path(spec_.executable), args,
                         bp::process_stdio{{}, impl_->pipes[0], impl_->pipes[1]}, ChildSetup{envp.data(), ::getpid(), spec_.cpus.empty() ? nullptr : &cpu_set});
    if (ec) {
      spawn_error_ = fmt::format("cannot start {}: {}", spec_.executable, ec.message());
    } else {
      pid_ = proc.id();
      impl_->handle = std::make_unique<bp::basic_process_handle<asio::io_context::executor_type>>(proc.detach());
    }
  }
  if (!spawn_error_.empty()) {
    for (auto& p : impl_->pipes) p.close(ec);
    // Report the failure from the event loop, never from inside the constructor.
    asio::post(io_, [this] { on_exit(127 << 8); });
    return;
  }
  for (int s = 0; s < 2; ++s) {
    impl_->open[s] = true;
    read_more(s);
  }
  impl_->handle->async_wait([this](bp::error_code ec, int status) { on_exit(ec ? (127 << 8) : status); });
}

WorkerProcess::~WorkerProcess() {
  if (pid_ > 0 && !exited_) {
    ::killpg(pid_, SIGKILL);
    bp::error_code ec;
    int status = 0;
    if (impl_->handle) impl_->handle->wait(status, ec);  // reap; SIGKILL cannot be ignored
  }
  for (int fd : impl_->files)
    if (fd >= 0) console_.close_file(fd);  // after what is queued for it
}

void WorkerProcess::signal_group(int sig) {
  if (pid_ <= 0) return;
  if (!exited_) {  // the unreaped leader holds the group id: it cannot name another group
    ::killpg(pid_, sig);
    return;
  }
  // Once the leader is reaped the id could in principle be reused after the group
  // empties: signal only while one of our own descendants is still in the group.
  const auto mine = descendants_of(scan_processes(), ::getpid());
  if (std::any_of(mine.begin(), mine.end(), [&](const ProcStat& p) { return p.pgrp == pid_; })) ::killpg(pid_, sig);
}

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
  impl_->pipes[s].async_read_some(asio::buffer(impl_->bufs[s]), [this, s](bp::error_code ec, std::size_t n) {
    if (n > 0) on_data(s, std::string_view(impl_->bufs[s].data(), n));
    if (ec) {
      close_stream(s);
      return;
    }
    read_more(s);
  });
}

void WorkerProcess::emit(int s, std::string_view line, bool cut) {
  if (spec_.console[s]) console_.line(s, prefix_, line, cut);
  if (s == 1) {  // stderr: keep the last lines for the failure report
    if (tail_.size() == spec_.tail_lines) tail_.pop_front();
    tail_.emplace_back(line.substr(0, 512));
  }
}

void WorkerProcess::on_data(int s, std::string_view data) {
  if (impl_->files[s] >= 0) console_.write_file(impl_->files[s], data);
  if (!spec_.console[s] && s != 1) return;  // nothing to show or keep
  console_.begin_batch();
  impl_->splitters[s]->feed(data, [&](std::string_view line, bool cut) { emit(s, line, cut); });
  console_.flush();
}

void WorkerProcess::close_stream(int s) {
  if (!impl_->open[s]) return;
  impl_->open[s] = false;
  impl_->splitters[s]->finish([&](std::string_view line, bool cut) { emit(s, line, cut); });
  console_.flush();
  bp::error_code ec;
  impl_->pipes[s].close(ec);
  maybe_done();
}

void WorkerProcess::on_exit(int status) {
  if (exited_) return;
  exited_ = true;
  status_ = status;
  end_ = std::chrono::steady_clock::now();
  if (impl_->open[0] || impl_->open[1]) arm_drain();
  maybe_done();
}

void WorkerProcess::arm_drain() {
  impl_->drain.expires_after(kDrainTimeout);
  impl_->drain.async_wait([this](bp::error_code ec) {
    if (ec) return;
    // Time spent paused by a congested console does not count: what is in the pipe
    // is still to be shown.
    if ((impl_->open[0] && paused_[0]) || (impl_->open[1] && paused_[1])) {
      arm_drain();
      return;
    }
    for (int s = 0; s < 2; ++s) {
      bp::error_code ignored;
      if (impl_->open[s]) impl_->pipes[s].cancel(ignored);
    }
  });
}

void WorkerProcess::maybe_done() {
  if (done_ || !exited_ || impl_->open[0] || impl_->open[1]) return;
  done_ = true;
  impl_->drain.cancel();
  on_done_(*this);
}

}  // namespace mg
