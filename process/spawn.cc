#include "process/spawn.h"
#include "process/reap.h"

#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <linux/close_range.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include <fmt/format.h>

#include "process/dirents.h"
#include "process/fd.h"

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#endif

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

bool SpawnError::no_child() const {
  return step && (std::strcmp(step, "clone") == 0 || std::strcmp(step, "mmap") == 0);
}

std::string SpawnError::message() const {
  return fmt::format("{}: {}", step ? step : "spawn", std::strerror(code));
}

namespace {

// The child's stack: its own mapping, with an inaccessible guard page below it so that
// an overflow faults instead of writing into the parent's memory. Touched pages only cost.
constexpr std::size_t kChildStack = 256 * 1024;

// What the parent and the child share (the child runs in the parent's memory).
struct ChildArgs {
  const SpawnRequest* req;
  pid_t parent;
  // Written by the child when a step fails, read by the parent after the child exited.
  const char* step = nullptr;
  int code = 0;
};

// The child, between clone and exec: async-signal-safe calls only, no allocation, no lock.
// Returning ends it (glibc's clone calls exit with the value).
int child_main(void* p) {
  auto* a = static_cast<ChildArgs*>(p);
  const SpawnRequest& r = *a->req;
  auto fail = [a](const char* step) {
    a->code = errno;
    a->step = step;
    return 127;
  };
  // 1. Every signal to its default action, before the mask is cleared: no handler of the
  // parent may run here (it would run in the parent's memory), and no SIG_IGN of the
  // parent is passed on. SIGKILL and SIGSTOP cannot change. glibc refuses its own two
  // (SIGCANCEL, SIGSETXID: 32 and 33) with EINVAL; the kernel call resets them, since an
  // ancestor that is not a glibc program may have left them ignored, which exec keeps.
  struct sigaction dfl {};
  dfl.sa_handler = SIG_DFL;
  sigemptyset(&dfl.sa_mask);
  struct KernelSigaction {  // the kernel's struct sigaction (with sa_restorer: x86-64, arm64)
    void (*handler)(int);
    unsigned long flags;
    void (*restorer)();
    unsigned long mask;
  } kdfl{SIG_DFL, 0, nullptr, 0};
  for (int sig = 1; sig < _NSIG; ++sig)
    if (sig != SIGKILL && sig != SIGSTOP && ::sigaction(sig, &dfl, nullptr) != 0)
      ::syscall(SYS_rt_sigaction, sig, &kdfl, nullptr, sizeof(kdfl.mask));
  // 2. Its own process group.
  if (r.own_group && ::setpgid(0, 0) != 0) return fail("setpgid");
  // 3. Killed with the thread that made it (see spawn.h), and at once if it is gone already.
  if (r.die_with_parent) {
    if (::prctl(PR_SET_PDEATHSIG, SIGKILL) != 0) return fail("prctl");
    if (::getppid() != a->parent) return 128 + SIGKILL;
  }
  // 4. The CPU set and the descriptor limit.
  if (r.cpus && ::sched_setaffinity(0, sizeof(cpu_set_t), r.cpus) != 0) return fail("sched_setaffinity");
  if (r.nofile && ::setrlimit(RLIMIT_NOFILE, r.nofile) != 0) return fail("setrlimit");
  // 5. stdin, stdout, stderr. A source that is itself one of 0..2 (but not its own
  // target) moves above 2 first, so that no dup2 overwrites a source still to be used.
  int src[3];
  for (int i = 0; i < 3; ++i) {
    src[i] = r.fds[i] < 0 ? i : r.fds[i];
    if (src[i] < 3 && src[i] != i && (src[i] = ::fcntl(src[i], F_DUPFD_CLOEXEC, 3)) < 0) return fail("dup");
  }
  for (int i = 0; i < 3; ++i) {
    if (src[i] != i) {
      if (::dup2(src[i], i) < 0) return fail("dup2");
    } else if (::fcntl(i, F_SETFD, 0) != 0 && r.fds[i] >= 0) {  // a given one must be open
      return fail("fcntl");
    }
  }
  if (!mark_cloexec_above_stderr()) return fail("close_range");
  // 6. The program, with an empty signal mask.
  sigset_t none;
  sigemptyset(&none);
  ::sigprocmask(SIG_SETMASK, &none, nullptr);
  ::execve(r.path, const_cast<char* const*>(r.argv), const_cast<char* const*>(r.envp));
  return fail("execve");
}

std::size_t page_size() {
  static const std::size_t page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  return page;
}

// Every signal blocked, glibc's own included (pthread_sigmask leaves those out), as glibc's
// posix_spawn does: no handler of the parent runs in the child before it reset them.
void block_all_signals(unsigned long long& old) {
  const unsigned long long all = ~0ULL;
  ::syscall(SYS_rt_sigprocmask, SIG_SETMASK, &all, &old, sizeof(all));
}
void restore_signals(const unsigned long long& old) {
  ::syscall(SYS_rt_sigprocmask, SIG_SETMASK, &old, nullptr, sizeof(old));
}

}  // namespace

pid_t spawn_process(const SpawnRequest& req, SpawnError& error) {
  error = {};
  const std::size_t guard = page_size();
  void* map = ::mmap(nullptr, guard + kChildStack, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_STACK,
                     -1, 0);
  if (map == MAP_FAILED) {
    error = {"mmap", errno};
    return -1;
  }
  ::mprotect(map, guard, PROT_NONE);  // a guard is a safety net: no reason to fail the spawn
  char* stack = static_cast<char*>(map) + guard;
  ChildArgs args{&req, ::getpid()};
  unsigned long long old_mask = 0;
  block_all_signals(old_mask);
  // The calling thread waits here until the child has exec'd or exited (CLONE_VFORK).
  const pid_t pid = ::clone(child_main, stack + kChildStack, CLONE_VM | CLONE_VFORK | SIGCHLD, &args);
  const int clone_errno = errno;
  restore_signals(old_mask);
#if defined(__SANITIZE_ADDRESS__)
  // Frames the child left by exec keep their red zones poisoned in the shared shadow.
  __asan_unpoison_memory_region(stack, kChildStack);
#endif
  ::munmap(map, guard + kChildStack);
  if (pid < 0) {
    error = {"clone", clone_errno};
    errno = clone_errno;
    return -1;
  }
  if (args.step) {
    // It exited 127 before its program ran: reap it, and say why.
    int status = 0;
    while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    error = {args.step, args.code};
    errno = args.code;
    return -1;
  }
  return pid;
}

bool reap_by(pid_t pid, std::chrono::steady_clock::time_point deadline, int& status) {
  status = 0;
  const int pidfd = open_pidfd(pid);
  bool reaped = false;
  for (;;) {
    const pid_t r = ::waitpid(pid, &status, WNOHANG);
    if (r < 0 && errno == EINTR) continue;
    if (r == pid || (r < 0 && errno == ECHILD)) {
      if (r < 0) status = 0;
      reaped = true;
      break;
    }
    if (r < 0) break;
    const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()).count();
    if (left <= 0) break;
    // A traced child's pidfd is readable once it exits, before we may reap it: then slices.
    pollfd p{pidfd, POLLIN, 0};
    const bool exited = pidfd >= 0 && ::poll(&p, 1, 0) > 0;
    ::poll(exited || pidfd < 0 ? nullptr : &p, exited || pidfd < 0 ? 0 : 1,
           static_cast<int>(std::min<long long>(left, exited || pidfd < 0 ? 5 : 1000)));
  }
  if (pidfd >= 0) ::close(pidfd);
  return reaped;
}

}  // namespace mg
