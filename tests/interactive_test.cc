// Interactive use and scale, with the real mglaunch binary: a terminal (a pseudo-terminal
// the test opens itself), Ctrl-Z, live partial lines, the line prefix template, the
// descriptor budget of many workers, and no orphan at any depth after kill -9.
#include <catch2/catch.hpp>

#include <fcntl.h>
#include <poll.h>
#include <pty.h>
#include <signal.h>
#include <sys/ioctl.h>
#include <sys/wait.h>
#include <termios.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <set>
#include <thread>

#include "process/proc.h"
#include "process/watchdog.h"
#include "support/proc.h"
#include "support/skip.h"

extern char** environ;

using namespace mgtest;
using namespace std::chrono_literals;
namespace fs = std::filesystem;

namespace {

void write_text(const std::string& path, const std::string& text) {
  std::ofstream out(path);
  out << text;
}

// Whether `pid` runs under an mglaunch agent (its environment carries a run mark). With a
// small pid_max (32768) pids come round again within seconds while other tests start
// thousands of processes: a pid recorded by a test may name another test's agent or
// watchdog by the time it is cleaned up.
bool run_by_mglaunch(pid_t pid) {
  return read_file("/proc/" + std::to_string(pid) + "/environ").find("MGLAUNCH_RUN_MARK=") != std::string::npos;
}

// Pids the test must not leave behind: SIGKILLed at the end, whatever happened (only
// while they still are processes a worker started).
struct KillList {
  std::string pidfile;
  ~KillList() {
    for (pid_t p : read_pids(pidfile))
      if (p > 1 && pid_alive(p) && run_by_mglaunch(p)) ::kill(p, SIGKILL);
  }
};

// A process by pid and start time: the same one, not a later one given its pid.
struct Ident {
  pid_t pid = 0;
  unsigned long long start = 0;
};

std::optional<mg::ProcStat> stat_of(pid_t pid) { return mg::read_proc_stat(pid); }

bool same_alive(const Ident& id) {
  auto ids = stat_of(id.pid);
  return ids && ids->starttime == id.start && ids->state != 'Z';
}

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
  const std::string trace = dir + "/watchdog.trace";
  Proc agent = spawn({kMglaunch, "--nproc_per_node=2", "--no_python", "/bin/sh", script, kill_list.pidfile},
                     {{"MGLAUNCH_WATCHDOG_TRACE", trace}});
  REQUIRE(eventually([&] { return read_pids(kill_list.pidfile).size() == 14 && split_lines(agent.out()).size() == 2; },
                     60s));
  // Each by its start time as well: a pid that comes round again (pid_max may be 32768)
  // is not a survivor.
  std::vector<Ident> procs;
  for (pid_t p : read_pids(kill_list.pidfile)) {
    auto ids = stat_of(p);
    REQUIRE(ids);
    REQUIRE(ids->state != 'Z');
    procs.push_back({p, ids->starttime});
  }
  ::kill(agent.pid, SIGKILL);
  REQUIRE(agent.wait(30s));
  std::vector<Ident> alive;
  eventually(
      [&] {
        alive.clear();
        for (const auto& id : procs)
          if (same_alive(id)) alive.push_back(id);
        return alive.empty();
      },
      30s);
  // What is left and what the watchdog did, for a failure seen under load.
  std::string left;
  for (const auto& id : alive) {
    left += read_file("/proc/" + std::to_string(id.pid) + "/stat").substr(0, 120) + "\n";
    for (const auto& l : split_lines(read_file("/proc/" + std::to_string(id.pid) + "/status")))
      if (l.starts_with("State:") || l.starts_with("PPid:") || l.starts_with("SigPnd:") || l.starts_with("ShdPnd:"))
        left += "  " + l + "\n";
  }
  INFO("still alive: " << alive.size() << " of " << procs.size() << "\n" << left << "watchdog trace:\n"
                       << read_file(trace) << "agent:\n" << agent.err());
  CHECK(alive.empty());
  for (const auto& id : alive) mg::signal_same_process(id.pid, id.start, SIGKILL);
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

namespace {

// mglaunch on a pseudo-terminal of its own: the session leader with the terminal as its
// controlling terminal, stdin, stdout and stderr (the foreground job, as after a shell
// started it). Killed (by process group) and reaped if the test ends first.
struct PtyProc {
  pid_t pid = -1;
  int master = -1;
  int status = -1;
  std::string out;  // everything read so far, "\r\n" as the terminal wrote it

  explicit PtyProc(const std::vector<std::string>& argv, const std::map<std::string, std::string>& env_add = {},
                   const winsize* size = nullptr) {
    int slave = -1;
    REQUIRE(::openpty(&master, &slave, nullptr, nullptr, size) == 0);
    std::vector<std::string> envs;
    for (char** e = environ; *e; ++e) {
      std::string kv = *e;
      if (!env_add.contains(kv.substr(0, kv.find('=')))) envs.push_back(kv);
    }
    for (const auto& [k, v] : env_add) envs.push_back(k + "=" + v);
    std::vector<char*> cargv, cenv;
    for (const auto& a : argv) cargv.push_back(const_cast<char*>(a.c_str()));
    cargv.push_back(nullptr);
    for (const auto& e : envs) cenv.push_back(const_cast<char*>(e.c_str()));
    cenv.push_back(nullptr);
    pid = ::fork();
    if (pid == 0) {
      ::setsid();
      ::ioctl(slave, TIOCSCTTY, 0);
      for (int i = 0; i < 3; ++i) ::dup2(slave, i);
      ::close(slave);
      ::close(master);
      ::execve(cargv[0], cargv.data(), cenv.data());
      ::_exit(126);
    }
    ::close(slave);
  }
  ~PtyProc() {
    if (pid > 0 && status == -1) {
      ::kill(-pid, SIGKILL);
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
    }
    if (master >= 0) ::close(master);
  }
  // Reads what is there within `ms`; false at end of file (every holder of the terminal gone).
  bool pump(int ms) {
    pollfd p{master, POLLIN, 0};
    if (::poll(&p, 1, ms) <= 0) return true;
    char buf[4096];
    const ssize_t n = ::read(master, buf, sizeof(buf));
    if (n <= 0) return false;
    out.append(buf, static_cast<std::size_t>(n));
    return true;
  }
  // The output with the terminal's "\r\n" as "\n" (a lone '\r' stays).
  std::string text() const {
    std::string t;
    for (std::size_t i = 0; i < out.size(); ++i)
      if (!(out[i] == '\r' && i + 1 < out.size() && out[i + 1] == '\n')) t.push_back(out[i]);
    return t;
  }
  bool wait_for(const std::string& what, std::chrono::milliseconds timeout) {
    return eventually(
        [&] {
          pump(50);
          return text().find(what) != std::string::npos;
        },
        timeout);
  }
  void type(const std::string& s) { REQUIRE(::write(master, s.data(), s.size()) == static_cast<ssize_t>(s.size())); }
  // Waits for the exit, reading the terminal meanwhile; the shell-style exit code or -1.
  int wait_exit(std::chrono::milliseconds timeout) {
    eventually(
        [&] {
          pump(50);
          return ::waitpid(pid, &status, WNOHANG) == pid;
        },
        timeout);
    while (status != -1 && pump(50)) {
    }
    if (status == -1) return -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  }
};

char proc_state(pid_t pid) {
  const std::string stat = read_file("/proc/" + std::to_string(pid) + "/stat");
  const auto close = stat.rfind(')');
  return close == std::string::npos || close + 2 >= stat.size() ? '?' : stat[close + 2];
}

// Stopped, or got SIGSTOP and cannot act on it yet: a shell waiting in vfork() for a child
// that was stopped before its exec stays in state D with the SIGSTOP pending (it runs on
// only once continued).
bool stopped(pid_t pid) {
  if (proc_state(pid) == 'T') return true;
  for (const auto& l : split_lines(read_file("/proc/" + std::to_string(pid) + "/status")))
    if (l.starts_with("SigPnd:") || l.starts_with("ShdPnd:"))
      if (std::stoull(l.substr(7), nullptr, 16) & (1ULL << (SIGSTOP - 1))) return true;
  return false;
}

}  // namespace

TEST_CASE("on a terminal the stdin rank runs pdb: its prompt shows at once and typed commands reach it") {
  PtyProc p({kMglaunch, "--nproc_per_node=2", "--no_python", "/usr/bin/python3", "-c",
             "import os, sys\n"
             "x = 41\n"
             "if os.environ['RANK'] == '0':\n"
             "    breakpoint()\n"
             "    print('after', x)\n"
             "else:\n"
             "    print('rank1 read', repr(sys.stdin.read()))\n"},
            {{"PYTHONBREAKPOINT", "pdb.set_trace"}});
  // The prompt has no newline: it must show before anything is typed.
  REQUIRE(p.wait_for("[rank0]:(Pdb) ", 60s));
  p.type("p x + 1\n");
  REQUIRE(p.wait_for("42\n", 30s));
  p.type("c\n");
  CHECK(p.wait_exit(60s) == 0);
  INFO(p.text());
  CHECK(p.text().find("[rank0]:after 41\n") != std::string::npos);
  CHECK(p.text().find("[rank0]:42\n") != std::string::npos);  // after the echoed line: a new line, prefixed
  CHECK(p.text().find("[rank1]:rank1 read ''\n") != std::string::npos);  // the others read /dev/null
}

namespace {

// A Python worker for the stdin rank: `before` (Python lines) runs first, then a getpass
// prompt, then it prints what it read and whether stdin, stdout and stderr are terminals
// (each line in one print of one string: one write, never cut by another worker's line).
// Every other rank prints "idle" and exits.
std::vector<std::string> getpass_job(const std::string& before, std::vector<std::string> flags = {}) {
  std::vector<std::string> argv{kMglaunch, "--nproc_per_node=2"};
  argv.insert(argv.end(), flags.begin(), flags.end());
  for (const char* a : {"--no_python", "/usr/bin/python3", "-c"}) argv.emplace_back(a);
  argv.push_back("import getpass, os, sys\n"
                 "if os.environ['LOCAL_RANK'] != '0':\n"
                 "    print('idle')\n"
                 "    sys.exit(0)\n" +
                 before +
                 "pw = getpass.getpass('pw: ')\n"
                 "print(f'got {pw} tty {sys.stdin.isatty()} {sys.stdout.isatty()} {sys.stderr.isatty()}')\n");
  return argv;
}

}  // namespace

TEST_CASE("on a terminal the stdin rank's getpass shows its prompt, reads the answer unechoed, and all three are terminals") {
  // The stdin rank is in the terminal's foreground job, with the terminal as its stdin:
  // getpass opens /dev/tty and turns echo off, which a worker in a background process
  // group could not (it was stopped by SIGTTOU, and the job hung).
  PtyProc p(getpass_job(""));
  REQUIRE(p.wait_for("pw: ", 60s));
  p.type("s3cret\n");
  CHECK(p.wait_exit(60s) == 0);
  const std::string t = p.text();
  INFO(t);
  CHECK(t.find("[rank0]:got s3cret tty True True True\n") != std::string::npos);
  CHECK(t.find("[rank1]:idle") != std::string::npos);  // (the prompt, written to the terminal directly, may follow)
  CHECK(t.find("s3cret") == t.find("got s3cret") + 4);  // not echoed as it was typed
}

TEST_CASE("on a terminal Ctrl-Z and fg stop and resume the job with the stdin rank in the foreground, which then reads") {
  const std::string dir = make_temp_dir();
  const std::string go = dir + "/go";
  PtyProc p(getpass_job("import time\n"
                        "print(f'up {os.getpid()}', flush=True)\n"
                        "for _ in range(1200):\n"
                        "    if os.path.exists('" + go + "'): break\n"
                        "    time.sleep(0.05)\n"));
  const bool up = p.wait_for("[rank0]:up ", 60s);
  INFO(p.text());
  REQUIRE(up);
  const auto at = p.text().find("[rank0]:up ");
  const pid_t worker = static_cast<pid_t>(std::stol(p.text().substr(at + 11)));
  p.type("\x1a");  // Ctrl-Z: the terminal stops the foreground job, the agent and the stdin rank
  int st = 0;
  REQUIRE(eventually([&] { return ::waitpid(p.pid, &st, WNOHANG | WUNTRACED) == p.pid; }, 30s));
  CHECK(WIFSTOPPED(st));
  CHECK(eventually([&] { return stopped(worker); }, 30s));
  write_text(go, "");
  ::kill(-p.pid, SIGCONT);  // fg: the shell continues the job's process group
  REQUIRE(p.wait_for("pw: ", 60s));
  p.type("after-fg\n");
  CHECK(p.wait_exit(60s) == 0);
  INFO(p.text());
  CHECK(p.text().find("[rank0]:got after-fg tty True True True\n") != std::string::npos);
}

TEST_CASE("on a terminal a restarted stdin rank is in the foreground again and its getpass reads the answer") {
  PtyProc p(getpass_job("if os.environ['TORCHELASTIC_RESTART_COUNT'] == '0':\n"
                        "    sys.exit(3)\n",
                        {"--max-restarts=1"}));
  REQUIRE(p.wait_for("pw: ", 90s));
  p.type("again\n");
  CHECK(p.wait_exit(60s) == 0);
  const std::string t = p.text();
  INFO(t);
  CHECK(t.find("[rank0]:got again tty True True True\n") != std::string::npos);
}

TEST_CASE("on a terminal Ctrl-C at the stdin rank's prompt still stops every worker and the run ends with 130") {
  const std::string dir = make_temp_dir();
  KillList kill_list{dir + "/pids"};
  PtyProc p({kMglaunch, "--nproc_per_node=2", "--no_python", "/usr/bin/python3", "-c",
             "import os, time\n"
             "open('" + kill_list.pidfile + "', 'a').write(f'{os.getpid()}\\n')\n"
             "if os.environ['LOCAL_RANK'] == '0':\n"
             "    input('name? ')\n"
             "else:\n"
             "    print('waiting', flush=True)\n"
             "    time.sleep(120)\n"});
  REQUIRE(p.wait_for("[rank0]:name? ", 60s));
  REQUIRE(p.wait_for("[rank1]:waiting", 60s));
  p.type("\x03");  // Ctrl-C
  CHECK(p.wait_exit(60s) == 128 + SIGINT);
  INFO(p.text());
  CHECK(p.text().find("got SIGINT: stopping the workers") != std::string::npos);
  for (pid_t w : read_pids(kill_list.pidfile)) CHECK_FALSE(pid_alive(w));
}

TEST_CASE("on a terminal what the stdin rank started is killed at a restart and at the end, though it shares the "
          "agent's process group") {
  // The stdin rank runs in the agent's own process group (the terminal's foreground job),
  // so no kill by process group may reach its children: the agent kills them one by one.
  // Each attempt's stdin rank leaves a sleeper that ignores SIGTERM, SIGHUP and SIGINT,
  // in the agent's group (a shell without job control keeps its background jobs there),
  // and one in a session of its own; attempt 0 then fails, attempt 1 waits for `go`.
  const std::string dir = make_temp_dir();
  KillList kill_list{dir + "/pids"};
  const std::string go = dir + "/go";
  PtyProc p({kMglaunch, "--nproc_per_node=1", "--max-restarts=1", "--no_python", "/bin/sh", "-c",
             "trap '' TERM HUP INT\n"
             "sleep 300 & echo $! >> '" + kill_list.pidfile + "'\n"
             "setsid sleep 300 & echo $! >> '" + kill_list.pidfile + "'\n"
             "echo \"attempt $TORCHELASTIC_RESTART_COUNT up\"\n"
             "[ \"$TORCHELASTIC_RESTART_COUNT\" = 0 ] && exit 3\n"
             "while [ ! -e '" + go + "' ]; do sleep 0.1; done\n"});
  REQUIRE(p.wait_for("attempt 1 up", 120s));
  const auto first = read_pids(kill_list.pidfile);
  INFO(p.text());
  REQUIRE(first.size() >= 2);
  std::vector<Ident> attempt0;
  for (std::size_t i = 0; i < 2; ++i)
    if (auto st = stat_of(first[i])) attempt0.push_back({first[i], st->starttime});
  CHECK(eventually([&] { return std::none_of(attempt0.begin(), attempt0.end(), same_alive); }, 30s));
  REQUIRE(eventually([&] { return read_pids(kill_list.pidfile).size() == 4; }, 30s));
  std::vector<Ident> attempt1;
  for (pid_t pid : read_pids(kill_list.pidfile))
    if (auto st = stat_of(pid); st && st->state != 'Z') attempt1.push_back({pid, st->starttime});
  CHECK(attempt1.size() == 2);
  write_text(go, "");
  CHECK(p.wait_exit(60s) == 0);
  // Killed by the agent before it exited (the watchdog let go without a sweep: "clean").
  CHECK(std::none_of(attempt1.begin(), attempt1.end(), same_alive));
}

TEST_CASE("the agent kills what a worker left behind through a pidfd, never by a bare pid a reuse could hand to "
          "another process") {
  // strace shows the agent's signals: the leftover (a daemon in a session of its own,
  // handed to the agent when its worker ended) gets pidfd_send_signal after a
  // pidfd_open of its pid, and no kill() names its pid (before: kill(PID, SIGKILL) after
  // a /proc scan, open to the pid's reuse in between).
  const std::string strace = require_program("strace", "strace");
  const std::string dir = make_temp_dir();
  KillList kill_list{dir + "/pids"};
  const std::string trace = dir + "/strace.txt";
  auto r = run({strace, "-f", "-qq", "-e", "trace=kill,pidfd_open,pidfd_send_signal", "-e", "signal=none", "-o",
                trace, kMglaunch, "--nproc_per_node=1", "--no_python", "/bin/sh", "-c",
                "setsid sleep 300 & echo $! >> '" + kill_list.pidfile + "'; echo up"},
               {}, 120s);
  INFO(r.out << r.err << read_file(trace));
  CHECK(r.code == 0);
  const auto pids = read_pids(kill_list.pidfile);
  REQUIRE(pids.size() == 1);
  const std::string pid = std::to_string(pids[0]);
  CHECK_FALSE(pid_alive(pids[0]));
  const std::string t = read_file(trace);
  CHECK(t.find("pidfd_open(" + pid + ",") != std::string::npos);
  CHECK(t.find("pidfd_send_signal(") != std::string::npos);
  CHECK(t.find("kill(" + pid + ",") == std::string::npos);
}

TEST_CASE("the --stdin-rank flag picks the worker that reads the terminal, none gives every worker /dev/null") {
  const std::string prog = "read line; echo \"rank $RANK got [$line]\"";
  SECTION("--stdin-rank 1") {
    PtyProc p({kMglaunch, "--nproc_per_node=2", "--stdin-rank", "1", "--no_python", "/bin/sh", "-c", prog});
    REQUIRE(p.wait_for("[rank0]:rank 0 got []", 60s));
    p.type("hello\n");
    CHECK(p.wait_exit(60s) == 0);
    INFO(p.text());
    CHECK(p.text().find("[rank1]:rank 1 got [hello]") != std::string::npos);
  }
  SECTION("--stdin-rank none") {
    PtyProc p({kMglaunch, "--nproc_per_node=2", "--stdin-rank=none", "--no_python", "/bin/sh", "-c", prog});
    CHECK(p.wait_exit(60s) == 0);
    INFO(p.text());
    CHECK(p.text().find("[rank0]:rank 0 got []") != std::string::npos);
    CHECK(p.text().find("[rank1]:rank 1 got []") != std::string::npos);
  }
  SECTION("a local rank this node does not have is exit 2") {
    auto r = run({kMglaunch, "--nproc_per_node=2", "--stdin-rank=2", "--no_python", "/bin/true"});
    CHECK(r.code == 2);
    CHECK_THAT(r.err, Catch::StartsWith("mglaunch: error: bad --stdin-rank 2"));
  }
}

TEST_CASE("Ctrl-Z stops the agent and every worker, SIGCONT (fg, bg) resumes them and the run completes") {
  const std::string dir = make_temp_dir();
  KillList kill_list{dir + "/pids"};
  const std::string go = dir + "/go";
  // The workers never fork while they wait: a shell that forks `sleep` can be caught in
  // vfork()'s wait (state D) by the stop, stopped in effect but not shown as 'T'.
  PtyProc p({kMglaunch, "--nproc_per_node=2", kFakeWorker, "pidfile", kill_list.pidfile, "print", "up", "wait-file", go,
             "print", "done"});
  REQUIRE(p.wait_for("[rank1]:up", 60s));
  REQUIRE(p.wait_for("[rank0]:up", 60s));
  const auto workers = read_pids(kill_list.pidfile);
  INFO(p.text() << "\npids: " << read_file(kill_list.pidfile));
  REQUIRE(workers.size() == 2);
  p.type("\x1a");  // Ctrl-Z
  int st = 0;
  REQUIRE(eventually([&] { return ::waitpid(p.pid, &st, WNOHANG | WUNTRACED) == p.pid; }, 30s));
  CHECK(WIFSTOPPED(st));
  for (pid_t w : workers) {
    const bool ok = eventually([&] { return stopped(w); }, 30s);
    INFO("worker " << w << ": " << read_file("/proc/" + std::to_string(w) + "/status"));
    CHECK(ok);
  }
  write_text(go, "");
  ::kill(p.pid, SIGCONT);
  CHECK(p.wait_exit(60s) == 0);
  INFO(p.text());
  CHECK(p.text().find("[rank0]:done") != std::string::npos);
  CHECK(p.text().find("[rank1]:done") != std::string::npos);
}

TEST_CASE("the time stopped by Ctrl-Z does not count against the output drain of a worker that already ended") {
  // The worker exits at once; its background child keeps the pipe and writes once told.
  // After an exit the agent drains the pipes for 2 s: a stop longer than that must not
  // cut the child's line when the job is continued.
  const std::string dir = make_temp_dir();
  KillList kill_list{dir + "/pids"};
  const std::string go = dir + "/go";
  PtyProc p({kMglaunch, "--nproc_per_node=1", "--no_python", "/bin/sh", "-c",
             "(while [ ! -e " + go + " ]; do sleep 0.05; done; echo late) & echo $! >> " + kill_list.pidfile +
                 "; read -r me rest < /proc/self/stat; echo leader $me end; exit 0"});
  REQUIRE(p.wait_for(" end", 60s));
  const auto at = p.text().find("[rank0]:leader ");
  const pid_t leader = static_cast<pid_t>(std::stol(p.text().substr(at + 15)));
  INFO(p.text());
  // Reaped by the agent: its drain of the pipes has begun.
  REQUIRE(eventually([&] { return !fs::exists("/proc/" + std::to_string(leader)); }, 30s));
  p.type("\x1a");  // Ctrl-Z
  int st = 0;
  REQUIRE(eventually([&] { return ::waitpid(p.pid, &st, WNOHANG | WUNTRACED) == p.pid; }, 30s));
  REQUIRE(WIFSTOPPED(st));
  // Not an ordering wait: the drain's 2 s must pass while everything is stopped.
  std::this_thread::sleep_for(3s);
  write_text(go, "");
  ::kill(p.pid, SIGCONT);
  CHECK(p.wait_exit(60s) == 0);
  INFO(p.text());
  CHECK(p.text().find("[rank0]:late") != std::string::npos);
}

TEST_CASE("a Ctrl-Z while stopping that outlasts the grace does not count: the workers are not killed as they resume") {
  // The worker ignores SIGTERM. SIGTERM to the agent starts the 5 s grace; a Ctrl-Z stops
  // everything for longer than that. Once continued the grace starts over: the worker
  // still answers a SIGUSR1 sent after the SIGCONT, and is SIGKILLed only 5 s later.
  const std::string dir = make_temp_dir();
  KillList kill_list{dir + "/pids"};
  PtyProc p({kMglaunch, "--nproc_per_node=1", "--grace=5", kFakeWorker, "pidfile", kill_list.pidfile, "ignore-term",
             "trap-usr", "print", "up", "hang", "120"});
  REQUIRE(p.wait_for("[rank0]:up", 60s));
  ::kill(p.pid, SIGTERM);
  REQUIRE(p.wait_for("got SIGTERM: stopping the workers", 30s));
  p.type("\x1a");  // Ctrl-Z
  int st = 0;
  REQUIRE(eventually([&] { return ::waitpid(p.pid, &st, WNOHANG | WUNTRACED) == p.pid; }, 30s));
  REQUIRE(WIFSTOPPED(st));
  // Not an ordering wait: the grace must run out while everything is stopped.
  std::this_thread::sleep_for(6s);
  ::kill(p.pid, SIGCONT);
  ::kill(p.pid, SIGUSR1);
  const bool answered = p.wait_for("[rank0]:got SIGUSR1", 30s);
  const int code = p.wait_exit(60s);
  INFO(p.text());
  CHECK(answered);
  const auto usr = p.text().find("[rank0]:got SIGUSR1");
  const auto kill = p.text().find("sending SIGKILL");
  REQUIRE(kill != std::string::npos);  // the grace still ends the stop
  CHECK(usr < kill);
  CHECK(code == 128 + SIGTERM);
}

TEST_CASE("a SIGCONT without a Ctrl-Z before it does not start an ended worker's output drain over") {
  // The worker exits at once; its background child holds the pipe for a minute. The agent
  // drains the pipe 2 s after the exit and ends. SIGCONTs (a scheduler's, `kill -CONT`, a
  // repeated `bg`) every 0.3 s must not keep it running.
  const std::string dir = make_temp_dir();
  KillList kill_list{dir + "/pids"};
  Proc agent = spawn({kMglaunch, "--nproc_per_node=1", "--no_python", "/bin/sh", "-c",
                      "sleep 60 & echo $! >> " + kill_list.pidfile + "; echo started"});
  REQUIRE(eventually([&] { return agent.out().find("[rank0]:started") != std::string::npos; }, 60s));
  bool ended = false;
  for (int i = 0; i < 100 && !ended; ++i) {  // 30 s of SIGCONTs at most
    ::kill(agent.pid, SIGCONT);
    ended = eventually([&] { return ::waitpid(agent.pid, &agent.status, WNOHANG) == agent.pid; }, 300ms);
  }
  if (!ended) ::kill(agent.pid, SIGTERM);
  REQUIRE(agent.wait(60s));
  INFO(agent.err());
  CHECK(ended);
  CHECK(agent.exit_code() == 0);
}

TEST_CASE("a process limit too low for the workers ends the run with exit 4 and names RLIMIT_NPROC and the fix") {
  // RLIMIT_NPROC binds a user without CAP_SYS_RESOURCE, never root: the run is made as
  // nobody with `prlimit --nproc`.
  require_program("/usr/bin/setpriv", "util-linux");
  require_program("/usr/bin/prlimit", "util-linux");
  if (::geteuid() != 0) SKIP_TEST("needs root to run mglaunch as nobody");
  auto r = run({"/usr/bin/setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/prlimit",
                "--nproc=40", kMglaunch, "--standalone", "--nproc_per_node=100", "--no_python", kFakeWorker, "hang",
                "60"},
               {{"TMPDIR", "/tmp"}}, 120s);
  INFO(r.out << r.err);
  CHECK(r.code == 4);
  CHECK_THAT(r.err, Catch::Contains("exitcode   : 4") && Catch::Contains("clone: Resource temporarily unavailable") &&
                        Catch::Contains("RLIMIT_NPROC") && Catch::Contains("`ulimit -u`") &&
                        Catch::Contains("is 40") && Catch::Contains("start fewer workers"));
  CHECK(r.err.find("exitcode   : 127") == std::string::npos);
}

TEST_CASE("on a terminal partial lines show at once, a carriage return gets the prefix, and two workers' lines never mix") {
  const std::string dir = make_temp_dir();
  // rank 0 leaves "half" open until rank 1 has written a whole line in between.
  PtyProc p({kMglaunch, "--nproc_per_node=2", "--no_python", "/bin/sh", "-c",
             "if [ $RANK = 0 ]; then printf 'a\\rb\\n'; printf half; while [ ! -e " + dir +
                 "/f1 ]; do sleep 0.05; done; echo ' rest'; else while [ ! -e " + dir +
                 "/f0 ]; do sleep 0.05; done; echo other; fi"});
  REQUIRE(p.wait_for("[rank0]:half", 60s));  // live: no newline yet
  write_text(dir + "/f0", "");
  REQUIRE(p.wait_for("[rank1]:other", 60s));
  write_text(dir + "/f1", "");
  CHECK(p.wait_exit(60s) == 0);
  const std::string t = p.text();
  INFO(t);
  CHECK(t.find("[rank0]:a\r[rank0]:b\n") != std::string::npos);
  CHECK(t.find("[rank0]:half\n[rank1]:other\n[rank0]: rest\n") != std::string::npos);
}

TEST_CASE("into a pipe or a file a line that comes whole stays whole and byte for byte, a carriage return included") {
  auto r = run({kMglaunch, "--no_python", "/bin/sh", "-c", "printf 'a\\rb\\nhalf'; echo ' rest'"});
  CHECK(r.code == 0);
  CHECK(r.out == "[rank0]:a\rb\n[rank0]:half rest\n");
  // No terminal for the workers either: their output is not one.
  auto t = run({kMglaunch, "--no_python", kFakeWorker, "tty"});
  CHECK(t.out == "[rank0]:tty in=0 out=0 err=0 size=none\n");
}

TEST_CASE("into a pipe or a file a progress bar's updates go out as they come, each with the prefix") {
  // `mglaunch ... | tee log`: an update ("\r 1/3") shows before its line ends, as it does
  // when the worker writes to the pipe itself (torchrun).
  const std::string dir = make_temp_dir();
  Proc agent = spawn({kMglaunch, "--nproc_per_node=2", "--no_python", "/bin/sh", "-c",
                      "w() { i=0; while [ ! -e " + dir + "/$1 ] && [ $i -lt 1200 ]; do sleep 0.05; i=$((i+1)); done; }\n"
                      "if [ $RANK = 0 ]; then printf '\\r 1/3'; w go; printf '\\r 2/3'; w go2; printf '\\r 3/3\\n';\n"
                      "else w go1; echo hello; fi"});
  const bool shown = eventually([&] { return agent.out().find("[rank0]: 1/3") != std::string::npos; }, 60s);
  write_text(dir + "/go", "");
  REQUIRE(eventually([&] { return agent.out().find("[rank0]: 2/3") != std::string::npos; }, 60s));
  // Another worker's line in between ends the open one first: each line of the file is one worker's.
  write_text(dir + "/go1", "");
  REQUIRE(eventually([&] { return agent.out().find("[rank1]:hello\n") != std::string::npos; }, 60s));
  write_text(dir + "/go2", "");
  REQUIRE(agent.wait(60s));
  INFO(agent.out());
  CHECK(shown);
  CHECK(agent.exit_code() == 0);
  CHECK(agent.out() == "[rank0]: 1/3\r[rank0]: 2/3\n[rank1]:hello\n[rank0]: 3/3\n");
}

TEST_CASE("raw lines (an empty prefix template) pass through byte for byte, also above the line limit") {
  auto r = run({kMglaunch, "--log-line-prefix-template=", "--no_python", kFakeWorker, "long-line", "1100000",
                "print-nonl", "\r 1/2\r 2/2", "print", "", "print-nonl", "tail"});
  CHECK(r.code == 0);
  CHECK(r.out == std::string(1100000, 'x') + "\n\r 1/2\r 2/2\ntail\n");
  CHECK(r.out.find("line continues") == std::string::npos);
}

TEST_CASE("on a terminal each worker writes to a pseudo-terminal as wide as the real one less its prefix, and a resize reaches it") {
  winsize size{};
  size.ws_col = 123;
  size.ws_row = 45;
  PtyProc p({kMglaunch, "--nproc_per_node=2", "--no_python", kFakeWorker, "tty", "winch", "60"}, {}, &size);
  REQUIRE(p.wait_for("[rank0]:waiting for SIGWINCH", 60s));
  REQUIRE(p.wait_for("[rank1]:waiting for SIGWINCH", 60s));
  size.ws_col = 99;
  size.ws_row = 33;
  REQUIRE(::ioctl(p.master, TIOCSWINSZ, &size) == 0);  // the kernel tells mglaunch (SIGWINCH), mglaunch the workers
  CHECK(p.wait_exit(60s) == 0);
  const std::string t = p.text();
  INFO(t);
  // "[rankN]:" takes 8 columns of each line: a full-width line of the worker still fits.
  // Rank 0, the stdin rank, reads the terminal itself; rank 1 reads /dev/null.
  for (const char* line : {"[rank0]:tty in=1 out=1 err=1 size=115x45\n", "[rank1]:tty in=0 out=1 err=1 size=115x45\n",
                           "[rank0]:winch size=91x33\n", "[rank1]:winch size=91x33\n"})
    CHECK(t.find(line) != std::string::npos);
  // A time stamp takes 24 more; a window narrower than what a line's start takes leaves 1.
  size.ws_col = 123;
  PtyProc stamped({kMglaunch, "--timestamps", "--no_python", kFakeWorker, "tty"}, {}, &size);
  CHECK(stamped.wait_exit(60s) == 0);
  CHECK_THAT(stamped.text(), Catch::Contains("[rank0]:tty in=1 out=1 err=1 size=91x33\n"));
  size.ws_col = 5;
  PtyProc narrow({kMglaunch, "--no_python", kFakeWorker, "tty"}, {}, &size);
  CHECK(narrow.wait_exit(60s) == 0);
  CHECK_THAT(narrow.text(), Catch::Contains("tty in=1 out=1 err=1 size=1x33\n"));
}

TEST_CASE("on a terminal a worker's pager prints instead of waiting for keys nobody types, unless the user chose one") {
  PtyProc p({kMglaunch, "--no_python", "/bin/sh", "-c", "echo \"pagers $PAGER $GIT_PAGER $MANPAGER $SYSTEMD_PAGER\""},
            {{"GIT_PAGER", "mine"}});
  CHECK(p.wait_exit(60s) == 0);
  CHECK_THAT(p.text(), Catch::Contains("[rank0]:pagers cat mine cat cat\n"));
}

TEST_CASE("on a terminal a stream that also goes to a log file (--tee) is a pipe for the worker, as that file needs") {
  const std::string dir = make_temp_dir();
  PtyProc p({kMglaunch, "--log_dir", dir, "--tee", "1", "--no_python", kFakeWorker, "tty"});
  CHECK(p.wait_exit(60s) == 0);
  CHECK_THAT(p.text(), Catch::Contains("[rank0]:tty in=1 out=0 err=1 size=none\n"));
}

TEST_CASE("on a terminal a progress bar keeps its last state when its worker's output ends") {
  PtyProc p({kMglaunch, "--no_python", "/bin/sh", "-c", "printf 'loss 0.9\\rloss 0.1'"}, {{"TERM", "xterm"}});
  CHECK(p.wait_exit(60s) == 0);
  const std::string t = p.text();
  INFO(t);
  CHECK(t.find("[rank0]:loss 0.9\r[rank0]:loss 0.1\n") != std::string::npos);
  CHECK(t.find("\x1b[K") == std::string::npos);
}

namespace {

// Two workers taking turns on a terminal (TERM=xterm): rank 0 runs the sh commands
// `rank0`, rank 1 `rank1`, where `w NAME` waits for the file NAME; `steps` are, in turn,
// the output awaited and the file then made. The whole output ("\r\n" as "\n"), once the
// run ended with exit 0.
std::string take_turns(const std::string& rank0, const std::string& rank1,
                       const std::vector<std::pair<std::string, std::string>>& steps) {
  const std::string dir = make_temp_dir();
  PtyProc p({kMglaunch, "--nproc_per_node=2", "--no_python", "/bin/sh", "-c",
             "w() { i=0; while [ ! -e " + dir + "/$1 ] && [ $i -lt 1200 ]; do sleep 0.05; i=$((i+1)); done; }\n"
             "if [ $RANK = 0 ]; then " + rank0 + "\nelse " + rank1 + "\nfi"},
            {{"TERM", "xterm"}});
  for (const auto& [awaited, file] : steps) {
    INFO(p.text());
    REQUIRE(p.wait_for(awaited, 60s));
    write_text(dir + "/" + file, "");
  }
  CHECK(p.wait_exit(60s) == 0);
  return p.text();
}

}  // namespace

TEST_CASE("on a terminal two workers' progress bars share one line: an interrupted bar is wiped, not ended") {
  // In turn: rank 0 draws, rank 1 draws, rank 0 redraws, rank 1 ends its bar, rank 0 ends its bar.
  const std::string t = take_turns("printf '\\rA 1'; w s2; printf '\\rA 2'; w s4; printf '\\rA done\\n'",
                                   "w s1; printf '\\rB 1'; w s3; printf '\\rB done\\n'",
                                   {{"[rank0]:A 1", "s1"}, {"[rank1]:B 1", "s2"}, {"[rank0]:A 2", "s3"},
                                    {"[rank1]:B done\n", "s4"}});
  INFO(t);
  CHECK(t.find("[rank0]:A 1\r\x1b[K[rank1]:B 1\r\x1b[K[rank0]:A 2\r\x1b[K[rank1]:B done\n[rank0]:A done\n") !=
        std::string::npos);
}

TEST_CASE("on a terminal wiped progress bars keep their last state when they end, by a lone newline or with their output") {
  // tqdm ends a bar with its last draw, then a "\n" of its own: when another worker's bar
  // wiped it in between, that newline shows the bar's last state again (it printed an
  // empty "[rank1]:" line before). Rank 0's bar, wiped by that line, ends with its output.
  const std::string t = take_turns("printf '\\rA 1'; w s1; printf '\\rA 2'; w s3",
                                   "w s0; printf '\\rB 1'; w s2; printf '\\n'",
                                   {{"[rank0]:A 1", "s0"}, {"[rank1]:B 1", "s1"}, {"[rank0]:A 2", "s2"},
                                    {"[rank1]:B 1\n", "s3"}});
  INFO(t);
  CHECK(t.find("[rank0]:A 1\r\x1b[K[rank1]:B 1\r\x1b[K[rank0]:A 2\r\x1b[K[rank1]:B 1\n[rank0]:A 2\n") !=
        std::string::npos);
  CHECK(t.find("]:\n") == std::string::npos);
}

TEST_CASE("the --log-line-prefix-template flag sets the prefix as torchrun's and an empty one gives raw lines") {
  auto r = run({kMglaunch, "--nproc_per_node=2", "--role", "trainer",
                "--log-line-prefix-template=[${role_name}${rank}|${local_rank}]:", "--no_python", "/bin/sh", "-c",
                "echo hi"});
  CHECK(r.code == 0);
  CHECK(r.out.find("[trainer0|0]:hi\n") != std::string::npos);
  CHECK(r.out.find("[trainer1|1]:hi\n") != std::string::npos);
  auto raw = run({kMglaunch, "--nproc_per_node=2", "--log-line-prefix-template", "", "--no_python", "/bin/sh", "-c",
                  "echo '{\"rank\": '$RANK'}'"});
  CHECK(raw.code == 0);
  auto lines = split_lines(raw.out);
  std::sort(lines.begin(), lines.end());
  CHECK(lines == std::vector<std::string>{"{\"rank\": 0}", "{\"rank\": 1}"});
  auto env = run({kMglaunch, "--no_python", "/bin/sh", "-c", "echo hi"}, {{"PET_LOG_LINE_PREFIX_TEMPLATE", "<${rank}> "}});
  CHECK(env.out == "<0> hi\n");
}

TEST_CASE("a Python worker that cannot import torch: the root cause names the interpreter and how to choose another") {
  const std::string dir = make_temp_dir();
  // A python3 first on PATH that lacks torch (as a venv without it would).
  write_text(dir + "/python3",
             "#!/bin/sh\necho 'Traceback (most recent call last):' >&2\n"
             "echo \"ModuleNotFoundError: No module named 'torch'\" >&2\nexit 1\n");
  fs::permissions(dir + "/python3", fs::perms::owner_all);
  write_text(dir + "/train.py", "import torch\n");
  auto r = run({kMglaunch, dir + "/train.py"}, {{"PATH", dir + ":" + std::getenv("PATH")}});
  INFO(r.out << r.err);
  CHECK(r.code == 1);
  // (#38 item 7: it also names a Python that has torch where one is found, else how to choose one)
  CHECK_THAT(r.out + r.err, Catch::Contains("the worker ran under " + dir + "/python3 (python3 from PATH), which "
                                            "has no module 'torch'") &&
                                Catch::Contains("--python ") && Catch::Contains("MGLAUNCH_PYTHON="));
}

TEST_CASE("a worker failing while later workers are still being started stops the run with its exit code") {
  // Workers start in batches; rank 0 fails at once, so the stop comes before every rank
  // has started: the ranks not started yet are never started and the run still ends.
  auto r = run({kMglaunch, "--nproc_per_node=600", "--grace=30", "--no_python", "/bin/sh", "-c",
                "[ $RANK = 0 ] && exit 7; exec sleep 120"},
               {}, 240s);
  INFO(r.err.substr(0, 2000));
  CHECK(r.code == 7);
  CHECK_THAT(r.out + r.err, Catch::Contains("exitcode   : 7"));
}
