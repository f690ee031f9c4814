// The watchdog program of the process layer (process/watchdog.h), started as the agent
// starts it: this test binary, exec'd in the hidden mode (its main hands it to
// watchdog_main), by a forked "agent" that is then killed with SIGKILL. Built twice:
// process_tests and, with ASan+UBSan, process_sanitized_tests.
#include <catch2/catch.hpp>

#include <fcntl.h>
#include <signal.h>
#include <sched.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <string>

#include "process/fd.h"
#include "process/proc.h"
#include "process/run.h"
#include "process/spawn.h"
#include "process/watchdog.h"
#include "support/proc.h"
#include "support/skip.h"

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

namespace {

// ProcessGroup (process/proc.h) against a recycled group id, made on purpose: in a user and
// pid namespace of its own, where this test may choose the next pid (ns_last_pid), a group
// leader is looked at (open), then killed and reaped, and its pid given to a new process
// that leads a group of its own; then the old group is signalled with SIGUSR1. Exit 0: the
// new group was not hit (signal() said the old one is gone); 10: it was hit; 77: this machine
// gives no such namespace or pid; other: a step failed.
int recycled_group_case(bool group_pidfd) {
  const pid_t c = ::fork();
  if (c < 0) return 2;
  if (c == 0) {
    const uid_t uid = ::getuid();
    const gid_t gid = ::getgid();
    if (::unshare(CLONE_NEWUSER | CLONE_NEWPID | CLONE_NEWNS) != 0) ::_exit(77);
    auto put = [](const char* path, const std::string& text) {
      const int fd = ::open(path, O_WRONLY | O_CLOEXEC);
      const bool ok = fd >= 0 && ::write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size());
      if (fd >= 0) ::close(fd);
      return ok;
    };
    if (!put("/proc/self/setgroups", "deny") || !put("/proc/self/uid_map", "0 " + std::to_string(uid) + " 1") ||
        !put("/proc/self/gid_map", "0 " + std::to_string(gid) + " 1"))
      ::_exit(77);
    const pid_t d = ::fork();  // pid 1 of the new namespace
    if (d == 0) {
      if (::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0 ||
          ::mount("proc", "/proc", "proc", 0, nullptr) != 0)
        ::_exit(77);
      auto leader = [] {
        const pid_t p = ::fork();
        if (p == 0) {
          ::setpgid(0, 0);
          for (;;) ::pause();
        }
        if (p > 0) ::setpgid(p, p);
        return p;
      };
      const pid_t l = leader();
      if (l <= 0) ::_exit(3);
      const auto st = mg::read_proc_stat(l);
      if (!st || st->pgrp != l) ::_exit(4);
      auto group = mg::ProcessGroup::open(l, st->starttime);
      if (!group) ::_exit(5);
      if (!group_pidfd) group->without_group_pidfd();
      ::kill(l, SIGKILL);
      int status = 0;
      if (::waitpid(l, &status, 0) != l) ::_exit(6);
      if (!put("/proc/sys/kernel/ns_last_pid", std::to_string(l - 1))) ::_exit(77);
      const pid_t x = leader();  // the recycled pid, leading a group of that id
      if (x != l) ::_exit(77);
      const int sent = group->signal(SIGUSR1);
      ::kill(x, SIGKILL);
      if (::waitpid(x, &status, 0) != x || !WIFSIGNALED(status)) ::_exit(7);
      // A fatal signal queued first decides the exit (SIGUSR1 when the new group was hit).
      if (WTERMSIG(status) == SIGUSR1) ::_exit(10);
      ::_exit(sent == 0 ? 0 : 8);
    }
    int status = 0;
    if (d < 0 || ::waitpid(d, &status, 0) != d) ::_exit(2);
    ::_exit(WIFEXITED(status) ? WEXITSTATUS(status) : 2);
  }
  int status = 0;
  if (::waitpid(c, &status, 0) != c) return 2;
  return WIFEXITED(status) ? WEXITSTATUS(status) : 2;
}

// Whether this kernel takes PIDFD_SIGNAL_PROCESS_GROUP (Linux 6.9): an unknown flag is
// EINVAL; this process leads no group, so a kernel that knows it says ESRCH.
bool kernel_signals_groups_by_pidfd() {
  mg::Fd self(mg::open_pidfd(::getpid()));
  return self && (::syscall(SYS_pidfd_send_signal, self.get(), 0, nullptr, 1U << 2) == 0 || errno == ESRCH);
}

}  // namespace

TEST_CASE("a process group signalled through its leader's pidfd is never another group that took its id after the "
          "leader was reaped") {
  // The watchdog's kill(-pgrp) after its check that the leader lives (#36): the watchdog is
  // not the leader's parent and cannot keep its zombie.
  if (!kernel_signals_groups_by_pidfd()) skip_test("this kernel has no PIDFD_SIGNAL_PROCESS_GROUP (Linux 6.9)");
  const int without = recycled_group_case(/*group_pidfd=*/false);
  if (without == 77) skip_test("no user and pid namespace, or no pid of our choosing, here (unshare, ns_last_pid)");
  CHECK(without == 10);  // kill(-pid): the window is real, the new group was hit
  CHECK(recycled_group_case(/*group_pidfd=*/true) == 0);
}

TEST_CASE("a process group is not opened for a process that is not its leader, or not the one looked at") {
  const pid_t p = ::fork();
  if (p == 0) {
    for (;;) ::pause();
  }
  REQUIRE(p > 0);
  const auto st = mg::read_proc_stat(p);
  REQUIRE(st);
  CHECK_FALSE(mg::ProcessGroup::open(p, st->starttime));  // in the test's group, leads none
  ::setpgid(p, p);
  CHECK_FALSE(mg::ProcessGroup::open(p, st->starttime + 1));  // another start: a recycled pid
  auto group = mg::ProcessGroup::open(p, st->starttime);
  REQUIRE(group);
  CHECK(group->signal(SIGKILL) == 1);
  int status = 0;
  REQUIRE(::waitpid(p, &status, 0) == p);
  CHECK(WTERMSIG(status) == SIGKILL);
  CHECK(group->signal(SIGKILL) == 0);  // gone
}
