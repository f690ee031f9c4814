// The watchdog after kill -9 of the agent: it kills the agent's descendants it saw in its
// snapshot even when they wiped their environment (no run mark), and spares a process that
// carries the mark but is not ours (a copied environment), with the real mglaunch binary.
#include <catch2/catch.hpp>

#include <signal.h>
#include <unistd.h>

#include <fstream>
#include <string>
#include <vector>

#include "launcher/watchdog.h"
#include "support/proc.h"

using namespace mgtest;
using namespace std::chrono_literals;

namespace {

long snapshots(const std::string& trace) {
  long n = 0;
  for (const auto& l : split_lines(read_file(trace))) n += l.rfind("snapshot ", 0) == 0;
  return n;
}

// Waits until the watchdog has taken two more snapshots than it had when called.
bool two_more_snapshots(const std::string& trace) {
  const long now = snapshots(trace);
  return eventually([&] { return snapshots(trace) >= now + 2; }, 60s);
}

struct Reaper {  // SIGKILLs what the test started, whatever happened
  std::vector<pid_t> pids;
  ~Reaper() {
    for (pid_t p : pids)
      if (p > 1 && pid_alive(p)) ::kill(p, SIGKILL);
  }
};

}  // namespace

TEST_CASE("the watchdog reads pid, parent, group and start time from /proc/PID/stat, comm with spaces and parentheses") {
  mg::StatIds ids;
  REQUIRE(mg::parse_stat_ids("4242 (a (b) c) S 17 4242 4242 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 987654 12 34",
                             ids));
  CHECK(ids.pid == 4242);
  CHECK(ids.ppid == 17);
  CHECK(ids.pgrp == 4242);
  CHECK(ids.state == 'S');
  CHECK(ids.flags == 4194560);  // field 9, where PF_KTHREAD (0x200000) marks a kernel thread
  CHECK(ids.starttime == 987654);
  CHECK_FALSE(mg::parse_stat_ids("4242 (x) S 17 4242", ids));  // cut short before the start time
  CHECK_FALSE(mg::parse_stat_ids("garbage", ids));
  CHECK_FALSE(mg::parse_stat_ids("(x) S 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19", ids));
}

TEST_CASE("after kill -9 of the agent a descendant that wiped its environment is killed, a marked stranger is spared") {
  const std::string dir = make_temp_dir();
  const std::string trace = dir + "/watch", pidfile = dir + "/pids", markfile = dir + "/mark";
  Reaper reaper;
  // The worker records its run mark, then starts a daemon (setsid) with an empty
  // environment: no MGLAUNCH_RUN_MARK, as after setproctitle() or `env -i`.
  Proc agent = spawn({kMglaunch, "--nproc_per_node=1", "--no_python", "/bin/sh", "-c",
                      "printf '%s' \"$MGLAUNCH_RUN_MARK\" > \"$1\"; setsid env -i /bin/sleep 300 & echo $! >> \"$2\"; "
                      "echo ready; exec /bin/sleep 300",
                      "sh", markfile, pidfile},
                     {{"MGLAUNCH_WATCHDOG_TRACE", trace}});
  REQUIRE(eventually([&] { return agent.out().find("ready") != std::string::npos && read_pids(pidfile).size() == 1; },
                     60s));
  const pid_t wiped = read_pids(pidfile).at(0);
  reaper.pids.push_back(wiped);
  const std::string mark = read_file(markfile);
  REQUIRE_FALSE(mark.empty());
  // A process of someone else that copied the worker's environment (tmux, at, a batch
  // job) and was never below the agent.
  Proc stranger = spawn({"/bin/sleep", "300"}, {{"MGLAUNCH_RUN_MARK", mark}});
  reaper.pids.push_back(stranger.pid);
  // Both exist at a snapshot: the watchdog has seen which one is ours.
  REQUIRE(two_more_snapshots(trace));
  ::kill(agent.pid, SIGKILL);
  REQUIRE(agent.wait(30s));
  REQUIRE(eventually([&] { return read_file(trace).find("kill round alive 0") != std::string::npos; }, 60s));
  CHECK(eventually([&] { return !pid_alive(wiped); }, 30s));
  CHECK(pid_alive(stranger.pid));
}
