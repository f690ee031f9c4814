// Every field of every message is checked on receipt: what a hostile peer sends is
// refused with a reason (ProtocolError), never converted out of range or stored unbounded.
#include <catch2/catch.hpp>

#include "proto/messages.h"
#include "proto/text.h"

using namespace mg::proto;

namespace {

Join good_join() {
  Join j;
  j.job_id = "job";
  j.agent_id = "host:1";
  j.host = "host";
  j.addr = "127.0.0.1";
  j.min_nodes = 1;
  j.max_nodes = 2;
  return j;
}

// The Join frame with one field replaced by a raw JSON value.
Frame join_with(const std::string& field, nlohmann::json value) {
  Frame f = to_frame(good_join());
  f.payload[field] = std::move(value);
  return f;
}

std::string refusal(const Frame& f) {
  try {
    from_frame<Join>(f);
  } catch (const ProtocolError& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("a valid join passes and every out-of-range field is refused with its name") {
  CHECK(refusal(to_frame(good_join())).empty());
  CHECK_THAT(refusal(join_with("max_nodes", -1)), Catch::Contains("max_nodes = -1"));
  CHECK_THAT(refusal(join_with("max_nodes", 18446744073709551615ULL)), Catch::Contains("32 bits"));
  CHECK_THAT(refusal(join_with("nproc", 1e300)), Catch::Contains("not an integer"));
  CHECK_THAT(refusal(join_with("nproc", 0)), Catch::Contains("nproc"));
  CHECK_THAT(refusal(join_with("min_nodes", 0)), Catch::Contains("min_nodes"));
  CHECK_THAT(refusal(join_with("min_nodes", 3)), Catch::Contains("min_nodes 3 > max_nodes 2"));
  CHECK_THAT(refusal(join_with("job_id", std::string(1 << 20, 'j'))), Catch::Contains("job_id is 1048576 bytes"));
  CHECK_THAT(refusal(join_with("addr", std::string(600000, 'a'))), Catch::Contains("addr is 600000 bytes"));
  CHECK_THAT(refusal(join_with("job_id", "")), Catch::Contains("job_id is empty"));
  CHECK_THAT(refusal(join_with("master_port", 70000)), Catch::Contains("master_port"));
  CHECK_THAT(refusal(join_with("keep_alive_ms", -5)), Catch::Contains("keep_alive_ms"));
  CHECK_THAT(refusal(join_with("node_rank", 2)), Catch::Contains("node_rank"));
  CHECK_THAT(refusal(join_with("nproc", "eight")), Catch::Contains("malformed"));
  Frame not_a_map{static_cast<std::uint8_t>(MsgType::kJoin), nlohmann::json::array({1, 2})};
  CHECK_THAT(refusal(not_a_map), Catch::Contains("not a map"));
}

TEST_CASE("handshake messages need hex nonces and MACs of the right length") {
  CHECK_THROWS_AS(from_frame<Hello>(to_frame(Hello{"a", "job", "xyz"})), ProtocolError);
  CHECK_THROWS_AS(from_frame<Hello>(to_frame(Hello{"a", "", std::string(64, 'a')})), ProtocolError);
  CHECK_NOTHROW(from_frame<Hello>(to_frame(Hello{"a", "job", std::string(64, 'a')})));
  // reads_not_hosting (review s39-listen M3): false when absent (an older client's Hello).
  const nlohmann::json older = {{"agent_id", "a"}, {"job_id", "job"}, {"nonce", std::string(64, 'a')}};
  CHECK_FALSE(from_frame<Hello>(Frame{static_cast<std::uint8_t>(MsgType::kHello), older}).reads_not_hosting);
  CHECK(from_frame<Hello>(to_frame(Hello{"a", "job", std::string(64, 'a'), true})).reads_not_hosting);
  CHECK_THROWS_AS(from_frame<Auth>(to_frame(Auth{std::string(64, 'G')})), ProtocolError);
}

TEST_CASE("failure reports are cut to their limits by the sender and refused beyond them by the receiver") {
  WorkerFailed f;
  f.host = "h";
  f.message = std::string(100000, 'm');
  f.last_lines.assign(100, std::string(2000, 'l'));
  CHECK_THROWS_AS(from_frame<WorkerFailed>(to_frame(f)), ProtocolError);
  truncate_to_limits(f);
  auto back = from_frame<WorkerFailed>(to_frame(f));
  CHECK(back.message.size() == kMaxTextBytes);
  CHECK(back.last_lines.size() == kMaxLines);
  CHECK(back.last_lines[0].size() == kMaxLineBytes);
  CHECK(truncate_text("\xc3\xa9\xc3\xa9\xc3\xa9", 5) == "...");  // no half UTF-8 character is left
}

TEST_CASE("every text field must be UTF-8 without control characters and the sender makes its report so") {
  using mg::proto::printable;
  using mg::proto::text_problem;
  CHECK(text_problem("plain ascii, é, 日本, 🙂").empty());
  CHECK(text_problem("a\xff").find("not valid UTF-8 (byte 1)") != std::string::npos);
  CHECK_FALSE(text_problem("\xc0\xaf").empty());          // overlong '/'
  CHECK_FALSE(text_problem("\xed\xa0\x80").empty());      // a surrogate
  CHECK_FALSE(text_problem("\xf4\x90\x80\x80").empty());  // past U+10FFFF
  CHECK_FALSE(text_problem("\xe6\x97").empty());          // cut short
  CHECK(text_problem("a\x1b[2J").find("control character (U+001B at byte 1)") != std::string::npos);
  CHECK_FALSE(text_problem("tab\there").empty());
  CHECK_FALSE(text_problem("\xc2\x85").empty());  // U+0085, a C1 control
  CHECK(printable("a\tb\nc\x1b\xff日") == "a b c\xEF\xBF\xBD\xEF\xBF\xBD日");
  CHECK(printable("a\tb\nc\x1b\xff日", mg::proto::Charset::kAscii) == "a b c???");  // (a local file's line)
  for (std::string bad : {"\xff\xfe", "\xc0\xaf", "x\x7f", "\xe6\x97", "\xed\xa0\x80"}) CHECK(text_problem(printable(bad)).empty());
  CHECK(mg::proto::dump_json(nlohmann::json{{"k", "a\xff"}}) == "{\"k\":\"a\xEF\xBF\xBD\"}");

  Join j;
  j.job_id = "job\xff";
  j.agent_id = "a";
  j.addr = "127.0.0.1";
  CHECK(validate(j) == "job_id is not valid UTF-8 (byte 3)");
  WorkerFailed f;
  f.message = "boom\n\x1b[31mred\xfe";
  f.last_lines = {"ok", "bad\xff"};
  f.host = "h\x01";
  CHECK_FALSE(validate(f).empty());
  truncate_to_limits(f);
  CHECK(validate(f).empty());
  CHECK(f.message == "boom \xEF\xBF\xBD[31mred\xEF\xBF\xBD");
  CHECK(validate(Error{"refused: \x1b]0;title\x07"}).find("message holds a control character") != std::string::npos);
}

TEST_CASE("an assignment listing the most nodes of the longest addresses fits in a default frame") {
  Assignment a;
  a.group_world_size = static_cast<int>(kMaxListedNodes);
  a.world_size = a.group_world_size;
  a.master_addr = "m";
  a.nodes.assign(kMaxListedNodes, std::string(kMaxHostBytes, 'n'));
  a.voters.assign(kMaxListedNodes, std::string(kMaxIdBytes, 'v'));  // and the most voters (#34)
  a.run = "1700000000000-" + std::string(kMaxRunBytes - 14, 'f');    // and the longest run (#37)
  CHECK(run_problem(a.run).empty());
  CHECK_NOTHROW(encode(to_frame(a)));
}

TEST_CASE("an assignment, a standby message and a join carry the run (MS-HEX), a frame from before #37 decodes with "
          "none, and a run that is not MS-HEX is refused (#37)") {
  const std::string run = "1700000000000-00000000000000ab";
  Assignment a;
  a.round = 4;
  a.master_addr = "m";
  a.run = run;
  CHECK(from_frame<Assignment>(to_frame(a)).run == run);
  Frame old = to_frame(a);
  old.payload.erase("run");
  CHECK(from_frame<Assignment>(old).run.empty());
  Standby s;
  s.run = run;
  CHECK(from_frame<Standby>(to_frame(s)).run == run);
  Join j;
  j.job_id = "j";
  j.agent_id = "n0:1";
  j.addr = "a";
  j.epoch = 7;
  j.run = run;
  CHECK(from_frame<Join>(to_frame(j)).run == run);
  for (const std::string& bad : std::vector<std::string>{"x", "17", "17-", "-ab", "17-AB", "17-ab\n", "12345678901234567890-ab",
                                "1-" + std::string(kMaxRunBytes, 'a')}) {
    INFO(bad);
    a.run = j.run = s.run = bad;
    CHECK(validate(a).find("is not MS-HEX") != std::string::npos);
    CHECK(validate(j).find("is not MS-HEX") != std::string::npos);
    CHECK(validate(s).find("is not MS-HEX") != std::string::npos);
  }
}

// Round 4 at epoch 7, its voters two nodes and a standby.
static Assignment epoch_7_of_three() {
  Assignment a;
  a.round = 4;
  a.master_addr = "m";
  a.epoch = 7;
  a.voters = {"n0:1", "n1:2", "standby:3"};
  return a;
}

TEST_CASE("an assignment and a standby message carry their standby voters' takeover addresses, a frame from before "
          "them decodes with none, and a port list of another length or a port out of range is refused (review "
          "s39-late M1)") {
  Assignment a = epoch_7_of_three();
  a.nodes = {"127.0.0.2", "127.0.0.3"};
  a.takeover_ports = {0, 7003};
  a.standby_nodes = {"127.0.0.4"};
  a.standby_takeover_ports = {7004};
  CHECK(validate(a).empty());
  const auto back = from_frame<Assignment>(to_frame(a));
  CHECK(back.standby_nodes == a.standby_nodes);
  CHECK(back.standby_takeover_ports == a.standby_takeover_ports);
  Frame old = to_frame(a);
  old.payload.erase("standby_nodes");
  old.payload.erase("standby_takeover_ports");
  CHECK(from_frame<Assignment>(old).standby_nodes.empty());
  Standby s;
  s.standby_nodes = a.standby_nodes;
  s.standby_takeover_ports = a.standby_takeover_ports;
  CHECK(from_frame<Standby>(to_frame(s)).standby_takeover_ports == a.standby_takeover_ports);
  Assignment short_ports = a;
  short_ports.standby_takeover_ports = {7004, 7005};
  CHECK(validate(short_ports).find("standby_takeover_ports lists 2 entries for 1 nodes") != std::string::npos);
  s.standby_takeover_ports = {65536};
  CHECK(validate(s).find("takeover port") != std::string::npos);
}

TEST_CASE("an assignment and a standby message carry the host's vote address, a join its vote port, a frame from "
          "before them decodes with none, and a port out of range is refused (review s40-recall M1)") {
  Assignment a = epoch_7_of_three();
  a.host_vote_addr = "127.0.0.2";
  a.host_vote_port = 7101;
  CHECK(validate(a).empty());
  const auto back = from_frame<Assignment>(to_frame(a));
  CHECK(back.host_vote_addr == "127.0.0.2");
  CHECK(back.host_vote_port == 7101);
  Frame old = to_frame(a);
  old.payload.erase("host_vote_addr");
  old.payload.erase("host_vote_port");
  CHECK(from_frame<Assignment>(old).host_vote_port == 0);
  Standby s;
  s.host_vote_addr = a.host_vote_addr;
  s.host_vote_port = 65536;
  CHECK(validate(s).find("host_vote_port") != std::string::npos);
  Join j;
  j.job_id = j.agent_id = j.addr = "x";
  j.vote_port = 7101;
  CHECK(from_frame<Join>(to_frame(j)).vote_port == 7101);
  j.vote_port = -1;
  CHECK(validate(j).find("vote_port") != std::string::npos);
}

TEST_CASE("an assignment and a standby message carry the epoch and its voters, a peer's frame from before #34 "
          "(no such fields) decodes with epoch 0 and no voters, and one with fields this build does not know "
          "decodes all the same (#34)") {
  const Assignment a = epoch_7_of_three();
  const auto back = from_frame<Assignment>(to_frame(a));
  CHECK(back.epoch == 7);
  CHECK(back.voters == a.voters);
  Frame old = to_frame(a);
  old.payload.erase("epoch");
  old.payload.erase("voters");
  const auto from_old = from_frame<Assignment>(old);
  CHECK(from_old.epoch == 0);
  CHECK(from_old.voters.empty());
  Frame newer = to_frame(a);
  newer.payload["a_later_field"] = 1;
  CHECK(from_frame<Assignment>(newer).epoch == 7);
  Assignment negative = a;
  negative.epoch = -1;
  CHECK(validate(negative).find("epoch") != std::string::npos);
  Assignment bad_voter = a;
  bad_voter.voters[1] = "";
  CHECK(validate(bad_voter).find("voter") != std::string::npos);
  Assignment too_many = a;
  too_many.voters.assign(kMaxListedNodes + 1, "v");
  CHECK(validate(too_many).find("voters lists") != std::string::npos);
  Standby s;
  s.epoch = 7;
  s.voters = a.voters;
  const auto sb = from_frame<Standby>(to_frame(s));
  CHECK(sb.epoch == 7);
  CHECK(sb.voters == a.voters);
  Join j;
  j.job_id = "j";
  j.agent_id = "n0:1";
  j.addr = "a";
  j.epoch = 7;
  CHECK(from_frame<Join>(to_frame(j)).epoch == 7);
}

TEST_CASE("a standby message takes a node count and a 1-based position, and refuses others (#26)") {
  Standby ok;
  ok.active_nodes = 2;
  ok.position = 1;
  CHECK(validate(ok).empty());
  auto back = from_frame<Standby>(to_frame(ok));
  CHECK(back.active_nodes == 2);
  CHECK(back.position == 1);
  Standby zero = ok;
  zero.position = 0;
  CHECK(validate(zero).find("position") != std::string::npos);
  Standby negative = ok;
  negative.active_nodes = -1;
  CHECK(validate(negative).find("active_nodes") != std::string::npos);
  CHECK_THROWS_AS(from_frame<Standby>(to_frame(Done{})), ProtocolError);
}

TEST_CASE("a standby message carries its round's takeover candidates, checked as an assignment's (#26)") {
  Standby ok;
  ok.round = 3;
  ok.restart_count = 1;
  ok.nodes = {"127.0.0.2", "127.0.0.3"};
  ok.takeover_ports = {0, 4101};
  REQUIRE(validate(ok).empty());
  auto back = from_frame<Standby>(to_frame(ok));
  CHECK(back.round == 3);
  CHECK(back.restart_count == 1);
  CHECK(back.nodes == ok.nodes);
  CHECK(back.takeover_ports == ok.takeover_ports);
  Standby mismatched = ok;
  mismatched.takeover_ports = {4101};
  CHECK(validate(mismatched).find("takeover_ports lists 1 entries for 2 nodes") != std::string::npos);
  Standby bad_port = ok;
  bad_port.takeover_ports = {0, 70000};
  CHECK(validate(bad_port).find("takeover port") != std::string::npos);
  Standby bad_addr = ok;
  bad_addr.nodes[1] = "a\nb";
  CHECK(!validate(bad_addr).empty());
  Heartbeat hb{5, 2};
  CHECK(from_frame<Heartbeat>(to_frame(hb)).standbys == 2);
  hb.standbys = -1;
  CHECK(validate(hb).find("standbys") != std::string::npos);
}
