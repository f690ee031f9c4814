// Workers as mglaunch starts them (the spawner itself: process_spawn_test.cc): an exec
// failure is the run's root cause with exit 127, and a large run ends with every worker
// reaped. And OpenSSL, loaded by the agent only for a token or TLS
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

#include "support/proc.h"
#include "support/skip.h"

using namespace mgtest;
using namespace std::chrono_literals;

namespace {

// pid is alive or a zombie, and its command name is `comm` (not a pid that came round to
// another program). A zombie keeps its name in stat (its cmdline is empty).
bool runs(pid_t pid, const std::string& comm) {
  return read_file("/proc/" + std::to_string(pid) + "/stat").find("(" + comm + ")") != std::string::npos;
}

}  // namespace

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
