// Takeover after the hosting agent's loss (#26): who hosts next, when no takeover is
// possible, and the taken-over job under a fake clock (time points passed in).
#include <catch2/catch.hpp>

#include "rendezvous/client.h"
#include "rendezvous/job.h"

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
  CHECK(why_no_takeover(0, 1, 2, 2).empty());
  CHECK_THAT(why_no_takeover(1, 1, 2, 2), Catch::Contains("no restart left") && Catch::Contains("--max_restarts=1"));
  CHECK_THAT(why_no_takeover(0, 3, 0, 1), Catch::Contains("no other node can host"));
  CHECK_THAT(why_no_takeover(0, 3, 2, 3), Catch::Contains("2 node(s) left, fewer than the 3"));
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
