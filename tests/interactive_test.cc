// Interactive use and scale, with the real mglaunch binary: a terminal (a pseudo-terminal
// the test opens itself), Ctrl-Z, live partial lines, the line prefix template, the
// descriptor budget of many workers, and no orphan at any depth after kill -9.
#include <catch2/catch.hpp>

#include <fcntl.h>
#include <poll.h>
#include <pty.h>
#include <signal.h>
#include <sys/wait.h>
#include <termios.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <set>

#include "launcher/watchdog.h"
#include "support/proc.h"

using namespace mgtest;
using namespace std::chrono_literals;
namespace fs = std::filesystem;

namespace {

std::vector<pid_t> read_pids(const std::string& path) {
  std::vector<pid_t> pids;
  for (const auto& l : split_lines(read_file(path)))
    if (!l.empty() && l.find_first_not_of("0123456789") == std::string::npos) pids.push_back(std::stoi(l));
  return pids;
}

void write_text(const std::string& path, const std::string& text) {
  std::ofstream out(path);
  out << text;
}

// Pids the test must not leave behind: SIGKILLed at the end, whatever happened.
struct KillList {
  std::string pidfile;
  ~KillList() {
    for (pid_t p : read_pids(pidfile))
      if (p > 1 && pid_alive(p)) ::kill(p, SIGKILL);
  }
};

}  // namespace

TEST_CASE("a run mark in the environment is found only in MGLAUNCH_RUN_MARK, also after an outer agent's") {
  using namespace std::string_view_literals;
  const auto env = "PATH=/bin\0MGLAUNCH_RUN_MARK=outer123,inner456\0HOME=/root\0"sv;
  CHECK(mg::environ_has_mark(env, "inner456"));
  CHECK(mg::environ_has_mark(env, "outer123"));
  CHECK_FALSE(mg::environ_has_mark(env, "other789"));
  CHECK_FALSE(mg::environ_has_mark("X=inner456\0"sv, "inner456"));
  CHECK_FALSE(mg::environ_has_mark(env, ""));
  CHECK_FALSE(mg::environ_has_mark(""sv, "inner456"));
  // No trailing NUL (a truncated read) still parses.
  CHECK(mg::environ_has_mark("A=1\0MGLAUNCH_RUN_MARK=abc"sv, "abc"));
}

TEST_CASE("after kill -9 of the agent no process a worker started survives, at any depth and outside its group") {
  const std::string dir = make_temp_dir();
  KillList kill_list{dir + "/pids"};
  const std::string script = dir + "/tree.sh";
  // Per worker: a grandchild in its group, a great-grandchild, a great-great-grandchild in
  // a session of its own (setsid), and a daemon whose parent exits at once (double fork
  // and setsid: it is handed to the agent, the subreaper). Each records its pid.
  write_text(script, R"(P="$1"
sleep 300 & echo $! >> "$P"
sh -c 'sleep 300 & echo $! >> "$1"; wait' sh "$P" & echo $! >> "$P"
setsid sh -c 'sh -c "sleep 300 & echo \$! >> \"\$1\"; wait" sh "$1" & echo $! >> "$1"; wait' sh "$P" & echo $! >> "$P"
setsid sh -c 'sleep 300 & echo $! >> "$1"' sh "$P"
echo ready
wait
)");
  // 7 pids per worker: sleep, sh + sleep, setsid sh + sh + sleep, daemon sleep.
  Proc agent = spawn({kMglaunch, "--nproc_per_node=2", "--no_python", "/bin/sh", script, kill_list.pidfile});
  REQUIRE(eventually([&] { return read_pids(kill_list.pidfile).size() == 14 && split_lines(agent.out()).size() == 2; },
                     60s));
  const auto pids = read_pids(kill_list.pidfile);
  for (pid_t p : pids) REQUIRE(pid_alive(p));
  ::kill(agent.pid, SIGKILL);
  REQUIRE(agent.wait(30s));
  std::vector<pid_t> alive;
  eventually(
      [&] {
        alive.clear();
        for (pid_t p : pids)
          if (pid_alive(p)) alive.push_back(p);
        return alive.empty();
      },
      30s);
  INFO("still alive: " << alive.size() << " of " << pids.size());
  CHECK(alive.empty());
}

TEST_CASE("more workers than the descriptor limit allows are refused up front with exit 4 and the count that fits") {
  // The limit is set for this run only (sh's ulimit in the child).
  auto r = run({"/bin/sh", "-c", "ulimit -n 256 && exec \"$@\"", "sh", kMglaunch, "--nproc_per_node=500", "--no_python",
                "/bin/sh", "-c", "echo started"});
  INFO(r.err);
  CHECK(r.code == 4);
  CHECK(r.out.find("started") == std::string::npos);  // nothing started
  const auto lines = split_lines(r.err);
  REQUIRE(lines.size() == 1);
  CHECK_THAT(lines[0], Catch::StartsWith("mglaunch: error: 500 workers need about") && Catch::Contains("256") &&
                           Catch::Contains("at most") && Catch::Contains("workers fit") &&
                           Catch::Contains("ulimit -Hn"));
}

TEST_CASE("500 workers all start and exit 0 when the soft descriptor limit is raised to the hard one") {
  // A soft limit far below what 500 workers need, a hard one above it: the agent raises
  // its own soft limit and the workers still start with the original one.
  auto r = run({"/bin/sh", "-c", "ulimit -S -n 300 && exec \"$@\"", "sh", kMglaunch, "--nproc_per_node=500",
                "--no_python", "/bin/sh", "-c", "echo \"up $RANK $(ulimit -S -n)\""},
               {}, 240s);
  INFO(r.err.substr(0, 2000));
  REQUIRE(r.code == 0);
  std::set<std::string> ranks;
  int with_original_limit = 0;
  for (const auto& l : split_lines(r.out)) {
    auto pos = l.find("]:up ");
    if (pos == std::string::npos) continue;
    std::string rest = l.substr(pos + 5);
    ranks.insert(rest.substr(0, rest.find(' ')));
    if (rest.ends_with(" 300")) ++with_original_limit;
  }
  CHECK(ranks.size() == 500);
  CHECK(with_original_limit == 500);
}
