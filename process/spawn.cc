#include "process/spawn.h"

#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <linux/close_range.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <vector>

#include <fmt/format.h>

#include "process/dirents.h"

namespace mg {

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

}  // namespace mg
