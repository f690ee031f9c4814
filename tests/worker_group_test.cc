// The agent's worker handles (launcher/worker_group, launcher/worker_process) driven
// directly, with real processes: what the agent's runs cannot show on their own.
#include <catch2/catch.hpp>

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>

#include <boost/asio/io_context.hpp>

#include "launcher/worker_group.h"
#include "logs/console.h"
#include "process/watchdog.h"

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
