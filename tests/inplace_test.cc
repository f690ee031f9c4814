// In-place recovery, the agent's side (docs/in-place-recovery.md), with real processes:
// tests/inplace_worker.py speaks the control protocol with Python's standard library; the
// agents run alone (--standalone) or as two nodes of a real mglaunch-rdzv on
// 127.0.0.2/.3. A worker that opted in keeps its pid through the restart and hears pause
// then assign; one that did not is restarted as a new process.
#include <catch2/catch.hpp>

#include <netinet/in.h>
#include <sys/time.h>
#include <arpa/inet.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

#include "launcher/port.h"
#include "support/proc.h"
#include "support/rdzv_fixture.h"

using namespace mgtest;
using namespace std::chrono_literals;
using json = nlohmann::json;

namespace {

const std::string kWorker = kSourceDir + "/tests/inplace_worker.py";

std::vector<json> events(const std::string& dir) {
  std::vector<json> v;
  for (const auto& l : split_lines(read_file(dir + "/events.jsonl")))
    if (!l.empty()) v.push_back(json::parse(l));
  return v;
}

// The events of `type` of local rank `lr`, in order.
std::vector<json> of(const std::vector<json>& evs, const std::string& type, int lr) {
  std::vector<json> v;
  for (const auto& e : evs)
    if (e["event"] == type && e["local_rank"] == lr) v.push_back(e);
  return v;
}

bool has_event(const std::string& dir, const std::string& type, int lr, std::size_t n = 1) {
  return of(events(dir), type, lr).size() >= n;
}

void finish(const std::string& dir) { std::ofstream(dir + "/finish").put('\n'); }

// Tells both nodes' workers to finish, then checks that both agents end with 0.
void finish_both_ok(const std::string& dir0, Proc& n0, const std::string& dir1, Proc& n1) {
  finish(dir0);
  finish(dir1);
  for (Proc* p : {&n0, &n1}) {
    REQUIRE(p->wait(60s));
    INFO(p->err());
    CHECK(p->exit_code() == 0);
  }
}

// Connects to an agent's control socket ("@name") and returns its first line ("" if none in 10 s).
std::string first_line_from(const std::string& at_name) {
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  std::string raw = at_name;
  raw[0] = '\0';
  std::memcpy(a.sun_path, raw.data(), raw.size());
  std::string got;
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + raw.size())) == 0) {
    for (int i = 0; i < 100 && got.find('\n') == std::string::npos; ++i) {
      pollfd p{fd, POLLIN, 0};
      if (::poll(&p, 1, 100) != 1) continue;
      char buf[4096];
      const ssize_t n = ::read(fd, buf, sizeof(buf));
      if (n <= 0) break;
      got.append(buf, static_cast<std::size_t>(n));
    }
  }
  ::close(fd);
  return got.substr(0, got.find('\n'));
}

// The variables every worker of one attempt shares: the assignment must carry the same
// values as the worker spawned beside it (both come from launcher/plan).
void check_same_round(const json& assigned, const json& spawned) {
  for (const char* k : {"WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "LOCAL_WORLD_SIZE",
                        "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_USE_AGENT_STORE"}) {
    INFO(k);
    CHECK(assigned.at(k) == spawned.at(k));
  }
}

double pause_to_assign_ms(const std::vector<json>& evs, int lr) {
  return (of(evs, "assign", lr).at(0)["time"].get<double>() - of(evs, "pause", lr).at(0)["time"].get<double>()) * 1000;
}


// The TCP ports `pid` listens on (/proc/net/tcp and tcp6: LISTEN sockets among its descriptors).
std::set<int> listening_ports_of(pid_t pid) {
  std::set<std::string> inodes;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator("/proc/" + std::to_string(pid) + "/fd", ec)) {
    const std::string target = std::filesystem::read_symlink(e.path(), ec).string();
    if (!ec && target.rfind("socket:[", 0) == 0) inodes.insert(target.substr(8, target.size() - 9));
  }
  std::set<int> ports;
  for (const char* table : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    const auto lines = split_lines(read_file(table));
    for (std::size_t i = 1; i < lines.size(); ++i) {
      std::istringstream in(lines[i]);
      std::string sl, local, remote, st, queues, tr, retr, uid, timeout, inode;
      if (!(in >> sl >> local >> remote >> st >> queues >> tr >> retr >> uid >> timeout >> inode)) continue;
      if (st == "0A" && inodes.contains(inode)) ports.insert(std::stoi(local.substr(local.rfind(':') + 1), nullptr, 16));
    }
  }
  return ports;
}

// The master port of `err`'s "round N: node ..." notice, 0 while none.
int round_master_port(const std::string& err, int round) {
  const auto at = err.find("round " + std::to_string(round) + ": node ");
  if (at == std::string::npos) return 0;
  const auto line = err.substr(at, err.find('\n', at) - at);
  const auto m = line.find("master ");
  if (m == std::string::npos) return 0;
  const auto colon = line.find(':', m);
  return colon == std::string::npos ? 0 : std::atoi(line.c_str() + colon + 1);
}

// Node `node_rank` of a two-node in-place job on `d` (id `rdzv_id`, at 127.0.0.(node_rank + 2)): every
// worker tests/inplace_worker.py writing to `dir`, local rank 0 opted in, `extra` its further arguments.
Proc two_node_agent(const Daemon& d, const std::string& rdzv_id, int nproc, int node_rank, const std::string& dir,
                    const std::vector<std::string>& extra = {}, const std::map<std::string, std::string>& env = {}) {
  std::vector<std::string> argv{kMglaunch, "--nnodes=2", "--nproc_per_node=" + std::to_string(nproc),
                                "--rdzv_backend=c10d", "--rdzv_endpoint=" + d.endpoint, "--rdzv_id=" + rdzv_id,
                                "--max_restarts=2", "--node_rank=" + std::to_string(node_rank),
                                "--local_addr=127.0.0." + std::to_string(node_rank + 2), "--no_python",
                                "/usr/bin/python3", kWorker, dir, "0"};
  argv.insert(argv.end(), extra.begin(), extra.end());
  return spawn(argv, env);
}

}  // namespace

TEST_CASE("in place, one node: a local failure pauses the opted-in worker, which keeps its pid and is assigned the "
          "next attempt, while the failed one is restarted") {
  const std::string dir = make_temp_dir();
  Proc agent = spawn({kMglaunch, "--standalone", "--nproc_per_node=2", "--max_restarts=1", "--no_python",
                      "/usr/bin/python3", kWorker, dir, "0", "fail-once", "1"});
  REQUIRE(eventually([&] { return has_event(dir, "assign", 0) && has_event(dir, "start", 1, 2); }, 60s));
  // The socket serves workers only: the test, not one of the agent's workers, is refused.
  const std::string socket_name = of(events(dir), "start", 0).at(0)["env"]["MGLAUNCH_CONTROL_SOCKET"];
  REQUIRE(socket_name.starts_with("@mglaunch-" + std::to_string(agent.pid) + "-"));
  const json refusal = json::parse(first_line_from(socket_name));
  CHECK(refusal["type"] == "error");
  CHECK_THAT(refusal["message"].get<std::string>(), Catch::Contains("is neither a worker of this agent"));
  finish(dir);
  REQUIRE(agent.wait(60s));
  INFO(agent.err());
  CHECK(agent.exit_code() == 0);
  CHECK_THAT(agent.err(), Catch::Contains("in-place recovery: local rank(s) 0 paused"));
  const auto evs = events(dir);
  const auto starts0 = of(evs, "start", 0), starts1 = of(evs, "start", 1);
  REQUIRE(starts0.size() == 1);  // never restarted
  REQUIRE(starts1.size() == 2);
  CHECK(starts1[0]["pid"] != starts1[1]["pid"]);
  CHECK(starts1[1]["env"]["TORCHELASTIC_RESTART_COUNT"] == "1");
  const auto pauses = of(evs, "pause", 0), assigns = of(evs, "assign", 0), exits = of(evs, "exit", 0);
  REQUIRE(pauses.size() == 1);
  REQUIRE(assigns.size() == 1);
  CHECK_THAT(pauses[0]["reason"].get<std::string>(), Catch::Contains("rank 1 (local_rank 1)"));
  CHECK(pauses[0]["lost"] == "worker");
  CHECK(assigns[0]["restart_count"] == 1);
  CHECK(assigns[0]["env"]["RANK"] == "0");
  check_same_round(assigns[0]["env"], starts1[1]["env"]);
  CHECK(assigns[0]["env"]["MASTER_PORT"] != starts0[0]["env"]["MASTER_PORT"]);  // a fresh port per attempt
  REQUIRE(exits.size() == 1);
  CHECK(exits[0]["pid"] == starts0[0]["pid"]);
  std::cout << "in place, one node: pause -> assign " << pause_to_assign_ms(evs, 0) << " ms\n";
  std::filesystem::remove_all(dir);
}

TEST_CASE("in place: a paused worker's control connection that closes is stopped with one line saying which side "
          "ended it and how - the worker's end of file, the agent's refusal with its reason - and whether it still runs") {
  struct Case {
    std::string mode, why;
  };
  for (const Case& c : {Case{"close", "the worker closed it (end of file)"},
                        Case{"junk", "the agent refused it: unknown message type 'junk'"}}) {
    INFO("on-pause=" << c.mode);
    const std::string dir = make_temp_dir();
    Proc agent = spawn({kMglaunch, "--standalone", "--nproc_per_node=2", "--max_restarts=1", "--no_python",
                        "/usr/bin/python3", kWorker, dir, "0", "fail-once", "1", "on-pause=" + c.mode});
    // Local rank 0 is stopped (SIGTERM) and both start anew in attempt 1.
    REQUIRE(eventually([&] { return has_event(dir, "start", 0, 2) && has_event(dir, "start", 1, 2); }, 60s));
    finish(dir);
    REQUIRE(agent.wait(60s));
    INFO(agent.err());
    CHECK(agent.exit_code() == 0);
    const auto starts = of(events(dir), "start", 0);
    CHECK_THAT(agent.err(), Catch::Contains("local rank 0's control connection closed while paused (" + c.why) &&
                                Catch::Contains("; its process (pid " + std::to_string(starts.at(0)["pid"].get<int>()) +
                                                ") still runs): stopping it"));
    std::filesystem::remove_all(dir);
  }
}

// A worker the test SIGSTOPped: SIGKILLed when the test ends, whatever happened (the agent
// may have died or hung with it still stopped).
struct StoppedWorker {
  pid_t pid;
  ~StoppedWorker() {
    if (pid > 0) ::kill(pid, SIGKILL);
  }
};

void touch_file(const std::string& path) { std::ofstream(path).put('\n'); }

TEST_CASE("in place: a SIGSTOPped worker that opted in cannot answer its pause: SIGKILL once the grace is out, and a "
          "new process in its place, never an assign to the stopped one (#26)") {
  const std::string dir = make_temp_dir();
  Proc agent = spawn({kMglaunch, "--standalone", "--nproc_per_node=2", "--max_restarts=1", "--grace=2", "--no_python",
                      "/usr/bin/python3", kWorker, dir, "0", "fail-on-file", "1"});
  REQUIRE(eventually([&] { return has_event(dir, "welcome", 0) && has_event(dir, "start", 1); }, 60s));
  StoppedWorker stopped{of(events(dir), "start", 0).at(0)["pid"].get<pid_t>()};
  REQUIRE(::kill(stopped.pid, SIGSTOP) == 0);
  touch_file(dir + "/fail");  // local rank 1 fails: a restart, local rank 0 paused
  // Before the fix it was assigned while stopped and kept for ever: no second process.
  REQUIRE(eventually([&] { return has_event(dir, "start", 0, 2) && has_event(dir, "start", 1, 2); }, 60s));
  REQUIRE(eventually([&] { return has_event(dir, "welcome", 0, 2); }, 30s));
  finish(dir);
  REQUIRE(agent.wait(60s));
  INFO(agent.err());
  CHECK(agent.exit_code() == 0);
  CHECK_THAT(agent.err(), Catch::Contains("in-place recovery: local rank(s) 0 paused"));
  CHECK_THAT(agent.err(), Catch::Contains("local rank(s) 0 did not answer the pause within 2.0s"));
  CHECK_FALSE(pid_alive(stopped.pid));  // killed and reaped before its replacement ran
  const auto evs = events(dir);
  const auto starts0 = of(evs, "start", 0);
  REQUIRE(starts0.size() == 2);
  CHECK(starts0[1]["pid"] != stopped.pid);
  CHECK(starts0[1]["env"]["TORCHELASTIC_RESTART_COUNT"] == "1");
  CHECK(starts0[1]["env"]["RANK"] == "0");
  CHECK(of(evs, "assign", 0).empty());  // the stopped one never read one, the new one needs none
  REQUIRE(of(evs, "exit", 0).size() == 1);
  CHECK(of(evs, "exit", 0)[0]["pid"] == starts0[1]["pid"]);
  std::filesystem::remove_all(dir);
}

TEST_CASE("in place: a worker that opted in, SIGSTOPped while training, is taken for hung after the grace: "
          "SIGKILL, a new process in its place, its peer paused and kept (#26)") {
  const std::string dir = make_temp_dir();
  Proc agent = spawn({kMglaunch, "--standalone", "--nproc_per_node=2", "--max_restarts=1", "--grace=2", "--no_python",
                      "/usr/bin/python3", kWorker, dir, "0,1"});
  REQUIRE(eventually([&] { return has_event(dir, "welcome", 0) && has_event(dir, "welcome", 1); }, 60s));
  StoppedWorker stopped{of(events(dir), "start", 1).at(0)["pid"].get<pid_t>()};
  REQUIRE(::kill(stopped.pid, SIGSTOP) == 0);
  // Before the fix nothing happened: its peers waited on it until their own time-outs.
  REQUIRE(eventually([&] { return has_event(dir, "start", 1, 2) && has_event(dir, "assign", 0); }, 60s));
  REQUIRE(eventually([&] { return has_event(dir, "welcome", 1, 2); }, 30s));
  finish(dir);
  REQUIRE(agent.wait(60s));
  INFO(agent.err());
  CHECK(agent.exit_code() == 0);
  CHECK_THAT(agent.err(), Catch::Contains("local rank(s) 1 stopped by a signal (SIGSTOP) for 2.0s: taken for hung"));
  CHECK_FALSE(pid_alive(stopped.pid));
  const auto evs = events(dir);
  REQUIRE(of(evs, "start", 0).size() == 1);  // kept in place
  CHECK(of(evs, "pause", 0).at(0)["lost"] == "worker");
  CHECK(of(evs, "start", 1).at(1)["env"]["TORCHELASTIC_RESTART_COUNT"] == "1");
  std::filesystem::remove_all(dir);
}

TEST_CASE("in place: a SIGSTOPped worker that did not opt in is stopped by SIGTERM at once (SIGCONT follows it), "
          "not SIGKILLed after the grace (#26)") {
  const std::string dir = make_temp_dir();
  Proc agent = spawn({kMglaunch, "--standalone", "--nproc_per_node=2", "--max_restarts=1", "--grace=60", "--no_python",
                      "/usr/bin/python3", kWorker, dir, "", "fail-on-file", "1"});
  REQUIRE(eventually([&] { return has_event(dir, "start", 0) && has_event(dir, "start", 1); }, 60s));
  StoppedWorker stopped{of(events(dir), "start", 0).at(0)["pid"].get<pid_t>()};
  REQUIRE(::kill(stopped.pid, SIGSTOP) == 0);
  touch_file(dir + "/fail");
  // Before the fix SIGTERM waited for a SIGCONT that never came: SIGKILL after the grace.
  REQUIRE(eventually([&] { return has_event(dir, "start", 0, 2) && has_event(dir, "start", 1, 2); }, 120s));
  finish(dir);
  REQUIRE(agent.wait(60s));
  INFO(agent.err());
  CHECK(agent.exit_code() == 0);
  CHECK_THAT(agent.err(), !Catch::Contains("sending SIGKILL"));
  CHECK_FALSE(pid_alive(stopped.pid));
  std::filesystem::remove_all(dir);
}

TEST_CASE("in place, two nodes: node 1's agent SIGKILLed, node 0's opted-in worker keeps its pid and is assigned "
          "the next round, its other worker is restarted") {
  Daemon d = start_daemon();
  const std::string dir0 = make_temp_dir(), dir1 = make_temp_dir(), dir1b = make_temp_dir();
  auto node = [&](int node_rank, const std::string& dir) { return two_node_agent(d, "inplace", 2, node_rank, dir); };
  Proc n0 = node(0, dir0);
  Proc n1 = node(1, dir1);
  REQUIRE(eventually([&] {
    return has_event(dir0, "welcome", 0) && has_event(dir1, "welcome", 0) && has_event(dir0, "start", 1) &&
           has_event(dir1, "start", 1);
  }, 60s));
  const pid_t kept = of(events(dir0), "start", 0).at(0)["pid"];
  ::kill(n1.pid, SIGKILL);
  REQUIRE(n1.wait(10s));
  Proc n1b = node(1, dir1b);  // node 1 comes back
  REQUIRE(eventually([&] { return has_event(dir0, "assign", 0) && has_event(dir0, "start", 1, 2); }, 60s));
  REQUIRE(eventually([&] { return has_event(dir1b, "start", 0) && has_event(dir1b, "start", 1); }, 30s));
  finish_both_ok(dir0, n0, dir1b, n1b);
  INFO(n0.err());
  CHECK_THAT(n0.err(), Catch::Contains("(127.0.0.3) lost: its connection closed"));
  const auto evs = events(dir0);
  const auto starts0 = of(evs, "start", 0), starts1 = of(evs, "start", 1);
  REQUIRE(starts0.size() == 1);
  CHECK(starts0[0]["pid"] == kept);
  REQUIRE(of(evs, "exit", 0).size() == 1);
  CHECK(of(evs, "exit", 0)[0]["pid"] == kept);
  REQUIRE(starts1.size() == 2);  // not opted in: restarted as a new process
  CHECK(starts1[0]["pid"] != starts1[1]["pid"]);
  const auto pauses = of(evs, "pause", 0), assigns = of(evs, "assign", 0);
  REQUIRE(pauses.size() == 1);
  REQUIRE(assigns.size() == 1);
  CHECK(pauses[0]["round"] == 1);
  CHECK_THAT(pauses[0]["reason"].get<std::string>(), Catch::Contains("lost"));
  CHECK(pauses[0]["lost"] == "host");
  CHECK(assigns[0]["round"].get<int>() > 1);
  CHECK(assigns[0]["restart_count"] == 1);
  const json& env = assigns[0]["env"];
  CHECK(env["RANK"] == "0");
  CHECK(env["LOCAL_RANK"] == "0");
  CHECK(env["WORLD_SIZE"] == "4");
  CHECK(env["GROUP_WORLD_SIZE"] == "2");
  CHECK(env["TORCHELASTIC_RESTART_COUNT"] == "1");
  check_same_round(env, starts1[1]["env"]);
  // The new node 1's workers are in the same round.
  const auto new1 = of(events(dir1b), "start", 0);
  REQUIRE(new1.size() == 1);
  CHECK(new1[0]["env"]["RANK"] == "2");
  CHECK(new1[0]["env"]["MASTER_PORT"] == env["MASTER_PORT"]);
  std::cout << "in place, two nodes: pause -> assign " << pause_to_assign_ms(evs, 0)
            << " ms (node 1's new agent started and joined meanwhile)\n";
  ::kill(d.proc.pid, SIGTERM);
  CHECK(d.proc.wait(10s));
  for (const auto& dir : {dir0, dir1, dir1b}) std::filesystem::remove_all(dir);
}

TEST_CASE("in place, two nodes: a store client queued on node 0's held master port before the round is decided is "
          "served once node 0's paused worker answers, not reset when the round opens (#36)") {
  // A pre-started standby's worker connects to the recovered round's master port as soon as
  // its own agent places it; node 0's agent, whose paused worker had not answered yet, closed
  // the held port there (the release meant for workers that bind it) and bound the store
  // afresh later: the queued connection was reset, and torch 1.13's store thread aborted.
  Daemon d = start_daemon();
  const std::string dir0 = make_temp_dir(), dir1 = make_temp_dir(), dir1b = make_temp_dir();
  auto node = [&](int node_rank, const std::string& dir) {
    return two_node_agent(d, "inplace-held", 1, node_rank, dir, {"on-pause=ack-on-file"});
  };
  Proc n0 = node(0, dir0);
  Proc n1 = node(1, dir1);
  REQUIRE(eventually([&] { return has_event(dir0, "welcome", 0) && has_event(dir1, "welcome", 0); }, 60s));
  const int first = round_master_port(n0.err(), 1);
  INFO(n0.err());
  REQUIRE(first > 0);
  ::kill(n1.pid, SIGKILL);
  REQUIRE(n1.wait(10s));
  // Node 0 re-joins holding a fresh master port (listening) beside its first round's store.
  // Master ports are drawn outside the kernel's ephemeral range; the agent's takeover socket
  // (listening since 3e05df2) has a port of that range, and is not the hold.
  const mg::PortRange eph = mg::ephemeral_port_range();
  int held = 0;
  REQUIRE(eventually([&] {
    for (int p : listening_ports_of(n0.pid))
      if (p != first && (p < eph.lo || p > eph.hi)) held = p;
    return has_event(dir0, "pause", 0) && held > 0;
  }, 60s));
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  REQUIRE(fd >= 0);
  const timeval tv{60, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(held));
  a.sin_addr.s_addr = htonl(0x7f000002);
  REQUIRE(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0);  // queued on the hold
  // torch 2.x's VALIDATE, then ADD("k", 1): answered once a store serves this connection.
  std::string q = std::string(1, '\0') + std::string("\xce\xf7\x85\x3c", 4) + '\4';
  const std::uint64_t one = 1, len = 1;
  q += std::string(reinterpret_cast<const char*>(&len), 8) + "k" + std::string(reinterpret_cast<const char*>(&one), 8);
  REQUIRE(::send(fd, q.data(), q.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(q.size()));
  Proc n1b = node(1, dir1b);  // the round opens on the held port; node 0's worker has not answered
  REQUIRE(eventually([&] { return round_master_port(n0.err(), 2) > 0; }, 60s));
  CHECK(round_master_port(n0.err(), 2) == held);
  REQUIRE(eventually([&] { return has_event(dir1b, "welcome", 0); }, 60s));
  // Before the fix the hold was closed by now: the connection reset (or, later, refused).
  std::string ended;  // how the connection ended, if it did (a reset shows once: the error is taken)
  auto reset = [&] {
    char c;
    const ssize_t n = ::recv(fd, &c, 1, MSG_PEEK | MSG_DONTWAIT);
    if (n == 0) ended = "closed";
    else if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK) ended = std::strerror(errno);
    return !ended.empty();
  };
  CHECK_FALSE(eventually(reset, 3s));
  INFO("the connection: " << ended);
  std::ofstream(dir0 + "/ack").put('\n');  // node 0's worker answers its pause: assigned, the store served
  std::int64_t v = 0;
  const ssize_t got = ::recv(fd, &v, 8, MSG_WAITALL);
  INFO("recv: " << got << " " << (got < 0 ? std::strerror(errno) : ""));
  CHECK(got == 8);
  CHECK(v == 1);
  ::close(fd);
  REQUIRE(eventually([&] { return has_event(dir0, "assign", 0); }, 60s));
  CHECK(of(events(dir0), "assign", 0).at(0)["env"]["MASTER_PORT"] == std::to_string(held));
  finish_both_ok(dir0, n0, dir1b, n1b);
  ::kill(d.proc.pid, SIGTERM);
  CHECK(d.proc.wait(10s));
  for (const auto& dir : {dir0, dir1, dir1b}) std::filesystem::remove_all(dir);
}

TEST_CASE("in place, two nodes, the workers hosting the store: the fresh master port node 0 offers for the next "
          "round refuses a store client until rank 0 listens, never queues it on the hold to reset it") {
  // torch 1.13's c10d workers: rank 0's TCPStore binds MASTER_PORT. A pre-started standby's
  // worker, placed as soon as the round is decided, connected to node 0's hold, still
  // listening until node 0's agent took its own assignment in; the hold's close then reset
  // the queued connection, and torch 1.13's store thread aborted (exit 134: the python
  // recovery done-when case, now and then under load). Node 0's agent is stopped here
  // (SIGSTOP) from its re-join until the round is decided, to hold that window open.
  Daemon d = start_daemon();
  const std::string dir0 = make_temp_dir(), dir1 = make_temp_dir(), dir1b = make_temp_dir();
  auto node = [&](int node_rank, const std::string& dir) {
    return two_node_agent(d, "inplace-unheld", 1, node_rank, dir, {"on-pause=ack-on-file"},
                          {{"TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1"}});
  };
  Proc n0 = node(0, dir0);
  Proc n1 = node(1, dir1);
  REQUIRE(eventually([&] { return has_event(dir0, "welcome", 0) && has_event(dir1, "welcome", 0); }, 60s));
  ::kill(n1.pid, SIGKILL);
  REQUIRE(n1.wait(10s));
  // The pause and the re-join with a fresh port are one batch of node 0's agent.
  REQUIRE(eventually([&] { return has_event(dir0, "pause", 0); }, 60s));
  ::kill(n0.pid, SIGSTOP);
  Proc n1b = node(1, dir1b);  // the round is decided; node 0's agent has not read its assignment
  const bool decided = eventually([&] { return round_master_port(n1b.err(), 2) > 0; }, 60s);
  const int port = round_master_port(n1b.err(), 2);
  int rc = -1, err = 0;
  if (decided) {
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(port));
    a.sin_addr.s_addr = htonl(0x7f000002);
    rc = ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
    err = errno;
    ::close(fd);
  }
  ::kill(n0.pid, SIGCONT);
  INFO(n1b.err());
  REQUIRE(decided);
  INFO("connect to node 0's port " << port << ": " << (rc < 0 ? std::strerror(err) : "queued on the hold"));
  CHECK(rc < 0);
  CHECK(err == ECONNREFUSED);
  std::ofstream(dir0 + "/ack").put('\n');  // node 0's worker answers its pause: assigned
  REQUIRE(eventually([&] { return has_event(dir0, "assign", 0); }, 60s));
  CHECK(of(events(dir0), "assign", 0).at(0)["env"]["MASTER_PORT"] == std::to_string(port));
  finish_both_ok(dir0, n0, dir1b, n1b);
  ::kill(d.proc.pid, SIGTERM);
  CHECK(d.proc.wait(10s));
  for (const auto& dir : {dir0, dir1, dir1b}) std::filesystem::remove_all(dir);
}

TEST_CASE("in place: a worker flooding the control socket neither locks the other ranks out nor spins the agent "
          "out of descriptors (ulimit -n 256)") {
  const std::string dir = make_temp_dir();
  const std::string script = dir + "/flood.py";
  std::ofstream(script) << R"PY(
import os, socket, sys, time
d, lr = sys.argv[1], int(os.environ["LOCAL_RANK"])
addr = "\0" + os.environ["MGLAUNCH_CONTROL_SOCKET"][1:]
def conn():
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(20)
    s.connect(addr)
    return s
if lr == 1:
    held = []
    for i in range(400):  # no hello, until this worker runs out of descriptors itself: more than the agent has
        try:
            held.append(conn())
        except OSError:
            break
    for s in held[-8:]:  # room for this worker's own files
        s.close()
    del held[-8:]
    open(os.path.join(d, "flooded"), "w").close()
    for _ in range(600):  # bounded: 60 s
        if os.path.exists(os.path.join(d, "done")):
            break
        time.sleep(0.1)
    sys.exit(0)
for _ in range(600):
    if os.path.exists(os.path.join(d, "flooded")):
        break
    time.sleep(0.1)
s = conn()
s.sendall(b'{"type":"hello","version":1,"in_place":false}\n')
line = s.makefile().readline()
print("rank 0 got:", line.strip(), flush=True)
open(os.path.join(d, "done"), "w").close()
)PY";
  auto r = run({"/bin/sh", "-c",
                "ulimit -n 256 && exec " + kMglaunch + " --standalone --nproc_per_node=2 --no_python /usr/bin/python3 " +
                    script + " " + dir},
               {}, 120s);
  INFO(r.out << r.err);
  CHECK(r.code == 0);
  CHECK_THAT(r.out, Catch::Contains("rank 0 got: {\"type\":\"welcome\",\"version\":1}"));
  // The refusals are logged at most once a second, not once each.
  std::size_t lines = 0;
  for (const auto& l : split_lines(r.out + r.err))
    if (l.find("control socket: refused") != std::string::npos) ++lines;
  CHECK(lines < 60);
  std::filesystem::remove_all(dir);
}

// --prestart-standby (docs/in-place-recovery.md, "Pre-started workers"): two active nodes
// and a standby on a real mglaunch-rdzv, every worker tests/inplace_worker.py (local rank 0
// opted in).
namespace {

struct StandbyJob {
  Daemon d = start_daemon();
  std::string dir2 = make_temp_dir(), dir3 = make_temp_dir(), dirs = make_temp_dir();
  std::vector<Proc> nodes;
  Proc node(int index, const std::string& dir, std::vector<std::string> flags = {}, std::vector<std::string> extra = {},
            const std::string& ranks = "0") {
    std::vector<std::string> argv{kMglaunch, "--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d",
                                  "--rdzv_endpoint=" + d.endpoint, "--rdzv_id=prestart", "--max_restarts=2",
                                  "--grace=10", "--local_addr=127.0.0." + std::to_string(index)};
    argv.insert(argv.end(), flags.begin(), flags.end());
    argv.insert(argv.end(), {"--no_python", "/usr/bin/python3", kWorker, dir, ranks});
    argv.insert(argv.end(), extra.begin(), extra.end());
    return spawn(argv);
  }
  // The active nodes running, then the standby (with `flags`) told it is one.
  void start(std::vector<std::string> standby_flags, std::vector<std::string> standby_extra = {},
             const std::string& standby_ranks = "0") {
    nodes.push_back(node(2, dir2));
    nodes.push_back(node(3, dir3));
    REQUIRE(eventually([&] { return has_event(dir2, "welcome", 0) && has_event(dir3, "welcome", 0); }, 60s));
    nodes.push_back(node(4, dirs, standby_flags, standby_extra, standby_ranks));
    REQUIRE(eventually([&] { return nodes[2].err().find("standby for job prestart") != std::string::npos; }, 60s));
  }
  ~StandbyJob() {
    for (const auto& dir : {dir2, dir3, dirs}) finish(dir);
    for (auto& p : nodes) p.wait(30s);
    ::kill(d.proc.pid, SIGTERM);
    d.proc.wait(10s);
    for (const auto& dir : {dir2, dir3, dirs}) std::filesystem::remove_all(dir);
  }
};

}  // namespace

TEST_CASE("standby prestart: the standby's worker starts before the loss, without a rank, and takes the lost node's "
          "place with its pid") {
  StandbyJob job;
  job.start({"--prestart-standby"});
  // Loaded ahead: started and welcomed while the node is still a standby.
  REQUIRE(eventually([&] { return has_event(job.dirs, "welcome", 0); }, 60s));
  const auto starts = of(events(job.dirs), "start", 0);
  REQUIRE(starts.size() == 1);
  const json pre = starts[0];
  CHECK(pre["standby"] == true);
  CHECK(pre["env"]["RANK"].is_null());  // no rank before a place
  CHECK(pre["env"]["MASTER_PORT"].is_null());
  CHECK(pre["env"]["TORCHELASTIC_RESTART_COUNT"].is_null());
  CHECK(pre["env"]["LOCAL_RANK"] == "0");
  CHECK_THAT(job.nodes[2].err(), Catch::Contains("worker(s) started ahead with MGLAUNCH_STANDBY=1"));
  ::kill(job.nodes[1].pid, SIGKILL);  // node 127.0.0.3's agent
  REQUIRE(job.nodes[1].wait(10s));
  REQUIRE(eventually([&] { return has_event(job.dirs, "assign", 0) && has_event(job.dir2, "assign", 0); }, 60s));
  for (const auto& dir : {job.dir2, job.dirs}) finish(dir);
  for (int i : {0, 2}) {
    REQUIRE(job.nodes[i].wait(60s));
    INFO(job.nodes[i].err());
    CHECK(job.nodes[i].exit_code() == 0);
  }
  const auto evs = events(job.dirs);
  CHECK(of(evs, "start", 0).size() == 1);  // no second process: the pre-started one took the place
  const auto assigns = of(evs, "assign", 0);
  REQUIRE(assigns.size() == 1);
  CHECK(assigns[0]["pid"] == pre["pid"]);
  CHECK(assigns[0]["restart_count"] == 1);
  const json& env = assigns[0]["env"];
  CHECK(env["WORLD_SIZE"] == "2");
  CHECK(env["TORCHELASTIC_RESTART_COUNT"] == "1");
  const json survivor = of(events(job.dir2), "assign", 0).at(0)["env"];
  for (const char* k : {"WORLD_SIZE", "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT"}) {
    INFO(k);
    CHECK(env.at(k) == survivor.at(k));  // one round with the survivor
  }
  CHECK(env["RANK"] != survivor["RANK"]);
  CHECK(of(evs, "exit", 0).at(0)["pid"] == pre["pid"]);
  CHECK_THAT(job.nodes[2].err(),
             Catch::Contains("local rank 0: the pre-started worker (pid " + std::to_string(pre["pid"].get<int>()) +
                             ") takes rank " + env["RANK"].get<std::string>()));
}

TEST_CASE("standby prestart: a worker without the capability is stopped at its hello and the place goes to a fresh "
          "worker, as without the flag") {
  StandbyJob job;
  job.start({"--prestart-standby"}, {"no-standby"});
  REQUIRE(eventually([&] { return has_event(job.dirs, "term", 0); }, 60s));
  const pid_t first = of(events(job.dirs), "start", 0).at(0)["pid"];
  REQUIRE(eventually([&] { return !pid_alive(first); }, 30s));
  CHECK_THAT(job.nodes[2].err(), Catch::Contains("--prestart-standby: local rank 0's pre-started worker (pid " +
                                                 std::to_string(first) + ") said hello without \"standby\""));
  ::kill(job.nodes[1].pid, SIGKILL);
  REQUIRE(job.nodes[1].wait(10s));
  REQUIRE(eventually([&] { return has_event(job.dirs, "start", 0, 2) && has_event(job.dir2, "assign", 0); }, 60s));
  for (const auto& dir : {job.dir2, job.dirs}) finish(dir);
  for (int i : {0, 2}) {
    REQUIRE(job.nodes[i].wait(60s));
    INFO(job.nodes[i].err());
    CHECK(job.nodes[i].exit_code() == 0);
  }
  const auto starts = of(events(job.dirs), "start", 0);
  REQUIRE(starts.size() == 2);
  CHECK(starts[1]["pid"] != first);
  CHECK(starts[1]["standby"] == false);
  CHECK(starts[1]["env"]["TORCHELASTIC_RESTART_COUNT"] == "1");
  CHECK(of(events(job.dirs), "assign", 0).empty());
}

TEST_CASE("standby prestart: the job ends while the node is still a standby: its pre-started worker gets SIGTERM, "
          "the standby exits 0 and no process is left") {
  StandbyJob job;
  job.start({"--prestart-standby"});
  REQUIRE(eventually([&] { return has_event(job.dirs, "welcome", 0); }, 60s));
  const pid_t pre = of(events(job.dirs), "start", 0).at(0)["pid"];
  finish(job.dir2);
  finish(job.dir3);
  for (auto& p : job.nodes) {
    REQUIRE(p.wait(60s));
    INFO(p.err());
    CHECK(p.exit_code() == 0);
  }
  CHECK_THAT(job.nodes[2].err(), Catch::Contains("stopping this standby's 1 pre-started worker(s): SIGTERM"));
  CHECK(has_event(job.dirs, "term", 0));  // SIGTERM first, not a bare SIGKILL
  CHECK_FALSE(pid_alive(pre));
  CHECK(of(events(job.dirs), "assign", 0).empty());
}

namespace {

// The state letter of /proc/PID/stat ('T': stopped by a signal); 0 when gone.
char proc_state(pid_t pid) {
  const std::string stat = read_file("/proc/" + std::to_string(pid) + "/stat");
  const auto close = stat.rfind(')');
  return close == std::string::npos || close + 2 >= stat.size() ? '\0' : stat[close + 2];
}

}  // namespace

TEST_CASE("standby prestart: a pre-started worker that never said hello when the place comes is killed and a fresh "
          "worker takes the place, and the standby agent lives on and exits 0") {
  // (Its handle dropped while it ran, its pipes open: the agent read them through the freed
  // handle and died of SIGSEGV, exit 139.)
  StandbyJob job;
  job.start({"--prestart-standby"}, {}, "");  // the standby's worker never connects
  REQUIRE(eventually([&] { return has_event(job.dirs, "start", 0); }, 60s));
  const pid_t first = of(events(job.dirs), "start", 0).at(0)["pid"];
  ::kill(job.nodes[1].pid, SIGKILL);
  REQUIRE(job.nodes[1].wait(10s));
  REQUIRE(eventually([&] { return has_event(job.dirs, "start", 0, 2) && has_event(job.dir2, "assign", 0); }, 60s));
  CHECK(eventually([&] { return !pid_alive(first); }, 30s));
  for (const auto& dir : {job.dir2, job.dirs}) finish(dir);
  for (int i : {0, 2}) {
    REQUIRE(job.nodes[i].wait(60s));
    INFO(job.nodes[i].err());
    CHECK(job.nodes[i].exit_code() == 0);
  }
  // (Had its 30 s for the hello passed first, it would have been stopped before the place.)
  REQUIRE_THAT(job.nodes[2].err(), !Catch::Contains("within 30 s"));
  CHECK_THAT(job.nodes[2].err(), Catch::Contains("pre-started worker (pid " + std::to_string(first) +
                                                 ") said no hello with \"standby\" before this node was given a "
                                                 "place: killed"));
  const auto starts = of(events(job.dirs), "start", 0);
  REQUIRE(starts.size() == 2);
  CHECK(starts[1]["standby"] == false);
  CHECK(starts[1]["env"]["TORCHELASTIC_RESTART_COUNT"] == "1");
}

TEST_CASE("standby prestart: a pre-started worker that ends on its own while the node is a standby is replaced by "
          "another, and the log file keeps both processes' output") {
  StandbyJob job;
  const std::string logs = make_temp_dir();
  job.start({"--prestart-standby", "--log_dir=" + logs, "--redirects=1"},
            {"standby-exits-after=6"});  // (kPrestartMinLife is 5 s)
  if (!eventually([&] { return has_event(job.dirs, "start", 0, 2); }, 60s))
    FAIL(job.nodes[2].err() << read_file(job.dirs + "/events.jsonl"));
  const auto starts = of(events(job.dirs), "start", 0);
  CHECK(starts[1]["standby"] == true);
  CHECK(starts[1]["pid"] != starts[0]["pid"]);
  CHECK(starts[1]["env"]["RANK"].is_null());
  REQUIRE(eventually([&] { return has_event(job.dirs, "welcome", 0, 2); }, 60s));  // the new one is welcomed too
  const std::string said = "local rank 0's pre-started worker (pid " + std::to_string(starts[0]["pid"].get<int>()) +
                           ") ended (";  // (exit code 3, or SIGTERM's 143: its connection closed first)
  CHECK(eventually([&] { return job.nodes[2].err().find(said) != std::string::npos; }, 30s));
  INFO(job.nodes[2].err());
  CHECK_THAT(job.nodes[2].err(), Catch::Contains("before this node was given a place: starting another"));
  finish(job.dir2);
  finish(job.dir3);
  for (auto& p : job.nodes) {
    REQUIRE(p.wait(60s));
    INFO(p.err());
    CHECK(p.exit_code() == 0);
  }
  for (const auto& s : of(events(job.dirs), "start", 0)) CHECK_FALSE(pid_alive(s["pid"].get<int>()));
  // Local rank 0's stdout.log of attempt 0 holds both pre-started processes' lines (the second
  // one's open truncated the first one's before).
  std::string out;
  for (const auto& e : std::filesystem::recursive_directory_iterator(logs))
    if (e.path().filename() == "stdout.log" && e.path().parent_path().parent_path().filename() == "attempt_0")
      out += read_file(e.path().string());
  for (int i : {0, 1})
    CHECK_THAT(out, Catch::Contains("pre-started worker pid " + std::to_string(starts[i]["pid"].get<int>())));
}

TEST_CASE("standby prestart: a second signal while the standby stops its pre-started workers kills them at once") {
  StandbyJob job;
  job.start({"--prestart-standby", "--grace=60"}, {"ignore-term"});
  REQUIRE(eventually([&] { return has_event(job.dirs, "welcome", 0); }, 60s));
  const pid_t pre = of(events(job.dirs), "start", 0).at(0)["pid"];
  ::kill(job.nodes[2].pid, SIGTERM);
  REQUIRE(eventually([&] { return has_event(job.dirs, "term-ignored", 0); }, 60s));  // it ignores the stop
  REQUIRE(eventually(
      [&] {
        return job.nodes[2].err().find("stopping this standby's 1 pre-started worker(s): SIGTERM, SIGKILL after 60.0s") !=
               std::string::npos;
      },
      30s));
  ::kill(job.nodes[2].pid, SIGINT);
  REQUIRE(job.nodes[2].wait(30s));  // not the 60 s grace
  INFO(job.nodes[2].err());
  CHECK_THAT(job.nodes[2].err(), Catch::Contains("got SIGINT while stopping this standby's pre-started workers: "
                                                 "killing them now (SIGKILL)"));
  CHECK(job.nodes[2].exit_code() == 143);  // the first signal's
  CHECK_FALSE(pid_alive(pre));
}

TEST_CASE("standby prestart: a SIGSTOPped pre-started worker gets SIGCONT after its SIGTERM at the job's end and ends "
          "by it, without the SIGKILL") {
  StandbyJob job;
  job.start({"--prestart-standby"});
  REQUIRE(eventually([&] { return has_event(job.dirs, "welcome", 0); }, 60s));
  const pid_t pre = of(events(job.dirs), "start", 0).at(0)["pid"];
  ::kill(pre, SIGSTOP);
  REQUIRE(eventually([&] { return proc_state(pre) == 'T'; }, 10s));
  finish(job.dir2);
  finish(job.dir3);
  for (auto& p : job.nodes) {
    REQUIRE(p.wait(60s));
    INFO(p.err());
    CHECK(p.exit_code() == 0);
  }
  INFO(job.nodes[2].err());
  CHECK(has_event(job.dirs, "term", 0));  // it ran its SIGTERM handler: continued
  CHECK_THAT(job.nodes[2].err(), !Catch::Contains("sending SIGKILL"));
  CHECK_FALSE(pid_alive(pre));
}
