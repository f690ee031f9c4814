#include "launcher/watchdog.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/random.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <fmt/format.h>

#include "launcher/worker_process.h"

namespace mg {

bool environ_has_mark(std::string_view environ, std::string_view token) {
  if (token.empty()) return false;
  constexpr std::string_view key = "MGLAUNCH_RUN_MARK=";
  while (!environ.empty()) {
    std::size_t end = environ.find('\0');
    std::string_view entry = environ.substr(0, end);
    if (entry.substr(0, key.size()) == key && entry.substr(key.size()).find(token) != std::string_view::npos)
      return true;
    if (end == std::string_view::npos) break;
    environ.remove_prefix(end + 1);
  }
  return false;
}

namespace {

// Reads up to `cap` bytes of `path` into buf; -1 when it cannot be opened.
long read_small(const char* path, char* buf, std::size_t cap) {
  const int fd = ::open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return -1;
  std::size_t got = 0;
  while (got < cap) {
    const ssize_t n = ::read(fd, buf + got, cap - got);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    got += static_cast<std::size_t>(n);
  }
  ::close(fd);
  return static_cast<long>(got);
}

// Writes "/proc/<pid>/<leaf>" into out (no allocation).
void proc_path(char* out, const char* pid, const char* leaf) {
  char* p = out;
  for (const char* s = "/proc/"; *s;) *p++ = *s++;
  for (const char* s = pid; *s;) *p++ = *s++;
  *p++ = '/';
  for (const char* s = leaf; *s;) *p++ = *s++;
  *p = '\0';
}

// Big buffers live outside the child's stack; fork gives the child its own copy.
char g_environ_buf[1 << 20];
char g_dents[1 << 15];

// One pass over /proc: SIGKILL every marked process and its process group. Returns how
// many marked processes were found alive.
int kill_marked(std::string_view token) {
  const int dir = ::open("/proc", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir < 0) return 0;
  const pid_t self = ::getpid();
  int found = 0;
  for (;;) {
    const long n = ::syscall(SYS_getdents64, dir, g_dents, sizeof(g_dents));
    if (n <= 0) break;
    for (long off = 0; off < n;) {
      struct Dirent64 {
        ino64_t d_ino;
        off64_t d_off;
        unsigned short d_reclen;
        unsigned char d_type;
        char d_name[1];
      };
      const auto* e = reinterpret_cast<const Dirent64*>(g_dents + off);
      off += e->d_reclen;
      const char* name = e->d_name;
      if (*name < '1' || *name > '9') continue;
      long pid = 0;
      bool numeric = true;
      for (const char* c = name; *c; ++c) {
        if (*c < '0' || *c > '9') {
          numeric = false;
          break;
        }
        pid = pid * 10 + (*c - '0');
      }
      if (!numeric || pid == self || std::strlen(name) > 12) continue;
      char path[64];
      proc_path(path, name, "environ");
      const long len = read_small(path, g_environ_buf, sizeof(g_environ_buf));
      if (len <= 0) continue;  // gone, a zombie, a kernel thread, or not ours to read
      if (!environ_has_mark(std::string_view(g_environ_buf, static_cast<std::size_t>(len)), token)) continue;
      ++found;
      char stat[1024];
      proc_path(path, name, "stat");
      const long slen = read_small(path, stat, sizeof(stat));
      if (slen > 0)
        if (auto st = parse_proc_stat(std::string_view(stat, static_cast<std::size_t>(slen))); st && st->pgrp > 1)
          ::kill(-st->pgrp, SIGKILL);
      ::kill(static_cast<pid_t>(pid), SIGKILL);
    }
  }
  ::close(dir);
  return found;
}

[[noreturn]] void watchdog_main(int fd, const char* token, std::size_t token_len) {
  for (;;) {
    char buf[64];
    const ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n > 0 || (n < 0 && errno == EINTR)) continue;
    break;  // end of file: the agent is gone
  }
  const std::string_view tok(token, token_len);
  for (int round = 0; round < 100; ++round) {
    if (kill_marked(tok) == 0) break;
    timespec ts{0, 20 * 1000 * 1000};
    ::nanosleep(&ts, nullptr);
  }
  ::_exit(0);
}

}  // namespace

bool Watchdog::start(std::string& error) {
  unsigned char raw[16];
  if (::getrandom(raw, sizeof(raw), 0) != static_cast<ssize_t>(sizeof(raw))) {
    error = fmt::format("getrandom: {}", std::strerror(errno));
    return false;
  }
  token_.clear();
  for (unsigned char c : raw) token_ += fmt::format("{:02x}", c);
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) {
    error = fmt::format("pipe: {}", std::strerror(errno));
    return false;
  }
  const int devnull = ::open("/dev/null", O_RDWR | O_CLOEXEC);
  const char* token = token_.c_str();
  const std::size_t token_len = token_.size();
  const pid_t pid = ::fork();
  if (pid < 0) {
    error = fmt::format("fork: {}", std::strerror(errno));
    ::close(fds[0]);
    ::close(fds[1]);
    if (devnull >= 0) ::close(devnull);
    return false;
  }
  if (pid == 0) {
    // Only system calls from here on: the agent has threads.
    ::setpgid(0, 0);
    ::prctl(PR_SET_NAME, "mglaunch-watch");
    for (int sig = 1; sig < NSIG; ++sig)
      if (sig != SIGKILL && sig != SIGSTOP) ::signal(sig, SIG_DFL);
    for (int sig : {SIGINT, SIGHUP, SIGTERM, SIGQUIT, SIGTSTP, SIGTTIN, SIGTTOU, SIGPIPE, SIGUSR1, SIGUSR2})
      ::signal(sig, SIG_IGN);
    sigset_t none;
    sigemptyset(&none);
    ::sigprocmask(SIG_SETMASK, &none, nullptr);
    const int keep = ::fcntl(fds[0], F_DUPFD, 10);  // out of the way of 0..3
    if (devnull >= 0)
      for (int i = 0; i < 3; ++i) ::dup2(devnull, i);
    ::dup2(keep, 3);
    ::syscall(SYS_close_range, 4U, ~0U, 0U);
    watchdog_main(3, token, token_len);
  }
  ::close(fds[0]);
  if (devnull >= 0) ::close(devnull);
  pid_ = pid;
  pipe_fd_ = fds[1];
  return true;
}

std::string Watchdog::mark_value(const std::string& inherited) const {
  return inherited.empty() ? token_ : inherited + "," + token_;
}

void Watchdog::release(int wait_ms) {
  if (pipe_fd_ >= 0) ::close(pipe_fd_);
  pipe_fd_ = -1;
  if (pid_ <= 0) return;
  for (int waited = 0; waited <= wait_ms; waited += 5) {
    int status = 0;
    const pid_t r = ::waitpid(pid_, &status, WNOHANG);
    if (r == pid_ || (r < 0 && errno == ECHILD)) break;
    timespec ts{0, 5 * 1000 * 1000};
    ::nanosleep(&ts, nullptr);
  }
  pid_ = -1;
}

}  // namespace mg
