// The agent's worker handles (launcher/worker_group, launcher/worker_process) driven
// directly, with real processes: what the agent's runs cannot show on their own.
#include <catch2/catch.hpp>

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <sys/wait.h>

#include <chrono>
#include <optional>

#include <boost/asio/io_context.hpp>

#include "launcher/worker_group.h"
#include "logs/console.h"
#include "process/proc.h"
#include "process/watchdog.h"
#include "support/proc.h"

using namespace std::chrono_literals;

TEST_CASE("a worker retired while it still runs, its pipes open, is killed with its handle, and the reads its "
          "handle had pending leave the gone handle alone") {
  // (RetireWorkers of a pre-started worker that never said hello, or of a closing worker
  // that ignores SIGTERM; before the fix the cancelled reads ran on the freed handle: SIGSEGV.)
  boost::asio::io_context io;
  const int null_fd = ::open("/dev/null", O_WRONLY | O_CLOEXEC);
  REQUIRE(null_fd >= 0);
  pid_t pid = -1;
  {
    mg::Console console(io, null_fd, null_fd, false);
    mg::Watchdog watchdog;
    mg::WorkerGroup group(io, console, watchdog);
    mg::WorkerSpec spec;
    spec.executable = "/bin/sleep";
    spec.argv = {"sleep", "100"};
    spec.terminal = false;
    bool ended = false;
    pid = group.spawn(spec, [&](mg::WorkerProcess&) { ended = true; }).pid();
    REQUIRE(pid > 0);
    io.poll();  // its reads pending
    group.retire({});  // SIGKILL; the handle goes from the event loop
    io.run_for(1s);    // the handle goes, then its cancelled reads complete
    CHECK(group.workers().empty());
    CHECK(::kill(pid, 0) != 0);  // killed and reaped by its handle
    CHECK_FALSE(ended);          // a retired attempt's worker reports nothing
  }
  ::close(null_fd);
}

TEST_CASE("a worker's ended leader stays a zombie while the agent may signal its process group, and is reaped once "
          "the group was killed") {
  // The killpg window (#36): reaped at once, the leader's pid (the group's id) could be
  // recycled as another process's group while the agent still signals the group. Kept a
  // zombie, the id cannot be taken (the kernel frees a pid only once no process, group or
  // session uses it), so killpg reaches this group or nothing.
  boost::asio::io_context io;
  const int null_fd = ::open("/dev/null", O_WRONLY | O_CLOEXEC);
  REQUIRE(null_fd >= 0);
  {
    mg::Console console(io, null_fd, null_fd, false);
    mg::Watchdog watchdog;
    mg::WorkerGroup group(io, console, watchdog);
    mg::WorkerSpec spec;
    spec.executable = "/bin/sh";
    spec.argv = {"sh", "-c", "sleep 300 & exit 3"};  // a straggler in its group
    spec.terminal = false;
    bool ended = false;
    mg::WorkerProcess& w = group.spawn(spec, [&](mg::WorkerProcess&) { ended = true; });
    const pid_t pid = w.pid();
    REQUIRE(pid > 0);
    auto straggler = [&]() -> std::optional<pid_t> {
      for (const auto& p : mg::scan_processes())
        if (p.pgrp == pid && p.pid != pid && p.state != 'Z') return p.pid;
      return std::nullopt;
    };
    REQUIRE(mgtest::eventually([&] { return straggler().has_value(); }, 20s));
    REQUIRE(mgtest::eventually([&] {
      group.reap();
      io.poll();
      return ended;
    }, 20s));
    CHECK(w.wait_status() == 3 << 8);
    CHECK(w.held());
    const auto st = mg::read_proc_stat(pid);
    REQUIRE(st);  // before: reaped, gone from /proc
    CHECK(st->state == 'Z');
    // The group is still this worker's: SIGTERM to it reaches the straggler.
    group.signal(SIGTERM, false);
    CHECK(mgtest::eventually([&] { return !straggler().has_value(); }, 20s));
    CHECK(w.held());  // kept until the group was SIGKILLed
    group.retire({});  // SIGKILL to the group, then the zombie reaped
    int status = 0;
    CHECK(::waitpid(pid, &status, WNOHANG) < 0);  // no child of ours any more: reaped
    CHECK(errno == ECHILD);
    io.run_for(1s);
  }
  ::close(null_fd);
}
