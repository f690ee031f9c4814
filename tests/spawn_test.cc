// Starting workers without waiting for their exec (process/spawn.h,
// spawn_process): every guarantee of the child holds in both modes (the agent returns at
// once; the agent waits, CLONE_VFORK, as where the kernel lacks what the first needs), an
// exec failure is reported after the reap exactly as before, and a large run ends with
// every worker reaped. And OpenSSL, loaded by the agent only for a token or TLS
// (launcher/openssl_lazy.cc). Real processes, every wait bounded.
#include <catch2/catch.hpp>

#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fstream>
#include <map>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "launcher/port.h"
#include "process/spawn.h"
#include "support/proc.h"
#include "support/skip.h"

using namespace mgtest;
using namespace std::chrono_literals;

namespace {

// A child started by spawn_process and reaped by the test (or killed and reaped on the way
// out, even when a check failed), with what it wrote to stdout.
struct Child {
  std::vector<std::string> args_;
  mg::SpawnTicket ticket;
  pid_t pid = -1;
  int status = -1;
  std::string out_path;

  Child(const std::vector<std::string>& args, bool wait_exec, const std::string& dir, const cpu_set_t* cpus = nullptr,
        const rlimit* nofile = nullptr)
      : args_(args), out_path(dir + "/out") {
    for (const auto& a : args_) argv.push_back(a.c_str());  // valid until the child's exec: ours
    argv.push_back(nullptr);
    envp.push_back(nullptr);
    const int out = ::open(out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    const int in = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
    mg::SpawnRequest req;
    req.path = argv[0];
    req.argv = argv.data();
    req.envp = envp.data();
    req.fds[0] = in;
    req.fds[1] = out;
    req.fds[2] = out;
    req.cpus = cpus;
    req.nofile = nofile;
    req.wait_exec = wait_exec;
    pid = mg::spawn_process(req, ticket, error);
    ::close(out);
    ::close(in);
  }
  ~Child() {
    if (pid > 0 && status == -1) {
      ::kill(pid, SIGKILL);
      int st = 0;
      ::waitpid(pid, &st, 0);
    }
  }
  bool wait(std::chrono::milliseconds timeout) {
    return eventually([&] { return ::waitpid(pid, &status, WNOHANG) == pid; }, timeout);
  }
  std::string out() const { return read_file(out_path); }

  std::string error;
  std::vector<const char*> argv, envp;
};

// The mode a spawn with `wait_exec` really runs in: where the kernel lacks what the fast
// path needs, both modes wait for the exec (CLONE_VFORK).
std::string mode_name(bool wait_exec) {
  if (wait_exec) return "asked to wait for the exec: CLONE_VFORK";
  return mg::spawn_skips_exec_wait() ? "not waiting for the exec (fast path)"
                                     : "asked not to wait, but the fast path is unavailable here: CLONE_VFORK";
}

void warn_if_fast_path_missing(bool wait_exec) {
  if (!wait_exec && !mg::spawn_skips_exec_wait())
    WARN("the fast path (no wait for the exec) is unavailable on this machine (no close_range CLOSE_RANGE_CLOEXEC, "
         "seccomp, or not x86-64/arm64): only the CLONE_VFORK path was exercised");
}

// Starts `args` with the fast path and stops the child (SIGSTOP cannot be blocked) before
// its exec; retries while the child was quicker. The child is stopped and not settled on
// return, or pid -1 when it never lost the race (bounded tries).
pid_t spawn_stopped_before_exec(mg::SpawnTicket& ticket, const char* const* argv, const char* const* envp,
                                const std::string& out_path) {
  for (int attempt = 0; attempt < 500; ++attempt) {
    const int out = ::open(out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    const int in = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
    mg::SpawnRequest req;
    req.path = argv[0];
    req.argv = argv;
    req.envp = envp;
    req.fds[0] = in;
    req.fds[1] = out;
    req.fds[2] = out;
    std::string error;
    const pid_t pid = mg::spawn_process(req, ticket, error);
    ::close(out);
    ::close(in);
    if (pid <= 0) return -1;
    ::kill(pid, SIGSTOP);
    int st = 0;
    if (::waitpid(pid, &st, WUNTRACED) == pid && WIFSTOPPED(st) && !ticket.settled()) return pid;
    ::kill(pid, SIGKILL);
    if (!WIFEXITED(st) && !WIFSIGNALED(st)) ::waitpid(pid, &st, 0);
  }
  return -1;
}

// pid is alive or a zombie, and its command name is `comm` (not a pid that came round to
// another program). A zombie keeps its name in stat (its cmdline is empty).
bool runs(pid_t pid, const std::string& comm) {
  return read_file("/proc/" + std::to_string(pid) + "/stat").find("(" + comm + ")") != std::string::npos;
}

std::set<std::string> fd_numbers(const std::string& json_line) {
  std::set<std::string> s;
  const auto j = nlohmann::json::parse(json_line);
  for (const auto& [k, v] : j["fds"].items()) s.insert(k);
  return s;
}

// SIGKILLs and reaps a child the test started, whatever happened.
struct KillAndReap {
  pid_t pid;
  ~KillAndReap() {
    ::kill(pid, SIGKILL);
    int st = 0;
    ::waitpid(pid, &st, 0);
  }
};

}  // namespace

TEST_CASE("a spawned child gets only stdin, stdout and stderr, its own process group at once, and the CPU set and "
          "descriptor limit asked for") {
  for (bool wait_exec : {false, true}) {
    INFO(mode_name(wait_exec));
    warn_if_fast_path_missing(wait_exec);
    const std::string dir = make_temp_dir();
    int leak[2];
    REQUIRE(::pipe(leak) == 0);  // no O_CLOEXEC: inherited unless the child marks it
    {
      Child c({kFakeWorker, "fds"}, wait_exec, dir);
      REQUIRE(c.pid > 0);
      // The group exists when spawn_process returns, so a signal to it cannot miss a child
      // that has not run yet.
      CHECK(::getpgid(c.pid) == c.pid);
      REQUIRE(c.wait(30s));
      CHECK(c.ticket.settled());
      REQUIRE(WIFEXITED(c.status));
      CHECK(WEXITSTATUS(c.status) == 0);
      CHECK(c.ticket.failure().empty());
      INFO(c.out());
      CHECK(fd_numbers(c.out()) == std::set<std::string>{"0", "1", "2"});
    }
    ::close(leak[0]);
    ::close(leak[1]);

    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(0, &one);
    rlimit nofile{};
    REQUIRE(::getrlimit(RLIMIT_NOFILE, &nofile) == 0);
    nofile.rlim_cur = std::min<rlim_t>(nofile.rlim_cur, 77);
    Child c({"/bin/sh", "-c", "ulimit -n; grep Cpus_allowed_list /proc/self/status"}, wait_exec, dir, &one, &nofile);
    REQUIRE(c.pid > 0);
    REQUIRE(c.wait(30s));
    const auto lines = split_lines(c.out());
    REQUIRE(lines.size() == 2);
    CHECK(lines[0] == std::to_string(nofile.rlim_cur));
    CHECK(lines[1].ends_with("\t0"));
  }
}

TEST_CASE("a spawned child starts with default signal actions and an empty signal mask, whatever the parent had") {
  for (bool wait_exec : {false, true}) {
    INFO(mode_name(wait_exec));
    warn_if_fast_path_missing(wait_exec);
    const std::string dir = make_temp_dir();
    // The parent catches SIGTERM and blocks SIGUSR1; the child must die of either.
    struct sigaction handler {}, old_term {};
    handler.sa_handler = [](int) {};
    REQUIRE(::sigaction(SIGTERM, &handler, &old_term) == 0);
    sigset_t usr1, old_mask;
    sigemptyset(&usr1);
    sigaddset(&usr1, SIGUSR1);
    REQUIRE(::pthread_sigmask(SIG_BLOCK, &usr1, &old_mask) == 0);
    for (int sig : {SIGTERM, SIGUSR1}) {
      INFO("signal " << sig);
      Child c({kFakeWorker, "hang", "30"}, wait_exec, dir);
      REQUIRE(c.pid > 0);
      // Sent at once, possibly before the child's exec: it is pending until the child
      // unblocks, then acts by default.
      REQUIRE(::killpg(c.pid, sig) == 0);
      REQUIRE(c.wait(30s));
      REQUIRE(WIFSIGNALED(c.status));
      CHECK(WTERMSIG(c.status) == sig);
    }
    ::pthread_sigmask(SIG_SETMASK, &old_mask, nullptr);
    ::sigaction(SIGTERM, &old_term, nullptr);
  }
}

TEST_CASE("a failed exec is reported once the child is reaped: exit 127 and the step with its errno") {
  for (bool wait_exec : {false, true}) {
    INFO(mode_name(wait_exec));
    warn_if_fast_path_missing(wait_exec);
    const std::string dir = make_temp_dir();
    {
      Child c({dir + "/no-such-program"}, wait_exec, dir);
      REQUIRE(c.pid > 0);
      REQUIRE(c.wait(30s));
      REQUIRE(WIFEXITED(c.status));
      CHECK(WEXITSTATUS(c.status) == 127);
      CHECK(c.ticket.failure() == "execve: No such file or directory");
    }
    const std::string garbage = dir + "/garbage";
    std::ofstream(garbage) << std::string("\x01\x02\x03 not a program\n");
    REQUIRE(::chmod(garbage.c_str(), 0755) == 0);
    Child c({garbage}, wait_exec, dir);
    REQUIRE(c.pid > 0);
    REQUIRE(c.wait(30s));
    REQUIRE(WIFEXITED(c.status));
    CHECK(WEXITSTATUS(c.status) == 127);
    CHECK(c.ticket.failure() == "execve: Exec format error");
  }
}

TEST_CASE("a child's stack is a mapping of its own with an inaccessible guard page below it, not agent heap") {
  // The child shares the agent's memory (CLONE_VM): an overflow of its stack must fault,
  // not write into the agent's heap. Both modes use the same pool of stacks.
  for (bool wait_exec : {false, true}) {
    INFO(mode_name(wait_exec));
    const std::string dir = make_temp_dir();
    Child c({"/bin/true"}, wait_exec, dir);
    REQUIRE(c.pid > 0);
    REQUIRE(c.wait(30s));
    // The pool keeps the stack mapped for the next child: a 64 KiB read-write mapping
    // right above a PROT_NONE page.
    const long page = ::sysconf(_SC_PAGESIZE);
    unsigned long prev_end = 0;
    bool prev_guard = false, found = false;
    for (const auto& line : split_lines(read_file("/proc/self/maps"))) {
      unsigned long lo = 0, hi = 0;
      char perms[5] = {};
      if (std::sscanf(line.c_str(), "%lx-%lx %4s", &lo, &hi, perms) != 3) continue;
      const std::string p(perms);
      if (prev_guard && lo == prev_end && p.starts_with("rw") && hi - lo == 64 * 1024) found = true;
      prev_guard = p == "---p" && hi - lo == static_cast<unsigned long>(page);
      prev_end = hi;
    }
    CHECK(found);
  }
}

TEST_CASE("a ticket whose child has not exec'd yet refuses a second child, and one destroyed then leaves the "
          "child's state intact until its exec") {
  if (!mg::spawn_skips_exec_wait()) {
    SKIP_TEST("the fast path (no wait for the exec) is unavailable here, so no ticket outlives its child's exec");
  }
  const std::string dir = make_temp_dir();
  const std::string out_path = dir + "/out";
  std::vector<std::string> args{kFakeWorker, "print", "exec-ok"};
  std::vector<const char*> argv;
  for (const auto& a : args) argv.push_back(a.c_str());
  argv.push_back(nullptr);
  const char* envp[] = {nullptr};

  SECTION("reuse is refused") {
    mg::SpawnTicket ticket;
    const pid_t pid = spawn_stopped_before_exec(ticket, argv.data(), envp, out_path);
    if (pid <= 0) {
      SKIP_TEST("no child could be stopped before its exec in 500 tries");
    }
    KillAndReap reap{pid};
    std::string error;
    mg::SpawnRequest req;
    req.path = argv[0];
    req.argv = argv.data();
    req.envp = envp;
    req.fds[0] = req.fds[1] = req.fds[2] = 2;
    errno = 0;
    const pid_t second = mg::spawn_process(req, ticket, error);
    if (second > 0) ::waitpid(second, nullptr, 0);
    CHECK(second == -1);
    CHECK(errno == EBUSY);
    CHECK(error.find("still in use") != std::string::npos);
  }

  SECTION("a destroyed ticket leaves the state to the child") {
    auto ticket = std::make_unique<mg::SpawnTicket>();
    const pid_t pid = spawn_stopped_before_exec(*ticket, argv.data(), envp, out_path);
    if (pid <= 0) {
      SKIP_TEST("no child could be stopped before its exec in 500 tries");
    }
    bool reaped = false;
    struct Reap {
      pid_t pid;
      bool& reaped;
      ~Reap() {
        if (reaped) return;
        ::kill(pid, SIGKILL);
        int st = 0;
        ::waitpid(pid, &st, 0);
      }
    } reap{pid, reaped};
    ticket.reset();  // before the child's exec
    // Whatever the heap hands out next is scribbled on: freed state of the child would be.
    std::vector<std::vector<unsigned char>> scribble;
    for (std::size_t size = 16; size <= 2048; size += 8)
      for (int i = 0; i < 4; ++i) scribble.emplace_back(size, 0xA5);
    REQUIRE(::kill(pid, SIGCONT) == 0);
    int st = 0;
    REQUIRE(eventually([&] { return ::waitpid(pid, &st, WNOHANG) == pid; }, 30s));
    reaped = true;
    INFO("status " << st << " output: " << read_file(out_path));
    REQUIRE(WIFEXITED(st));
    CHECK(WEXITSTATUS(st) == 0);
    CHECK(read_file(out_path) == "exec-ok\n");
  }
}

TEST_CASE("a port held by the parent is free for a plain bind once spawn_settle_all says every child has exec'd, "
          "and not while one has not") {
  if (!mg::spawn_skips_exec_wait()) {
    SKIP_TEST("the fast path (no wait for the exec) is unavailable here, so every child has exec'd already");
  }
  const std::string dir = make_temp_dir();
  std::vector<std::string> args{kFakeWorker, "hang", "30"};
  std::vector<const char*> argv;
  for (const auto& a : args) argv.push_back(a.c_str());
  argv.push_back(nullptr);
  const char* envp[] = {nullptr};
  auto plain_bind = [](int port) {  // no SO_REUSEADDR
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(static_cast<uint16_t>(port));
    const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
    ::close(fd);
    return ok;
  };
  // A port: the kernel's choice, then held as the agent holds the master port.
  int port = 0;
  {
    const int probe = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    REQUIRE(::bind(probe, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0);
    socklen_t len = sizeof(a);
    REQUIRE(::getsockname(probe, reinterpret_cast<sockaddr*>(&a), &len) == 0);
    port = ntohs(a.sin_port);
    ::close(probe);
  }
  // Held as the agent holds the master port (launcher/port.h: SO_REUSEADDR, bound, not
  // listening, close-on-exec).
  auto held = mg::PortReservation::try_hold(port);
  REQUIRE(held);
  mg::SpawnTicket ticket;
  const pid_t pid = spawn_stopped_before_exec(ticket, argv.data(), envp, dir + "/out");
  if (pid <= 0) {
    SKIP_TEST("no child could be stopped before its exec in 500 tries");
  }
  KillAndReap reap{pid};
  held.reset();
  // The child, stopped before its exec, still holds a copy of the socket.
  CHECK_FALSE(mg::spawn_settle_all(std::chrono::milliseconds(50)));
  CHECK_FALSE(plain_bind(port));
  REQUIRE(::kill(pid, SIGCONT) == 0);
  REQUIRE(mg::spawn_settle_all(std::chrono::seconds(30)));
  CHECK(ticket.settled());
  // Its copy went with the exec (close-on-exec) before the child ran a line of its own.
  CHECK(eventually([&] { return plain_bind(port); }, 30s));
}

TEST_CASE("a worker whose program cannot be exec'd fails the run with exit 127 and one root cause naming the exec "
          "error") {
  const std::string dir = make_temp_dir();
  const std::string garbage = dir + "/garbage";
  std::ofstream(garbage) << std::string("\x01\x02\x03 not a program\n");
  REQUIRE(::chmod(garbage.c_str(), 0755) == 0);
  auto r = run({kMglaunch, "--standalone", "--nproc_per_node=3", "--no_python", garbage}, {}, 60s);
  INFO(r.out << r.err);
  CHECK(r.code == 127);
  CHECK(r.err.find("message    : cannot start " + garbage + ": execve: Exec format error") != std::string::npos);
  CHECK(r.err.find("exitcode   : 127") != std::string::npos);
  CHECK(r.err.find("error_file") == std::string::npos);  // it never ran: no error file to name
}

TEST_CASE("a run of 1000 workers starts every one and ends with every one reaped") {
  const std::string dir = make_temp_dir();
  const std::string pids = dir + "/pids";
  auto r = run({kMglaunch, "--standalone", "--nproc_per_node=1000", "--no_python", kFakeWorker, "pidfile", pids}, {},
               300s);
  INFO(r.err.substr(0, 2000));
  REQUIRE(r.code == 0);
  const auto started = read_pids(pids);
  CHECK(started.size() == 1000);
  CHECK(std::set<pid_t>(started.begin(), started.end()).size() == 1000);
  // The agent exits 0 only once it has reaped each (it counts the exits it reaped), and
  // none is left behind: no worker still runs, none is a zombie (a pid that came round to
  // another program does not count).
  std::vector<pid_t> left;
  const bool none_left = eventually(
      [&] {
        left.clear();
        for (pid_t p : started)
          if (runs(p, "fake_worker")) left.push_back(p);
        return left.empty();
      },
      30s);
  INFO(left.size() << " workers still present, the first " << (left.empty() ? 0 : left.front()) << ": "
                   << (left.empty() ? "" : read_file("/proc/" + std::to_string(left.front()) + "/stat")));
  CHECK(none_left);
  CHECK(r.err.find("Too many open files") == std::string::npos);
}

namespace {

// The shared objects mapped by process `pid` whose path holds `part`.
bool maps_library(pid_t pid, const std::string& part) {
  return read_file("/proc/" + std::to_string(pid) + "/maps").find(part) != std::string::npos;
}

}  // namespace

TEST_CASE("a run without a token or TLS maps neither libssl nor libcrypto, and one with a token loads OpenSSL and "
          "completes") {
#if !defined(__x86_64__)
  SKIP_TEST("OpenSSL is loaded lazily on x86-64 only");
#endif
  const std::string dir = make_temp_dir();
  for (bool token : {false, true}) {
    INFO((token ? "with MGLAUNCH_RDZV_TOKEN" : "without a token"));
    const std::string pids = dir + (token ? "/pids-token" : "/pids");
    const std::map<std::string, std::string> env{{"MGLAUNCH_RDZV_TOKEN", token ? "a-secret" : "\x01unset"}};
    Proc agent = spawn({kMglaunch, "--standalone", "--nproc_per_node=1", "--no_python", kFakeWorker, "pidfile", pids,
                        "hang", "30"},
                       env);
    // The worker runs: the agent is past its start-up.
    REQUIRE(eventually([&] { return read_pids(pids).size() == 1; }, 60s));
    CHECK(maps_library(agent.pid, "libcrypto") == token);
    CHECK(maps_library(agent.pid, "libssl") == token);
    ::kill(agent.pid, SIGTERM);
    REQUIRE(agent.wait(60s));
    CHECK(agent.exit_code() == 128 + SIGTERM);
  }
}

TEST_CASE("a token without a loadable OpenSSL stops the run before it starts with one line naming the library and exit "
          "4") {
#if !defined(__x86_64__)
  SKIP_TEST("OpenSSL is loaded lazily on x86-64 only");
#endif
  auto r = run({kMglaunch, "--standalone", "--nproc_per_node=1", "--no_python", "/bin/true"},
               {{"MGLAUNCH_RDZV_TOKEN", "a-secret"}, {"MGLAUNCH_LIBSSL", "/nonexistent/libssl.so.3"}}, 60s);
  INFO(r.out << r.err);
  CHECK(r.code == 4);
  CHECK(r.err.starts_with("mglaunch: error: cannot load OpenSSL"));
  CHECK(r.err.find("/nonexistent/libssl.so.3") != std::string::npos);
  CHECK(split_lines(r.err).size() == 1);
}

TEST_CASE("a test's process handle removes its output files and their directory when it goes, leaving $TMPDIR as it was") {
  std::string dir;
  {
    Proc p = spawn({kFakeWorker, "print", "hello"});
    REQUIRE(p.wait(30s));
    CHECK_THAT(p.out(), Catch::Contains("hello"));
    dir = p.out_path.substr(0, p.out_path.rfind('/'));
    struct stat st{};
    REQUIRE(::stat(dir.c_str(), &st) == 0);
    Proc moved(std::move(p));  // one owner: the moved-from handle removes nothing
  }
  struct stat st{};
  CHECK(::stat(dir.c_str(), &st) != 0);
}
