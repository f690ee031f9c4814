// The watchdog after kill -9 of the agent: it kills the agent's descendants it saw in its
// snapshot even when they wiped their environment (no run mark), and spares a process that
// carries the mark but is not ours (a copied environment), with the real mglaunch binary.
#include <catch2/catch.hpp>

#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "process/proc.h"
#include "process/watchdog.h"
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

// The start time of `pid` from /proc (0 when it is gone).
unsigned long long starttime_of(pid_t pid) {
  const auto st = mg::read_proc_stat(pid);
  return st ? st->starttime : 0;
}

void touch(const std::string& path) { std::ofstream(path) << "go\n"; }

// The state letter of `pid` ('?' when it is gone).
char state_of(pid_t pid) {
  const auto st = mg::read_proc_stat(pid);
  return st ? st->state : '?';
}

}  // namespace

TEST_CASE("the watchdog signals a pid only while it is the process that started at the time it saw, with or without a pidfd") {
  for (bool use_pidfd : {true, false}) {
    INFO("pidfd: " << use_pidfd);
    const pid_t child = ::fork();
    if (child == 0) {
      for (;;) ::pause();
    }
    REQUIRE(child > 0);
    Reaper reaper;
    reaper.pids.push_back(child);
    unsigned long long st = 0;
    REQUIRE(eventually([&] { return (st = starttime_of(child)) != 0; }, 10s));
    // Another start time: a pid reused since the scan. Neither a check nor a signal reaches it.
    CHECK(mg::signal_same_process(child, st + 1, 0, use_pidfd) == 0);
    CHECK(mg::signal_same_process(child, st + 1, SIGKILL, use_pidfd) == 0);
    int status = 0;
    CHECK(::waitpid(child, &status, WNOHANG) == 0);  // still alive
    CHECK(mg::signal_same_process(child, st, 0, use_pidfd) == 1);
    CHECK(mg::signal_same_process(child, st, SIGKILL, use_pidfd) == 1);
    REQUIRE(::waitpid(child, &status, 0) == child);
    CHECK((WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL));
    CHECK(mg::signal_same_process(child, st, SIGKILL, use_pidfd) == 0);  // gone
  }
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

TEST_CASE("after kill -9 of the agent a fresh daemon of a worker is killed, a fresh child of a marked stranger is spared") {
  // Both start after the watchdog's last snapshot and both carry the run mark; only the
  // daemon is an orphan of the agent's tree. A snapshot between their start and the kill
  // would decide by ancestry instead of this rule: then the attempt is repeated.
  bool exercised = false;
  for (int attempt = 0; attempt < 4 && !exercised; ++attempt) {
    const std::string dir = make_temp_dir();
    const std::string trace = dir + "/watch", markfile = dir + "/mark", go = dir + "/go";
    const std::string daemon_pids = dir + "/daemon", stranger_pids = dir + "/stranger";
    Reaper reaper;
    Proc agent = spawn({kMglaunch, "--nproc_per_node=1", "--no_python", "/bin/sh", "-c",
                        "printf '%s' \"$MGLAUNCH_RUN_MARK\" > \"$1\"; exec \"$2\" wait-file \"$3\" spawn-child daemon \"$4\" "
                        "hang 120",
                        "sh", markfile, kFakeWorker, go, daemon_pids},
                       // A token left in the environment (an outer run's watchdog) is not the one it sweeps by.
                       {{"MGLAUNCH_WATCHDOG_TRACE", trace}, {"MGLAUNCH_WATCHDOG_TOKEN", "stale-token-of-an-outer-run"}});
    REQUIRE(eventually([&] { return !read_file(markfile).empty(); }, 60s));
    const std::string mark = read_file(markfile);
    // Someone else's process with a copy of the worker's environment, older than the
    // last snapshot; it starts a child when told to.
    Proc stranger = spawn({kFakeWorker, "wait-file", go, "spawn-child", "group", stranger_pids, "hang", "120"},
                          {{"MGLAUNCH_RUN_MARK", mark}});
    reaper.pids.push_back(stranger.pid);
    REQUIRE(two_more_snapshots(trace));
    const long before = snapshots(trace);
    touch(go);
    REQUIRE(eventually([&] { return read_pids(daemon_pids).size() == 1 && read_pids(stranger_pids).size() == 1; }, 30s));
    ::kill(agent.pid, SIGKILL);
    const pid_t daemon = read_pids(daemon_pids).at(0), child = read_pids(stranger_pids).at(0);
    reaper.pids.push_back(daemon);
    reaper.pids.push_back(child);
    REQUIRE(agent.wait(30s));
    REQUIRE(eventually([&] { return read_file(trace).find("kill round alive 0") != std::string::npos; }, 60s));
    if (snapshots(trace) != before) {
      WARN("a snapshot came between the fresh processes' start and the kill; trying again");
      continue;
    }
    exercised = true;
    CHECK(eventually([&] { return !pid_alive(daemon); }, 30s));
    CHECK(pid_alive(child));
    CHECK(pid_alive(stranger.pid));
  }
  CHECK(exercised);
}

TEST_CASE("after kill -9 of the agent the watchdog does not read the environment of a fresh process in state D") {
  // A vfork parent waits in state D; reading its environ would not block, but one whose
  // memory-map lock is held would for ever, and the watchdog cannot tell them apart.
  bool exercised = false;
  for (int attempt = 0; attempt < 4 && !exercised; ++attempt) {
    const std::string dir = make_temp_dir();
    const std::string trace = dir + "/watch", markfile = dir + "/mark", pids = dir + "/pids";
    Reaper reaper;
    Proc agent = spawn({kMglaunch, "--nproc_per_node=1", "--no_python", "/bin/sh", "-c",
                        "printf '%s' \"$MGLAUNCH_RUN_MARK\" > \"$1\"; exec /bin/sleep 120", "sh", markfile},
                       {{"MGLAUNCH_WATCHDOG_TRACE", trace}});
    REQUIRE(eventually([&] { return !read_file(markfile).empty(); }, 60s));
    REQUIRE(two_more_snapshots(trace));
    const long before = snapshots(trace);
    // Fresh, marked, and its parent (this test) is the agent's parent: the watchdog would
    // take it for the agent's orphan if it read its environment.
    Proc waiter = spawn({kFakeWorker, "pidfile", pids, "vfork-hang", "120"}, {{"MGLAUNCH_RUN_MARK", read_file(markfile)}});
    reaper.pids.push_back(waiter.pid);
    REQUIRE(eventually([&] { return state_of(waiter.pid) == 'D'; }, 30s));
    ::kill(agent.pid, SIGKILL);
    REQUIRE(agent.wait(30s));
    REQUIRE(eventually([&] { return read_file(trace).find("kill round alive 0") != std::string::npos; }, 60s));
    if (snapshots(trace) != before) {
      WARN("a snapshot came between the process's start and the kill; trying again");
      continue;
    }
    exercised = true;
    CHECK_THAT(read_file(trace), Catch::Contains("environ not read (state D)"));
  }
  CHECK(exercised);
}

TEST_CASE("a full watchdog table is said once on the agent's stderr, and the run goes on") {
  const std::string dir = make_temp_dir();
  const std::string trace = dir + "/watch";
  // The worker ends once the watchdog has taken two snapshots (each overflows the table).
  auto r = run({kMglaunch, "--nproc_per_node=1", kFakeWorker, "wait-lines", trace, "2"},
               {{"MGLAUNCH_WATCHDOG_TRACE", trace}, {"MGLAUNCH_WATCHDOG_MAX_PROCS", "3"}}, 90s);
  INFO(r.err);
  CHECK(r.code == 0);
  int warnings = 0;
  for (const auto& l : split_lines(r.err))
    if (l.find("watchdog:") != std::string::npos) {
      ++warnings;
      CHECK_THAT(l, Catch::StartsWith("mglaunch: warning: watchdog: more than 3 processes"));
    }
  CHECK(warnings == 1);
}

TEST_CASE("a run that leaves nothing of its tree alive tells the watchdog so and the watchdog exits without a sweep") {
  const std::string dir = make_temp_dir();
  const std::string trace = dir + "/watch";
  // Workers whose children are gone before the end (a background sleep that is waited
  // for): at the end nothing below the agent is alive.
  Proc agent = spawn({kMglaunch, "--nproc_per_node=2", "--no_python", "/bin/sh", "-c", "/bin/sleep 0.1 & wait"},
                     {{"MGLAUNCH_WATCHDOG_TRACE", trace}});
  REQUIRE(agent.wait(60s));
  CHECK(agent.exit_code() == 0);
  // The agent waited for the watchdog: had it swept, its "stopped N" line would be there.
  CHECK(read_file(trace).find("stopped") == std::string::npos);
}

TEST_CASE("after kill -9 of the agent the watchdog removes the run's temporary directory, which nobody was told of") {
  namespace fs = std::filesystem;
  const std::string dir = make_temp_dir();
  const std::string trace = dir + "/watch", tmp = dir + "/tmp";
  fs::create_directory(tmp);
  auto trees = [&] {
    std::size_t n = 0;
    for (const auto& e : fs::directory_iterator(tmp)) n += e.path().filename().string().starts_with("mglaunch_");
    return n;
  };
  Proc agent = spawn({kMglaunch, "--nproc_per_node=2", "--no_python", "/bin/sh", "-c", "echo ready; exec /bin/sleep 300"},
                     {{"MGLAUNCH_WATCHDOG_TRACE", trace}, {"TMPDIR", tmp}});
  REQUIRE(eventually([&] { return agent.out().find("ready") != std::string::npos; }, 60s));
  REQUIRE(trees() == 1);
  REQUIRE(two_more_snapshots(trace));  // the watchdog runs
  ::kill(agent.pid, SIGKILL);
  REQUIRE(agent.wait(30s));
  REQUIRE(eventually([&] { return read_file(trace).find("kill round alive 0") != std::string::npos; }, 60s));
  INFO(read_file(trace));
  CHECK(eventually([&] { return trees() == 0; }, 30s));
}
