// Takeover after the hosting agent's loss (#26): who hosts next, when no takeover is
// possible, and the taken-over job under a fake clock (time points passed in).
#include <catch2/catch.hpp>

#include "rendezvous/client.h"
#include "rendezvous/job.h"

#include <map>

using namespace mg;
using namespace mg::rdzv;
using namespace std::chrono_literals;
using proto::MsgType;

namespace {

proto::Assignment round_of(std::vector<std::string> nodes, std::vector<int> ports) {
  proto::Assignment a;
  a.round = 4;
  a.group_world_size = static_cast<int>(nodes.size());
  a.nodes = std::move(nodes);
  a.takeover_ports = std::move(ports);
  return a;
}

proto::Join survivor(const std::string& addr) {
  proto::Join j;
  j.job_id = "job";
  j.agent_id = "agent-" + addr;
  j.host = "host-" + addr;
  j.addr = addr;
  j.min_nodes = 2;
  j.max_nodes = 3;
  j.max_restarts = 3;
  j.last_call_ms = 1000;
  j.keep_alive_ms = 100;
  j.keep_alive_max_attempt = 3;
  j.join_timeout_ms = 600000;
  return j;
}

const Clock::time_point T0{};

// Collects the actions of a sequence of calls: add(job.join(...)).
struct Collected {
  Actions out;
  void operator()(Actions more) { out.insert(out.end(), more.begin(), more.end()); }
};

}  // namespace

TEST_CASE("the lowest live node by group rank is tried first, the lost host and nodes without a port never") {
  // Group rank 0 hosted (port 0); 1 and 2 can host.
  auto a = round_of({"127.0.0.11", "127.0.0.12", "127.0.0.13"}, {0, 4001, 4002});
  auto c = takeover_candidates(a, "127.0.0.11", 41999);
  REQUIRE(c.size() == 2);
  CHECK(c[0].group_rank == 1);
  CHECK(c[0].addr == "127.0.0.12");
  CHECK(c[0].port == 4001);
  CHECK(c[1].group_rank == 2);
  // The node that took over is lost in turn: the one after it hosts next.
  c = takeover_candidates(a, "127.0.0.12", 4001);
  REQUIRE(c.size() == 1);
  CHECK(c[0].group_rank == 2);
  // Same address, another port (two agents on one machine): still a candidate.
  CHECK(takeover_candidates(a, "127.0.0.12", 41999).size() == 2);
  // A round with no ports listed (an older server, or too many nodes to list): nobody.
  CHECK(takeover_candidates(round_of({"127.0.0.11", "127.0.0.12"}, {}), "127.0.0.11", 41999).empty());
}

TEST_CASE("no takeover without a restart left, a node that can host, or enough nodes for --nnodes") {
  CHECK(why_no_takeover(0, 1, 2, 0, 2).empty());
  CHECK_THAT(why_no_takeover(1, 1, 2, 0, 2), Catch::Contains("no restart left") && Catch::Contains("--max_restarts=1"));
  CHECK_THAT(why_no_takeover(0, 3, 0, 1, 1), Catch::Contains("no other node can host"));
  CHECK_THAT(why_no_takeover(0, 3, 2, 0, 3), Catch::Contains("2 node(s) left, fewer than the 3"));
}

TEST_CASE("the standbys count towards --nnodes' minimum after the host's loss: 2 survivors and 1 standby go on at 3") {
  CHECK(why_no_takeover(0, 1, 2, 1, 3).empty());
  CHECK_THAT(why_no_takeover(0, 1, 1, 1, 3), Catch::Contains("2 node(s) left (1 of them standbys), fewer than the 3"));
  // Standbys cannot host: without a candidate there is no takeover, whatever waits.
  CHECK_THAT(why_no_takeover(0, 1, 0, 3, 1), Catch::Contains("no other node can host"));
}

namespace {

std::vector<Outgoing> to(SessionId s, const Actions& out) {
  std::vector<Outgoing> v;
  for (const auto& o : out)
    if (o.session == s) v.push_back(o);
  return v;
}

proto::Join of_size(proto::Join j, int min_nodes, int max_nodes) {
  j.min_nodes = min_nodes;
  j.max_nodes = max_nodes;
  return j;
}

proto::Join follower(const std::string& addr) {
  auto j = of_size(survivor(addr), 3, 3);
  j.resume_standby = true;
  return j;
}

proto::Join survivor_of(const std::string& addr, int last_group_rank) {
  auto j = of_size(survivor(addr), 3, 3);
  j.last_group_rank = last_group_rank;
  return j;
}

}  // namespace

TEST_CASE("a standby is told the running round's takeover candidates, again when a round closes, and the running "
          "nodes hear the standby count") {
  Job job("job");
  auto a = of_size(survivor("127.0.0.11"), 2, 2), b = of_size(survivor("127.0.0.12"), 2, 2);
  b.takeover_port = 4002;
  CHECK(job.join(1, a, T0).empty());
  auto out = job.join(2, b, T0);
  REQUIRE(out.size() == 2);
  CHECK(proto::from_frame<proto::Assignment>(out[0].frame).standbys == 0);
  auto s = of_size(survivor("127.0.0.13"), 2, 2);
  s.takeover_port = 4003;
  out = job.join(3, s, T0 + 1ms);
  REQUIRE(to(3, out).size() == 1);
  auto sb = proto::from_frame<proto::Standby>(to(3, out)[0].frame);
  CHECK(sb.round == 1);
  CHECK(sb.nodes == std::vector<std::string>{"127.0.0.11", "127.0.0.12"});
  CHECK(sb.takeover_ports == std::vector<int>{0, 4002});
  for (SessionId m : {1, 2}) {
    REQUIRE(to(m, out).size() == 1);
    REQUIRE(proto::type_of(to(m, out)[0].frame) == MsgType::kHeartbeat);
    CHECK(proto::from_frame<proto::Heartbeat>(to(m, out)[0].frame).standbys == 1);
  }
  // A worker fails: the same two nodes run the next round; the standby hears of it.
  proto::WorkerFailed f;
  f.round = 1;
  a.max_restarts = b.max_restarts = 3;
  Job job2("job2");
  job2.join(1, a, T0);
  job2.join(2, b, T0);
  job2.join(3, s, T0);
  job2.worker_failed(1, f, T0 + 1ms);
  job2.join(1, a, T0 + 2ms);
  out = job2.join(2, b, T0 + 2ms);
  REQUIRE(to(3, out).size() == 1);
  sb = proto::from_frame<proto::Standby>(to(3, out)[0].frame);
  CHECK(sb.round == 2);
  CHECK(sb.restart_count == 1);
  CHECK(sb.nodes == std::vector<std::string>{"127.0.0.11", "127.0.0.12"});
  CHECK(proto::from_frame<proto::Assignment>(to(1, out)[0].frame).standbys == 1);
  // The standby leaves: the running nodes hear the count.
  out = job2.disconnected(3, T0 + 3ms);
  REQUIRE(out.size() == 2);
  CHECK(proto::from_frame<proto::Heartbeat>(out[0].frame).standbys == 0);
}

TEST_CASE("a job taken over: the standby that follows takes the lost host's place at once, the survivors keep theirs") {
  for (const bool standby_first : {true, false}) {
    INFO("the standby re-registers first: " << standby_first);
    Job job("job");
    // Group rank 0 hosted and is lost; 1 and 2 survive; 127.0.0.19 was the standby.
    job.take_over({4, 1, "rendezvous host h1 (127.0.0.11:41999) lost: connection closed by peer", "h1", T0 + 300ms, 2},
                  T0);
    Collected add;
    Actions& out = add.out;

    if (standby_first) add(job.join(9, follower("127.0.0.19"), T0 + 1ms));
    add(job.join(1, survivor_of("127.0.0.12", 1), T0 + 2ms));
    add(job.join(2, survivor_of("127.0.0.13", 2), T0 + 3ms));
    if (!standby_first) add(job.join(9, follower("127.0.0.19"), T0 + 4ms));
    // 3 of 3: the round closed at once, with no tick (no last call, no deadline).
    CHECK(job.state() == Job::State::kRunning);
    std::map<SessionId, proto::Assignment> got;
    for (const auto& o : out)
      if (proto::type_of(o.frame) == MsgType::kAssignment) got[o.session] = proto::from_frame<proto::Assignment>(o.frame);
    REQUIRE(got.size() == 3);
    CHECK(got[9].group_rank == 0);  // the lost host's place
    CHECK(got[1].group_rank == 1);
    CHECK(got[2].group_rank == 2);
    CHECK(got[9].round == 5);
    CHECK(got[9].restart_count == 1);
    CHECK(got[9].master_addr == "127.0.0.19");
  }
}

TEST_CASE("a job taken over keeps the survivors' places from standbys that follow first, and gives them the places "
          "of survivors that never come at the deadline") {
  Job job("job");
  job.take_over({4, 1, "rendezvous host h1 (127.0.0.11:41999) lost: connection closed by peer", "h1", T0 + 300ms, 2},
                T0);
  // Two standbys follow before the survivors: one free place (3 less 2 survivors).
  auto out = job.join(8, follower("127.0.0.18"), T0 + 1ms);
  out = job.join(9, follower("127.0.0.19"), T0 + 2ms);
  REQUIRE(to(9, out).size() == 1);
  CHECK(proto::type_of(to(9, out)[0].frame) == MsgType::kStandby);
  CHECK(job.standbys() == 1);
  // Both survivors come: the round closes without the second standby, which hears of it.
  job.join(1, survivor_of("127.0.0.12", 1), T0 + 3ms);
  out = job.join(2, survivor_of("127.0.0.13", 2), T0 + 4ms);
  CHECK(to(1, out).size() == 1);
  CHECK(to(2, out).size() == 1);
  REQUIRE(to(8, out).size() == 1);
  CHECK(proto::from_frame<proto::Assignment>(to(8, out)[0].frame).group_rank == 0);
  REQUIRE(to(9, out).size() == 1);
  auto sb = proto::from_frame<proto::Standby>(to(9, out)[0].frame);
  CHECK(sb.round == 5);
  CHECK(sb.nodes == std::vector<std::string>{"127.0.0.18", "127.0.0.12", "127.0.0.13"});

  // One survivor never comes: at the deadline its place goes to the waiting standby.
  Job late("late");
  late.take_over({4, 1, "rendezvous host h1 (127.0.0.11:41999) lost: connection closed by peer", "h1", T0 + 300ms, 2},
                 T0);
  late.join(8, follower("127.0.0.18"), T0 + 1ms);
  late.join(9, follower("127.0.0.19"), T0 + 2ms);
  late.join(1, survivor_of("127.0.0.12", 1), T0 + 3ms);
  CHECK(late.tick(T0 + 299ms).empty());
  CHECK(late.state() == Job::State::kRestarting);
  out = late.tick(T0 + 300ms);
  CHECK(late.state() == Job::State::kRunning);
  CHECK(to(9, out).size() == 1);
  CHECK(proto::type_of(to(9, out)[0].frame) == MsgType::kAssignment);
}

TEST_CASE("a job taken over restarts with the survivors that join, with the restart the lost host cost") {
  Job job("job");
  job.take_over({4, 2, "rendezvous host h1 (127.0.0.11:41999) lost: connection closed by peer", "h1", T0 + 300ms}, T0);
  CHECK(job.state() == Job::State::kRestarting);
  CHECK(job.join(1, survivor("127.0.0.12"), T0 + 10ms).empty());
  CHECK(job.join(2, survivor("127.0.0.13"), T0 + 20ms).empty());
  // Two of 2:3 joined: the round closes after last call, not at the takeover deadline.
  CHECK(job.tick(T0 + 400ms).empty());
  auto out = job.tick(T0 + 20ms + 1000ms);
  auto assigned = out;
  REQUIRE(assigned.size() == 2);
  for (const auto& o : assigned) {
    REQUIRE(proto::type_of(o.frame) == MsgType::kAssignment);
    auto a = proto::from_frame<proto::Assignment>(o.frame);
    CHECK(a.round == 5);
    CHECK(a.restart_count == 2);
    CHECK(a.group_world_size == 2);
  }
  CHECK(job.state() == Job::State::kRunning);
}

TEST_CASE("a job taken over that too few survivors join fails at the deadline, naming the lost host") {
  Job job("job");
  job.take_over({4, 1, "rendezvous host h1 (127.0.0.11:41999) lost: connection closed by peer", "h1", T0 + 300ms}, T0);
  CHECK(job.join(1, survivor("127.0.0.12"), T0 + 10ms).empty());
  CHECK(job.tick(T0 + 299ms).empty());
  auto out = job.tick(T0 + 300ms);
  REQUIRE(out.size() == 1);
  REQUIRE(proto::type_of(out[0].frame) == MsgType::kAbort);
  auto abort = proto::from_frame<proto::Abort>(out[0].frame);
  CHECK(abort.root_cause.host == "h1");
  CHECK(abort.root_cause.rank == -1);
  CHECK(abort.root_cause.exit_code == kHostLostExitCode);
  CHECK_THAT(abort.reason, Catch::Contains("rendezvous host h1 (127.0.0.11:41999) lost") &&
                               Catch::Contains("only 1 of at least 2 nodes re-joined"));
  CHECK(job.state() == Job::State::kFailed);
}

TEST_CASE("an assignment lists every node's takeover port by group rank") {
  Job job("job");
  auto a = survivor("127.0.0.11"), b = survivor("127.0.0.12");
  a.min_nodes = b.min_nodes = a.max_nodes = b.max_nodes = 2;
  a.takeover_port = 0;  // it hosts
  b.takeover_port = 4002;
  CHECK(job.join(1, a, T0).empty());
  auto out = job.join(2, b, T0);
  REQUIRE(out.size() == 2);
  auto got = proto::from_frame<proto::Assignment>(out[0].frame);
  CHECK(got.takeover_ports == std::vector<int>{0, 4002});
  CHECK(got.nodes == std::vector<std::string>{"127.0.0.11", "127.0.0.12"});
}

namespace {

// Group rank 0 hosted and is lost; ranks 1 and 2 of the 3 survive, so two places are kept.
TakeoverSeed seed_of_3() {
  return {4, 1, "rendezvous host h1 (127.0.0.11:41999) lost: connection closed by peer", "h1", T0 + 300ms, 2, 3};
}

std::map<SessionId, proto::Assignment> assignments(const Actions& out) {
  std::map<SessionId, proto::Assignment> got;
  for (const auto& o : out)
    if (proto::type_of(o.frame) == MsgType::kAssignment) got[o.session] = proto::from_frame<proto::Assignment>(o.frame);
  return got;
}

}  // namespace

TEST_CASE("a job taken over keeps a late survivor's place from a newcomer and a standby") {
  Job job("job");
  job.take_over(seed_of_3(), T0);
  Collected add;
  Actions& out = add.out;

  add(job.join(7, survivor_of("127.0.0.17", -1), T0 + 1ms));  // a fresh node: no last group rank
  add(job.join(1, survivor_of("127.0.0.12", 1), T0 + 2ms));
  add(job.join(9, follower("127.0.0.19"), T0 + 3ms));
  // Rank 2's place is still kept: the standby may not take it.
  CHECK(job.state() == Job::State::kRestarting);
  CHECK(job.standbys() == 1);
  add(job.join(2, survivor_of("127.0.0.13", 2), T0 + 4ms));
  CHECK(job.state() == Job::State::kRunning);
  auto got = assignments(out);
  REQUIRE(got.count(2) == 1);
  CHECK(got[2].group_rank == 2);
  CHECK(got[1].group_rank == 1);
  CHECK(got.count(9) == 0);  // it waits on (told Standby again with the new round)
  REQUIRE(!to(9, out).empty());
  CHECK(proto::type_of(to(9, out).back().frame) == MsgType::kStandby);
}

TEST_CASE("a job taken over takes a second claim of a placed group rank, or a rank beyond the last round, as a "
          "newcomer: the survivor still coming keeps its place") {
  for (const int claim : {1, 5}) {
    INFO("the other node claims group rank " << claim);
    Job job("job");
    job.take_over(seed_of_3(), T0);
    Collected add;
    Actions& out = add.out;

    add(job.join(1, survivor_of("127.0.0.12", 1), T0 + 1ms));
    auto j = survivor_of("127.0.0.17", 0);
    j.last_group_rank = claim;
    add(job.join(7, j, T0 + 2ms));  // 5: beyond the round (a decoder refuses it; a Job caller may not)
    add(job.join(9, follower("127.0.0.19"), T0 + 3ms));
    CHECK(job.state() == Job::State::kRestarting);
    CHECK(job.standbys() == 1);
    add(job.join(2, survivor_of("127.0.0.13", 2), T0 + 4ms));
    REQUIRE(job.state() == Job::State::kRunning);
    auto got = assignments(out);
    REQUIRE(got.size() == 3);
    CHECK(got[1].group_rank == 1);  // the first claim keeps the rank
    CHECK(got[2].group_rank == 2);
    CHECK(got[7].group_rank == 0);  // the second claim is placed as a newcomer
  }
}

TEST_CASE("a job taken over makes a newcomer beyond the places kept for survivors a standby") {
  Job job("job");
  job.take_over(seed_of_3(), T0);
  Collected add;
  Actions& out = add.out;

  add(job.join(7, survivor_of("127.0.0.17", -1), T0 + 1ms));  // the one free place
  add(job.join(8, survivor_of("127.0.0.18", -1), T0 + 2ms));  // none left: it waits
  CHECK(job.standbys() == 1);
  add(job.join(1, survivor_of("127.0.0.12", 1), T0 + 3ms));
  add(job.join(2, survivor_of("127.0.0.13", 2), T0 + 4ms));
  REQUIRE(job.state() == Job::State::kRunning);
  auto got = assignments(out);
  CHECK(got.count(8) == 0);
  CHECK(got[1].group_rank == 1);
  CHECK(got[2].group_rank == 2);
  CHECK(got[7].group_rank == 0);
}
