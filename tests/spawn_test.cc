// Starting workers without waiting for their exec (launcher/worker_process.h,
// spawn_process): every guarantee of the child holds in both modes (the agent returns at
// once; the agent waits, CLONE_VFORK, as where the kernel lacks what the first needs), an
// exec failure is reported after the reap exactly as before, and a large run ends with
// every worker reaped. And OpenSSL, loaded by the agent only for a token or TLS
// (launcher/openssl_lazy.cc). Real processes, every wait bounded.
#include <catch2/catch.hpp>

#include <fcntl.h>
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

#include "launcher/worker_process.h"
#include "support/proc.h"

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

std::set<std::string> fd_numbers(const std::string& json_line) {
  std::set<std::string> s;
  const auto j = nlohmann::json::parse(json_line);
  for (const auto& [k, v] : j["fds"].items()) s.insert(k);
  return s;
}

}  // namespace

TEST_CASE("a spawned child gets only stdin, stdout and stderr, its own process group at once, and the CPU set and "
          "descriptor limit asked for") {
  for (bool wait_exec : {false, true}) {
    INFO((wait_exec ? "waiting for the exec (CLONE_VFORK)" : "not waiting for the exec"));
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
    INFO((wait_exec ? "waiting for the exec (CLONE_VFORK)" : "not waiting for the exec"));
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
    INFO((wait_exec ? "waiting for the exec (CLONE_VFORK)" : "not waiting for the exec"));
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
  // The agent exits 0 only once it has reaped each (it counts the exits it reaped).
  CHECK(r.err.find("Too many open files") == std::string::npos);
}

namespace {

// The shared objects mapped by process `pid` whose path holds `part`.
bool maps_library(pid_t pid, const std::string& part) {
  return read_file("/proc/" + std::to_string(pid) + "/maps").find(part) != std::string::npos;
}

}  // namespace

TEST_CASE("a run without a token or TLS maps no libssl, libcrypto or libm, and one with a token loads OpenSSL and "
          "completes") {
#if !defined(__x86_64__)
  WARN("skipped: OpenSSL is loaded lazily on x86-64 only");
  return;
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
    CHECK_FALSE(maps_library(agent.pid, "libm.so"));  // the few libm functions are linked in
    ::kill(agent.pid, SIGTERM);
    REQUIRE(agent.wait(60s));
    CHECK(agent.exit_code() == 128 + SIGTERM);
  }
}

TEST_CASE("a token without a loadable OpenSSL stops the run before it starts with one line naming the library and exit "
          "4") {
#if !defined(__x86_64__)
  WARN("skipped: OpenSSL is loaded lazily on x86-64 only");
  return;
#endif
  auto r = run({kMglaunch, "--standalone", "--nproc_per_node=1", "--no_python", "/bin/true"},
               {{"MGLAUNCH_RDZV_TOKEN", "a-secret"}, {"MGLAUNCH_LIBSSL", "/nonexistent/libssl.so.3"}}, 60s);
  INFO(r.out << r.err);
  CHECK(r.code == 4);
  CHECK(r.err.starts_with("mglaunch: error: cannot load OpenSSL"));
  CHECK(r.err.find("/nonexistent/libssl.so.3") != std::string::npos);
  CHECK(split_lines(r.err).size() == 1);
}
