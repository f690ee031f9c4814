// The agent under stress (issue #11): what a worker inherits, what is left running after
// the agent stops, master ports under load, a stalled console. Real mglaunch agents,
// real fake_worker processes, rendezvous on 127.0.0.x with ports picked at run time.
#include <catch2/catch.hpp>

#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <set>

#include <nlohmann/json.hpp>

#include "launcher/port.h"
#include "launcher/worker_process.h"
#include "support/proc.h"
#include "support/rdzv_fixture.h"

using namespace mgtest;
using namespace std::chrono_literals;

namespace {

std::vector<std::string> standalone(std::vector<std::string> flags, std::vector<std::string> worker) {
  std::vector<std::string> argv{kMglaunch, "--standalone"};
  argv.insert(argv.end(), flags.begin(), flags.end());
  argv.push_back(kFakeWorker);
  argv.insert(argv.end(), worker.begin(), worker.end());
  return argv;
}

// One agent of an n-node job on 127.0.0.<index> against the rendezvous at `endpoint`.
std::vector<std::string> node_argv(const std::string& endpoint, const std::string& job, int index, int nnodes,
                                   std::vector<std::string> flags, std::vector<std::string> worker) {
  return agent_argv(endpoint, job, index, std::to_string(nnodes), 1, std::move(flags), std::move(worker));
}

// The JSON objects printed by the workers ("[rankN]:{...}" lines).
std::vector<nlohmann::json> json_lines(const std::string& out) {
  std::vector<nlohmann::json> v;
  for (const auto& l : split_lines(out))
    if (auto b = l.find(":{"); b != std::string::npos) v.push_back(nlohmann::json::parse(l.substr(b + 1)));
  return v;
}

std::set<std::string> fd_numbers(const nlohmann::json& j) {
  std::set<std::string> s;
  for (const auto& [k, v] : j["fds"].items()) s.insert(k);
  return s;
}

bool is_fake_worker(pid_t pid) {
  return read_file("/proc/" + std::to_string(pid) + "/cmdline").find("fake_worker") != std::string::npos;
}

// Kills, when the test ends however it ends, the fake_worker processes listed in a
// pidfile that are still alive (what a broken agent left behind).
struct Leftovers {
  std::string pidfile;
  ~Leftovers() {
    for (pid_t p : read_pids(pidfile))
      if (pid_alive(p) && is_fake_worker(p)) ::kill(p, SIGKILL);
  }
  // The listed pids still alive after giving SIGKILLs in flight time to land.
  std::vector<pid_t> alive() const {
    auto pids = read_pids(pidfile);
    eventually([&] { return std::none_of(pids.begin(), pids.end(), pid_alive); }, 5s);
    std::vector<pid_t> out;
    for (pid_t p : pids)
      if (pid_alive(p)) out.push_back(p);
    return out;
  }
};

// A process whose stdout is a pipe that the test reads only when it chooses to; stderr
// goes to a file. Its process group is killed if the test ends before it does.
struct PipedProc {
  pid_t pid = -1;
  int out = -1;  // read end
  std::string err_path;
  int status = -1;
  bool exited() { return status != -1 || ::waitpid(pid, &status, WNOHANG) == pid; }
  std::string err() const { return read_file(err_path); }
  ~PipedProc() {
    if (pid > 0 && status == -1) {
      ::killpg(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
    }
    if (out >= 0) ::close(out);
  }
};

std::unique_ptr<PipedProc> spawn_piped(const std::vector<std::string>& argv) {
  auto p = std::make_unique<PipedProc>();
  p->err_path = make_temp_dir() + "/stderr";
  int fds[2];
  REQUIRE(::pipe2(fds, O_CLOEXEC) == 0);
  std::vector<char*> cargv;
  for (const auto& a : argv) cargv.push_back(const_cast<char*>(a.c_str()));
  cargv.push_back(nullptr);
  pid_t pid = ::fork();
  if (pid == 0) {
    ::setpgid(0, 0);
    int in = ::open("/dev/null", O_RDONLY);
    int err = ::open(p->err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ::dup2(in, 0);
    ::dup2(fds[1], 1);
    ::dup2(err, 2);
    ::execv(cargv[0], cargv.data());
    ::_exit(126);
  }
  ::setpgid(pid, pid);
  ::close(fds[1]);
  p->pid = pid;
  p->out = fds[0];
  return p;
}

// Reads fd to its end (at most `timeout`).
std::string read_to_end(int fd, std::chrono::milliseconds timeout) {
  std::string data;
  char buf[65536];
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < deadline) {
    pollfd pfd{fd, POLLIN, 0};
    if (::poll(&pfd, 1, 100) <= 0) continue;
    ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n == 0) break;
    if (n > 0) data.append(buf, static_cast<std::size_t>(n));
  }
  return data;
}

}  // namespace

TEST_CASE("a worker inherits no descriptor of the agent: only stdin, stdout and stderr") {
  SECTION("in a 2-node job, where the agent holds rendezvous sockets") {
    Daemon d = start_daemon();
    const std::string& ep = d.endpoint;
    Proc a = spawn(node_argv(ep, "fds", 1, 2, {}, {"fds"}));
    Proc b = spawn(node_argv(ep, "fds", 2, 2, {}, {"fds"}));
    for (auto* p : {&a, &b}) {
      REQUIRE(p->wait(30s));
      INFO(p->out() << p->err());
      CHECK(p->exit_code() == 0);
      auto lines = json_lines(p->out());
      REQUIRE(lines.size() == 1);
      INFO(lines[0].dump());
      CHECK(fd_numbers(lines[0]) == std::set<std::string>{"0", "1", "2"});
    }
  }
  SECTION("in a standalone run with redirected logs and two workers") {
    std::string dir = make_temp_dir();
    auto r = run(standalone({"--nproc_per_node=2", "--log_dir", dir, "--tee", "3"}, {"fds"}));
    INFO(r.out << r.err);
    CHECK(r.code == 0);
    auto lines = json_lines(r.out);
    REQUIRE(lines.size() == 2);
    for (const auto& l : lines) {
      INFO(l.dump());
      CHECK(fd_numbers(l) == std::set<std::string>{"0", "1", "2"});
    }
  }
}

TEST_CASE("the rendezvous token never reaches a worker's environment") {
  const std::string token = "s3cret-token-" + std::to_string(::getpid());
  const std::map<std::string, std::string> env{{"MGLAUNCH_RDZV_TOKEN", token}};
  Daemon d = start_daemon(env);
  const std::string& ep = d.endpoint;
  Proc a = spawn(node_argv(ep, "token", 1, 2, {}, {"env"}), env);
  Proc b = spawn(node_argv(ep, "token", 2, 2, {}, {"env"}), env);
  for (auto* p : {&a, &b}) {
    REQUIRE(p->wait(30s));
    INFO(p->err());
    CHECK(p->exit_code() == 0);
    auto lines = json_lines(p->out());
    REQUIRE(lines.size() == 1);
    CHECK(lines[0].contains("RANK"));  // the dump is the worker's environment
    CHECK_FALSE(lines[0].contains("MGLAUNCH_RDZV_TOKEN"));
    CHECK(p->out().find(token) == std::string::npos);
  }
}

TEST_CASE("a straggler in the worker's group and a daemonised grandchild do not outlive the agent") {
  std::string dir = make_temp_dir();
  Leftovers left{dir + "/pids"};
  const std::vector<std::string> spawn_both{"spawn-child", "group", left.pidfile, "spawn-child", "daemon", left.pidfile};
  auto with = [&](std::vector<std::string> tail) {
    auto cmds = spawn_both;
    cmds.insert(cmds.end(), tail.begin(), tail.end());
    return cmds;
  };
  SECTION("after the workers succeed") {
    auto r = run(standalone({"--nproc_per_node=2"}, with({"exit", "0"})));
    INFO(r.err);
    CHECK(r.code == 0);
    REQUIRE(read_pids(left.pidfile).size() == 4);
    CHECK(left.alive().empty());
  }
  SECTION("after a worker fails") {
    // Rank 1 leaves both behind and fails; rank 0 is stopped while it hangs.
    auto cmds = spawn_both;
    cmds.insert(cmds.begin(), {"when-rank", "1"});
    cmds.insert(cmds.end(), {"exit", "3"});
    auto r = run(standalone({"--nproc_per_node=2", "--grace=60"}, cmds));
    INFO(r.err);
    CHECK(r.code == 3);
    REQUIRE(read_pids(left.pidfile).size() == 2);
    CHECK(left.alive().empty());
  }
  SECTION("after SIGTERM to the agent") {
    Proc agent = spawn(standalone({"--nproc_per_node=2", "--grace=60"}, with({"print", "ready", "hang", "60"})));
    REQUIRE(eventually([&] { return split_lines(agent.out()).size() == 2; }, 20s));
    REQUIRE(read_pids(left.pidfile).size() == 4);
    ::kill(agent.pid, SIGTERM);
    REQUIRE(agent.wait(30s));
    INFO(agent.err());
    CHECK(agent.exit_code() == 128 + SIGTERM);
    CHECK(left.alive().empty());
  }
  SECTION("in a 2-node job") {
    Daemon d = start_daemon();
    const std::string& ep = d.endpoint;
    Proc a = spawn(node_argv(ep, "leftovers", 1, 2, {}, with({"exit", "0"})));
    Proc b = spawn(node_argv(ep, "leftovers", 2, 2, {}, with({"exit", "0"})));
    for (auto* p : {&a, &b}) {
      REQUIRE(p->wait(30s));
      INFO(p->err());
      CHECK(p->exit_code() == 0);
    }
    REQUIRE(read_pids(left.pidfile).size() == 4);
    CHECK(left.alive().empty());
  }
}

TEST_CASE("stragglers of a failed attempt are gone before the restarted workers start") {
  std::string dir = make_temp_dir();
  Leftovers left{dir + "/pids"};
  // Attempt 0 leaves a straggler and a daemon and fails; attempt 1 exits 9 if either lives.
  auto r = run(standalone({"--nproc_per_node=1", "--max_restarts=1"},
                          {"expect-dead", left.pidfile, "when-restart-below", "1", "spawn-child", "group",
                           left.pidfile, "spawn-child", "daemon", left.pidfile, "exit", "3"}));
  INFO(r.err);
  CHECK(r.code == 0);
  CHECK(read_pids(left.pidfile).size() == 2);
  CHECK(left.alive().empty());
}

TEST_CASE("the agent's view of /proc: stat lines parse, descendants are found through re-parenting") {
  auto st = mg::parse_proc_stat("4242 (a (b) c) S 17 4242 4242 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 987654 12 34");
  REQUIRE(st);
  CHECK(st->pid == 4242);
  CHECK(st->ppid == 17);
  CHECK(st->pgrp == 4242);
  CHECK(st->state == 'S');
  CHECK(st->starttime == 987654);
  CHECK_FALSE(mg::parse_proc_stat("4242 (x) S 17 4242"));  // cut short before the start time
  CHECK_FALSE(mg::parse_proc_stat(""));
  CHECK_FALSE(mg::parse_proc_stat("12 (x"));
  CHECK_FALSE(mg::parse_proc_stat("12 (x) S"));
  CHECK_FALSE(mg::parse_proc_stat("x (y) S 1 1"));
  std::vector<mg::ProcStat> table{{1, 0, 1, 'S'}, {10, 1, 10, 'S'}, {11, 10, 11, 'S'}, {12, 11, 11, 'Z'},
                                  {13, 12, 11, 'S'}, {14, 10, 14, 'R'}, {20, 1, 20, 'S'}};
  std::set<pid_t> d;
  for (const auto& p : mg::descendants_of(table, 10)) d.insert(p.pid);
  CHECK(d == std::set<pid_t>{11, 13, 14});  // the zombie 12 is skipped, its child is not
  CHECK(mg::descendants_of(table, 20).empty());
}

TEST_CASE("master ports are drawn outside the kernel's ephemeral range") {
  CHECK(mg::parse_port_range("32768\t60999\n")->lo == 32768);
  CHECK(mg::parse_port_range("1024 65000")->hi == 65000);
  CHECK_FALSE(mg::parse_port_range(""));
  CHECK_FALSE(mg::parse_port_range("60999 32768"));
  CHECK_FALSE(mg::parse_port_range("1 70000"));
  CHECK_FALSE(mg::parse_port_range("1 2 3"));
  const mg::PortRange eph{32768, 60999};
  std::set<int> seen;
  int bad = 0;
  for (unsigned r = 0; r < 40000; ++r) {
    const int p = mg::port_outside(eph, r);
    bad += p < mg::kLowestMasterPort || p > 65535 || (p >= eph.lo && p <= eph.hi);
    seen.insert(p);
  }
  CHECK(bad == 0);
  // Every port on both sides of the range can be drawn.
  CHECK(seen.size() == static_cast<std::size_t>((eph.lo - mg::kLowestMasterPort) + (65535 - eph.hi)));
  CHECK(*seen.begin() == mg::kLowestMasterPort);
  CHECK(*seen.rbegin() == 65535);
  CHECK(mg::port_outside({1024, 65535}, 5) == 0);  // nothing left

  // The real agent, with the real kernel range.
  const mg::PortRange real = mg::ephemeral_port_range();
  auto r = run(standalone({"--nproc_per_node=1"}, {"env"}));
  REQUIRE(r.code == 0);
  auto lines = json_lines(r.out);
  REQUIRE(lines.size() == 1);
  const int port = std::stoi(lines[0]["MASTER_PORT"].get<std::string>());
  INFO("MASTER_PORT " << port << ", ephemeral range " << real.lo << "-" << real.hi);
  CHECK((port < real.lo || port > real.hi));
}

TEST_CASE("a restart after EADDRINUSE on the master port gets a fresh port") {
  std::string dir = make_temp_dir();
  const std::string go = dir + "/go";
  // Attempt 0 prints its env and waits until the test has taken its MASTER_PORT, then
  // fails to listen there; attempt 1 must be given another port and succeed.
  // Rank 0 hosts the store on MASTER_PORT (the agent's store off, as torchrun's switch says).
  Proc agent = spawn(standalone({"--nproc_per_node=1", "--max_restarts=1"}, {"env", "wait-file", go, "listen-master"}),
                     {{"TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1"}});
  REQUIRE(eventually([&] { return json_lines(agent.out()).size() == 1; }, 20s));
  const int first = std::stoi(json_lines(agent.out())[0]["MASTER_PORT"].get<std::string>());
  int squatter = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<uint16_t>(first));
  REQUIRE(::bind(squatter, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0);
  REQUIRE(::listen(squatter, 4) == 0);
  std::ofstream(go) << "go\n";
  const bool ended = agent.wait(30s);
  ::close(squatter);
  REQUIRE(ended);
  INFO(agent.out() << agent.err());
  CHECK_THAT(agent.err(), Catch::Contains("Address already in use"));
  CHECK(agent.exit_code() == 0);
  auto lines = json_lines(agent.out());
  REQUIRE(lines.size() == 2);
  CHECK(lines[1]["MASTER_PORT"] != lines[0]["MASTER_PORT"]);
}

TEST_CASE("a stalled stdout does not stop the heartbeats: the 2-node job completes once it is read") {
  Daemon d = start_daemon();
  // Heartbeats every second, a node is lost after 3 missed ones (3 s: margin for a loaded
  // machine).
  const std::vector<std::string> flags{"--rdzv_conf=keep_alive_interval=1,keep_alive_max_attempt=3"};
  constexpr long kLines = 100000;  // ~5 MB: far more than a pipe and the console's queue hold
  auto a = spawn_piped(node_argv(d.endpoint, "stall", 1, 2, flags, {"lines", std::to_string(kLines)}));
  Proc b = spawn(node_argv(d.endpoint, "stall", 2, 2, flags, {"print", "b-done"}));
  // Node 1's stdout pipe fills up and nobody reads it.
  REQUIRE(eventually([&] {
    int queued = 0;
    return ::ioctl(a->out, FIONREAD, &queued) == 0 && queued >= 65536;
  }, 30s));
  REQUIRE(eventually([&] { return b.out().find("b-done") != std::string::npos; }, 30s));
  // The stall lasts over three heartbeat timeouts. An agent whose event loop is blocked in
  // write() misses its heartbeats: the job is aborted and node 2 exits early.
  const bool b_ended_during_stall = eventually([&] { return ::waitpid(b.pid, &b.status, WNOHANG) == b.pid; }, 10s);
  INFO(b.err());
  CHECK_FALSE(b_ended_during_stall);
  CHECK_FALSE(a->exited());
  // Now read: every line arrives, whole and in order, and both nodes succeed.
  const std::string out = read_to_end(a->out, 120s);
  REQUIRE(eventually([&] { return a->exited(); }, 30s));
  INFO(a->err());
  CHECK(WIFEXITED(a->status));
  CHECK(WEXITSTATUS(a->status) == 0);
  REQUIRE(b.wait(30s));
  CHECK(b.exit_code() == 0);
  long next = 0, bad = 0;
  for (const auto& l : split_lines(out)) {
    // "[rankR]:R:i:abc...789"
    auto c1 = l.find(':'), c2 = l.find(':', c1 + 1), c3 = l.find(':', c2 + 1);
    if (c3 == std::string::npos || l.substr(c3 + 1) != "abcdefghijklmnopqrstuvwxyz0123456789" ||
        l.substr(c2 + 1, c3 - c2 - 1) != std::to_string(next)) {
      ++bad;
      continue;
    }
    ++next;
  }
  CHECK(bad == 0);
  CHECK(next == kLines);
}

TEST_CASE("a node that loses the rendezvous after its workers were stopped exits with their code, not 0") {
  Daemon d = start_daemon();
  std::string dir = make_temp_dir();
  const std::vector<std::string> flags{"--max_restarts=1",
                                       "--rdzv_conf=keep_alive_interval=1,keep_alive_max_attempt=3,join_timeout=5"};
  Proc a = spawn(node_argv(d.endpoint, "lost", 1, 2, flags, {"pidfile", dir + "/a", "print", "up", "hang", "60"}));
  Proc b = spawn(node_argv(d.endpoint, "lost", 2, 2, flags, {"print", "up", "hang", "60"}));
  REQUIRE(eventually([&] { return a.out().find("up") != std::string::npos && b.out().find("up") != std::string::npos; },
                     30s));
  // Node 2 hangs: the rendezvous restarts the job; node 1 stops its worker and waits for
  // a new round that cannot come, and then the rendezvous itself goes away.
  ::kill(b.pid, SIGSTOP);
  REQUIRE(eventually([&] { return a.err().find("restart 1 decided by the rendezvous") != std::string::npos; }, 30s));
  const auto pids = read_pids(dir + "/a");
  REQUIRE(pids.size() == 1);
  REQUIRE(eventually([&] { return !pid_alive(pids[0]); }, 30s));
  ::kill(d.proc.pid, SIGKILL);
  REQUIRE(a.wait(60s));
  INFO(a.err());
  CHECK(a.exit_code() == 128 + SIGTERM);  // its worker's own code: stopped by SIGTERM
}

TEST_CASE("signals reach a worker's process group after its leader has exited") {
  std::string dir = make_temp_dir();
  Leftovers left{dir + "/pids"};
  // Rank 0 leaves a member of its process group behind and exits 0; rank 1 (which
  // survives SIGUSR1) keeps the run going.
  Proc agent = spawn(standalone({"--nproc_per_node=2"}, {"trap-usr", "print", "ready", "when-rank", "0", "pidfile", dir + "/leader", "spawn-child",
                                                        "group-usr", left.pidfile, "exit", "0"}));
  REQUIRE(eventually([&] { return read_pids(left.pidfile).size() == 1 && read_pids(dir + "/leader").size() == 1; },
                     30s));
  REQUIRE(eventually([&] { return split_lines(agent.out()).size() == 2; }, 30s));  // both ranks trap SIGUSR1
  const pid_t leader = read_pids(dir + "/leader")[0];
  REQUIRE(eventually([&] { return !pid_alive(leader); }, 30s));
  ::kill(agent.pid, SIGUSR1);
  CHECK(eventually([&] { return read_file(left.pidfile + ".usr").find("got SIGUSR1") != std::string::npos; }, 20s));
  ::kill(agent.pid, SIGTERM);
  REQUIRE(agent.wait(30s));
  CHECK(agent.exit_code() == 128 + SIGTERM);
  CHECK(left.alive().empty());
}

TEST_CASE("a stalled log file does not stop the heartbeats: the 2-node job completes once it is read") {
  Daemon d = start_daemon();
  const std::vector<std::string> rdzv{"--rdzv_conf=keep_alive_interval=1,keep_alive_max_attempt=3"};
  constexpr long kLines = 100000;
  // Node 1's stdout.log is a FIFO this test holds open and does not read for a while
  // (a log file system that stalls). The run's directory is DIR/stall-log_TIME_XXXXXX,
  // linked as DIR/stall-log once node 1 started; its workers start only when node 2 joins.
  const std::string dir = make_temp_dir();
  auto flags = rdzv;
  flags.insert(flags.end(), {"--log_dir", dir, "--redirects", "1"});
  Proc a = spawn(node_argv(d.endpoint, "stall-log", 1, 2, flags, {"lines", std::to_string(kLines)}));
  REQUIRE(eventually([&] { return std::filesystem::is_symlink(dir + "/stall-log"); }, 30s));
  const std::string attempt_dir = dir + "/stall-log/attempt_0/0";
  std::filesystem::create_directories(attempt_dir);
  const std::string fifo = attempt_dir + "/stdout.log";
  REQUIRE(::mkfifo(fifo.c_str(), 0644) == 0);
  const int reader = ::open(fifo.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  REQUIRE(reader >= 0);
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{reader};
  Proc b = spawn(node_argv(d.endpoint, "stall-log", 2, 2, rdzv, {"print", "b-done"}));
  REQUIRE(eventually([&] {
    int queued = 0;
    return ::ioctl(reader, FIONREAD, &queued) == 0 && queued >= 65536;
  }, 30s));
  REQUIRE(eventually([&] { return b.out().find("b-done") != std::string::npos; }, 30s));
  // Over three heartbeat timeouts with the log file stalled.
  const bool b_ended_during_stall = eventually([&] { return ::waitpid(b.pid, &b.status, WNOHANG) == b.pid; }, 10s);
  INFO(b.err());
  CHECK_FALSE(b_ended_during_stall);
  const std::string out = read_to_end(reader, 120s);
  REQUIRE(a.wait(30s));
  INFO(a.err());
  CHECK(a.exit_code() == 0);
  REQUIRE(b.wait(30s));
  CHECK(b.exit_code() == 0);
  long next = 0, bad = 0;
  for (const auto& l : split_lines(out)) {
    // "R:i:abc...789", raw (no prefix in log files)
    auto c1 = l.find(':'), c2 = l.find(':', c1 + 1);
    if (c2 == std::string::npos || l.substr(c2 + 1) != "abcdefghijklmnopqrstuvwxyz0123456789" ||
        l.substr(c1 + 1, c2 - c1 - 1) != std::to_string(next)) {
      ++bad;
      continue;
    }
    ++next;
  }
  CHECK(bad == 0);
  CHECK(next == kLines);
}

TEST_CASE("both ways of marking descriptors close-on-exec leave an exec'd program only 0, 1 and 2") {
  for (bool listing : {false, true}) {
    INFO((listing ? "the /proc/self/fd fallback" : "close_range"));
    std::string dir = make_temp_dir();
    int leak[2];
    REQUIRE(::pipe(leak) == 0);  // no O_CLOEXEC: inherited unless marked
    const std::string out = dir + "/out";
    pid_t pid = ::fork();
    if (pid == 0) {
      int fd = ::open(out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      ::dup2(fd, 1);
      const bool ok = listing ? mg::mark_cloexec_above_stderr_by_listing() : mg::mark_cloexec_above_stderr();
      if (!ok) ::_exit(90);
      ::execl(kFakeWorker.c_str(), kFakeWorker.c_str(), "fds", static_cast<char*>(nullptr));
      ::_exit(91);
    }
    int status = 0;
    REQUIRE(eventually([&] { return ::waitpid(pid, &status, WNOHANG) == pid; }, 30s));
    ::close(leak[0]);
    ::close(leak[1]);
    REQUIRE(WIFEXITED(status));
    REQUIRE(WEXITSTATUS(status) == 0);
    auto j = nlohmann::json::parse(read_file(out));
    INFO(j.dump());
    CHECK(fd_numbers(j) == std::set<std::string>{"0", "1", "2"});
  }
}

TEST_CASE("a hosting agent stopped by SIGTERM tells the other node, which stops at once instead of at join_timeout") {
  // The first agent hosts the rendezvous in-process; when it goes, so does the server.
  const int port = free_loopback_port();
  const std::string ep = "127.0.0.1:" + std::to_string(port);
  const std::vector<std::string> host_flags{"--rdzv_conf=is_host=true,join_timeout=300"};
  const std::vector<std::string> flags{"--rdzv_conf=join_timeout=300"};
  Proc a = spawn(node_argv(ep, "leave", 1, 2, host_flags, {"print", "up", "hang", "120"}));
  REQUIRE(eventually([&] { return a.err().find("hosting the rendezvous") != std::string::npos; }, 30s));
  Proc b = spawn(node_argv(ep, "leave", 2, 2, flags, {"print", "up", "hang", "120"}));
  REQUIRE(eventually([&] { return a.out().find("up") != std::string::npos && b.out().find("up") != std::string::npos; },
                     30s));
  ::kill(a.pid, SIGTERM);
  REQUIRE(a.wait(60s));
  INFO(a.err());
  CHECK(a.exit_code() == 128 + SIGTERM);
  // Far less than join_timeout (300 s): the other node heard that this one left.
  REQUIRE(b.wait(60s));
  INFO(b.err());
  CHECK(b.exit_code() == 128 + SIGTERM);
  CHECK_THAT(b.err(), Catch::Contains("was stopped by SIGTERM"));
}

TEST_CASE("the agent finds its own process tree and its zombies through the kernel's children lists") {
  // A child that starts a grandchild, and a child that exits unreaped (a zombie). Both wait
  // on a pipe, so closing it ends them; the guard does that and reaps even on failure.
  int gate[2];
  REQUIRE(::pipe(gate) == 0);
  auto wait_gate = [&] {
    ::close(gate[1]);
    char c;
    while (::read(gate[0], &c, 1) < 0 && errno == EINTR) {
    }
  };
  int ready[2];
  REQUIRE(::pipe(ready) == 0);
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    ::close(ready[0]);
    const pid_t grandchild = ::fork();
    if (grandchild == 0) {
      ::close(ready[1]);
      wait_gate();
      ::_exit(0);
    }
    const ssize_t ignored = ::write(ready[1], &grandchild, sizeof(grandchild));
    (void)ignored;
    ::close(ready[1]);
    wait_gate();
    ::waitpid(grandchild, nullptr, 0);
    ::_exit(0);
  }
  const pid_t zombie = ::fork();
  if (zombie == 0) ::_exit(0);
  struct Reap {
    int gate_w;
    pid_t a, z;
    ~Reap() {
      ::close(gate_w);
      ::waitpid(a, nullptr, 0);
      if (z > 0) ::waitpid(z, nullptr, 0);
    }
  } reap{gate[1], child, zombie};
  ::close(gate[0]);
  ::close(ready[1]);
  pid_t grandchild = 0;
  REQUIRE(::read(ready[0], &grandchild, sizeof(grandchild)) == sizeof(grandchild));
  ::close(ready[0]);
  REQUIRE(zombie > 0);
  // The zombie: until it is one, it is simply a child (bounded wait).
  for (int i = 0; i < 500; ++i) {
    auto st = mg::parse_proc_stat(read_file("/proc/" + std::to_string(zombie) + "/stat"));
    if (st && st->state == 'Z') break;
    ::usleep(10000);
  }

  const pid_t self = ::getpid();
  std::map<pid_t, mg::ProcStat> family;
  for (const auto& p : mg::scan_family(self)) family[p.pid] = p;
  REQUIRE(family.count(child));
  REQUIRE(family.count(grandchild));
  REQUIRE(family.count(zombie));
  CHECK(family[child].ppid == self);
  CHECK(family[grandchild].ppid == child);
  CHECK(family[zombie].state == 'Z');
  // The same living descendants as a scan of every process on the machine.
  std::set<pid_t> fast, full;
  for (const auto& p : mg::descendants_of(mg::scan_family(self), self)) fast.insert(p.pid);
  for (const auto& p : mg::descendants_of(mg::scan_processes(), self)) full.insert(p.pid);
  CHECK(fast == full);
  CHECK(fast.count(grandchild));
  CHECK_FALSE(fast.count(zombie));
}
