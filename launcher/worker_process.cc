#include "launcher/worker_process.h"

#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <linux/close_range.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <dirent.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstring>
#include <unordered_map>

#include <boost/asio/post.hpp>
#include <boost/asio/readable_pipe.hpp>
#include <boost/asio/steady_timer.hpp>
#include <fmt/format.h>

#include "launcher/dirents.h"

namespace mg {

namespace asio = boost::asio;
using error_code = boost::system::error_code;

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
  for_each_dirent(dir, buf, sizeof(buf), [dir](const char* c) {
    int fd = 0;
    if (*c < '0' || *c > '9') return;
    for (; *c >= '0' && *c <= '9'; ++c) fd = fd * 10 + (*c - '0');
    if (fd > 2 && fd != dir) ::fcntl(fd, F_SETFD, FD_CLOEXEC);
  });
  ::close(dir);
  return true;
}

namespace {

// How long after the exit we keep reading a worker's pipes (a grandchild may hold them).
constexpr std::chrono::milliseconds kDrainTimeout{2000};

// What the child of spawn_process() reads (before exec it shares the parent's memory, and
// the parent is suspended until the exec or _exit: CLONE_VFORK).
struct ChildArgs {
  const SpawnRequest* req;
  pid_t parent;
  int error;          // errno of the failed step, 0 if exec succeeded
  const char* stage;  // which step failed
};

// Runs in the child on its own stack: only system calls, no allocation, no locks.
int child_main(void* p) {
  auto* a = static_cast<ChildArgs*>(p);
  const SpawnRequest& r = *a->req;
  auto fail = [&](const char* stage) {
    a->error = errno;
    a->stage = stage;
    ::_exit(127);
    return 0;
  };
  // Default dispositions before unblocking (exec would reset the caught ones, but a
  // signal could come before it); ignored ones the agent set (SIGPIPE, SIGTTIN) too. Only
  // the signals the agent (asio's signal_set) may catch: every system call here is time
  // the agent waits (CLONE_VFORK).
  for (int sig : {SIGHUP, SIGINT, SIGQUIT, SIGUSR1, SIGUSR2, SIGPIPE, SIGALRM, SIGTERM, SIGCHLD, SIGCONT, SIGTSTP,
                  SIGTTIN, SIGTTOU, SIGWINCH, SIGURG, SIGXFSZ}) {
    struct sigaction old {};
    if (::sigaction(sig, nullptr, &old) != 0) continue;
    const bool agent_ignores = sig == SIGPIPE || sig == SIGTTIN || sig == SIGTTOU;
    if (old.sa_handler != SIG_DFL && (old.sa_handler != SIG_IGN || agent_ignores)) ::signal(sig, SIG_DFL);
  }
  sigset_t none;
  sigemptyset(&none);
  if (::setpgid(0, 0) != 0) return fail("setpgid");
  if (::prctl(PR_SET_PDEATHSIG, SIGKILL) != 0) return fail("prctl");
  if (::getppid() != a->parent) ::_exit(128 + SIGKILL);  // the agent died before prctl
  if (r.cpus && ::sched_setaffinity(0, sizeof(cpu_set_t), r.cpus) != 0) return fail("sched_setaffinity");
  if (r.nofile && ::setrlimit(RLIMIT_NOFILE, r.nofile) != 0) return fail("setrlimit");
  // fds[i] may already be i (the agent's own stdin); dup2 of a descriptor onto itself
  // would leave a close-on-exec flag in place, so clear it explicitly.
  for (int i = 0; i < 3; ++i) {
    if (r.fds[i] == i) {
      ::fcntl(i, F_SETFD, 0);
    } else if (::dup2(r.fds[i], i) < 0) {
      return fail("dup2");
    }
  }
  // Nothing of the agent (rendezvous sockets, other workers' pipes, log files) may reach
  // the worker.
  if (!mark_cloexec_above_stderr()) return fail("close_range");
  ::sigprocmask(SIG_SETMASK, &none, nullptr);
  ::execve(r.path, const_cast<char* const*>(r.argv), const_cast<char* const*>(r.envp));
  return fail("execve");
}

}  // namespace

pid_t spawn_process(const SpawnRequest& req, std::string& error) {
  // One stack for every child, reused: CLONE_VFORK lets only one child use it at a time.
  static constexpr std::size_t kStack = 256 * 1024;
  static char* stack = static_cast<char*>(::mmap(nullptr, kStack, PROT_READ | PROT_WRITE,
                                                  MAP_PRIVATE | MAP_ANONYMOUS | MAP_STACK, -1, 0));
  if (stack == MAP_FAILED) {
    error = fmt::format("mmap: {}", std::strerror(errno));
    return -1;
  }
  ChildArgs args{&req, ::getpid(), 0, nullptr};
  // No signal handler of the agent may run in the child (it shares our memory).
  sigset_t all, old;
  sigfillset(&all);
  ::pthread_sigmask(SIG_SETMASK, &all, &old);
  const pid_t pid = ::clone(child_main, stack + kStack, CLONE_VM | CLONE_VFORK | SIGCHLD, &args);
  const int clone_errno = errno;
  ::pthread_sigmask(SIG_SETMASK, &old, nullptr);
  if (pid < 0) {
    error = fmt::format("clone: {}", std::strerror(clone_errno));
    return -1;
  }
  if (args.error != 0) {
    int status = 0;
    while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    error = fmt::format("{}: {}", args.stage ? args.stage : "spawn", std::strerror(args.error));
    return -1;
  }
  return pid;
}

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

std::vector<ProcStat> scan_family(pid_t root) {
  static const bool have_children = [] {
    const std::string self = fmt::format("/proc/{0}/task/{0}/children", ::getpid());
    return ::access(self.c_str(), R_OK) == 0;
  }();
  if (!have_children) return scan_processes();
  std::vector<ProcStat> out;
  std::vector<pid_t> frontier{root};
  std::unordered_set<pid_t> seen{root};  // each pid once: bounded by the tree
  char buf[4096];
  std::string list;
  while (!frontier.empty()) {
    std::vector<pid_t> next;
    for (pid_t pid : frontier) {
      // Every thread: an orphan re-parented to a subreaper goes to one of its threads.
      DIR* tasks = ::opendir(fmt::format("/proc/{}/task", pid).c_str());
      if (!tasks) continue;  // gone meanwhile
      while (dirent* t = ::readdir(tasks)) {
        if (t->d_name[0] < '1' || t->d_name[0] > '9') continue;
        const int fd = ::open(fmt::format("/proc/{}/task/{}/children", pid, t->d_name).c_str(), O_RDONLY | O_CLOEXEC);
        if (fd < 0) continue;
        list.clear();
        for (ssize_t n; (n = ::read(fd, buf, sizeof(buf))) > 0;) list.append(buf, static_cast<std::size_t>(n));
        ::close(fd);
        for (std::size_t i = 0; i < list.size();) {
          pid_t child = 0;
          for (; i < list.size() && list[i] >= '0' && list[i] <= '9'; ++i) child = child * 10 + (list[i] - '0');
          for (; i < list.size() && (list[i] < '0' || list[i] > '9'); ++i) {
          }
          if (child <= 0 || !seen.insert(child).second) continue;
          const int sfd = ::open(fmt::format("/proc/{}/stat", child).c_str(), O_RDONLY | O_CLOEXEC);
          if (sfd < 0) continue;
          const ssize_t n = ::read(sfd, buf, sizeof(buf));
          ::close(sfd);
          if (n <= 0) continue;
          if (auto st = parse_proc_stat(std::string_view(buf, static_cast<std::size_t>(n)))) {
            out.push_back(*st);
            next.push_back(child);
          }
        }
      }
      ::closedir(tasks);
    }
    frontier = std::move(next);
  }
  return out;
}

std::vector<ProcStat> descendants_of(const std::vector<ProcStat>& table, pid_t root) {
  std::unordered_map<pid_t, std::vector<std::size_t>> children;
  children.reserve(table.size());
  for (std::size_t i = 0; i < table.size(); ++i)
    if (table[i].pid != root) children[table[i].ppid].push_back(i);
  std::vector<ProcStat> out;
  std::vector<pid_t> stack{root};
  std::unordered_set<pid_t> seen{root};  // a malformed table (a cycle) must not loop
  while (!stack.empty()) {
    const pid_t p = stack.back();
    stack.pop_back();
    auto it = children.find(p);
    if (it == children.end()) continue;
    for (std::size_t i : it->second) {
      if (!seen.insert(table[i].pid).second) continue;
      stack.push_back(table[i].pid);
      if (table[i].state != 'Z') out.push_back(table[i]);
    }
  }
  return out;
}

std::unordered_set<pid_t> descendant_groups(const std::vector<ProcStat>& table, pid_t root) {
  std::unordered_set<pid_t> out;
  for (const auto& p : descendants_of(table, root)) out.insert(p.pgrp);
  return out;
}

struct WorkerProcess::Impl {
  explicit Impl(asio::io_context& io) : pipes{asio::readable_pipe(io), asio::readable_pipe(io)}, drain(io) {}
  std::array<asio::readable_pipe, 2> pipes;
  std::array<std::array<char, 64 * 1024>, 2> bufs;
  std::array<bool, 2> open{false, false};
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
  start_ = std::chrono::steady_clock::now();
  const int nstreams = spec_.merge_streams ? 1 : 2;
  int ends[2][2] = {{-1, -1}, {-1, -1}};
  for (int s = 0; s < nstreams && spawn_error_.empty(); ++s)
    if (::pipe2(ends[s], O_CLOEXEC) != 0)
      spawn_error_ = fmt::format("cannot start {}: pipe: {}", spec_.executable, std::strerror(errno));
  int devnull = -1;
  if (spawn_error_.empty() && spec_.stdin_fd < 0) {
    devnull = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (devnull < 0) spawn_error_ = fmt::format("cannot open /dev/null: {}", std::strerror(errno));
  }
  if (spawn_error_.empty()) {
    std::vector<const char*> envp;
    envp.reserve(spec_.env.size() + 1);
    for (const auto& kv : spec_.env) envp.push_back(kv.c_str());
    envp.push_back(nullptr);
    std::vector<const char*> argv;
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
    std::string error;
    pid_ = spawn_process(req, error);
    if (pid_ < 0) spawn_error_ = fmt::format("cannot start {}: {}", spec_.executable, error);
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
    asio::post(io_, [this, alive = std::weak_ptr<int>(alive_)] {
      if (!alive.expired()) on_exit(127 << 8);
    });
    return;
  }
  for (int s = 0; s < 2; ++s)
    if (impl_->open[s]) read_more(s);
}

WorkerProcess::~WorkerProcess() {
  if (pid_ > 0 && !exited_) {
    ::killpg(pid_, SIGKILL);
    int status = 0;
    while (::waitpid(pid_, &status, 0) < 0 && errno == EINTR) {  // SIGKILL cannot be ignored
    }
  }
  for (int fd : impl_->files)
    if (fd >= 0) console_.close_file(fd);  // after what is queued for it
  console_.forget(this);
}

void WorkerProcess::signal_group(int sig, const std::unordered_set<pid_t>* groups) {
  if (pid_ <= 0) return;
  if (!exited_) {  // the unreaped leader holds the group id: it cannot name another group
    ::killpg(pid_, sig);
    return;
  }
  // Once the leader is reaped the id could in principle be reused after the group
  // empties: signal only while one of our own descendants is still in the group.
  if (groups) {
    if (groups->contains(pid_)) ::killpg(pid_, sig);
    return;
  }
  if (descendant_groups(scan_family(::getpid()), ::getpid()).contains(pid_)) ::killpg(pid_, sig);
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
  impl_->pipes[s].async_read_some(asio::buffer(impl_->bufs[s]), [this, s](error_code ec, std::size_t n) {
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

void WorkerProcess::on_data(int s, std::string_view data) {
  if (impl_->files[s] >= 0) console_.write_file(impl_->files[s], data);
  const bool show = spec_.console[s];
  if (show && console_.live(s)) {
    // A terminal: shown at once, partial lines included; the splitter only keeps the tail.
    console_.begin_batch();
    console_.relay(s, this, live_[s], prefix_, data);
    console_.flush();
    if (keeps_tail(s)) impl_->splitters[s]->feed(data, [&](std::string_view line, bool cut) { emit(s, line, cut, false); });
    return;
  }
  if (!show && !keeps_tail(s)) return;  // nothing to show or keep
  console_.begin_batch();
  impl_->splitters[s]->feed(data, [&](std::string_view line, bool cut) { emit(s, line, cut, show); });
  console_.flush();
}

void WorkerProcess::close_stream(int s) {
  if (!impl_->open[s]) return;
  impl_->open[s] = false;
  const bool live = spec_.console[s] && console_.live(s);
  if (live) console_.end_relay(s, this, live_[s]);
  impl_->splitters[s]->finish([&](std::string_view line, bool cut) { emit(s, line, cut, spec_.console[s] && !live); });
  console_.flush();
  error_code ec;
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
  impl_->drain.async_wait([this](error_code ec) {
    if (ec) return;
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
  if (exited_ && !done_) impl_->drain.cancel();
}

void WorkerProcess::resume_drain() {
  if (exited_ && !done_ && (impl_->open[0] || impl_->open[1])) arm_drain();
}

void WorkerProcess::maybe_done() {
  if (done_ || !exited_ || impl_->open[0] || impl_->open[1]) return;
  done_ = true;
  impl_->drain.cancel();
  on_done_(*this);
}

}  // namespace mg
