// process/run.h: short helper commands through the one spawner, their output read under a
// deadline. Real processes (sh, sleep), every wait bounded.
#include <catch2/catch.hpp>

#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fstream>
#include <string>

#include "process/run.h"
#include "support/proc.h"

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
