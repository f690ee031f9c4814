// ClientMachine's Recall (rendezvous/client_machine.h, #34 H1), driven with a fake clock: an
// agent restarted with a record of its job looks for the job at the record's hosts before
// it hosts a fresh one or joins the endpoint, and job_hosts(), what such a record names.
#include <memory>
#include <utility>
#include <vector>

#include <catch2/catch.hpp>
#include <fmt/format.h>

#include "rendezvous/auth.h"
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

// Node 127.0.0.N (takeover port 7000 + N).
ClientOptions node_at(int n) {
  ClientOptions o = restarted();
  o.join.addr = fmt::format("127.0.0.{}", n);
  o.join.takeover_port = 7000 + n;
  return o;
}
// Node 127.0.0.5 (takeover port 7005), a standby of the job below.
ClientOptions fifth() { return node_at(5); }

// Started and welcomed by an agent's server (a host that takes records).
void welcomed(Link& l) {
  l.m.start(l.now);
  l.welcome("host-1");
}

// A Standby of round `epoch` (the same number as its epoch), told at position 1.
proto::Standby standby_at(int epoch, std::vector<std::string> nodes, std::vector<int> ports,
                          std::vector<std::string> voters, std::vector<std::string> standby_nodes,
                          std::vector<int> standby_ports) {
  proto::Standby s;
  s.position = 1;
  s.round = epoch;
  s.nodes = std::move(nodes);
  s.takeover_ports = std::move(ports);
  s.epoch = epoch;
  s.run = kRun;
  s.voters = std::move(voters);
  s.standby_nodes = std::move(standby_nodes);
  s.standby_takeover_ports = std::move(standby_ports);
  return s;
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
  l.m.recall(kRecorded, kRun, T0 + 1h);
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

TEST_CASE("client machine, recall: when every host of the record answers in one pass that no host of the run is "
          "there (a server of another run, an agent alive in no run or another run), one line says the record is "
          "stale at once, the agent decides to host, and the endpoint is joined as on any start (review s38 M2)") {
  Link l(restarted());
  l.m.recall(kRecorded, kRun, T0 + 1h, 0, "/rec/job-1.json");
  auto c = l.m.start(l.now);
  // The endpoint: a fresh run of the job answers there (another node started it afresh).
  l.m.connected(kNonce, l.now);
  c = l.receive(welcome_of("host-x", "1764500099999-00000000000000ff"));
  CHECK(connect_of(c) == kRecorded[1]);
  CHECK(sent(c).empty());
  // The second: its agent, restarted too, in no run yet.
  l.m.connected(kNonce, l.now);
  c = l.receive(proto::NotHosting{"job", "", "host-2", ""});
  CHECK(!has<cmd::Lost>(c));
  CHECK(connect_of(c) == kRecorded[2]);
  // The third: in another run.
  l.m.connected(kNonce, l.now);
  c = l.receive(proto::NotHosting{"job", "1764500099999-00000000000000ff", "host-3", ""});
  CHECK_THAT(notices(c), Catch::Contains("this node's record of job 'job' (run " + kRun + ", from its agent's last run) "
                                         "is stale: every host it names answered that it runs no host of that run") &&
                             Catch::Contains("127.0.0.1:" + std::to_string(kRdzvPort) + ": runs another run of the job") &&
                             Catch::Contains("127.0.0.2:7002: alive, not hosting, in no run yet") &&
                             Catch::Contains("127.0.0.3:7003: alive, not hosting, in another run"));
  REQUIRE(has<cmd::RecallEnded>(c));
  CHECK(l.now == T0);  // no wait
  CHECK(!has<cmd::Connect>(c));  // the agent decides to host first
  CHECK(!l.m.recalling());
  // It hosts now: the endpoint is joined, offering no takeover port.
  c = l.m.recall_ended(/*hosting=*/true, l.now);
  CHECK(connect_of(c) == kRecorded[0]);
  c = l.m.connected(kNonce, l.now);
  REQUIRE(sent(c) == std::vector<MsgType>{MsgType::kHello, MsgType::kJoin});
  CHECK(proto::from_frame<proto::Join>(all<cmd::Send>(c)[1].frame).takeover_port == 0);
}

TEST_CASE("client machine, recall: silence, refusals, a closed connection, a node of the record's run that does not "
          "host and an unproven answer never make the record stale: it tries again until join_timeout, then ends "
          "(exit 3) naming the record, and never hosts (review s38 H1b)") {
  ClientOptions o = restarted();
  o.token = "a-token-of-the-job";
  Link l(o);
  l.m.recall(kRecorded, kRun, T0 + 1h, 0, "/rec/job-1.json");
  auto c = l.m.start(l.now);
  bool lost = false;
  std::string said;
  for (int pass = 0; pass < 100 && !lost; ++pass) {
    for (int target = 0; target < 3 && !lost; ++target) {
      if (target == 0) {
        c = l.after(100ms, ClientTimer::kTakeover);  // silent for a keep-alive interval
      } else if (target == 1) {
        l.m.connected(kNonce, l.now);
        c = pass % 2 ? l.receive(proto::NotHosting{"job", kRun, "host-2", ""})  // a node of the run
                     : l.m.connection_closed("end of file", l.now);
      } else {
        l.m.connected(kNonce, l.now);
        // "In no run", but without the job's key: anyone could say so.
        c = pass % 2 ? l.receive(proto::NotHosting{"job", "", "host-3", std::string(64, 'a')})
                     : l.m.connect_failed(true, "Connection refused", l.now);
      }
      CHECK(!has<cmd::RecallEnded>(c));
      lost = has<cmd::Lost>(c);
      if (lost) said = all<cmd::Lost>(c).front().why;
    }
    if (!lost) {
      c = l.after(100ms, ClientTimer::kTakeover);  // the pause between passes
      lost = has<cmd::Lost>(c);
      if (lost) said = all<cmd::Lost>(c).front().why;
    }
  }
  REQUIRE(lost);
  CHECK(l.now <= T0 + 5s + 100ms);  // join_timeout
  CHECK_THAT(said, Catch::Contains("this node has a record of job 'job' (run " + kRun + ", /rec/job-1.json)") &&
                       Catch::Contains("does not start it afresh. If the job is over, remove /rec/job-1.json and start "
                                       "again"));
  CHECK(l.m.closed());
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

TEST_CASE("client machine, recall: past `until` a pass of refusals ends the node, not the record, and without a "
          "record, or with an empty one, start() goes to the endpoint as before") {
  Link l(restarted());
  l.m.recall({{"127.0.0.2", 7002}}, kRun, T0 + 150ms);
  l.m.start(l.now);
  l.m.connect_failed(true, "Connection refused", l.now);
  l.after(100ms, ClientTimer::kTakeover);
  l.now += 60ms;
  auto c = l.m.connect_failed(true, "Connection refused", l.now);
  CHECK(!has<cmd::RecallEnded>(c));
  REQUIRE(has<cmd::Lost>(c));
  CHECK_THAT(all<cmd::Lost>(c).front().why, Catch::Contains("127.0.0.2:7002: refused") &&
                                                Catch::Contains("If the job is over, remove that record"));

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
    // The voters' takeover addresses (whose answers count, review s39-late H2): no endpoint.
    CHECK(l.m.job_voter_hosts() == Hosts{{"127.0.0.2", 7002}, {"127.0.0.3", 7003}});
  }
  {
    Link l(restarted());
    l.m.start(l.now);
    l.welcome("");  // a daemon: found again at its own address
    l.receive(a);
    CHECK(l.m.job_hosts().empty());
    CHECK(l.m.job_voter_hosts().empty());
  }
}

TEST_CASE("client machine, recall: it ends by join_timeout however far `until` lies, and after a recall that ended "
          "stale the join_timeout watchdog counts from its end, not from the start (review M2)") {
  ClientOptions o = restarted();
  o.join.join_timeout_ms = 5000;  // PyTorch's tests pass 5 s
  {
    Link l(o);
    l.m.recall({{"127.0.0.2", 7002}}, kRun, T0 + 1h);
    auto c = l.m.start(l.now);
    bool ended = false;
    for (int i = 0; i < 200 && !ended; ++i) {
      c = l.m.connect_failed(true, "Connection refused", l.now);
      if (!has<cmd::Lost>(c)) c = l.after(100ms, ClientTimer::kTakeover);
      ended = has<cmd::Lost>(c);
    }
    REQUIRE(ended);
    CHECK(l.now <= T0 + 5s + 100ms);
  }
  Link l(o);
  l.m.recall({{"127.0.0.2", 7002}}, kRun, T0 + 1h);
  auto c = l.m.start(l.now);
  for (int i = 0; i < 30; ++i) {  // 3 s of refusals: that node's agent is not up again yet
    l.m.connect_failed(true, "Connection refused", l.now);
    l.after(100ms, ClientTimer::kTakeover);
  }
  l.m.connected(kNonce, l.now);
  c = l.receive(proto::NotHosting{"job", "", "host-2", ""});
  REQUIRE(has<cmd::RecallEnded>(c));
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

TEST_CASE("client machine, recall: an answer that no host of the run is there counts only with the job's key proven "
          "(NotHosting's proof over this connection's nonce), and an older server's Welcome without a run that ran "
          "rounds is the job's (review s38 L3)") {
  ClientOptions o = restarted();
  o.token = "a-token-of-the-job";
  const std::string key = auth::job_key(o.token, "job");
  {
    Link l(o);
    l.m.recall({{"127.0.0.2", 7002}}, kRun, T0 + 1h);
    l.m.start(l.now);
    l.m.connected(kNonce, l.now);
    auto c = l.receive(proto::NotHosting{"job", "", "host-2", auth::not_hosting_proof(key, "ff" + kNonce.substr(2), "")});
    CHECK(!has<cmd::RecallEnded>(c));  // a proof over another nonce (a replay)
    c = l.after(100ms, ClientTimer::kTakeover);
    l.m.connected(kNonce, l.now);
    c = l.receive(proto::NotHosting{"job", "", "host-2", auth::not_hosting_proof(key, kNonce, "")});
    CHECK(has<cmd::RecallEnded>(c));
  }
  Link l(restarted());
  l.m.recall({{"127.0.0.2", 7002}}, kRun, T0 + 1h);
  l.m.start(l.now);
  l.m.connected(kNonce, l.now);
  auto c = l.receive(welcome_of("host-2", ""));  // no run, rounds of epoch 131074
  CHECK_THAT(notices(c), Catch::Contains("joining it there as a new member"));
  CHECK(sent(c) == std::vector<MsgType>{MsgType::kJoin});
}

// Review s39-listen L1: a takeover socket that closes a connection before any frame (its
// admission refused: connections, per address, memory; an EMFILE pause) was passed over at
// once, so filling a candidate's share turned "waited for" into "passed over" (a second
// host). A proven "alive, not hosting" in no run (a restarted node that will never host the
// run) was waited for to the search's deadline.
TEST_CASE("client machine, takeover: a candidate's takeover socket that answers 'alive, not hosting' in the job's run, "
          "or closes or resets the connection before any frame, is waited for (as a refused connect was), and one in "
          "another run or in no run is passed over at once (review s39-listen L1)") {
  enum class Answer { kOwnRun, kOtherRun, kNoRun, kEndOfFile, kReset };
  for (const Answer answer : {Answer::kOwnRun, Answer::kOtherRun, Answer::kNoRun, Answer::kEndOfFile, Answer::kReset}) {
    CAPTURE(static_cast<int>(answer));
    ClientOptions o = restarted();
    o.join.addr = "127.0.0.3";
    Link l(o);
    welcomed(l);
    proto::Assignment a = round_on({"127.0.0.1", "127.0.0.2", "127.0.0.3"}, {0, 7002, 7003});
    a.group_rank = 2;
    l.receive(a);
    auto c = l.m.connection_closed("end of file", l.now);  // the host is lost
    CHECK(connect_of(c) == std::pair<std::string, int>{"127.0.0.2", 7002});
    l.m.connected(kNonce, l.now);
    switch (answer) {
      case Answer::kOwnRun: c = l.receive(proto::NotHosting{"job", kRun, "host-2", ""}); break;
      case Answer::kOtherRun: c = l.receive(proto::NotHosting{"job", "1764500099999-00000000000000ff", "host-2", ""}); break;
      case Answer::kNoRun: c = l.receive(proto::NotHosting{"job", "", "host-2", ""}); break;
      case Answer::kEndOfFile: c = l.m.connection_closed("end of file", l.now); break;
      case Answer::kReset: c = l.m.connection_closed("Connection reset by peer", l.now, /*reset=*/true); break;
    }
    if (answer == Answer::kOtherRun || answer == Answer::kNoRun) {
      CHECK(has<cmd::HostTakeover>(c));  // node 2, this one, hosts
      continue;
    }
    CHECK(!has<cmd::HostTakeover>(c));
    CHECK(armed(c, ClientTimer::kRetry));
    c = l.after(100ms, ClientTimer::kRetry);
    CHECK(connect_of(c) == std::pair<std::string, int>{"127.0.0.2", 7002});
    // Its interval ends while it still closes before a word: waited for, to the search's deadline.
    l.m.connected(kNonce, l.now);
    CHECK(!has<cmd::HostTakeover>(l.m.connection_closed("end of file", l.now)));
    c = l.fire(ClientTimer::kTakeover);
    CHECK(!has<cmd::HostTakeover>(c));
    CHECK(armed(c, ClientTimer::kTakeover));
  }
}

namespace {
// The 17-node job of review s39 H1: this node (rank 0) hosted at the endpoint; its record
// names the takeover sockets of ranks 1..16, and the round's 17 voters.
Hosts ranks_1_to_16() {
  Hosts out;
  for (int g = 1; g <= 16; ++g) out.emplace_back(fmt::format("127.0.1.{}", g), 7000 + g);
  return out;
}
constexpr int kRecordEpoch = 131074;
ClientOptions restarted_with_token() {
  ClientOptions o = restarted();
  o.token = "secret";
  return o;
}
}  // namespace

TEST_CASE("client machine, recall: restarted with ranks 1..7 while ranks 8..16 run on (a rack's power lost), the host "
          "does not call its record stale on the 7 that recall the run too: no majority of the 17 voters, then it "
          "joins the run where it runs (review s39 H1)") {
  const std::string key = auth::job_key("secret", "job");
  Link l(restarted_with_token());
  const Hosts hosts = ranks_1_to_16();
  l.m.recall(hosts, kRun, T0 + 1h, kRecordEpoch, "/rec/job-1.json", /*voters=*/17, hosts);
  auto c = l.m.start(l.now);
  for (int pass = 0; pass < 2; ++pass)
    for (int g = 1; g <= 16; ++g) {
      INFO("pass " << pass << ", rank " << g);
      REQUIRE(connect_of(c) == hosts[static_cast<std::size_t>(g - 1)]);
      l.m.connected(kNonce, l.now);
      proto::NotHosting n{"job", kRun, fmt::format("host-{}", g), ""};
      if (g <= 7) {  // restarted too: recalling the run at the record's epoch
        n.recalling = true;
        n.epoch = kRecordEpoch;
        n.proof = auth::not_hosting_proof(key, kNonce, kRun, kRecordEpoch);
      } else {  // a survivor, in the run's round at rank 8's takeover
        n.proof = auth::not_hosting_proof(key, kNonce, kRun);
      }
      c = l.receive(n);
      CHECK(!has<cmd::RecallEnded>(c));
      CHECK(notices(c).find("stale") == std::string::npos);
      if (g == 16) {  // the pass's pause: the next pass
        REQUIRE(armed(c, ClientTimer::kTakeover));
        l.now += 500ms;
        c = l.fire(ClientTimer::kTakeover);
      }
    }
  CHECK(l.m.recalling());
  // Rank 8 hosts the run now (it took over): the next pass finds it, and this node joins.
  REQUIRE(connect_of(c) == hosts[0]);
  c = l.m.connect_failed(true, "Connection refused", l.now);
  for (int g = 2; g <= 8; ++g) {
    REQUIRE(connect_of(c) == hosts[static_cast<std::size_t>(g - 1)]);
    if (g < 8) {
      c = l.m.connect_failed(true, "Connection refused", l.now);
      continue;
    }
    l.m.connected(kNonce, l.now);
  }
  CHECK(!has<cmd::RecallEnded>(c));
}

TEST_CASE("client machine, recall: a whole job rerun at once (every voter recalls the same run at the record's epoch, "
          "none hosts) is stale once a majority of the voters answered so, at once, and one that recalls a newer epoch "
          "(it was in a later round) or names a run unproven does not count (review s39 H1)") {
  const std::string key = auth::job_key("secret", "job");
  Link l(restarted_with_token());
  const Hosts hosts{{"127.0.0.2", 7002}, {"127.0.0.3", 7003}, {"127.0.0.4", 7004}, {"127.0.0.5", 7005}};
  l.m.recall(hosts, kRun, T0 + 1h, kRecordEpoch, "/rec/job-1.json", /*voters=*/5, hosts);
  auto c = l.m.start(l.now);
  auto recalling = [&](int epoch, bool proven) {
    proto::NotHosting n{"job", kRun, "host", ""};
    n.recalling = true;
    n.epoch = epoch;
    n.proof = auth::not_hosting_proof(key, proven ? kNonce : "ff" + kNonce.substr(2), kRun, epoch);
    l.m.connected(kNonce, l.now);
    return l.receive(n);
  };
  c = recalling(kRecordEpoch + 65536, true);  // in a round after this node's last: not counted
  CHECK(!has<cmd::RecallEnded>(c));
  CHECK(connect_of(c) == hosts[1]);
  c = recalling(kRecordEpoch, false);  // unproven: not counted
  CHECK(!has<cmd::RecallEnded>(c));
  CHECK(connect_of(c) == hosts[2]);
  c = recalling(kRecordEpoch, true);  // this node and one more: 2 of 5
  CHECK(!has<cmd::RecallEnded>(c));
  CHECK(connect_of(c) == hosts[3]);
  c = recalling(kRecordEpoch - 1, true);  // 3 of 5: a majority, in no round of the run
  CHECK_THAT(notices(c), Catch::Contains("is stale: a majority of its last round's 5 voters (this node and 2 more) "
                                         "answered that they run no round of that run"));
  REQUIRE(has<cmd::RecallEnded>(c));
  CHECK(l.now == T0);
}

TEST_CASE("client machine, recall: its first pass ends by `until` too, however many hosts are silent, and the end "
          "names the record, not the watchdog's server (review s39 L5)") {
  Link l(restarted());
  l.m.recall(kRecorded, kRun, T0 + 150ms, 0, "/rec/job-1.json");
  auto c = l.m.start(l.now);
  CHECK(armed(c, ClientTimer::kTakeover) == T0 + 100ms);  // a silent one: one keep-alive interval
  c = l.after(100ms, ClientTimer::kTakeover);
  CHECK(armed(c, ClientTimer::kTakeover) == T0 + 150ms);  // (before: T0 + 200ms, past `until`)
  c = l.after(50ms, ClientTimer::kTakeover);
  CHECK(armed(c, ClientTimer::kTakeover) == T0 + 150ms);  // the last: at once
  c = l.fire(ClientTimer::kTakeover);
  REQUIRE(has<cmd::Lost>(c));
  CHECK_THAT(all<cmd::Lost>(c).front().why, Catch::Contains("If the job is over, remove /rec/job-1.json"));
}

TEST_CASE("client machine, recall: a node that took the job over, restarted, is no target of its own recall (its "
          "takeover socket, bound again, answers 'recalling' too): with 3 voters it is not stale after a pass where "
          "it alone said so (review s39-late H1)") {
  Link l(restarted());  // this node: 127.0.0.1, takeover port 7001
  const Hosts hosts{{"127.0.0.1", 7001}, {"127.0.0.2", 7002}, {"127.0.0.3", 7003}};
  l.m.recall(hosts, kRun, T0 + 1h, kRecordEpoch, "/rec/job-1.json", /*voters=*/3, hosts);
  auto c = l.m.start(l.now);
  for (int turn = 0; turn < 3 && has<cmd::Connect>(c); ++turn) {
    const auto at = connect_of(c);
    INFO("turn " << turn << ", " << at.first << ":" << at.second);
    if (at == hosts[0]) {  // itself: recalling the run at the record's epoch
      l.m.connected(kNonce, l.now);
      proto::NotHosting n{"job", kRun, "host-1", ""};
      n.recalling = true;
      n.epoch = kRecordEpoch;
      c = l.receive(n);
    } else if (at == hosts[1]) {  // the other survivor, in the run's round: not hosting it
      l.m.connected(kNonce, l.now);
      c = l.receive(proto::NotHosting{"job", kRun, "host-2", ""});
    } else {  // the third voter: gone
      c = l.m.connect_failed(true, "Connection refused", l.now);
    }
    CHECK(!has<cmd::RecallEnded>(c));
    CHECK(notices(c).find("stale") == std::string::npos);
  }
  CHECK(l.m.recalling());
  CHECK(armed(c, ClientTimer::kTakeover));  // the pause before the next pass
}

TEST_CASE("client machine, recall: an answer from a target that is no voter of the record's epoch (the endpoint "
          "hosting another run) never counts toward the majority, and a voter listed twice counts once: with 5 voters, the "
          "endpoint and one voter are not a majority (review s39-late H2)") {
  Link l(restarted());  // this node: 127.0.0.1, takeover port 7001
  const Hosts voters{{"127.0.0.2", 7002}, {"127.0.0.3", 7003}, {"127.0.0.4", 7004}, {"127.0.0.5", 7005}};
  const Hosts hosts{{"127.0.0.1", kRdzvPort}, voters[0], voters[0], voters[1], voters[2], voters[3]};
  l.m.recall(hosts, kRun, T0 + 1h, kRecordEpoch, "/rec/job-1.json", /*voters=*/5, voters);
  auto c = l.m.start(l.now);
  // The endpoint: the agent there restarted without a record and hosts a fresh run.
  REQUIRE(connect_of(c) == hosts[0]);
  l.m.connected(kNonce, l.now);
  c = l.receive(welcome_of("host-x", "1764500099999-00000000000000ff"));
  CHECK(!has<cmd::RecallEnded>(c));
  // One voter, restarted too (twice in the targets): recalling the run at the record's epoch.
  for (int i = 1; i <= 2; ++i) {
    REQUIRE(connect_of(c) == hosts[static_cast<std::size_t>(i)]);
    l.m.connected(kNonce, l.now);
    proto::NotHosting n{"job", kRun, "host-2", ""};
    n.recalling = true;
    n.epoch = kRecordEpoch;
    c = l.receive(n);
    CHECK(!has<cmd::RecallEnded>(c));
    CHECK(notices(c).find("stale") == std::string::npos);
  }
  // The other voters run on elsewhere, unreachable: no majority in this pass.
  for (std::size_t i = 3; i < hosts.size(); ++i) {
    REQUIRE(connect_of(c) == hosts[i]);
    c = l.m.connect_failed(true, "Connection refused", l.now);
    CHECK(!has<cmd::RecallEnded>(c));
    CHECK(notices(c).find("stale") == std::string::npos);
  }
  CHECK(l.m.recalling());
  // A third voter that answers so in the next pass makes the majority: 3 of 5 with this node.
  REQUIRE(armed(c, ClientTimer::kTakeover));
  l.now += 500ms;
  c = l.fire(ClientTimer::kTakeover);
  for (std::size_t i = 0; i < hosts.size(); ++i) {
    REQUIRE(connect_of(c) == hosts[i]);
    if (i == 0 || i == 3) {
      c = l.m.connect_failed(true, "Connection refused", l.now);
      continue;
    }
    l.m.connected(kNonce, l.now);
    proto::NotHosting n{"job", kRun, "host", ""};
    n.recalling = true;
    n.epoch = kRecordEpoch;
    c = l.receive(n);
    if (i == 4) break;
  }
  CHECK_THAT(notices(c), Catch::Contains("a majority of its last round's 5 voters (this node and 2 more)"));
  CHECK(has<cmd::RecallEnded>(c));
}

// Review s39-late L4: the recall read "ran rounds" from round_epoch and last_round_epoch, the
// takeover search from epoch and last_round_epoch. One reading now (any of the three above 0):
// a server before Welcome's run whose job is at an epoch, between rounds (a build before
// last_round_epoch sends no last round), is the job's here too, not "no round of the job".
TEST_CASE("client machine, recall: an older server's Welcome without a run whose job's epoch alone is above 0 is the "
          "job's, as in the takeover search (review s39-late L4)") {
  Link l(restarted());
  l.m.recall({{"127.0.0.2", 7002}}, kRun, T0 + 1h);
  l.m.start(l.now);
  l.m.connected(kNonce, l.now);
  proto::Welcome w{"srv", "host-2"};
  w.epoch = 131074;  // round_epoch, last_round_epoch 0
  auto c = l.receive(w);
  CHECK_THAT(notices(c), Catch::Contains("joining it there as a new member"));  // main: "runs no round of the job"
  CHECK(sent(c) == std::vector<MsgType>{MsgType::kJoin});
  CHECK_FALSE(has<cmd::RecallEnded>(c));
}

// Review s39-late M2: the record's voters are the Job's voter set of the epoch (the
// Standby's or Assignment's list). Before, a standby counted the round's nodes plus its own
// place among the standbys: 4 here, fewer than the Job's 5 (the standby behind it left out),
// and a majority of too few voters is the unsafe direction. M1: the record names the standby
// voters' takeover sockets too, so that they can answer a whole rerun's recall.
TEST_CASE("client machine: job_voters() of a standby behind another is the Standby's voter list (not its nodes plus "
          "its place), job_voter_hosts() names the standby voters' takeover sockets, and a round that lists no voters "
          "(over 1,024) makes it 0, the every-host rule (review s39-late M1, M2)") {
  const ClientOptions o = fifth();
  Link l(o);
  welcomed(l);
  proto::Standby s;
  s.position = 2;  // one standby ahead of it, one behind
  s.round = 1;
  s.nodes = {"127.0.0.1", "127.0.0.2"};
  s.takeover_ports = {0, 7002};  // (the host offers no takeover)
  s.epoch = 1;
  s.run = kRun;
  s.voters = {"agent-1", "agent-2", "agent-4", "agent-new", "agent-6"};
  s.standby_nodes = {"127.0.0.4", "127.0.0.5", "127.0.0.6"};
  s.standby_takeover_ports = {7004, 7005, 7006};
  l.receive(s);
  CHECK(l.m.job_voters() == 5);
  CHECK(l.m.job_voter_hosts() == Hosts{{"127.0.0.2", 7002}, {"127.0.0.4", 7004}, {"127.0.0.5", 7005}, {"127.0.0.6", 7006}});
  // Where to look: the server, then every voter's takeover socket but its own.
  CHECK(l.m.job_hosts() == Hosts{{"127.0.0.1", kRdzvPort}, {"127.0.0.2", 7002}, {"127.0.0.4", 7004}, {"127.0.0.6", 7006}});
  // Its place comes: a round whose voters are not listed (more than kMaxListedNodes).
  proto::Assignment a = round_on({"127.0.0.1", "127.0.0.5"}, {0, 7005});
  a.round = 2;
  a.epoch = 2;
  l.receive(a);
  CHECK(l.m.job_voters() == 0);
  CHECK(l.m.job_voter_hosts() == Hosts{{"127.0.0.5", 7005}});
}

// Review s39-late H3: welcomed by the run's host, a recalled node is a node of the run. Its
// takeover socket says so from then on (cmd::RecallWelcomed: the agent tells it the run), not
// "recalling the run at epoch e", which another restarted node's recall counts as in no round
// of the run: with 3 voters, that answer and the reader make a majority, and the reader
// would start afresh beside the run that this node joins.
TEST_CASE("client machine, recall: welcomed by the run's host (or an older server of the job), the recall says so "
          "with the run (the agent's takeover socket names it), and a recalling peer never counts that node's answer "
          "toward calling its record stale (review s39-late H3)") {
  for (const std::string& run_in_welcome : {kRun, std::string()}) {
    Link l(restarted());
    l.m.recall({{"127.0.0.2", 7002}}, kRun, T0 + 1h);
    l.m.start(l.now);
    l.m.connected(kNonce, l.now);
    const auto c = l.receive(welcome_of("host-2", run_in_welcome));
    REQUIRE(all<cmd::RecallWelcomed>(c).size() == 1);
    CHECK(all<cmd::RecallWelcomed>(c).front().run == kRun);
    CHECK(!has<cmd::RecallEnded>(c));
  }
  {  // A Welcome of another run: no node of it, nothing said.
    Link l(restarted());
    l.m.recall({{"127.0.0.2", 7002}}, kRun, T0 + 1h);
    l.m.start(l.now);
    l.m.connected(kNonce, l.now);
    CHECK(!has<cmd::RecallWelcomed>(l.receive(welcome_of("host-2", "1764500099999-00000000000000ff"))));
  }
  // Another node restarted with a record of 3 voters reads that node's takeover socket.
  const std::string key = auth::job_key("secret", "job");
  for (const bool recalling : {false, true}) {
    Link l(restarted_with_token());
    const Hosts hosts{{"127.0.0.2", 7002}, {"127.0.0.3", 7003}};
    l.m.recall(hosts, kRun, T0 + 1h, kRecordEpoch, "/rec/job-1.json", /*voters=*/3, hosts);
    l.m.start(l.now);
    l.m.connected(kNonce, l.now);
    proto::NotHosting n{"job", kRun, "host-2", ""};
    n.recalling = recalling;  // after the welcome: false (a node of the run); before: true
    n.epoch = recalling ? kRecordEpoch : 0;
    n.proof = auth::not_hosting_proof(key, kNonce, kRun, recalling ? kRecordEpoch : -1);
    const auto c = l.receive(n);
    CHECK(has<cmd::RecallEnded>(c) == recalling);  // "recalling": 2 of 3, stale; a node of the run: never
  }
}

// Review s40 L1: the record's epoch, voter count and voters' addresses come from one message.
// Before, a Standby of an older epoch with nodes (a host that missed the last round) replaced
// the addresses while the newer voters stayed: epoch 2's count over epoch 1's sockets.
TEST_CASE("client machine: a Standby of an older epoch after a newer one leaves the newer voters' count, addresses "
          "and epoch for the record, as does a first Standby of an older epoch after an Assignment (review s40 L1)") {
  const ClientOptions o = fifth();
  const proto::Standby older = standby_at(1, {"127.0.0.1", "127.0.0.4"}, {0, 7004}, {"agent-1", "agent-4", "agent-new"},
                                          {"127.0.0.5"}, {7005});
  {
    Link l(o);
    welcomed(l);
    l.receive(standby_at(2, {"127.0.0.1", "127.0.0.2", "127.0.0.3"}, {0, 7002, 7003},
                         {"agent-1", "agent-2", "agent-3", "agent-new"}, {"127.0.0.5"}, {7005}));
    l.receive(older);
    CHECK(l.m.job_voters() == 4);
    CHECK(l.m.job_voters_epoch() == 2);
    CHECK(l.m.job_voter_hosts() == Hosts{{"127.0.0.2", 7002}, {"127.0.0.3", 7003}, {"127.0.0.5", 7005}});
  }
  {
    Link l(o);
    welcomed(l);
    proto::Assignment a = round_on({"127.0.0.1", "127.0.0.5", "127.0.0.3"}, {0, 7005, 7003});
    a.epoch = 2;
    a.voters = {"agent-1", "agent-new", "agent-3"};
    l.receive(a);
    l.receive(older);
    CHECK(l.m.job_voters() == 3);
    CHECK(l.m.job_voters_epoch() == 2);
    CHECK(l.m.job_voter_hosts() == Hosts{{"127.0.0.5", 7005}, {"127.0.0.3", 7003}});
  }
}

// Review s40 L3: a host older than standby_nodes lists its standbys among the voters but not
// their addresses; a record of that count would need answers it cannot name.
TEST_CASE("client machine: an Assignment or Standby of more voters than nodes that lists no standby's address (an "
          "older host) makes job_voters() 0, the every-host rule (review s40 L3)") {
  const ClientOptions o = fifth();
  {
    Link l(o);
    welcomed(l);
    l.receive(standby_at(1, {"127.0.0.1", "127.0.0.2"}, {0, 7002}, {"agent-1", "agent-2", "agent-new"}, {}, {}));
    CHECK(l.m.job_voters() == 0);
    l.receive(standby_at(1, {"127.0.0.1", "127.0.0.2"}, {0, 7002}, {"agent-1", "agent-2", "agent-new"},
                         {"127.0.0.5"}, {7005}));
    CHECK(l.m.job_voters() == 3);  // (a newer host: every voter named)
  }
  {
    Link l(o);
    welcomed(l);
    proto::Assignment a = round_on({"127.0.0.1", "127.0.0.5"}, {0, 7005});
    a.voters = {"agent-1", "agent-new", "agent-6"};
    l.receive(a);
    CHECK(l.m.job_voters() == 0);
  }
}

// Review s40-recall M1: the recall counted this node itself toward the majority always. A
// standby that registered after the recorded round closed is no voter of that round, yet with
// 3 voters one positive answer and itself made "2 of 3": it could call a live job's record
// stale and start a fresh run beside it (a fork). Its record says now whether it is a voter.
TEST_CASE("client machine, recall: a standby that registered after the recorded round closed (the Standby's voters "
          "omit this node) does not count itself: one positive of 3 voters does not end its recall, while a voter's "
          "own record with the same answers does (review s40-recall M1)") {
  const ClientOptions o = node_at(4);
  Link told(o);
  welcomed(told);
  proto::Standby s = standby_at(1, {"127.0.0.1", "127.0.0.2", "127.0.0.3"}, {0, 7002, 7003},
                                {"agent-1", "agent-2", "agent-3"}, {}, {});
  told.receive(s);
  CHECK(told.m.job_voters() == 3);
  CHECK_FALSE(told.m.job_self_voter());
  const Hosts voter_hosts = told.m.job_voter_hosts();
  REQUIRE(voter_hosts == Hosts{{"127.0.0.2", 7002}, {"127.0.0.3", 7003}});
  for (const bool self_voter : {false, true}) {
    CAPTURE(self_voter);
    Link l(o);
    l.m.recall(voter_hosts, kRun, T0 + 1h, 1, "/rec/job-1.json", 3, voter_hosts, self_voter);
    auto c = l.m.start(l.now);
    REQUIRE(connect_of(c) == voter_hosts[0]);
    l.m.connected(kNonce, l.now);
    proto::NotHosting n{"job", kRun, "host-2", ""};
    n.recalling = true;  // restarted too, at the record's epoch: in no round of the run since
    n.epoch = 1;
    c = l.receive(n);
    if (self_voter) {  // a voter's own record: itself and that one, 2 of 3
      CHECK_THAT(notices(c), Catch::Contains("a majority of its last round's 3 voters (this node and 1 more)"));
      CHECK(has<cmd::RecallEnded>(c));
      continue;
    }
    CHECK(!has<cmd::RecallEnded>(c));  // main: "this node and 1 more", stale
    REQUIRE(connect_of(c) == voter_hosts[1]);
    c = l.m.connect_failed(true, "Connection refused", l.now);  // the third runs on, cut off from this node
    CHECK(!has<cmd::RecallEnded>(c));
    CHECK(notices(c).find("stale") == std::string::npos);
    CHECK(l.m.recalling());
  }
  // Standing by when a later round closes, it is one of that round's voters.
  told.receive(standby_at(2, s.nodes, s.takeover_ports, {"agent-1", "agent-2", "agent-3", "agent-new"}, {"127.0.0.4"},
                          {7004}));
  CHECK(told.m.job_voters() == 4);
  CHECK(told.m.job_self_voter());
}

// Review s40-recall M1's liveness caveat: the host offered no port (0), so it was never
// countable, and a late standby of a two-voter job ({host, node}) could prove at most 1 of 2.
// The host's vote socket rides in the Assignment apart from the takeover ports.
namespace {
// A round of three, this node (agent-new, 127.0.0.3) rank 2, whose host lists its vote socket
// (127.0.0.1:7101).
proto::Assignment round_with_host_vote() {
  proto::Assignment a = round_on({"127.0.0.1", "127.0.0.2", "127.0.0.3"}, {0, 7002, 7003});
  a.group_rank = 2;
  a.voters = {"agent-1", "agent-2", "agent-new"};
  a.host_vote_addr = "127.0.0.1";
  a.host_vote_port = 7101;
  return a;
}
// record_after()'s fields: what the getters say once the frame is taken, three voters.
void check_ahead(const RecordFields& ahead, const ClientMachine& m) {
  CHECK(ahead.hosts == m.job_hosts());
  CHECK(ahead.voters == 3);
  CHECK(ahead.voters == m.job_voters());
  CHECK(ahead.voters_epoch == m.job_voters_epoch());
  CHECK(ahead.self_voter == m.job_self_voter());
  CHECK(ahead.voter_hosts == m.job_voter_hosts());
  CHECK(ahead.epoch == m.job_epoch());
}
}  // namespace

TEST_CASE("client machine: the host's vote socket in the Assignment is a voter address that a recall counts, and a "
          "lost host is never a takeover candidate through it (review s40-recall M1)") {
  Link l(node_at(3));
  welcomed(l);
  const proto::Assignment a = round_with_host_vote();
  l.receive(a);
  CHECK(l.m.job_voters() == 3);
  CHECK(l.m.job_self_voter());
  const Hosts voter_hosts = l.m.job_voter_hosts();
  CHECK(voter_hosts == Hosts{{"127.0.0.2", 7002}, {"127.0.0.3", 7003}, {"127.0.0.1", 7101}});
  CHECK(l.m.job_hosts() == Hosts{{"127.0.0.1", kRdzvPort}, {"127.0.0.2", 7002}, {"127.0.0.1", 7101}});
  // The host lost: the candidates are node 1, then this node; never the host's vote socket.
  auto c = l.m.connection_closed("end of file", l.now);
  CHECK(connect_of(c) == std::pair<std::string, int>{"127.0.0.2", 7002});
  l.m.connected(kNonce, l.now);
  c = l.receive(proto::NotHosting{"job", "1764500099999-00000000000000ff", "host-2", ""});  // passed over
  CHECK(all<cmd::Connect>(c).empty());
  CHECK(has<cmd::HostTakeover>(c));  // this node, the last candidate
  // Taking over, its next Join offers no takeover port and names its vote socket: its own.
  c = l.m.hosted(TakeoverHost{"127.0.0.3", 7003}, l.now);
  CHECK(connect_of(c) == std::pair<std::string, int>{"127.0.0.3", 7003});
  // A late standby's recall (no voter itself) counts the host's answer: with node 1's, 2 of 3.
  const ClientOptions late = node_at(4);
  for (const bool host_countable : {true, false}) {
    CAPTURE(host_countable);
    Link r(late);
    Hosts counted = voter_hosts;
    if (!host_countable) counted.pop_back();  // an older host: its port 0, never listed
    r.m.recall(voter_hosts, kRun, T0 + 1h, 1, "/rec/job-1.json", 3, counted, /*self_voter=*/false);
    c = r.m.start(r.now);
    for (std::size_t i = 0; i < voter_hosts.size(); ++i) {
      REQUIRE(connect_of(c) == voter_hosts[i]);
      if (i == 1) {
        c = r.m.connect_failed(true, "Connection refused", r.now);
        continue;
      }
      r.m.connected(kNonce, r.now);
      proto::NotHosting n{"job", kRun, "host", ""};
      n.recalling = true;
      n.epoch = 1;
      c = r.receive(n);
    }
    CHECK(has<cmd::RecallEnded>(c) == host_countable);
    if (host_countable)
      CHECK_THAT(notices(c), Catch::Contains("a majority of its last round's 3 voters (2 of them; this node is none)"));
  }
}

TEST_CASE("client machine: record_after(a), what the record names once this node took its Assignment, is what the "
          "getters say after it, and changes nothing before (the host's record written ahead, review s41-a M2)") {
  Link l(node_at(3));
  welcomed(l);
  const proto::Assignment a = round_with_host_vote();
  const RecordFields ahead = l.m.record_after(a);
  CHECK(l.m.job_voters() == 0);  // not taken yet
  CHECK(l.m.job_voter_hosts().empty());
  l.receive(a);
  check_ahead(ahead, l.m);
}

TEST_CASE("client machine: record_after before its client read its own server's Welcome (a tokenless Join goes with "
          "the Hello) names what it would once that Welcome is read, not nothing (review s41-e M1)") {
  const proto::Assignment a = round_with_host_vote();
  Link early(node_at(3));
  early.m.start(early.now);
  early.m.connected(kNonce, early.now);  // Hello and Join sent, no Welcome read
  const RecordFields ahead = early.m.record_after(a);
  CHECK_FALSE(ahead.hosts.empty());  // main: none, and no record written ahead
  Link own(node_at(3));
  own.m.start(own.now);
  own.welcome("agent-new");  // its own server's Welcome: this agent hosts
  own.receive(a);
  check_ahead(ahead, own.m);
  const proto::Standby sb = standby_at(2, {"127.0.0.1", "127.0.0.2", "127.0.0.4"}, {0, 7002, 7004},
                                       {"agent-1", "agent-2", "agent-4"}, {}, {});
  CHECK_FALSE(early.m.record_after(sb).hosts.empty());  // main: none
}

TEST_CASE("client machine: record_after(s), what the record names once this node took its own Standby, is what the "
          "getters say after it, and changes nothing before (the host a standby of its own round, review s41-d M1)") {
  Link l(fifth());
  welcomed(l);
  const proto::Standby s = standby_at(2, {"127.0.0.1", "127.0.0.2", "127.0.0.3"}, {0, 7002, 7003},
                                      {"agent-1", "agent-2", "agent-3"}, {}, {});
  const RecordFields ahead = l.m.record_after(s);
  CHECK(l.m.job_voters() == 0);  // not taken yet
  CHECK(l.m.job_voter_hosts().empty());
  l.receive(s);
  CHECK_FALSE(ahead.hosts.empty());
  check_ahead(ahead, l.m);
}

// Review s41-b L4: a node of round e made a standby by a taker whose seed is e gets the
// taker's Standby before its own round: epoch e, the seed's voters, no nodes. It hid the
// Assignment's addresses (the every-host rule, which never completes once the lost host's
// machine is dead); the Assignment's go with those voters.
TEST_CASE("client machine: a Standby of the voters' own epoch that lists no nodes (a taker's before its round) leaves "
          "the Assignment's count and addresses for the record, not the every-host rule (review s41-b L4)") {
  Link l(fifth());
  welcomed(l);
  proto::Assignment a = round_on({"127.0.0.1", "127.0.0.5", "127.0.0.3"}, {0, 7005, 7003});
  a.epoch = 2;
  a.voters = {"agent-1", "agent-new", "agent-3"};
  l.receive(a);
  l.receive(standby_at(2, {}, {}, a.voters, {}, {}));  // the taker 127.0.0.3's, seed epoch 2
  CHECK(l.m.job_voters() == 3);  // main: 0
  CHECK(l.m.job_voters_epoch() == 2);
  CHECK(l.m.job_voter_hosts() == Hosts{{"127.0.0.5", 7005}, {"127.0.0.3", 7003}});
  CHECK(l.m.job_epoch() == 2);
}

// Review s41-b L6: a Standby of another run that lists no voters left the old run's count and
// addresses acceptable (its epoch, told as the max of two runs', still the voters'), and the
// record named the new run with the old run's voters, whose "in another run" counts.
TEST_CASE("client machine: a Standby or Assignment of another run forgets the old run's voters: no count or address of "
          "it goes with the new run (review s41-b L6)") {
  proto::Assignment a = round_on({"127.0.0.1", "127.0.0.5", "127.0.0.3"}, {0, 7005, 7003});
  a.epoch = 2;
  a.voters = {"agent-1", "agent-new", "agent-3"};
  const std::string other = "1764500099999-00000000000000ff";
  {
    Link l(fifth());
    welcomed(l);
    l.receive(a);
    REQUIRE(l.m.job_voters() == 3);
    proto::Standby s = standby_at(1, {}, {}, {}, {}, {});
    s.run = other;
    l.receive(s);
    CHECK(l.m.job_voters() == 0);  // main: 3, the old run's
    CHECK(l.m.job_voter_hosts().empty());
    CHECK(l.m.job_voters_epoch() == 0);
  }
  {
    Link l(fifth());
    welcomed(l);
    l.receive(standby_at(2, {"127.0.0.1", "127.0.0.3"}, {0, 7003}, a.voters, {"127.0.0.5"}, {7005}));
    REQUIRE(l.m.job_voters() == 3);
    proto::Assignment b = round_on({"127.0.0.1", "127.0.0.5"}, {0, 7005});
    b.run = other;
    b.epoch = 1;
    b.voters = {"agent-1", "agent-new"};
    l.receive(b);
    // The new run's epoch and voters (main: epoch 2, the old run's, so the count 0).
    CHECK(l.m.job_epoch() == 1);
    CHECK(l.m.job_voters() == 2);
    CHECK(l.m.job_voter_hosts() == Hosts{{"127.0.0.5", 7005}});
  }
}
