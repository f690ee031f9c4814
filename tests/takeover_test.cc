// The agent that hosts the rendezvous (c10d-style: the agent at --rdzv_endpoint) SIGKILLed
// mid-run, with real agents on 127.0.0.2-127.0.0.4 and fake_worker as the workload
// (#26, "the hosting agent's death is survivable").
#include <catch2/catch.hpp>

#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <arpa/inet.h>

#include "launcher/job_record.h"
#include "launcher/plan.h"
#include "proto/frame.h"
#include "proto/messages.h"
#include "support/proc.h"
#include "support/rdzv_fixture.h"
#include "support/skip.h"

using namespace mgtest;
using namespace std::chrono_literals;

namespace {

// Starts the hosting agent on 127.0.0.2 first (so that it is the one listening at the
// endpoint), then the agents on 127.0.0.3 and 127.0.0.4; returns once every worker printed
// "up". agents[0] hosts.
std::vector<Proc> start_job(const std::string& ep, const std::string& job, const std::string& nnodes,
                            const std::vector<std::string>& flags, const std::vector<std::string>& worker,
                            const std::map<std::string, std::string>& env = {}, int count = 3) {
  std::vector<Proc> agents;
  agents.push_back(spawn(agent_argv(ep, job, 2, nnodes, 1, flags, worker), env));
  const bool hosting =
      eventually([&] { return agents[0].err().find("hosting the rendezvous") != std::string::npos; }, 20s);
  INFO("the first agent at " << ep << " (alive: " << pid_alive(agents[0].pid) << "):\n" << agents[0].out()
                             << agents[0].err());
  REQUIRE(hosting);
  for (int i = 3; i < 2 + count; ++i) agents.push_back(spawn(agent_argv(ep, job, i, nnodes, 1, flags, worker), env));
  REQUIRE(eventually([&] {
    return std::all_of(agents.begin(), agents.end(), [](Proc& p) { return p.out().find("up") != std::string::npos; });
  }, 30s));
  return agents;
}

// The agents of the rejoin cases (#34 H1): a token, and their records (launcher/job_record.h)
// in `records`, a directory of the test's own; a keep-alive interval of 1 s.
std::map<std::string, std::string> rejoin_env(const std::string& records) {
  return {{"MGLAUNCH_RDZV_TOKEN", "5f1c0e9a7b2d4c6e8a0b1c2d3e4f5061"}, {"XDG_RUNTIME_DIR", records}};
}
// rejoin_env() with the records in `records` itself (MGLAUNCH_RECORD_DIR).
std::map<std::string, std::string> record_env(const std::string& records) {
  auto env = rejoin_env(records);
  env["MGLAUNCH_RECORD_DIR"] = records;
  return env;
}
// The records in `dir` (job-HASH.json; not a write's temporary file).
std::size_t records_in(const std::string& dir) {
  std::size_t n = 0;
  for (const auto& f : std::filesystem::directory_iterator(dir)) n += f.path().extension() == ".json";
  return n;
}
const std::string kRejoinConf = "--rdzv_conf=keep_alive_interval=1,keep_alive_max_attempt=3,last_call_timeout=3";

// A whole job SIGKILLed at once: every agent's process group stopped first, then killed. Killed
// one after another, a node still running sees its host lost and, with too few survivors
// to take over, ends the job for good and removes its record (exit 3): a job ended so, not
// the whole job lost at once that the rerun cases mean.
void kill_at_once(std::vector<Proc>& agents) {
  for (Proc& p : agents) ::kill(-p.pid, SIGSTOP);
  for (Proc& p : agents) ::kill(-p.pid, SIGKILL);
  for (Proc& p : agents) p.wait(5s);
}

// What the takeover socket at addr:port answers a hello for `job` from 127.0.0.1 (one frame,
// read within 10 s): its NotHosting, or nullopt (refused, silent, closed, another frame).
std::optional<mg::proto::NotHosting> not_hosting_at(const std::string& addr, int port, const std::string& job) {
  namespace proto = mg::proto;
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  REQUIRE(fd >= 0);
  std::optional<proto::NotHosting> out;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<std::uint16_t>(port));
  ::inet_pton(AF_INET, addr.c_str(), &a.sin_addr);
  const auto hello =
      proto::encode(proto::to_frame(proto::Hello{"test", job, std::string(64, 'a'), /*reads_not_hosting=*/true}));
  std::vector<std::uint8_t> got;
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 &&
      ::send(fd, hello.data(), hello.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(hello.size())) {
    const auto end = std::chrono::steady_clock::now() + 10s;
    std::uint8_t buf[4096];
    while (std::chrono::steady_clock::now() < end) {
      pollfd p{fd, POLLIN, 0};
      if (::poll(&p, 1, 100) <= 0) continue;
      const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
      if (n <= 0) break;
      got.insert(got.end(), buf, buf + n);
    }
  }
  ::close(fd);
  const auto r = proto::decode(got);
  if (r.status == proto::DecodeResult::Status::kOk && proto::type_of(r.frame) == proto::MsgType::kNotHosting)
    out = proto::from_frame<proto::NotHosting>(r.frame);
  return out;
}

// A job of `count` agents started as start_job() does (endpoint 127.0.0.2, a free port), each
// keeping its record in a directory of the test's own (MGLAUNCH_RECORD_DIR); returned once
// every record is written (before its node's first workers start, so at once).
struct RecordedJob {
  std::string ep, records;
  std::map<std::string, std::string> env;
  std::vector<Proc> agents;
};
RecordedJob start_recorded_job(const std::string& job, const std::string& nnodes, const std::vector<std::string>& flags,
                               const std::vector<std::string>& worker, int count = 3) {
  RecordedJob j{"127.0.0.2:" + std::to_string(free_loopback_port()), make_temp_dir(), {}, {}};
  j.env = record_env(j.records);
  j.agents = start_job(j.ep, job, nnodes, flags, worker, j.env, count);
  REQUIRE(eventually([&] { return records_in(j.records) == static_cast<std::size_t>(count); }, 10s));
  return j;
}

// The takeover port in the record of node 127.0.0.N (in `dir`), 0 if none.
int recorded_takeover_port(const std::string& dir, int n) {
  for (const auto& f : std::filesystem::directory_iterator(dir)) {
    if (f.path().extension() != ".json") continue;
    const auto j = nlohmann::json::parse(std::ifstream(f.path()), nullptr, false);
    if (j.is_object() && j.value("node", "").starts_with("127.0.0." + std::to_string(n) + "@"))
      return j.value("takeover_port", 0);
  }
  return 0;
}

}  // namespace

// docs/multinode.md, "Two voters": with two nodes and no standby no side of a cut has a
// majority; the run says so once at its first round, on each node. A third node rules a
// split out: no such line.
TEST_CASE("an agent-hosted job of two nodes and no standby says at its first round that it has two voters (no "
          "majority on either side of a cut), on each node, and a job of three nodes does not") {
  for (const std::string nnodes : {"2", "3"}) {
    INFO("--nnodes=" << nnodes);
    const std::string ep = "127.0.0.2:" + std::to_string(free_loopback_port());
    const std::vector<std::string> flags{"--max_restarts=0"};
    std::vector<Proc> agents;
    agents.push_back(spawn(agent_argv(ep, "voters" + nnodes, 2, nnodes, 1, flags, {"print", "up"})));
    REQUIRE(eventually([&] { return agents[0].err().find("hosting the rendezvous") != std::string::npos; }, 20s));
    for (int i = 3; i < 2 + std::stoi(nnodes); ++i)
      agents.push_back(spawn(agent_argv(ep, "voters" + nnodes, i, nnodes, 1, flags, {"print", "up"})));
    for (auto& a : agents) {
      REQUIRE(a.wait(60s));
      INFO(a.err());
      CHECK(a.exit_code() == 0);
      const int told = count_of(a.err(), "this job has two voters (two nodes, no standby): if a network "
                                                 "partition cuts them apart, no side has a majority");
      CHECK(told == (nnodes == "2" ? 1 : 0));
    }
  }
}

TEST_CASE("the hosting agent SIGKILLed where no survivor can take over (no restart left, too few nodes left): every "
          "survivor ends at once with the lost host as root cause, exit 3, never after join_timeout") {
  struct Case {
    std::string nnodes, restarts, why;
  };
  for (const Case& c : {Case{"3", "0", "no restart left"}, Case{"3", "2", "2 node(s) left, fewer than the 3"}}) {
    INFO("--nnodes=" << c.nnodes << " --max_restarts=" << c.restarts);
    const std::string ep = "127.0.0.2:" + std::to_string(free_loopback_port());
    // join_timeout is left at 600 s: a survivor that waited it out fails the wait below.
    const std::vector<std::string> flags{"--max_restarts=" + c.restarts,
                                         "--rdzv_conf=keep_alive_interval=1,keep_alive_max_attempt=3"};
    std::vector<Proc> agents = start_job(ep, "hostlost" + c.restarts, c.nnodes, flags, {"print", "up", "hang", "300"});
    ::kill(agents[0].pid, SIGKILL);
    for (int i : {1, 2}) {
      REQUIRE(agents[i].wait(60s));
      INFO(agents[i].err());
      CHECK(agents[i].exit_code() == 3);
      CHECK_THAT(agents[i].out() + agents[i].err(),
                 Catch::Contains("rendezvous host ") && Catch::Contains("(" + ep + ") lost: ") &&
                     Catch::Contains("no survivor can take over: " + c.why) && !Catch::Contains("join_timeout"));
    }
    agents[0].wait(5s);
  }
}

TEST_CASE("the hosting agent SIGKILLed: the lowest live node takes the rendezvous over, proving the job's token, "
          "and the survivors finish the job in a restart round") {
  const std::string ep = "127.0.0.2:" + std::to_string(free_loopback_port());
  const std::map<std::string, std::string> env{{"MGLAUNCH_RDZV_TOKEN", "takeover-test-token"}};
  const std::vector<std::string> flags{"--max_restarts=1",
                                       "--rdzv_conf=keep_alive_interval=1,keep_alive_max_attempt=3,last_call_timeout=1"};
  // The first round hangs; the restart after the host's loss exits 0.
  std::vector<Proc> agents = start_job(ep, "takeover", "2:3", flags,
                                       {"env", "print", "up", "when-restart-below", "1", "hang", "300"}, env);
  ::kill(agents[0].pid, SIGKILL);
  for (int i : {1, 2}) {
    REQUIRE(agents[i].wait(60s));
    INFO(agents[i].err());
    CHECK(agents[i].exit_code() == 0);
    const auto e = envs(agents[i].out());
    REQUIRE(!e.empty());
    CHECK(e.back()["TORCHELASTIC_RESTART_COUNT"] == "1");
    CHECK(e.back()["WORLD_SIZE"] == "2");
    CHECK(e.back()["MASTER_ADDR"] == "127.0.0.3");  // the new group rank 0
    CHECK_THAT(agents[i].err(), Catch::Contains("(" + ep + ") lost: "));
    // The new host's job goes on with the run the lost host minted, at a later epoch (#37).
    CHECK(e.size() == 2);
    CHECK(std::stoll(e.back()["MGLAUNCH_EPOCH"].get<std::string>()) > std::stoll(e.front()["MGLAUNCH_EPOCH"].get<std::string>()));
    CHECK(e.front().value("MGLAUNCH_RUN", "").size() > 2);
    CHECK(e.back().value("MGLAUNCH_RUN", "") == e.front().value("MGLAUNCH_RUN", ""));
  }
  // 127.0.0.3 was group rank 1, the lowest live node: it hosts; 127.0.0.4 joins it.
  CHECK_THAT(agents[1].err(), Catch::Contains("hosting the rendezvous for job 'takeover'") &&
                                  Catch::Contains("taking over from"));
  CHECK_THAT(agents[2].err(), Catch::Contains("the rendezvous is now hosted by") &&
                                  !Catch::Contains("hosting the rendezvous"));
  agents[0].wait(5s);
}

TEST_CASE("the hosting agent and the next node SIGKILLed at once: the last survivor tries that node, hosts itself, "
          "finds too few nodes and ends with the lost host as root cause, exit 3") {
  const std::string ep = "127.0.0.2:" + std::to_string(free_loopback_port());
  const std::vector<std::string> flags{"--max_restarts=1", "--rdzv_conf=keep_alive_interval=1,keep_alive_max_attempt=3"};
  std::vector<Proc> agents = start_job(ep, "twolost", "2:3", flags, {"print", "up", "hang", "300"});
  ::kill(agents[0].pid, SIGKILL);
  ::kill(agents[1].pid, SIGKILL);
  REQUIRE(agents[2].wait(60s));
  INFO(agents[2].err());
  CHECK(agents[2].exit_code() == 3);
  CHECK_THAT(agents[2].out() + agents[2].err(),
             Catch::Contains("rendezvous host ") && Catch::Contains(" lost: ") && !Catch::Contains("join_timeout"));
  for (int i : {0, 1}) agents[i].wait(5s);
}

TEST_CASE("the hosting agent of a 3-node job with one standby SIGKILLed: the standby follows the takeover, proving "
          "the job's token, takes the lost node's place at once, and the job finishes (#26, Done when)") {
  const std::string ep = "127.0.0.2:" + std::to_string(free_loopback_port());
  const std::map<std::string, std::string> env{{"MGLAUNCH_RDZV_TOKEN", "takeover-standby-token"}};
  // --nnodes=3 and a last call of 120 s: the job can go on only with the standby, and
  // only if it gets its place at once (no join wait).
  const std::vector<std::string> flags{
      "--max_restarts=1", "--rdzv_conf=keep_alive_interval=1,keep_alive_max_attempt=3,last_call_timeout=120"};
  const std::string pids = make_temp_dir() + "/pids";
  // The first round hangs; the round after the host's loss prints its environment, exits 0.
  const std::vector<std::string> worker{"pidfile", pids, "env", "when-restart-below", "1", "print", "up", "hang", "300"};
  std::vector<Proc> agents = start_job(ep, "standby-follows", "3", flags, worker, env);
  Proc s = spawn(agent_argv(ep, "standby-follows", 5, "3", 1, flags, worker), env);
  REQUIRE(eventually([&] { return s.err().find("[mglaunch] standby for job ") != std::string::npos || !pid_alive(s.pid); },
                     30s));
  ::kill(agents[0].pid, SIGKILL);
  for (Proc* p : {&agents[1], &agents[2], &s}) {
    REQUIRE(p->wait(90s));
    INFO(p->err());
    CHECK(p->exit_code() == 0);
  }
  agents[0].wait(5s);
  INFO(s.err());
  // The standby followed: it re-registered as one with the node that took over (127.0.0.3,
  // group rank 1, the lowest live node) and took group rank 0, the lost host's place.
  CHECK_THAT(s.err(), Catch::Contains("(" + ep + ") lost: ") &&
                          Catch::Contains("this standby follows the node that takes over") &&
                          Catch::Contains("the rendezvous is now hosted by") &&
                          Catch::Contains("re-registered as a standby") && Catch::Contains("round 2: node 0 of 3"));
  CHECK_THAT(agents[1].err(), Catch::Contains("taking over from"));
  const auto s_env = envs(s.out());
  REQUIRE(s_env.size() == 1);
  CHECK(s_env[0]["GROUP_RANK"] == "0");
  CHECK(s_env[0]["WORLD_SIZE"] == "3");
  CHECK(s_env[0]["TORCHELASTIC_RESTART_COUNT"] == "1");
  CHECK(s_env[0]["MASTER_ADDR"] == "127.0.0.5");
  // The survivors keep their group ranks.
  for (int i : {1, 2}) {
    const auto e = envs(agents[i].out());
    REQUIRE(e.size() == 2);
    CHECK(e.back()["GROUP_RANK"] == std::to_string(i));
    CHECK(e.back()["TORCHELASTIC_RESTART_COUNT"] == "1");
    CHECK(e.back()["MASTER_ADDR"] == "127.0.0.5");
  }
  // No worker is left, the lost host's included (its watchdog stopped it).
  const auto started = read_pids(pids);
  CHECK(started.size() == 6);  // 3 in the first round, 3 in the second
  CHECK(eventually([&] { return std::none_of(started.begin(), started.end(), pid_alive); }, 30s));
}

TEST_CASE("a survivor of a job whose endpoint is 'localhost', advertising this machine's name, takes over on that "
          "name's address only, never on every address (#35)") {
  // Before: the advertised address was bound only when it was an IPv4 literal, else
  // 0.0.0.0, so the new host listened on every address without a token (a warning only).
  const std::string ep = "localhost:" + std::to_string(free_loopback_port());
  const std::string job = "takeover-name";
  // As a new user runs it: no --local_addr, so each node advertises this machine's name.
  auto argv = [&] {
    return std::vector<std::string>{kMglaunch, "--nnodes=2:3", "--nproc_per_node=1", "--rdzv_backend=c10d",
                                    "--rdzv_endpoint=" + ep, "--rdzv_id=" + job, "--max_restarts=1",
                                    "--rdzv_conf=keep_alive_interval=1,keep_alive_max_attempt=3,last_call_timeout=1",
                                    kFakeWorker, "print", "up", "when-restart-below", "1", "hang", "300"};
  };
  std::vector<Proc> agents;
  agents.push_back(spawn(argv()));
  REQUIRE(eventually([&] { return agents[0].err().find("hosting the rendezvous") != std::string::npos; }, 20s));
  for (int i = 0; i < 2; ++i) agents.push_back(spawn(argv()));
  REQUIRE(eventually([&] {
    return std::all_of(agents.begin(), agents.end(), [](Proc& p) { return p.out().find("up") != std::string::npos; });
  }, 30s));
  ::kill(agents[0].pid, SIGKILL);
  std::string took;
  for (int i : {1, 2}) {
    REQUIRE(agents[i].wait(60s));
    INFO(agents[i].err());
    CHECK(agents[i].exit_code() == 0);
    CHECK_THAT(agents[i].err(), !Catch::Contains("0.0.0.0"));
    if (agents[i].err().find("taking over from") != std::string::npos) took = agents[i].err();
  }
  INFO(took);
  const std::string hosting = "hosting the rendezvous for job '" + job + "' on ";
  const auto at = took.find(hosting);
  REQUIRE(at != std::string::npos);
  const std::string addr = took.substr(at + hosting.size(), took.find(':', at + hosting.size()) - at - hosting.size());
  CHECK(addr != "0.0.0.0");
  // Where the name is a loopback address (as localhost, in /etc/hosts), no stranger reaches it.
  if (addr.starts_with("127.")) CHECK_THAT(took, !Catch::Contains("without a token"));
  agents[0].wait(5s);
}

TEST_CASE("a survivor whose host name resolves here only to 127.0.1.1 (Debian's hosts file) while the job's endpoint is "
          "on a real network takes over on the address it reaches the endpoint from, not on 127.0.1.1 (#35 review)") {
  // A host of our own: a network namespace with one address on a veth link, its own host
  // name, and a hosts file mapping that name to 127.0.1.1 (mount namespace). Before: the
  // survivor bound 127.0.1.1, where no other machine can reach it. Two nodes: in one
  // namespace the name resolves to 127.0.1.1 for every node, so a third could not reach the
  // new host at its name as another machine would (that needs hosts of their own, #34).
  if (run({"/usr/bin/unshare", "-n", "-u", "-m", "/bin/true"}).code != 0)
    SKIP_TEST("cannot create network, UTS and mount namespaces here (unshare -n -u -m needs root)");
  Proc host = spawn({"/usr/bin/unshare", "-n", "-u", "-m", "--propagation", "private", "/bin/sh", "-c",
                     "set -e; ip link set lo up; ip link add d0 type veth peer name d1; ip addr add 10.77.0.1/24 dev d0;"
                     " ip link set d0 up; ip link set d1 up; hostname nodea; printf '127.0.0.1 localhost\\n127.0.1.1 nodea\\n' > \"$TMPDIR/hosts\";"
                     " mount --bind \"$TMPDIR/hosts\" /etc/hosts; echo ready; exec sleep 300"});
  REQUIRE(eventually([&] { return host.out().find("ready") != std::string::npos || !pid_alive(host.pid); }, 20s));
  INFO(host.err());
  REQUIRE(host.out().find("ready") != std::string::npos);
  const std::string ep = "10.77.0.1:" + std::to_string(free_loopback_port());
  auto argv = [&](bool hosting) {
    std::vector<std::string> a{"/usr/bin/nsenter", "-t", std::to_string(host.pid), "-n", "-u", "-m", kMglaunch,
                               "--nnodes=1:2", "--nproc_per_node=1", "--rdzv_backend=c10d", "--rdzv_endpoint=" + ep,
                               "--rdzv_id=debian-name", "--max_restarts=1",
                               "--rdzv_conf=keep_alive_interval=1,keep_alive_max_attempt=3,last_call_timeout=5"};
    // (min 1: the host waits 5 s for the second node before its first round closes)
    if (hosting) a.push_back("--local_addr=10.77.0.1");
    a.insert(a.end(), {kFakeWorker, "print", "up", "when-restart-below", "1", "hang", "300"});
    return a;
  };
  std::vector<Proc> agents;
  agents.push_back(spawn(argv(true)));
  REQUIRE(eventually([&] { return agents[0].err().find("hosting the rendezvous") != std::string::npos; }, 20s));
  agents.push_back(spawn(argv(false)));
  REQUIRE(eventually([&] {
    return std::all_of(agents.begin(), agents.end(), [](Proc& p) { return p.out().find("up") != std::string::npos; });
  }, 30s));
  ::kill(agents[0].pid, SIGKILL);
  REQUIRE(agents[1].wait(60s));
  const std::string took = agents[1].err();
  INFO(took);
  CHECK(agents[1].exit_code() == 0);
  CHECK_THAT(took, Catch::Contains("hosting the rendezvous for job 'debian-name' on 10.77.0.1:"));
  CHECK_THAT(took, !Catch::Contains("127.0.1.1"));
  agents[0].wait(5s);
  ::kill(host.pid, SIGKILL);
  host.wait(5s);
}

// Three agents of job `job` at a fresh endpoint, node 2 hosting, each with its records in
// records/N of its own (record_env; `tweak` adds to node N's environment), each worker
// running `worker`. Waits (60 s at most) for all three and checks that each ended 0, and
// `check` on each.
namespace {
void three_with_own_records(const std::string& job, const std::vector<std::string>& flags,
                            const std::vector<std::string>& worker, const std::string& records,
                            const std::function<void(int, std::map<std::string, std::string>&)>& tweak,
                            const std::function<void(const Proc&)>& check) {
  const std::string ep = "127.0.0.2:" + std::to_string(free_loopback_port());
  std::vector<Proc> agents;
  auto start = [&](int i) {
    const std::string dir = records + "/" + std::to_string(i);
    std::filesystem::create_directory(dir);
    auto env = record_env(dir);
    if (tweak) tweak(i, env);
    agents.push_back(spawn(agent_argv(ep, job, i, "3", 1, flags, worker), env));
  };
  start(2);
  REQUIRE(eventually([&] { return agents[0].err().find("hosting the rendezvous") != std::string::npos; }, 20s));
  for (int i : {3, 4}) start(i);
  bool ended = true;
  for (Proc& p : agents) ended = p.wait(60s) && ended;
  for (Proc& p : agents) {
    INFO("an agent (" << (p.status < 0 ? std::string("running") : "exit " + std::to_string(p.exit_code())) << "):\n"
                      << p.err() << p.out());
    REQUIRE(ended);
    check(p);
    CHECK(p.exit_code() == 0);
  }
}
}  // namespace

// #34 (session 41): a node's first record of a job is written before its first workers
// start. Before (643b029), it was written on the helper thread after they started, and an
// agent SIGKILLed in between (its first round) restarted with no record and hosted a fresh
// job at the endpoint beside the survivors. Each agent keeps its record in a directory of
// its own here, and each worker checks, the moment it starts, that its agent's is there
// (fake_worker's expect-record: exit 9 if not).
TEST_CASE("every agent of an agent-hosted job has written its record of the job before its first worker starts") {
  three_with_own_records("first-record", {"--max_restarts=0", kRejoinConf}, {"expect-record", "print", "up"},
                         make_temp_dir(), {}, [](const Proc& p) {
                           CHECK_THAT(p.err(), !Catch::Contains("no job record in"));
                           CHECK(p.out().find("up") != std::string::npos);
                         });
}

// Review s41-a M2: the hosting agent's own server sent round 1's Assignments to the other
// nodes before its own client had read its own and written its record; the host SIGKILLed
// while the others' workers ran restarted with no record and hosted a fresh job beside them.
// Now its record is on disk before the round goes out. The host's record writes are slowed
// here (MGLAUNCH_RECORD_TEST_WRITE_DELAY_MS, 800 ms) and every worker checks, the moment it
// starts, that the host's record is there (fake_worker's expect-record-in: exit 9 if not).
TEST_CASE("the hosting agent's record of the job is on disk before any other node's first worker starts, even on a "
          "slow disk (review s41-a M2)") {
  const std::string records = make_temp_dir();
  three_with_own_records(
      "host-record", {"--max_restarts=0", kRejoinConf}, {"expect-record-in", records + "/2", "print", "up"}, records,
      [](int i, std::map<std::string, std::string>& env) {
        if (i == 2) env["MGLAUNCH_RECORD_TEST_WRITE_DELAY_MS"] = "800";
      },
      [](const Proc& p) {
        CHECK_THAT(p.err(), !Catch::Contains("no job record in"));
        CHECK(p.out().find("up") != std::string::npos);
      });
}

// Review s41-a M1: the io thread waits for a node's first record, and sends no heartbeat
// meanwhile; the wait was up to 2 s whatever keep_alive_interval, and with 0.5 s (a node fences
// itself after 1.25 s of silence) a slow disk fenced the node and failed the job. Now the wait
// is at most half the fence bound (0.625 s here), then one warning line and the workers start.
// Node 3's record writes take 1.8 s (MGLAUNCH_RECORD_TEST_WRITE_DELAY_MS).
TEST_CASE("a node whose first record is slower than half its fence bound starts its workers after that half with one "
          "warning line, and never fences itself for the wait (review s41-a M1)") {
  int index = 0;
  three_with_own_records(
      "slow-record",
      {"--max_restarts=0", "--rdzv_conf=keep_alive_interval=0.5,keep_alive_max_attempt=3,last_call_timeout=3"},
      {"hang", "3", "print", "up"}, make_temp_dir(),
      [](int i, std::map<std::string, std::string>& env) {
        if (i == 3) env["MGLAUNCH_RECORD_TEST_WRITE_DELAY_MS"] = "1800";
      },
      [&index](const Proc& p) {
        CHECK_THAT(p.err(), !Catch::Contains("fenced itself"));
        if (index++ == 1)  // node 3's
          CHECK_THAT(p.err(), Catch::Contains("first record of job 'slow-record' is not written after 0.625 s"));
      });
}

// Review s41-a L1: a first record that failed counted as written, and every later one was
// written after its workers started. Now records are written before the workers until one
// lands: here round 1's writes fail (MGLAUNCH_RECORD_TEST_FAIL_WRITES=2, said before the
// workers start), every write takes 0.8 s, the first attempt fails, and the restarted
// worker checks at its start that its agent's record is there.
TEST_CASE("after a first record that failed, the next round's record is on disk before its workers start, and the "
          "failure is said (review s41-a L1)") {
  const std::string ep = "127.0.0.2:" + std::to_string(free_loopback_port());
  const std::string records = make_temp_dir();
  auto env = record_env(records);
  env["MGLAUNCH_RECORD_TEST_WRITE_DELAY_MS"] = "800";
  env["MGLAUNCH_RECORD_TEST_FAIL_WRITES"] = "2";  // round 1's two (its server's, its client's)
  Proc p = spawn(agent_argv(ep, "failed-record", 2, "1:2", 1, {"--max_restarts=1", kRejoinConf},
                            {"fail-first-attempt", "0", "1", "expect-record", "print", "up"}),
                 env);
  const bool ended = p.wait(60s);
  INFO("the agent (" << (p.status < 0 ? std::string("running") : "exit " + std::to_string(p.exit_code())) << "):\n"
                     << p.err() << p.out());
  REQUIRE(ended);
  CHECK_THAT(p.err(), Catch::Contains("MGLAUNCH_RECORD_TEST_FAIL_WRITES"));
  CHECK_THAT(p.err(), !Catch::Contains("no job record in"));
  CHECK(p.out().find("up") != std::string::npos);
  CHECK(p.exit_code() == 0);
}

// #34 H1: the hosting agent's machine comes back and its agent is started again with the
// same command line (systemd, a user, a Slurm requeue of one node). Before, it found the
// endpoint's port free and hosted a fresh job (a new run, a first round that needs no
// majority): with --nnodes=1:3 a round of one beside the survivors' round, two rounds of one
// job id at once. Now its record of the job (launcher/job_record.h; XDG_RUNTIME_DIR a
// directory of the test's own) names the survivors' takeover sockets: it joins there.
TEST_CASE("the hosting agent SIGKILLed and started again with the same command line after the survivors took the job "
          "over: it joins the job where it runs now, as a new member (the same run, one round on all three at the "
          "end), and never runs a round of its own (#34 H1)") {
  const std::string ep = "127.0.0.2:" + std::to_string(free_loopback_port());
  const std::string records = make_temp_dir();
  const auto env = rejoin_env(records);
  const std::vector<std::string> flags{"--max_restarts=3", kRejoinConf};
  // Each round prints its environment. The first round (all three, restart 0) hangs; a round
  // of fewer than three (the survivors') waits (60 s at most, then ends 0); a round of three
  // after the takeover ends 0, and with it the job.
  const std::vector<std::string> worker{"env", "print", "up", "when-world-below", "3", "when-restart-below", "1",
                                        "hang", "300"};
  std::vector<Proc> agents = start_job(ep, "rejoin", "1:3", flags, worker, env);
  // (A node late for the first round's last call joins it as a scale-up: all three first.)
  REQUIRE(eventually([&] {
    return std::all_of(agents.begin(), agents.end(), [](Proc& p) {
      const auto e = envs(p.out());
      return !e.empty() && e.back().value("WORLD_SIZE", "") == "3";
    });
  }, 30s));
  const std::string run = envs(agents[1].out()).front().value("MGLAUNCH_RUN", "");
  REQUIRE(run.size() > 2);
  // Every node's record written (before its first workers start: a guard, since a node
  // killed with none would restart as a fresh one; here the host would host a fresh job).
  const std::string dir = records + "/mglaunch";
  REQUIRE(eventually([&] { return std::filesystem::is_directory(dir) && records_in(dir) == 3; }, 10s));
  ::kill(-agents[0].pid, SIGKILL);  // the agent, its watchdog and its workers
  agents[0].wait(5s);
  // The survivors took the job over and run a round of two.
  auto in_round_of_two = [&](Proc& p) {
    const auto e = envs(p.out());
    return e.size() >= 2 && e.back().value("WORLD_SIZE", "") == "2";
  };
  REQUIRE(eventually([&] { return in_round_of_two(agents[1]) && in_round_of_two(agents[2]); }, 60s));
  Proc again = spawn(agent_argv(ep, "rejoin", 2, "1:3", 1, flags, worker), env);
  for (Proc* p : {&again, &agents[1], &agents[2]}) {
    REQUIRE(p->wait(120s));
    INFO(p->err());
    CHECK(p->exit_code() == 0);
  }
  INFO("the restarted agent:\n" << again.err());
  CHECK_THAT(again.err(), Catch::Contains("job 'rejoin' runs on at 127.0.0.3:") &&
                              Catch::Contains("since this node's agent last ran (run " + run +
                                              "); joining it there as a new member") &&
                              !Catch::Contains("hosting the rendezvous"));
  const auto seen = envs(again.out());
  REQUIRE(!seen.empty());
  for (const auto& e : seen) {
    CHECK(e.value("WORLD_SIZE", "") == "3");  // never a round of one (or any round but the job's)
    CHECK(e.value("MGLAUNCH_RUN", "") == run);
  }
  for (int i : {1, 2}) {
    const auto e = envs(agents[i].out());
    CHECK(e.back().value("WORLD_SIZE", "") == "3");
    CHECK(e.back().value("MGLAUNCH_RUN", "") == run);
  }
  // The job ended for good: every node's record is gone, so a rerun starts afresh.
  CHECK(std::filesystem::is_empty(records + "/mglaunch"));
}

// #34 H1, a node that did not host: after a takeover its endpoint is dead, and before, its
// agent started again waited there until join_timeout (exit 3) while the job ran on. Its
// record names the nodes that could take the job over: it joins the one that did. (Five
// nodes, the host and the last one lost at once: the three left are a majority.)
TEST_CASE("a node that does not host SIGKILLed with the host and started again with the same command line after the "
          "takeover joins the job at the node that took it over, as a new member (the same run, one round on four at "
          "the end) (#34 H1)") {
  const std::string ep = "127.0.0.2:" + std::to_string(free_loopback_port());
  const std::string records = make_temp_dir();
  const auto env = rejoin_env(records);
  const std::vector<std::string> flags{"--max_restarts=3", kRejoinConf + ",join_timeout=20"};
  // The first round (five nodes) hangs; the takeover's (three) waits (60 s at most, then
  // ends 0); a round of four after the takeover ends 0.
  const std::vector<std::string> worker{"env", "print", "up", "when-world-below", "4", "when-restart-below", "1",
                                        "hang", "300"};
  auto argv = [&](int i) { return agent_argv(ep, "rejoin-node", i, "1:5", 1, flags, worker); };
  auto last_world = [](Proc& p) {
    const auto e = envs(p.out());
    return e.empty() ? std::string() : e.back().value("WORLD_SIZE", "");
  };
  std::vector<Proc> agents;
  agents.push_back(spawn(argv(2), env));
  REQUIRE(eventually([&] { return agents[0].err().find("hosting the rendezvous") != std::string::npos; }, 20s));
  for (int i : {3, 4, 5, 6}) agents.push_back(spawn(argv(i), env));
  REQUIRE(eventually(
      [&] { return std::all_of(agents.begin(), agents.end(), [&](Proc& p) { return last_world(p) == "5"; }); }, 30s));
  const std::string run = envs(agents[1].out()).front().value("MGLAUNCH_RUN", "");
  // Every node's record written (before its first workers start: a guard, since a node
  // killed with none would restart as a fresh one; here 127.0.0.6).
  const std::string dir = records + "/mglaunch";
  REQUIRE(eventually([&] { return std::filesystem::is_directory(dir) && records_in(dir) == 5; }, 10s));
  for (int i : {0, 4}) ::kill(-agents[i].pid, SIGKILL);  // the host and 127.0.0.6, which never hosted
  for (int i : {0, 4}) agents[i].wait(5s);
  REQUIRE(eventually([&] { return last_world(agents[1]) == "3" && last_world(agents[2]) == "3" && last_world(agents[3]) == "3"; },
                     60s));
  Proc again = spawn(argv(6), env);
  for (Proc* p : {&again, &agents[1], &agents[2], &agents[3]}) {
    REQUIRE(p->wait(120s));
    INFO(p->err());
    CHECK(p->exit_code() == 0);
  }
  INFO("the restarted agent:\n" << again.err());
  CHECK_THAT(again.err(), Catch::Contains("job 'rejoin-node' runs on at 127.0.0.3:") &&
                              Catch::Contains("joining it there as a new member"));
  const auto seen = envs(again.out());
  REQUIRE(!seen.empty());
  for (const auto& e : seen) {
    CHECK(e.value("WORLD_SIZE", "") == "4");
    CHECK(e.value("MGLAUNCH_RUN", "") == run);
  }
  for (int i : {1, 2, 3}) CHECK(last_world(agents[i]) == "4");
}

// Review s38 M2: a whole agent-hosted job SIGKILLed keeps every node's record, and before,
// its rerun at once found only refusals (the takeover sockets bound, not listening) and
// waited K x (2A + 3) before a fresh start. Now each node's takeover socket listens from
// its start, on its record's port, answering "alive, not hosting, recalling run R at epoch
// e" (review s39 H1): a majority of every record's voters answer so in one pass, and the
// rerun starts at once.
// The agents of `job` at 127.0.0.2 .. 127.0.0.(1 + total) started again at once (the
// job SIGKILLed everywhere), with workers that print their environment and exit 0 once every
// agent ran a worker or stood by (a job that ends at once would leave a late agent no voter
// to ask): every one ends with exit 0, `nodes` of them in one fresh run of `nodes` (not
// `run`), the others its standbys. Returns their stderr. (Each case its own job id: cases
// that ctest runs at once share the addresses and the token, and a port one case's agent
// left may be another's by then.)
static std::vector<std::string> rerun_at_once(const std::string& job, const std::string& ep, const std::map<std::string, std::string>& env,
                                              const std::vector<std::string>& flags, int nodes, int total,
                                              const std::string& run) {
  const std::string n = std::to_string(nodes);
  const std::string go = make_temp_dir() + "/go";
  std::vector<Proc> again;
  for (int i = 2; i < 2 + total; ++i)
    again.push_back(spawn(agent_argv(ep, job, i, n, 1, flags, {"env", "print", "up", "wait-file", go}), env));
  // A rerun agent that could not bind its record's port again leaves a node that needs its
  // answer waiting until join_timeout (review s40-recall M2): the case fails at once, saying so.
  auto port_lost = [&] {
    return std::any_of(again.begin(), again.end(), [](Proc& p) {
      return p.err().find("cannot bind its record's takeover port") != std::string::npos;
    });
  };
  auto dump = [&] {
    std::string all;
    for (Proc& p : again)
      all += "-- agent, " + (p.status < 0 ? std::string("running") : "exit " + std::to_string(p.exit_code())) +
             ":\n" + p.err() + p.out() + "\n";
    return all;
  };
  eventually([&] {
    return port_lost() || std::all_of(again.begin(), again.end(), [](Proc& p) {
      return p.out().find("up") != std::string::npos || p.err().find("[mglaunch] standby for job ") != std::string::npos ||
             !pid_alive(p.pid);
    });
  }, 60s);
  {
    INFO("the rerun agents:\n" << dump());
    REQUIRE_FALSE(port_lost());
  }
  std::ofstream(go) << "go\n";
  bool ended = true;
  for (Proc& p : again) ended = p.wait(60s) && ended;
  INFO("the rerun agents:\n" << dump());
  REQUIRE(ended);
  std::vector<std::string> errs;
  int ran = 0;
  for (Proc& p : again) {
    CHECK(p.exit_code() == 0);
    const auto e = envs(p.out());
    REQUIRE(e.size() <= 1);
    ran += static_cast<int>(e.size());
    for (const auto& one : e) {
      CHECK(one.value("WORLD_SIZE", "") == n);
      CHECK(one.value("MGLAUNCH_RUN", "") != run);  // a fresh run
    }
    errs.push_back(p.err());
  }
  CHECK(ran == nodes);
  return errs;
}

// The whole job of `count` nodes SIGKILLed, then rerun at once; every rerun agent ends with
// exit 0 in a fresh run of `count`. Returns the rerun agents' stderr, and the old run.
static std::pair<std::vector<std::string>, std::string> rerun_whole_job(int count) {
  const std::string n = std::to_string(count);
  const std::vector<std::string> flags{"--max_restarts=3", kRejoinConf};
  RecordedJob job = start_recorded_job("rerun-" + n, n, flags, {"env", "print", "up", "hang", "300"}, count);
  const std::string run = envs(job.agents[1].out()).front().value("MGLAUNCH_RUN", "");
  REQUIRE(run.size() > 2);
  kill_at_once(job.agents);
  return {rerun_at_once("rerun-" + n, job.ep, job.env, flags, count, count, run), run};
}

// A job of two nodes (start_job(), --nnodes=2), then agents on 127.0.0.4 and 127.0.0.5:
// returned once both stand by; `run`, the job's run.
static std::vector<Proc> two_nodes_then_two_standbys(const std::string& ep, const std::string& job,
                                                     const std::vector<std::string>& flags,
                                                     const std::vector<std::string>& worker,
                                                     const std::map<std::string, std::string>& env, std::string& run) {
  std::vector<Proc> agents = start_job(ep, job, "2", flags, worker, env, 2);
  run = envs(agents[1].out()).front().value("MGLAUNCH_RUN", "");
  REQUIRE(run.size() > 2);
  for (int i : {4, 5}) agents.push_back(spawn(agent_argv(ep, job, i, "2", 1, flags, worker), env));
  REQUIRE(eventually([&] {
    return std::all_of(agents.begin() + 2, agents.end(),
                       [](Proc& p) { return p.err().find("[mglaunch] standby for job ") != std::string::npos; });
  }, 30s));
  return agents;
}

TEST_CASE("a whole agent-hosted job SIGKILLed and rerun at once: every node's record is found stale in one pass "
          "(each recorded host answers 'alive, not hosting'), and the rerun runs a fresh run of three (review s38 "
          "M2)") {
  const auto [errs, run] = rerun_whole_job(3);
  for (const std::string& err : errs)
    CHECK_THAT(err, Catch::Contains("this node has a record of job 'rerun-3' (run " + run) &&
                        Catch::Contains("is stale: a majority of its last round's 3 voters") &&
                        Catch::Contains("answered that they run no round of that run"));
}

TEST_CASE("a whole agent-hosted job of two nodes on a loopback endpoint SIGKILLed and rerun at once runs a fresh run "
          "of two (review s39 M1)") {
  const auto [errs, run] = rerun_whole_job(2);
  CHECK(std::any_of(errs.begin(), errs.end(), [](const std::string& e) { return e.find("is stale") != std::string::npos; }));
}

// Review s39-late M1: the voters of a round are its nodes and the standbys registered when it
// closed, and a record is stale once a majority of them answered. Before, a record named only
// the nodes' takeover sockets: with as many standbys as nodes (--nnodes=2 on 4 machines) the
// nodes alone are no majority, the standbys were never asked, and every rerun agent ended
// with exit 3 at join_timeout. Now the record names the standbys' takeover sockets too.
TEST_CASE("a whole agent-hosted job of two nodes and two standbys that are voters SIGKILLed and rerun at once runs a "
          "fresh run of two, never exit 3 (review s39-late M1)") {
  const std::string ep = "127.0.0.2:" + std::to_string(free_loopback_port());
  const std::string records = make_temp_dir();
  const auto env = record_env(records);
  const std::vector<std::string> flags{"--max_restarts=3", kRejoinConf + ",join_timeout=20"};
  // Round 1 (two nodes) fails once the standbys stand by, so that round 2 closes with them:
  // its voters are 2 nodes + 2 standbys. Round 2 hangs.
  const std::string go = make_temp_dir() + "/go";
  const std::vector<std::string> worker{"env", "print", "up", "wait-file", go, "fail-first-attempt", "0", "1",
                                        "hang", "300"};
  std::string run;
  std::vector<Proc> agents = two_nodes_then_two_standbys(ep, "rerun-standbys", flags, worker, env, run);
  std::ofstream(go) << "go\n";
  // Round 2 runs, and every agent's record is of its epoch (the standbys' too: told at its close).
  std::string epoch;
  REQUIRE(eventually([&] {
    for (Proc& p : agents) {
      const auto e = envs(p.out());
      if (!e.empty() && e.back().value("TORCHELASTIC_RESTART_COUNT", "") == "1")
        epoch = e.back().value("MGLAUNCH_EPOCH", "");
    }
    if (epoch.empty() || records_in(records) != 4) return false;
    for (const auto& f : std::filesystem::directory_iterator(records))
      if (f.path().extension() == ".json" &&
          std::to_string(nlohmann::json::parse(read_file(f.path().string())).value("epoch", 0)) != epoch)
        return false;
    return true;
  }, 30s));
  // The precondition (review s40-recall L5): the standbys are voters of round 2, so every
  // record counts 4 voters, and names the 3 takeover sockets and the host's vote socket
  // (review s40-recall M1). A standby registered after the round closed would record the 2
  // nodes only.
  for (const auto& f : std::filesystem::directory_iterator(records)) {
    if (f.path().extension() != ".json") continue;
    const auto j = nlohmann::json::parse(read_file(f.path().string()));
    INFO(f.path().string() << ": " << j.dump());
    CHECK(j.value("voters", 0) == 4);
    CHECK(j.value("voter_hosts", nlohmann::json::array()).size() == 4);
    CHECK(j.value("self_voter", false));
  }
  kill_at_once(agents);
  const auto errs = rerun_at_once("rerun-standbys", ep, env, flags, 2, 4, run);
  for (const std::string& err : errs) CHECK_THAT(err, !Catch::Contains("does not start it afresh"));
}

// Review s40-recall M1: a standby that registered after the last round closed is no voter of
// it, and counted itself before (with 5 voters, 2 answers made it "3 of 5": a fork of a live
// job). It does not now, and the host's vote socket makes the host countable: else the late
// standbys of a whole rerun (--nnodes=2 on 4 machines, all started at once) could prove at
// most 1 of round 1's 2 voters (the host's port was 0) and ended with exit 3.
TEST_CASE("a whole agent-hosted job of two nodes and two late standbys (no voters of its round) SIGKILLed and rerun at "
          "once runs a fresh run of two, never exit 3: the standbys' records say they are no voters, and every "
          "record names the host's vote socket (review s40-recall M1)") {
  const std::string ep = "127.0.0.2:" + std::to_string(free_loopback_port());
  const std::string records = make_temp_dir();
  const auto env = record_env(records);
  const std::vector<std::string> flags{"--max_restarts=3", kRejoinConf + ",join_timeout=20"};
  const std::vector<std::string> worker{"env", "print", "up", "hang", "300"};
  // Round 1 closed with the 2 nodes: the other 2 stand by after it, no voters of it.
  std::string run;
  std::vector<Proc> agents = two_nodes_then_two_standbys(ep, "rerun-late", flags, worker, env, run);
  REQUIRE(eventually([&] { return records_in(records) == 4; }, 10s));
  int late = 0;
  for (const auto& f : std::filesystem::directory_iterator(records)) {
    if (f.path().extension() != ".json") continue;
    const auto j = nlohmann::json::parse(read_file(f.path().string()));
    INFO(f.path().string() << ": " << j.dump());
    const std::string node = j.value("node", "");
    const bool standby = node.starts_with("127.0.0.4@") || node.starts_with("127.0.0.5@");
    late += standby;
    CHECK(j.value("voters", 0) == 2);
    CHECK(j.value("voter_hosts", nlohmann::json::array()).size() == 2);  // node 3's takeover, the host's vote
    CHECK(j.value("self_voter", true) == !standby);  // (absent before: counted itself)
  }
  CHECK(late == 2);
  kill_at_once(agents);
  const auto errs = rerun_at_once("rerun-late", ep, env, flags, 2, 4, run);
  for (const std::string& err : errs) CHECK_THAT(err, !Catch::Contains("does not start it afresh"));
}

// Review s39-late L1: a record the agent cannot read (past the size a record holds, not a
// record) was ignored with a warning, and the agent started afresh: a fork of a job that runs
// on elsewhere. Now it ends with exit 3 naming the file, before any worker or hosting.
TEST_CASE("an agent restarted with a record of its job that it cannot read (past the size a record holds) exits 3 "
          "naming the file, and never hosts a fresh job (review s39-late L1)") {
  const std::string ep = "127.0.0.2:" + std::to_string(free_loopback_port());
  const std::string records = make_temp_dir();
  const std::vector<std::string> flags{"--max_restarts=3", kRejoinConf};
  const auto env = record_env(records);
  std::vector<Proc> agents = start_job(ep, "unreadable", "2", flags, {"env", "print", "up", "hang", "300"}, env, 2);
  REQUIRE(eventually([&] { return records_in(records) == 2; }, 10s));
  for (Proc& p : agents) ::kill(-p.pid, SIGKILL);
  for (Proc& p : agents) p.wait(5s);
  std::string path;
  for (const auto& f : std::filesystem::directory_iterator(records))
    if (f.path().extension() == ".json" &&
        nlohmann::json::parse(read_file(f.path().string())).value("node", "").starts_with("127.0.0.2@"))
      path = f.path().string();
  REQUIRE(!path.empty());
  std::ofstream(path, std::ios::trunc) << std::string(2 << 20, ' ');  // past kMaxJobRecordBytes (1 MiB)
  Proc again = spawn(agent_argv(ep, "unreadable", 2, "2", 1, flags, {"env", "print", "up"}), env);
  REQUIRE(again.wait(30s));  // main: "warning: ignoring PATH", then a fresh job waiting for its second node
  INFO(again.err());
  CHECK(again.exit_code() == 3);
  CHECK_THAT(again.err(), Catch::Contains("this node has a record of job 'unreadable' that it cannot use (cannot use " +
                                          path) &&
                              Catch::Contains("remove that file and start again") &&
                              !Catch::Contains("hosting the rendezvous"));
  CHECK(envs(again.out()).empty());
}

// Review s38 H1b: the host's agent dies while its node is cut off from the others (here the
// others are SIGSTOPped: their takeover sockets accept in the kernel and never answer, as
// behind a firewall that drops). Before, its restart declared the record stale after
// K x (2A + 3) of silence and hosted a fresh job beside the survivors'. Silence proves
// nothing: it ends with exit 3 at join_timeout, naming the record, and never hosts.
// (No ':' in the name past Catch's 80 columns: its console reporter then loops for ever
// while printing the header of a failure.)
TEST_CASE("the hosting agent SIGKILLed and started again while the other nodes are silent never hosts a fresh job, and "
          "exits 3 at join_timeout naming its record (review s38 H1b)") {
  const std::vector<std::string> flags{"--max_restarts=3", kRejoinConf + ",join_timeout=8"};
  RecordedJob job = start_recorded_job("silent", "1:3", flags, {"env", "print", "up", "hang", "300"});
  const std::string &ep = job.ep, &records = job.records;
  const auto& env = job.env;
  auto& agents = job.agents;
  for (int i : {1, 2}) ::kill(-agents[static_cast<std::size_t>(i)].pid, SIGSTOP);
  ::kill(-agents[0].pid, SIGKILL);
  agents[0].wait(5s);
  Proc again = spawn(agent_argv(ep, "silent", 2, "1:3", 1, flags, {"env", "print", "up"}), env);
  const bool ended = again.wait(60s);
  for (int i : {1, 2}) ::kill(-agents[static_cast<std::size_t>(i)].pid, SIGKILL);
  for (int i : {1, 2}) agents[static_cast<std::size_t>(i)].wait(5s);
  REQUIRE(ended);
  INFO(again.err());
  CHECK(again.exit_code() == 3);
  CHECK_THAT(again.err(), Catch::Contains("does not start it afresh. If the job is over, remove " + records + "/job-") &&
                              Catch::Contains("127.0.0.3:") && Catch::Contains("no answer") &&
                              !Catch::Contains("hosting the rendezvous") && !Catch::Contains("is stale"));
  CHECK(envs(again.out()).empty());  // no worker ran
}

// Review s39-late H3: a node restarted with a record, welcomed by the run's host, waits there
// for a round. Before, its takeover socket still answered "recalling run R at epoch e" until
// its first assignment, and another restarted node's recall counted that as a voter in no
// round of R: with ids repeated across restarts (a pod's PID 1), a majority for a fresh start
// beside the run. Now it answers as a node of R (not recalling), which no recall counts.
TEST_CASE("a node restarted with a record and welcomed by its run's host answers at its takeover socket as a node of "
          "that run, no longer as recalling it, while it waits there for a round (review s39-late H3)") {
  const std::vector<std::string> flags{"--max_restarts=3", kRejoinConf + ",join_timeout=30"};
  RecordedJob job = start_recorded_job("welcomed", "1:3", flags, {"env", "print", "up", "hang", "300"});
  std::vector<Proc>& agents = job.agents;
  const std::string run = envs(agents[1].out()).front().value("MGLAUNCH_RUN", "");
  REQUIRE(run.size() > 2);
  const int port = recorded_takeover_port(job.records, 3);
  REQUIRE(port > 0);
  for (int i : {1, 2}) ::kill(-agents[static_cast<std::size_t>(i)].pid, SIGKILL);  // 127.0.0.3 and .4
  for (int i : {1, 2}) agents[static_cast<std::size_t>(i)].wait(5s);
  // The host noticed: its next round waits for a majority of the 3 voters (1 of them there).
  REQUIRE(eventually([&] { return agents[0].err().find("waits for a majority") != std::string::npos; }, 30s));
  Proc again = spawn(agent_argv(job.ep, "welcomed", 3, "1:3", 1, flags, {"env", "print", "up", "hang", "300"}), job.env);
  const bool joined = eventually([&] { return again.err().find("joining it there as a new member") != std::string::npos; },
                                 20s);
  const auto n = joined ? not_hosting_at("127.0.0.3", port, "welcomed") : std::nullopt;
  for (Proc* p : {&agents[0], &again}) ::kill(-p->pid, SIGKILL);
  for (Proc* p : {&agents[0], &again}) p->wait(5s);
  INFO("the restarted agent:\n" << again.err() << "\nthe host:\n" << agents[0].err());
  REQUIRE(joined);
  CHECK(envs(again.out()).empty());  // no round yet: no majority of the voters
  REQUIRE(n);
  CHECK(n->job_id == "welcomed");
  CHECK(n->run == run);
  CHECK(!n->recalling);
}

// Review s40-recall M2: an agent with a record binds its record's takeover port again; when
// that port is taken it binds another, and the other nodes' records name a port that refuses
// from then on (a whole job's rerun of three voters then waits until join_timeout). Before,
// it did so without a word. Now it says so in one line: the recorded port, why, the new one.
TEST_CASE("a node started again whose record's takeover port is taken says so in one line, naming that port, the "
          "error and the port it listens on instead (review s40-recall M2)") {
  const std::vector<std::string> flags{"--max_restarts=3", kRejoinConf + ",join_timeout=30"};
  RecordedJob job = start_recorded_job("port-lost", "1:3", flags, {"env", "print", "up", "hang", "300"});
  const int port = recorded_takeover_port(job.records, 3);
  REQUIRE(port > 0);
  ::kill(-job.agents[1].pid, SIGKILL);  // 127.0.0.3
  job.agents[1].wait(5s);
  // A listener of the test's own at 127.0.0.3's recorded port (SO_REUSEADDR: the killed
  // agent's connections in TIME_WAIT do not hold it; a listener refuses every other bind).
  const int held = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  REQUIRE(held >= 0);
  const int on = 1;
  ::setsockopt(held, SOL_SOCKET, SO_REUSEADDR, &on, sizeof on);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<std::uint16_t>(port));
  ::inet_pton(AF_INET, "127.0.0.3", &a.sin_addr);
  const bool holding = ::bind(held, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 && ::listen(held, 4) == 0;
  std::optional<Proc> again;
  bool said = false;
  if (holding) {
    again.emplace(
        spawn(agent_argv(job.ep, "port-lost", 3, "1:3", 1, flags, {"env", "print", "up", "hang", "300"}), job.env));
    said = eventually([&] { return again->err().find("cannot bind its record's takeover port") != std::string::npos; },
                      20s);
    ::kill(-again->pid, SIGKILL);
    again->wait(5s);
  }
  ::close(held);
  REQUIRE(holding);
  const std::string err = again->err();
  INFO("the restarted agent:\n" << err);
  REQUIRE(said);
  const std::string line = "cannot bind its record's takeover port 127.0.0.3:" + std::to_string(port) + " again (";
  CHECK_THAT(err, Catch::Contains(line + "Address already in use) and listens on 127.0.0.3:") &&
                      Catch::Contains("name the old port, which now refuses") && Catch::Contains("join_timeout"));
  CHECK(err.find(line) == err.rfind(line));  // once
  CHECK_THAT(err, !Catch::Contains("listens on 127.0.0.3:" + std::to_string(port) + " instead"));
}

TEST_CASE("an agent whose record cannot be written warns when the write fails, in a round that writes no second "
          "record (review s40 M2)") {
  const std::string ep = "127.0.0.2:" + std::to_string(free_loopback_port());
  const std::string records = make_temp_dir();
  auto env = rejoin_env(records);
  env["MGLAUNCH_RECORD_DIR"] = records;
  const std::string path =
      records + "/" + mg::job_record_name("unwritable", mg::node_identity("127.0.0.2", mg::local_hostname()),
                                          mg::job_endpoint("c10d", ep));
  // The host reads its (absent) record at start, before it hosts; then a directory is put
  // where its record goes: the write's rename onto it fails (EISDIR), for root too (at start
  // a directory there is a record it cannot use: exit 3, 5cd7421). One round, no restart:
  // no second write comes.
  std::vector<Proc> agents;
  agents.push_back(spawn(agent_argv(ep, "unwritable", 2, "2", 1, {"--max_restarts=0"}, {"print", "up", "hang", "300"}), env));
  const bool hosting =
      eventually([&] { return agents[0].err().find("hosting the rendezvous") != std::string::npos; }, 20s);
  INFO("the host:\n" << agents[0].err());
  REQUIRE(hosting);
  std::filesystem::create_directory(path);
  agents.push_back(spawn(agent_argv(ep, "unwritable", 3, "2", 1, {"--max_restarts=0"}, {"print", "up", "hang", "300"}), env));
  const bool warned =
      eventually([&] { return agents[0].err().find("cannot keep this node's record") != std::string::npos; }, 30s);
  INFO("the other node:\n" << agents[1].err());
  CHECK(warned);
  CHECK(count_of(agents[0].err(), "warning: cannot keep this node's record of job 'unwritable'") == 1);
  CHECK(std::filesystem::is_directory(path));  // nothing was written there
  CHECK(agents[1].err().find("cannot keep this node's record") == std::string::npos);
}

// Review s41-c M1: a record was one file per advertised address, so agents of one job on one
// machine without --local_addr (each advertises the machine's name) shared one, the last
// writer's; both rerun agents recalled it, both tried its port, and neither counted the
// other: exit 3 at join_timeout. Now each agent keeps its own slot (job-HASH[.N].json).
TEST_CASE("a whole job of two agents on 'localhost' without --local_addr SIGKILLed and rerun at once runs a fresh run "
          "of two, each agent with a record of its own, never exit 3 (review s41-c M1)") {
  const std::string ep = "localhost:" + std::to_string(free_loopback_port());
  const std::string job = "slots-localhost";
  const std::string records = make_temp_dir();
  const auto env = record_env(records);
  auto argv = [&](const std::vector<std::string>& worker) {
    std::vector<std::string> a{kMglaunch, "--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d",
                               "--rdzv_endpoint=" + ep, "--rdzv_id=" + job, "--max_restarts=3",
                               kRejoinConf + ",join_timeout=30", kFakeWorker};
    a.insert(a.end(), worker.begin(), worker.end());
    return a;
  };
  std::vector<Proc> agents;
  agents.push_back(spawn(argv({"env", "print", "up", "hang", "300"}), env));
  REQUIRE(eventually([&] { return agents[0].err().find("hosting the rendezvous") != std::string::npos; }, 20s));
  agents.push_back(spawn(argv({"env", "print", "up", "hang", "300"}), env));
  const bool up = eventually([&] {
    return std::all_of(agents.begin(), agents.end(), [](Proc& p) { return p.out().find("up") != std::string::npos; });
  }, 30s);
  INFO("the first run:\n" << agents[0].err() << agents[1].err());
  REQUIRE(up);
  const std::string run = envs(agents[1].out()).front().value("MGLAUNCH_RUN", "");
  REQUIRE(run.size() > 2);
  CHECK(eventually([&] { return records_in(records) == 2; }, 10s));  // (before: one, shared)
  kill_at_once(agents);
  const std::string go = make_temp_dir() + "/go";
  std::vector<Proc> again;
  for (int i = 0; i < 2; ++i) again.push_back(spawn(argv({"env", "print", "up", "wait-file", go}), env));
  eventually([&] {
    return std::all_of(again.begin(), again.end(),
                       [](Proc& p) { return p.out().find("up") != std::string::npos || !pid_alive(p.pid); });
  }, 60s);
  std::ofstream(go) << "go\n";
  bool ended = true;
  for (Proc& p : again) ended = p.wait(60s) && ended;
  INFO("the rerun:\n" << again[0].err() << "--\n" << again[1].err());
  REQUIRE(ended);
  for (Proc& p : again) {
    CHECK(p.exit_code() == 0);
    const auto e = envs(p.out());
    REQUIRE(e.size() == 1);
    CHECK(e.front().value("MGLAUNCH_RUN", "") != run);  // a fresh run
  }
}

// Review s41-c M1: a restarted agent that cannot bind its record's takeover port again is not
// that record's writer (a live writer holds the port): it counts itself no more, and keeps
// that address as a target. Before, it dropped the address and counted itself as that voter:
// here (1 voter, itself) it started afresh at once beside whoever holds the port.
TEST_CASE("an agent whose record's takeover port is held by another live socket does not count itself as that "
          "record's voter, and keeps that address as a target (review s41-c M1)") {
  const std::string ep = "127.0.0.2:" + std::to_string(free_loopback_port());
  const std::string records = make_temp_dir();
  const auto env = record_env(records);
  // A live holder of the recorded port: it listens and never answers (silence counts nothing).
  const int held = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  REQUIRE(held >= 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  ::inet_pton(AF_INET, "127.0.0.2", &a.sin_addr);
  socklen_t len = sizeof a;
  REQUIRE(::bind(held, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  REQUIRE(::listen(held, 16) == 0);
  REQUIRE(::getsockname(held, reinterpret_cast<sockaddr*>(&a), &len) == 0);
  const int port = ntohs(a.sin_port);
  std::string why;
  const auto dir = mg::JobRecordDir::open(records, &why);
  REQUIRE(dir);
  mg::JobRecord r;
  r.job = "held-port";
  r.node = mg::node_identity("127.0.0.2", mg::local_hostname());
  r.endpoint = mg::job_endpoint("c10d", ep);
  r.run = "1764500000000-0123456789abcdef";
  r.epoch = 1;
  r.hosts = {{"127.0.0.2", port}};
  r.takeover_port = port;
  r.voters = 1;
  r.voter_hosts = {{"127.0.0.2", port}};
  r.self_voter = true;
  REQUIRE(dir->write(r) == "");
  Proc agent = spawn(agent_argv(ep, "held-port", 2, "1:2", 1, {"--max_restarts=0", kRejoinConf + ",join_timeout=4"},
                                {"print", "up"}),
                     env);
  const bool ended = agent.wait(60s);
  ::close(held);
  INFO(agent.err());
  REQUIRE(ended);
  CHECK(agent.exit_code() == 3);
  CHECK_THAT(agent.err(), Catch::Contains("cannot bind its record's takeover port 127.0.0.2:" + std::to_string(port)) &&
                              Catch::Contains("not every host it names answered that the run is over") &&
                              !Catch::Contains("names only this node itself") && !Catch::Contains("is stale"));
  CHECK(agent.out().find("up") == std::string::npos);
}

// Review s41-c L3: a hosting agent whose vote socket cannot bind said nothing, and the
// rerun it breaks (a node that needs the host's answer) ended with exit 3 unexplained.
TEST_CASE("a hosting agent that cannot bind its vote socket on its advertised address says so in one line (review "
          "s41-c L3)") {
  const std::string ep = "127.0.0.2:" + std::to_string(free_loopback_port());
  const std::string records = make_temp_dir();
  // 192.0.2.7 (TEST-NET-1) is no address of this machine; is_host=1: it hosts all the same.
  Proc host = spawn({kMglaunch, "--nnodes=1:2", "--nproc_per_node=1", "--rdzv_backend=c10d", "--rdzv_endpoint=" + ep,
                     "--rdzv_id=vote-unbound", "--local_addr=192.0.2.7", "--max_restarts=0",
                     "--rdzv_conf=last_call_timeout=1,is_host=1", kFakeWorker, "print", "up"},
                    record_env(records));
  const bool ended = host.wait(60s);
  INFO(host.err());
  REQUIRE(ended);
  CHECK(host.exit_code() == 0);
  const std::string line = "warning: this node hosts job 'vote-unbound' but cannot bind its vote socket on its "
                           "advertised address '192.0.2.7' (";
  CHECK_THAT(host.err(), Catch::Contains("hosting the rendezvous") && Catch::Contains(line) &&
                             Catch::Contains("cannot count this host"));
  CHECK(count_of(host.err(), line) == 1);
  CHECK_THAT(host.err(), !Catch::Contains("cannot take the rendezvous over if its host is lost"));
}
