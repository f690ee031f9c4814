// ClientMachine's Recall (rendezvous/client_machine.h, #34 H1), driven with a fake clock: an
// agent restarted with a record of its job looks for the job at the record's hosts before
// it hosts a fresh one or joins the endpoint, and job_hosts(), what such a record names.
#include <memory>
#include <utility>
#include <vector>

#include <catch2/catch.hpp>

#include "rendezvous/client_machine.h"
#include "support/fake_clock.h"

using namespace mg;
using namespace mg::rdzv;
using namespace mgtest::rdzv;  // the fake clock's link and its command filters
using namespace std::chrono_literals;
using proto::MsgType;

namespace {

const std::string kRun = "1764500000000-0123456789abcdef";
using Hosts = std::vector<std::pair<std::string, int>>;
// The record of node 127.0.0.1, which hosted the job at the endpoint: the endpoint, then
// the takeover sockets of the round's other nodes.
const Hosts kRecorded{{"127.0.0.1", kRdzvPort}, {"127.0.0.2", 7002}, {"127.0.0.3", 7003}};

ClientOptions restarted() {
  ClientOptions o;
  o.host = "127.0.0.1";
  o.port = kRdzvPort;
  o.join.job_id = "job";
  o.join.agent_id = "agent-new";
  o.join.host = "host-1";
  o.join.addr = "127.0.0.1";
  o.join.min_nodes = 1;
  o.join.max_nodes = 3;
  o.join.max_restarts = 3;
  o.join.keep_alive_ms = 100;
  o.join.keep_alive_max_attempt = 3;
  o.join.join_timeout_ms = 5000;
  o.join.takeover_port = 7001;
  return o;
}

proto::Welcome welcome_of(const std::string& host_agent, const std::string& run) {
  proto::Welcome w{"srv", host_agent};
  w.run = run;
  w.round_epoch = w.epoch = w.last_round_epoch = 131074;
  return w;
}

// Round 1 of the job on `nodes` (group rank 1 this node), with their takeover ports.
proto::Assignment round_on(std::vector<std::string> nodes, std::vector<int> takeover_ports) {
  proto::Assignment a;
  a.round = 1;
  a.group_rank = 1;
  a.group_world_size = a.world_size = static_cast<int>(nodes.size());
  a.master_addr = "127.0.0.1";
  a.master_port = 40000;
  a.nodes = std::move(nodes);
  a.takeover_ports = std::move(takeover_ports);
  a.epoch = 1;
  a.run = kRun;
  return a;
}

std::vector<MsgType> sent(const ClientCommands& cs) {
  std::vector<MsgType> out;
  for (const auto& s : all<cmd::Send>(cs)) out.push_back(proto::type_of(s.frame));
  return out;
}
std::string notices(const ClientCommands& cs) {
  std::string out;
  for (const auto& n : all<cmd::Notice>(cs)) out += n.text + "\n";
  return out;
}
std::pair<std::string, int> connect_of(const ClientCommands& cs) {
  const auto c = all<cmd::Connect>(cs);
  REQUIRE(c.size() == 1);
  return {c.front().host, c.front().port};
}

}  // namespace

TEST_CASE("client machine, recall: a restarted agent tries its record's hosts in turn (a refusal: the next at once) "
          "and joins the first that runs the record's run, as a new member, with one line") {
  Link l(restarted());
  l.m.recall(kRecorded, kRun, T0);
  auto c = l.m.start(l.now);
  CHECK(connect_of(c) == kRecorded[0]);
  CHECK(armed(c, ClientTimer::kTakeover) == T0 + 100ms);  // a silent one: one keep-alive interval
  CHECK(l.m.recalling());
  // Nothing listens at the endpoint (this node hosted there): the next at once, no retry.
  l.now += 1ms;
  c = l.m.connect_failed(true, "Connection refused", l.now);
  CHECK(connect_of(c) == kRecorded[1]);
  CHECK(!armed(c, ClientTimer::kRetry));
  CHECK(!has<cmd::Lost>(c));
  // Without a token the join would ride with the hello: here it waits for the welcome.
  c = l.m.connected(kNonce, l.now);
  CHECK(sent(c) == std::vector<MsgType>{MsgType::kHello});
  c = l.receive(welcome_of("host-2", kRun));
  CHECK(notices(c) == "job 'job' runs on at 127.0.0.2:7002 (hosted by host-2) since this node's agent last ran (run " +
                          kRun + "); joining it there as a new member\n");
  REQUIRE(sent(c) == std::vector<MsgType>{MsgType::kJoin});
  const auto j = proto::from_frame<proto::Join>(all<cmd::Send>(c).front().frame);
  CHECK(j.resume_round == 0);  // a newcomer: its next round (a scale-up) or a standby
  CHECK(j.takeover_port == 7001);
  CHECK(!has<cmd::RecallEnded>(c));
  CHECK(!l.m.recalling());
  CHECK(l.m.host() == "127.0.0.2");
}

TEST_CASE("client machine, recall: a server of another run, one that proves nothing and one silent for a keep-alive "
          "interval are passed over, and when none runs the run one line says the record is stale, the agent decides to "
          "host, and the endpoint is joined as on any start") {
  Link l(restarted());
  l.m.recall(kRecorded, kRun, T0);
  auto c = l.m.start(l.now);
  // The endpoint: a fresh run of the job answers there (another node started it afresh).
  l.m.connected(kNonce, l.now);
  c = l.receive(welcome_of("host-x", "1764500099999-00000000000000ff"));
  CHECK(connect_of(c) == kRecorded[1]);
  CHECK(sent(c).empty());
  // The second: it closes before any welcome (not a mglaunch server, or another job's).
  l.m.connected(kNonce, l.now);
  c = l.m.connection_closed("end of file", l.now);
  CHECK(!has<cmd::Lost>(c));
  CHECK(connect_of(c) == kRecorded[2]);
  // The third is silent: passed over after one interval; the pass is over, past `until`.
  l.m.connected(kNonce, l.now);
  c = l.after(100ms, ClientTimer::kTakeover);
  CHECK_THAT(notices(c), Catch::Contains("this node's record of job 'job' (run " + kRun + ", from its agent's last run) "
                                         "is stale: no host it names runs that run") &&
                             Catch::Contains("127.0.0.1:" + std::to_string(kRdzvPort) + ": runs another run of the job") &&
                             Catch::Contains("127.0.0.2:7002: closed the connection") &&
                             Catch::Contains("127.0.0.3:7003: no answer"));
  REQUIRE(has<cmd::RecallEnded>(c));
  CHECK(!has<cmd::Connect>(c));  // the agent decides to host first
  CHECK(!l.m.recalling());
  // It hosts now: the endpoint is joined, offering no takeover port.
  c = l.m.recall_ended(/*hosting=*/true, l.now);
  CHECK(connect_of(c) == kRecorded[0]);
  c = l.m.connected(kNonce, l.now);
  REQUIRE(sent(c) == std::vector<MsgType>{MsgType::kHello, MsgType::kJoin});
  CHECK(proto::from_frame<proto::Join>(all<cmd::Send>(c)[1].frame).takeover_port == 0);
}

TEST_CASE("client machine, recall: within its bound a pass of refusals is tried again after a pause (the survivors' "
          "takeover sockets refuse until one of them hosts), and the job found then is joined") {
  Link l(restarted());
  l.m.recall({{"127.0.0.2", 7002}}, kRun, T0 + 1s);
  auto c = l.m.start(l.now);
  c = l.m.connect_failed(true, "Connection refused", l.now);
  CHECK(!has<cmd::Connect>(c));
  CHECK(!has<cmd::RecallEnded>(c));
  CHECK(armed(c, ClientTimer::kTakeover) == T0 + 100ms);  // the pause: min(K, 500 ms)
  c = l.after(100ms, ClientTimer::kTakeover);
  CHECK(connect_of(c) == std::pair<std::string, int>{"127.0.0.2", 7002});
  l.m.connected(kNonce, l.now);
  c = l.receive(welcome_of("host-2", kRun));
  CHECK_THAT(notices(c), Catch::Contains("joining it there as a new member"));
  CHECK(!has<cmd::RecallEnded>(c));
}

TEST_CASE("client machine, recall: past its bound the last pass of refusals ends it as stale, and without a record, or "
          "with an empty one, start() goes to the endpoint as before") {
  Link l(restarted());
  l.m.recall({{"127.0.0.2", 7002}}, kRun, T0 + 150ms);
  l.m.start(l.now);
  l.m.connect_failed(true, "Connection refused", l.now);
  l.after(100ms, ClientTimer::kTakeover);
  l.now += 60ms;
  auto c = l.m.connect_failed(true, "Connection refused", l.now);
  CHECK(has<cmd::RecallEnded>(c));
  c = l.m.recall_ended(/*hosting=*/false, l.now);
  CHECK(connect_of(c) == kRecorded[0]);
  c = l.m.connected(kNonce, l.now);
  CHECK(proto::from_frame<proto::Join>(all<cmd::Send>(c)[1].frame).takeover_port == 7001);  // not hosting: offered

  for (const auto& [hosts, run] : {std::pair{Hosts{}, kRun}, std::pair{kRecorded, std::string()}}) {
    Link fresh(restarted());
    fresh.m.recall(hosts, run, T0 + 10s);
    CHECK(!fresh.m.recalling());
    CHECK(connect_of(fresh.m.start(fresh.now)) == kRecorded[0]);
  }
}

TEST_CASE("client machine: job_hosts(), what a node's record names: the server it is joined to, the job's former "
          "hosts, the last round's nodes that could host but this one, and nothing for a daemon's job") {
  const proto::Assignment a = round_on({"127.0.0.1", "127.0.0.2", "127.0.0.3"}, {0, 7002, 7003});
  {
    ClientOptions o = restarted();
    o.join.addr = "127.0.0.2";
    Link l(o);
    CHECK(l.m.job_hosts().empty());  // nothing heard yet
    l.m.start(l.now);
    l.welcome("host-1");
    l.receive(a);
    CHECK(l.m.job_hosts() == Hosts{{"127.0.0.1", kRdzvPort}, {"127.0.0.3", 7003}});
  }
  {
    Link l(restarted());
    l.m.start(l.now);
    l.welcome("");  // a daemon: found again at its own address
    l.receive(a);
    CHECK(l.m.job_hosts().empty());
  }
}

TEST_CASE("client machine, recall: it ends by join_timeout however far its record's bound lies, and the join_timeout "
          "watchdog counts from its end, not from the start (review M2)") {
  ClientOptions o = restarted();
  o.join.join_timeout_ms = 5000;  // PyTorch's tests pass 5 s
  Link l(o);
  l.m.recall({{"127.0.0.2", 7002}}, kRun, T0 + 1h);  // (a record's bound: K x (2A + 3), or a clock ahead)
  auto c = l.m.start(l.now);
  bool ended = false;
  // Refusals and pauses (at most 100 ms each here) until the recall ends: by join_timeout.
  for (int i = 0; i < 200 && !ended; ++i) {
    c = l.m.connect_failed(true, "Connection refused", l.now);
    ended = has<cmd::RecallEnded>(c);
    if (!ended) c = l.after(100ms, ClientTimer::kTakeover);
    ended = ended || has<cmd::RecallEnded>(c);
  }
  REQUIRE(ended);
  CHECK(l.now <= T0 + 5s + 100ms);
  // It hosts now; the watchdog's join_timeout starts here: no exit 3 just after the recall.
  l.m.recall_ended(/*hosting=*/true, l.now);
  c = l.after(3s, ClientTimer::kWatchdog);
  CHECK(!has<cmd::Lost>(c));
}

TEST_CASE("client machine: job_over(), when a node's record goes: on Done and a final Abort, not on a minority's "
          "Abort (the majority goes on, review H1a), and on its host lost with no survivor able to take over") {
  proto::Assignment a = round_on({"127.0.0.1", "127.0.0.2"}, {0, 7002});
  auto node = [&](int max_restarts, int group_rank = 1) {
    ClientOptions o = restarted();
    o.join.addr = a.nodes[static_cast<std::size_t>(group_rank)];
    a.group_rank = group_rank;
    o.join.max_restarts = max_restarts;
    auto l = std::make_unique<Link>(o);
    l->m.start(l->now);
    l->welcome("host-1");
    l->receive(a);
    return l;
  };
  {
    auto l = node(3);
    CHECK(!l->m.job_over());
    proto::Abort minority{{}, "no majority of job 'job''s 3 voters within join_timeout", /*final=*/false};
    l->receive(minority);
    CHECK(l->m.decided());
    CHECK(!l->m.job_over());
  }
  {
    auto l = node(3);
    l->receive(proto::Abort{{}, "worker failed"});  // (final by default: an older server's too)
    CHECK(l->m.job_over());
  }
  {
    auto l = node(3);
    l->receive(proto::Done{});
    CHECK(l->m.job_over());
  }
  {
    auto l = node(0);  // no restart left: no survivor can take over when the host is lost
    CHECK(l->m.why_no_takeover_of_self() != "");
    auto c = l->m.connection_closed("end of file", l->now);
    CHECK(has<cmd::Tell>(c));  // (an Abort with the lost host as root cause: exit 3)
    CHECK(l->m.job_over());
  }
  // The host (group rank 0, no takeover port) at its own stop: 127.0.0.2 could take over,
  // unless no restart is left.
  CHECK(node(3, 0)->m.why_no_takeover_of_self() == "");
  CHECK_THAT(node(0, 0)->m.why_no_takeover_of_self(), Catch::Contains("no restart left"));
}

TEST_CASE("client machine, recall: a server of the record's run whose newest round is older than the record's epoch (a "
          "stale host of the run) is passed over, and the next, which ran the record's round, is joined (review M3)") {
  Link l(restarted());
  l.m.recall({{"127.0.0.1", kRdzvPort}, {"127.0.0.2", 7002}}, kRun, T0 + 10s, /*epoch=*/131075);
  auto c = l.m.start(l.now);
  l.m.connected(kNonce, l.now);
  c = l.receive(welcome_of("host-1", kRun));  // epochs 131074: the round before the record's
  CHECK(!has<cmd::Send>(c));
  CHECK(connect_of(c) == std::pair<std::string, int>{"127.0.0.2", 7002});
  l.m.connected(kNonce, l.now);
  proto::Welcome w = welcome_of("host-2", kRun);
  w.round_epoch = 131075;
  w.last_round_epoch = 131074;
  c = l.receive(w);
  CHECK_THAT(notices(c), Catch::Contains("joining it there as a new member"));
  CHECK(sent(c) == std::vector<MsgType>{MsgType::kJoin});
}
