// The agent under stress (issue #11): what a worker inherits, what is left running after
// the agent stops, master ports under load, a stalled console. Real mglaunch agents,
// real fake_worker processes, rendezvous on 127.0.0.x with ports picked at run time.
#include <catch2/catch.hpp>

#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <fstream>
#include <map>
#include <set>

#include <nlohmann/json.hpp>

#include "launcher/port.h"
#include "launcher/worker_process.h"
#include "support/proc.h"

using namespace mgtest;
using namespace std::chrono_literals;

namespace {

int free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  socklen_t len = sizeof(a);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  return ntohs(a.sin_port);
}

std::vector<std::string> standalone(std::vector<std::string> flags, std::vector<std::string> worker) {
  std::vector<std::string> argv{kMglaunch, "--standalone"};
  argv.insert(argv.end(), flags.begin(), flags.end());
  argv.push_back(kFakeWorker);
  argv.insert(argv.end(), worker.begin(), worker.end());
  return argv;
}

// One agent of an n-node job on 127.0.0.<index> against the rendezvous at `endpoint`
// (the first agent to come hosts it).
std::vector<std::string> node_argv(const std::string& endpoint, const std::string& job, int index, int nnodes,
                                   std::vector<std::string> flags, std::vector<std::string> worker) {
  std::vector<std::string> argv{kMglaunch,
                                "--nnodes=" + std::to_string(nnodes),
                                "--nproc_per_node=1",
                                "--rdzv_backend=c10d",
                                "--rdzv_endpoint=" + endpoint,
                                "--rdzv_id=" + job,
                                "--local_addr=127.0.0." + std::to_string(index)};
  argv.insert(argv.end(), flags.begin(), flags.end());
  argv.push_back(kFakeWorker);
  argv.insert(argv.end(), worker.begin(), worker.end());
  return argv;
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

std::vector<pid_t> read_pids(const std::string& path) {
  std::vector<pid_t> pids;
  for (const auto& l : split_lines(read_file(path)))
    if (!l.empty()) pids.push_back(std::stoi(l));
  return pids;
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

}  // namespace

TEST_CASE("a worker inherits no descriptor of the agent: only stdin, stdout and stderr") {
  SECTION("in a 2-node job, where the agent holds rendezvous sockets") {
    const std::string ep = "127.0.0.1:" + std::to_string(free_port());
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
  const std::string ep = "127.0.0.1:" + std::to_string(free_port());
  const std::map<std::string, std::string> env{{"MGLAUNCH_RDZV_TOKEN", token}};
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
    auto r = run(standalone({"--nproc_per_node=2", "--grace=60"}, with({"when-rank", "1", "exit", "3"})));
    INFO(r.err);
    CHECK(r.code == 3);
    REQUIRE(read_pids(left.pidfile).size() == 4);
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
    const std::string ep = "127.0.0.1:" + std::to_string(free_port());
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
  auto st = mg::parse_proc_stat("4242 (a (b) c) S 17 4242 4242 0 -1 4194560 ...");
  REQUIRE(st);
  CHECK(st->pid == 4242);
  CHECK(st->ppid == 17);
  CHECK(st->pgrp == 4242);
  CHECK(st->state == 'S');
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
  Proc agent = spawn(standalone({"--nproc_per_node=1", "--max_restarts=1"}, {"env", "wait-file", go, "listen-master"}));
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
