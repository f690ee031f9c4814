// An agent's takeover socket (rdzv::Server with ServerOptions::not_hosting, #34) under a
// hostile client of our own: what it answers before it hosts, what it holds for an older
// client (bounded in time and memory) and how it serves the held once it hosts.
#include <catch2/catch.hpp>

#include <algorithm>
#include <chrono>
#include <functional>
#include <future>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <boost/asio/post.hpp>
#include <nlohmann/json.hpp>

#include "proto/messages.h"
#include "rendezvous/auth.h"
#include "rendezvous/server.h"
#include "support/raw_peer.h"

using namespace mgtest;
using namespace std::chrono_literals;
namespace proto = mg::proto;
namespace auth = mg::rdzv::auth;

// #34, review s38 M2: an agent's takeover socket listens from its start (ServerOptions::
// not_hosting). Every Hello gets one NotHosting frame, whose proof only a holder of the
// job's key can make for this connection's nonce, and the close; no job is made. Once the
// agent hosts (host(), as take_over() does), the same socket runs the handshake.
namespace {

// An agent's takeover socket that does not host yet (ServerOptions::not_hosting) of job
// "job" at `run`, on its own io thread; with `token`, the job's key is the token's.
struct TakeoverSocket {
  explicit TakeoverSocket(const std::string& run, bool token = true,
                          std::chrono::milliseconds handshake_timeout = std::chrono::seconds(10),
                          const std::function<void(mg::rdzv::ServerOptions&)>& tweak = {}) {
    mg::rdzv::ServerOptions so;
    so.handshake_timeout = handshake_timeout;
    if (tweak) tweak(so);
    so.host = "127.0.0.1";
    so.only_job = "job";
    if (token) so.job_tokens["job"] = key;
    so.host_agent = "node-2";
    so.not_hosting = true;
    server.emplace(io, so);
    server->tell_run(run);
    loop = std::thread([this] { io.run(); });
  }
  ~TakeoverSocket() {
    on_loop([&] { server->stop(); });
    io.stop();
    loop.join();
  }
  // Runs `f` on the server's io thread and waits for it.
  template <typename F>
  void on_loop(F f) {
    std::promise<void> done;
    boost::asio::post(io, [&] {
      f();
      done.set_value();
    });
    done.get_future().wait();
  }
  // The value of metrics() series `series` (its labels included), read on the io thread.
  std::uint64_t metric(const std::string& series) {
    std::string text;
    on_loop([&] { text = server->metrics(); });
    const auto at = text.find("\nmglaunch_rdzv_" + series + " ");
    return at == std::string::npos ? 0 : std::stoull(text.substr(at + series.size() + 16));
  }
  const std::string key = auth::job_key(kToken, "job");
  boost::asio::io_context io{1};
  std::optional<mg::rdzv::Server> server;
  std::thread loop;
};

proto::Hello hello_reading_not_hosting(const std::string& job, const std::string& nonce) {
  proto::Hello h{"hostile", job, nonce};
  h.reads_not_hosting = true;
  return h;
}

}  // namespace

TEST_CASE("a takeover socket that does not host answers each hello with 'alive, not hosting' (job, run, a proof of "
          "the job's key over the client's nonce) and closes, and once it hosts the same socket challenges") {
  const std::string run = "1764500000000-0123456789abcdef";
  TakeoverSocket t(run);
  for (const std::string job : {"job", "another-job"}) {  // (the answer is this job's, whatever the hello named)
    RawPeer p(t.server->port());
    const std::string cn = auth::random_hex(32);
    REQUIRE(p.send(proto::to_frame(hello_reading_not_hosting(job, cn))));
    const auto f = p.read(5s);
    REQUIRE(f);
    REQUIRE(proto::type_of(*f) == proto::MsgType::kNotHosting);
    const auto n = proto::from_frame<proto::NotHosting>(*f);
    CHECK(n.job_id == "job");
    CHECK(n.run == run);
    CHECK(n.host_agent == "node-2");
    CHECK(n.proof == auth::not_hosting_proof(t.key, cn, run));
    CHECK(p.closed_within(5s));
  }
  t.on_loop([&] { CHECK(t.server->jobs_json().empty()); });
  t.on_loop([&] { t.server->host(); });
  RawPeer p(t.server->port());
  REQUIRE(p.send(proto::to_frame(hello_reading_not_hosting("job", auth::random_hex(32)))));
  const auto f = p.read(5s);
  REQUIRE(f);
  CHECK(proto::type_of(*f) == proto::MsgType::kChallenge);
}

// Review s39-listen M3: an older client (its Hello has no reads_not_hosting) reads NotHosting
// as a failed try and passes a candidate over that has not noticed the host's loss yet; a
// reset or an end of file passes it over too. Its Hello waits unanswered until the socket
// hosts, and is then served (the Join that rode with it too).
TEST_CASE("a takeover socket that does not host answers an older client's hello with nothing and keeps it open, and "
          "serves it once it hosts (review s39-listen M3)") {
  for (const bool token : {true, false}) {
    CAPTURE(token);
    TakeoverSocket t("1764500000000-0123456789abcdef", token);
    RawPeer old(t.server->port());
    REQUIRE(old.send(proto::to_frame(proto::Hello{"hostile", "job", auth::random_hex(32)})));
    if (!token) REQUIRE(old.send(proto::to_frame(join_for("job"))));  // (a Join rides with the Hello)
    // A newer client's hello, sent after it, is answered with NotHosting.
    RawPeer now(t.server->port());
    REQUIRE(now.send(proto::to_frame(hello_reading_not_hosting("job", auth::random_hex(32)))));
    const auto n = now.read(5s);
    REQUIRE(n);
    CHECK(proto::type_of(*n) == proto::MsgType::kNotHosting);
    // The older one: no frame and no close (before: NotHosting and a close).
    CHECK_FALSE(old.closed_within(500ms));
    CHECK(old.received().empty());
    t.on_loop([&] { t.server->host(); });
    const auto f = old.read(5s);
    REQUIRE(f);
    CHECK(proto::type_of(*f) == (token ? proto::MsgType::kChallenge : proto::MsgType::kWelcome));
    if (!token)  // its Join was read too: the job has its node
      t.on_loop([&] { CHECK(t.server->jobs_json().dump().find("127.0.0.9") != std::string::npos); });
  }
}

// Review s40 L1: a held Hello's handshake deadline ran from its connect, so a long hold cut
// the handshake that its replay began. Served, it has the whole deadline again.
TEST_CASE("an older client's hello held by a takeover socket has the whole handshake deadline again once the socket "
          "hosts, and a held one is closed at that deadline (review s40 L1)") {
  // (Margins of 2.5-3 s each way: a loaded machine's scheduling lag must not decide it.)
  TakeoverSocket t("1764500000000-0123456789abcdef", true, 6s);
  RawPeer old(t.server->port());
  REQUIRE(old.send(proto::to_frame(proto::Hello{"hostile", "job", auth::random_hex(32)})));
  CHECK_FALSE(old.closed_within(3s));  // held half its deadline
  t.on_loop([&] { t.server->host(); });
  const auto f = old.read(5s);
  REQUIRE(f);
  CHECK(proto::type_of(*f) == proto::MsgType::kChallenge);
  CHECK_FALSE(old.closed_within(3500ms));  // (before: closed 6 s after its connect, 3 s after the challenge)
  CHECK(old.closed_within(15s));           // no Auth: closed at the deadline from the challenge
  // A hello held that long is closed at the deadline from its connect (held_timeout: below).
  TakeoverSocket held("1764500000000-0123456789abcdef", true, 1s,
                      [](mg::rdzv::ServerOptions& so) { so.held_timeout = 1s; });
  RawPeer waits(held.server->port());
  REQUIRE(waits.send(proto::to_frame(proto::Hello{"hostile", "job", auth::random_hex(32)})));
  CHECK(waits.closed_within(10s));
  CHECK(waits.received().empty());
}

// Review s40 L1: a held Hello was closed at the handshake deadline (10 s), which the agent
// never sets, so an older client whose keep_alive_interval is longer passed this node over
// at 10 s, not at its interval. A held Hello has its own bound (held_timeout, 60 s); a
// connection that sends nothing keeps the handshake's.
TEST_CASE("an older client's hello held by a takeover socket is kept past the handshake deadline until its own bound "
          "(held_timeout), and a silent connection is still closed at the handshake deadline (review s40 L1)") {
  // (Margins of 2.5 s each way: a loaded machine's scheduling lag must not decide it.)
  TakeoverSocket t("1764500000000-0123456789abcdef", true, 1s,
                   [](mg::rdzv::ServerOptions& so) { so.held_timeout = 6s; });
  RawPeer old(t.server->port());
  REQUIRE(old.send(proto::to_frame(proto::Hello{"hostile", "job", auth::random_hex(32)})));
  RawPeer silent(t.server->port());
  CHECK_FALSE(old.closed_within(3500ms));  // (before: closed 1 s after its connect)
  CHECK(silent.closed_within(10ms));       // (closed 1 s after its connect)
  CHECK(old.closed_within(15s));
  CHECK(old.received().empty());
}

// Review s40 L2: a held Hello and Join were kept as parsed trees outside the memory budget
// (a 4 KiB Join of empty arrays parses to about 200 KB), so one address's 256 connections
// pinned about 100 MB. Held as bytes, charged to the budget: past the limit, refused.
TEST_CASE("older clients' hellos and joins held by a takeover socket are charged to its memory limit, and those past "
          "it are refused (review s40 L2)") {
  constexpr std::size_t kLimit = 64 << 10;
  TakeoverSocket t("1764500000000-0123456789abcdef", false, 10s,  // (no token: each Join is read once it hosts)
                   [](mg::rdzv::ServerOptions& so) { so.max_memory = kLimit; });
  const auto idle = t.metric("memory_bytes");
  auto join = proto::to_frame(join_for("job"));
  join.payload["pad"] = std::string(3500, 'x');  // (a key Join does not define: read and ignored)
  constexpr int kPeers = 40;                       // 40 x 3.6 KiB: more than twice the limit
  std::vector<std::unique_ptr<RawPeer>> peers;
  for (int i = 0; i < kPeers; ++i) {
    peers.push_back(std::make_unique<RawPeer>(t.server->port()));
    REQUIRE(peers.back()->send(proto::to_frame(proto::Hello{"hostile", "job", auth::random_hex(32)})));
    peers.back()->send(join);  // (false when refused at the connect: the budget is spent)
  }
  // Every frame read, or every connection past those read refused (bounded: 10 s).
  for (int i = 0; i < 100 && t.metric("frames_received_total") +
                                     2 * t.metric("connections_refused_total{reason=\"memory\"}") <
                                 std::uint64_t{2} * kPeers;
       ++i)
    std::this_thread::sleep_for(100ms);
  const auto used = t.metric("memory_bytes");
  CHECK(used <= kLimit);
  CHECK(used - idle >= kLimit / 2);  // (before: nothing held was charged)
  std::vector<bool> closed;
  for (auto& p : peers) closed.push_back(p->closed_within(100ms));
  const auto n_closed = std::count(closed.begin(), closed.end(), true);
  CHECK(n_closed >= kPeers - static_cast<int>(kLimit / 3500));
  CHECK(n_closed < kPeers);
  // Those held are served once the socket hosts, and the budget is given back.
  t.on_loop([&] { t.server->host(); });
  for (std::size_t i = 0; i < peers.size(); ++i)
    if (!closed[i]) {
      const auto f = peers[i]->read(5s);
      REQUIRE(f);
      CHECK(proto::type_of(*f) == proto::MsgType::kWelcome);
    }
  CHECK(t.metric("memory_bytes") < used);
}

// Review s40 L3: take_over() makes the job (the seed's run) before host() replays a held
// Hello; the other way round, a held no-token Hello+Join was welcomed with no run and its
// Join made a job of a fresh run before the seed came.
TEST_CASE("a takeover socket that takes the job over welcomes an older client's held hello and join into the seed's "
          "run (review s40 L3)") {
  const std::string run = "1764500000000-0123456789abcdef", seed_run = "1764400000000-fedcba9876543210";
  TakeoverSocket t(run, false);
  const auto idle = t.metric("memory_bytes");
  RawPeer old(t.server->port());
  REQUIRE(old.send(proto::to_frame(proto::Hello{"hostile", "job", auth::random_hex(32)})));
  REQUIRE(old.send(proto::to_frame(join_for("job"))));
  // Held: its bytes are charged (bounded: 10 s), nothing is answered, no job is made.
  for (int i = 0; i < 100 && t.metric("memory_bytes") <= idle; ++i) std::this_thread::sleep_for(100ms);
  REQUIRE(t.metric("memory_bytes") > idle);
  CHECK_FALSE(old.closed_within(200ms));
  CHECK(old.received().empty());
  t.on_loop([&] { CHECK(t.server->jobs_json().empty()); });
  mg::rdzv::TakeoverSeed seed;
  seed.round = 3;
  seed.reason = "rendezvous host node-0 lost: silent";
  seed.lost_host = "node-0";
  seed.deadline = mg::rdzv::Clock::now() + 60s;
  seed.survivors = 2;
  seed.world_size = 2;
  seed.run = seed_run;
  t.on_loop([&] { t.server->take_over("job", seed); });
  const auto f = old.read(5s);
  REQUIRE(f);
  REQUIRE(proto::type_of(*f) == proto::MsgType::kWelcome);
  CHECK(proto::from_frame<proto::Welcome>(*f).run == seed_run);
  nlohmann::json jobs;
  t.on_loop([&] { jobs = t.server->jobs_json(); });
  REQUIRE(jobs.size() == 1);
  CHECK(jobs[0]["id"] == "job");
  CHECK(jobs[0]["round"] == 3);
  CHECK(jobs[0].dump().find("127.0.0.9") != std::string::npos);  // its Join was read into it
}

// What a held session may send before the socket hosts: the Join that rides with an older
// client's Hello, and nothing else (review s40 L2, L3).
TEST_CASE("a takeover socket holding an older client's hello refuses a third frame, and a second that is not a Join "
          "(review s40 L3)") {
  TakeoverSocket t("1764500000000-0123456789abcdef", false);
  RawPeer third(t.server->port());
  REQUIRE(third.send(proto::to_frame(proto::Hello{"hostile", "job", auth::random_hex(32)})));
  REQUIRE(third.send(proto::to_frame(join_for("job"))));
  third.send(proto::to_frame(proto::Heartbeat{1, 0}));
  CHECK(third.closed_within(5s));
  CHECK(third.received().find("a third frame before this rendezvous host's answer") != std::string::npos);
  RawPeer second(t.server->port());
  REQUIRE(second.send(proto::to_frame(proto::Hello{"hostile", "job", auth::random_hex(32)})));
  second.send(proto::to_frame(proto::Heartbeat{1, 0}));
  CHECK(second.closed_within(5s));  // (before: held, and refused only once it hosts)
  CHECK(second.received().find("before this rendezvous host's answer") != std::string::npos);
}

// Review s41-a L5: a refused session went on with the frames already in its read buffer (a
// graceful close only lingers): a second refusal, a second Error frame and log line, and
// refusals_total counted twice for one peer. Now a refused session handles no more frames.
TEST_CASE("a session refused handles none of the frames that came with the refused one: one refusal, one Error "
          "(review s41-a L5)") {
  TakeoverSocket t("1764500000000-0123456789abcdef", false);
  RawPeer peer(t.server->port());
  std::vector<std::uint8_t> bytes = peer.encoded(proto::to_frame(proto::Hello{"hostile", "job", auth::random_hex(32)}));
  for (int i = 0; i < 2; ++i) {  // refused (not a Join after a held Hello), then one more in the same write
    const auto beat = peer.encoded(proto::to_frame(proto::Heartbeat{1, 0}));
    bytes.insert(bytes.end(), beat.begin(), beat.end());
  }
  REQUIRE(peer.send_bytes(bytes));
  CHECK(peer.closed_within(5s));
  CHECK(peer.received().find("before this rendezvous host's answer") != std::string::npos);
  CHECK(t.metric("refusals_total") == 1);  // (before: 2)
}

// Review s39-listen L3: an agent that hosts at the endpoint after a stale recall keeps its
// takeover socket, which had the hosting server's whole descriptor share too (twice the
// budget). Limited, it holds the connections it has and refuses any beyond the limit.
TEST_CASE("a takeover socket limited to N connections keeps those open and closes one more before any frame "
          "(review s39-listen L3)") {
  TakeoverSocket t("1764500000000-0123456789abcdef");
  std::vector<std::unique_ptr<RawPeer>> held;  // older clients' hellos: held open, unanswered
  for (int i = 0; i < 3; ++i) {
    held.push_back(std::make_unique<RawPeer>(t.server->port()));
    REQUIRE(held.back()->send(proto::to_frame(proto::Hello{"hostile", "job", auth::random_hex(32)})));
  }
  RawPeer probe(t.server->port());  // (once answered, every hello before it was read)
  REQUIRE(probe.send(proto::to_frame(hello_reading_not_hosting("job", auth::random_hex(32)))));
  REQUIRE(probe.read(5s));
  t.on_loop([&] { t.server->limit_connections(2); });
  RawPeer beyond(t.server->port());
  CHECK(beyond.closed_within(5s));
  CHECK(beyond.received().empty());
  for (auto& p : held) CHECK_FALSE(p->closed_within(100ms));
}

// Review s41-c L2: the hosting agent's vote socket never hosts, so an older client's hello
// held there (60 s, 8 connections in all) only kept others, whose recalls count the host's
// answer, out. There it is answered at once, and one held before the call is answered then.
TEST_CASE("a takeover socket that never hosts (the host's vote socket) answers an older client's hello with 'alive, "
          "not hosting' at once and closes, the held ones too, and reads no join that rode with it (review s41-c L2)") {
  for (const bool token : {true, false}) {
    CAPTURE(token);
    TakeoverSocket t("1764500000000-0123456789abcdef", token);
    RawPeer before(t.server->port());
    REQUIRE(before.send(proto::to_frame(proto::Hello{"hostile", "job", auth::random_hex(32)})));
    CHECK_FALSE(before.closed_within(500ms));  // held, as on any takeover socket
    t.on_loop([&] { t.server->answer_older_hellos(); });
    const auto b = before.read(5s);
    REQUIRE(b);
    CHECK(proto::type_of(*b) == proto::MsgType::kNotHosting);
    RawPeer old(t.server->port());
    REQUIRE(old.send(proto::to_frame(proto::Hello{"hostile", "job", auth::random_hex(32)})));
    if (!token) REQUIRE(old.send(proto::to_frame(join_for("job"))));  // (a Join rides with the Hello)
    const auto f = old.read(5s);
    REQUIRE(f);
    CHECK(proto::type_of(*f) == proto::MsgType::kNotHosting);
    CHECK(old.closed_within(5s));
    t.on_loop([&] { CHECK(t.server->jobs_json().dump().find("127.0.0.9") == std::string::npos); });
  }
}
