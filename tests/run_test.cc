// process/run.h: short helper commands through the one spawner, their output read under a
// deadline. Real processes (sh, sleep), every wait bounded.
#include <catch2/catch.hpp>

#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <fstream>
#include <future>
#include <string>

#include "process/run.h"
#include "support/proc.h"
#include "support/skip.h"

using namespace std::chrono_literals;
using mgtest::eventually;
using mgtest::pid_alive;

namespace {

pid_t first_number(const std::string& text) {
  try {
    return static_cast<pid_t>(std::stol(text));
  } catch (...) {
    return -1;
  }
}

}  // namespace

TEST_CASE("run_capture returns a command's stdout and exit status, and drops stderr unless merged") {
  auto r = mg::run_capture({"sh", "-c", "echo out; echo err >&2; exit 3"});
  INFO(r.error);
  REQUIRE(r.started);
  CHECK_FALSE(r.timed_out);
  CHECK(WIFEXITED(r.status));
  CHECK(WEXITSTATUS(r.status) == 3);
  CHECK(r.out == "out\n");
  CHECK_FALSE(r.ok());
  mg::RunOptions merged;
  merged.merge_stderr = true;
  r = mg::run_capture({"sh", "-c", "echo out; echo err >&2"}, merged);
  CHECK(r.ok());
  CHECK(r.out == "out\nerr\n");
}

TEST_CASE("run_capture of a command not on PATH or not a program says why in one line and runs nothing") {
  auto r = mg::run_capture({"mg-no-such-command-anywhere"});
  CHECK_FALSE(r.started);
  CHECK_THAT(r.error, Catch::Contains("cannot find 'mg-no-such-command-anywhere' on PATH"));
  const std::string dir = mgtest::make_temp_dir();
  const std::string junk = dir + "/junk";
  std::ofstream(junk) << "not a program\n";
  REQUIRE(::chmod(junk.c_str(), 0755) == 0);
  r = mg::run_capture({junk});
  CHECK_FALSE(r.started);
  CHECK_THAT(r.error, Catch::Contains("cannot run " + junk) && Catch::Contains("Exec format error"));
  CHECK(r.error.find('\n') == std::string::npos);
}

TEST_CASE("run_capture kills a command past its deadline with its whole process group") {
  mg::RunOptions o;
  o.timeout = 300ms;
  // The shell prints its background sleep's pid, then waits for it: past the deadline.
  auto r = mg::run_capture({"sh", "-c", "sleep 600 & echo $!; wait"}, o);
  REQUIRE(r.started);
  CHECK(r.timed_out);
  CHECK_FALSE(r.ok());
  CHECK_THAT(r.error, Catch::Contains("killed after 300 ms"));
  CHECK(WIFSIGNALED(r.status));
  const pid_t straggler = first_number(r.out);
  REQUIRE(straggler > 0);
  CHECK(eventually([&] { return !pid_alive(straggler); }, 10s));
}

TEST_CASE("run_capture returns once the command ended, killing what it left holding the pipe") {
  mg::RunOptions o;
  o.timeout = 600s;  // never reached: the call returns as soon as the shell has exited
  auto r = mg::run_capture({"sh", "-c", "sleep 600 & echo $!; exit 0"}, o);
  INFO(r.error);
  CHECK(r.ok());
  const pid_t straggler = first_number(r.out);
  REQUIRE(straggler > 0);
  CHECK(eventually([&] { return !pid_alive(straggler); }, 10s));
}

TEST_CASE("run_capture keeps at most max_output bytes and still reads the command to its end") {
  mg::RunOptions o;
  o.max_output = 10;
  auto r = mg::run_capture({"sh", "-c", "head -c 1000000 /dev/zero; echo done >&2"}, o);
  INFO(r.error);
  CHECK(r.ok());
  CHECK(r.out.size() == 10);
}

TEST_CASE("run_capture past its deadline returns within 2 s of its SIGKILL when the command cannot be reaped "
          "(traced by another process), and says it left it behind (#36)") {
  // Before: a blocking waitpid after the SIGKILL, which waits as long as the tracer does.
  const std::string pidfile = mgtest::make_temp_dir() + "/pid";
  mg::RunOptions o;
  o.timeout = 3s;
  auto result = std::async(std::launch::async,
                           [&] { return mg::run_capture({"sh", "-c", "echo $$ > " + pidfile + "; exec sleep 600"}, o); });
  pid_t target = -1;
  REQUIRE(eventually([&] {
    std::ifstream in(pidfile);
    return static_cast<bool>(in >> target) && target > 0;
  }, 10s));
  // Another process traces the command and never waits for it. It goes, even when a check
  // fails; the command left behind is reaped then.
  struct Reap {
    pid_t command;
    ~Reap() {
      int status = 0;
      mgtest::eventually([&] { return ::waitpid(command, &status, WNOHANG) != 0; }, 10s);
    }
  } reap{target};
  mgtest::ForeignTracer tracer(target);
  if (!tracer.attached()) {
    result.wait();
    SKIP_TEST("cannot trace the command (ptrace)");
  }
  REQUIRE(result.wait_for(60s) == std::future_status::ready);  // 3 s + 2 s, on a loaded machine
  const mg::RunResult r = result.get();
  CHECK(r.timed_out);
  CHECK_THAT(r.error, Catch::Contains("could not be reaped within 2 s of SIGKILL"));
}
