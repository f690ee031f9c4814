// The rendezvous client's policy (rendezvous/client_machine.h), driven with a fake clock:
// events in with the time passed in, commands out. No socket, no timer.
#include <catch2/catch.hpp>
#include <cerrno>
#include <cstring>
#include <random>

#include "rendezvous/auth.h"
#include "rendezvous/client.h"
#include "rendezvous/client_machine.h"
#include "support/fake_clock.h"

using namespace mg;
using namespace mg::rdzv;
using namespace std::chrono_literals;
using proto::MsgType;

namespace {

using mgtest::rdzv::all;
using mgtest::rdzv::armed;
using mgtest::rdzv::has;
using mgtest::rdzv::kNonce;
using mgtest::rdzv::kRdzvPort;
using mgtest::rdzv::Link;
using mgtest::rdzv::T0;
using mgtest::rdzv::told;

const int kMasterPort = kRdzvPort + 10000;
const std::string kServer = "127.0.0.1:" + std::to_string(kRdzvPort);

proto::Join join_of(const std::string& addr, int max_restarts = 3) {
  proto::Join j;
  j.job_id = "job";
  j.agent_id = "agent-" + addr;
  j.host = "host-" + addr;
  j.addr = addr;
  j.min_nodes = 1;
  j.max_nodes = 4;
  j.max_restarts = max_restarts;
  j.keep_alive_ms = 100;
  j.keep_alive_max_attempt = 3;
  j.join_timeout_ms = 5000;
  j.takeover_port = 7000;
  return j;
}

ClientOptions options(const std::string& addr = "127.0.0.3", int max_restarts = 3) {
  ClientOptions o;
  o.host = "127.0.0.1";
  o.port = kRdzvPort;
  o.join = join_of(addr, max_restarts);
  return o;
}

template <class T>
T one(const ClientCommands& cs) {
  auto xs = all<T>(cs);
  REQUIRE(xs.size() == 1);
  return xs.front();
}
template <class T>
T told_one(const ClientCommands& cs) {
  auto xs = told<T>(cs);
  REQUIRE(xs.size() == 1);
  return xs.front();
}

std::vector<MsgType> sent(const ClientCommands& cs) {
  std::vector<MsgType> out;
  for (const auto& s : all<cmd::Send>(cs)) out.push_back(proto::type_of(s.frame));
  return out;
}
template <class T>
T sent_of(const ClientCommands& cs) {
  for (const auto& s : all<cmd::Send>(cs))
    if (proto::type_of(s.frame) == T::kType) return proto::from_frame<T>(s.frame);
  FAIL("no " << static_cast<int>(T::kType) << " sent");
  return {};
}
std::string notices(const ClientCommands& cs) {
  std::string out;
  for (const auto& n : all<cmd::Notice>(cs)) out += n.text + "\n";
  return out;
}

// A round of three nodes: 127.0.0.1 (group rank 0, the host, its takeover port 0 since it
// hosts), 127.0.0.2 and 127.0.0.3, each with a takeover port.
proto::Assignment round_of(int group_rank, int round = 1, int restart_count = 0) {
  proto::Assignment a;
  a.round = round;
  a.group_rank = group_rank;
  a.group_world_size = 3;
  a.rank_offset = group_rank;
  a.world_size = 3;
  a.master_addr = "127.0.0.1";
  a.master_port = kMasterPort;
  a.restart_count = restart_count;
  a.nodes = {"127.0.0.1", "127.0.0.2", "127.0.0.3"};
  a.takeover_ports = {0, 7002, 7003};
  return a;
}

// round_of's round among `nodes` (node 0 hosts; node i's takeover port is 7001 + i).
proto::Assignment round_among(const std::vector<std::string>& nodes, int group_rank) {
  proto::Assignment a = round_of(group_rank);
  a.group_world_size = a.world_size = static_cast<int>(nodes.size());
  a.nodes = nodes;
  a.takeover_ports = {0};
  for (std::size_t i = 1; i < nodes.size(); ++i) a.takeover_ports.push_back(7001 + static_cast<int>(i));
  return a;
}


}  // namespace

TEST_CASE("client machine: a refused start is retried soon and more slowly, and ends on the lost rendezvous at "
          "join_timeout") {
  Link l(options());
  auto c = l.m.start(l.now);
  CHECK(one<cmd::Connect>(c).host == "127.0.0.1");
  CHECK(one<cmd::Connect>(c).port == kRdzvPort);
  CHECK(armed(c, ClientTimer::kWatchdog) == T0 + 100ms);
  // Each refusal arms the retry after connect_retry_delay: 5 ms, then growing by half.
  std::vector<std::chrono::milliseconds> waits;
  for (int i = 0; i < 5; ++i) {
    c = l.m.connect_failed(true, "Connection refused", l.now);
    auto at = armed(c, ClientTimer::kRetry);
    REQUIRE(at);
    waits.push_back(std::chrono::duration_cast<std::chrono::milliseconds>(*at - l.now));
    l.now = *at;
    CHECK(has<cmd::Connect>(l.fire(ClientTimer::kRetry)));
  }
  CHECK(waits == std::vector<std::chrono::milliseconds>{5ms, 7ms, 10ms, 15ms, 22ms});
  CHECK(connect_retry_delay(100) == 500ms);
  // At join_timeout the next refusal is the end, with the hint flag for an own address.
  l.now = T0 + 5000ms;
  c = l.m.connect_failed(true, "Connection refused", l.now);
  auto lost = one<cmd::Lost>(c);
  CHECK(lost.why == "cannot reach the rendezvous server at " + kServer + ": Connection refused");
  CHECK(lost.unanswered);
  CHECK(one<cmd::Shut>(c).flush == false);
  CHECK(l.m.closed());
  // A closed machine ignores whatever comes late.
  CHECK(l.fire(ClientTimer::kRetry).empty());
  CHECK(l.m.connected(kNonce, l.now).empty());
}

TEST_CASE("client machine: without a token the join rides with the hello, and the welcome arms the heartbeat") {
  Link l(options());
  l.m.start(l.now);
  auto c = l.m.connected(kNonce, l.now);
  CHECK(sent(c) == std::vector<MsgType>{MsgType::kHello, MsgType::kJoin});
  CHECK(sent_of<proto::Hello>(c).nonce == kNonce);
  l.now += 3ms;
  c = l.receive(proto::Welcome{"srv", ""});
  CHECK(one<cmd::Welcomed>(c).session.empty());
  CHECK(sent(c).empty());  // the join went already
  CHECK(armed(c, ClientTimer::kHeartbeat) == l.now + 100ms);
  c = l.receive(round_of(2));
  CHECK(told_one<proto::Assignment>(c).group_rank == 2);
  // Heartbeats carry the round, every keep-alive interval.
  c = l.after(100ms, ClientTimer::kHeartbeat);
  CHECK(sent_of<proto::Heartbeat>(c).round == 1);
  CHECK(armed(c, ClientTimer::kHeartbeat) == l.now + 100ms);
}

TEST_CASE("client machine: with a token the server proves the job's key before the join, and a wrong proof is "
          "refused") {
  auto o = options();
  o.token = "secret";
  const std::string key = auth::job_key("secret", "job");
  const std::string server_nonce(64, 'b');
  {
    Link l(o);
    l.m.start(l.now);
    auto c = l.m.connected(kNonce, l.now);
    CHECK(sent(c) == std::vector<MsgType>{MsgType::kHello});
    c = l.receive(proto::Challenge{server_nonce, auth::server_proof(key, kNonce, server_nonce)});
    CHECK(sent(c) == std::vector<MsgType>{MsgType::kAuth});
    const auto session = auth::session_key(key, kNonce, server_nonce);
    CHECK(one<cmd::SignSent>(c).session == session);
    c = l.receive(proto::Welcome{"srv", ""});
    CHECK(one<cmd::Welcomed>(c).session == session);
    CHECK(sent(c) == std::vector<MsgType>{MsgType::kJoin});
  }
  {
    Link l(o);
    l.m.start(l.now);
    l.m.connected(kNonce, l.now);
    auto c = l.receive(proto::Challenge{server_nonce, std::string(64, '0')});
    CHECK_THAT(one<cmd::Lost>(c).why, Catch::Contains("cannot prove this job's key"));
  }
  {
    // A decision from a server that proved nothing is never obeyed.
    Link l(o);
    l.m.start(l.now);
    l.m.connected(kNonce, l.now);
    auto c = l.receive(proto::Abort{});
    CHECK(told<proto::Abort>(c).empty());
    CHECK_THAT(one<cmd::Lost>(c).why, Catch::Contains("could not be authenticated: it sent an Abort"));
  }
}

TEST_CASE("client machine: a daemon's outage that ends within join_timeout: reconnects with a doubling back-off and "
          "re-registers the round, replaying a failure reported meanwhile") {
  Link l(options());
  l.m.start(l.now);
  l.welcome();
  l.receive(round_of(1));
  l.now += 1s;
  auto c = l.m.connection_closed("end of file", l.now);
  CHECK(has<cmd::Drop>(c));
  CHECK_THAT(notices(c), Catch::Contains("lost the rendezvous server (end of file); workers keep running"));
  CHECK(armed(c, ClientTimer::kRetry) == l.now + 100ms);
  // The workers go on; a failure while away waits for the next welcome.
  proto::WorkerFailed f;
  f.round = 1;
  f.host = "host-127.0.0.2";
  f.rank = 1;
  CHECK(l.m.worker_failed(f, l.now).empty());
  c = l.after(100ms, ClientTimer::kRetry);
  CHECK(has<cmd::Connect>(c));
  // The server is back but closes again before its welcome: the back-off doubles.
  l.m.connected(kNonce, l.now);
  c = l.m.connection_closed("reset", l.now);
  CHECK(armed(c, ClientTimer::kRetry) == l.now + 200ms);
  c = l.after(200ms, ClientTimer::kRetry);
  CHECK(has<cmd::Connect>(c));
  c = l.m.connect_failed(true, "Connection refused", l.now);  // within the outage's join_timeout: retried
  REQUIRE(armed(c, ClientTimer::kRetry));
  l.now = *armed(c, ClientTimer::kRetry);
  l.fire(ClientTimer::kRetry);
  c = l.welcome();
  const auto j = sent_of<proto::Join>(c);
  CHECK(j.resume_round == 1);
  CHECK(j.resume_group_rank == 1);
  CHECK(j.resume_group_world_size == 3);
  CHECK(sent_of<proto::WorkerFailed>(c).rank == 1);
  CHECK_THAT(notices(c), Catch::Contains("reconnected; re-registered round 1"));
  // The outage is over: the next one starts from 100 ms and a full join_timeout again.
  l.now += 10s;
  c = l.m.connection_closed("end of file", l.now);
  CHECK(armed(c, ClientTimer::kRetry) == l.now + 100ms);
  l.now += 4s;
  c = l.m.connect_failed(true, "Connection refused", l.now);
  CHECK_FALSE(has<cmd::Lost>(c));
}

TEST_CASE("client machine: a node whose workers end between its reconnection and the welcome tells the rebuilt job "
          "it is done") {
  // Without a token the join (resume_done false) left with the hello; the welcome sends
  // no join again, so the done must follow that join on the same connection.
  Link l(options());
  l.m.start(l.now);
  l.welcome();
  l.receive(round_of(1));
  l.now += 1s;
  l.m.connection_closed("end of file", l.now);
  CHECK(has<cmd::Connect>(l.after(100ms, ClientTimer::kRetry)));
  auto c = l.m.connected(kNonce, l.now);
  CHECK_FALSE(sent_of<proto::Join>(c).resume_done);
  c = l.m.node_done(1);
  CHECK(sent_of<proto::NodeDone>(c).round == 1);
  c = l.receive(proto::Welcome{"srv", ""});
  CHECK(sent(c).empty());  // neither the join nor the done twice
  // Done while away altogether: the next join says so, no NodeDone needed.
  l.now += 1s;
  l.m.connection_closed("end of file", l.now);
  CHECK(sent(l.m.node_done(1)).empty());
  CHECK(has<cmd::Connect>(l.after(100ms, ClientTimer::kRetry)));
  c = l.m.connected(kNonce, l.now);
  CHECK(sent_of<proto::Join>(c).resume_done);
}

TEST_CASE("client machine: a daemon's outage past join_timeout ends the node on the lost rendezvous, however the "
          "tries fail") {
  SECTION("refused until the end") {
    Link l(options());
    l.m.start(l.now);
    l.welcome();
    l.receive(round_of(1));
    l.now += 1s;
    l.m.connection_closed("end of file", l.now);
    for (int i = 0; i < 100 && !l.m.closed(); ++i) {
      l.now += 100ms;
      l.fire(ClientTimer::kRetry);
      auto c = l.m.connect_failed(true, "Connection refused", l.now);
      if (l.now < T0 + 6s) CHECK_FALSE(has<cmd::Lost>(c));
      else CHECK_THAT(one<cmd::Lost>(c).why, Catch::StartsWith("cannot reach the rendezvous server at " + kServer));
    }
    CHECK(l.m.closed());
    CHECK(l.now == T0 + 6s);
  }
  SECTION("connections made that prove nothing") {
    Link l(options());
    l.m.start(l.now);
    l.welcome();
    l.receive(round_of(1));
    l.m.connection_closed("end of file", l.now);
    l.now += 5s;
    l.m.connected(kNonce, l.now);
    auto c = l.m.connection_closed("reset", l.now);
    CHECK_THAT(one<cmd::Lost>(c).why, Catch::StartsWith("no authenticated rendezvous server at " + kServer + " within "
                                                        "join_timeout (5 s): reset"));
  }
  SECTION("a silent server: the heartbeat echo stops") {
    Link l(options());
    l.m.start(l.now);
    l.welcome();
    l.receive(round_of(1));
    ClientCommands c;
    for (int i = 0; i < 4; ++i) {
      c = l.after(100ms, ClientTimer::kWatchdog);
      CHECK_FALSE(has<cmd::Drop>(c));
    }
    c = l.after(100ms, ClientTimer::kWatchdog);  // 500 ms > 100 ms x (3 + 1) without a frame
    CHECK(has<cmd::Drop>(c));
    CHECK_THAT(notices(c), Catch::Contains("lost the rendezvous server (no answer for 500 ms)"));
    CHECK(armed(c, ClientTimer::kWatchdog) == l.now + 100ms);
  }
}

TEST_CASE("client machine: no decision within join_timeout and a margin ends the wait, a standby's wait has none") {
  Link l(options());
  l.m.start(l.now);
  l.welcome();
  // join_timeout 5 s + max(2 s, 0.5 s): the server decides on join_timeout itself.
  ClientCommands c;
  while (!l.m.closed() && l.now < T0 + 60s) {
    l.receive(proto::Heartbeat{});
    c = l.after(100ms, ClientTimer::kWatchdog);
  }
  CHECK(l.now == T0 + 7100ms);
  CHECK_THAT(one<cmd::Lost>(c).why, Catch::Contains("no decision from the rendezvous server"));

  Link s(options());
  s.m.start(s.now);
  s.welcome();
  s.receive(proto::Standby{});
  for (int i = 0; i < 100; ++i) {
    s.receive(proto::Heartbeat{});
    c = s.after(100ms, ClientTimer::kWatchdog);
  }
  CHECK_FALSE(s.m.closed());
}

TEST_CASE("client machine: an assignment that comes while the workers stop waits for rejoin(), outside its call") {
  Link l(options());
  l.m.start(l.now);
  l.welcome();
  l.receive(round_of(1));
  auto c = l.receive(proto::Restart{1, "rank 0 failed"});
  CHECK(told_one<proto::Restart>(c).restart_count == 1);
  // The daemon restarts meanwhile; the node's join on reconnecting brings the next round.
  l.m.connection_closed("end of file", l.now);
  l.now += 100ms;
  l.fire(ClientTimer::kRetry);
  l.welcome();
  c = l.receive(round_of(1, 2, 1));
  CHECK(told<proto::Assignment>(c).empty());
  c = l.m.rejoin(l.now);
  CHECK(has<cmd::TakePending>(c));
  CHECK(told<proto::Assignment>(c).empty());
  c = l.m.take_pending(l.now);
  CHECK(told_one<proto::Assignment>(c).round == 2);
  CHECK(l.m.take_pending(l.now).empty());
}

TEST_CASE("client machine: the host agent lost: survivors restart and try the lowest live node first, then host "
          "themselves when nobody below answered") {
  Link l(options("127.0.0.3"));
  l.m.start(l.now);
  l.welcome("host-a");
  l.receive(round_of(2));
  l.now += 1s;
  auto c = l.m.connection_closed("end of file", l.now);
  auto r = told_one<proto::Restart>(c);
  CHECK(r.restart_count == 1);
  CHECK_THAT(r.reason, Catch::StartsWith("rendezvous host host-a (" + kServer + ") lost: end of file"));
  // Node 1 first (the lost host, node 0, is no candidate), one keep-alive interval.
  CHECK(one<cmd::Connect>(c).host == "127.0.0.2");
  CHECK(one<cmd::Connect>(c).port == 7002);
  CHECK(armed(c, ClientTimer::kTakeover) == l.now + 100ms);
  CHECK(l.m.searching());
  // Node 1 does not answer: this node (2) is next and hosts.
  c = l.after(100ms, ClientTimer::kTakeover);
  auto seed = one<cmd::HostTakeover>(c).seed;
  CHECK_FALSE(has<cmd::Connect>(c));
  CHECK(seed.round == 1);
  CHECK(seed.restart_count == 1);
  CHECK(seed.lost_host == "host-a");
  CHECK(seed.survivors == 1);  // 3 listed, less the lost host and node 1 that did not answer
  CHECK(seed.world_size == 3);
  CHECK(seed.deadline == T0 + 1s + 300ms);  // keep-alive x attempts for the whole search
  // It hosts at the address it bound, and joins itself there with its last group rank.
  c = l.m.hosted({"127.0.0.9", 7100}, l.now);
  CHECK(one<cmd::Connect>(c).host == "127.0.0.9");
  CHECK(one<cmd::Connect>(c).port == 7100);
  l.m.rejoin(l.now);  // the workers stopped
  c = l.welcome("host-127.0.0.3");
  CHECK_THAT(notices(c), Catch::Contains("the rendezvous is now hosted by host-127.0.0.3 at 127.0.0.9:7100"));
  CHECK(std::ranges::any_of(all<cmd::Cancel>(c), [](const auto& x) { return x.timer == ClientTimer::kTakeover; }));
  const auto j = sent_of<proto::Join>(c);
  CHECK(j.last_group_rank == 2);
  CHECK(j.takeover_port == 0);  // it hosts now
  CHECK(j.resume_round == 0);
  CHECK_FALSE(l.m.searching());
}

TEST_CASE("client machine: a survivor above the lowest live node joins it, and a refusal there is retried within "
          "its interval") {
  auto o = options("127.0.0.3");
  Link l(o);
  l.m.start(l.now);
  l.welcome("host-a");
  l.receive(round_of(2));
  auto c = l.m.connection_closed("end of file", l.now);
  CHECK(one<cmd::Connect>(c).host == "127.0.0.2");
  // Node 1 has not opened its server yet: refused, retried soon (not the end of the search).
  c = l.m.connect_failed(true, "Connection refused", l.now);
  CHECK(armed(c, ClientTimer::kRetry) == l.now + 5ms);
  l.now += 5ms;
  CHECK(one<cmd::Connect>(l.fire(ClientTimer::kRetry)).host == "127.0.0.2");
  c = l.welcome("host-127.0.0.2");
  CHECK_THAT(notices(c), Catch::Contains("now hosted by host-127.0.0.2 at 127.0.0.2:7002"));
  CHECK_FALSE(has<cmd::HostTakeover>(c));
  // The restart stopped its workers: it joins once rejoin() says so, with its last group rank.
  c = l.m.rejoin(l.now);
  CHECK(sent_of<proto::Join>(c).last_group_rank == 2);
  c = l.receive(round_of(1, 2, 1));
  CHECK(told_one<proto::Assignment>(c).restart_count == 1);
}

TEST_CASE("client machine: no survivor can take over: no restart left, too few nodes, no round, or nobody answers "
          "in time - the node ends with the lost host as root cause") {
  SECTION("no restart left") {
    Link l(options("127.0.0.3", /*max_restarts=*/0));
    l.m.start(l.now);
    l.welcome("host-a");
    l.receive(round_of(2));
    auto c = l.m.connection_closed("end of file", l.now);
    auto a = told_one<proto::Abort>(c);
    CHECK(a.root_cause.exit_code == kHostLostExitCode);
    CHECK(a.root_cause.host == "host-a");
    CHECK_THAT(a.reason, Catch::Contains("no survivor can take over: no restart left"));
    CHECK(told<proto::Restart>(c).empty());
    CHECK(l.m.closed());
  }
  SECTION("fewer nodes than --nnodes' minimum") {
    auto o = options("127.0.0.3");
    o.join.min_nodes = 3;
    Link l(o);
    l.m.start(l.now);
    l.welcome("host-a");
    l.receive(round_of(2));
    auto c = l.m.connection_closed("end of file", l.now);
    CHECK_THAT(told_one<proto::Abort>(c).reason, Catch::Contains("2 node(s) left, fewer than the 3"));
  }
  SECTION("no round had started") {
    Link l(options());
    l.m.start(l.now);
    l.welcome("host-a");
    auto c = l.m.connection_closed("end of file", l.now);
    CHECK_THAT(one<cmd::Lost>(c).why, Catch::Contains("no round had started, so no node can take over"));
  }
  SECTION("the search runs out of time") {
    Link l(options("127.0.0.3"));
    l.m.start(l.now);
    l.welcome("host-a");
    l.receive(round_of(2));
    l.m.connection_closed("end of file", l.now);
    auto c = l.after(100ms, ClientTimer::kTakeover);
    REQUIRE(has<cmd::HostTakeover>(c));
    c = l.m.hosted({}, l.now);  // this node cannot host
    auto a = told_one<proto::Abort>(c);
    CHECK_THAT(a.reason, Catch::Contains("no survivor could take over (node 1 at 127.0.0.2:7002: no answer; node 2 "
                                         "(this one): cannot host)"));
  }
  SECTION("a job that ended: its host closes, nothing to take over") {
    Link l(options("127.0.0.3"));
    l.m.start(l.now);
    l.welcome("host-a");
    l.receive(round_of(2));
    CHECK_FALSE(told<proto::Done>(l.receive(proto::Done{})).empty());
    auto c = l.m.connection_closed("end of file", l.now);
    CHECK(has<cmd::Drop>(c));
    CHECK(told<proto::Restart>(c).empty());
    CHECK_FALSE(has<cmd::Connect>(c));
    CHECK(told<proto::Abort>(c).empty());
  }
}

// #34: a REJECT firewall around this node resets its host's connection and refuses every
// connect, so every candidate refuses to the search's deadline. Before, the node ended there
// (exit 3, 'no survivor could take over') and could not rejoin after the heal. A host that
// closed (not reset) still ends the node there.
TEST_CASE("client machine: a takeover search whose candidates refused to its deadline waits to rejoin: the last host "
          "and the others in turn, never hosting, joining the first that welcomes, until join_timeout") {
  auto search_refused = [](Link& l, bool reset = true) {
    l.m.start(l.now);
    l.welcome("host-a");
    l.receive(round_of(2));
    auto c = l.m.connection_closed(reset ? std::strerror(ECONNRESET) : "end of file", l.now, reset);
    REQUIRE(told_one<proto::Restart>(c).restart_count == 1);
    REQUIRE(one<cmd::Connect>(c).host == "127.0.0.2");
    l.m.rejoin(l.now);  // the workers stopped
    // Node 1 refuses (the firewall) to the search's deadline (keep-alive x attempts: 300 ms).
    for (int i = 0; i < 2; ++i) {
      l.m.connect_failed(true, "Connection refused", l.now);
      c = l.after(100ms, ClientTimer::kTakeover);
      REQUIRE_FALSE(has<cmd::Connect>(c));
    }
    l.m.connect_failed(true, "Connection refused", l.now);
    return l.after(100ms, ClientTimer::kTakeover);
  };
  Link l(options("127.0.0.3"));
  auto c = search_refused(l);
  // Before: an Abort here (the search's end). Now it waits: the last host first.
  CHECK(told<proto::Abort>(c).empty());
  CHECK_FALSE(has<cmd::HostTakeover>(c));
  CHECK_FALSE(l.m.closed());
  CHECK_THAT(notices(c), Catch::Contains("it waits to rejoin the job") && Catch::Contains("until join_timeout (5 s)"));
  CHECK(one<cmd::Connect>(c).host == "127.0.0.1");
  CHECK(one<cmd::Connect>(c).port == kRdzvPort);
  CHECK(armed(c, ClientTimer::kTakeover) == l.now + 100ms);
  // Refused there too (still cut off): node 1 next, never this node (2), then the host again.
  l.m.connect_failed(true, "Connection refused", l.now);
  c = l.after(100ms, ClientTimer::kTakeover);
  CHECK(one<cmd::Connect>(c).host == "127.0.0.2");
  c = l.after(100ms, ClientTimer::kTakeover);  // silent
  CHECK(one<cmd::Connect>(c).host == "127.0.0.1");
  CHECK_FALSE(has<cmd::HostTakeover>(c));
  // Healed: the host welcomes; this node joins its next round as a newcomer.
  c = l.welcome("host-a");
  CHECK_THAT(notices(c), Catch::Contains("reached the job again: its rendezvous is hosted by host-a at " + kServer));
  const auto j = sent_of<proto::Join>(c);
  CHECK(j.resume_round == 0);
  CHECK_FALSE(j.resume_standby);
  CHECK_FALSE(l.m.searching());
  c = l.receive(round_of(2, 3, 1));
  CHECK(told_one<proto::Assignment>(c).round == 3);

  // Nobody answers within join_timeout (5 s) of the loss: the end, with the lost host as root cause.
  Link t(options("127.0.0.3"));
  const auto lost_at = t.now;
  c = search_refused(t);
  int fires = 0;
  while (told<proto::Abort>(c).empty() && fires++ < 100) {
    CHECK_FALSE(has<cmd::HostTakeover>(c));
    t.m.connect_failed(true, "Connection refused", t.now);
    c = t.after(100ms, ClientTimer::kTakeover);
  }
  const auto a = told_one<proto::Abort>(c);
  CHECK(t.now == lost_at + 5s);
  CHECK(a.root_cause.exit_code == kHostLostExitCode);
  CHECK_THAT(a.reason, Catch::Contains("no survivor could take over (node 1 at 127.0.0.2:7002: refused until the "
                                       "search's deadline); no host of the job answered this node within "
                                       "join_timeout (5 s)"));
  CHECK(t.m.closed());

  // A host that closed (a SIGKILLed agent's kernel sends an end of file, not a reset) and
  // candidates that refuse (dead too, on machines that live): the end at the search's
  // deadline, as before.
  Link d(options("127.0.0.3"));
  c = search_refused(d, /*reset=*/false);
  CHECK_THAT(told_one<proto::Abort>(c).reason,
             Catch::EndsWith("no survivor could take over (node 1 at 127.0.0.2:7002: refused until the search's "
                             "deadline)"));
  CHECK(d.m.closed());
}

TEST_CASE("client machine: a standby follows the takeover of its lost host, never hosts, and re-registers as a "
          "standby") {
  Link l(options("127.0.0.4"));
  l.m.start(l.now);
  l.welcome("host-a");
  proto::Standby s;
  s.active_nodes = 3;
  s.round = 1;
  s.nodes = {"127.0.0.1", "127.0.0.2", "127.0.0.3"};
  s.takeover_ports = {0, 7002, 7003};
  CHECK_FALSE(told<proto::Standby>(l.receive(s)).empty());
  // A node that took a job over lists no round before its own closes: the last list stays.
  l.receive(proto::Standby{});
  auto c = l.m.connection_closed("end of file", l.now);
  CHECK(told<proto::Restart>(c).empty());  // no workers to stop
  CHECK_THAT(notices(c), Catch::Contains("this standby follows the node that takes over"));
  CHECK(one<cmd::Connect>(c).host == "127.0.0.2");
  c = l.after(100ms, ClientTimer::kTakeover);
  CHECK(one<cmd::Connect>(c).host == "127.0.0.3");
  CHECK_FALSE(has<cmd::HostTakeover>(c));
  c = l.welcome("host-127.0.0.3");
  CHECK(sent_of<proto::Join>(c).resume_standby);
  CHECK_FALSE(l.m.searching());

  // A standby told no round gives up with the lost host named.
  Link t(options("127.0.0.4"));
  t.m.start(t.now);
  t.welcome("host-a");
  t.receive(proto::Standby{});
  c = t.m.connection_closed("end of file", t.now);
  CHECK_THAT(one<cmd::Lost>(c).why, Catch::Contains("this standby was told no round to follow"));
}

TEST_CASE("client machine: a candidate whose name does not resolve is passed over at once") {
  Link l(options("127.0.0.4"));
  l.m.start(l.now);
  l.welcome("host-a");
  proto::Assignment a = round_among({"127.0.0.1", "node-b.invalid", "127.0.0.3", "127.0.0.4"}, 3);
  l.receive(a);
  auto c = l.m.connection_closed("end of file", l.now);
  CHECK(one<cmd::Connect>(c).host == "node-b.invalid");
  c = l.m.unresolvable(l.now);
  CHECK(one<cmd::Connect>(c).host == "127.0.0.3");
}

TEST_CASE("client machine: close() flushes, give_up() says why once, and nothing starts after either") {
  Link l(options());
  l.m.start(l.now);
  l.welcome();
  l.receive(round_of(1));
  auto c = l.m.node_done(1);
  CHECK(sent_of<proto::NodeDone>(c).round == 1);
  c = l.m.close();
  CHECK(one<cmd::Shut>(c).flush);
  CHECK(l.m.close().empty());
  CHECK(l.m.give_up("late").empty());
  CHECK(l.m.connection_closed("end of file", l.now).empty());
  CHECK(l.fire(ClientTimer::kWatchdog).empty());

  Link bad(options());
  bad.m.start(bad.now);
  bad.m.connected(kNonce, bad.now);
  c = bad.m.connection_closed("end of file", bad.now);  // before a word: maybe another program
  CHECK_THAT(one<cmd::Lost>(c).why, Catch::Contains("ended before its welcome (end of file)"));
  CHECK_THAT(one<cmd::Lost>(c).why, Catch::Contains("ss -ltnp"));

  auto o = options();
  o.join.nproc = 0;
  Link invalid(o);
  c = invalid.m.start(invalid.now);
  CHECK_THAT(one<cmd::Lost>(c).why, Catch::StartsWith("cannot join: "));
  CHECK_FALSE(has<cmd::Connect>(c));
}

TEST_CASE("client machine: a stale timer fire (an earlier arm, queued before the re-arm) is ignored: a takeover "
          "candidate that refused its handshake is not skipped by its predecessor's timer") {
  // Four nodes; this one is group rank 3: candidates node 1 (127.0.0.2), node 2 (127.0.0.3), then itself.
  Link l(options("127.0.0.4"));
  l.m.start(l.now);
  l.welcome("host-a");
  proto::Assignment a = round_among({"127.0.0.1", "127.0.0.2", "127.0.0.3", "127.0.0.4"}, 3);
  l.receive(a);
  auto c = l.m.connection_closed("end of file", l.now);
  CHECK(one<cmd::Connect>(c).host == "127.0.0.2");
  const auto first = one<cmd::Arm>(c);
  REQUIRE(first.timer == ClientTimer::kTakeover);
  // Node 1 refuses the handshake (a close before any frame would be waited for, review
  // s39-listen L1): node 2 is tried, under a new arm.
  l.now += 10ms;
  l.m.connected(kNonce, l.now);
  c = l.receive(proto::Error{"not this job"});
  CHECK(one<cmd::Connect>(c).host == "127.0.0.3");
  const auto second = one<cmd::Arm>(c);
  CHECK(second.generation != first.generation);
  // Node 1's timer, expired and queued before the re-arm, fires now: stale, node 2 keeps its interval.
  l.now = first.at;
  CHECK(l.m.timer_fired(ClientTimer::kTakeover, first.generation, l.now).empty());
  CHECK(l.m.searching());
  // A fire after a cancel is stale too.
  c = l.welcome("host-127.0.0.3");
  CHECK(has<cmd::Cancel>(c));
  CHECK(l.m.timer_fired(ClientTimer::kTakeover, second.generation, second.at).empty());
  // Node 2's own timer, had it not answered, moves on to this node.
  Link m(options("127.0.0.4"));
  m.m.start(m.now);
  m.welcome("host-a");
  m.receive(a);
  m.m.connection_closed("end of file", m.now);
  m.m.connected(kNonce, m.now);
  c = m.receive(proto::Error{"not this job"});
  const auto armed2 = one<cmd::Arm>(c);
  c = m.m.timer_fired(ClientTimer::kTakeover, armed2.generation, armed2.at);
  CHECK(has<cmd::HostTakeover>(c));
}

TEST_CASE("client machine: a failure report is not lost when the connection closes during its send: it goes "
          "again with every re-registration until a decision answers it") {
  Link l(options());
  l.m.start(l.now);
  l.welcome();
  l.receive(round_of(1));
  l.m.connection_closed("end of file", l.now);  // the daemon restarts
  proto::WorkerFailed f;
  f.round = 1;
  f.rank = 1;
  f.exit_code = 3;
  auto c = l.m.worker_failed(f, l.now);  // held back: no connection
  CHECK(sent(c).empty());
  l.after(100ms, ClientTimer::kRetry);
  c = l.welcome();
  CHECK(sent_of<proto::WorkerFailed>(c).exit_code == 3);
  // The join's send fails and shuts the connection: the failure went nowhere.
  l.m.connection_closed("Broken pipe", l.now);
  l.after(200ms, ClientTimer::kRetry);
  c = l.welcome();
  CHECK(sent_of<proto::WorkerFailed>(c).exit_code == 3);
  CHECK(sent_of<proto::Join>(c).resume_round == 1);
  // Once a decision answered it, it is not sent again.
  c = l.receive(proto::Restart{1, "rank 1 failed"});
  CHECK(told_one<proto::Restart>(c).restart_count == 1);
  l.m.connection_closed("end of file", l.now);
  l.after(400ms, ClientTimer::kRetry);
  c = l.welcome();
  CHECK(std::ranges::count(sent(c), MsgType::kWorkerFailed) == 0);

  // Sent on a live connection that is lost before the decision: sent again on the next welcome.
  Link m(options());
  m.m.start(m.now);
  m.welcome();
  m.receive(round_of(1));
  CHECK(sent_of<proto::WorkerFailed>(m.m.worker_failed(f, m.now)).rank == 1);
  m.m.connection_closed("end of file", m.now);
  m.after(100ms, ClientTimer::kRetry);
  CHECK(sent_of<proto::WorkerFailed>(m.welcome()).rank == 1);
}

TEST_CASE("client machine: the takeover search runs out of time with candidates left: the last interval is cut "
          "at the search's deadline and this node does not host past it") {
  auto o = options("127.0.0.5");
  o.join.keep_alive_max_attempt = 2;  // the whole search: 100 ms x 2
  Link l(o);
  l.m.start(l.now);
  l.welcome("host-a");
  proto::Assignment a = round_among({"127.0.0.1", "127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5"}, 4);
  l.receive(a);
  const auto lost_at = l.now;
  auto c = l.m.connection_closed("end of file", l.now);
  CHECK(armed(c, ClientTimer::kTakeover) == lost_at + 100ms);
  l.now += 50ms;  // node 1 refuses the handshake
  l.m.connected(kNonce, l.now);
  c = l.receive(proto::Error{"not this job"});
  CHECK(one<cmd::Connect>(c).host == "127.0.0.3");
  CHECK(armed(c, ClientTimer::kTakeover) == lost_at + 150ms);
  c = l.after(100ms, ClientTimer::kTakeover);  // node 2 silent
  CHECK(one<cmd::Connect>(c).host == "127.0.0.4");
  CHECK(armed(c, ClientTimer::kTakeover) == lost_at + 200ms);  // not 250 ms: the search's deadline
  c = l.after(50ms, ClientTimer::kTakeover);  // node 3 silent: the search is over, node 4 (this one) left
  CHECK_FALSE(has<cmd::HostTakeover>(c));
  CHECK_THAT(told_one<proto::Abort>(c).reason,
             Catch::Contains("no survivor could take over (node 1 at 127.0.0.2:7002: refused by the rendezvous server: not "
                             "this job; node 2 at "
                             "127.0.0.3:7003: no answer; node 3 at 127.0.0.4:7004: no answer)"));
  CHECK(l.m.closed());
}

TEST_CASE("client machine: a server that accepts but never answers the handshake: the end at first, a reconnect "
          "in an outage") {
  Link l(options());  // join_timeout 5 s: the handshake may take min(5 s, max(400 ms, 10 s))
  l.m.start(l.now);
  l.m.connected(kNonce, l.now);
  l.now += 5000ms;
  l.fire(ClientTimer::kWatchdog);
  CHECK_FALSE(l.m.closed());  // 5 s is not past it
  auto c = l.after(100ms, ClientTimer::kWatchdog);
  CHECK_THAT(one<cmd::Lost>(c).why, Catch::Contains("accepts connections but does not answer the handshake"));

  auto opts = options();
  opts.join.join_timeout_ms = 20000;  // the handshake: min(20 s, max(400 ms, 10 s)); the outage: 20 s
  Link o(opts);
  o.m.start(o.now);
  o.welcome();
  o.receive(round_of(1));
  o.m.connection_closed("end of file", o.now);
  o.after(100ms, ClientTimer::kRetry);
  o.m.connected(kNonce, o.now);
  o.now += 10100ms;
  c = o.fire(ClientTimer::kWatchdog);
  CHECK_THAT(notices(c), Catch::Contains("no answer to the handshake"));
  CHECK(has<cmd::Drop>(c));
  CHECK_FALSE(o.m.closed());
}

TEST_CASE("client machine: a node that hosts at an empty address joins itself at its candidate's address") {
  Link l(options("127.0.0.3"));
  l.m.start(l.now);
  l.welcome("host-a");
  l.receive(round_of(2));
  l.m.connection_closed("end of file", l.now);
  REQUIRE(has<cmd::HostTakeover>(l.after(100ms, ClientTimer::kTakeover)));
  auto c = l.m.hosted({"", 7100}, l.now);
  CHECK(one<cmd::Connect>(c).host == "127.0.0.3");
  CHECK(one<cmd::Connect>(c).port == 7100);
}

TEST_CASE("client machine: an Error or a bad frame after the welcome ends the link with what it said") {
  Link l(options());
  l.m.start(l.now);
  l.welcome();
  auto c = l.receive(proto::Error{"job 'job' is full"});
  CHECK(one<cmd::Lost>(c).why == "refused by the rendezvous server: job 'job' is full");
  CHECK(l.m.closed());

  Link b(options());
  b.m.start(b.now);
  b.welcome();
  proto::Frame f;
  f.type = static_cast<std::uint8_t>(MsgType::kAssignment);
  f.payload = "not an assignment";
  c = b.m.frame(f, b.now);
  CHECK_THAT(one<cmd::Lost>(c).why, Catch::StartsWith("bad message from the rendezvous server: "));
  CHECK_FALSE(has<cmd::Connect>(c));
  CHECK(b.m.closed());
}

TEST_CASE("client layer: a join that cannot be sent is not told as lost once the agent closed the link") {
  boost::asio::io_context io;
  auto o = options();
  o.join.nproc = 0;
  int lost = 0;
  ClientHandlers h;
  h.on_lost = [&](const std::string&) { ++lost; };
  {
    Client c(io, o, h);
    c.start();
    c.close();
    io.run();
  }
  CHECK(lost == 0);
  lost = 0;
  io.restart();
  Client c(io, o, h);
  c.start();
  CHECK(lost == 0);  // after start() returned
  io.run();
  CHECK(lost == 1);
}

TEST_CASE("client machine: an assignment without an epoch (a server before #34) is said once, naming the server") {
  Link l(options());
  l.m.start(l.now);
  l.welcome();
  auto old_round = [&](int round) {
    proto::Frame f = proto::to_frame(round_of(2, round));
    f.payload.erase("epoch");
    f.payload.erase("voters");
    return l.m.frame(f, l.now);
  };
  auto c = old_round(1);
  CHECK(told_one<proto::Assignment>(c).round == 1);
  CHECK(notices(c) == "the rendezvous at " + kServer + " is older than this agent (its assignment carries no epoch): "
                      "no MGLAUNCH_EPOCH for the workers and no partition rules (voters, majority) there; upgrade it\n");
  l.receive(proto::Restart{1, "rank 0 failed"});
  l.m.rejoin(l.now);
  c = old_round(2);
  CHECK(told_one<proto::Assignment>(c).round == 2);
  CHECK(notices(c).empty());  // once
  // A server of today sends its epoch: nothing to say.
  Link n(options());
  n.m.start(n.now);
  n.welcome();
  proto::Assignment a = round_of(2);
  a.epoch = 1;
  CHECK(notices(n.receive(a)).empty());
}

// #34, Seeking: a host whose own server's next round waits for a majority (the host cut off
// from the others) looks for the job at the other nodes that could host after K x A, and
// leaves for one that runs a newer round. Before, it waited for its own round to
// join_timeout and ended there, though the majority's host answered after the heal.
namespace {

mg::rdzv::ClientCommands welcome_from(mgtest::rdzv::Link& l, const std::string& host_agent, int round_epoch,
                                      int epoch, int last_round_epoch = 0, const std::string& run = {}) {
  auto c = l.m.connected(kNonce, l.now);
  proto::Welcome w{"srv", host_agent};
  w.run = run;
  w.round_epoch = round_epoch;
  w.epoch = epoch;
  w.last_round_epoch = last_round_epoch;
  auto f = l.m.frame(proto::to_frame(w), l.now);
  c.insert(c.end(), f.begin(), f.end());
  return c;
}

bool stops_hosting(const ClientCommands& c) { return has<cmd::StopHosting>(c); }

// The host of round_of's round (node 0 at 127.0.0.1, this node's own server at the
// endpoint), its round at epoch 5 restarted after the other two were dropped: it waits for
// its own next round.
void host_waits(Link& l, const std::string& run = {}) {
  l.m.start(l.now);
  welcome_from(l, "host-127.0.0.1", 0, 0);
  auto a = round_of(0);
  a.epoch = 5;
  a.run = run;
  l.receive(a);
  l.receive(proto::Restart{1, "node 127.0.0.2 lost"});
  l.m.rejoin(l.now);
}

ClientOptions host_options() {
  auto o = options("127.0.0.1");
  o.join.takeover_port = 0;  // it hosts
  o.join.last_call_ms = 100;
  return o;
}

// Node 2 of round_of's round (epoch `epoch`), cut off from both others, took it over alone
// and its round waits for a majority: after the grace it looks for the job, first at the
// old host (the endpoint), which it is connecting to now.
void taker_seeks(Link& taker, int epoch) {
  taker.m.start(taker.now);
  welcome_from(taker, "host-127.0.0.1", 0, 0);
  auto a = round_of(2);
  a.epoch = epoch;
  a.voters = {"agent-127.0.0.1", "agent-127.0.0.2", "agent-127.0.0.3"};
  taker.receive(a);
  taker.now += 1s;
  auto c = taker.m.connection_closed("no answer for 400 ms", taker.now);
  REQUIRE(one<cmd::Connect>(c).host == "127.0.0.2");
  taker.m.rejoin(taker.now);
  c = taker.after(100ms, ClientTimer::kTakeover);
  REQUIRE(has<cmd::HostTakeover>(c));
  c = taker.m.hosted({"127.0.0.3", 7003}, taker.now);
  REQUIRE(one<cmd::Connect>(c).port == 7003);
  welcome_from(taker, "host-127.0.0.3", 0, takeover_epoch(epoch, 2) - 1, epoch);
  taker.m.host_short_of_majority(taker.now);
  c = taker.after(300ms, ClientTimer::kTakeover);
  CHECK_THAT(notices(c), Catch::Contains("(127.0.0.1:" + std::to_string(kRdzvPort) + ", 127.0.0.2:7002)"));
  REQUIRE(one<cmd::Connect>(c).host == "127.0.0.1");
}

}  // namespace

TEST_CASE("client machine: a host whose round waits for a majority looks for the job at the other nodes after K x A, "
          "in turn with its own server, and leaves for one that runs a newer round") {
  Link l(host_options());
  host_waits(l);
  auto c = l.m.host_short_of_majority(l.now);
  CHECK(armed(c, ClientTimer::kTakeover) == l.now + 300ms);  // the grace: K x A
  CHECK_FALSE(has<cmd::Connect>(c));
  CHECK_FALSE(l.m.seeking());
  // The grace passed without a decision: node 1's takeover port first, never this node's own.
  c = l.after(300ms, ClientTimer::kTakeover);
  CHECK_THAT(notices(c), Catch::Contains("looks for the job at its other hosts (127.0.0.2:7002, 127.0.0.3:7003)"));
  CHECK(has<cmd::Drop>(c));
  CHECK(one<cmd::Connect>(c).host == "127.0.0.2");
  CHECK(one<cmd::Connect>(c).port == 7002);
  CHECK(armed(c, ClientTimer::kTakeover) == l.now + 100ms);
  CHECK(l.m.seeking());
  // Node 1 hosts no newer round (it took over too, later in the order, and waits): not left
  // for, and no join is sent there (not even with the hello, as a job without a token does).
  c = welcome_from(l, "host-127.0.0.2", 0, 131074);
  CHECK_FALSE(stops_hosting(c));
  CHECK(sent(c) == std::vector<MsgType>{MsgType::kHello});
  CHECK(one<cmd::Connect>(c).host == "127.0.0.3");
  // Node 2 silent (still cut off): home, for K past the last call, joining its own round.
  c = l.after(100ms, ClientTimer::kTakeover);
  CHECK(one<cmd::Connect>(c).host == "127.0.0.1");
  CHECK(one<cmd::Connect>(c).port == kRdzvPort);
  CHECK(armed(c, ClientTimer::kTakeover) == l.now + 200ms);
  c = welcome_from(l, "host-127.0.0.1", 0, 5);
  CHECK(sent_of<proto::Join>(c).resume_round == 0);
  CHECK_FALSE(stops_hosting(c));
  // Healed: node 1 runs a round of a newer epoch (a majority opened it): this node stops
  // hosting before anything else and joins there as a new member.
  c = l.after(200ms, ClientTimer::kTakeover);
  CHECK(one<cmd::Connect>(c).host == "127.0.0.2");
  c = welcome_from(l, "host-127.0.0.2", 131075, 131075);
  REQUIRE(stops_hosting(c));
  CHECK_THAT(one<cmd::StopHosting>(c).why, Catch::Contains("runs a newer round (epoch 131075, this node's 5)"));
  const auto stop_at = std::ranges::find_if(c, [](const auto& x) { return std::holds_alternative<cmd::StopHosting>(x); });
  const auto join_at = std::ranges::find_if(c, [](const auto& x) {
    return std::holds_alternative<cmd::Send>(x) && proto::type_of(std::get<cmd::Send>(x).frame) == MsgType::kJoin;
  });
  CHECK(stop_at < join_at);
  CHECK(sent_of<proto::Join>(c).resume_round == 0);
  CHECK_FALSE(l.m.seeking());
  auto a = round_of(2, 3, 2);
  a.epoch = 131076;
  CHECK(told_one<proto::Assignment>(l.receive(a)).epoch == 131076);
  // A stale fire of the seek's timer does nothing now.
  CHECK(l.m.timer_fired(ClientTimer::kTakeover, l.m.generation(ClientTimer::kTakeover) - 1, l.now).empty());
}

TEST_CASE("client machine: a host whose round opens within the grace, or that runs a round, never looks elsewhere") {
  Link l(host_options());
  host_waits(l);
  const auto gen_before = l.m.generation(ClientTimer::kTakeover);
  l.m.host_short_of_majority(l.now);
  const auto gen = l.m.generation(ClientTimer::kTakeover);
  CHECK(gen != gen_before);
  // The dropped nodes came back: the round opens at home.
  auto a = round_of(0, 3, 1);
  a.epoch = 6;
  l.receive(a);
  l.now += 300ms;
  CHECK_FALSE(has<cmd::Connect>(l.m.timer_fired(ClientTimer::kTakeover, gen, l.now)));
  CHECK_FALSE(l.m.seeking());
  // Running a round: the server's word is ignored.
  CHECK(l.m.host_short_of_majority(l.now).empty());
}

TEST_CASE("client machine: a host waiting for its next round asks every K whether its server hears a majority, so a "
          "shortfall heard before its Restart is not missed") {
  // Review s37 M: the server's shortfall (a node lost) came while this node's link had not
  // read its Restart yet: ignored (a round still runs here). With --nnodes=2:3 below the
  // minimum no last call and so no "no quorum" event follows: before, nothing asked again
  // and the host waited out join_timeout (exit 3) while the others ran a round.
  Link l(host_options());
  l.m.start(l.now);
  welcome_from(l, "host-127.0.0.1", 0, 0);
  auto a = round_of(0);
  a.epoch = 5;
  l.receive(a);
  CHECK(l.m.host_short_of_majority(l.now).empty());  // too early: the round runs here
  l.receive(proto::Restart{1, "node 127.0.0.2 lost"});
  auto c = l.m.rejoin(l.now);
  CHECK(armed(c, ClientTimer::kMajority) == l.now + 100ms);  // K
  // K later the link asks; the agent's server hears no majority: the seek's grace is armed.
  c = l.after(100ms, ClientTimer::kMajority);
  CHECK(has<cmd::AskMajority>(c));
  CHECK(armed(c, ClientTimer::kMajority) == l.now + 100ms);  // and again every K
  c = l.m.host_short_of_majority(l.now);
  CHECK(armed(c, ClientTimer::kTakeover) == l.now + 300ms);
  // A seek under way: no more asking.
  CHECK_FALSE(has<cmd::AskMajority>(l.after(100ms, ClientTimer::kMajority)));

  // A host whose round opens again asks no more.
  Link r(host_options());
  host_waits(r);
  CHECK(has<cmd::AskMajority>(r.after(100ms, ClientTimer::kMajority)));
  a = round_of(0, 3, 1);
  a.epoch = 6;
  r.receive(a);
  c = r.after(100ms, ClientTimer::kMajority);
  CHECK_FALSE(has<cmd::AskMajority>(c));
  CHECK_FALSE(armed(c, ClientTimer::kMajority));
}

TEST_CASE("client machine: two hosts without a majority meet: the one whose job's epoch is higher leaves for the "
          "other, which stays") {
  // The old host (epoch 5 at home) finds a node that took the round over alone (its job's
  // epoch in its own block, no round): it stays.
  Link old_host(host_options());
  host_waits(old_host);
  old_host.m.host_short_of_majority(old_host.now);
  auto c = old_host.after(300ms, ClientTimer::kTakeover);
  REQUIRE(one<cmd::Connect>(c).host == "127.0.0.2");
  c = welcome_from(old_host, "host-127.0.0.2", 0, 131074);
  CHECK_FALSE(stops_hosting(c));
  CHECK(one<cmd::Connect>(c).host == "127.0.0.3");

  // Node 2 of that round, cut off from both, took it over alone: its job's epoch is above
  // the old host's. Its targets: the old host (the endpoint), node 1's takeover port; it
  // finds the old host waiting too, leading the same last round (epoch 5), which precedes
  // it: it leaves for it.
  Link taker(options("127.0.0.3"));
  taker_seeks(taker, 5);
  c = welcome_from(taker, "host-127.0.0.1", 0, 5, 5);
  REQUIRE(stops_hosting(c));
  CHECK_THAT(one<cmd::StopHosting>(c).why,
             Catch::Contains("without a majority too and precedes this node (epoch 5 below 131074)"));
  CHECK(sent_of<proto::Join>(c).resume_round == 0);
  // Nor its vote port: that was its server's, destroyed now (review s41-b M1; main: 7003).
  CHECK(sent_of<proto::Join>(c).vote_port == 0);
  CHECK(sent_of<proto::Join>(c).takeover_port == 0);
  // Its join names its epoch's voters (a host whose last round is older counts them too).
  CHECK(sent_of<proto::Join>(c).voters == std::vector<std::string>{"agent-127.0.0.1", "agent-127.0.0.2", "agent-127.0.0.3"});
}

TEST_CASE("client machine: a join carries the voters of this node's epoch, but one sent before the welcome leaves a "
          "list too long for the handshake's frame out") {
  for (const std::size_t n : {std::size_t{3}, std::size_t{200}}) {
    INFO(n << " voters");
    Link l(options());
    l.m.start(l.now);
    welcome_from(l, "host-127.0.0.1", 0, 0);  // an agent hosts: its loss is taken over
    auto a = round_of(2);
    a.epoch = 5;
    for (std::size_t i = 0; i < n; ++i) a.voters.push_back("agent-" + std::string(40, 'x') + std::to_string(i));
    l.receive(a);
    l.now += 1s;
    auto c = l.m.connection_closed("no answer for 400 ms", l.now);
    REQUIRE(one<cmd::Connect>(c).host == "127.0.0.2");
    c = l.m.connected(kNonce, l.now);  // no token: the join rides with the hello, before the welcome
    const auto j = sent_of<proto::Join>(c);
    CHECK(j.epoch == 5);
    if (n == 3) CHECK(j.voters == a.voters);
    else CHECK(j.voters.empty());  // 200 x 47 bytes: past the 4,096 a server reads before its welcome
  }
}

TEST_CASE("client machine: a host without a majority never leaves for a host whose last round is another: one cut off "
          "epochs ago counts its own stale voters") {
  // Review s36 H1: round 5 ran {0,1,2}; node 0 was cut off and waits alone since (its job at
  // epoch 5, no round); the job went on without it to epoch 131077 (a takeover, a scale-up
  // to six nodes, a restart). Now this node, which took that round over, has no majority of
  // its voters and finds node 0: its job's epoch is below this host's, but its last round
  // is epoch 5, not this node's 131077. Left for, it would count this node's vote (and the
  // next node's) among its stale voters {0,1,2} and open a round beside the majority's.
  constexpr int kT3 = 131077;
  Link taker(options("127.0.0.3"));
  taker_seeks(taker, kT3);
  auto c = welcome_from(taker, "host-127.0.0.1", 0, 5, 5);
  CHECK_FALSE(stops_hosting(c));
  CHECK(sent(c) == std::vector<MsgType>{MsgType::kHello});  // no join there
  CHECK(one<cmd::Connect>(c).host == "127.0.0.2");            // the next target
  CHECK(taker.m.seeking());
  // A server before this field names no last round (0): never a peer either.
  c = welcome_from(taker, "host-127.0.0.2", 0, 5);
  CHECK_FALSE(stops_hosting(c));
  CHECK(one<cmd::Connect>(c).port == 7003);  // home
  // The old host that leads this node's last round is one (the case above).
}

TEST_CASE("client machine: of two hosts without a majority whose last rounds differ, the one whose last round is "
          "older leaves for the other, which stays") {
  // Review s37 H1': round 5 ran {0..4}, node 0 hosting. A cut {0,1} | {2,3,4}: node 2 took
  // over and opened round T1 on {2,3,4}; then node 4 died, so node 2's restart counts 2 of 3
  // of T1's voters but 2 of 5 of round 5's: short too. After the heal node 0 (last round 5)
  // and node 2 (last round T1) meet. Before, neither left for the other (the rule asked for
  // the same last round) and both ended with exit 3, though {0,1,2,3} is a majority at node
  // 2's server (of T1's voters {2,3,4}: 2 of 3; of round 5's {0..4}: 4 of 5).
  const int kT1 = takeover_epoch(5, 2);
  Link old_host(host_options());
  host_waits(old_host);
  old_host.m.host_short_of_majority(old_host.now);
  auto c = old_host.after(300ms, ClientTimer::kTakeover);
  REQUIRE(one<cmd::Connect>(c).host == "127.0.0.2");
  c = old_host.after(100ms, ClientTimer::kTakeover);  // node 1: silent (it waits at home)
  REQUIRE(one<cmd::Connect>(c).host == "127.0.0.3");
  // Node 2's server runs no round, its job at T1's epoch, its last round T1 (newer than 5):
  // node 0 stops hosting and joins it there.
  c = welcome_from(old_host, "host-127.0.0.3", 0, kT1, kT1);
  REQUIRE(stops_hosting(c));
  CHECK_THAT(one<cmd::StopHosting>(c).why,
             Catch::Contains("leads a newer last round (epoch " + std::to_string(kT1) + ", this node's 5)"));
  CHECK(sent_of<proto::Join>(c).resume_round == 0);
  CHECK_FALSE(old_host.m.seeking());

  // The converse: node 2 (last round T1) finds node 0 (last round 5, its job's epoch below
  // node 2's): an older last round is never left for, whatever the job's epoch.
  Link taker(options("127.0.0.3"));
  taker_seeks(taker, kT1);
  c = welcome_from(taker, "host-127.0.0.1", 0, 5, 5);
  CHECK_FALSE(stops_hosting(c));
  CHECK(sent(c) == std::vector<MsgType>{MsgType::kHello});
  CHECK(taker.m.seeking());
  // And a server of the same last round that does not precede it (job's epoch above home's):
  // not left for either, so exactly one of two leaves.
  REQUIRE(one<cmd::Connect>(c).host == "127.0.0.2");
  c = welcome_from(taker, "host-127.0.0.2", 0, takeover_epoch(kT1, 2) + 5, kT1);
  CHECK_FALSE(stops_hosting(c));
  CHECK(taker.m.seeking());
}

TEST_CASE("client machine: a host that finds no newer round within join_timeout of the shortfall ends, exit 3") {
  Link l(host_options());
  host_waits(l);
  const auto short_at = l.now;
  l.m.host_short_of_majority(l.now);
  auto c = l.after(300ms, ClientTimer::kTakeover);
  int fires = 0;
  while (told<proto::Abort>(c).empty() && fires++ < 200) {
    CHECK_FALSE(stops_hosting(c));
    c = l.after(100ms, ClientTimer::kTakeover);  // silent, or home where nothing opens
  }
  const auto a = told_one<proto::Abort>(c);
  CHECK(l.now <= short_at + 5s + 200ms);
  CHECK(a.root_cause.exit_code == kHostLostExitCode);
  CHECK_THAT(a.reason, Catch::Contains("no majority of the job's voters on this side within join_timeout (5 s)"));
  CHECK(l.m.closed());

  // Its own server ended the job (its join_timeout) while this node looked elsewhere: back
  // home, its join is refused; that ends it with the same root cause, not as a refusal.
  Link h(host_options());
  host_waits(h);
  h.m.host_short_of_majority(h.now);
  h.after(300ms, ClientTimer::kTakeover);
  h.after(100ms, ClientTimer::kTakeover);
  c = h.after(100ms, ClientTimer::kTakeover);
  REQUIRE(one<cmd::Connect>(c).port == kRdzvPort);  // home
  welcome_from(h, "host-127.0.0.1", 0, 5);
  c = h.receive(proto::Error{"job 'job' has already finished; use a new --rdzv_id"});
  CHECK(all<cmd::Lost>(c).empty());
  CHECK_THAT(told_one<proto::Abort>(c).reason,
             Catch::Contains("no majority of the job's voters on this side within join_timeout (5 s)") &&
                 Catch::Contains("its own server: job 'job' has already finished"));
  CHECK(h.m.closed());
}

TEST_CASE("client machine: a seeking host takes a server of another run of the job id (its welcome names that run) "
          "for one with no newer round, whatever its epochs (review s38 L4)") {
  const std::string run = "1700000000000-00000000000000ab", other = "1800000000000-00000000000000cd";
  Link l(host_options());
  host_waits(l, run);
  l.m.host_short_of_majority(l.now);
  REQUIRE(one<cmd::Connect>(l.after(300ms, ClientTimer::kTakeover)).host == "127.0.0.2");
  // Epoch 9 of another run: before, "a newer round", and this host left its job for it.
  auto c = welcome_from(l, "host-127.0.0.2", 9, 9, 9, other);
  CHECK_FALSE(stops_hosting(c));
  CHECK(one<cmd::Connect>(c).host == "127.0.0.3");
  // The same welcome of this job's run is a newer round, as before.
  c = welcome_from(l, "host-127.0.0.3", 9, 9, 9, run);
  CHECK(stops_hosting(c));
}

// Review s38-late M1: a node that waits to rejoin after a takeover found no host tries the
// endpoint first. Its agent was started again there and hosts a fresh run: joined with this
// node's run and epoch, it refused the node (Job::join_of_other_run) and the node ended,
// never trying its next target, where its run may be hosted.
namespace {
const std::string kRunOld = "1700000000000-00000000000000aa";
const std::string kRunNew = "1700000099000-00000000000000bb";

ClientCommands welcome_run(Link& l, const std::string& host_agent, const std::string& run) {
  auto c = l.m.connected(kNonce, l.now);
  proto::Welcome w{"srv", host_agent};
  w.run = run;
  auto more = l.receive(w);
  c.insert(c.end(), more.begin(), more.end());
  return c;
}

// Node 2 (127.0.0.3) of round_of's round, epoch 5 of kRunOld (or a standby told that round):
// its host's connection reset; its takeover search connects to node 1 (127.0.0.2) first.
void taking_over(Link& l, bool standby = false) {
  l.m.start(l.now);
  welcome_run(l, "host-a", kRunOld);
  if (standby) {
    proto::Standby s;
    s.active_nodes = 3;
    s.round = 1;
    s.nodes = {"127.0.0.1", "127.0.0.2", "127.0.0.3"};
    s.takeover_ports = {0, 7002, 7003};
    s.epoch = 5;
    s.run = kRunOld;
    l.receive(s);
  } else {
    proto::Assignment a = round_of(2);
    a.epoch = 5;
    a.run = kRunOld;
    l.receive(a);
  }
  auto c = l.m.connection_closed(std::strerror(ECONNRESET), l.now, /*reset=*/true);
  REQUIRE(one<cmd::Connect>(c).host == "127.0.0.2");
  if (!standby) l.m.rejoin(l.now);
}

// taking_over(), then node 1 refusing to the search's deadline: it waits to rejoin,
// connecting to the host (127.0.0.1, the endpoint) first.
ClientCommands rejoining(Link& l, bool standby = false) {
  taking_over(l, standby);
  ClientCommands c;
  for (int i = 0; i < 3; ++i) {
    l.m.connect_failed(true, "Connection refused", l.now);
    c = l.after(100ms, ClientTimer::kTakeover);
  }
  REQUIRE_THAT(notices(c), Catch::Contains("it waits to rejoin the job"));
  REQUIRE(one<cmd::Connect>(c).host == "127.0.0.1");
  return c;
}

bool sent_join(const ClientCommands& c) {
  const auto s = sent(c);
  return std::find(s.begin(), s.end(), MsgType::kJoin) != s.end();
}
}  // namespace

TEST_CASE("client machine: a node waiting to rejoin passes over a server of another run and joins the next target, "
          "which serves its run, with its run and epoch (review s38-late M1)") {
  Link l(options("127.0.0.3"));
  rejoining(l);
  // The endpoint's agent, started again, hosts a fresh run: no join there (main: the join
  // rode with the hello, was refused and the node ended), the next target at once.
  auto c = welcome_run(l, "host-a", kRunNew);
  CHECK_FALSE(sent_join(c));
  CHECK(has<cmd::Drop>(c));
  CHECK(one<cmd::Connect>(c).host == "127.0.0.2");
  CHECK_FALSE(l.m.closed());
  CHECK(l.m.searching());
  // Node 1 took the job over meanwhile: its server names this node's run.
  c = welcome_run(l, "host-127.0.0.2", kRunOld);
  CHECK_THAT(notices(c), Catch::Contains("reached the job again"));
  const auto j = sent_of<proto::Join>(c);
  CHECK(j.run == kRunOld);
  CHECK(j.epoch == 5);
  CHECK(j.resume_round == 0);
  CHECK_FALSE(l.m.searching());
  // An agent's server with no job yet (its own join, which mints a run, to come) is passed over too.
  Link e(options("127.0.0.3"));
  rejoining(e);
  c = welcome_run(e, "host-a", "");
  CHECK_FALSE(sent_join(c));
  CHECK(one<cmd::Connect>(c).host == "127.0.0.2");
}

// Review s39 H1: the fresh join needs a pass in which every target proved that it hosts no
// round of this node's run: a Welcome of another run (or none), a takeover socket's proven
// NotHosting of another run (or none). A refused connect (a REJECT firewall refuses too), a
// silent target and a NotHosting of this node's own run (a live node of the run) prove
// nothing: before, each counted as "not hosted", and a node cut off from the majority joined
// the restarted endpoint's fresh run beside it (a fork).
namespace {
ClientCommands not_hosting_from(Link& l, const std::string& run) {
  auto c = l.m.connected(kNonce, l.now);
  auto more = l.receive(proto::NotHosting{"job", run, "host-x", ""});
  c.insert(c.end(), more.begin(), more.end());
  return c;
}
}  // namespace

TEST_CASE("client machine: a node waiting to rejoin whose run no target serves (each proved it hosts another run or "
          "none) joins the other run afresh, without its run, epoch, group rank and old round (review s39 H1, L2)") {
  for (const std::string& other : {kRunNew, std::string()}) {
    Link l(options("127.0.0.3"));
    rejoining(l);
    auto c = welcome_run(l, "host-a", kRunNew);
    REQUIRE(one<cmd::Connect>(c).host == "127.0.0.2");
    // Node 1: its agent's takeover socket, alive, not hosting, in another run (or none yet).
    c = not_hosting_from(l, other);
    // The pass is over (the endpoint, node 1): the endpoint again, to be joined afresh.
    CHECK(told<proto::Abort>(c).empty());
    REQUIRE(one<cmd::Connect>(c).host == "127.0.0.1");
    c = welcome_run(l, "host-a", kRunNew);
    CHECK_THAT(notices(c), Catch::Contains("run " + kRunOld + " of job 'job' runs at none of its hosts this node can "
                                           "reach, and host-a at " + kServer + " serves another run of the job id"));
    CHECK_THAT(notices(c), !Catch::Contains("reached the job again"));
    const auto j = sent_of<proto::Join>(c);
    CHECK(j.run.empty());
    CHECK(j.epoch == 0);
    CHECK(j.last_group_rank == -1);
    CHECK(j.resume_round == 0);
    CHECK_FALSE(j.resume_standby);
    CHECK_FALSE(l.m.searching());
    // L2: the new server lost before its first assignment: no takeover of the old run's
    // round (before: a Restart naming its survivors, and node 1 tried as a candidate).
    c = l.m.connection_closed(std::strerror(ECONNRESET), l.now, /*reset=*/true);
    CHECK(told<proto::Restart>(c).empty());
    CHECK_FALSE(has<cmd::HostTakeover>(c));
    if (has<cmd::Connect>(c)) CHECK(one<cmd::Connect>(c).host != "127.0.0.2");
  }
  // And it runs the fresh run's rounds.
  Link l(options("127.0.0.3"));
  rejoining(l);
  auto c = welcome_run(l, "host-a", kRunNew);
  not_hosting_from(l, kRunNew);
  welcome_run(l, "host-a", kRunNew);
  proto::Assignment a = round_of(1);
  a.epoch = 1;
  a.run = kRunNew;
  c = l.receive(a);
  CHECK(told_one<proto::Assignment>(c).run == kRunNew);
  CHECK(l.m.job_over() == false);
}

TEST_CASE("client machine: a node waiting to rejoin that found another run while a target refuses, is silent or is a "
          "live node of its own run that hosts nothing never joins afresh, and ends at the rejoin deadline (review s39 H1)") {
  enum class Node1 { kRefuses, kSilent, kOwnRun };
  for (const Node1 node1 : {Node1::kRefuses, Node1::kSilent, Node1::kOwnRun}) {
    CAPTURE(static_cast<int>(node1));
    Link l(options("127.0.0.3"));
    const auto lost_at = l.now;
    auto c = rejoining(l);
    int fires = 0;
    bool ended = false;
    // Each pass: the endpoint names another run, node 1 does not prove its run is not there.
    while (!ended && fires++ < 200) {
      if (has<cmd::Connect>(c) && one<cmd::Connect>(c).host == "127.0.0.1") {
        c = welcome_run(l, "host-a", kRunNew);
        CHECK_FALSE(sent_join(c));
      } else if (has<cmd::Connect>(c) && one<cmd::Connect>(c).host == "127.0.0.2") {
        if (node1 == Node1::kRefuses) l.m.connect_failed(true, "Connection refused", l.now);
        if (node1 == Node1::kOwnRun) not_hosting_from(l, kRunOld);
        c = l.after(100ms, ClientTimer::kTakeover);
      } else {
        c = l.after(100ms, ClientTimer::kTakeover);
      }
      ended = l.m.closed();
    }
    REQUIRE(ended);
    CHECK(l.now >= lost_at + 5s);
    CHECK_THAT(told_one<proto::Abort>(c).reason, Catch::Contains("no host of the job answered this node within"));
  }
}

TEST_CASE("client machine: a standby waiting to rejoin passes over a server of another run and joins it afresh, as a "
          "plain newcomer, only when every target proved its run is not there (review s38-late M1, s39 H1)") {
  for (const bool proven : {true, false}) {
    Link l(options("127.0.0.4"));
    rejoining(l, /*standby=*/true);
    auto c = welcome_run(l, "host-a", kRunNew);
    CHECK_FALSE(sent_join(c));
    // Its targets: the endpoint, node 1, node 2: alive, not hosting, of no run (or refusing).
    for (const char* next : {"127.0.0.2", "127.0.0.3"}) {
      REQUIRE(one<cmd::Connect>(c).host == next);
      if (proven) {
        c = not_hosting_from(l, "");
      } else {
        l.m.connect_failed(true, "Connection refused", l.now);
        c = l.after(100ms, ClientTimer::kTakeover);
      }
    }
    REQUIRE(one<cmd::Connect>(c).host == "127.0.0.1");
    c = welcome_run(l, "host-a", kRunNew);
    if (!proven) {
      CHECK_FALSE(sent_join(c));
      CHECK(one<cmd::Connect>(c).host == "127.0.0.2");
      continue;
    }
    const auto j = sent_of<proto::Join>(c);
    CHECK_FALSE(j.resume_standby);
    CHECK(j.run.empty());
    CHECK(j.epoch == 0);
  }
}

// Review s39 M1: a server before Welcome's run (an older build's taker) sends no run; one whose
// job ran rounds is the job's, as the recall takes it. Passed over, a new node could take the
// job over beside it (two takers of one run). "Ran rounds" is the recall's reading too, any of
// the Welcome's epochs above 0 (review s39-late L4: the takeover read epoch and last round,
// the recall round and last round, so a Welcome with only round_epoch was passed over here).
TEST_CASE("client machine: in the takeover search an older server's welcome without a run whose job ran rounds (any "
          "of its epochs above 0) is the job's and is joined, while a new agent's server with no job yet is passed "
          "over (review s39 M1, s39-late L4)") {
  struct Epochs {
    int round_epoch, epoch, last_round_epoch;
  };
  for (const Epochs e : {Epochs{7, 0, 0}, Epochs{0, 7, 0}, Epochs{0, 0, 7}, Epochs{7, 7, 7}, Epochs{0, 0, 0}}) {
    CAPTURE(e.round_epoch, e.epoch, e.last_round_epoch);
    Link l(options("127.0.0.3"));
    taking_over(l);
    auto c = l.m.connected(kNonce, l.now);
    proto::Welcome w{"srv", "host-127.0.0.2"};
    w.round_epoch = e.round_epoch;
    w.epoch = e.epoch;
    w.last_round_epoch = e.last_round_epoch;
    auto more = l.receive(w);
    c.insert(c.end(), more.begin(), more.end());
    if (e.epoch + e.round_epoch + e.last_round_epoch == 0) {
      CHECK_FALSE(sent_join(c));
      CHECK(has<cmd::HostTakeover>(c));  // the next candidate: this node
      continue;
    }
    const auto j = sent_of<proto::Join>(c);  // main, round_epoch alone: passed over, this node hosted
    CHECK(j.run == kRunOld);
    CHECK(j.epoch == 5);
    CHECK_FALSE(l.m.searching());
  }
}

// Review s39-late L4: waiting to rejoin, such a server was joined as "the job's" too, though it
// may be the endpoint's agent started again, running another run (an older build cannot say):
// that bypassed the rule that a rejoining node joins afresh only after a pass in which every
// target proved that it hosts none of its run. It proves nothing now: neither joined nor proof.
TEST_CASE("client machine: a node waiting to rejoin neither joins an older server's welcome without a run whose job ran "
          "rounds nor counts it as proof that its run is gone, and ends at the rejoin deadline naming it (review "
          "s39-late L4)") {
  Link l(options("127.0.0.3"));
  auto c = rejoining(l);
  bool joined = false;
  int fires = 0;
  while (!l.m.closed() && fires++ < 200) {
    if (has<cmd::Connect>(c) && one<cmd::Connect>(c).host == "127.0.0.1") {
      // The endpoint: an older build's agent whose job ran rounds (this run's host, or one
      // started again that runs another).
      l.now += 100ms;
      c = l.m.connected(kNonce, l.now);
      proto::Welcome w{"srv", "host-a"};
      w.epoch = w.last_round_epoch = 7;
      auto more = l.receive(w);
      c.insert(c.end(), more.begin(), more.end());
      joined = joined || sent_join(c);  // main: joined at once, "reached the job again"
    } else if (has<cmd::Connect>(c) && one<cmd::Connect>(c).host == "127.0.0.2") {
      l.now += 100ms;
      c = welcome_run(l, "host-127.0.0.2", kRunNew);  // proven: another run (a fresh join's place)
      joined = joined || sent_join(c);
    } else {
      c = l.after(100ms, ClientTimer::kTakeover);
    }
  }
  CHECK_FALSE(joined);
  REQUIRE(l.m.closed());
  const auto reason = told_one<proto::Abort>(c).reason;
  CHECK_THAT(reason, Catch::Contains("no host of the job answered this node within"));
  CHECK_THAT(reason, Catch::Contains("the server at " + kServer + " is an older mglaunch"));
}
