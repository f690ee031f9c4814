// proto::Wire: messages encoded once for many connections, and the direct CBOR writers.
#include <catch2/catch.hpp>

#include <set>

#include "proto/wire.h"
#include "rendezvous/job.h"

using namespace mg::proto;

namespace {

Assignment sample(std::size_t listed) {
  Assignment a;
  a.round = 7;
  a.group_rank = 300;
  a.group_world_size = 70000;
  a.rank_offset = 2400000;
  a.world_size = 2400008;
  a.master_addr = "127.0.0.1";
  a.master_port = 41234;  // any port: nothing binds it
  a.restart_count = 3;
  for (std::size_t i = 0; i < listed; ++i) a.nodes.push_back("127.0." + std::to_string(i / 256) + "." + std::to_string(i % 256));
  a.epoch = 9;
  a.run = "1700000000000-00000000000000ab";
  for (std::size_t i = 0; i < listed; ++i) a.voters.push_back("node" + std::to_string(i) + ":4242");
  if (listed > 0 && listed < kMaxListedNodes) {  // a standby voter too (review s39-late M1)
    a.voters.push_back("standby:4242");
    a.standby_nodes = {"127.1.0.1"};
    a.standby_takeover_ports = {40001};
    a.host_vote_addr = "127.0.0.0";  // the host's vote socket (review s40-recall M1)
    a.host_vote_port = 40002;
  }
  return a;
}

std::vector<std::uint8_t> framed(const Wire& w, std::size_t trailer = 0) {
  std::vector<std::uint8_t> out;
  append_frame(w, out, kDefaultMaxFrame, trailer);
  return out;
}

}  // namespace

TEST_CASE("an assignment written straight to CBOR decodes to what nlohmann's encoding decodes to") {
  for (std::size_t listed : {std::size_t{0}, std::size_t{1}, std::size_t{30}, kMaxListedNodes}) {
    const Assignment a = sample(listed);
    const auto bytes = framed(to_wire(a));
    const auto r = decode(bytes);
    REQUIRE(r.status == DecodeResult::Status::kOk);
    CHECK(r.consumed == bytes.size());
    CHECK(r.frame.type == static_cast<std::uint8_t>(MsgType::kAssignment));
    CHECK(r.frame.payload == nlohmann::json(a));  // every field, and no other
    const auto back = from_frame<Assignment>(r.frame);
    CHECK(back.group_rank == 300);
    CHECK(back.rank_offset == 2400000);
    CHECK(back.nodes == a.nodes);
    CHECK(back.epoch == 9);
    CHECK(back.voters == a.voters);
    CHECK(back.run == a.run);
    CHECK(back.standby_nodes == a.standby_nodes);
    CHECK(back.standby_takeover_ports == a.standby_takeover_ports);
    CHECK(back.host_vote_addr == a.host_vote_addr);
    CHECK(back.host_vote_port == a.host_vote_port);
  }
}

TEST_CASE("integers take their shortest CBOR form, as nlohmann writes them") {
  for (std::int64_t v : {0LL, 23LL, 24LL, 255LL, 256LL, 65535LL, 65536LL, 4294967295LL, 4294967296LL, -1LL, -24LL,
                         -25LL, -256LL, -257LL, -2147483648LL}) {
    std::vector<std::uint8_t> ours;
    cbor::put_int(ours, v);
    CHECK(ours == nlohmann::json::to_cbor(nlohmann::json(v)));
  }
  std::vector<std::uint8_t> text;
  cbor::put_text(text, std::string(300, 'x'));
  CHECK(text == nlohmann::json::to_cbor(nlohmann::json(std::string(300, 'x'))));
}

TEST_CASE("the assignments of a round share one encoding of what every node gets") {
  mg::rdzv::Job job("job");
  Join j;
  j.job_id = "job";
  j.min_nodes = j.max_nodes = 3;
  mg::rdzv::Actions out;
  for (int i = 1; i <= 3; ++i) {
    j.agent_id = "a" + std::to_string(i);
    j.addr = "127.0.0." + std::to_string(i);
    out = job.join(static_cast<mg::rdzv::SessionId>(i), j, mg::rdzv::Clock::time_point{});
  }
  REQUIRE(out.size() == 3);
  for (const auto& o : out) {
    CHECK(type_of(o.frame) == MsgType::kAssignment);
    CHECK(o.frame.body.get() == out.front().frame.body.get());  // the node list is held once
  }
  std::set<int> ranks;
  for (const auto& o : out) {
    auto a = from_frame<Assignment>(o.frame);
    ranks.insert(a.group_rank);
    CHECK(a.nodes == std::vector<std::string>{"127.0.0.1", "127.0.0.2", "127.0.0.3"});
  }
  CHECK(ranks == std::set<int>{0, 1, 2});
}

TEST_CASE("the standbys told a new round share one encoding of its node list, and decode as nlohmann's (#26)") {
  Standby m;
  m.active_nodes = 2;
  m.round = 300;
  m.restart_count = 2;
  m.nodes = {"127.0.0.1", "127.0.0.2"};
  m.takeover_ports = {0, 40000};
  m.run = "1700000000000-00000000000000ab";
  m.standby_nodes = {"127.0.0.3"};  // the round's standby voters (review s39-late M1)
  m.standby_takeover_ports = {40001};
  m.host_vote_addr = "127.0.0.1";  // the host's vote socket (review s40-recall M1)
  m.host_vote_port = 40002;
  const StandbyEncoder encode(m);
  const Wire first = encode(1), second = encode(70000);
  CHECK(first.body.get() == second.body.get());
  for (int position : {1, 70000}) {
    m.position = position;
    const Wire w = position == 1 ? first : second;
    CHECK(frame_of(w).payload == nlohmann::json(m));
    auto back = from_frame<Standby>(w);
    CHECK(back.position == position);
    CHECK(back.nodes == m.nodes);
    CHECK(back.takeover_ports == m.takeover_ports);
    CHECK(back.run == m.run);
    CHECK(back.standby_nodes == m.standby_nodes);
    CHECK(back.standby_takeover_ports == m.standby_takeover_ports);
    CHECK(back.host_vote_port == m.host_vote_port);
  }
}

TEST_CASE("a heartbeat and any other message survive the trip through a Wire") {
  auto hb = decode(framed(to_wire(Heartbeat{12})));
  REQUIRE(hb.status == DecodeResult::Status::kOk);
  CHECK(from_frame<Heartbeat>(hb.frame).round == 12);
  CHECK(hb.frame.payload == nlohmann::json(Heartbeat{12}));
  const Restart restart{2, "rank 1 on h exited with 1"};
  const Wire w = to_wire(restart);
  CHECK(framed(w) == encode(to_frame(restart)));  // byte for byte what encode() writes
  CHECK(from_frame<Restart>(w).reason == restart.reason);
}

TEST_CASE("a frame that would exceed the limit is refused and the buffer left as it was") {
  Assignment a = sample(kMaxListedNodes);
  for (auto& n : a.nodes) n = std::string(kMaxHostBytes, 'n');
  std::vector<std::uint8_t> out{1, 2, 3};
  CHECK_THROWS_AS(append_frame(to_wire(a), out, 4096), std::length_error);
  CHECK(out == std::vector<std::uint8_t>{1, 2, 3});
  // The length counts the trailer the caller writes.
  const auto bytes = framed(to_wire(Heartbeat{1}), 32);
  const std::size_t length = (std::size_t{bytes[0]} << 24) | (bytes[1] << 16) | (bytes[2] << 8) | bytes[3];
  CHECK(length == bytes.size() - 4 + 32);
}
