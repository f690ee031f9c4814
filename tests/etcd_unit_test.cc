// The pure parts of the etcd backend (rendezvous/etcd_log.h): endpoints, base64, the key
// layout, the gateway's stream splitter, events, and the replay of a job's log into
// rendezvous::Job, which must give every agent the same decisions.
#include <catch2/catch.hpp>

#include <map>
#include <set>

#include "rendezvous/etcd_log.h"

using namespace mg::rdzv;
using namespace mg::rdzv::etcd;
using mg::proto::MsgType;

namespace {

constexpr std::int64_t T0 = 1'700'000'000'000;

Event join_event(const std::string& agent, const std::string& addr, std::int64_t t, int min = 3, int max = 3) {
  Event e;
  e.kind = Event::Kind::kJoin;
  e.agent = agent;
  e.t_ms = t;
  e.join.job_id = "job";
  e.join.agent_id = agent;
  e.join.host = "h" + addr;
  e.join.addr = addr;
  e.join.nproc = 2;
  e.join.min_nodes = min;
  e.join.max_nodes = max;
  e.join.max_restarts = 1;
  e.join.master_port = 4000;
  e.join.last_call_ms = 1000;
  e.join.join_timeout_ms = 5000;
  return e;
}

Event simple(Event::Kind kind, const std::string& agent, std::int64_t t) {
  Event e;
  e.kind = kind;
  e.agent = agent;
  e.t_ms = t;
  return e;
}

}  // namespace

TEST_CASE("etcd endpoints: lists, schemes and default port are parsed, bad ones are refused") {
  auto eps = parse_endpoints("127.0.0.1:2379,etcd://b,https://c.example:2380/");
  REQUIRE(eps.size() == 3);
  CHECK(eps[0].text() == "http://127.0.0.1:2379");
  CHECK(eps[1].text() == "http://b:2379");
  CHECK(eps[2].tls);
  CHECK(eps[2].text() == "https://c.example:2380");
  CHECK_THROWS_AS(parse_endpoints(""), std::invalid_argument);
  CHECK_THROWS_AS(parse_endpoints("a:1,,b:2"), std::invalid_argument);
  CHECK_THROWS_AS(parse_endpoints("ftp://a:1"), std::invalid_argument);
  CHECK_THROWS_AS(parse_endpoints("a:notaport"), std::invalid_argument);
}

TEST_CASE("etcd base64 round-trips any bytes and a prefix's range end follows every key under it") {
  for (std::string s : {std::string(), std::string("a"), std::string("ab"), std::string("abc"), std::string("\0\xff\x10x", 4)})
    CHECK(base64_decode(base64_encode(s)) == s);
  CHECK(base64_encode("foo") == "Zm9v");
  CHECK(base64_decode("YQ==") == "a");
  CHECK_THROWS_AS(base64_decode("a*b"), std::invalid_argument);
  CHECK(prefix_end("/mglaunch/j/") == "/mglaunch/j0");
  CHECK(prefix_end(std::string("a\xff", 2)) == "b");
  auto k = keys_for("/mglaunch/", "j");
  CHECK(k.root == "/mglaunch/j/");
  CHECK(k.log_key("h:1", 7) == "/mglaunch/j/log/h:1/0000000007");
  CHECK(k.agent_of_alive("/mglaunch/j/alive/h:1") == "h:1");
  CHECK(k.agent_of_alive("/mglaunch/j/log/h:1/1").empty());
  // A job id holds no '/' once in a key: no job's keys lie under another job's root.
  const auto team = keys_for("/mglaunch", "team").root, exp = keys_for("/mglaunch", "team/exp1").root;
  CHECK(exp == "/mglaunch/team%2Fexp1/");
  CHECK_FALSE(exp.starts_with(team));
  CHECK(keys_for("/mglaunch", "a%2Fb").root == "/mglaunch/a%252Fb/");
  CHECK(keys_for("/mglaunch", "a%2Fb").root != keys_for("/mglaunch", "a/b").root);
  // A job whose etcd_prefix is another job's root stays out of that job's own key ranges,
  // even when its id is one of their names.
  const auto t = keys_for("/mglaunch", "team");
  for (const char* id : {"log", "alive", "lease", "exp1"}) {
    const auto nested = keys_for("/mglaunch/team", id);
    CHECK_FALSE(nested.root.starts_with(t.log()));
    CHECK_FALSE(nested.root.starts_with(t.alive()));
    CHECK_FALSE(nested.root.starts_with(t.lease()));
  }
  CHECK(keys_for("/m", "log").root == "/m/%6Cog/");
  CHECK(keys_for("/m", "%6Cog").root == "/m/%256Cog/");  // injective: a literal '%' is escaped
  CHECK(number(nlohmann::json{{"revision", "42"}}, "revision") == 42);
  CHECK(number(nlohmann::json{{"revision", 7}}, "revision") == 7);
  CHECK(number(nlohmann::json::object(), "revision") == 0);
}

TEST_CASE("the gateway's stream is split into whole objects whatever the chunking") {
  const std::string text =
      R"({"result":{"created":true}}
{"result":{"events":[{"kv":{"key":"e30=","value":"{\"}"}}]}}{"result":{"x":"]}"}})";
  for (std::size_t chunk : {1u, 3u, 7u, 1000u}) {
    JsonStream s;
    std::vector<nlohmann::json> got;
    for (std::size_t i = 0; i < text.size(); i += chunk) {
      s.feed(std::string_view(text).substr(i, chunk));
      while (auto j = s.next()) got.push_back(*j);
    }
    REQUIRE(got.size() == 3);
    CHECK(got[0]["result"]["created"] == true);
    CHECK(got[1]["result"]["events"][0]["kv"]["value"] == "{\"}");
    CHECK(got[2]["result"]["x"] == "]}");
  }
  JsonStream bad;
  bad.feed("[1]");
  CHECK_THROWS(bad.next());
}

TEST_CASE("events survive JSON and a malformed event is refused") {
  auto j = join_event("a", "127.0.0.1", T0);
  auto back = event_from_json(to_json(j));
  CHECK(back.kind == Event::Kind::kJoin);
  CHECK(back.join.addr == "127.0.0.1");
  CHECK(back.t_ms == T0);
  Event lost = simple(Event::Kind::kLost, "b", T0 + 5);
  lost.why = "gone";
  CHECK(event_from_json(to_json(lost)).why == "gone");
  CHECK_THROWS_AS(event_from_json({{"kind", "explode"}, {"agent", "a"}, {"t", 1}}), std::invalid_argument);
  CHECK_THROWS_AS(event_from_json({{"kind", "join"}, {"agent", "a"}}), std::invalid_argument);
  auto neg = to_json(j);
  neg["join"]["nproc"] = -5;
  CHECK_THROWS_AS(event_from_json(neg), std::invalid_argument);
  // Times a steady_clock cannot hold and rounds that are not ints are refused, not wrapped.
  for (const nlohmann::json& t : {nlohmann::json(-1), nlohmann::json(INT64_MAX), nlohmann::json(1.5e300), nlohmann::json("1")}) {
    auto bad = to_json(j);
    bad["t"] = t;
    CHECK_THROWS_AS(event_from_json(bad), std::invalid_argument);
  }
  Event done = simple(Event::Kind::kDone, "a", T0);
  auto big = to_json(done);
  big["round"] = 1e300;
  CHECK_THROWS_AS(event_from_json(big), std::invalid_argument);
}

TEST_CASE("every agent replaying the same log gets its own place in one consistent round") {
  // Agents join in an order different from their addresses: ranks follow the addresses.
  const std::vector<Event> log = {join_event("c", "127.0.0.3", T0), join_event("a", "127.0.0.1", T0 + 10),
                                  join_event("b", "127.0.0.2", T0 + 20)};
  std::set<int> offsets;
  for (const std::string self : {"a", "b", "c"}) {
    JobReplay r("job", self);
    std::vector<mg::proto::Frame> mine;
    for (const auto& e : log)
      for (auto& f : r.apply(e)) mine.push_back(f);
    REQUIRE(mine.size() == 1);
    auto a = mg::proto::from_frame<mg::proto::Assignment>(mine[0]);
    CHECK(a.world_size == 6);
    CHECK(a.master_addr == "127.0.0.1");
    CHECK(a.group_rank == self[0] - 'a');
    offsets.insert(a.rank_offset);
  }
  CHECK(offsets == std::set<int>{0, 2, 4});
}

TEST_CASE("a last call is due only once its time has come, and the tick closes the round for everyone") {
  JobReplay r("job", "a");
  r.apply(join_event("a", "127.0.0.1", T0, 2, 3));
  r.apply(join_event("b", "127.0.0.2", T0 + 100, 2, 3));
  CHECK_FALSE(r.tick_due(T0 + 500));
  CHECK(r.tick_due(T0 + 1200));
  auto frames = r.apply(simple(Event::Kind::kTick, "b", T0 + 1200));
  REQUIRE(frames.size() == 1);
  CHECK(mg::proto::from_frame<mg::proto::Assignment>(frames[0]).group_world_size == 2);
  CHECK_FALSE(r.tick_due(T0 + 100000));  // running: liveness is the lease's, not heartbeats
}

TEST_CASE("a join that waits past join_timeout aborts when the tick comes") {
  JobReplay r("job", "a");
  r.apply(join_event("a", "127.0.0.1", T0));
  CHECK_FALSE(r.tick_due(T0 + 4000));
  REQUIRE(r.tick_due(T0 + 6000));
  auto frames = r.apply(simple(Event::Kind::kTick, "a", T0 + 6000));
  REQUIRE(frames.size() == 1);
  CHECK_THAT(mg::proto::from_frame<mg::proto::Abort>(frames[0]).reason, Catch::Contains("within join_timeout"));
}

TEST_CASE("a lost agent restarts the survivors with one count and is told Restart itself, as a silent node an agent "
          "host drops") {
  const std::vector<Event> base = {join_event("a", "127.0.0.1", T0), join_event("b", "127.0.0.2", T0 + 1),
                                   join_event("c", "127.0.0.3", T0 + 2)};
  Event lost = simple(Event::Kind::kLost, "b", T0 + 50);
  lost.why = "its etcd lease expired";
  for (const std::string self : {"a", "b", "c"}) {
    JobReplay r("job", self);
    for (const auto& e : base) r.apply(e);
    auto frames = r.apply(lost);
    REQUIRE(frames.size() == 1);
    // b too: it stops its workers and joins again (before: an Abort, where c10d's host tells
    // a node it dropped Restart).
    REQUIRE(mg::proto::type_of(frames[0]) == MsgType::kRestart);
    auto restart = mg::proto::from_frame<mg::proto::Restart>(frames[0]);
    CHECK(restart.restart_count == 1);
    CHECK_THAT(restart.reason, Catch::Contains("node h127.0.0.2 (127.0.0.2) lost: its etcd lease expired"));
    CHECK(r.apply(lost).empty());  // a second report of the same loss changes nothing
    CHECK_FALSE(r.live("b"));
  }
  SECTION("no restart left: the lost agent hears the job's Abort, as the others") {
    JobReplay r("job", "b");
    for (auto e : base) {
      e.join.max_restarts = 0;
      r.apply(e);
    }
    auto frames = r.apply(lost);
    REQUIRE(frames.size() == 1);
    REQUIRE(mg::proto::type_of(frames[0]) == MsgType::kAbort);
    CHECK_THAT(mg::proto::from_frame<mg::proto::Abort>(frames[0]).reason, Catch::Contains("its etcd lease expired"));
  }
}

TEST_CASE("a worker failure then everybody done: same decisions for every agent") {
  std::vector<Event> log = {join_event("a", "127.0.0.1", T0), join_event("b", "127.0.0.2", T0 + 1),
                            join_event("c", "127.0.0.3", T0 + 2)};
  Event failed = simple(Event::Kind::kFailed, "c", T0 + 10);
  failed.failed.round = 1;
  failed.failed.host = "h127.0.0.3";
  failed.failed.rank = 5;
  failed.failed.exit_code = 7;
  log.push_back(failed);
  for (const char* agent : {"a", "b", "c"}) log.push_back(join_event(agent, std::string("127.0.0.") + char('1' + (agent[0] - 'a')), T0 + 20));
  for (const char* agent : {"a", "b", "c"}) {
    Event done = simple(Event::Kind::kDone, agent, T0 + 30);
    done.round = 2;
    log.push_back(done);
  }
  for (const std::string self : {"a", "b", "c"}) {
    JobReplay r("job", self);
    std::vector<MsgType> types;
    for (const auto& e : log)
      for (auto& f : r.apply(e)) types.push_back(mg::proto::type_of(f));
    CHECK(types == std::vector<MsgType>{MsgType::kAssignment, MsgType::kRestart, MsgType::kAssignment, MsgType::kDone});
    CHECK(r.job().restart_count() == 1);
    CHECK(r.job().state() == Job::State::kDone);
  }
}

TEST_CASE("a standby in the log: every agent computes the same standby, and it takes the lost agent's place") {
  const std::vector<Event> base = {join_event("a", "127.0.0.1", T0, 2, 2), join_event("b", "127.0.0.2", T0 + 1, 2, 2),
                                   join_event("c", "127.0.0.0", T0 + 2, 2, 2)};
  Event lost = simple(Event::Kind::kLost, "a", T0 + 50);
  lost.why = "its etcd lease expired";
  const Event back = join_event("b", "127.0.0.2", T0 + 60, 2, 2);
  std::map<std::string, std::vector<MsgType>> seen;
  std::map<std::string, int> group_rank;
  for (const std::string self : {"a", "b", "c"}) {
    JobReplay r("job", self);
    for (const auto& e : base)
      for (auto& f : r.apply(e))
        if (mg::proto::type_of(f) != MsgType::kHeartbeat) seen[self].push_back(mg::proto::type_of(f));  // (the standby count)
    for (const auto& e : {lost, back})
      for (auto& f : r.apply(e)) {
        seen[self].push_back(mg::proto::type_of(f));
        if (mg::proto::type_of(f) == MsgType::kAssignment) group_rank[self] = mg::proto::from_frame<mg::proto::Assignment>(f).group_rank;
      }
    CHECK(r.job().round() == 2);
    CHECK(r.job().standbys() == 0);
  }
  CHECK(seen["c"] == std::vector<MsgType>{MsgType::kStandby, MsgType::kAssignment});
  CHECK(seen["b"] == std::vector<MsgType>{MsgType::kAssignment, MsgType::kRestart, MsgType::kAssignment});
  CHECK(seen["a"] == std::vector<MsgType>{MsgType::kAssignment, MsgType::kRestart});
  CHECK(group_rank["b"] == 1);  // b keeps its place
  CHECK(group_rank["c"] == 0);  // the standby takes a's
}

TEST_CASE("the job's run is the log's first record's: every agent that replays the log tells its workers the same run (#37)") {
  // Each agent writes its own new run into its records; the first record's wins everywhere.
  std::vector<Event> log = {join_event("c", "127.0.0.3", T0), join_event("a", "127.0.0.1", T0 + 10),
                            join_event("b", "127.0.0.2", T0 + 20)};
  const std::vector<std::string> runs = {"1700000000000-0000000000000003", "1700000000010-0000000000000001",
                                         "1700000000020-0000000000000002"};
  for (std::size_t i = 0; i < log.size(); ++i) log[i].run = runs[i];
  for (const std::string self : {"a", "b", "c"}) {
    JobReplay r("job", self);
    std::vector<mg::proto::Frame> mine;
    for (const auto& e : log)
      for (auto& f : r.apply(event_from_json(to_json(e)))) mine.push_back(f);  // through the log's JSON
    REQUIRE(mine.size() == 1);
    CHECK(mg::proto::from_frame<mg::proto::Assignment>(mine[0]).run == runs[0]);  // before: none
    CHECK(r.job().run() == runs[0]);
  }
  // A record of an agent before #37 has none; a run that is not MS-HEX is refused.
  CHECK_FALSE(to_json(join_event("a", "127.0.0.1", T0)).contains("run"));
  auto bad = to_json(log[0]);
  bad["run"] = "yesterday";
  CHECK_THROWS_AS(event_from_json(bad), std::invalid_argument);
}
