// The rendezvous job state machine, driven with a fake clock (time points passed in).
#include <catch2/catch.hpp>

#include <map>
#include <set>

#include "rendezvous/job.h"
#include "rendezvous/journal.h"
#include "support/fake_clock.h"

using namespace mg;
using namespace mg::rdzv;
using namespace std::chrono_literals;
using proto::MsgType;

namespace {

using mgtest::rdzv::node;
using mgtest::rdzv::of_type;
using mgtest::rdzv::T0;

}  // namespace

TEST_CASE("a static job closes its round the moment N nodes joined, with deterministic ranks") {
  Job job("job");
  CHECK(job.join(1, node("127.0.0.3", 3, 3), T0).empty());
  CHECK(job.join(2, node("127.0.0.1", 3, 3, 4), T0).empty());
  auto out = job.join(3, node("127.0.0.2", 3, 3), T0);
  auto assigned = of_type(out, MsgType::kAssignment);
  REQUIRE(assigned.size() == 3);
  CHECK(job.state() == Job::State::kRunning);
  std::map<SessionId, proto::Assignment> by_session;
  for (auto& o : assigned) by_session[o.session] = proto::from_frame<proto::Assignment>(o.frame);
  // Sorted by address: 127.0.0.1 (session 2) is group rank 0 and the master.
  CHECK(by_session[2].group_rank == 0);
  CHECK(by_session[3].group_rank == 1);
  CHECK(by_session[1].group_rank == 2);
  CHECK(by_session[3].rank_offset == 4);
  CHECK(by_session[1].rank_offset == 6);
  for (auto& [s, a] : by_session) {
    CHECK(a.world_size == 8);
    CHECK(a.master_addr == "127.0.0.1");
    CHECK(a.group_world_size == 3);
  }
}

TEST_CASE("nodes that would take the world past 2^31-1 ranks are refused, never an overflowed world size (#23 D9)") {
  Job job("job");
  constexpr int kNodes = 32769;  // x 65536 workers (the protocol's most): 32767 nodes fit below 2^31
  Actions out;
  for (int i = 0; i < kNodes; ++i) {
    auto j = node("127.0." + std::to_string(i / 256) + "." + std::to_string(i % 256), kNodes, kNodes, proto::kMaxNproc);
    j.agent_id = "agent-" + std::to_string(i);
    out = job.join(static_cast<SessionId>(i + 1), j, T0);
  }
  auto assigned = of_type(out, MsgType::kAssignment);
  auto refused = of_type(out, MsgType::kError);
  CHECK(refused.size() == 2);
  REQUIRE(assigned.size() == kNodes - 2);
  const auto a = proto::from_frame<proto::Assignment>(assigned.front().frame);
  CHECK(a.world_size == (kNodes - 2) * proto::kMaxNproc);
  CHECK(a.world_size > 0);
  CHECK_THAT(proto::from_frame<proto::Error>(refused.front().frame).message, Catch::Contains("2147483647 ranks"));
}

TEST_CASE("an explicit node rank comes before address order") {
  Job job("job");
  auto a = node("127.0.0.1", 2, 2);
  auto b = node("127.0.0.9", 2, 2);
  b.node_rank = 0;
  job.join(1, a, T0);
  auto out = of_type(job.join(2, b, T0), MsgType::kAssignment);
  REQUIRE(out.size() == 2);
  for (auto& o : out)
    if (o.session == 2) CHECK(proto::from_frame<proto::Assignment>(o.frame).group_rank == 0);
}

TEST_CASE("an elastic job waits last_call_timeout after MIN for more nodes") {
  Job job("job");
  job.join(1, node("127.0.0.1", 2, 3), T0);
  CHECK(job.join(2, node("127.0.0.2", 2, 3), T0 + 10ms).empty());
  CHECK(job.tick(T0 + 500ms).empty());  // last call still open
  CHECK(job.join(3, node("127.0.0.3", 2, 3), T0 + 600ms).size() == 3);  // MAX closes at once
  Job late("job");
  late.join(1, node("127.0.0.1", 2, 3), T0);
  late.join(2, node("127.0.0.2", 2, 3), T0);
  CHECK(late.tick(T0 + 999ms).empty());
  CHECK(of_type(late.tick(T0 + 1001ms), MsgType::kAssignment).size() == 2);
}

TEST_CASE("a node joining a running job below MAX triggers a new round without spending a restart") {
  Job job("job");
  job.join(1, node("127.0.0.1", 1, 2), T0);
  job.tick(T0 + 2s);
  REQUIRE(job.state() == Job::State::kRunning);
  auto out = job.join(2, node("127.0.0.2", 1, 2), T0 + 3s);
  CHECK(of_type(out, MsgType::kRestart).size() == 1);
  CHECK(job.join(1, node("127.0.0.1", 1, 2), T0 + 3s).size() == 2);  // both assigned
  CHECK(job.restart_count() == 0);
  CHECK(job.round() == 2);
}

TEST_CASE("a worker failure restarts every node with one restart count, then aborts when spent") {
  Job job("job");
  job.join(1, node("127.0.0.1", 2, 2, 2, 1), T0);
  job.join(2, node("127.0.0.2", 2, 2, 2, 1), T0);
  proto::WorkerFailed f;
  f.round = 1;
  f.rank = 3;
  f.exit_code = 7;
  auto out = job.worker_failed(2, f, T0 + 1s);
  auto restarts = of_type(out, MsgType::kRestart);
  REQUIRE(restarts.size() == 2);
  for (auto& r : restarts) CHECK(proto::from_frame<proto::Restart>(r.frame).restart_count == 1);
  job.join(1, node("127.0.0.1", 2, 2, 2, 1), T0 + 1s);
  auto again = of_type(job.join(2, node("127.0.0.2", 2, 2, 2, 1), T0 + 1s), MsgType::kAssignment);
  REQUIRE(again.size() == 2);
  CHECK(proto::from_frame<proto::Assignment>(again[0].frame).restart_count == 1);
  f.round = 2;
  auto aborts = of_type(job.worker_failed(1, f, T0 + 2s), MsgType::kAbort);
  REQUIRE(aborts.size() == 2);
  CHECK(proto::from_frame<proto::Abort>(aborts[0].frame).root_cause.exit_code == 7);
  CHECK(job.state() == Job::State::kFailed);
  CHECK(of_type(job.join(3, node("127.0.0.3", 2, 2), T0 + 3s), MsgType::kError).size() == 1);
}

TEST_CASE("a failure of a node as a whole (no rank) is told without 'rank -1', in the restart and the abort (#35)") {
  // Seen before: "restart 2 decided by the rendezvous: rank -1 on vm exited with 143".
  Job job("job");
  job.join(1, node("127.0.0.1", 2, 2, 2, 1), T0);
  job.join(2, node("127.0.0.2", 2, 2, 2, 1), T0);
  job.take_events();
  proto::WorkerFailed f;  // as an agent stopped by SIGTERM reports it (launcher/supervisor.cc leave_job)
  f.round = 1;
  f.host = "vm";
  f.rank = f.local_rank = -1;
  f.exit_code = 143;
  f.signal = 15;
  f.message = "node vm (node rank 1) was stopped by SIGTERM";
  auto restarts = of_type(job.worker_failed(2, f, T0 + 1s), MsgType::kRestart);
  REQUIRE(restarts.size() == 2);
  const std::string reason = proto::from_frame<proto::Restart>(restarts[0].frame).reason;
  CHECK(reason == "node vm (node rank 1) was stopped by SIGTERM (exit code 143)");
  // The daemon's event log (#38) too: its line and its JSON (rank null).
  const auto events = job.take_events();
  REQUIRE_FALSE(events.empty());
  CHECK(text_of(events[0]) == "job 'job': node host-127.0.0.2 (127.0.0.2, agent agent-127.0.0.2) failed with exit "
                              "code 143 (signal 15): node vm (node rank 1) was stopped by SIGTERM");
  CHECK(json_of(events[0])["rank"].is_null());
  for (const auto& e : events) CHECK_THAT(text_of(e), !Catch::Contains("rank -1"));
  job.join(1, node("127.0.0.1", 2, 2, 2, 1), T0 + 1s);
  job.join(2, node("127.0.0.2", 2, 2, 2, 1), T0 + 1s);
  f.round = 2;
  f.message.clear();  // (an agent that says nothing more)
  auto aborts = of_type(job.worker_failed(2, f, T0 + 2s), MsgType::kAbort);
  REQUIRE(aborts.size() == 2);
  CHECK(proto::from_frame<proto::Abort>(aborts[0].frame).reason == "node vm exited with 143");
  CHECK(failed_who(f) == "node vm");
  f.rank = 3;
  CHECK(failure_text(f) == "rank 3 on vm exited with 143");
}

TEST_CASE("a silent node is declared lost after keep_alive_interval x max attempts") {
  Job job("job");
  job.join(1, node("127.0.0.1", 2, 2), T0);
  job.join(2, node("127.0.0.2", 2, 2), T0);
  job.heartbeat(1, T0 + 250ms);
  CHECK(job.tick(T0 + 290ms).empty());
  job.heartbeat(1, T0 + 300ms);
  auto out = job.tick(T0 + 310ms);  // node 2 silent for 310 ms > 3 x 100 ms
  auto aborts = of_type(out, MsgType::kAbort);
  REQUIRE(aborts.size() == 2);
  CHECK_THAT(proto::from_frame<proto::Abort>(aborts[0].frame).root_cause.message, Catch::Contains("missed 3 heartbeats"));
}

TEST_CASE("a closed connection ends the round and survivors restart while restarts remain") {
  Job job("job");
  job.join(1, node("127.0.0.1", 1, 2, 1, 2), T0);
  job.join(2, node("127.0.0.2", 1, 2, 1, 2), T0);
  auto out = job.disconnected(2, T0 + 1s);
  auto restarts = of_type(out, MsgType::kRestart);
  REQUIRE(restarts.size() == 1);
  CHECK(restarts[0].session == 1);
  job.join(1, node("127.0.0.1", 1, 2, 1, 2), T0 + 1s);
  auto assigned = of_type(job.tick(T0 + 3s), MsgType::kAssignment);  // MIN 1 after last call
  REQUIRE(assigned.size() == 1);
  CHECK(proto::from_frame<proto::Assignment>(assigned[0].frame).world_size == 1);
}

TEST_CASE("the job is done when every node reports done, and too few nodes time out") {
  Job job("job");
  job.join(1, node("127.0.0.1", 2, 2), T0);
  job.join(2, node("127.0.0.2", 2, 2), T0);
  CHECK(job.node_done(1, 1, T0 + 1s).empty());
  CHECK(job.node_done(2, 0, T0 + 1s).empty());  // a stale round's report does not count
  CHECK(of_type(job.node_done(2, 1, T0 + 1s), MsgType::kDone).size() == 2);
  CHECK(job.state() == Job::State::kDone);
  Job lonely("job");
  lonely.join(1, node("127.0.0.1", 2, 2), T0);
  CHECK(lonely.tick(T0 + 4s).empty());
  CHECK(of_type(lonely.tick(T0 + 6s), MsgType::kAbort).size() == 1);
}

TEST_CASE("messages round-trip through frames and reject the wrong type") {
  proto::Assignment a;
  a.round = 1;
  a.master_addr = "x";
  a.nodes = {"x", "y"};
  a.world_size = 9;
  auto back = proto::from_frame<proto::Assignment>(proto::decode(proto::encode(proto::to_frame(a))).frame);
  CHECK(back.nodes == a.nodes);
  CHECK(back.world_size == 9);
  CHECK_THROWS_AS(proto::from_frame<proto::Join>(proto::to_frame(a)), proto::ProtocolError);
  proto::Frame missing{static_cast<std::uint8_t>(MsgType::kJoin), {{"job_id", "j"}, {"agent_id", "a"}, {"addr", "x"}}};
  CHECK(proto::from_frame<proto::Join>(missing).nproc == 1);  // absent fields take defaults
}

TEST_CASE("a restarted server rebuilds the running round from re-registering nodes") {
  Job job("job");
  auto a = node("127.0.0.1", 2, 2);
  auto b = node("127.0.0.2", 2, 2);
  for (auto* j : {&a, &b}) {
    j->resume_round = 4;
    j->resume_restart_count = 1;
    j->resume_group_world_size = 2;
  }
  a.resume_group_rank = 0;
  b.resume_group_rank = 1;
  a.resume_done = true;
  CHECK(job.join(7, a, T0).empty());
  CHECK(job.state() == Job::State::kRunning);
  CHECK(job.round() == 4);
  CHECK(job.restart_count() == 1);
  CHECK(job.node_done(7, 4, T0).empty());  // node b has not re-registered yet
  CHECK(job.join(8, b, T0).empty());
  CHECK(of_type(job.node_done(8, 4, T0), MsgType::kDone).size() == 2);
}

namespace {
std::string error_of(const Actions& a) {
  auto e = of_type(a, MsgType::kError);
  return e.empty() ? "" : proto::from_frame<proto::Error>(e[0].frame).message;
}
}  // namespace

TEST_CASE("a node of the rebuilt round that never re-registers with the restarted server is lost after join_timeout, "
          "and the job's end names that loss (#26, chaos soak)") {
  // The server restarted while node B died: A re-registers round 3 of 2 nodes, B never
  // does. The job waited for B for ever (A's workers kept running, A heartbeating).
  Job job("job");
  auto a = node("127.0.0.1", 2, 2, 2, /*max_restarts=*/3);
  a.resume_round = 3;
  a.resume_group_rank = 0;
  a.resume_group_world_size = 2;
  CHECK(job.join(1, a, T0).empty());
  REQUIRE(job.state() == Job::State::kRunning);
  auto t = T0;
  for (; t < T0 + 5000ms; t += 100ms) {
    job.heartbeat(1, t);
    REQUIRE(job.tick(t).empty());
  }
  job.heartbeat(1, t);
  auto out = job.tick(t);
  auto restart = of_type(out, MsgType::kRestart);
  REQUIRE(restart.size() == 1);
  CHECK(restart[0].session == 1);
  const auto why = proto::from_frame<proto::Restart>(restart[0].frame).reason;
  CHECK_THAT(why, Catch::Contains("1 of the 2 nodes of round 3 (group rank 1) lost") &&
                      Catch::Contains("not re-registered with the restarted rendezvous server within join_timeout"));
  CHECK(job.state() == Job::State::kRestarting);
  // A re-joins; nobody else comes: the job fails at join_timeout with that loss as its cause.
  CHECK(job.join(1, node("127.0.0.1", 2, 2, 2, 3), t).empty());
  auto end = of_type(job.tick(t + 5001ms), MsgType::kAbort);
  REQUIRE(end.size() == 1);
  CHECK_THAT(proto::from_frame<proto::Abort>(end[0].frame).reason,
             Catch::Contains("only 1 of at least 2 nodes joined") && Catch::Contains("after restart 1 (1 of the 2 nodes"));
}

TEST_CASE("a job that fails at join_timeout after a node was lost names the lost node as root cause (#26)") {
  Job job("job");
  job.join(1, node("127.0.0.1", 2, 2, 2, 3), T0);
  job.join(2, node("127.0.0.2", 2, 2, 2, 3), T0);
  REQUIRE(job.state() == Job::State::kRunning);
  CHECK(of_type(job.disconnected(2, T0), MsgType::kRestart).size() == 1);
  CHECK(job.join(1, node("127.0.0.1", 2, 2, 2, 3), T0).empty());
  auto end = of_type(job.tick(T0 + 5001ms), MsgType::kAbort);
  REQUIRE(end.size() == 1);
  const auto abort = proto::from_frame<proto::Abort>(end[0].frame);
  CHECK(abort.root_cause.host == "host-127.0.0.2");
  CHECK_THAT(abort.reason, Catch::Contains("only 1 of at least 2 nodes joined job 'job' within join_timeout after "
                                           "restart 1 (node host-127.0.0.2 (127.0.0.2) lost: its connection closed)"));
  CHECK(abort.final);  // (not short of a majority: the job ends for good)
}

TEST_CASE("a forged re-registration cannot end or enter a job that is not being rebuilt") {
  auto resume = [](proto::Join j, int round, int rank, int world) {
    j.resume_round = round;
    j.resume_group_rank = rank;
    j.resume_group_world_size = world;
    j.resume_done = true;
    return j;
  };
  SECTION("a job with nodes waiting to start") {
    Job job("job");
    CHECK(job.join(1, node("127.0.0.1", 2, 2), T0).empty());
    auto out = job.join(9, resume(node("127.0.0.9", 2, 2), 1, 0, 1), T0);
    CHECK_THAT(error_of(out), Catch::Contains("re-registration refused"));
    CHECK(of_type(out, MsgType::kDone).empty());
    CHECK(job.state() == Job::State::kJoining);
  }
  SECTION("a running job") {
    Job job("job");
    job.join(1, node("127.0.0.1", 2, 2), T0);
    job.join(2, node("127.0.0.2", 2, 2), T0);
    REQUIRE(job.state() == Job::State::kRunning);
    auto out = job.join(9, resume(node("127.0.0.9", 2, 2), 1, 1, 2), T0);
    CHECK_THAT(error_of(out), Catch::Contains("not being rebuilt"));
    CHECK(job.disconnected(9, T0).empty());  // and leaving again aborts nothing
    CHECK(job.state() == Job::State::kRunning);
  }
  SECTION("a rebuild with a taken slot or a different round") {
    Job job("job");
    CHECK(job.join(1, resume(node("127.0.0.1", 2, 2), 3, 0, 2), T0).empty());
    CHECK_THAT(error_of(job.join(2, resume(node("127.0.0.2", 2, 2), 3, 0, 2), T0)), Catch::Contains("group rank 0 is taken"));
    CHECK_THAT(error_of(job.join(3, resume(node("127.0.0.3", 2, 2), 2, 1, 2), T0)), Catch::Contains("does not match"));
    CHECK_THAT(error_of(job.join(4, resume(node("127.0.0.4", 2, 2), 3, 1, 1), T0)), Catch::Contains("does not match"));
    CHECK(job.state() == Job::State::kRunning);
    CHECK(of_type(job.join(5, resume(node("127.0.0.5", 2, 2), 3, 1, 2), T0), MsgType::kDone).size() == 2);
  }
}

TEST_CASE("after a server restart a later round's re-registration wins over a node left out of it") {
  // Node A was declared lost in round 1; the job went on to round 2 (restart 1) with B and
  // C. The server restarts and A, back from its outage, re-registers first.
  auto resume = [](proto::Join j, int round, int restart, int rank) {
    j.resume_round = round;
    j.resume_restart_count = restart;
    j.resume_group_rank = rank;
    j.resume_group_world_size = 2;
    return j;
  };
  Job job("job");
  CHECK(job.join(1, resume(node("127.0.0.1", 2, 2), 1, 0, 1), T0).empty());
  auto out = job.join(2, resume(node("127.0.0.2", 2, 2), 2, 1, 0), T0);
  CHECK_THAT(error_of(out), Catch::Contains("without this node"));
  REQUIRE(of_type(out, MsgType::kError).size() == 1);
  CHECK(of_type(out, MsgType::kError)[0].session == 1);  // A is told, B is taken
  CHECK(job.round() == 2);
  CHECK(job.restart_count() == 1);
  // An older claim after the newer one is refused, as before.
  CHECK_THAT(error_of(job.join(4, resume(node("127.0.0.4", 2, 2), 1, 0, 1), T0)), Catch::Contains("does not match"));
  CHECK(job.join(3, resume(node("127.0.0.3", 2, 2), 2, 1, 1), T0).empty());
  CHECK(of_type(job.node_done(2, 2, T0), MsgType::kDone).empty());
  CHECK(of_type(job.node_done(3, 2, T0), MsgType::kDone).size() == 2);
}

TEST_CASE("after a server restart the running round's re-registration wins over a new node that joined first: it "
          "becomes the round's standby (#26, found by the chaos soak)") {
  // The job ran round 2 (restart 1) with A and B. The server restarts; a replacement node N,
  // started meanwhile, reaches it before A and B do. A and B were refused ("other nodes are
  // waiting for a new round") and the job wedged until join_timeout.
  auto resume = [](proto::Join j, int rank) {
    j.resume_round = 2;
    j.resume_restart_count = 1;
    j.resume_group_rank = rank;
    j.resume_group_world_size = 2;
    return j;
  };
  Job job("job");
  CHECK(job.join(1, node("127.0.0.9", 2, 2), T0).empty());
  auto out = job.join(2, resume(node("127.0.0.1", 2, 2), 0), T0);
  CHECK(error_of(out).empty());
  REQUIRE(of_type(out, MsgType::kStandby).size() == 1);
  CHECK(of_type(out, MsgType::kStandby)[0].session == 1);
  CHECK(job.state() == Job::State::kRunning);
  CHECK(job.round() == 2);
  CHECK(job.restart_count() == 1);
  CHECK(error_of(job.join(3, resume(node("127.0.0.2", 2, 2), 1), T0)).empty());
  CHECK(job.describe(T0)["standby_nodes"] == 1);
  // A claim that would end the job at once is refused while a new node waits.
  Job other("other");
  CHECK(other.join(1, node("127.0.0.9", 2, 2), T0).empty());
  auto done = resume(node("127.0.0.1", 2, 2), 0);
  done.resume_done = true;
  CHECK_THAT(error_of(other.join(2, done, T0)), Catch::Contains("other nodes are waiting for a new round"));
  CHECK(other.state() == Job::State::kJoining);
}

TEST_CASE("a node re-registering a round that ended while it was away hears how it ended") {
  auto back = [](proto::Join j, int rank) {
    j.resume_round = 1;
    j.resume_group_rank = rank;
    j.resume_group_world_size = 2;
    return j;
  };
  proto::WorkerFailed f;
  f.round = 1;
  f.rank = 3;
  f.exit_code = 7;
  SECTION("the job failed: the late node gets the same abort") {
    Job job("job");
    job.join(1, back(node("127.0.0.1", 2, 2), 0), T0);
    auto out = job.worker_failed(1, f, T0);
    CHECK(of_type(out, MsgType::kAbort).size() == 1);
    auto late = of_type(job.join(2, back(node("127.0.0.2", 2, 2), 1), T0), MsgType::kAbort);
    REQUIRE(late.size() == 1);
    CHECK(proto::from_frame<proto::Abort>(late[0].frame).root_cause.exit_code == 7);
  }
  SECTION("the job restarts: the late node is told to restart") {
    Job job("job");
    job.join(1, back(node("127.0.0.1", 2, 2, 2, /*max_restarts=*/1), 0), T0);
    CHECK(of_type(job.worker_failed(1, f, T0), MsgType::kRestart).size() == 1);
    auto late = of_type(job.join(2, back(node("127.0.0.2", 2, 2, 2, 1), 1), T0), MsgType::kRestart);
    REQUIRE(late.size() == 1);
    CHECK(proto::from_frame<proto::Restart>(late[0].frame).restart_count == 1);
  }
}

// ---- standbys (#26) ----

namespace {
std::map<SessionId, proto::Assignment> assignments(const Actions& a) {
  std::map<SessionId, proto::Assignment> out;
  for (const auto& o : of_type(a, MsgType::kAssignment)) out[o.session] = proto::from_frame<proto::Assignment>(o.frame);
  return out;
}
}  // namespace

TEST_CASE("a node that arrives when the round is full becomes a standby, outlives join_timeout and hears Done") {
  Job job("job");
  job.join(1, node("127.0.0.1", 2, 2), T0);
  job.join(2, node("127.0.0.2", 2, 2), T0);
  REQUIRE(job.state() == Job::State::kRunning);
  auto out = job.join(3, node("127.0.0.3", 2, 2), T0 + 1s);
  REQUIRE(out.size() == 3);  // and the standby count to the two running nodes
  REQUIRE(proto::type_of(out[0].frame) == MsgType::kStandby);
  CHECK(out[0].session == 3);
  CHECK(of_type(out, MsgType::kHeartbeat).size() == 2);
  auto sb = proto::from_frame<proto::Standby>(out[0].frame);
  CHECK(sb.active_nodes == 2);
  CHECK(sb.position == 1);
  CHECK(proto::from_frame<proto::Standby>(job.join(4, node("127.0.0.4", 2, 2), T0 + 1s)[0].frame).position == 2);
  CHECK(job.standbys() == 2);
  CHECK(job.nodes() == 2);
  // Heartbeating standbys wait past join_timeout (5 s here) for as long as the job runs.
  for (std::chrono::milliseconds t = 1s; t <= 20s; t += 100ms) {
    for (SessionId s : {1, 2, 3, 4}) job.heartbeat(s, T0 + t);
    CHECK(job.tick(T0 + t).empty());
  }
  auto desc = job.describe(T0 + 20s);
  CHECK(desc["standby_nodes"] == 2);
  CHECK(desc["nodes"].size() == 4);
  CHECK(desc["nodes"][2]["status"] == "standby");
  job.node_done(1, 1, T0 + 21s);
  auto done = of_type(job.node_done(2, 1, T0 + 21s), MsgType::kDone);
  std::set<SessionId> told;
  for (auto& d : done) told.insert(d.session);
  CHECK(told == std::set<SessionId>{1, 2, 3, 4});
  CHECK(job.standbys() == 0);
}

TEST_CASE("a lost node's place goes to a standby at once, and the nodes that stay keep their group ranks") {
  Job job("job");
  for (SessionId s : {1, 2, 3}) job.join(s, node("127.0.0." + std::to_string(s), 3, 3, 2, 1), T0);
  // The standby's address sorts first: by address it would be group rank 0; it takes the freed place instead.
  CHECK(of_type(job.join(4, node("127.0.0.0", 3, 3, 2, 1), T0), MsgType::kStandby).size() == 1);
  auto out = job.disconnected(2, T0 + 1s);  // group rank 1
  CHECK(of_type(out, MsgType::kRestart).size() == 2);
  CHECK(of_type(out, MsgType::kAssignment).empty());
  CHECK(job.join(1, node("127.0.0.1", 3, 3, 2, 1), T0 + 1s).empty());
  auto a = assignments(job.join(3, node("127.0.0.3", 3, 3, 2, 1), T0 + 1s));  // the last survivor: no last call
  REQUIRE(a.size() == 3);
  CHECK(a[1].group_rank == 0);
  CHECK(a[4].group_rank == 1);
  CHECK(a[3].group_rank == 2);
  CHECK(a[4].rank_offset == 2);
  CHECK(a[4].restart_count == 1);
  CHECK(a[4].master_addr == "127.0.0.1");
  CHECK(a[1].nodes == std::vector<std::string>{"127.0.0.1", "127.0.0.0", "127.0.0.3"});
  CHECK(job.standbys() == 0);
  CHECK(job.round() == 2);
}

TEST_CASE("with explicit node ranks the first round follows them, and a standby takes the place of a lost node 0") {
  Job job("job");
  for (int r : {2, 0, 1}) {
    auto j = node("127.0.0." + std::to_string(9 - r), 3, 3, 1, 1);
    j.node_rank = r;
    job.join(static_cast<SessionId>(r + 1), j, T0);
  }
  REQUIRE(job.state() == Job::State::kRunning);
  auto sb = node("127.0.0.5", 3, 3, 1, 1);
  sb.node_rank = 3;
  CHECK(of_type(job.join(9, sb, T0), MsgType::kStandby).size() == 1);
  job.disconnected(1, T0 + 1s);  // node rank 0, the master
  for (int r : {1, 2}) {
    auto j = node("127.0.0." + std::to_string(9 - r), 3, 3, 1, 1);
    j.node_rank = r;
    auto a = assignments(job.join(static_cast<SessionId>(r + 1), j, T0 + 1s));
    if (r == 2) {
      REQUIRE(a.size() == 3);
      CHECK(a[9].group_rank == 0);
      CHECK(a[9].master_addr == "127.0.0.5");
      CHECK(a[2].group_rank == 1);
      CHECK(a[3].group_rank == 2);
    }
  }
}

TEST_CASE("an elastic job at MAX takes a standby instead of waiting out last_call_timeout") {
  Job job("job");
  job.join(1, node("127.0.0.1", 1, 2, 1, 1), T0);
  job.join(2, node("127.0.0.2", 1, 2, 1, 1), T0);
  REQUIRE(job.state() == Job::State::kRunning);
  job.join(3, node("127.0.0.3", 1, 2, 1, 1), T0);
  // Node 1 and the standby heartbeat; node 2 went silent at T0.
  for (std::chrono::milliseconds t = 100ms; t <= 300ms; t += 100ms) {
    job.heartbeat(1, T0 + t);
    job.heartbeat(3, T0 + t);
  }
  CHECK(of_type(job.tick(T0 + 350ms), MsgType::kRestart).size() == 2);  // node 2 missed 3 x 100 ms (told too)
  auto a = assignments(job.join(1, node("127.0.0.1", 1, 2, 1, 1), T0 + 400ms));  // no last call (1 s) wait
  REQUIRE(a.size() == 2);
  CHECK(a[1].group_rank == 0);
  CHECK(a[3].group_rank == 1);
  CHECK(a[3].world_size == 2);
}

TEST_CASE("a one-node job's standby takes over at once when the node is lost") {
  Job job("job");
  job.join(1, node("127.0.0.1", 1, 1, 1, 1), T0);
  job.join(2, node("127.0.0.2", 1, 1, 1, 1), T0);
  auto a = assignments(job.disconnected(1, T0 + 1s));
  REQUIRE(a.size() == 1);
  CHECK(a[2].group_rank == 0);
  CHECK(a[2].master_addr == "127.0.0.2");
  CHECK(job.state() == Job::State::kRunning);
}

TEST_CASE("a worker failure keeps every node in place and the standby waiting - when the job fails the standby hears it") {
  Job job("job");
  job.join(1, node("127.0.0.1", 2, 2, 1, 1), T0);
  job.join(2, node("127.0.0.2", 2, 2, 1, 1), T0);
  job.join(3, node("127.0.0.3", 2, 2, 1, 1), T0);
  proto::WorkerFailed f;
  f.round = 1;
  f.rank = 1;
  f.exit_code = 7;
  auto out = job.worker_failed(2, f, T0 + 1s);
  CHECK(of_type(out, MsgType::kRestart).size() == 2);
  for (auto& o : out) CHECK(o.session != 3);
  // A newcomer while the two restart: their places are theirs, it waits too.
  CHECK(of_type(job.join(4, node("127.0.0.4", 2, 2, 1, 1), T0 + 1s), MsgType::kStandby).size() == 1);
  job.join(2, node("127.0.0.2", 2, 2, 1, 1), T0 + 1s);
  auto a = assignments(job.join(1, node("127.0.0.1", 2, 2, 1, 1), T0 + 1s));
  CHECK(a.size() == 2);
  CHECK(job.standbys() == 2);
  f.round = 2;
  auto aborts = of_type(job.worker_failed(1, f, T0 + 2s), MsgType::kAbort);  // restarts spent
  std::set<SessionId> told;
  for (auto& o : aborts) told.insert(o.session);
  CHECK(told == std::set<SessionId>{1, 2, 3, 4});
  CHECK(proto::from_frame<proto::Abort>(aborts[0].frame).root_cause.exit_code == 7);
}

TEST_CASE("a node lost while the others re-join leaves its place to the next standby") {
  Job job("job");
  for (SessionId s : {1, 2, 3}) job.join(s, node("127.0.0." + std::to_string(s), 3, 3, 1, 2), T0);
  job.join(4, node("127.0.0.4", 3, 3, 1, 2), T0);
  job.join(5, node("127.0.0.5", 3, 3, 1, 2), T0);
  job.disconnected(3, T0 + 1s);  // standby 4 is taken
  job.join(1, node("127.0.0.1", 3, 3, 1, 2), T0 + 1s);
  // Lost before it re-joined: standby 5 is taken too, and the round is full at once. The
  // freed places (1 and 2) go to the standbys in address order.
  auto a = assignments(job.disconnected(2, T0 + 1s));
  REQUIRE(a.size() == 3);
  CHECK(a[1].group_rank == 0);
  CHECK(a[4].group_rank == 1);
  CHECK(a[5].group_rank == 2);
  CHECK(job.restart_count() == 1);
}

TEST_CASE("a silent standby is dropped and told, a closed one forgotten - with every node lost and no standby the job fails") {
  Job job("job");
  job.join(1, node("127.0.0.1", 1, 1, 1, 1), T0);
  job.join(2, node("127.0.0.2", 1, 1, 1, 1), T0);
  job.join(3, node("127.0.0.3", 1, 1, 1, 1), T0);
  job.heartbeat(1, T0 + 250ms);
  job.heartbeat(3, T0 + 250ms);
  auto out = job.tick(T0 + 310ms);  // standby 2 silent for 310 ms > 3 x 100 ms
  REQUIRE(out.size() == 2);  // and node 1 hears the standby count
  CHECK(out[0].session == 2);
  CHECK_THAT(error_of(out), Catch::Contains("standby dropped"));
  CHECK(out[1].session == 1);
  CHECK(proto::from_frame<proto::Heartbeat>(out[1].frame).standbys == 1);
  out = job.disconnected(3, T0 + 320ms);
  REQUIRE(out.size() == 1);
  CHECK(proto::from_frame<proto::Heartbeat>(out[0].frame).standbys == 0);
  CHECK(job.standbys() == 0);
  CHECK(of_type(job.disconnected(1, T0 + 330ms), MsgType::kAbort).empty());  // nobody left to tell
  CHECK(job.state() == Job::State::kFailed);
}

TEST_CASE("one tick drops every silent standby and still checks the tick's other deadlines (#36)") {
  // Before: one standby per tick, and that tick returned before the running node's deadline.
  Job job("job");
  job.join(1, node("127.0.0.1", 1, 1, 1, 1), T0);
  job.join(2, node("127.0.0.2", 1, 1, 1, 1), T0);
  job.join(3, node("127.0.0.3", 1, 1, 1, 1), T0);
  REQUIRE(job.standbys() == 2);
  auto out = job.tick(T0 + 310ms);  // all three silent for 310 ms > 3 x 100 ms
  std::set<SessionId> dropped;
  for (auto& e : of_type(out, MsgType::kError)) dropped.insert(e.session);
  CHECK(dropped == std::set<SessionId>{2, 3});
  CHECK(job.standbys() == 0);
  CHECK(job.missed_heartbeats() == 1);  // node 1's deadline in the same tick
  CHECK_FALSE(of_type(out, MsgType::kAbort).empty());  // the silent node is told
}

TEST_CASE("a standby re-registering with a restarted server waits for the rebuilt round, or hears that none came back") {
  auto sb = node("127.0.0.9", 2, 2, 1, 1);
  sb.resume_standby = true;
  Job job("job");
  CHECK(of_type(job.join(9, sb, T0), MsgType::kStandby).size() == 1);
  auto a = node("127.0.0.1", 2, 2, 1, 1), b = node("127.0.0.2", 2, 2, 1, 1);
  for (auto* j : {&a, &b}) {
    j->resume_round = 3;
    j->resume_group_world_size = 2;
  }
  a.resume_group_rank = 0;
  b.resume_group_rank = 1;
  CHECK(job.join(1, a, T0).empty());
  CHECK(job.join(2, b, T0).empty());
  CHECK(job.state() == Job::State::kRunning);
  CHECK(job.standbys() == 1);
  CHECK(of_type(job.disconnected(2, T0 + 1s), MsgType::kRestart).size() == 1);  // the standby takes b's place
  auto as = assignments(job.join(1, node("127.0.0.1", 2, 2, 1, 1), T0 + 1s));
  REQUIRE(as.size() == 2);
  CHECK(as[1].group_rank == 0);
  CHECK(as[9].group_rank == 1);

  Job alone("job");  // nobody of the round comes back
  CHECK(of_type(alone.join(9, sb, T0), MsgType::kStandby).size() == 1);
  for (std::chrono::milliseconds t = 100ms; t < 5s; t += 100ms) {
    alone.heartbeat(9, T0 + t);
    CHECK(alone.tick(T0 + t).empty());
  }
  alone.heartbeat(9, T0 + 5s);
  auto aborts = of_type(alone.tick(T0 + 5s), MsgType::kAbort);
  REQUIRE(aborts.size() == 1);
  CHECK_THAT(proto::from_frame<proto::Abort>(aborts[0].frame).reason, Catch::Contains("nothing to stand by for"));
}

namespace {
// The events a job recorded since the last call, as "KIND" or "KIND HOST" lines.
std::vector<std::string> kinds(Job& job) {
  std::vector<std::string> out;
  for (const auto& e : job.take_events()) out.push_back(e.host.empty() ? kind_name(e.kind) : std::string(kind_name(e.kind)) + " " + e.host);
  return out;
}
}  // namespace

TEST_CASE("the job's events (#38): created, joins, a standby, a round, a lost node, the restart, the promotion, the end") {
  Job job("job");
  job.join(1, node("127.0.0.1", 2, 2, 2, 1), T0);
  job.join(2, node("127.0.0.2", 2, 2, 2, 1), T0);
  CHECK(kinds(job) == std::vector<std::string>{"created host-127.0.0.1", "joined host-127.0.0.1", "joined host-127.0.0.2",
                                               "round_started"});
  job.join(3, node("127.0.0.3", 2, 2, 2, 1), T0);
  auto standby = job.take_events();
  REQUIRE(standby.size() == 1);
  CHECK(text_of(standby[0]) == "job 'job': node host-127.0.0.3 (127.0.0.3, agent agent-127.0.0.3) joined as standby 1 "
                               "(the round is full)");
  CHECK(json_of(standby[0])["role"] == "standby");
  job.disconnected(2, T0 + 1s);
  auto lost = job.take_events();
  REQUIRE(lost.size() == 3);
  CHECK(text_of(lost[0]) == "job 'job': node host-127.0.0.2 (127.0.0.2, agent agent-127.0.0.2) lost (connection "
                            "closed): its connection closed");
  CHECK(text_of(lost[1]) == "job 'job': restart 1 of 1: node host-127.0.0.2 (127.0.0.2) lost: its connection closed");
  CHECK(text_of(lost[2]) == "job 'job': standby host-127.0.0.3 (127.0.0.3, agent agent-127.0.0.3) promoted into "
                            "round 2 in place of lost node host-127.0.0.2");
  const auto j = json_of(lost[0]);
  CHECK(j["event"] == "node_lost");
  CHECK(j["addr"] == "127.0.0.2");
  CHECK(j["cause"] == "connection closed");
  job.join(1, node("127.0.0.1", 2, 2, 2, 1), T0 + 1s);
  auto round = job.take_events();
  REQUIRE(round.size() == 2);
  CHECK(json_of(round[0])["how"] == "survivor");
  CHECK(text_of(round[1]) == "job 'job': round 2 started (restart 1 of 1): 2 nodes, world size 4: host-127.0.0.1 "
                             "(127.0.0.1), host-127.0.0.3 (127.0.0.3)");
  job.node_done(1, 2, T0 + 2s);
  job.node_done(3, 2, T0 + 2s);
  auto done = job.take_events();
  REQUIRE(done.size() == 1);
  CHECK(text_of(done[0]) == "job 'job' done: round 2, 2 nodes, 1 restart spent");
}

TEST_CASE("the job's events (#38): a worker's failure with its exit code, a silent node, and the root cause of the failure") {
  Job job("job");
  job.join(1, node("127.0.0.1", 2, 2, 1, 1), T0);
  job.join(2, node("127.0.0.2", 2, 2, 1, 1), T0);
  job.take_events();
  proto::WorkerFailed f;
  f.round = 1;
  f.host = "host-127.0.0.2";
  f.rank = 1;
  f.exit_code = 137;
  f.signal = 9;
  f.message = "killed";
  job.worker_failed(2, f, T0 + 1s);
  auto failed = job.take_events();
  REQUIRE(failed.size() == 2);
  CHECK(text_of(failed[0]) ==
        "job 'job': rank 1 on node host-127.0.0.2 (127.0.0.2, agent agent-127.0.0.2) failed with exit code 137 (signal 9): killed");
  CHECK(json_of(failed[1])["cause"] == "worker failed");
  job.join(1, node("127.0.0.1", 2, 2, 1, 1), T0 + 1s);
  job.join(2, node("127.0.0.2", 2, 2, 1, 1), T0 + 1s);
  job.take_events();
  job.heartbeat(1, T0 + 1300ms);
  job.tick(T0 + 1310ms);  // node 2 silent for 310 ms, no restart left
  auto ended = job.take_events();
  REQUIRE(ended.size() == 2);
  CHECK(text_of(ended[0]) == "job 'job': node host-127.0.0.2 (127.0.0.2, agent agent-127.0.0.2) lost (heartbeat "
                             "timeout): missed 3 heartbeats (100 ms apart): hung or unreachable");
  CHECK(text_of(ended[1]) == "job 'job' failed at round 2 (restart 1 of 1): root cause: node host-127.0.0.2 "
                             "(127.0.0.2) missed 3 heartbeats (100 ms apart): hung or unreachable");
  CHECK(json_of(ended[1])["event"] == "failed");
  CHECK(job.take_events().empty());
}

namespace {
// Two fresh joins, one naming the run that ended (a plain newcomer): `fresh` from epoch 1.
void fresh_joins_start_new_run(Job& job, const std::string& ended, const std::string& fresh) {
  proto::Join j1 = node("127.0.0.1", 2, 2);
  j1.run = ended;
  j1.epoch = 7;
  CHECK(job.join(4, j1, T0).empty());
  auto out = of_type(job.join(5, node("127.0.0.2", 2, 2), T0), MsgType::kAssignment);
  REQUIRE(out.size() == 2);
  const auto a = proto::from_frame<proto::Assignment>(out[0].frame);
  CHECK(a.run == fresh);
  CHECK(a.epoch == 1);
}
}  // namespace

// Review s38-late L1: a daemon journals a job's end after the frames go out, or dies before
// every node read its Done; restarted, its journal says done (or failed), so its Job is a new
// run, and the nodes that re-register the old run were refused ("its run R is not this
// job's") and ended non-zero after the training completed. They hear the end now.
TEST_CASE("a restarted daemon's Job whose journal says the last run ended tells that run's re-registering nodes and "
          "standbys the end (Done, the Abort), while fresh joins start the new run (review s38-late L1)") {
  const std::string ended = "1764500000000-0123456789abcdef", fresh = "1764500099000-00000000000000ff";
  auto claim = [&](const std::string& addr, bool standby) {
    proto::Join j = node(addr, 2, 2);
    j.run = ended;
    j.epoch = 7;
    if (standby) {
      j.resume_standby = true;
      return j;
    }
    j.resume_round = 4;
    j.resume_group_rank = addr == "127.0.0.1" ? 0 : 1;
    j.resume_group_world_size = 2;
    j.resume_restart_count = 1;
    j.resume_done = true;
    return j;
  };
  Job done("job", false, fresh);
  done.seed_ended(ended, std::nullopt);
  CHECK(of_type(done.join(1, claim("127.0.0.1", false), T0), MsgType::kDone).size() == 1);  // main: Error
  CHECK(of_type(done.join(2, claim("127.0.0.3", true), T0), MsgType::kDone).size() == 1);
  CHECK(done.state() == Job::State::kJoining);
  // Another run's re-registration is weighed as before (an older one refused).
  proto::Join older = claim("127.0.0.2", false);
  older.run = "1764400000000-0000000000000001";
  CHECK_THAT(error_of(done.join(3, older, T0)), Catch::Contains("re-registration refused"));
  // Fresh joins, one naming the ended run (a plain newcomer): the new run from epoch 1.
  fresh_joins_start_new_run(done, ended, fresh);

  Job failed("job", false, fresh);
  proto::Abort abort;
  abort.root_cause.rank = 3;
  abort.root_cause.exit_code = 7;
  abort.reason = "rank 3 on host-127.0.0.2 exited with 7";
  failed.seed_ended(ended, abort);
  auto told = of_type(failed.join(1, claim("127.0.0.2", false), T0), MsgType::kAbort);
  REQUIRE(told.size() == 1);
  CHECK(proto::from_frame<proto::Abort>(told[0].frame).root_cause.exit_code == 7);
  CHECK(proto::from_frame<proto::Abort>(told[0].frame).reason == abort.reason);
}

namespace {
// Node `addr` (127.0.0.1: group rank 0, else 1) re-registering round 4 (restart 1) of two nodes
// of run `run` at epoch 7.
proto::Join forgotten_claim(const std::string& addr, const std::string& run) {
  proto::Join j = node(addr, 2, 2);
  j.run = run;
  j.epoch = 7;
  j.resume_round = 4;
  j.resume_group_rank = addr == "127.0.0.1" ? 0 : 1;
  j.resume_group_world_size = 2;
  j.resume_restart_count = 1;
  return j;
}
}  // namespace

// Review s39 M2: a daemon that heard no joined session for orphan_job_expiry (its restart,
// or an outage its agents ride out: they retry for up to join_timeout, workers running)
// journals the job forgotten. Restarted with that journal, its Job was a new run and the
// running round's re-registrations were refused ("its run R is not this job's"): every
// agent ended, where without --state-dir the round is rebuilt.
TEST_CASE("a restarted daemon's Job whose journal says the last run was forgotten rebuilds that run's round from its "
          "re-registering nodes, while a fresh join alone starts the new run (review s39 M2)") {
  const std::string was = "1764500000000-0123456789abcdef", fresh = "1764500099000-00000000000000ff";
  auto claim = [&](const std::string& addr) { return forgotten_claim(addr, was); };
  Job job("job", false, fresh);
  job.seed_forgotten(was);
  CHECK(error_of(job.join(1, claim("127.0.0.1"), T0)).empty());  // main: "re-registration refused"
  CHECK(error_of(job.join(2, claim("127.0.0.2"), T0)).empty());
  CHECK(job.state() == Job::State::kRunning);
  CHECK(job.run() == was);
  // Another older run's re-registration is refused as before.
  Job other("job", false, fresh);
  other.seed_forgotten(was);
  proto::Join older = claim("127.0.0.2");
  older.run = "1764400000000-0000000000000001";
  CHECK_THAT(error_of(other.join(3, older, T0)), Catch::Contains("re-registration refused"));
  // Fresh joins, one naming the forgotten run (a plain newcomer): the new run from epoch 1.
  Job requeue("job", false, fresh);
  requeue.seed_forgotten(was);
  fresh_joins_start_new_run(requeue, was, fresh);
}

// Review s39 L1: a requeue's first fresh join journals "created" for the new run, which
// started a new summary: a daemon restarted a second time, before that run's first round,
// no longer knew the old run ended, and refused its stragglers' re-registration (exit 1
// after a completed training).
TEST_CASE("the journal's summary of a job keeps the run that ended when a new run of its id is created, so that a "
          "second restart still tells that run's stragglers its end (review s39 L1)") {
  const std::string r1 = "1764500000000-0123456789abcdef", r2 = "1764500099000-00000000000000ff";
  for (const std::string end : {"done", "failed"}) {
    nlohmann::json s;
    rdzv::fold_event(s, {{"event", "created"}, {"job", "j"}, {"run", r1}, {"epoch", 0}});
    rdzv::fold_event(s, {{"event", "round_started"}, {"job", "j"}, {"run", r1}, {"epoch", 4}, {"round", 4}});
    rdzv::fold_event(s, {{"event", end}, {"job", "j"}, {"why", "rank 0 exited with 1"}});
    rdzv::fold_event(s, {{"event", "created"}, {"job", "j"}, {"run", r2}, {"epoch", 0}});
    CHECK(s.value("state", "") == "joining");
    CHECK(s.value("run", "") == r2);
    CHECK(s.value("ended_run", "") == r1);  // main: absent
    CHECK(s.value("ended_state", "") == end);
    // A third run created before the second ran a round: the ended one is still named.
    rdzv::fold_event(s, {{"event", "created"}, {"job", "j"}, {"run", "1764500199000-00000000000000ff"}});
    CHECK(s.value("ended_run", "") == r1);
  }
}

// Review s40-recall M1: the host's vote socket (its Join's vote_port, its takeover port 0)
// is the round's host vote address in every Assignment and Standby, for the nodes' records; it
// is never a takeover port. An older host's Join has none: none is listed.
TEST_CASE("the hosting agent's vote port (a Join without a takeover port) is the round's host vote address in every "
          "assignment and standby message, never a takeover port, and an older host's Join lists none (review "
          "s40-recall M1)") {
  for (const int vote : {7101, 0}) {
    CAPTURE(vote);
    Job job("job");
    job.set_host_agent_id("agent-127.0.0.1");
    auto h = node("127.0.0.1", 2, 2);
    h.vote_port = vote;
    auto b = node("127.0.0.2", 2, 2);
    b.takeover_port = 7002;
    b.vote_port = 7999;  // (beside a takeover port: no host's)
    job.join(1, h, T0);
    auto assigned = of_type(job.join(2, b, T0), MsgType::kAssignment);
    REQUIRE(assigned.size() == 2);
    for (const auto& o : assigned) {
      const auto a = proto::from_frame<proto::Assignment>(o.frame);
      CHECK(a.takeover_ports == std::vector<int>{0, 7002});
      CHECK(a.host_vote_addr == (vote > 0 ? "127.0.0.1" : ""));
      CHECK(a.host_vote_port == vote);
    }
    auto told = of_type(job.join(3, node("127.0.0.3", 2, 2), T0), MsgType::kStandby);
    REQUIRE(told.size() == 1);
    const auto s = proto::from_frame<proto::Standby>(told.front().frame);
    CHECK(s.host_vote_addr == (vote > 0 ? "127.0.0.1" : ""));
    CHECK(s.host_vote_port == vote);
  }
}

// Review s41-b M1: a taker that stopped hosting (its server, on its vote port, destroyed) and
// joined the majority's host kept that vote_port, and the Job took the first Join with one
// as the host's: sorted first, every later round listed a dead port (one another agent could
// bind and answer for it) and dropped the real host's. Only the server's own agent's counts.
TEST_CASE("only the Join of the agent the job's server is built into gives the round's host vote address: a former "
          "host's stale vote port sorted before it is not listed, and a daemon's job lists none (review s41-b M1)") {
  for (const bool daemon : {false, true}) {
    CAPTURE(daemon);
    Job job("job");
    if (!daemon) job.set_host_agent_id("agent-127.0.0.9");
    auto former = node("127.0.0.1", 2, 2);  // sorts first: a former taker, vote port P kept
    former.vote_port = 7001;
    auto h = node("127.0.0.9", 2, 2);
    h.vote_port = 7109;
    job.join(1, former, T0);
    auto assigned = of_type(job.join(2, h, T0), MsgType::kAssignment);
    REQUIRE(assigned.size() == 2);
    for (const auto& o : assigned) {
      const auto a = proto::from_frame<proto::Assignment>(o.frame);
      CHECK(a.host_vote_addr == (daemon ? "" : "127.0.0.9"));  // main: 127.0.0.1
      CHECK(a.host_vote_port == (daemon ? 0 : 7109));           // main: 7001
    }
    auto told = of_type(job.join(3, node("127.0.0.3", 2, 2), T0), MsgType::kStandby);
    REQUIRE(told.size() == 1);
    CHECK(proto::from_frame<proto::Standby>(told.front().frame).host_vote_port == (daemon ? 0 : 7109));
  }
}

// Review s41-d M1: the hosting agent that arrives last into a full round is a standby of its
// own server; its agent writes its record from that Standby, found by its Join's session.
TEST_CASE("job: the session of the hosting agent's Join is found as a member, or as a standby of a full round, and "
          "none for a daemon (review s41-d M1)") {
  Job job("job");
  CHECK(job.host_agent_session() == 0);
  job.set_host_agent_id("agent-127.0.0.9");
  CHECK(job.host_agent_session() == 0);  // not joined yet
  job.join(1, node("127.0.0.1", 2, 2), T0);
  REQUIRE(of_type(job.join(2, node("127.0.0.2", 2, 2), T0), MsgType::kAssignment).size() == 2);
  auto told = of_type(job.join(7, node("127.0.0.9", 2, 2), T0), MsgType::kStandby);
  REQUIRE(told.size() == 1);
  CHECK(told.front().session == 7);
  CHECK(job.host_agent_session() == 7);
  Job member("job");
  member.set_host_agent_id("agent-127.0.0.9");
  member.join(4, node("127.0.0.9", 2, 2), T0);
  member.join(5, node("127.0.0.2", 2, 2), T0);
  CHECK(member.host_agent_session() == 4);
}
