// Multi-node rendezvous with real processes: agents on 127.0.0.1-127.0.0.4 (--local_addr),
// an embedded or standalone mglaunch-rdzv, fake_worker as the workload.
#include <catch2/catch.hpp>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <fstream>
#include <thread>
#include <map>
#include <set>

#include <nlohmann/json.hpp>

#include "support/proc.h"
#include "rendezvous/client.h"
#include "rendezvous/token_strength.h"
#include "support/rdzv_fixture.h"

using namespace mgtest;
using namespace std::chrono_literals;

namespace {


int count_of_up(const std::string& out) {
  int n = 0;
  for (const auto& l : split_lines(out)) n += l.find(":up") != std::string::npos;
  return n;
}


}  // namespace

TEST_CASE("3 agents x 2 workers get ranks 0..5 once each and one MASTER_ADDR") {
  const std::string ep = "127.0.0.1:" + std::to_string(free_loopback_port());
  std::vector<Proc> agents;
  for (int i = 1; i <= 3; ++i) agents.push_back(spawn(agent_argv(ep, "ranks", i, "3", 2, {}, {"env"})));
  const WorldSeen w = world_seen(agents, 30s);
  CHECK(w.ranks == std::multiset<std::string>{"0", "1", "2", "3", "4", "5"});
  CHECK(w.masters == std::set<std::string>{"127.0.0.1"});
  CHECK(w.ports.size() == 1);
  CHECK(w.worlds == std::set<std::string>{"6/3"});
}

TEST_CASE("elastic 2:3 starts with two nodes and scales up when a third arrives") {
  const std::string ep = "127.0.0.1:" + std::to_string(free_loopback_port());
  const std::vector<std::string> flags{"--rdzv_conf=last_call_timeout=0.5"};
  const std::vector<std::string> worker{"print", "world=${local_rank}", "env", "when-world-below", "3"};
  Proc a = spawn(agent_argv(ep, "elastic", 1, "2:3", 1, flags, worker));
  Proc b = spawn(agent_argv(ep, "elastic", 2, "2:3", 1, flags, worker));
  // Round 1 (two nodes) is running when the third node comes.
  REQUIRE(eventually([&] { return envs(a.out()).size() == 1 && envs(b.out()).size() == 1; }, 20s));
  CHECK(envs(a.out())[0]["WORLD_SIZE"] == "2");
  Proc c = spawn(agent_argv(ep, "elastic", 3, "2:3", 1, flags, worker));
  for (auto* p : {&a, &b, &c}) {
    REQUIRE(p->wait(30s));
    INFO(p->err());
    CHECK(p->exit_code() == 0);
    CHECK(envs(p->out()).back()["WORLD_SIZE"] == "3");
  }
}

TEST_CASE("a worker failure on node 2 restarts every node with the same restart count") {
  const std::string ep = "127.0.0.1:" + std::to_string(free_loopback_port());
  // Rank 3 fails only once all six workers of the first round are up (and printed their
  // environment), however slowly a loaded machine starts them.
  const std::string started = make_temp_dir() + "/started";
  std::vector<Proc> agents;
  for (int i = 1; i <= 3; ++i)
    agents.push_back(spawn(agent_argv(ep, "restart", i, "3", 2, {"--max_restarts=2"},
                                      {"env", "when-restart-below", "1", "pidfile", started, "when-rank", "3",
                                       "wait-lines", started, "6", "exit", "7"})));
  for (auto& a : agents) {
    REQUIRE(a.wait(30s));
    INFO(a.err());
    CHECK(a.exit_code() == 0);
    std::set<std::string> counts;
    std::map<std::string, std::string> port_of_restart;
    for (const auto& e : envs(a.out())) {
      counts.insert(e["TORCHELASTIC_RESTART_COUNT"].get<std::string>());
      port_of_restart[e["TORCHELASTIC_RESTART_COUNT"].get<std::string>()] = e["MASTER_PORT"].get<std::string>();
    }
    CHECK(counts == std::set<std::string>{"0", "1"});
    CHECK(port_of_restart["0"] != port_of_restart["1"]);  // each round gets a fresh master port
    CHECK_THAT(a.err(), Catch::Contains("restart 1 decided by the rendezvous: rank 3"));
  }
}

TEST_CASE("without restarts every node prints the same root cause and exits with its code") {
  const std::string ep = "127.0.0.1:" + std::to_string(free_loopback_port());
  std::vector<Proc> agents;
  for (int i = 1; i <= 3; ++i)
    agents.push_back(spawn(agent_argv(ep, "abort", i, "3", 1, {}, {"when-rank", "2", "eprint", "bad input", "exit", "9"})));
  for (auto& a : agents) {
    REQUIRE(a.wait(30s));
    CHECK(a.exit_code() == 9);
    CHECK_THAT(a.err(), Catch::Contains("rank       : 2 (local_rank: 0)") && Catch::Contains("    bad input"));
  }
}

TEST_CASE("a SIGKILLed agent and a SIGSTOPped agent are both detected by the survivors") {
  Daemon d = start_daemon();
  // Heartbeats 1 s apart, 3 may be missed: a survivor slowed by a loaded machine is not
  // mistaken for the lost node, and the root cause must name the node that was stopped.
  const std::vector<std::string> flags{"--rdzv_conf=keep_alive_interval=1,keep_alive_max_attempt=3"};
  for (int sig : {SIGKILL, SIGSTOP}) {
    INFO("signal " << sig);
    const std::string job = "lost" + std::to_string(sig);
    std::vector<Proc> agents;
    for (int i = 1; i <= 3; ++i)
      agents.push_back(spawn(agent_argv(d.endpoint, job, i, "3", 1, flags, {"print", "up", "hang", "60"})));
    REQUIRE(eventually([&] {
      return std::all_of(agents.begin(), agents.end(), [](Proc& p) { return p.out().find("up") != std::string::npos; });
    }, 20s));
    ::kill(agents[1].pid, sig);
    for (int i : {0, 2}) {
      REQUIRE(agents[i].wait(60s));
      INFO(agents[i].err());
      CHECK(agents[i].exit_code() == 1);
      CHECK_THAT(agents[i].err(), Catch::Contains(sig == SIGKILL ? "(127.0.0.2) lost: its connection closed"
                                                                 : "(127.0.0.2) missed 3 heartbeats"));
      // The node is named, never rank -1 (#22).
      CHECK_THAT(agents[i].err(), Catch::Contains("rank       : none (node ") && !Catch::Contains("rank       : -1"));
    }
    ::kill(agents[1].pid, SIGKILL);
    agents[1].wait(5s);
  }
  ::kill(d.proc.pid, SIGTERM);
  REQUIRE(d.proc.wait(5s));
  CHECK(d.proc.exit_code() == 0);
}

TEST_CASE("the daemon refuses a wrong or missing token, too many nodes, and accepts the right one") {
  Daemon d = start_daemon({{"MGLAUNCH_RDZV_TOKEN", "s3cret"}}, {"--max-nodes-per-job", "8"});
  auto run_agent = [&](const std::string& job, std::map<std::string, std::string> env) {
    return run(agent_argv(d.endpoint, job, 1, "2:2", 1, {"--rdzv_conf=join_timeout=5"}, {"print", "ok"}), env, 30s);
  };
  auto wrong = run_agent("t1", {{"MGLAUNCH_RDZV_TOKEN", "guess"}});
  CHECK(wrong.code == 3);
  CHECK_THAT(wrong.err, Catch::Contains("wrong rendezvous token"));
  auto big = run(agent_argv(d.endpoint, "t4", 1, "1:50", 1, {}, {"print", "ok"}), {{"MGLAUNCH_RDZV_TOKEN", "s3cret"}},
                 30s);
  CHECK(big.code == 3);
  CHECK_THAT(big.err, Catch::Contains("limit of 8 nodes per job"));
  auto none = run_agent("t2", {{"MGLAUNCH_RDZV_TOKEN", "\x01unset"}});
  CHECK(none.code == 3);
  CHECK_THAT(none.err, Catch::Contains("wants a token"));
  CHECK_THAT(d.proc.err(), Catch::Contains("closed during authentication for job 't1'"));
  Proc a = spawn(agent_argv(d.endpoint, "t3", 1, "2", 1, {}, {"print", "ok"}), {{"MGLAUNCH_RDZV_TOKEN", "s3cret"}});
  Proc b = spawn(agent_argv(d.endpoint, "t3", 2, "2", 1, {}, {"print", "ok"}), {{"MGLAUNCH_RDZV_TOKEN", "s3cret"}});
  REQUIRE(a.wait(20s));
  REQUIRE(b.wait(20s));
  CHECK(a.exit_code() == 0);
  CHECK(b.exit_code() == 0);
  ::kill(d.proc.pid, SIGTERM);
  d.proc.wait(5s);
}

TEST_CASE("garbage and oversized frames close only their own connection while a job proceeds") {
  Daemon d = start_daemon();
  const int port = std::stoi(d.endpoint.substr(d.endpoint.rfind(':') + 1));
  auto raw = [&](const std::vector<unsigned char>& bytes) {
    int fd = connect_loopback(port);
    REQUIRE(fd >= 0);
    REQUIRE(::write(fd, bytes.data(), bytes.size()) == static_cast<ssize_t>(bytes.size()));
    return fd;
  };
  Proc a = spawn(agent_argv(d.endpoint, "busy", 1, "2", 1, {}, {"sleep-ms", "300", "print", "ok"}));
  int garbage = raw({0, 0, 0, 6, 1, 5, 0xff, 0xfe, 0xfd, 0xfc});
  int huge = raw({0x7f, 0xff, 0xff, 0xff, 1, 5});
  char c;
  CHECK(::read(garbage, &c, 1) <= 0);  // closed by the daemon
  CHECK(::read(huge, &c, 1) <= 0);
  ::close(garbage);
  ::close(huge);
  Proc b = spawn(agent_argv(d.endpoint, "busy", 2, "2", 1, {}, {"sleep-ms", "300", "print", "ok"}));
  REQUIRE(a.wait(20s));
  REQUIRE(b.wait(20s));
  CHECK(a.exit_code() == 0);
  CHECK(b.exit_code() == 0);
  CHECK_THAT(d.proc.err(), Catch::Contains("exceeds the limit"));
  CHECK(pid_alive(d.proc.pid));
  ::kill(d.proc.pid, SIGTERM);
  d.proc.wait(5s);
}

TEST_CASE("the daemon killed and restarted mid-run: workers keep running and the job completes") {
  Daemon first = first_listening_at("127.0.0.1");
  const std::string endpoint = first.endpoint;
  auto listen = [&] { return listening_at(endpoint); };
  const std::string go = make_temp_dir() + "/go";  // the workers end only once the new daemon holds the job
  const std::vector<std::string> worker{"print", "up", "wait-file", go, "print", "bye"};
  Proc a = spawn(agent_argv(endpoint, "survive", 1, "2", 1, {}, worker));
  Proc b = spawn(agent_argv(endpoint, "survive", 2, "2", 1, {}, worker));
  REQUIRE(eventually([&] { return a.out().find("up") != std::string::npos && b.out().find("up") != std::string::npos; },
                     20s));
  ::kill(first.proc.pid, SIGKILL);
  REQUIRE(first.proc.wait(5s));
  Daemon second = listen();
  REQUIRE(eventually([&] { return second.proc.err().find("job 'survive' created") != std::string::npos; }, 30s));
  { std::ofstream(go) << "now"; }
  REQUIRE(a.wait(30s));
  REQUIRE(b.wait(30s));
  INFO(a.err() << b.err() << second.proc.err());
  CHECK(a.exit_code() == 0);
  CHECK(b.exit_code() == 0);
  CHECK_THAT(a.out(), Catch::Contains("bye"));
  CHECK_THAT(b.out(), Catch::Contains("bye"));
  CHECK(count_of_up(a.out()) == 1);  // the workers were never restarted
  CHECK_THAT(second.proc.err(), Catch::Contains("job 'survive' created"));
  ::kill(second.proc.pid, SIGTERM);
  second.proc.wait(5s);
}

TEST_CASE("a silent client is dropped after the handshake timeout and connections beyond the limit are refused") {
  Daemon d{spawn({kRdzvDaemon, "--listen", "127.0.0.1:0", "--handshake-timeout", "0.3", "--max-connections", "2"}), ""};
  REQUIRE(eventually([&] { return d.proc.out().find('\n') != std::string::npos; }, 10s));
  const auto line = split_lines(d.proc.out()).at(0);
  const int port = std::stoi(line.substr(line.rfind(':') + 1));
  auto connect_raw = [&] {
    int fd = connect_loopback(port);
    REQUIRE(fd >= 0);
    return fd;
  };
  int slow1 = connect_raw(), slow2 = connect_raw();
  int third = connect_raw();
  char c;
  CHECK(::read(third, &c, 1) <= 0);  // refused: 2 connections open
  CHECK(eventually([&] { return d.proc.err().find("no handshake within 300 ms") != std::string::npos; }, 5s));
  CHECK(::read(slow1, &c, 1) <= 0);
  CHECK(::read(slow2, &c, 1) <= 0);
  CHECK_THAT(d.proc.err(), Catch::Contains("(max)"));
  for (int fd : {slow1, slow2, third}) ::close(fd);
  ::kill(d.proc.pid, SIGTERM);
  d.proc.wait(5s);
}

TEST_CASE("an agent started during a daemon outage does not take the daemon's port") {
  // The daemon's node is emulated at 127.0.0.5 (127.0.0.1 and localhost are this machine's
  // own loopback, which an agent takes over as torchrun does).
  Daemon first = first_listening_at("127.0.0.5");
  const std::string endpoint = first.endpoint;
  auto listen = [&] { return listen_at(endpoint); };
  REQUIRE_THAT(first.proc.out(), Catch::Contains("listening on"));
  const std::string go = make_temp_dir() + "/go";  // the workers end once the daemon is back
  const std::vector<std::string> worker{"print", "up", "wait-file", go, "print", "bye"};
  Proc a = spawn(agent_argv(endpoint, "outage", 2, "2", 1, {}, worker));
  Proc b = spawn(agent_argv(endpoint, "outage", 3, "2", 1, {}, worker));
  REQUIRE(eventually([&] { return a.out().find("up") != std::string::npos && b.out().find("up") != std::string::npos; },
                     20s));
  ::kill(first.proc.pid, SIGKILL);
  REQUIRE(first.proc.wait(5s));
  // A node of another job starts now; the endpoint is on this machine but not its address.
  Proc newcomer = spawn(agent_argv(endpoint, "newcomer", 4, "2", 1, {"--rdzv_conf=join_timeout=60"}, {"print", "x"}));
  CHECK_FALSE(eventually([&] { return newcomer.err().find("hosting the rendezvous") != std::string::npos; }, 2s));
  Daemon second = listen();
  INFO(second.proc.err());
  CHECK_THAT(second.proc.out(), Catch::Contains("listening on"));  // the port was still free
  { std::ofstream(go) << "now"; }
  REQUIRE(a.wait(30s));
  REQUIRE(b.wait(30s));
  CHECK(a.exit_code() == 0);
  CHECK(b.exit_code() == 0);
  CHECK_THAT(a.out(), Catch::Contains("bye"));
  ::kill(newcomer.pid, SIGTERM);
  newcomer.wait(10s);
  ::kill(second.proc.pid, SIGTERM);
  second.proc.wait(5s);
}

TEST_CASE("a hosting agent whose start-up fails never listens, so the agents started with it keep waiting for a host") {
  // Its log directory cannot be made (--log_dir under a file). Had it listened first, an
  // agent connected in that moment would see the connection reset and end its run; a
  // refused one retries until join_timeout.
  const std::string ep = "127.0.0.1:" + std::to_string(free_loopback_port());
  const std::string file = make_temp_dir() + "/a-file";
  { std::ofstream(file) << "not a directory"; }
  Result r = run(agent_argv(ep, "early", 1, "2", 1, {"--log_dir=" + file + "/logs"}, {"print", "x"}), {}, 60s);
  INFO(r.err);
  CHECK(r.code == 2);
  CHECK_THAT(r.err, Catch::Contains("mglaunch: error: --log_dir"));
  CHECK_THAT(r.err, !Catch::Contains("hosting the rendezvous"));
}

TEST_CASE("a worker that fails while the daemon is down is reported when the daemon is back") {
  Daemon first = first_listening_at("127.0.0.1");
  const std::string endpoint = first.endpoint;
  auto listen = [&] { return listening_at(endpoint); };
  const std::string go = make_temp_dir() + "/go";
  std::vector<Proc> agents;
  for (int i = 2; i <= 4; ++i)
    agents.push_back(spawn(agent_argv(endpoint, "report", i, "3", 1, {},
                                      {"print", "up", "when-rank", "2", "wait-file", go, "exit", "7"})));
  REQUIRE(eventually([&] {
    return std::all_of(agents.begin(), agents.end(), [](Proc& p) { return p.out().find("up") != std::string::npos; });
  }, 20s));
  ::kill(first.proc.pid, SIGKILL);
  REQUIRE(first.proc.wait(5s));
  { std::ofstream(go) << "now"; }  // rank 2 exits 7 while nobody can hear it
  Daemon second = listen();
  for (auto& a : agents) {
    REQUIRE(a.wait(60s));
    INFO(a.err() << second.proc.err());
    CHECK(a.exit_code() == 7);
    CHECK_THAT(a.err(), Catch::Contains("rank       : 2"));
  }
  ::kill(second.proc.pid, SIGTERM);
  second.proc.wait(5s);
}

TEST_CASE("a node whose workers finished early waits for the slowest node beyond join_timeout") {
  Daemon d = start_daemon();
  const std::string go = make_temp_dir() + "/go";
  const std::vector<std::string> flags{"--rdzv_conf=join_timeout=2"};
  Proc fast = spawn(agent_argv(d.endpoint, "slow", 2, "2", 1, flags, {"print", "fast-done"}));
  Proc slow = spawn(agent_argv(d.endpoint, "slow", 3, "2", 1, flags, {"wait-file", go, "print", "slow-done"}));
  REQUIRE(eventually([&] { return fast.out().find("fast-done") != std::string::npos; }, 20s));
  // Past join_timeout (2 s) plus the client's margin (2 s), the finished node still waits.
  CHECK_FALSE(eventually([&] { return !pid_alive(fast.pid) || !pid_alive(slow.pid); }, 6s));
  { std::ofstream(go) << "now"; }
  REQUIRE(fast.wait(30s));
  REQUIRE(slow.wait(30s));
  INFO(fast.err() << slow.err());
  CHECK(fast.exit_code() == 0);
  CHECK(slow.exit_code() == 0);
  CHECK_THAT(fast.out() + slow.out(), Catch::Contains("slow-done"));
  ::kill(d.proc.pid, SIGTERM);
  d.proc.wait(5s);
}

TEST_CASE("mglaunch-rdzv refuses bad flag values in one line that gives the real range") {
  struct Case {
    std::vector<std::string> args;
    std::string says;
  };
  const std::vector<Case> cases = {
      {{"--max-connections", "0"}, "bad --max-connections '0': use a whole number in 1..16777216"},
      {{"--max-connections", "-1"}, "bad --max-connections '-1'"},
      {{"--max-connections-per-address", "0"}, "use a whole number in 1..16777216"},
      {{"--frame-timeout", "0"}, "bad --frame-timeout '0': use 0.001..86400 seconds"},
      {{"--max-nodes-per-job", "0"}, "bad --max-nodes-per-job '0'"},
      {{"--listen", "a:b:c"}, "bad endpoint 'a:b:c'"},
      {{"--listen", "127.0.0.1:65536"}, "0..65535"},
      {{"--http", "[::1"}, "--http"},
      {{"--listen=", "--json-log"}, "bad endpoint ''"},  // empty, and --json-log is not eaten
      {{"--token-file=", "--json-log"}, "--token-file is empty"},
      {{"--job-token=", "--json-log"}, "--job-token is empty"},
      {{"--max-conn", "5"}, "ambiguous flag '--max-conn'"},
      {{"--max-frames", "5000"}, "did you mean '--max-frame'?"},
  };
  for (const auto& c : cases) {
    INFO(c.args.front());
    std::vector<std::string> argv{kRdzvDaemon};
    argv.insert(argv.end(), c.args.begin(), c.args.end());
    auto r = run(argv, {}, 30s);
    CHECK(r.code == 2);
    const auto lines = split_lines(r.err);
    REQUIRE(lines.size() == 1);
    CHECK_THAT(lines[0], Catch::StartsWith("mglaunch-rdzv: error: ") && Catch::Contains(c.says));
    CHECK(lines[0].size() < 300);
    CHECK(r.out.empty());  // nothing listened
  }
  // a unique prefix is a flag: --max-frame=4096 via --max-fr
  Daemon d = start_daemon({}, {"--max-fr", "4096"});
  CHECK(d.port() > 0);
}

TEST_CASE("a join timeout says that the rendezvous timed out, how many nodes came and what to check") {
  Daemon d = start_daemon();
  auto r = run(agent_argv(d.endpoint, "lonely", 2, "2", 1, {"--rdzv_conf=join_timeout=1"}, {"print", "never"}), {}, 60s);
  CHECK(r.code == 3);  // README: no decision within join_timeout before any worker ran
  CHECK(r.out.find("never") == std::string::npos);
  std::vector<std::string> errors;
  for (const auto& l : split_lines(r.err))
    if (l.starts_with("mglaunch: error: ")) errors.push_back(l);
  REQUIRE(errors.size() == 1);
  CHECK_THAT(errors[0], Catch::Contains("the rendezvous timed out") && Catch::Contains("only 1 of at least 2 nodes") &&
                            Catch::Contains("--rdzv_id") && Catch::Contains("join_timeout=SECONDS"));
  CHECK_THAT(r.err, !Catch::Contains("Root Cause") && !Catch::Contains("rank       : -1"));
}

TEST_CASE("a rendezvous that refuses the node ends in one mglaunch: error: line") {
  Daemon d = start_daemon({{"MGLAUNCH_RDZV_TOKEN", "right"}});
  auto r = run(agent_argv(d.endpoint, "refused", 2, "2", 1, {"--rdzv_conf=join_timeout=5"}, {"print", "never"}),
               {{"MGLAUNCH_RDZV_TOKEN", "wrong"}}, 60s);
  CHECK(r.code == 3);
  int errors = 0;
  for (const auto& l : split_lines(r.err)) errors += l.starts_with("mglaunch: error: rendezvous: ");
  CHECK(errors == 1);
}

TEST_CASE("two agents given --rdzv_endpoint=localhost:PORT whose advertised addresses are not localhost finish: one "
          "hosts, as torchrun does for a loopback endpoint") {
  // Debian's hosts file puts the host name on 127.0.1.1: an agent's own address is then not
  // "localhost", and before, nobody hosted and both waited out join_timeout.
  const std::string ep = "localhost:" + std::to_string(free_loopback_port());
  const std::vector<std::string> flags{"--rdzv_conf=join_timeout=60"};
  Proc a = spawn(agent_argv(ep, "loopback", 2, "2", 1, flags, {"env"}));
  Proc b = spawn(agent_argv(ep, "loopback", 3, "2", 1, flags, {"env"}));
  for (auto* p : {&a, &b}) {
    REQUIRE(p->wait(90s));
    INFO(p->err());
    CHECK(p->exit_code() == 0);
    REQUIRE(envs(p->out()).size() == 1);
    CHECK(envs(p->out())[0]["WORLD_SIZE"] == "2");
  }
  const bool a_hosts = a.err().find("hosting the rendezvous") != std::string::npos;
  const bool b_hosts = b.err().find("hosting the rendezvous") != std::string::npos;
  CHECK(a_hosts != b_hosts);  // one of them
}

namespace {

// A TCP server on 127.0.0.1 that is not ours: it accepts each connection and closes it
// at once, until destroyed (its thread polls 100 ms at a time).
struct ForeignServer {
  int fd = -1;
  int port = 0;
  std::atomic<bool> stop{false};
  std::thread thread;
  ForeignServer() {
    fd = listen_on_loopback(port, 16);
    REQUIRE(fd >= 0);
    thread = std::thread([this] {
      while (!stop.load()) {
        pollfd p{fd, POLLIN, 0};
        if (::poll(&p, 1, 100) > 0)
          if (const int c = ::accept4(fd, nullptr, nullptr, SOCK_CLOEXEC); c >= 0) ::close(c);
      }
    });
  }
  ~ForeignServer() {
    stop = true;
    thread.join();
    ::close(fd);
  }
};

// The agent's error lines ("mglaunch: error: ...") of its stderr.
std::vector<std::string> error_lines(const std::string& err) {
  std::vector<std::string> out;
  for (const auto& l : split_lines(err))
    if (l.starts_with("mglaunch: error: ")) out.push_back(l);
  return out;
}

}  // namespace

TEST_CASE("the hint for an endpoint nobody hosts names --local_addr and is_host only for this machine's non-loopback "
          "address, and the one for a foreign server names the port (#38)") {
  const std::string own = mg::rdzv::unanswered_endpoint_hint("198.51.100.7", 29411, true, false);
  CHECK_THAT(own, Catch::Contains("198.51.100.7 is an address of this machine") && Catch::Contains("--local_addr=198.51.100.7") &&
                      Catch::Contains("is_host=true") && Catch::Contains("mglaunch-rdzv --listen 198.51.100.7:29411"));
  CHECK_THAT(mg::rdzv::unanswered_endpoint_hint("fd00::5", 29411, true, false),
             Catch::Contains("--listen [fd00::5]:29411"));
  CHECK(mg::rdzv::unanswered_endpoint_hint("198.51.100.7", 29411, false, false).empty());  // another machine's
  CHECK(mg::rdzv::unanswered_endpoint_hint("localhost", 29411, true, true).empty());   // loopback: an agent hosts it
  CHECK(own.find('\n') == std::string::npos);
  CHECK_THAT(mg::rdzv::foreign_server_hint("127.0.0.1", 8080),
             Catch::Contains("not a mglaunch rendezvous") && Catch::Contains("127.0.0.1:8080") &&
                 Catch::Contains("--rdzv_endpoint"));
}

TEST_CASE("an endpoint at this machine's own address that no agent advertises: the error after join_timeout says to "
          "give --local_addr or is_host=true there (#38)") {
  // 127.0.0.2 is this machine's (bindable) and not loopback for hosting (rendezvous/endpoint.h);
  // the agent advertises 127.0.0.3, so it does not host, and nothing listens there.
  const std::string ep = "127.0.0.2:" + std::to_string(free_loopback_port());
  auto r = run(agent_argv(ep, "nobody-hosts", 3, "2", 1, {"--rdzv_conf=join_timeout=1"}, {"print", "never"}), {}, 60s);
  CHECK(r.code == 3);
  const std::vector<std::string> errors = error_lines(r.err);
  INFO(r.err);
  REQUIRE(errors.size() == 1);
  CHECK_THAT(errors[0], Catch::Contains("Connection refused") &&
                            Catch::Contains("127.0.0.2 is an address of this machine") &&
                            Catch::Contains("--local_addr=127.0.0.2") && Catch::Contains("is_host=true"));
}

TEST_CASE("an endpoint held by a server that is not ours: one error line that says another program may hold the port "
          "(#38)") {
  ForeignServer other;
  const std::string ep = "127.0.0.1:" + std::to_string(other.port);
  auto r = run(agent_argv(ep, "foreign", 2, "2", 1, {"--rdzv_conf=join_timeout=30"}, {"print", "never"}), {}, 60s);
  CHECK(r.code == 3);
  const std::vector<std::string> errors = error_lines(r.err);
  INFO(r.err);
  REQUIRE(errors.size() == 1);
  CHECK_THAT(errors[0], Catch::Contains("ended before its welcome") &&
                            Catch::Contains("not a mglaunch rendezvous may hold 127.0.0.1:" + std::to_string(other.port)));
  CHECK(r.out.find("never") == std::string::npos);
}

TEST_CASE("a rendezvous token too short for 128 random bits gets one warning from mglaunch and mglaunch-rdzv, a long "
          "random one none") {
  // The server proves the job key first, so anyone who can connect can test guesses of a
  // weak token offline: the docs ask for 128 random bits, and both programs say so once.
  CHECK(mg::rdzv::token_bits_at_most("hunter2") < mg::rdzv::kMinTokenBits);
  CHECK(mg::rdzv::token_bits_at_most(std::string(31, 'a')) < mg::rdzv::kMinTokenBits);  // 31 hex digits: 124
  CHECK(mg::rdzv::token_bits_at_most(std::string(32, 'a')) == mg::rdzv::kMinTokenBits);
  CHECK(mg::rdzv::token_bits_at_most("Zm9vYmFyYmF6cXV4cXV1eA") >= mg::rdzv::kMinTokenBits);  // 22 base64 characters
  CHECK(mg::rdzv::token_bits_at_most("123456789012345678901234567890") < mg::rdzv::kMinTokenBits);  // digits only
  const std::string strong = "9f1c2a7e5b3d4c6a8e0f1b2c3d4e5f60718293a4b5c6d7e8f90a1b2c3d4e5f60";
  for (const auto& [token, warned] : std::vector<std::pair<std::string, bool>>{{"hunter2", true}, {strong, false}}) {
    INFO(token);
    auto agent = run({kMglaunch, "--dry-run", "--nnodes=1", "--nproc_per_node=1", "--rdzv_backend=c10d",
                      "--rdzv_endpoint=127.0.0.1:" + std::to_string(free_loopback_port()), "--no_python", "/bin/true"},
                     {{"MGLAUNCH_RDZV_TOKEN", token}});
    CHECK(agent.code == 0);
    CHECK(count_of(agent.err, "mglaunch: warning: the rendezvous token from MGLAUNCH_RDZV_TOKEN holds at most") ==
          (warned ? 1 : 0));
    auto daemon = run({kRdzvDaemon, "--job-token", "job1"}, {{"MGLAUNCH_RDZV_TOKEN", token}});
    CHECK(daemon.code == 0);
    CHECK(count_of(daemon.err, "mglaunch-rdzv: warning: the rendezvous token from MGLAUNCH_RDZV_TOKEN holds at most") ==
          (warned ? 1 : 0));
    if (warned) CHECK_THAT(daemon.err, Catch::Contains("128 random bits"));
  }
}
