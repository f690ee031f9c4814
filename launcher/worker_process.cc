#include "launcher/worker_process.h"

#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <linux/close_range.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <linux/futex.h>
#include <sys/ioctl.h>
#include <sys/wait.h>
#include <termios.h>
#include <unistd.h>

#include <dirent.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <unordered_map>

#include <boost/asio/post.hpp>
#include <boost/asio/readable_pipe.hpp>
#include <boost/asio/steady_timer.hpp>
#include <fmt/format.h>

#include "launcher/dirents.h"
#include "cli/errors.h"
#include "launcher/report.h"

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

// The child of spawn_process() runs on a stack of its own, in the agent's memory
// (CLONE_VM), while the agent goes on: it may not touch anything the agent uses, not even
// errno (the agent thread's, through the shared thread pointer). So it calls the kernel
// directly, with results as -errno.
#if defined(__x86_64__)
#define MG_RAW_SYSCALLS 1
inline long raw_syscall(long n, long a = 0, long b = 0, long c = 0, long d = 0) {
  long ret;
  register long r10 __asm__("r10") = d;
  __asm__ volatile("syscall" : "=a"(ret) : "a"(n), "D"(a), "S"(b), "d"(c), "r"(r10) : "rcx", "r11", "memory");
  return ret;
}
#elif defined(__aarch64__)
#define MG_RAW_SYSCALLS 1
inline long raw_syscall(long n, long a = 0, long b = 0, long c = 0, long d = 0) {
  register long x8 __asm__("x8") = n;
  register long x0 __asm__("x0") = a;
  register long x1 __asm__("x1") = b;
  register long x2 __asm__("x2") = c;
  register long x3 __asm__("x3") = d;
  __asm__ volatile("svc 0" : "+r"(x0) : "r"(x8), "r"(x1), "r"(x2), "r"(x3) : "memory");
  return x0;
}
#else
// Elsewhere the agent waits for the exec (CLONE_VFORK): the libc wrappers may then write
// errno, as in posix_spawn.
#define MG_RAW_SYSCALLS 0
inline long raw_syscall(long n, long a = 0, long b = 0, long c = 0, long d = 0) {
  const long r = ::syscall(n, a, b, c, d);
  return r < 0 ? -errno : r;
}
#endif

// The kernel's struct sigaction (x86-64 and arm64; rt_sigaction with an 8-byte set).
struct KernelSigaction {
  void* handler;
  unsigned long flags;
  void* restorer;
  unsigned long mask;
};

// Stacks of children between clone and exec. A stack is reused once its child has exec'd
// or exited (the kernel clears the ticket's tid word then: CLONE_CHILD_CLEARTID). Used by
// the one thread that spawns. Each stack is its own mapping with a PROT_NONE guard page
// below it, so an overflow faults in the child instead of writing into the agent's heap
// (the child shares the agent's memory); up to kKeepFree of them are kept for reuse.
constexpr std::size_t kChildStack = 64 * 1024;  // child_main needs a few hundred bytes; the
                                                // CLONE_VFORK path lists /proc/self/fd (4 KiB)
constexpr std::size_t kMaxInFlight = 128;       // then wait for the oldest child's exec
constexpr std::size_t kKeepFree = 16;

std::size_t page_size() {
  static const std::size_t page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  return page;
}

// The usable stack: kChildStack bytes above a guard page; nullptr when out of memory.
char* map_stack() {
  const std::size_t guard = page_size();
  void* m = ::mmap(nullptr, guard + kChildStack, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_STACK, -1,
                   0);
  if (m == MAP_FAILED) return nullptr;
  if (::mprotect(m, guard, PROT_NONE) != 0) {
    ::munmap(m, guard + kChildStack);
    return nullptr;
  }
  return static_cast<char*>(m) + guard;
}

void unmap_stack(char* s) { ::munmap(s - page_size(), page_size() + kChildStack); }

bool tid_cleared(const int* tid) { return __atomic_load_n(tid, __ATOMIC_ACQUIRE) == 0; }

}  // namespace

struct SpawnTicket::State {
  int tid = 1;  // zeroed by the kernel when the child execs or exits (CLONE_CHILD_CLEARTID)
  // Written by the child before it exits 127: the step that failed and its errno.
  int error = 0;
  const char* stage = nullptr;
  // What the child reads; the agent does not change it while the child may run.
  SpawnRequest req;
  cpu_set_t cpus;
  bool has_cpus = false;
  unsigned long long nofile[2] = {0, 0};  // struct rlimit64 for prlimit64
  bool has_nofile = false;
  bool waited = false;  // CLONE_VFORK: the agent is suspended until the exec
  pid_t parent = 0;
  char* stack = nullptr;  // owned until the child settles
};

namespace {

struct StackPool {
  std::vector<char*> free;
  // Children not yet settled whose ticket still owns their State.
  std::vector<SpawnTicket::State*> in_flight;
  // Children not yet settled whose ticket is gone: the pool owns their State (the kernel
  // will still clear its tid word, the child still reads its request) and frees it, with
  // the stack back to the pool, once the child has settled.
  std::vector<SpawnTicket::State*> orphans;

  char* take() {
    reclaim();
    if (in_flight.size() + orphans.size() >= kMaxInFlight) {
      // Far ahead of the children (a saturated machine): wait for the oldest one's exec,
      // at most 100 ms (a child stopped before its exec must not stop the agent).
      SpawnTicket::State* oldest = in_flight.empty() ? orphans.front() : in_flight.front();
      if (const int v = __atomic_load_n(&oldest->tid, __ATOMIC_ACQUIRE); v != 0) {
        timespec limit{0, 100 * 1000 * 1000};
        ::syscall(SYS_futex, &oldest->tid, FUTEX_WAIT, v, &limit, nullptr, 0);
      }
      reclaim();
    }
    if (!free.empty()) {
      char* s = free.back();
      free.pop_back();
      return s;
    }
    return map_stack();
  }
  void give(char* s) {
    if (free.size() < kKeepFree) free.push_back(s);
    else unmap_stack(s);
  }
  void reclaim() {
    std::erase_if(in_flight, [this](SpawnTicket::State* st) {
      if (!tid_cleared(&st->tid)) return false;
      give(st->stack);
      st->stack = nullptr;
      return true;
    });
    std::erase_if(orphans, [this](SpawnTicket::State* st) {
      if (!tid_cleared(&st->tid)) return false;
      give(st->stack);
      delete st;
      return true;
    });
  }
  void forget(SpawnTicket::State* st) { std::erase(in_flight, st); }
  // Takes over the State of an unsettled child whose ticket goes away.
  void adopt(SpawnTicket::State* st) {
    forget(st);
    orphans.push_back(st);
  }
  // Waits until every child spawned so far has exec'd or exited, at most until `deadline`.
  bool settle_all(std::chrono::steady_clock::time_point deadline) {
    for (;;) {
      reclaim();
      SpawnTicket::State* st = !in_flight.empty() ? in_flight.front() : !orphans.empty() ? orphans.front() : nullptr;
      if (!st) return true;
      const auto left = deadline - std::chrono::steady_clock::now();
      if (left <= std::chrono::steady_clock::duration::zero()) return false;
      const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(left).count();
      timespec limit{static_cast<time_t>(ns / 1000000000), static_cast<long>(ns % 1000000000)};
      if (const int v = __atomic_load_n(&st->tid, __ATOMIC_ACQUIRE); v != 0)
        ::syscall(SYS_futex, &st->tid, FUTEX_WAIT, v, &limit, nullptr, 0);
    }
  }
};

StackPool& stack_pool() {
  static StackPool* pool = new StackPool;  // never destroyed: children may settle during exit
  return *pool;
}

// Runs in the child: raw system calls only (see above), no allocation, no lock.
int child_main(void* p) {
  auto* st = static_cast<SpawnTicket::State*>(p);
  const SpawnRequest& r = st->req;
  auto fail = [st](const char* stage, long rc) {
    st->error = static_cast<int>(-rc);
    st->stage = stage;
    raw_syscall(SYS_exit_group, 127);
    __builtin_unreachable();
  };
  // Default dispositions before unblocking (exec would reset the caught ones, but a
  // signal could come before it); ignored ones the agent set (SIGPIPE, SIGTTIN) too. Only
  // the signals the agent (asio's signal_set) may catch.
  for (int sig : {SIGHUP, SIGINT, SIGQUIT, SIGUSR1, SIGUSR2, SIGPIPE, SIGALRM, SIGTERM, SIGCHLD, SIGCONT, SIGTSTP,
                  SIGTTIN, SIGTTOU, SIGWINCH, SIGURG, SIGXFSZ}) {
    const bool agent_ignores = sig == SIGPIPE || sig == SIGTTIN || sig == SIGTTOU;
#if MG_RAW_SYSCALLS
    KernelSigaction old{};
    if (raw_syscall(SYS_rt_sigaction, sig, 0, reinterpret_cast<long>(&old), 8) != 0) continue;
    const bool dfl = old.handler == reinterpret_cast<void*>(SIG_DFL);
    const bool ign = old.handler == reinterpret_cast<void*>(SIG_IGN);
    if (!dfl && (!ign || agent_ignores)) {
      KernelSigaction def{};  // SIG_DFL, no flags, empty mask
      raw_syscall(SYS_rt_sigaction, sig, reinterpret_cast<long>(&def), 0, 8);
    }
#else
    struct sigaction old {};
    if (::sigaction(sig, nullptr, &old) != 0) continue;
    if (old.sa_handler != SIG_DFL && (old.sa_handler != SIG_IGN || agent_ignores)) ::signal(sig, SIG_DFL);
#endif
  }
  long rc = 0;
  if ((rc = raw_syscall(SYS_setpgid, 0, 0)) != 0) fail("setpgid", rc);
  if ((rc = raw_syscall(SYS_prctl, PR_SET_PDEATHSIG, SIGKILL)) != 0) fail("prctl", rc);
  if (raw_syscall(SYS_getppid) != st->parent) raw_syscall(SYS_exit_group, 128 + SIGKILL);  // the agent died before prctl
  if (st->has_cpus &&
      (rc = raw_syscall(SYS_sched_setaffinity, 0, sizeof(cpu_set_t), reinterpret_cast<long>(&st->cpus))) != 0)
    fail("sched_setaffinity", rc);
  if (st->has_nofile &&
      (rc = raw_syscall(SYS_prlimit64, 0, RLIMIT_NOFILE, reinterpret_cast<long>(st->nofile), 0)) != 0)
    fail("setrlimit", rc);
  // fds[i] may already be i (the agent's own stdin); dup of a descriptor onto itself
  // would leave a close-on-exec flag in place, so clear it explicitly.
  for (int i = 0; i < 3; ++i) {
    if (r.fds[i] == i) {
      raw_syscall(SYS_fcntl, i, F_SETFD, 0);
    } else if ((rc = raw_syscall(SYS_dup3, r.fds[i], i, 0)) < 0) {
      fail("dup2", rc);
    }
  }
  // Nothing of the agent (rendezvous sockets, other workers' pipes, log files) may reach
  // the worker.
  if (!st->waited) {
    // Only when the kernel has CLOSE_RANGE_CLOEXEC (checked by spawn_skips_exec_wait()).
    if ((rc = raw_syscall(SYS_close_range, 3, ~0U, CLOSE_RANGE_CLOEXEC)) != 0) fail("close_range", rc);
  } else if (!mark_cloexec_above_stderr()) {
    fail("close_range", -errno);
  }
#if MG_RAW_SYSCALLS
  const unsigned long none = 0;
  raw_syscall(SYS_rt_sigprocmask, SIG_SETMASK, reinterpret_cast<long>(&none), 0, 8);
#else
  sigset_t none;
  sigemptyset(&none);
  ::sigprocmask(SIG_SETMASK, &none, nullptr);
#endif
  rc = raw_syscall(SYS_execve, reinterpret_cast<long>(r.path), reinterpret_cast<long>(r.argv),
                   reinterpret_cast<long>(r.envp));
  fail("execve", rc);
  return 127;
}

}  // namespace

bool spawn_skips_exec_wait() {
  static const bool skips = [] {
#if MG_RAW_SYSCALLS && defined(SYS_close_range) && defined(CLOSE_RANGE_CLOEXEC)
    // An empty range: accepted wherever the kernel knows CLOSE_RANGE_CLOEXEC (Linux >= 5.11).
    return ::syscall(SYS_close_range, ~0U, ~0U, CLOSE_RANGE_CLOEXEC) == 0;
#else
    return false;
#endif
  }();
  return skips;
}

SpawnTicket::SpawnTicket() = default;

SpawnTicket::~SpawnTicket() {
  if (!state_ || !state_->stack) return;
  StackPool& pool = stack_pool();
  if (tid_cleared(&state_->tid)) {
    pool.forget(state_.get());
    pool.give(state_->stack);
  } else {
    // The child has not exec'd or exited yet: it still reads the State and the kernel will
    // clear its tid word. The pool frees both once it has settled.
    pool.adopt(state_.release());
  }
}

bool SpawnTicket::settled() const { return !state_ || tid_cleared(&state_->tid); }

std::string SpawnTicket::failure() const {
  if (!state_ || !tid_cleared(&state_->tid) || state_->error == 0) return {};
  return fmt::format("{}: {}", state_->stage ? state_->stage : "spawn", std::strerror(state_->error));
}

bool spawn_settle_all(std::chrono::milliseconds timeout) {
  return stack_pool().settle_all(std::chrono::steady_clock::now() + timeout);
}

pid_t spawn_process(const SpawnRequest& req, SpawnTicket& ticket, std::string& error) {
  if (!ticket.settled()) {
    // Its child still runs on the State (and its stack): a ticket serves one child.
    error = "the spawn ticket is still in use by a child that has not exec'd or exited";
    errno = EBUSY;
    return -1;
  }
  if (ticket.state_) {
    // A settled child's State: its stack back to the pool (~SpawnTicket) before it goes.
    SpawnTicket old;
    old.state_ = std::move(ticket.state_);
  }
  auto st = std::make_unique<SpawnTicket::State>();
  st->req = req;
  if (req.cpus) {
    st->cpus = *req.cpus;
    st->has_cpus = true;
  }
  if (req.nofile) {
    auto wide = [](rlim_t v) { return v == RLIM_INFINITY ? ~0ULL : static_cast<unsigned long long>(v); };
    st->nofile[0] = wide(req.nofile->rlim_cur);
    st->nofile[1] = wide(req.nofile->rlim_max);
    st->has_nofile = true;
  }
  st->waited = req.wait_exec || !spawn_skips_exec_wait();
  st->parent = ::getpid();
  StackPool& pool = stack_pool();
  st->stack = pool.take();
  if (!st->stack) {
    error = "no memory for the child's stack";
    errno = ENOMEM;
    return -1;
  }
  // No signal handler of the agent may run in the child (it shares our memory); the child
  // resets the dispositions, then unblocks.
  sigset_t all, old;
  sigfillset(&all);
  ::pthread_sigmask(SIG_SETMASK, &all, &old);
  const int flags = CLONE_VM | CLONE_CHILD_CLEARTID | SIGCHLD | (st->waited ? CLONE_VFORK : 0);
  const pid_t pid = ::clone(child_main, st->stack + kChildStack, flags, st.get(), nullptr, nullptr, &st->tid);
  const int clone_errno = errno;
  if (pid > 0 && !st->waited) {
    // The child's own group at once, also for a signal sent before the child ran setpgid
    // (EACCES once it has exec'd: then it did so itself).
    ::setpgid(pid, pid);
  }
  ::pthread_sigmask(SIG_SETMASK, &old, nullptr);
  if (pid < 0) {
    pool.give(st->stack);
    st->stack = nullptr;
    error = fmt::format("clone: {}", std::strerror(clone_errno));
    errno = clone_errno;
    return -1;
  }
  if (tid_cleared(&st->tid)) {
    pool.give(st->stack);
    st->stack = nullptr;
  } else {
    pool.in_flight.push_back(st.get());
  }
  ticket.state_ = std::move(st);
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

namespace {

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
  // The child until its exec, and what it reads meanwhile (spawn_process's lifetimes).
  SpawnTicket ticket;
  std::vector<const char*> argv, envp;
  std::vector<std::string> pager_env;  // PAGER=cat and the like, for a worker on a pty
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
    auto& envp = impl_->envp;
    if (impl_->pty[0] || impl_->pty[1])
      for (const char* var : kPagerVars) {
        const std::string eq = std::string(var) + "=";
        if (std::none_of(spec_.env.begin(), spec_.env.end(), [&](const std::string& kv) { return kv.starts_with(eq); }))
          impl_->pager_env.push_back(eq + "cat");
      }
    envp.reserve(spec_.env.size() + impl_->pager_env.size() + 1);
    for (const auto& kv : spec_.env) envp.push_back(kv.c_str());
    for (const auto& kv : impl_->pager_env) envp.push_back(kv.c_str());
    envp.push_back(nullptr);
    auto& argv = impl_->argv;
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
    pid_ = spawn_process(req, impl_->ticket, error);
    if (pid_ < 0) {
      const int why = errno;
      spawn_error_ = fmt::format("cannot start {}: {}", spec_.executable, error);
      if (why == EAGAIN || why == ENOMEM) {  // a limit of the machine, not a missing program
        failed_status = exit_code::kResource << 8;
        spawn_error_ += "; " + process_limit_text();
      }
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

void WorkerProcess::window_changed() {
  bool any = false;
  const auto size = worker_window(console_, prefix_);
  for (int s = 0; s < 2; ++s) {
    if (!impl_->pty[s] || !impl_->open[s] || !size) continue;
    ::ioctl(impl_->pipes[s].native_handle(), TIOCSWINSZ, &*size);
    any = true;
  }
  // The pty is nobody's controlling terminal, so the kernel tells no one: the agent does.
  if (any && pid_ > 0 && !exited_) ::killpg(pid_, SIGWINCH);
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
  if (live) console_.end_relay(s, this, live_[s]);
  open_line_[s] = false;
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
  // A step before the program ran failed (the child exited 127): say which, as the
  // constructor does for failures in the agent.
  if (std::string failure = impl_->ticket.failure(); !failure.empty() && spawn_error_.empty())
    spawn_error_ = fmt::format("cannot start {}: {}", spec_.executable, failure);
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
