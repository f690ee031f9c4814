// The watchdog program of the process layer (process/watchdog.h), started as the agent
// starts it: this test binary, exec'd in the hidden mode (its main hands it to
// watchdog_main), by a forked "agent" that is then killed with SIGKILL. Built twice:
// process_tests and, with ASan+UBSan, process_sanitized_tests.
#include <catch2/catch.hpp>

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <string>

#include "process/proc.h"
#include "process/run.h"
#include "process/spawn.h"
#include "process/watchdog.h"
#include "support/proc.h"

using namespace mgtest;
using namespace std::chrono_literals;

namespace {

long count_lines(const std::string& path, const std::string& prefix) {
  long n = 0;
  for (const auto& l : split_lines(read_file(path))) n += l.rfind(prefix, 0) == 0;
  return n;
}

}  // namespace

TEST_CASE("the watchdog program kills what a killed agent left behind, and exits at once when told all is clean") {
  const std::string dir = make_temp_dir();
  const std::string trace = dir + "/trace";
  for (bool killed : {true, false}) {
    INFO((killed ? "the agent is killed" : "the agent says all is clean"));
    int report[2], go[2];
    REQUIRE(::pipe2(report, O_CLOEXEC) == 0);
    REQUIRE(::pipe2(go, O_CLOEXEC) == 0);
    const pid_t agent = ::fork();
    REQUIRE(agent >= 0);
    if (agent == 0) {
      // The agent: a subreaper with a watchdog and a worker that leaves a daemon behind.
      ::prctl(PR_SET_CHILD_SUBREAPER, 1);
      ::setenv("MGLAUNCH_WATCHDOG_TRACE", trace.c_str(), 1);
      mg::Watchdog watchdog;
      std::string error;
      pid_t ids[2] = {-1, -1};
      pid_t worker = -1;
      if (watchdog.start(error)) {
        ids[0] = watchdog.pid();
        // A worker (with the run mark) whose daemon tells us its pid on the worker's stdout.
        const std::string mark = std::string(mg::kRunMarkVar) + "=" + watchdog.mark_value("");
        const char* argv[] = {"/bin/sh", "-c", "sleep 60 >/dev/null & echo $!; exec 1>&-; wait", nullptr};
        const char* envp[] = {mark.c_str(), nullptr};
        int out[2];
        if (::pipe2(out, O_CLOEXEC) == 0) {
          mg::SpawnRequest req;
          req.path = argv[0];
          req.argv = argv;
          req.envp = envp;
          req.fds[1] = out[1];
          mg::SpawnError spawn_error;
          worker = mg::spawn_process(req, spawn_error);
          ::close(out[1]);
          char buf[32] = {};
          if (worker > 0 && ::read(out[0], buf, sizeof(buf) - 1) > 0) ids[1] = std::atoi(buf);
          ::close(out[0]);
        }
      }
      [[maybe_unused]] ssize_t w = ::write(report[1], ids, sizeof(ids));
      char c = 0;
      [[maybe_unused]] ssize_t r = ::read(go[0], &c, 1);  // until the test says
      if (c == 'C') {
        // Nothing of the tree left, as the agent checks before it says so.
        ::kill(ids[1], SIGKILL);
        ::waitpid(worker, nullptr, 0);
        watchdog.release(/*clean=*/true);
      }
      ::_exit(0);
    }
    ::close(report[1]);
    ::close(go[0]);
    pid_t ids[2] = {-1, -1};
    const bool got = ::read(report[0], ids, sizeof(ids)) == static_cast<ssize_t>(sizeof(ids));
    ::close(report[0]);
    struct Cleanup {
      pid_t agent;
      pid_t* ids;
      int go;
      ~Cleanup() {
        ::close(go);
        for (int i = 0; i < 2; ++i)
          if (ids[i] > 0) ::kill(ids[i], SIGKILL);
        ::kill(agent, SIGKILL);
        ::waitpid(agent, nullptr, 0);
      }
    } cleanup{agent, ids, go[1]};
    REQUIRE(got);
    REQUIRE(ids[0] > 0);  // the watchdog
    REQUIRE(ids[1] > 0);  // the worker's daemon
    // The watchdog has seen the daemon in a snapshot.
    const long before = count_lines(trace, "snapshot ");
    REQUIRE(eventually([&] { return count_lines(trace, "snapshot ") >= before + 2; }, 60s));
    const long rounds_before = count_lines(trace, "kill round alive 0");
    if (killed) {
      REQUIRE(::kill(agent, SIGKILL) == 0);
      REQUIRE(::waitpid(agent, nullptr, 0) == agent);
      CHECK(eventually([&] { return !pid_alive(ids[1]); }, 60s));
      CHECK(eventually([&] { return count_lines(trace, "kill round alive 0") > rounds_before; }, 60s));
    } else {
      REQUIRE(::write(go[1], "C", 1) == 1);
      int status = 0;
      REQUIRE(::waitpid(agent, &status, 0) == agent);  // release() waited for the watchdog
      CHECK_FALSE(pid_alive(ids[0]));
      CHECK(count_lines(trace, "kill round alive 0") == rounds_before);  // no sweep
    }
    CHECK(eventually([&] { return !pid_alive(ids[0]); }, 60s));  // the watchdog is done
  }
}

TEST_CASE("the watchdog mode refuses to run without the agent's arguments, with one line and exit 2") {
  mg::RunOptions o;
  o.merge_stderr = true;
  o.timeout = 60s;
  char exe[4096] = {};
  REQUIRE(::readlink("/proc/self/exe", exe, sizeof(exe) - 1) > 0);
  auto r = mg::run_capture({exe, mg::kWatchdogMode}, o);
  REQUIRE(r.started);
  REQUIRE(WIFEXITED(r.status));
  CHECK(WEXITSTATUS(r.status) == 2);
  CHECK(split_lines(r.out).size() == 1);
  CHECK(r.out.starts_with("mglaunch: error: "));
}
