// fake_worker: a worker with modes, driven by the integration tests instead of shell
// one-liners. Commands run left to right:
//   env                 print the environment as one JSON object line
//   fds                 print {"fds": {"N": "target", ...}} of our open descriptors as one line
//   exit N              exit with N
//   signal N            raise signal N
//   ignore-term         ignore SIGTERM from now on
//   ignore N            ignore signal N from now on (SIGHUP, SIGINT: the agent passes those on)
//   term-file PATH      on the first SIGTERM create PATH and keep running; exit 0 on the second
//   trap-usr            print "got SIGUSR1"/"got SIGUSR2" when those arrive
//   lines N             print N lines "<rank>:<i>:<payload>" on stdout as fast as possible
//   long-line N         print one line of N 'x'
//   print T | eprint T  print T on stdout / stderr; print-nonl T: no newline
//   tty                 print "tty in=I out=O err=E size=COLSxROWS" (isatty of 0, 1, 2; the
//                       window size of stdout, "none" when it has none)
//   winch SECS          print "waiting for SIGWINCH", wait for one after which stdout's size
//                       differs from the first (exit 8 after SECS), then print
//                       "winch size=COLSxROWS" (the stdin rank gets the terminal's own
//                       SIGWINCH too, maybe before the agent resized its pseudo-terminal)
//   eprint-lines N      write N lines "err <i>" to stderr in one write() (one read for the agent)
//   error-file MSG      write a torchelastic error file with MSG to $TORCHELASTIC_ERROR_FILE
//   pidfile PATH        append our pid to PATH
//   hang SECS           sleep up to SECS seconds (signals still act)
//   alloc MB            allocate MB MiB, touch every page and keep it (RSS for the monitor tests)
//   burn SECS           keep one CPU busy for SECS seconds
//   sleep-ms N          sleep N milliseconds
//   stamp FILE TAG      append "TAG RESTART_COUNT RANK CLOCK_REALTIME_NS" to FILE
//   spawn-child K PATH  start a process that ignores SIGTERM, has /dev/null as stdio and
//                       sleeps 60 s, and append its pid to PATH. K = group: a plain child
//                       (same process group); daemon: double fork + setsid; group-usr: a
//                       plain child that appends "got SIGUSR1" to PATH.usr on SIGUSR1
//   expect-dead PATH    exit 9 unless every pid in PATH is gone within 10 s
//   wait-file PATH      wait until PATH exists (exit 8 after 30 s)
//   expect-record       exit 9, saying "no job record in DIR", unless $MGLAUNCH_RECORD_DIR
//                       holds a record (job-*.json) at once: the agent's, a test giving each
//                       agent a directory of its own
//   expect-record-in DIR  the same for DIR (another agent's directory)
//   wait-lines PATH N   wait until PATH holds at least N lines (exit 8 after 60 s): orders
//                       events between workers of different agents without a sleep
//   bind-master-plain SECS  bind 0.0.0.0:$MASTER_PORT without SO_REUSEADDR (retrying up to
//                       SECS s), release it, print "bound PORT"; exit 1 if it stayed held
//   listen-master       bind (SO_REUSEADDR, as c10d's TCPStore) and listen on
//                       0.0.0.0:$MASTER_PORT, print "listening PORT"; exit 1 on failure
//   listen-master-for SECS  the same, listening SECS seconds before it closes
//   undumpable          prctl(PR_SET_DUMPABLE, 0): its /proc/PID/fd needs CAP_SYS_PTRACE
//   when-rank R         ranks other than R hang (60 s) instead of running the rest
//   when-world-below N  hang (60 s) while WORLD_SIZE < N, then exit 0 (scale-up tests)
//   when-restart-below K  exit 0 once TORCHELASTIC_RESTART_COUNT >= K
//   fail-first-attempt R N  rank R exits N in the first attempt (restart count 0); otherwise go on
//   vfork-hang SECS     vfork a child that sleeps SECS seconds: until it ends we wait in
//                       state D (an uninterruptible wait), as the watchdog tests need
#include <dirent.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

extern char** environ;

namespace {

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v ? std::atoi(v) : fallback;
}

void hang(double seconds) {
  auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (std::chrono::steady_clock::now() < deadline) {
    timespec ts{0, 50 * 1000 * 1000};
    ::nanosleep(&ts, nullptr);
  }
}

bool alive(long pid) {
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%ld/stat", pid);
  FILE* f = std::fopen(path, "r");
  if (!f) return false;
  char buf[512] = {};
  size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  const char* close = std::strrchr(buf, ')');
  return n > 0 && close && close[1] == ' ' && close[2] != 'Z';  // a zombie is dead
}

void append_pid(const char* path, long pid) {
  int fd = ::open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  std::string line = std::to_string(pid) + "\n";
  ssize_t ignored = ::write(fd, line.data(), line.size());
  (void)ignored;
  ::close(fd);
}

char usr_path[4096];
void on_usr_to_file(int) {
  int fd = ::open(usr_path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  ssize_t ignored = ::write(fd, "got SIGUSR1\n", 12);
  (void)ignored;
  ::close(fd);
}

// The stubborn straggler: ignores SIGTERM, holds none of the worker's pipes.
[[noreturn]] void straggle() {
  ::signal(SIGTERM, SIG_IGN);
  int null = ::open("/dev/null", O_RDWR);
  for (int fd = 0; fd < 3; ++fd) ::dup2(null, fd);
  hang(60);
  ::_exit(0);
}

const char* term_path = nullptr;
volatile sig_atomic_t terms = 0;
char* volatile g_kept = nullptr;  // `alloc`'s memory, reachable so it is never optimised away
void on_term_file(int) {
  if (terms > 0) ::_exit(0);  // a read and a write, not ++ on a volatile (deprecated in C++20)
  terms = 1;
  ::close(::open(term_path, O_WRONLY | O_CREAT | O_CLOEXEC, 0644));
}

void on_usr(int sig) {
  const char* msg = sig == SIGUSR1 ? "got SIGUSR1\n" : "got SIGUSR2\n";
  ssize_t ignored = ::write(STDOUT_FILENO, msg, std::strlen(msg));
  (void)ignored;
}

}  // namespace

int main(int argc, char** argv) {
  const int rank = env_int("RANK", 0);
  for (int i = 1; i < argc; ++i) {
    std::string_view cmd = argv[i];
    auto arg = [&]() -> const char* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "fake_worker: %s needs an argument\n", argv[i]);
        std::exit(100);
      }
      return argv[++i];
    };
    if (cmd == "env") {
      nlohmann::json j = nlohmann::json::object();
      for (char** e = environ; *e; ++e) {
        std::string_view kv = *e;
        auto eq = kv.find('=');
        if (eq != std::string_view::npos) j[std::string(kv.substr(0, eq))] = std::string(kv.substr(eq + 1));
      }
      std::printf("%s\n", j.dump().c_str());
      std::fflush(stdout);
    } else if (cmd == "fds") {
      nlohmann::json fds = nlohmann::json::object();
      if (DIR* d = ::opendir("/proc/self/fd")) {
        const int own = ::dirfd(d);  // the listing's own descriptor is not inherited
        while (dirent* e = ::readdir(d)) {
          if (e->d_name[0] == '.' || std::atoi(e->d_name) == own) continue;
          char target[512] = {};
          std::string link = std::string("/proc/self/fd/") + e->d_name;
          ssize_t n = ::readlink(link.c_str(), target, sizeof(target) - 1);
          fds[e->d_name] = n > 0 ? std::string(target, static_cast<std::size_t>(n)) : std::string("?");
        }
        ::closedir(d);
      }
      std::printf("%s\n", nlohmann::json{{"fds", fds}}.dump().c_str());
      std::fflush(stdout);
    } else if (cmd == "exit") {
      std::fflush(nullptr);
      return std::atoi(arg());
    } else if (cmd == "signal") {
      std::fflush(nullptr);
      int sig = std::atoi(arg());
      ::signal(sig, SIG_DFL);
      ::raise(sig);
    } else if (cmd == "ignore-term") {
      ::signal(SIGTERM, SIG_IGN);
    } else if (cmd == "ignore") {
      ::signal(std::atoi(arg()), SIG_IGN);
    } else if (cmd == "term-file") {
      term_path = arg();
      ::signal(SIGTERM, on_term_file);
    } else if (cmd == "trap-usr") {
      ::signal(SIGUSR1, on_usr);
      ::signal(SIGUSR2, on_usr);
    } else if (cmd == "lines") {
      long n = std::atol(arg());
      static char buf[1 << 16];
      std::setvbuf(stdout, buf, _IOFBF, sizeof(buf));
      for (long k = 0; k < n; ++k) std::printf("%d:%ld:abcdefghijklmnopqrstuvwxyz0123456789\n", rank, k);
      std::fflush(stdout);
      std::setvbuf(stdout, nullptr, _IOLBF, 0);
    } else if (cmd == "long-line") {
      std::string s(std::strtoul(arg(), nullptr, 10), 'x');
      std::printf("%s\n", s.c_str());
      std::fflush(stdout);
    } else if (cmd == "print") {
      std::printf("%s\n", arg());
      std::fflush(stdout);
    } else if (cmd == "tty" || cmd == "winch") {
      winsize ws{};
      if (cmd == "winch") {
        sigset_t set;
        sigemptyset(&set);
        sigaddset(&set, SIGWINCH);
        ::sigprocmask(SIG_BLOCK, &set, nullptr);
        winsize first{};
        ::ioctl(1, TIOCGWINSZ, &first);
        std::printf("waiting for SIGWINCH\n");
        std::fflush(stdout);
        const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(std::atol(arg()));
        for (;;) {
          const auto left = std::chrono::duration_cast<std::chrono::seconds>(until - std::chrono::steady_clock::now());
          const timespec limit{std::max<long>(left.count(), 0), 0};
          if (left.count() <= 0 || ::sigtimedwait(&set, nullptr, &limit) != SIGWINCH) return 8;
          if (::ioctl(1, TIOCGWINSZ, &ws) == 0 && (ws.ws_col != first.ws_col || ws.ws_row != first.ws_row)) break;
        }
      }
      const std::string size = ::ioctl(1, TIOCGWINSZ, &ws) == 0
                                   ? std::to_string(ws.ws_col) + "x" + std::to_string(ws.ws_row)
                                   : std::string("none");
      if (cmd == "winch")
        std::printf("winch size=%s\n", size.c_str());
      else
        std::printf("tty in=%d out=%d err=%d size=%s\n", ::isatty(0), ::isatty(1), ::isatty(2), size.c_str());
      std::fflush(stdout);
    } else if (cmd == "print-nonl") {
      std::printf("%s", arg());
      std::fflush(stdout);
    } else if (cmd == "eprint-lines") {
      std::string text;
      for (long k = 0, n = std::atol(arg()); k < n; ++k) text += "err " + std::to_string(k) + "\n";
      std::fflush(stderr);
      for (std::string_view left = text; !left.empty();) {
        const ssize_t w = ::write(2, left.data(), left.size());
        if (w <= 0) break;
        left.remove_prefix(static_cast<std::size_t>(w));
      }
    } else if (cmd == "eprint") {
      std::fprintf(stderr, "%s\n", arg());
    } else if (cmd == "error-file") {
      const char* msg = arg();
      const char* path = std::getenv("TORCHELASTIC_ERROR_FILE");
      if (path) {
        nlohmann::json j = {{"message", {{"message", msg}, {"extraInfo", {{"py_callstack", "fake"}, {"timestamp", "0"}}}}}};
        if (FILE* f = std::fopen(path, "w")) {
          std::fprintf(f, "%s", j.dump().c_str());
          std::fclose(f);
        }
      }
    } else if (cmd == "pidfile") {
      int fd = ::open(arg(), O_WRONLY | O_CREAT | O_APPEND, 0644);
      std::string line = std::to_string(::getpid()) + "\n";
      ssize_t ignored = ::write(fd, line.data(), line.size());
      (void)ignored;
      ::close(fd);
    } else if (cmd == "spawn-child") {
      std::string_view kind = arg();
      const char* path = arg();
      std::fflush(nullptr);
      if (kind == "group" || kind == "group-usr") {
        std::snprintf(usr_path, sizeof(usr_path), "%s.usr", path);
        pid_t pid = ::fork();
        if (pid == 0) {
          if (kind == "group-usr") ::signal(SIGUSR1, on_usr_to_file);
          straggle();
        }
        append_pid(path, pid);
      } else if (kind == "daemon") {
        int p[2];
        if (::pipe(p) != 0) return 101;
        pid_t mid = ::fork();
        if (mid == 0) {
          ::setsid();
          if (::fork() == 0) {
            long self = ::getpid();
            ssize_t ignored = ::write(p[1], &self, sizeof(self));
            (void)ignored;
            ::close(p[1]);
            straggle();
          }
          ::_exit(0);  // the grandchild is orphaned: re-parented to a subreaper or init
        }
        ::close(p[1]);
        long pid = 0;
        if (::read(p[0], &pid, sizeof(pid)) != sizeof(pid)) return 102;
        ::close(p[0]);
        ::waitpid(mid, nullptr, 0);
        append_pid(path, pid);
      } else {
        std::fprintf(stderr, "fake_worker: spawn-child: unknown kind '%s'\n", std::string(kind).c_str());
        return 100;
      }
    } else if (cmd == "expect-dead") {
      std::vector<long> pids;
      if (FILE* f = std::fopen(arg(), "r")) {
        long pid = 0;
        while (std::fscanf(f, "%ld", &pid) == 1) pids.push_back(pid);
        std::fclose(f);
      }
      auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
      for (long pid : pids) {
        while (alive(pid) && std::chrono::steady_clock::now() < deadline) hang(0.01);
        if (alive(pid)) {
          std::fprintf(stderr, "fake_worker: pid %ld is still alive\n", pid);
          return 9;
        }
      }
    } else if (cmd == "vfork-hang") {
      const timespec ts{std::atol(arg()), 0};
      const pid_t pid = ::vfork();
      if (pid == 0) {  // shares our memory: system calls only, then _exit
        ::nanosleep(&ts, nullptr);
        ::_exit(0);
      }
      if (pid > 0) ::waitpid(pid, nullptr, 0);
    } else if (cmd == "wait-file") {
      const char* path = arg();
      auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
      while (::access(path, F_OK) != 0) {
        if (std::chrono::steady_clock::now() > deadline) return 8;
        hang(0.01);
      }
    } else if (cmd == "expect-record" || cmd == "expect-record-in") {
      const char* dir = cmd == "expect-record" ? std::getenv("MGLAUNCH_RECORD_DIR") : arg();
      bool found = false;
      if (DIR* d = dir ? ::opendir(dir) : nullptr) {
        while (const dirent* e = ::readdir(d)) {
          const std::string_view n = e->d_name;
          found = found || (n.starts_with("job-") && n.ends_with(".json"));
        }
        ::closedir(d);
      }
      if (!found) {
        std::fprintf(stderr, "fake_worker: no job record in %s\n", dir ? dir : "(MGLAUNCH_RECORD_DIR unset)");
        return 9;
      }
    } else if (cmd == "wait-lines") {
      const char* path = arg();
      const long want = std::atol(arg());
      auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
      auto lines = [&] {
        FILE* f = std::fopen(path, "r");
        if (!f) return 0L;
        long n = 0;
        for (int c; (c = std::fgetc(f)) != EOF;) n += c == '\n';
        std::fclose(f);
        return n;
      };
      while (lines() < want) {
        if (std::chrono::steady_clock::now() > deadline) return 8;
        hang(0.01);
      }
    } else if (cmd == "undumpable") {
      // Not dumpable: who lacks CAP_SYS_PTRACE cannot read /proc/PID/fd (#35).
      if (::prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0) return 1;
    } else if (cmd == "listen-master" || cmd == "listen-master-for") {
      // listen-master-for SECS: keeps listening for SECS seconds before it closes.
      const double hold = cmd == "listen-master-for" ? std::atof(arg()) : 0;
      const int port = env_int("MASTER_PORT", 0);
      int fd = ::socket(AF_INET, SOCK_STREAM, 0);
      const int one = 1;
      ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
      sockaddr_in a{};
      a.sin_family = AF_INET;
      a.sin_addr.s_addr = htonl(INADDR_ANY);
      a.sin_port = htons(static_cast<uint16_t>(port));
      if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 || ::listen(fd, 16) != 0) {
        std::fprintf(stderr, "listen-master: 0.0.0.0:%d: %s (EADDRINUSE=%d)\n", port, std::strerror(errno),
                     errno == EADDRINUSE);
        return 1;
      }
      std::printf("listening %d\n", port);
      std::fflush(stdout);
      if (hold > 0) hang(hold);
      ::close(fd);
    } else if (cmd == "bind-master-plain") {
      // Binds 0.0.0.0:$MASTER_PORT without SO_REUSEADDR (any other socket bound there makes
      // it fail), retrying for up to SECS seconds, then lets it go; exit 1 if it never could.
      const double secs = std::strtod(arg(), nullptr);
      const int port = env_int("MASTER_PORT", 0);
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(secs);
      for (;;) {
        int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        sockaddr_in a{};
        a.sin_family = AF_INET;
        a.sin_addr.s_addr = htonl(INADDR_ANY);
        a.sin_port = htons(static_cast<uint16_t>(port));
        const bool bound = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
        ::close(fd);
        if (bound) break;
        if (std::chrono::steady_clock::now() > deadline) {
          std::fprintf(stderr, "bind-master-plain: 0.0.0.0:%d stayed held\n", port);
          return 1;
        }
        hang(0.01);
      }
      std::printf("bound %d\n", port);
      std::fflush(stdout);
    } else if (cmd == "stamp") {
      const char* path = arg();
      const char* tag = arg();
      timespec ts{};
      ::clock_gettime(CLOCK_REALTIME, &ts);
      std::string line = std::string(tag) + " " + std::to_string(env_int("TORCHELASTIC_RESTART_COUNT", 0)) + " " +
                         std::to_string(rank) + " " + std::to_string(ts.tv_sec * 1000000000LL + ts.tv_nsec) + "\n";
      int fd = ::open(path, O_WRONLY | O_CREAT | O_APPEND, 0644);
      ssize_t ignored = ::write(fd, line.data(), line.size());
      (void)ignored;
      ::close(fd);
    } else if (cmd == "alloc") {
      const std::size_t bytes = static_cast<std::size_t>(std::atof(arg()) * 1024 * 1024);
      char* p = static_cast<char*>(std::malloc(bytes));
      if (!p) return 103;
      for (std::size_t at = 0; at < bytes; at += 4096) p[at] = 1;  // resident now; never freed
      g_kept = p;
    } else if (cmd == "burn") {
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(std::atof(arg()));
      volatile unsigned long spin = 0;
      while (std::chrono::steady_clock::now() < deadline)
        for (int k = 0; k < 100000; ++k) spin = spin + 1;
    } else if (cmd == "hang") {
      hang(std::atof(arg()));
    } else if (cmd == "sleep-ms") {
      hang(std::atof(arg()) / 1000.0);
    } else if (cmd == "when-rank") {
      if (rank != std::atoi(arg())) {
        hang(60);
        return 0;
      }
    } else if (cmd == "when-world-below") {
      if (env_int("WORLD_SIZE", 1) < std::atoi(arg())) {
        hang(60);
        return 0;
      }
    } else if (cmd == "fail-first-attempt") {
      const int r = std::atoi(arg()), code = std::atoi(arg());
      if (rank == r && env_int("TORCHELASTIC_RESTART_COUNT", 0) == 0) {
        std::fflush(nullptr);
        return code;
      }
    } else if (cmd == "when-restart-below") {
      if (env_int("TORCHELASTIC_RESTART_COUNT", 0) >= std::atoi(arg())) return 0;
    } else {
      std::fprintf(stderr, "fake_worker: unknown command '%s'\n", argv[i]);
      return 100;
    }
  }
  std::fflush(nullptr);
  return 0;
}
