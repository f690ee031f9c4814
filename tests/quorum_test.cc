// A network partition never splits a job (#34): the pure rules, under a fake clock. The
// job's epochs and voters, the majority a new round needs after a loss in a job an agent
// hosts (rdzv::Job), a re-registration after an outage; the client's fence timer and the
// takeover search that waits for a refusing candidate (rdzv::ClientMachine).
#include <catch2/catch.hpp>

#include <algorithm>
#include <random>

#include "rendezvous/client_machine.h"
#include "rendezvous/job.h"

using namespace mg;
using namespace mg::rdzv;
using namespace std::chrono_literals;
using proto::MsgType;

namespace {

const Clock::time_point T0{};

proto::Join node(const std::string& addr, int min_nodes = 1, int max_nodes = 3, int max_restarts = 5) {
  proto::Join j;
  j.job_id = "job";
  j.agent_id = "agent-" + addr;
  j.host = "host-" + addr;
  j.addr = addr;
  j.min_nodes = min_nodes;
  j.max_nodes = max_nodes;
  j.max_restarts = max_restarts;
  j.last_call_ms = 1000;
  j.keep_alive_ms = 100;
  j.keep_alive_max_attempt = 3;
  j.join_timeout_ms = 5000;
  return j;
}

std::vector<Outgoing> of_type(const Actions& a, MsgType t) {
  std::vector<Outgoing> out;
  for (const auto& o : a)
    if (proto::type_of(o.frame) == t) out.push_back(o);
  return out;
}

template <class T>
T decoded(const Outgoing& o) {
  return proto::from_frame<T>(proto::frame_of(o.frame));
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
    TakeoverSeed seed;
    seed.round = 4;
    seed.restart_count = 1;
    seed.deadline = T0 + 1s;
    seed.survivors = 2;
    seed.world_size = 3;
    seed.epoch = 6;
    seed.voters = {"agent-127.0.0.1", "agent-127.0.0.2", "agent-127.0.0.3"};
    job.take_over(seed, T0);
    auto j2 = node("127.0.0.2");
    j2.last_group_rank = 1;
    j2.epoch = 6;
    auto j3 = node("127.0.0.3");
    j3.last_group_rank = 2;
    j3.epoch = 7;  // it heard of a later round than the new host did
    job.join(2, j2, T0);
    job.join(3, j3, T0);
    auto closed = of_type(job.tick(T0 + 1001ms), MsgType::kAssignment);
    REQUIRE(closed.size() == 2);
    CHECK(decoded<proto::Assignment>(closed[0]).epoch == 8);
    CHECK(job.round() == 5);
  }
  SECTION("a re-registration with a restarted daemon keeps the round's epoch; its next round is one more") {
    Job job("job");
    auto j = node("127.0.0.1", 1, 1);
    j.resume_round = 3;
    j.resume_group_rank = 0;
    j.resume_group_world_size = 1;
    j.epoch = 9;
    job.join(1, j, T0);
    REQUIRE(job.state() == Job::State::kRunning);
    CHECK(job.epoch() == 9);
    proto::WorkerFailed f;
    f.round = 3;
    f.host = "host-127.0.0.1";
    f.rank = 0;
    job.worker_failed(1, f, T0);
    auto out = of_type(job.join(1, node("127.0.0.1", 1, 1), T0), MsgType::kAssignment);
    REQUIRE(out.size() == 1);
    CHECK(decoded<proto::Assignment>(out[0]).epoch == 10);
  }
}

TEST_CASE("quorum: in a job an agent hosts, a new round after a node was lost needs a majority of the voters: one "
          "survivor of three waits, says so once, and fails at join_timeout with that root cause") {
  Job job = three_nodes(/*quorum=*/true);
  // Nodes 2 and 3 are cut off: their heartbeats stop; node 1 (the host's side) goes on beating.
  for (auto t = T0 + 100ms; t <= T0 + 300ms; t += 100ms) job.heartbeat(1, t);
  auto out = job.tick(T0 + 301ms);  // node 2 lost: nodes 1 and 3 told to restart; node 3 never comes
  CHECK(of_type(out, MsgType::kRestart).size() == 2);
  job.join(1, node("127.0.0.1"), T0 + 400ms);
  job.take_events();
  // The last call passes: with 1 of 3 voters no round opens.
  out = job.tick(T0 + 1500ms);
  CHECK(of_type(out, MsgType::kAssignment).empty());
  JobEvent e;
  REQUIRE(has_event(job, JobEvent::Kind::kNoQuorum, &e));
  CHECK(e.nodes == 1);
  CHECK(e.voters == 3);
  CHECK_THAT(text_of(e), Catch::Contains("waits for a majority of the job's 3 voters: 1 of them joined, 2 needed"));
  CHECK(of_type(job.tick(T0 + 1600ms), MsgType::kAssignment).empty());
  CHECK_FALSE(has_event(job, JobEvent::Kind::kNoQuorum));  // said once
  auto end = of_type(job.tick(T0 + 5401ms), MsgType::kAbort);
  REQUIRE(end.size() == 1);
  CHECK_THAT(decoded<proto::Abort>(end[0]).reason, Catch::Contains("no majority of job 'job''s 3 voters within "
                                                                    "join_timeout: 1 of them joined, 2 needed"));
}

TEST_CASE("quorum: two survivors of three are a majority and go on, the same lone survivor goes on where a daemon "
          "arbitrates (no majority counted there)") {
  SECTION("two of three, an agent hosting") {
    Job job = three_nodes(true);
    job.heartbeat(1, T0 + 250ms);
    job.heartbeat(2, T0 + 250ms);
    REQUIRE(of_type(job.tick(T0 + 301ms), MsgType::kRestart).size() == 2);
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

TEST_CASE("quorum: a job taken over opens its round only with a majority of the seed's voters among its joins, a "
          "newcomer is no voter") {
  Job job("job", true);
  TakeoverSeed seed;
  seed.round = 2;
  seed.restart_count = 1;
  seed.deadline = T0 + 300ms;
  seed.survivors = 2;
  seed.world_size = 3;
  seed.epoch = 2;
  seed.voters = {"agent-127.0.0.1", "agent-127.0.0.2", "agent-127.0.0.3"};
  job.take_over(seed, T0);
  auto j3 = node("127.0.0.3");
  j3.last_group_rank = 2;
  job.join(3, j3, T0);  // the new host itself
  job.join(9, node("127.0.0.9"), T0);  // a newcomer
  CHECK(of_type(job.tick(T0 + 1001ms), MsgType::kAssignment).empty());
  CHECK(has_event(job, JobEvent::Kind::kNoQuorum));
  CHECK(job.state() == Job::State::kRestarting);
  // The other survivor comes (late, its side healed): 2 of 3 voters, the round opens.
  auto j2 = node("127.0.0.2");
  j2.last_group_rank = 1;
  auto out = of_type(job.join(2, j2, T0 + 1100ms), MsgType::kAssignment);
  CHECK(out.size() == 3);
  CHECK(decoded<proto::Assignment>(out[0]).epoch == 3);
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
      TakeoverSeed seed;
      seed.round = 1;
      seed.restart_count = 1;
      seed.deadline = T0 + 300ms;
      seed.survivors = 1;
      seed.world_size = 2;
      seed.epoch = 1;
      seed.voters = {"agent-127.0.0.1", "agent-127.0.0.2"};
      seed.host_closed = closed;
      job.take_over(seed, T0);
      auto j2 = node("127.0.0.2", 1, 2);
      j2.last_group_rank = 1;
      job.join(2, j2, T0);
      CHECK(of_type(job.tick(T0 + 1001ms), MsgType::kAssignment).size() == (closed ? 1u : 0u));
    }
  }
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

const std::string kNonce(64, 'a');
const int kRdzvPort = 30000 + static_cast<int>(std::random_device{}() % 10000);

ClientOptions client_options(const std::string& addr = "127.0.0.3") {
  ClientOptions o;
  o.host = "127.0.0.1";
  o.port = kRdzvPort;
  o.join = node(addr, 1, 4);
  o.join.takeover_port = 7000;
  return o;
}

template <class T>
std::vector<T> all(const ClientCommands& cs) {
  std::vector<T> out;
  for (const auto& c : cs)
    if (auto* x = std::get_if<T>(&c)) out.push_back(*x);
  return out;
}
template <class T>
bool has(const ClientCommands& cs) {
  return !all<T>(cs).empty();
}
template <class T>
std::vector<T> told(const ClientCommands& cs) {
  std::vector<T> out;
  for (const auto& t : all<cmd::Tell>(cs))
    if (auto* x = std::get_if<T>(&t.d)) out.push_back(*x);
  return out;
}
std::optional<Clock::time_point> armed(const ClientCommands& cs, ClientTimer t) {
  std::optional<Clock::time_point> at;
  for (const auto& a : all<cmd::Arm>(cs))
    if (a.timer == t) at = a.at;
  return at;
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

struct Link {
  ClientMachine m;
  Clock::time_point now = T0;
  explicit Link(ClientOptions o = client_options()) : m(std::move(o)) {}
  ClientCommands welcome(const std::string& host_agent = {}) {
    auto c = m.connected(kNonce, now);
    auto w = m.frame(proto::to_frame(proto::Welcome{"srv", host_agent}), now);
    c.insert(c.end(), w.begin(), w.end());
    return c;
  }
  ClientCommands receive(const auto& msg) { return m.frame(proto::to_frame(msg), now); }
  ClientCommands fire(ClientTimer t) { return m.timer_fired(t, m.generation(t), now); }
};

}  // namespace

TEST_CASE("quorum: the fence fires half a keep-alive interval before the server may drop a silent member") {
  CHECK(fence_after(100, 3) == 250ms);  // the server drops it after 300 ms
  CHECK(fence_after(5000, 3) == 12500ms);
  CHECK(fence_after(1000, 1) == 500ms);
}

TEST_CASE("quorum: a node running a round that hears nothing from its rendezvous fences itself: its workers stop "
          "with one line saying why, its fence is reported on re-registering, and the epoch rides on its joins") {
  Link l;
  l.m.start(l.now);
  l.welcome();
  auto c = l.receive(round_of(2));
  REQUIRE(armed(c, ClientTimer::kFence) == l.now + 250ms);
  // Every frame moves it on.
  l.now += 100ms;
  c = l.receive(proto::Heartbeat{1, 0});
  CHECK(armed(c, ClientTimer::kFence) == l.now + 250ms);
  // Silence: it fires before the watchdog's outage (350 ms) and before the server's drop.
  l.now += 250ms;
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

TEST_CASE("quorum: a daemon restart never fences a running node: each refused or closed connection is an answer "
          "of its machine") {
  Link l;
  l.m.start(l.now);
  l.welcome();
  l.receive(round_of(2));
  l.now += 100ms;
  auto c = l.m.connection_closed("end of file", l.now);
  CHECK(armed(c, ClientTimer::kFence) == l.now + 250ms);
  for (int i = 0; i < 20; ++i) {
    l.now += 200ms;
    c = l.m.connect_failed(true, "Connection refused", l.now);
    CHECK(armed(c, ClientTimer::kFence) == l.now + 250ms);
    CHECK(told<proto::Restart>(c).empty());
  }
  // A fence fire of an earlier arm is stale.
  CHECK(l.m.timer_fired(ClientTimer::kFence, l.m.generation(ClientTimer::kFence) - 1, l.now).empty());
}

TEST_CASE("quorum: the takeover search waits for a candidate that refuses (alive, not noticed yet) and passes over "
          "a silent one, the seed carries the epoch, the voters and how the host was lost") {
  SECTION("refused: waited for to the search's deadline") {
    Link l;
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
      Link l;
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
      CHECK(host[0].seed.host_closed == closed);
    }
  }
}
