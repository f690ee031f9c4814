// A network partition never splits a job (#34): the pure rules, under a fake clock. The
// job's epochs and voters, the majority a new round needs after a loss in a job an agent
// hosts (rdzv::Job), a re-registration after an outage; the client's fence timer and the
// takeover search that waits for a refusing candidate (rdzv::ClientMachine).
#include <catch2/catch.hpp>

#include <algorithm>
#include <random>

#include "rendezvous/auth.h"
#include "rendezvous/client_machine.h"
#include "rendezvous/job.h"
#include "support/fake_clock.h"

using namespace mg;
using namespace mg::rdzv;
using namespace std::chrono_literals;
using proto::MsgType;

namespace {

using mgtest::rdzv::decoded;
using mgtest::rdzv::of_type;
using mgtest::rdzv::T0;

// A node of a job of one to three nodes (by default) with restarts to spare.
proto::Join node(const std::string& addr, int min_nodes = 1, int max_nodes = 3, int max_restarts = 5) {
  return mgtest::rdzv::node(addr, min_nodes, max_nodes, 1, max_restarts);
}

// A takeover seed of round `round` (restart 1 next) of `world` nodes 127.0.0.1..WORLD, all
// voters of `epoch`, `survivors` of them expected to re-join by `deadline`.
TakeoverSeed seed_of(int round, int epoch, int world, int survivors, Clock::time_point deadline) {
  TakeoverSeed seed;
  seed.round = round;
  seed.restart_count = 1;
  seed.deadline = deadline;
  seed.survivors = survivors;
  seed.world_size = world;
  seed.epoch = epoch;
  for (int i = 1; i <= world; ++i) seed.voters.push_back("agent-127.0.0." + std::to_string(i));
  return seed;
}

bool has_event(Job& job, JobEvent::Kind k, JobEvent* out = nullptr) {
  for (const auto& e : job.take_events())
    if (e.kind == k) {
      if (out) *out = e;
      return true;
    }
  return false;
}

// A running 3-node job (sessions 1-3 at 127.0.0.1..3), its first round closed at T0.
Job three_nodes(bool quorum) {
  Job job("job", quorum);
  job.join(1, node("127.0.0.1"), T0);
  job.join(2, node("127.0.0.2"), T0);
  auto out = job.join(3, node("127.0.0.3"), T0);
  REQUIRE(of_type(out, MsgType::kAssignment).size() == 3);
  REQUIRE(job.state() == Job::State::kRunning);
  job.take_events();
  return job;
}

}  // namespace

TEST_CASE("quorum: every round gets the next epoch and lists its voters (its nodes, then the standbys registered "
          "when it closed), a standby hears them too") {
  Job job("job", true);
  job.join(1, node("127.0.0.1", 2, 2), T0);
  auto out = job.join(2, node("127.0.0.2", 2, 2), T0);
  auto assigned = of_type(out, MsgType::kAssignment);
  REQUIRE(assigned.size() == 2);
  auto a = decoded<proto::Assignment>(assigned[0]);
  CHECK(a.epoch == 1);
  CHECK(a.voters == std::vector<std::string>{"agent-127.0.0.1", "agent-127.0.0.2"});
  CHECK(job.epoch() == 1);
  // A standby registered now is a voter from the next round on.
  auto told = of_type(job.join(3, node("127.0.0.3", 2, 2), T0), MsgType::kStandby);
  REQUIRE(told.size() == 1);
  auto s = decoded<proto::Standby>(told[0]);
  CHECK(s.epoch == 1);
  CHECK(s.voters == a.voters);
  // A worker fails: the next round is epoch 2, and lists the standby among its voters.
  proto::WorkerFailed f;
  f.round = 1;
  f.host = "host-127.0.0.2";
  f.rank = 1;
  job.worker_failed(2, f, T0 + 1s);
  job.join(1, node("127.0.0.1", 2, 2), T0 + 1s);
  out = job.join(2, node("127.0.0.2", 2, 2), T0 + 1s);
  assigned = of_type(out, MsgType::kAssignment);
  REQUIRE(assigned.size() == 2);
  a = decoded<proto::Assignment>(assigned[0]);
  CHECK(a.epoch == 2);
  CHECK(a.voters == std::vector<std::string>{"agent-127.0.0.1", "agent-127.0.0.2", "agent-127.0.0.3"});
}

TEST_CASE("quorum: the epoch goes on from the highest any joining node saw: a node that took the job over, and a "
          "restarted daemon rebuilding its round") {
  SECTION("a takeover: the seed's epoch, or a survivor's higher one") {
    Job job("job", true);
    TakeoverSeed seed = seed_of(4, 6, 3, 2, T0 + 1s);
    job.take_over(seed, T0);
    auto j2 = node("127.0.0.2");
    j2.last_group_rank = 1;
    j2.epoch = 6;
    auto j3 = node("127.0.0.3");
    j3.last_group_rank = 2;
    j3.epoch = takeover_epoch(6, 1) + 5;  // it heard of a later round than the new host did
    job.join(2, j2, T0);
    job.join(3, j3, T0);
    auto closed = of_type(job.tick(T0 + 1001ms), MsgType::kAssignment);
    REQUIRE(closed.size() == 2);
    CHECK(decoded<proto::Assignment>(closed[0]).epoch == takeover_epoch(6, 1) + 6);
    CHECK(job.round() == 5);
  }
  SECTION("a re-registration with a restarted daemon keeps the round's epoch and run (#37); its next round is one "
          "more") {
    const std::string kRun = "1700000000000-00000000000000ab";
    Job job("job", false, "1700000009999-00000000000000cd");  // the new daemon's own run
    job.open_run();  // it has no journal of the job (rdzv::Server::job_of())
    auto j = node("127.0.0.1", 1, 1);
    j.resume_round = 3;
    j.resume_group_rank = 0;
    j.resume_group_world_size = 1;
    j.epoch = 9;
    j.run = kRun;
    job.join(1, j, T0);
    REQUIRE(job.state() == Job::State::kRunning);
    CHECK(job.epoch() == 9);
    CHECK(job.run() == kRun);
    proto::WorkerFailed f;
    f.round = 3;
    f.host = "host-127.0.0.1";
    f.rank = 0;
    job.worker_failed(1, f, T0);
    auto out = of_type(job.join(1, node("127.0.0.1", 1, 1), T0), MsgType::kAssignment);
    REQUIRE(out.size() == 1);
    CHECK(decoded<proto::Assignment>(out[0]).epoch == 10);
    CHECK(decoded<proto::Assignment>(out[0]).run == kRun);
  }
}

TEST_CASE("quorum: two hosts never mint the same epoch: a takeover's epochs jump to a block of their own, offset by "
          "the new host's group rank") {
  // The lost host (cut off, not dead) counts on from 6 by one; two nodes that each took round
  // 4 over (ranks 1 and 2) mint their own; a later takeover of theirs lands further on.
  const int a = takeover_epoch(6, 1), b = takeover_epoch(6, 2);
  CHECK(a != b);
  CHECK(a > 6 + 1000);
  CHECK(b > 6 + 1000);
  CHECK(takeover_epoch(a, 1) > b + 1000);
  CHECK(takeover_epoch(INT32_MAX, 5) == INT32_MAX);
  auto first_epoch = [](int host_rank) {
    Job job("job", true);
    TakeoverSeed seed = seed_of(4, 6, 3, 1, T0 + 1s);
    seed.host_rank = host_rank;
    job.take_over(seed, T0);
    // Its last round, for a host that looks for the job (Welcome::last_round_epoch, review
    // s36 H1): the round taken over until its own opens.
    CHECK(job.last_round_epoch() == 6);
    for (int i = 2; i <= 3; ++i) {
      auto j = node("127.0.0." + std::to_string(i));
      j.last_group_rank = i - 1;
      j.epoch = 6;
      job.join(i, j, T0);
    }
    auto closed = of_type(job.tick(T0 + 1001ms), MsgType::kAssignment);
    REQUIRE(closed.size() == 2);
    CHECK(job.last_round_epoch() == decoded<proto::Assignment>(closed[0]).epoch);
    return decoded<proto::Assignment>(closed[0]).epoch;
  };
  CHECK(first_epoch(1) == a);  // before: both 7, the lost host's next epoch too
  CHECK(first_epoch(2) == b);
}

TEST_CASE("quorum: in a job an agent hosts, a new round after a node was lost needs a majority of the voters: one "
          "survivor of three waits, says so once, and fails at join_timeout with that root cause") {
  Job job = three_nodes(/*quorum=*/true);
  // Nodes 2 and 3 are cut off: their heartbeats stop; node 1 (the host's side) goes on beating.
  for (auto t = T0 + 100ms; t <= T0 + 300ms; t += 100ms) job.heartbeat(1, t);
  auto out = job.tick(T0 + 301ms);  // node 2 lost: all told to restart (node 2 too); node 3 never comes
  CHECK(of_type(out, MsgType::kRestart).size() == 3);
  job.join(1, node("127.0.0.1"), T0 + 400ms);
  job.take_events();
  // The last call passes: with 1 of 3 voters no round opens.
  out = job.tick(T0 + 1500ms);
  CHECK(of_type(out, MsgType::kAssignment).empty());
  JobEvent e;
  REQUIRE(has_event(job, JobEvent::Kind::kNoQuorum, &e));
  CHECK(e.nodes == 1);
  CHECK(e.voters == 3);
  CHECK_THAT(text_of(e), Catch::Contains("waits for a majority of the job's 3 voters: 1 of them joined or standing by, 2 needed"));
  CHECK(of_type(job.tick(T0 + 1600ms), MsgType::kAssignment).empty());
  CHECK_FALSE(has_event(job, JobEvent::Kind::kNoQuorum));  // said once
  // What its Welcome tells a host that looks for the job (#34, Seeking): no round runs here.
  CHECK(job.running_epoch() == 0);
  CHECK(job.epoch() == 1);
  auto end = of_type(job.tick(T0 + 5401ms), MsgType::kAbort);
  REQUIRE(end.size() == 1);
  CHECK_THAT(decoded<proto::Abort>(end[0]).reason, Catch::Contains("no majority of job 'job''s 3 voters within "
                                                                    "join_timeout: 1 of them joined or standing by, 2 needed"));
  // A minority's end: the majority's side goes on, so the agents keep their records of the job.
  CHECK_FALSE(decoded<proto::Abort>(end[0]).final);
}

TEST_CASE("quorum: two survivors of three are a majority and go on, the same lone survivor goes on where a daemon "
          "arbitrates (no majority counted there)") {
  SECTION("two of three, an agent hosting") {
    Job job = three_nodes(true);
    job.heartbeat(1, T0 + 250ms);
    job.heartbeat(2, T0 + 250ms);
    REQUIRE(of_type(job.tick(T0 + 301ms), MsgType::kRestart).size() == 3);
    job.join(1, node("127.0.0.1"), T0 + 400ms);
    job.join(2, node("127.0.0.2"), T0 + 400ms);
    auto out = of_type(job.tick(T0 + 1401ms), MsgType::kAssignment);
    REQUIRE(out.size() == 2);
    CHECK(decoded<proto::Assignment>(out[0]).epoch == 2);
  }
  SECTION("one of three, a daemon") {
    Job job = three_nodes(false);
    for (auto t = T0 + 100ms; t <= T0 + 300ms; t += 100ms) job.heartbeat(1, t);
    job.tick(T0 + 301ms);
    job.tick(T0 + 302ms);
    job.join(1, node("127.0.0.1"), T0 + 400ms);
    CHECK(of_type(job.tick(T0 + 1401ms), MsgType::kAssignment).size() == 1);
  }
}

TEST_CASE("quorum: every round after the first needs a majority, not only after a loss: a cut during a worker "
          "failure's restart or a scale-up leaves the host alone without a round") {
  SECTION("a worker failed (every node alive), then the cut: the host alone waits and fails at join_timeout") {
    Job job = three_nodes(true);
    proto::WorkerFailed f;
    f.round = 1;
    f.host = "host-127.0.0.3";
    f.rank = 2;
    REQUIRE(of_type(job.worker_failed(3, f, T0 + 100ms), MsgType::kRestart).size() == 3);
    job.join(1, node("127.0.0.1"), T0 + 150ms);  // nodes 2 and 3 are cut off from here on
    job.take_events();
    CHECK(of_type(job.tick(T0 + 1200ms), MsgType::kAssignment).empty());  // before: a round of one, epoch 2
    CHECK(has_event(job, JobEvent::Kind::kNoQuorum));
    auto end = of_type(job.tick(T0 + 5200ms), MsgType::kAbort);
    REQUIRE(end.size() == 1);
    CHECK_THAT(decoded<proto::Abort>(end[0]).reason, Catch::Contains("no majority of job 'job''s 3 voters"));
  }
  SECTION("a scale-up, then the cut: the same") {
    Job job("job", true);
    for (int i = 1; i <= 3; ++i) job.join(i, node("127.0.0." + std::to_string(i), 1, 4), T0);
    REQUIRE(of_type(job.tick(T0 + 1001ms), MsgType::kAssignment).size() == 3);
    REQUIRE(of_type(job.join(4, node("127.0.0.4", 1, 4), T0 + 1100ms), MsgType::kRestart).size() == 3);
    job.join(1, node("127.0.0.1", 1, 4), T0 + 1150ms);  // nodes 2 and 3 cut off; node 4 is no voter of epoch 1
    job.join(4, node("127.0.0.4", 1, 4), T0 + 1150ms);
    CHECK(of_type(job.tick(T0 + 2200ms), MsgType::kAssignment).empty());  // before: a round of nodes 1 and 4
    // Node 2 comes back: 2 of the 3 voters, the round opens.
    job.join(2, node("127.0.0.2", 1, 4), T0 + 2300ms);
    CHECK(of_type(job.tick(T0 + 2301ms), MsgType::kAssignment).size() == 3);
  }
}

TEST_CASE("quorum: a node told to restart that stays silent past keep-alive x attempts is lost: its place goes to a "
          "standby, the round opens without it") {
  Job job("job", true);
  job.join(1, node("127.0.0.1", 2, 2), T0);
  job.join(2, node("127.0.0.2", 2, 2), T0);
  REQUIRE(of_type(job.join(3, node("127.0.0.3", 2, 2), T0), MsgType::kStandby).size() == 1);
  proto::WorkerFailed f;
  f.round = 1;
  f.host = "host-127.0.0.1";
  f.rank = 0;
  job.worker_failed(1, f, T0 + 50ms);
  job.join(1, node("127.0.0.1", 2, 2), T0 + 100ms);  // node 2 never answers its Restart
  for (auto t = T0 + 100ms; t <= T0 + 400ms; t += 100ms) {
    job.heartbeat(1, t);
    job.heartbeat(3, t);
  }
  job.take_events();
  auto out = job.tick(T0 + 401ms);  // before: node 2's place held to join_timeout, then the job failed
  auto assigned = of_type(out, MsgType::kAssignment);
  REQUIRE(assigned.size() == 2);
  CHECK(((assigned[0].session == 1 && assigned[1].session == 3) || (assigned[0].session == 3 && assigned[1].session == 1)));
  JobEvent e;
  REQUIRE(has_event(job, JobEvent::Kind::kNodeLost, &e));
  CHECK(e.host == "host-127.0.0.2");
  CHECK(e.cause == "heartbeat timeout");
}

TEST_CASE("quorum: a silent member the job drops hears Restart (stop and join again) while the job goes on, the "
          "Abort only when the job failed") {
  Job job = three_nodes(true);
  for (auto t = T0 + 100ms; t <= T0 + 300ms; t += 100ms) {
    job.heartbeat(1, t);
    job.heartbeat(2, t);
  }
  auto out = job.tick(T0 + 301ms);
  CHECK(of_type(out, MsgType::kAbort).empty());  // before: an Abort, and node 3 ended
  auto r = of_type(out, MsgType::kRestart);
  REQUIRE(r.size() == 3);
  std::string to;
  for (const auto& o : r) to += std::to_string(o.session) + " ";
  INFO("restarts to sessions " << to);
  CHECK(std::any_of(r.begin(), r.end(), [](const Outgoing& o) { return o.session == 3; }));
  SECTION("no restart left: the Abort") {
    Job last("job", true);
    last.join(1, node("127.0.0.1", 1, 2, 0), T0);
    last.join(2, node("127.0.0.2", 1, 2, 0), T0);
    last.heartbeat(1, T0 + 250ms);
    auto end = last.tick(T0 + 301ms);
    CHECK(of_type(end, MsgType::kAbort).size() == 2);
  }
}

TEST_CASE("quorum: the standbys registered count as present voters: --nnodes=2 with two standbys goes on after one "
          "node's loss") {
  Job job("job", true);
  job.join(1, node("127.0.0.1", 2, 2), T0);
  job.join(2, node("127.0.0.2", 2, 2), T0);
  job.join(3, node("127.0.0.3", 2, 2), T0);  // standbys
  job.join(4, node("127.0.0.4", 2, 2), T0);
  // A worker fails: round 2's voters are both nodes and both standbys.
  proto::WorkerFailed f;
  f.round = 1;
  f.host = "host-127.0.0.2";
  f.rank = 1;
  job.worker_failed(2, f, T0 + 10ms);
  job.join(1, node("127.0.0.1", 2, 2), T0 + 20ms);
  auto a = of_type(job.join(2, node("127.0.0.2", 2, 2), T0 + 20ms), MsgType::kAssignment);
  REQUIRE(a.size() == 2);
  REQUIRE(decoded<proto::Assignment>(a[0]).voters.size() == 4);
  // Node 2 crashes: standby 3 takes its place; node 1 and standby 3 joined, standby 4 waits.
  job.disconnected(2, T0 + 100ms);
  auto out = of_type(job.join(1, node("127.0.0.1", 2, 2), T0 + 150ms), MsgType::kAssignment);
  CHECK(out.size() == 2);  // before: 2 of 4 joined, no round, the job failed at join_timeout
  CHECK(job.state() == Job::State::kRunning);
}

TEST_CASE("quorum: a job taken over opens its round only with a majority of the seed's voters among its joins, a "
          "newcomer is no voter") {
  Job job("job", true);
  TakeoverSeed seed = seed_of(2, 2, 3, 2, T0 + 300ms);
  job.take_over(seed, T0);
  auto j3 = node("127.0.0.3");
  j3.last_group_rank = 2;
  job.join(3, j3, T0);  // the new host itself
  job.join(9, node("127.0.0.9"), T0);  // a newcomer
  CHECK(of_type(job.tick(T0 + 1001ms), MsgType::kAssignment).empty());
  CHECK(has_event(job, JobEvent::Kind::kNoQuorum));
  CHECK(job.state() == Job::State::kRestarting);
  CHECK(job.running_epoch() == 0);  // (its Welcome's epoch: its own block, below the round's)
  CHECK(job.epoch() == takeover_epoch(2, 0) - 1);
  // The other survivor comes (late, its side healed): 2 of 3 voters, the round opens.
  auto j2 = node("127.0.0.2");
  j2.last_group_rank = 1;
  auto out = of_type(job.join(2, j2, T0 + 1100ms), MsgType::kAssignment);
  CHECK(out.size() == 3);
  CHECK(decoded<proto::Assignment>(out[0]).epoch == takeover_epoch(2, 0));
  CHECK(job.running_epoch() == takeover_epoch(2, 0));
}

TEST_CASE("quorum: two voters - the rendezvous host's side goes on after the other's loss, a node that took over "
          "goes on after its host's connection closed, never after silence") {
  SECTION("the host's side") {
    Job job("job", true);
    job.join(1, node("127.0.0.1", 1, 2), T0);
    job.join(2, node("127.0.0.2", 1, 2), T0);
    REQUIRE(job.state() == Job::State::kRunning);
    job.heartbeat(1, T0 + 250ms);
    job.tick(T0 + 301ms);
    job.join(1, node("127.0.0.1", 1, 2), T0 + 400ms);
    CHECK(of_type(job.tick(T0 + 1401ms), MsgType::kAssignment).size() == 1);
  }
  for (bool closed : {true, false}) {
    DYNAMIC_SECTION("a takeover, its host's connection " << (closed ? "closed" : "silent")) {
      Job job("job", true);
      TakeoverSeed seed = seed_of(1, 1, 2, 1, T0 + 300ms);
      seed.host_closed = closed;
      job.take_over(seed, T0);
      auto j2 = node("127.0.0.2", 1, 2);
      j2.last_group_rank = 1;
      job.join(2, j2, T0);
      CHECK(of_type(job.tick(T0 + 1001ms), MsgType::kAssignment).size() == (closed ? 1u : 0u));
    }
  }
}

namespace {

// Every node of the job beats at `t` but those in `silent`.
void beat(Job& job, std::initializer_list<SessionId> sessions, Clock::time_point t) {
  for (auto s : sessions) job.heartbeat(s, t);
}

// A worker of node `s` failed in round `round`: everybody is told to restart.
Actions fail_worker(Job& job, SessionId s, int round, Clock::time_point t) {
  proto::WorkerFailed f;
  f.round = round;
  f.host = "host-127.0.0." + std::to_string(s);
  f.rank = 0;
  return job.worker_failed(s, f, t);
}

}  // namespace

TEST_CASE("quorum: voters that change between epochs need the old set's majority too (joint majority): a standby "
          "the host counted and then lost to the other side of a cut splits the job no more") {
  // --nnodes=1:2, nodes A (.1, the host) and B (.2), S (.3) a standby; two worker failures
  // make S a voter of epochs 2 and 3: voters {A, B, S}.
  Job host("job", true);
  host.join(1, node("127.0.0.1", 1, 2), T0);
  REQUIRE(of_type(host.join(2, node("127.0.0.2", 1, 2), T0), MsgType::kAssignment).size() == 2);
  REQUIRE(of_type(host.join(3, node("127.0.0.3", 1, 2), T0), MsgType::kStandby).size() == 1);
  for (int round = 1; round <= 2; ++round) {
    const auto t = T0 + round * 10ms;
    fail_worker(host, 2, round, t);
    host.join(1, node("127.0.0.1", 1, 2), t);
    REQUIRE(of_type(host.join(2, node("127.0.0.2", 1, 2), t), MsgType::kAssignment).size() == 2);
  }
  REQUIRE(host.epoch() == 3);
  const std::vector<std::string> voters = {"agent-127.0.0.1", "agent-127.0.0.2", "agent-127.0.0.3"};
  // The cut: {A} | {B, S}. B beat last at 100 ms, S at 150 ms (they beat apart): when B is
  // lost at 401 ms, S is still counted on the host's side and takes B's place in round 4.
  beat(host, {1, 2, 3}, T0 + 100ms);
  beat(host, {1, 3}, T0 + 150ms);
  for (auto t = T0 + 200ms; t <= T0 + 400ms; t += 100ms) beat(host, {1}, t);
  host.tick(T0 + 401ms);
  auto round4 = of_type(host.join(1, node("127.0.0.1", 1, 2), T0 + 410ms), MsgType::kAssignment);
  REQUIRE(round4.size() == 2);  // A and S (whose assignment never arrives: it is cut off)
  CHECK(decoded<proto::Assignment>(round4[0]).voters == std::vector<std::string>{"agent-127.0.0.1", "agent-127.0.0.3"});
  // S, silent, is lost; A alone re-joins. Round 5's voters {A, S} are two and A kept the
  // host: one epoch's count lets it go on. The epoch before's {A, B, S}: 1 of 3.
  for (auto t = T0 + 500ms; t <= T0 + 700ms; t += 100ms) beat(host, {1}, t);
  host.tick(T0 + 711ms);
  host.join(1, node("127.0.0.1", 1, 2), T0 + 720ms);
  host.take_events();
  CHECK(of_type(host.tick(T0 + 1800ms), MsgType::kAssignment).empty());  // before: a round of A alone, epoch 5
  JobEvent e;
  REQUIRE(has_event(host, JobEvent::Kind::kNoQuorum, &e));
  CHECK(e.previous_voters);
  CHECK(e.voters == 3);
  CHECK(e.nodes == 1);
  CHECK_THAT(text_of(e), Catch::Contains("waits for a majority of the job's 3 voters of the epoch before: 1 of them"));
  auto end = of_type(host.tick(T0 + 5800ms), MsgType::kAbort);
  REQUIRE(end.size() == 1);
  CHECK_THAT(decoded<proto::Abort>(end[0]).reason, Catch::Contains("no majority of job 'job''s 3 voters of the epoch "
                                                                    "before within join_timeout"));
  // The other side: B took the job over from epoch 3 (its last assignment), S followed it.
  Job other("job", true);
  TakeoverSeed seed = seed_of(3, 3, 2, 1, T0 + 5s);
  seed.voters = voters;
  seed.prev_voters = voters;
  seed.host_rank = 1;
  other.take_over(seed, T0 + 600ms);
  auto jb = node("127.0.0.2", 1, 2);
  jb.last_group_rank = 1;
  jb.epoch = 3;
  other.join(2, jb, T0 + 600ms);
  auto js = node("127.0.0.3", 1, 2);
  js.resume_standby = true;
  js.epoch = 3;
  CHECK(of_type(other.join(3, js, T0 + 600ms), MsgType::kAssignment).size() == 2);  // B and S: 2 of 3, one side
}

TEST_CASE("quorum: a node told to restart that still beats is alive but no vote until it joins: the round waits for "
          "it instead of opening without it, then opens with it, and cut off after its Restart it is dropped, never counted") {
  // Nodes A (the host), B, C; a worker fails. A re-joins at once; B beats (its workers take
  // their time to stop); C is cut off. Counted as present, B would make 2 of 3 at the last
  // call and open a round of A alone, which B would then join as a scale-up (one more
  // restart), and a B cut off after its Restart could be counted here and by the other
  // side's takeover too. Not counted: the round waits for B's join.
  Job job = three_nodes(true);
  fail_worker(job, 1, 1, T0 + 50ms);
  job.join(1, node("127.0.0.1"), T0 + 100ms);
  job.take_events();
  for (auto t = T0 + 200ms; t <= T0 + 1300ms; t += 100ms) {
    beat(job, {1, 2}, t);
    CHECK(of_type(job.tick(t + 1ms), MsgType::kAssignment).empty());
  }
  JobEvent e;
  REQUIRE(has_event(job, JobEvent::Kind::kNoQuorum, &e));
  CHECK(e.nodes == 1);
  // Yet A hears a majority (B beats): its host does not look for the job elsewhere (#34).
  CHECK(job.hears_majority());
  auto out = job.join(2, node("127.0.0.2"), T0 + 1350ms);
  auto more = job.tick(T0 + 1351ms);
  out.insert(out.end(), more.begin(), more.end());
  out = of_type(out, MsgType::kAssignment);
  REQUIRE(out.size() == 2);  // A and B, one round, no scale-up after it
  CHECK(decoded<proto::Assignment>(out[0]).group_world_size == 2);
  SECTION("B cut off after its Restart: dropped at keep-alive x attempts, the round never opens on A's side") {
    Job cut = three_nodes(true);
    fail_worker(cut, 1, 1, T0 + 50ms);
    cut.join(1, node("127.0.0.1"), T0 + 100ms);
    beat(cut, {1, 2}, T0 + 150ms);
    for (auto t = T0 + 200ms; t <= T0 + 2000ms; t += 100ms) {
      beat(cut, {1}, t);
      CHECK(of_type(cut.tick(t + 1ms), MsgType::kAssignment).empty());
    }
    CHECK(cut.state() == Job::State::kRestarting);
    CHECK_FALSE(cut.hears_majority());  // A alone: its host looks for the job (#34, Seeking)
  }
}

TEST_CASE("quorum: a node told to restart whose connection closes before it re-joined is lost, an event: its host "
          "asks again whether it hears a majority") {
  // Review s36 M1: A (the host) re-joins at once, B and C beat while their workers stop: the
  // round waits for a majority (kNoQuorum), yet A hears one, so its host stays home. Then a
  // REJECT cut resets B's and C's connections. The host asks hears_majority() again only on
  // an event; before, such a node was erased without one and the host waited out join_timeout.
  Job job = three_nodes(true);
  fail_worker(job, 1, 1, T0 + 50ms);
  job.join(1, node("127.0.0.1"), T0 + 100ms);
  for (auto t = T0 + 200ms; t <= T0 + 1300ms; t += 100ms) {
    beat(job, {1, 2, 3}, t);
    REQUIRE(of_type(job.tick(t + 1ms), MsgType::kAssignment).empty());
  }
  REQUIRE(has_event(job, JobEvent::Kind::kNoQuorum));
  REQUIRE(job.hears_majority());
  job.disconnected(2, T0 + 1350ms, "its connection was reset");
  JobEvent e;
  REQUIRE(has_event(job, JobEvent::Kind::kNodeLost, &e));
  CHECK(e.host == "host-127.0.0.2");
  CHECK(e.cause == "connection closed");
  CHECK(e.why == "its connection was reset, told to restart for round 2");
  CHECK(job.hears_majority());  // A and C: 2 of 3
  job.disconnected(3, T0 + 1360ms, "its connection was reset");
  REQUIRE(has_event(job, JobEvent::Kind::kNodeLost, &e));
  CHECK(e.host == "host-127.0.0.3");
  CHECK_FALSE(job.hears_majority());  // A alone: its host looks for the job (#34, Seeking)
  CHECK(job.state() == Job::State::kRestarting);
}

TEST_CASE("quorum: a host cut off epochs ago counts the voters of a newer epoch that joining nodes bring: the nodes "
          "that went on never open a round there among its stale voters") {
  // Review s36 H1: round 1 (epoch 1) ran nodes 1-3, node 1 hosting. Nodes 2 and 3 fell silent
  // (node 1 cut off) and went on without it: a takeover, a scale-up to six nodes, a restart,
  // epoch kT with voters 2-6. Then {1,2,3} | {4,5,6}: the other side takes over with 3 of 5.
  // Nodes 2 and 3 reach node 1 again; counting only its own voters {1,2,3} (3 of 3), node 1
  // opened a second round of the job. The joins carry epoch kT's voters: 2 of 5, it waits.
  constexpr int kT = 131077;
  auto six = [](int i) { return node("127.0.0." + std::to_string(i), 1, 6); };
  Job job("job", true);
  for (int i = 1; i <= 3; ++i) job.join(i, six(i), T0);
  REQUIRE(of_type(job.tick(T0 + 1001ms), MsgType::kAssignment).size() == 3);
  fail_worker(job, 1, 1, T0 + 1050ms);
  job.join(1, six(1), T0 + 1100ms);
  for (auto t = T0 + 1200ms; t <= T0 + 1600ms; t += 100ms) {
    beat(job, {1}, t);
    REQUIRE(of_type(job.tick(t + 1ms), MsgType::kAssignment).empty());  // 2 and 3 silent: lost
  }
  std::vector<std::string> went_on;
  for (int i = 2; i <= 6; ++i) went_on.push_back("agent-127.0.0." + std::to_string(i));
  auto back = [&](int i) {
    auto j = six(i);
    j.epoch = kT;
    j.voters = went_on;
    return j;
  };
  job.take_events();
  job.join(12, back(2), T0 + 1700ms);
  job.join(13, back(3), T0 + 1700ms);
  for (auto t = T0 + 1800ms; t <= T0 + 3000ms; t += 100ms) {
    beat(job, {1, 12, 13}, t);
    CHECK(of_type(job.tick(t + 1ms), MsgType::kAssignment).empty());  // before: a round of 1, 2 and 3 at 2.1 s
  }
  JobEvent e;
  REQUIRE(has_event(job, JobEvent::Kind::kNoQuorum, &e));
  CHECK(e.voters == 5);
  CHECK(e.nodes == 2);
  CHECK_FALSE(job.hears_majority());
  // The other side's nodes come too (healed): a majority of epoch kT's voters, the round
  // opens past kT, and its voters before are epoch kT's (joint majority from there on).
  job.join(14, back(4), T0 + 3100ms);
  auto out = of_type(job.tick(T0 + 3101ms), MsgType::kAssignment);
  REQUIRE(out.size() == 4);
  CHECK(decoded<proto::Assignment>(out[0]).epoch == kT + 1);
  SECTION("a newer epoch of two voters needs both: this host was not its host") {
    Job two("job", true);
    for (int i = 1; i <= 3; ++i) two.join(i, six(i), T0);
    REQUIRE(of_type(two.tick(T0 + 1001ms), MsgType::kAssignment).size() == 3);
    fail_worker(two, 1, 1, T0 + 1050ms);
    two.join(1, six(1), T0 + 1100ms);
    two.join(2, six(2), T0 + 1100ms);
    two.join(3, six(3), T0 + 1100ms);
    auto j = six(4);
    j.epoch = kT;
    j.voters = {"agent-127.0.0.3", "agent-127.0.0.4"};
    REQUIRE(of_type(two.join(4, j, T0 + 1100ms), MsgType::kAssignment).empty());
    // 3 and 4 of {3, 4}, all of {1, 2, 3}: it opens.
    CHECK(of_type(two.tick(T0 + 2101ms), MsgType::kAssignment).size() == 4);
    Job one_of_two("job", true);
    for (int i = 1; i <= 3; ++i) one_of_two.join(i, six(i), T0);
    REQUIRE(of_type(one_of_two.tick(T0 + 1001ms), MsgType::kAssignment).size() == 3);
    fail_worker(one_of_two, 1, 1, T0 + 1050ms);
    for (int i = 1; i <= 2; ++i) one_of_two.join(i, six(i), T0 + 1100ms);
    j.voters = {"agent-127.0.0.4", "agent-127.0.0.5"};
    one_of_two.join(4, j, T0 + 1100ms);
    for (auto t = T0 + 1200ms; t <= T0 + 2100ms; t += 100ms) {
      beat(one_of_two, {1, 2, 4}, t);
      CHECK(of_type(one_of_two.tick(t + 1ms), MsgType::kAssignment).empty());  // 1 of {4, 5}
    }
  }
}

TEST_CASE("quorum: a node that joined a round and was cut off before its assignment takes over with the older "
          "voters: the host's side needs their majority too, so only one side goes on") {
  // Nodes A (the host), B, C; a worker fails, A and B re-join (C is cut off), round 2 opens
  // with A and B: voters {A, B}. B's assignment never arrives: the cut is now {A} | {B, C}.
  Job host = three_nodes(true);
  fail_worker(host, 3, 1, T0 + 50ms);
  host.join(1, node("127.0.0.1"), T0 + 100ms);
  host.join(2, node("127.0.0.2"), T0 + 100ms);
  auto round2 = of_type(host.tick(T0 + 1101ms), MsgType::kAssignment);
  REQUIRE(round2.size() == 2);
  for (auto t = T0 + 1200ms; t <= T0 + 1400ms; t += 100ms) beat(host, {1}, t);
  host.tick(T0 + 1402ms);  // B lost
  host.join(1, node("127.0.0.1"), T0 + 1410ms);
  host.take_events();
  CHECK(of_type(host.tick(T0 + 2500ms), MsgType::kAssignment).empty());  // before: A alone (two voters, the host's side)
  JobEvent e;
  REQUIRE(has_event(host, JobEvent::Kind::kNoQuorum, &e));
  CHECK(e.previous_voters);
  // B and C take over from epoch 1 (B's last assignment), voters {A, B, C}: 2 of 3.
  Job other("job", true);
  TakeoverSeed seed = seed_of(1, 1, 3, 2, T0 + 5s);
  seed.host_rank = 1;
  other.take_over(seed, T0 + 1500ms);
  for (int i = 2; i <= 3; ++i) {
    auto j = node("127.0.0." + std::to_string(i));
    j.last_group_rank = i - 1;
    j.epoch = 1;
    other.join(static_cast<SessionId>(i), j, T0 + 1500ms);
  }
  CHECK(of_type(other.tick(T0 + 2501ms), MsgType::kAssignment).size() == 2);
}

TEST_CASE("quorum: a node of the running round that re-registers after an outage of its own takes its place back "
          "(no Error while its workers run), one the job went on without is told to restart and join again") {
  auto resume = [](proto::Join j, int round, int rank, int restart_count = 0) {
    j.resume_round = round;
    j.resume_group_rank = rank;
    j.resume_group_world_size = 3;
    j.resume_restart_count = restart_count;
    return j;
  };
  SECTION("the same round: a new session, no restart") {
    Job job = three_nodes(false);
    auto out = job.join(7, resume(node("127.0.0.2"), 1, 1), T0 + 200ms);
    CHECK(of_type(out, MsgType::kError).empty());
    CHECK(of_type(out, MsgType::kRestart).empty());
    JobEvent e;
    REQUIRE(has_event(job, JobEvent::Kind::kJoined, &e));
    CHECK(e.how == "reconnected");
    // The old session's close is nothing now; the new one beats and is never lost.
    CHECK(job.disconnected(2, T0 + 250ms).empty());
    for (auto t = T0 + 300ms; t <= T0 + 600ms; t += 100ms) {
      job.heartbeat(1, t);
      job.heartbeat(3, t);
      job.heartbeat(7, t);
      CHECK(of_type(job.tick(t), MsgType::kRestart).empty());
    }
    CHECK(job.state() == Job::State::kRunning);
    // Its fence, reported on the new session, restarts the round.
    proto::WorkerFailed f;
    f.round = 1;
    f.host = "host-127.0.0.2";
    f.rank = -1;
    f.message = "node host-127.0.0.2 (127.0.0.2) fenced itself";
    CHECK(of_type(job.worker_failed(7, f, T0 + 700ms), MsgType::kRestart).size() == 3);
  }
  SECTION("a later round: Restart, then a fresh join as a standby") {
    Job job("job", false);
    job.join(1, node("127.0.0.1", 2, 2), T0);
    job.join(2, node("127.0.0.2", 2, 2), T0);
    job.join(3, node("127.0.0.3", 2, 2), T0);  // a standby
    job.heartbeat(1, T0 + 250ms);
    job.heartbeat(3, T0 + 250ms);
    job.tick(T0 + 301ms);  // node 2 lost: the standby takes its place in round 2
    job.join(1, node("127.0.0.1", 2, 2), T0 + 400ms);
    REQUIRE(job.round() == 2);
    auto cut = node("127.0.0.2", 2, 2);
    cut.resume_round = 1;
    cut.resume_group_rank = 1;
    cut.resume_group_world_size = 2;
    auto out = job.join(8, cut, T0 + 45s);
    REQUIRE(of_type(out, MsgType::kRestart).size() == 1);
    CHECK(of_type(out, MsgType::kError).empty());
    CHECK_THAT(decoded<proto::Restart>(out[0]).reason, Catch::Contains("went on without this node"));
    CHECK(of_type(job.join(8, node("127.0.0.2", 2, 2), T0 + 45s), MsgType::kStandby).size() == 1);
  }
}

// ---- the client ----

namespace {

using mgtest::rdzv::all;
using mgtest::rdzv::armed;
using mgtest::rdzv::has;
using mgtest::rdzv::kNonce;
using mgtest::rdzv::kRdzvPort;
using mgtest::rdzv::Link;
using mgtest::rdzv::told;

ClientOptions client_options(const std::string& addr = "127.0.0.3") {
  ClientOptions o;
  o.host = "127.0.0.1";
  o.port = kRdzvPort;
  o.join = node(addr, 1, 4);
  o.join.takeover_port = 7000;
  return o;
}

std::vector<proto::Frame> sent(const ClientCommands& cs) {
  std::vector<proto::Frame> out;
  for (const auto& s : all<cmd::Send>(cs)) out.push_back(proto::frame_of(s.frame));
  return out;
}

proto::Assignment round_of(int group_rank) {
  proto::Assignment a;
  a.round = 1;
  a.group_rank = group_rank;
  a.group_world_size = 3;
  a.rank_offset = group_rank;
  a.world_size = 3;
  a.master_addr = "127.0.0.1";
  a.master_port = kRdzvPort + 1;
  a.nodes = {"127.0.0.1", "127.0.0.2", "127.0.0.3"};
  a.takeover_ports = {0, 7002, 7003};
  a.epoch = 4;
  a.voters = {"agent-127.0.0.1", "agent-127.0.0.2", "agent-127.0.0.3"};
  return a;
}


}  // namespace

TEST_CASE("quorum: the fence fires half a keep-alive interval before the server may drop a silent member") {
  CHECK(fence_after(100, 3) == 250ms);  // the server drops it after 300 ms
  CHECK(fence_after(5000, 3) == 12500ms);
  // Below three attempts there is no fence (0): its bound would fall within one or two
  // keep-alive intervals of the last echo, and every node would fence every cycle.
  CHECK(fence_after(1000, 1) == 0ms);
  CHECK(fence_after(1000, 2) == 0ms);
}

TEST_CASE("quorum: keep_alive_max_attempt below 3 arms no fence and says so once at the first round") {
  auto o = client_options();
  o.join.keep_alive_max_attempt = 1;
  Link l(o);
  l.m.start(l.now);
  l.welcome();
  auto c = l.receive(round_of(2));
  CHECK_FALSE(armed(c, ClientTimer::kFence));  // before: armed at 50 ms, before the next echo (100 ms)
  auto notes = all<cmd::Notice>(c);
  REQUIRE(notes.size() == 1);
  CHECK_THAT(notes[0].text, Catch::Contains("keep_alive_max_attempt=1 (below 3): this node does not fence itself"));
  l.now += 100ms;
  l.fire(ClientTimer::kHeartbeat);
  c = l.receive(proto::Heartbeat{1, 0});
  CHECK_FALSE(armed(c, ClientTimer::kFence));
  CHECK(all<cmd::Notice>(l.receive(round_of(2))).empty());
}

TEST_CASE("quorum: a node running a round that hears nothing from its rendezvous fences itself: its workers stop "
          "with one line saying why, its fence is reported on re-registering, and the epoch rides on its joins") {
  Link l(client_options());
  l.m.start(l.now);
  l.welcome();
  auto c = l.receive(round_of(2));
  REQUIRE(armed(c, ClientTimer::kFence) == l.now + 250ms);
  // The echo of a heartbeat moves it on, to when that heartbeat went out (the server heard
  // this node then, or later).
  l.now += 100ms;
  l.fire(ClientTimer::kHeartbeat);
  l.now += 50ms;
  c = l.receive(proto::Heartbeat{1, 0});
  CHECK(armed(c, ClientTimer::kFence) == T0 + 350ms);
  // A frame the server sends of its own (a standby count) is no echo: the server may hear
  // nothing of this node (a one-way cut), so the fence stays where it is.
  l.now += 50ms;
  c = l.receive(proto::Heartbeat{1, 1});
  CHECK_FALSE(armed(c, ClientTimer::kFence));  // before: moved to 450 ms, past the server's drop at 400 ms
  // Silence: it fires before the watchdog's outage and before the server's drop.
  l.now = T0 + 350ms;
  c = l.fire(ClientTimer::kFence);
  const auto r = told<proto::Restart>(c);
  REQUIRE(r.size() == 1);
  CHECK_THAT(r[0].reason, Catch::StartsWith("this node fenced itself: no word from the rendezvous at 127.0.0.1:") &&
                              Catch::Contains("for 0.25 s") && Catch::Contains("waiting to rejoin"));
  // The server may still hear it (a one-way cut): the fence goes out at once.
  auto f = proto::from_frame<proto::WorkerFailed>(sent(c).at(0));
  CHECK(f.rank == -1);
  CHECK_THAT(f.message, Catch::Contains("fenced itself"));
  CHECK(l.fire(ClientTimer::kFence).empty());  // once
  // The workers stopped: no fresh join on this session.
  CHECK(sent(l.m.rejoin(l.now)).empty());
  // The outage, the reconnection: the round is re-registered with the fence and the epoch.
  l.now += 200ms;
  l.m.connection_closed("timed out", l.now);
  c = l.welcome();
  auto frames = sent(c);
  auto join = std::find_if(frames.begin(), frames.end(),
                           [](const auto& x) { return proto::type_of(x) == MsgType::kJoin; });
  REQUIRE(join != frames.end());
  const auto j = proto::from_frame<proto::Join>(*join);
  CHECK(j.resume_round == 1);
  CHECK(j.epoch == 4);
  CHECK(std::any_of(frames.begin(), frames.end(),
                    [](const auto& x) { return proto::type_of(x) == MsgType::kWorkerFailed; }));
  // The job says: restart (it went on, or restarts for the fence): a fresh join follows.
  c = l.receive(proto::Restart{1, "round 1 of job 'job' went on without this node"});
  CHECK(told<proto::Restart>(c).size() == 1);
  CHECK_FALSE(armed(c, ClientTimer::kFence));
  auto again = sent(l.m.rejoin(l.now));
  REQUIRE(again.size() == 1);
  CHECK(proto::from_frame<proto::Join>(again[0]).resume_round == 0);
}

TEST_CASE("quorum: a refused, reset or closed connection is no answer (a REJECT firewall sends them), a connection "
          "accepted, a proven challenge and a welcome are: a slow handshake after a daemon restart does not fence") {
  auto o = client_options();
  o.token = "secret-token";
  Link l(o);
  l.m.start(l.now);
  const auto key = auth::job_key(o.token, o.join.job_id);
  auto handshake = [&] {
    auto c = l.m.connected(kNonce, l.now);
    const std::string server_nonce(64, 'b');
    auto ch = l.receive(proto::Challenge{server_nonce, auth::server_proof(key, kNonce, server_nonce)});
    c.insert(c.end(), ch.begin(), ch.end());
    return c;
  };
  handshake();
  l.receive(proto::Welcome{"srv", ""});
  l.receive(round_of(2));  // the fence: 250 ms from here
  SECTION("reset and refused: the fence fires at its bound") {
    l.now += 100ms;
    auto c = l.m.connection_closed("Connection reset by peer", l.now);
    CHECK_FALSE(armed(c, ClientTimer::kFence));  // before: moved on
    l.now += 100ms;
    c = l.m.connect_failed(true, "Connection refused", l.now);
    CHECK_FALSE(armed(c, ClientTimer::kFence));  // before: moved on, and a node behind a firewall never fenced
    l.now = T0 + 250ms;
    CHECK(told<proto::Restart>(l.fire(ClientTimer::kFence)).size() == 1);
  }
  SECTION("the daemon back: its accept and its challenge move the fence on, its slow welcome comes in time") {
    l.now += 100ms;
    l.m.connection_closed("end of file", l.now);
    l.now += 100ms;
    auto c = handshake();
    auto at = armed(c, ClientTimer::kFence);
    REQUIRE(at);
    CHECK(*at == l.now + 250ms);  // before: not moved, the fence fired at 250 ms mid-handshake
    l.now += 200ms;
    c = l.receive(proto::Welcome{"srv", ""});
    CHECK(armed(c, ClientTimer::kFence) == l.now + 250ms);
    CHECK(told<proto::Restart>(c).empty());
  }
}

TEST_CASE("quorum: an assignment taken after the workers stopped (take_pending) arms the fence") {
  Link l(client_options());
  l.m.start(l.now);
  l.welcome();
  l.receive(round_of(2));
  l.receive(proto::Restart{1, "rank 0 failed"});
  l.m.connection_closed("end of file", l.now);
  l.now += 100ms;
  l.fire(ClientTimer::kRetry);
  l.welcome();
  auto next = round_of(2);
  next.round = 2;
  l.receive(next);  // waits for rejoin()
  l.now += 50ms;
  REQUIRE(has<cmd::TakePending>(l.m.rejoin(l.now)));
  auto c = l.m.take_pending(l.now);
  REQUIRE(told<proto::Assignment>(c).size() == 1);
  CHECK(armed(c, ClientTimer::kFence) == l.now + 250ms);  // before: no fence for this round at all
}

TEST_CASE("quorum: the takeover search waits for a candidate that refuses (alive, not noticed yet) and passes over "
          "a silent one, the seed carries the epoch, the voters and how the host was lost") {
  SECTION("refused: waited for to the search's deadline") {
    Link l(client_options());
    l.m.start(l.now);
    l.welcome("host-a");
    l.receive(round_of(2));
    auto c = l.m.connection_closed("end of file", l.now);
    REQUIRE(all<cmd::Connect>(c).at(0).host == "127.0.0.2");
    l.m.connect_failed(true, "Connection refused", l.now);
    l.now += 100ms;
    c = l.fire(ClientTimer::kTakeover);
    CHECK_FALSE(has<cmd::HostTakeover>(c));  // not passed over: still node 1
    CHECK(armed(c, ClientTimer::kTakeover) == l.now + 100ms);
    l.now += 100ms;
    l.m.connect_failed(true, "Connection refused", l.now);
    c = l.fire(ClientTimer::kTakeover);
    CHECK_FALSE(has<cmd::HostTakeover>(c));
    // Node 1 hosts at last: this node joins it.
    c = l.welcome("host-127.0.0.2");
    CHECK_FALSE(l.m.searching());
  }
  for (bool closed : {true, false}) {
    DYNAMIC_SECTION("silent: passed over, this node hosts; the host " << (closed ? "closed" : "went silent")) {
      Link l(client_options());
      l.m.start(l.now);
      l.welcome("host-a");
      l.receive(round_of(2));
      if (closed) {
        l.m.connection_closed("end of file", l.now);
      } else {
        l.now += 450ms;
        REQUIRE(has<cmd::Connect>(l.fire(ClientTimer::kWatchdog)));
      }
      l.now += 100ms;
      auto c = l.fire(ClientTimer::kTakeover);
      auto host = all<cmd::HostTakeover>(c);
      REQUIRE(host.size() == 1);
      CHECK(host[0].seed.epoch == 4);
      CHECK(host[0].seed.voters.size() == 3);
      CHECK(host[0].seed.prev_voters.empty());  // no epoch before it was told
      CHECK(host[0].seed.host_closed == closed);
    }
  }
  SECTION("the voters changed at the last epoch: the seed carries the epoch before's too (joint majority)") {
    Link l(client_options());
    l.m.start(l.now);
    l.welcome("host-a");
    l.receive(round_of(2));
    l.receive(proto::Restart{1, "rank 0 failed"});
    l.m.rejoin(l.now);
    auto next = round_of(2);
    next.round = 2;
    next.restart_count = 1;
    next.epoch = 5;
    next.voters.push_back("agent-127.0.0.4");  // a standby registered meanwhile
    l.receive(next);
    l.m.take_pending(l.now);
    l.m.connection_closed("end of file", l.now);
    l.now += 100ms;
    auto host = all<cmd::HostTakeover>(l.fire(ClientTimer::kTakeover));
    REQUIRE(host.size() == 1);
    CHECK(host[0].seed.epoch == 5);
    CHECK(host[0].seed.voters == next.voters);
    CHECK(host[0].seed.prev_voters == round_of(2).voters);
  }
}

// The rendezvous run (#37): epochs count from 1 in every run of a job, so workers compare
// them only within one run (MGLAUNCH_RUN). It is minted once, where the Job is made, and
// carried: a takeover's Job and a restarted daemon's keep it; both sides of a split share it.
TEST_CASE("run: every round and standby of a job carries the run its Job was made with, a job taken over carries "
          "the seed's, and a fresh Job a new one (a restarted daemon: above)") {
  const std::string kRun = "1700000000000-00000000000000ab", kMinted = "1700000009999-00000000000000cd";
  SECTION("the rounds of one job: the same run at every epoch, a standby hears it too") {
    Job job("job", true, kRun);
    job.join(1, node("127.0.0.1", 2, 2), T0);
    auto assigned = of_type(job.join(2, node("127.0.0.2", 2, 2), T0), MsgType::kAssignment);
    REQUIRE(assigned.size() == 2);
    CHECK(decoded<proto::Assignment>(assigned[0]).run == kRun);
    auto told = of_type(job.join(3, node("127.0.0.3", 2, 2), T0), MsgType::kStandby);
    REQUIRE(told.size() == 1);
    CHECK(decoded<proto::Standby>(told[0]).run == kRun);
    proto::WorkerFailed f;
    f.round = 1;
    f.host = "host-127.0.0.2";
    f.rank = 1;
    job.worker_failed(2, f, T0 + 1s);
    // A node that says it ran another run at a lower epoch changes nothing.
    auto j1 = node("127.0.0.1", 2, 2);
    j1.epoch = 1;
    j1.run = kMinted;
    job.join(1, j1, T0 + 1s);
    assigned = of_type(job.join(2, node("127.0.0.2", 2, 2), T0 + 1s), MsgType::kAssignment);
    REQUIRE(assigned.size() == 2);
    CHECK(decoded<proto::Assignment>(assigned[0]).epoch == 2);
    CHECK(decoded<proto::Assignment>(assigned[0]).run == kRun);
    CHECK(job.run() == kRun);
  }
  SECTION("a takeover: the new host's Job, made with a run of its own, goes on with the seed's") {
    Job job("job", true, kMinted);
    TakeoverSeed seed = seed_of(4, 6, 3, 2, T0 + 1s);
    seed.run = kRun;
    job.take_over(seed, T0);
    for (int i = 2; i <= 3; ++i) {
      auto j = node("127.0.0." + std::to_string(i));
      j.last_group_rank = i - 1;
      j.epoch = 6;
      j.run = kRun;
      job.join(i, j, T0);
    }
    auto closed = of_type(job.tick(T0 + 1001ms), MsgType::kAssignment);
    REQUIRE(closed.size() == 2);
    CHECK(decoded<proto::Assignment>(closed[0]).run == kRun);  // before: no run at all
    // A seed without one (its node was told none: a server before #37) keeps the minted run.
    Job other("job", true, kMinted);
    other.take_over(seed_of(4, 6, 3, 2, T0 + 1s), T0);
    CHECK(other.run() == kMinted);
  }
  SECTION("a new run (fresh nodes, no run told): the Job's own, minted as MS-HEX, a different one each time") {
    CHECK(mint_run(1700000000000, 0xab) == kRun);
    const std::string a = new_run(), b = new_run();
    CHECK(proto::run_problem(a).empty());
    CHECK(a != b);
    Job job("job", true, a);
    auto assigned = of_type(job.join(1, node("127.0.0.1", 1, 1), T0), MsgType::kAssignment);
    REQUIRE(assigned.size() == 1);
    CHECK(decoded<proto::Assignment>(assigned[0]).run == a);
    CHECK(decoded<proto::Assignment>(assigned[0]).epoch == 1);
  }
}

TEST_CASE("run: a node keeps the run it was told: its re-registration carries it, and so does the seed of the job it "
          "takes over") {
  const std::string kRun = "1700000000000-00000000000000ab";
  auto a = round_of(2);
  a.run = kRun;
  SECTION("re-registering after an outage") {
    Link l(client_options());
    l.m.start(l.now);
    l.welcome();
    l.receive(a);
    l.now += 200ms;
    l.m.connection_closed("timed out", l.now);
    auto frames = sent(l.welcome());
    auto join = std::find_if(frames.begin(), frames.end(),
                             [](const auto& x) { return proto::type_of(x) == MsgType::kJoin; });
    REQUIRE(join != frames.end());
    CHECK(proto::from_frame<proto::Join>(*join).run == kRun);
  }
  SECTION("taking over after its hosting agent was lost") {
    Link l(client_options());
    l.m.start(l.now);
    l.welcome("host-a");
    l.receive(a);
    l.now += 1s;
    l.m.connection_closed("end of file", l.now);
    auto host = all<cmd::HostTakeover>(l.after(100ms, ClientTimer::kTakeover));  // node 1 silent: this node hosts
    REQUIRE(host.size() == 1);
    CHECK(host[0].seed.run == kRun);  // before: none, the new host's Job went on with a run of its own
    CHECK(host[0].seed.epoch == 4);
  }
}

TEST_CASE("quorum: a standby registering with a node that took the job over is told the seed's epoch with its voters "
          "(a round that ran), never the reserved epoch below the new host's first (review s38, 1)") {
  Job job("job", true);
  TakeoverSeed seed = seed_of(2, 2, 3, 2, T0 + 300ms);
  seed.host_rank = 1;
  job.take_over(seed, T0);
  REQUIRE(job.epoch() == takeover_epoch(2, 1) - 1);  // its Welcome's: the tie-break of its own block
  auto sb = node("127.0.0.4");
  sb.resume_standby = true;  // it followed the takeover
  sb.epoch = 2;
  sb.voters = seed.voters;
  auto told = of_type(job.join(4, sb, T0), MsgType::kStandby);
  REQUIRE(told.size() == 1);
  const auto m = decoded<proto::Standby>(told[0]);
  // Before: takeover_epoch(2, 1) - 1 with epoch 2's voters; the standby reported that pair on
  // joining another host, which adopted epoch 2's voters as a newer epoch's than any of the
  // lost host's block (adopt_voters), and so ignored the voters of the rounds that really ran.
  CHECK(m.epoch == 2);
  CHECK(m.voters == seed.voters);
}

namespace {
const std::string kThisRun = "1700000000000-00000000000000ab", kOldRun = "1600000000000-00000000000000ef";

// A leftover agent of an earlier run of the job id (kOldRun): an epoch far past this run's,
// voters that exist no more, a group rank of that run's last round.
proto::Join leftover(const std::string& addr, int last_group_rank = 0) {
  auto j = node(addr);
  j.run = kOldRun;
  j.epoch = 40;
  j.voters = {"agent-10.0.0.1", "agent-10.0.0.2", "agent-10.0.0.3"};
  j.last_group_rank = last_group_rank;
  return j;
}

// `j` re-registering group rank `rank` of round `round` of `world` nodes of run `run`, at epoch 9.
proto::Join resumed(proto::Join j, const std::string& run, int round, int rank, int world) {
  j.resume_round = round;
  j.resume_group_rank = rank;
  j.resume_group_world_size = world;
  j.epoch = 9;
  j.run = run;
  return j;
}
}  // namespace

TEST_CASE("run: a join of another run of the job id (a leftover agent of an earlier run) teaches nothing: no epoch, "
          "no run switch, no voters, no survivor's place: it joins as a plain newcomer (review s38, 2)") {
  SECTION("a running job an agent hosts: its scale-up round opens, at this run's next epoch") {
    Job job("job", true, kThisRun);
    job.join(1, node("127.0.0.1"), T0);
    job.join(2, node("127.0.0.2"), T0);
    REQUIRE(of_type(job.tick(T0 + 1001ms), MsgType::kAssignment).size() == 2);
    job.join(9, leftover("127.0.0.9"), T0 + 1100ms);  // a scale-up: 1 and 2 told to restart
    job.join(1, node("127.0.0.1"), T0 + 1200ms);
    auto out = of_type(job.join(2, node("127.0.0.2"), T0 + 1200ms), MsgType::kAssignment);
    // Before: none (the leftover's three voters adopted, none of them present: wedged until
    // join_timeout), and past it epoch 41 of the old run.
    REQUIRE(out.size() == 3);
    const auto a = decoded<proto::Assignment>(out[0]);
    CHECK(a.epoch == 2);
    CHECK(a.run == kThisRun);
    CHECK(job.run() == kThisRun);
  }
  SECTION("a job with no round yet (a daemon's): its first round is this run's epoch 1") {
    Job job("job", false, kThisRun);
    job.join(9, leftover("127.0.0.9"), T0);
    auto out = of_type(job.tick(T0 + 1001ms), MsgType::kAssignment);
    REQUIRE(out.size() == 1);
    CHECK(decoded<proto::Assignment>(out[0]).epoch == 1);  // before: 41
    CHECK(decoded<proto::Assignment>(out[0]).run == kThisRun);  // before: the old run's
  }
  SECTION("a job taken over: the leftover takes no survivor's kept place, the survivor keeps its group rank") {
    Job job("job", true, "1700000009999-00000000000000cd");
    TakeoverSeed seed = seed_of(4, 6, 3, 2, T0 + 1s);
    seed.run = kThisRun;
    seed.host_rank = 2;
    job.take_over(seed, T0);
    job.take_events();
    job.join(9, leftover("127.0.0.9", 1), T0);  // it claims group rank 1
    JobEvent e;
    REQUIRE(has_event(job, JobEvent::Kind::kJoined, &e));
    CHECK(e.how == "new");  // before: "survivor", in node 2's place
    Actions out;
    for (int i = 2; i <= 3; ++i) {
      auto j = node("127.0.0." + std::to_string(i));
      j.last_group_rank = i - 1;
      j.epoch = 6;
      j.run = kThisRun;
      auto more = job.join(static_cast<SessionId>(i), j, T0 + 10ms);
      out.insert(out.end(), more.begin(), more.end());
    }
    auto assigned = of_type(out, MsgType::kAssignment);
    REQUIRE(assigned.size() == 3);
    for (const auto& o : assigned) {
      const auto a = decoded<proto::Assignment>(o);
      CHECK(a.run == kThisRun);
      CHECK(a.epoch == takeover_epoch(6, 2));
      if (o.session == 2) CHECK(a.group_rank == 1);  // before: 0, its rank taken by the leftover
      if (o.session == 3) CHECK(a.group_rank == 2);
    }
  }
  SECTION("a restarted daemon takes the run of the round its nodes re-register; one of another run is refused") {
    Job job("job", false, "1700000009999-00000000000000cd");  // the new daemon's own run
    job.open_run();  // it has no journal of the job (rdzv::Server::job_of())
    auto resume = [](proto::Join j, const std::string& run, int rank) { return resumed(j, run, 3, rank, 2); };
    job.join(1, resume(node("127.0.0.1", 2, 2), kThisRun, 0), T0);
    REQUIRE(job.state() == Job::State::kRunning);
    CHECK(job.run() == kThisRun);
    CHECK(job.epoch() == 9);
    auto old = resume(node("127.0.0.2", 2, 2), kOldRun, 1);
    // Held, not taken as the rebuilt round's rank 1 (before #37); one node of another run
    // never drops the rebuild (review s38-late L2).
    CHECK(of_type(job.join(2, old, T0), MsgType::kError).empty());
    old.resume_round = 7;  // a later round of another run does not end this one's rebuild either
    CHECK(of_type(job.join(2, old, T0), MsgType::kError).empty());
    CHECK(job.run() == kThisRun);
    CHECK(of_type(job.join(3, resume(node("127.0.0.3", 2, 2), kThisRun, 1), T0), MsgType::kError).empty());
    auto refused = of_type(job.tick(T0 + 100ms), MsgType::kError);  // the rebuild is whole: refused
    REQUIRE(refused.size() == 1);
    CHECK(refused[0].session == 2);
    CHECK_THAT(decoded<proto::Error>(refused[0]).message, Catch::Contains("is not the rebuilt round's"));
  }
  SECTION("an agent's server (which never restarts) rebuilds no round of another run") {
    Job job("job", true, kThisRun);
    auto j = leftover("127.0.0.9");
    j.resume_round = 3;
    j.resume_group_rank = 0;
    j.resume_group_world_size = 1;
    CHECK(of_type(job.join(9, j, T0), MsgType::kError).size() == 1);  // before: its round rebuilt, its run taken
    CHECK(job.run() == kThisRun);
    CHECK(job.state() == Job::State::kJoining);
  }
}

TEST_CASE("run: a daemon restarted between rounds without a journal (a Job whose run is open) goes on with the run "
          "its nodes' fresh joins name, at their epochs, and joiners that disagree take the newest run (review s38 M1)") {
  // The restarted daemon minted a run of its own, here on a clock behind the nodes' daemon.
  Job job("job", false, "1500000000000-00000000000000cd");
  job.open_run();
  auto fresh = [](const std::string& addr, const std::string& run, int epoch) {
    auto j = node(addr);
    j.run = run;
    j.epoch = epoch;
    j.last_group_rank = 0;
    return j;
  };
  SECTION("every joiner names the job's run R at epoch E: the round runs as R, epoch E + 1") {
    job.join(1, fresh("127.0.0.1", kThisRun, 7), T0);
    job.join(2, fresh("127.0.0.2", kThisRun, 7), T0);
    auto out = of_type(job.join(3, node("127.0.0.3"), T0), MsgType::kAssignment);  // a new node names none
    REQUIRE(out.size() == 3);
    const auto a = decoded<proto::Assignment>(out[0]);
    CHECK(a.run == kThisRun);  // before: the daemon's own (older) run, epoch 1
    CHECK(a.epoch == 8);
  }
  SECTION("a leftover of an older run among them: the newest run goes on, the leftover teaches no epoch") {
    job.join(1, fresh("127.0.0.1", kThisRun, 7), T0);
    job.join(9, leftover("127.0.0.9"), T0);
    job.tick(T0 + 1001ms);
    REQUIRE(job.state() == Job::State::kRunning);
    CHECK(job.run() == kThisRun);
    CHECK(job.epoch() == 8);  // not 41
  }
  SECTION("its run is settled by its first round: a later join of another run is a plain newcomer") {
    job.join(1, fresh("127.0.0.1", kThisRun, 7), T0);
    job.tick(T0 + 1001ms);
    REQUIRE(job.run() == kThisRun);
    auto later = fresh("127.0.0.2", "1800000000000-00000000000000ab", 50);
    job.join(2, later, T0 + 2s);  // a scale-up
    job.join(1, fresh("127.0.0.1", kThisRun, 8), T0 + 2s);
    job.tick(T0 + 4s);
    CHECK(job.run() == kThisRun);
    CHECK(job.epoch() == 9);
  }
}

TEST_CASE("quorum: a standby told an older epoch's voters than it knows (by a node that took the job over and missed "
          "the last round) keeps the newer ones, and its next join names them (review s38 L3)") {
  Link l(client_options());
  l.m.start(l.now);
  l.welcome("host-a");
  auto a = round_of(2);
  a.epoch = 5;
  l.receive(a);  // epoch 5, voters 1-3
  proto::Standby sb;
  sb.active_nodes = 2;
  sb.position = 1;
  sb.round = 2;
  sb.nodes = {"127.0.0.1", "127.0.0.2"};
  sb.takeover_ports = {7001, 7002};
  sb.epoch = 2;
  sb.voters = {"agent-127.0.0.1", "agent-127.0.0.9"};
  l.receive(sb);
  l.m.connection_closed("end of file", l.now);
  const auto go = all<cmd::Connect>(l.after(100ms, ClientTimer::kTakeover));  // node 1 silent
  REQUIRE(go.size() == 1);
  CHECK(go[0].host == "127.0.0.2");
  auto frames = sent(l.welcome("host-127.0.0.2"));
  auto join = std::find_if(frames.begin(), frames.end(), [](const auto& x) { return proto::type_of(x) == MsgType::kJoin; });
  REQUIRE(join != frames.end());
  const auto j = proto::from_frame<proto::Join>(*join);
  CHECK(j.epoch == 5);
  CHECK(j.voters == a.voters);  // before: none (its voters were epoch 2's, its epoch 5)
}

TEST_CASE("run: a fresh job an agent hosts (its agent started again at the endpoint) refuses a node that ran rounds "
          "of another run, and never makes its own new run that job's (review s38 L2)") {
  Job job("job", true, kThisRun);
  auto j = node("127.0.0.2");
  j.run = kOldRun;  // the run the majority goes on with elsewhere
  j.epoch = 3;
  j.last_group_rank = 1;
  auto refused = of_type(job.join(2, j, T0), MsgType::kError);
  REQUIRE(refused.size() == 1);  // before: stripped, and the first round opened as this run, epoch 1
  CHECK_THAT(decoded<proto::Error>(refused[0]).message, Catch::Contains("ran epoch 3 of run " + kOldRun));
  CHECK(of_type(job.tick(T0 + 1001ms), MsgType::kAssignment).empty());
  CHECK(job.state() == Job::State::kJoining);
  // A node that ran no round (epoch 0) is a plain newcomer, as is any once a round ran here.
  j.epoch = 0;
  CHECK(of_type(job.join(2, j, T0), MsgType::kError).empty());
}

TEST_CASE("run: a restarted daemon orders the runs its nodes re-register by their MS: a newer run's round replaces "
          "the rebuild of an older one, and a rebuild that claims no run takes the first run named (review s38 L1)") {
  Job job("job", false, "1900000000000-00000000000000cd");  // the restarted daemon's own run
  job.open_run();
  auto resume = [](const std::string& addr, const std::string& run, int round, int rank) {
    auto j = node(addr, 2, 2);
    j.resume_round = round;
    j.resume_group_rank = rank;
    j.resume_group_world_size = 2;
    j.epoch = run.empty() ? 0 : 9;
    j.run = run;
    return j;
  };
  SECTION("a leftover of an older run re-registers first: the live run's nodes replace its rebuild") {
    job.join(9, resume("127.0.0.9", kOldRun, 3, 0), T0);
    REQUIRE(job.run() == kOldRun);
    // One node of the live run waits (one node never drops a rebuild, review s38-late L2) ...
    CHECK(job.join(1, resume("127.0.0.1", kThisRun, 2, 0), T0).empty());
    CHECK(job.run() == kOldRun);
    // ... and the second, more than the rebuild's one, replaces it.
    auto out = job.join(2, resume("127.0.0.2", kThisRun, 2, 1), T0);
    CHECK(of_type(out, MsgType::kError).size() == 1);  // to the leftover; before 207dbf4: to node 1
    CHECK(of_type(out, MsgType::kError)[0].session == 9);
    CHECK(job.run() == kThisRun);
    CHECK(job.epoch() == 9);
    CHECK(job.state() == Job::State::kRunning);
    CHECK(job.round() == 2);
    // The older run's leftover, back again, is refused and drops nothing.
    CHECK(of_type(job.join(9, resume("127.0.0.9", kOldRun, 7, 0), T0), MsgType::kError).size() == 1);
    CHECK(job.run() == kThisRun);
  }
  SECTION("the first re-registration claims no run (an agent before #37): the first run named is the job's") {
    job.join(1, resume("127.0.0.1", "", 2, 0), T0);
    CHECK(of_type(job.join(2, resume("127.0.0.2", kThisRun, 2, 1), T0), MsgType::kError).empty());  // before: refused
    CHECK(job.run() == kThisRun);
    CHECK(job.epoch() == 9);
  }
}

TEST_CASE("run: a restarted daemon's Job seeded from its journal with run and epoch runs fresh joins that name neither "
          "one epoch on and a Job whose run is open journals no run until a round settles it (review s38-late H1 and M2)") {
  SECTION("seeded: run R at epoch 5, a requeue's fresh join -> (R, 6), and its events carry the epoch") {
    Job job("job", false, kThisRun);
    job.seed_epoch(5);
    job.take_events();
    const auto out = of_type(job.join(1, node("127.0.0.1", 1, 1), T0), MsgType::kAssignment);
    REQUIRE(out.size() == 1);
    const auto a = decoded<proto::Assignment>(out[0]);
    CHECK(a.run == kThisRun);
    CHECK(a.epoch == 6);  // before: 1, which mgtrain's same-run fence refuses (exit 4)
    bool journaled = false;
    for (const auto& e : job.take_events())
      if (e.kind == JobEvent::Kind::kRoundStarted) {
        const auto j = json_of(e);
        CHECK(j.value("run", "") == kThisRun);
        CHECK(j.value("epoch", 0) == 6);
        journaled = true;
      }
    CHECK(journaled);
  }
  SECTION("open: the created event names no run; the round_started event names the run its nodes settled") {
    Job job("job", false, "1500000000000-00000000000000cd");
    job.open_run();
    auto j1 = node("127.0.0.1", 1, 1);
    j1.run = kThisRun;
    j1.epoch = 7;
    j1.last_group_rank = 0;
    job.join(1, j1, T0);
    bool created = false, started = false;
    for (const auto& e : job.take_events()) {
      const auto j = json_of(e);
      if (e.kind == JobEvent::Kind::kCreated) {
        created = true;
        CHECK(!j.contains("run"));  // before: the daemon's provisional run
      } else if (e.kind == JobEvent::Kind::kRoundStarted) {
        started = true;
        CHECK(j.value("run", "") == kThisRun);
        CHECK(j.value("epoch", 0) == 8);
      }
    }
    CHECK(created);
    CHECK(started);
  }
}

TEST_CASE("quorum: a node that took the job over hears a majority until its takeover's deadline, while its survivors "
          "may still be searching: its shortfall (and its agent's seeking) counts from there (review s38, 3)") {
  Job job("job", true);
  TakeoverSeed seed = seed_of(2, 2, 3, 2, T0 + 1s);  // the deadline: the survivors search that long
  seed.host_rank = 1;
  job.take_over(seed, T0);
  auto j2 = node("127.0.0.2");
  j2.last_group_rank = 1;
  job.join(2, j2, T0);  // the new host itself: 1 of the 3 voters
  // Before: false here, so its agent began to look elsewhere K x A after its first ask
  // (client_machine.h, Seeking) while survivors that noticed the loss up to 2 K later still
  // searched for it, and might stop hosting (leave for the old host back after a short cut).
  CHECK(job.hears_majority());
  job.tick(T0 + 999ms);
  CHECK(job.hears_majority());
  job.tick(T0 + 1001ms);  // past the deadline: the survivors not here are not coming
  CHECK_FALSE(job.hears_majority());
  CHECK(job.state() == Job::State::kRestarting);
  // A survivor late past the deadline still makes the majority, and the round opens.
  auto j3 = node("127.0.0.3");
  j3.last_group_rank = 2;
  job.join(3, j3, T0 + 1100ms);
  CHECK(job.hears_majority());
  CHECK(of_type(job.tick(T0 + 2101ms), MsgType::kAssignment).size() == 2);
}

TEST_CASE("quorum: a node that took the job over and is still short of a majority at its takeover's deadline tells "
          "it again there, though its last call told it inside the window (review s38 M2)") {
  // Node 2 (group rank 1) took round 2 of three voters over, alone; its survivors may come
  // until T0 + 5 s.
  Job job("job", true);
  job.take_over([] {
    auto seed = seed_of(2, 2, 3, 2, T0 + 5s);
    seed.host_rank = 1;
    return seed;
  }(), T0);
  auto j2 = node("127.0.0.2");
  j2.last_group_rank = 1;
  job.join(2, j2, T0);
  job.take_events();
  job.tick(T0 + 1001ms);  // the last call, inside the window: told once, heard as "majority"
  CHECK(has_event(job, JobEvent::Kind::kNoQuorum));
  CHECK(job.hears_majority());
  job.tick(T0 + 3s);
  CHECK_FALSE(has_event(job, JobEvent::Kind::kNoQuorum));  // once per round, as before
  job.tick(T0 + 5001ms);  // the deadline: the survivors are not coming
  CHECK(has_event(job, JobEvent::Kind::kNoQuorum));  // before: nothing, and nobody asked again
  CHECK_FALSE(job.hears_majority());
  CHECK(job.state() == Job::State::kRestarting);
}

TEST_CASE("quorum: a node whose workers stopped during its takeover search goes on asking every K, once it hosts, "
          "whether its server hears a majority (review s38, 3)") {
  // Before: the ask's timer fired during the search (node 1 silent for K) and was not armed
  // again; the node took the job over alone and, its server's "no majority" event answered
  // while its takeover's survivors could still come (above), never looked for the job: in
  // the partition test 'node 2 cut off' it waited out join_timeout instead of rejoining.
  Link l(client_options());  // group rank 2
  l.m.start(l.now);
  l.welcome("host-a");
  l.receive(round_of(2));
  l.m.connection_closed("end of file", l.now);  // the search: node 1 first
  auto c = l.m.rejoin(l.now);                     // its workers stopped at once
  REQUIRE(armed(c, ClientTimer::kMajority) == l.now + 100ms);
  l.now += 100ms;
  c = l.fire(ClientTimer::kMajority);
  CHECK_FALSE(has<cmd::AskMajority>(c));  // no server of its own yet
  CHECK(armed(c, ClientTimer::kMajority) == l.now + 100ms);  // before: none
  REQUIRE(has<cmd::HostTakeover>(l.fire(ClientTimer::kTakeover)));  // node 1 passed over
  l.m.hosted({"127.0.0.3", 7003}, l.now);
  l.welcome("host-127.0.0.3");
  CHECK(has<cmd::AskMajority>(l.after(100ms, ClientTimer::kMajority)));
}

TEST_CASE("quorum: a node whose host took the job over and then left it (a minority host that found the majority) "
          "waits to rejoin and finds the job at its endpoint, never a candidate (review s38, 4)") {
  // Four nodes, node 0 (the endpoint) hosting. Cut {0, 1} | {2, 3}: node 3 passes over node 1
  // (silent) and follows node 2, which took over without a majority. After the heal node 2
  // finds node 0's newer round and stops hosting: its connection closes. Node 1 (alive, not
  // hosting) refuses; the endpoint, where the job runs, offers no takeover port.
  proto::Assignment a = round_of(3);
  a.group_world_size = 4;
  a.world_size = 4;
  a.nodes = {"127.0.0.1", "127.0.0.2", "127.0.0.3", "127.0.0.4"};
  a.takeover_ports = {0, 7002, 7003, 7004};
  a.voters.push_back("agent-127.0.0.4");
  Link l(client_options("127.0.0.4"));
  l.m.start(l.now);
  l.welcome("host-a");
  l.receive(a);
  l.now += 450ms;
  REQUIRE(all<cmd::Connect>(l.fire(ClientTimer::kWatchdog)).at(0).host == "127.0.0.2");
  l.now += 100ms;
  REQUIRE(all<cmd::Connect>(l.fire(ClientTimer::kTakeover)).at(0).host == "127.0.0.3");  // node 1 silent
  l.welcome("host-127.0.0.3");
  REQUIRE_FALSE(l.m.searching());
  l.now += 1s;
  auto c = l.m.connection_closed("end of file", l.now);  // node 2 stops hosting
  REQUIRE(all<cmd::Connect>(c).at(0).host == "127.0.0.2");
  for (int i = 0; i < 3; ++i) {  // node 1 refuses to the search's deadline
    l.m.connect_failed(true, "Connection refused", l.now);
    l.now += 100ms;
    c = l.fire(ClientTimer::kTakeover);
  }
  // Before: the search's end, an Abort naming the lost host (exit 3), while the job ran at
  // its endpoint.
  CHECK(told<proto::Abort>(c).empty());
  REQUIRE(l.m.searching());
  bool endpoint = false;
  for (int i = 0; i < 4 && !endpoint; ++i) {
    for (const auto& x : all<cmd::Connect>(c)) endpoint = endpoint || (x.host == "127.0.0.1" && x.port == kRdzvPort);
    if (!endpoint) {
      l.now += 100ms;
      c = l.fire(ClientTimer::kTakeover);
    }
  }
  CHECK(endpoint);
  l.welcome("host-a");
  CHECK_FALSE(l.m.searching());
}

// Review s38-late L2: runs that disagree were ordered by their MS alone, which favours a
// leftover of a run minted on a clock that ran ahead: a daemon restarted between rounds took
// its run for the job's (mgtrain then refuses the majority's writes), and one such node
// re-registering dropped a live rebuild of the majority's run (Error to every member).
TEST_CASE("run: joiners and re-registrations that name different runs go on with the run most of them name, by MS "
          "only between as many, and one node of another run never drops a live rebuild (review s38-late L2)") {
  const std::string ahead = "1990000000000-00000000000000ff";  // a leftover minted on a clock far ahead
  SECTION("fresh joins: two name this run, one a clock-ahead leftover's: this run goes on") {
    Job job("job", false, "1500000000000-00000000000000cd");
    job.open_run();
    for (const auto& [s, addr, run] : {std::tuple{1, "127.0.0.1", kThisRun}, std::tuple{2, "127.0.0.2", kThisRun},
                                       std::tuple{3, "127.0.0.3", ahead}}) {
      auto j = node(addr);
      j.run = run;
      j.epoch = run == kThisRun ? 7 : 40;
      job.join(static_cast<SessionId>(s), j, T0);
    }
    REQUIRE(job.state() == Job::State::kRunning);  // (the third join fills the round)
    CHECK(job.run() == kThisRun);  // before: the leftover's (newest by MS)
    CHECK(job.epoch() == 8);
  }
  SECTION("a live rebuild of this run and one clock-ahead leftover: nothing dropped; the leftover is refused once the "
          "rebuild is whole") {
    Job job("job", false, "1500000000000-00000000000000cd");
    job.open_run();
    auto resume = [](const std::string& addr, const std::string& run, int rank) {
      return resumed(node(addr, 3, 3), run, 4, rank, 3);
    };
    job.join(1, resume("127.0.0.1", kThisRun, 0), T0);
    job.join(2, resume("127.0.0.2", kThisRun, 1), T0);
    REQUIRE(job.run() == kThisRun);
    auto out = job.join(9, resume("127.0.0.9", ahead, 0), T0);
    CHECK(of_type(out, MsgType::kError).empty());  // before: Error to nodes 1 and 2, the rebuild dropped
    CHECK(job.run() == kThisRun);
    CHECK(job.tick(T0 + 100ms).empty());  // it waits while the rebuild does
    job.join(3, resume("127.0.0.3", kThisRun, 2), T0 + 200ms);
    out = job.tick(T0 + 300ms);
    REQUIRE(of_type(out, MsgType::kError).size() == 1);
    CHECK(of_type(out, MsgType::kError)[0].session == 9);
    CHECK_THAT(decoded<proto::Error>(of_type(out, MsgType::kError)[0]).message, Catch::Contains("its run " + ahead));
    CHECK(job.state() == Job::State::kRunning);
    CHECK(job.run() == kThisRun);
  }
}
