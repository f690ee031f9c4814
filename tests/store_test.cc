// The agent's store (store/): the pure wire parser and engine, then the server against real
// torch clients: 1.13 here, 2.6 inside ../shared/peers/torch2's root when it is set up.
#include <malloc.h>
#include <poll.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>

#include <chrono>
#include <cstring>
#include <fstream>
#include <future>
#include <limits>
#include <regex>
#include <set>
#include <atomic>
#include <thread>

#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/write.hpp>
#include <catch2/catch.hpp>
#include <fmt/format.h>

#include "store/engine.h"
#include "store/server.h"
#include "store/wire.h"
#include "support/net.h"
#include "support/proc.h"
#include "support/skip.h"
#include "support/torch2.h"

using namespace mg::store;
using namespace mgtest;
using namespace std::chrono_literals;

namespace {

std::string u64(std::uint64_t v) { return std::string(reinterpret_cast<const char*>(&v), 8); }
std::string str(std::string_view s) { return u64(s.size()) + std::string(s); }
std::string byte(int b) { return std::string(1, static_cast<char>(b)); }
std::string validate() {
  std::uint32_t m = kValidationMagic;
  return byte(0) + std::string(reinterpret_cast<const char*>(&m), 4);
}

// A server on its own thread, stopped and joined when the test ends (also on failure).
struct ServerThread {
  boost::asio::io_context io;
  std::unique_ptr<StoreServer> server;
  std::thread thread;
  std::vector<std::string> log;
  explicit ServerThread(ServerOptions o = {}) {
    o.log = [this](const std::string& l) { log.push_back(l); };
    server = std::make_unique<StoreServer>(io, "127.0.0.1", 0, o);
    thread = std::thread([this] {
      auto guard = boost::asio::make_work_guard(io);
      io.run();
    });
  }
  ~ServerThread() {
    boost::asio::post(io, [this] { server->stop(); io.stop(); });
    thread.join();
  }
  int port() const { return server->port(); }
};

// `f()` run on the server's io thread (its counters are the io thread's).
template <typename F>
auto on_io(ServerThread& s, F f) {
  std::promise<decltype(f())> p;
  auto r = p.get_future();
  boost::asio::post(s.io, [&] { p.set_value(f()); });
  return r.get();
}

std::string client_script() {
  static const TmpCopy copy("tests/store_client.py");
  return copy.path();
}

// Three ranks of store_client.py's env:// gloo all-reduce, each started by `prefix` + the
// script's arguments; every one must print the sum 1+2+3.
void three_rank_allreduce(const std::vector<std::string>& prefix, const std::string& port,
                          std::chrono::seconds timeout) {
  std::vector<Proc> ranks;
  for (int r = 0; r < 3; ++r) {
    auto argv = prefix;
    argv.insert(argv.end(), {client_script(), "allreduce", "127.0.0.1", port, std::to_string(r), "3"});
    ranks.push_back(spawn(argv));
  }
  for (auto& p : ranks) {
    REQUIRE(p.wait(timeout));
    INFO(p.out() << p.err());
    CHECK(p.exit_code() == 0);
    CHECK_THAT(p.out(), Catch::Contains("sum 6"));
  }
}

}  // namespace

TEST_CASE("the first query tells a torch 1.x client from a 2.x one, and each dialect numbers its queries") {
  Dialect d = Dialect::kUnknown;
  auto p = parse_query(byte(0) + str("/k") + str("v"), d);  // 1.x: SET is 0
  REQUIRE(p.status == Parsed::kOk);
  CHECK(d == Dialect::kV1);
  CHECK(p.query.op == Op::kSet);
  CHECK(p.query.keys == std::vector<std::string>{"/k"});
  CHECK(p.query.values == std::vector<std::string>{"v"});

  d = Dialect::kUnknown;
  p = parse_query(validate(), d);
  REQUIRE(p.status == Parsed::kOk);
  CHECK(d == Dialect::kV2);
  CHECK(p.query.op == Op::kValidate);
  p = parse_query(byte(1) + str("/k") + str("v"), d);  // 2.x: SET is 1
  REQUIRE(p.status == Parsed::kOk);
  CHECK(p.query.op == Op::kSet);
  p = parse_query(byte(2) + str("/k") + str("e") + str("n"), d);
  CHECK(p.query.op == Op::kCompareSet);

  Dialect v1 = Dialect::kV1;
  CHECK(parse_query(byte(2) + str("/k"), v1).query.op == Op::kGet);
  CHECK(parse_query(byte(5) + u64(2) + str("a") + str("b"), v1).query.op == Op::kWait);
  CHECK(parse_query(byte(6), v1).query.op == Op::kNumKeys);
  CHECK(parse_query(byte(8) + str("a"), v1).query.op == Op::kDelete);
  CHECK(parse_query(byte(9), v1).status == Parsed::kBad);  // 1.x has no APPEND
}

TEST_CASE("a query cut anywhere needs more bytes, and one over a bound is refused with the reason") {
  const std::string q = byte(11) + u64(2) + str("k1") + str("v1") + str("k2") + str("value two");  // 2.x MULTI_SET
  for (std::size_t cut = 0; cut < q.size(); ++cut) {
    Dialect d = Dialect::kV2;
    CHECK(parse_query(q.substr(0, cut), d).status == Parsed::kNeedMore);
  }
  Dialect d = Dialect::kV2;
  auto p = parse_query(q + "next", d);
  REQUIRE(p.status == Parsed::kOk);
  CHECK(p.consumed == q.size());
  CHECK(p.query.values.back() == "value two");

  Limits small;
  small.max_key = 4;
  small.max_keys = 1;
  d = Dialect::kV2;
  p = parse_query(byte(1) + str("longkey"), d, small);  // refused before its bytes arrive
  CHECK(p.status == Parsed::kBad);
  CHECK(p.error == "a key of 7 bytes is over the limit of 4");
  p = parse_query(byte(6) + u64(2), d, small);
  CHECK(p.status == Parsed::kBad);
  CHECK_THAT(p.error, Catch::Contains("2 keys"));
  d = Dialect::kV2;
  std::uint32_t bad = 0x12345678;
  // 2.x's VALIDATE with a wrong number: first the dialect is 1.x (no magic), as a SET...
  Dialect u = Dialect::kUnknown;
  CHECK(parse_query(byte(0) + std::string(reinterpret_cast<const char*>(&bad), 4), u).status == Parsed::kNeedMore);
  // ...and a 2.x connection that validates again with a wrong number is refused.
  CHECK(parse_query(byte(0) + std::string(reinterpret_cast<const char*>(&bad), 4), d).status == Parsed::kBad);
}

TEST_CASE("the engine answers as torch's server does and wakes a waiting client when its last key is set") {
  Engine e;
  std::vector<Reply> out;
  auto q = [](Op op, std::vector<std::string> keys, std::vector<std::string> values = {}, std::int64_t n = 0) {
    Query x;
    x.op = op;
    x.keys = std::move(keys);
    x.values = std::move(values);
    x.number = n;
    return x;
  };
  CHECK(e.apply(1, q(Op::kWait, {"a", "b"}), out).empty());
  CHECK(out.empty());
  CHECK(e.waiting_clients() == 1);
  CHECK(e.apply(2, q(Op::kSet, {"a"}, {"x"}), out).empty());
  CHECK(out.empty());  // one key of two
  CHECK(e.apply(2, q(Op::kAdd, {"b"}, {}, 7), out).empty());
  REQUIRE(out.size() == 2);
  CHECK(out[0].to == 1);
  CHECK(out[0].bytes == byte(kStopWaiting));
  CHECK(out[1].to == 2);
  CHECK(out[1].bytes == std::string("\x07\0\0\0\0\0\0\0", 8));
  CHECK(e.waiting_clients() == 0);
  out.clear();
  CHECK(e.apply(2, q(Op::kAdd, {"a"}, {}, 1), out) == "add to key 'a', whose value is not a number");
  CHECK(e.apply(2, q(Op::kGet, {"missing"}), out) == "get of a key that is not set");
  out.clear();
  CHECK(e.apply(3, q(Op::kCompareSet, {"c"}, {"", "new"}), out).empty());
  CHECK(out.back().flat() == str("new"));
  CHECK(e.apply(3, q(Op::kCompareSet, {"c"}, {"other", "x"}), out).empty());
  CHECK(out.back().flat() == str("new"));
  out.clear();
  CHECK(e.apply(4, q(Op::kWait, {"twice", "twice"}), out).empty());  // one key named twice is one key
  CHECK(e.apply(2, q(Op::kSet, {"twice"}, {"1"}), out).empty());
  REQUIRE(out.size() == 1);
  CHECK(out[0].to == 4);
  CHECK(e.waiting_clients() == 0);
  CHECK(e.apply(3, q(Op::kWait, {"z"}), out).empty());
  e.disconnected(3);  // a client that goes away stops waiting
  CHECK(e.waiting_clients() == 0);
  CHECK(e.apply(3, q(Op::kSet, {"z"}, {"1"}), out).empty());

  Engine tiny(10);
  CHECK(tiny.apply(1, q(Op::kSet, {"k"}, {"12345678"}), out).empty());
  CHECK_THAT(tiny.apply(1, q(Op::kSet, {"k2"}, {"1"}), out), Catch::Contains("more than 10 bytes"));
  CHECK(tiny.apply(1, q(Op::kSet, {"k"}, {"123456789"}), out).empty());  // a replacement counts its difference
}

TEST_CASE("the store server serves torch 1.13's TCPStore client: every query type, waits served by another client") {
  require_installed(python_has_torch(), "torch for /usr/bin/python3", "python3-torch");
  ServerThread s;
  auto r = run({"/usr/bin/python3", client_script(), "ops", "127.0.0.1", std::to_string(s.port())}, {}, 120s);
  INFO(r.out << r.err);
  CHECK(r.code == 0);
  CHECK_THAT(r.out, Catch::StartsWith("ok 1."));
}

TEST_CASE("three torch 1.13 gloo workers initialise through the store server with the agent-store contract") {
  require_installed(python_has_torch(), "torch for /usr/bin/python3", "python3-torch");
  ServerThread s;
  three_rank_allreduce({"/usr/bin/python3"}, std::to_string(s.port()), 120s);
}

TEST_CASE("the store server serves torch 2.6's TCPStore client and three 2.6 gloo workers") {
  const std::string t2 = torch2_or_skip();
  ServerThread s;
  const std::string port = std::to_string(s.port());
  auto r = run({t2, "run", "python3", client_script(), "ops", "127.0.0.1", port}, {}, 180s);
  INFO(r.out << r.err);
  CHECK(r.code == 0);
  CHECK_THAT(r.out, Catch::StartsWith("ok 2.6"));
  three_rank_allreduce({t2, "run", "python3"}, port, 180s);
}

TEST_CASE("a client that breaks the protocol is disconnected with one log line and the others go on") {
  ServerThread s;
  boost::asio::io_context io;
  using tcp = boost::asio::ip::tcp;
  tcp::socket good(io), bad(io);
  good.connect({boost::asio::ip::make_address("127.0.0.1"), static_cast<unsigned short>(s.port())});
  bad.connect({boost::asio::ip::make_address("127.0.0.1"), static_cast<unsigned short>(s.port())});
  boost::asio::write(bad, boost::asio::buffer(validate() + byte(200)));  // no query 200
  char c;
  boost::system::error_code ec;
  boost::asio::read(bad, boost::asio::buffer(&c, 1), ec);
  CHECK(ec == boost::asio::error::eof);  // closed by the server
  boost::asio::write(good, boost::asio::buffer(validate() + byte(4) + str("n") + u64(41)));  // 2.x ADD
  std::int64_t v = 0;
  boost::asio::read(good, boost::asio::buffer(&v, 8));
  CHECK(v == 41);
  REQUIRE(eventually([&] { return s.server->dropped() == 1; }, 10s));
  boost::asio::post(s.io, [] {});
  std::this_thread::sleep_for(50ms);
  CHECK_THAT(s.log.at(0), Catch::Contains("unknown query type 200"));
}

TEST_CASE("an unfinished query says how many bytes it needs, so a large value is not parsed again at every read") {
  Dialect d = Dialect::kV2;
  const std::string q = byte(1) + str("key") + str(std::string(1000, 'v'));
  auto p = parse_query(q.substr(0, 20), d);
  CHECK(p.status == Parsed::kNeedMore);
  CHECK(p.need == q.size());
  Limits small;
  small.max_query = 100;
  p = parse_query(q.substr(0, 20), d, small);  // refused as soon as the lengths say it is too big
  CHECK(p.status == Parsed::kBad);
}

TEST_CASE("the engine empties for a new attempt, adds as torch does and refuses an overflowing add") {
  Engine e;
  std::vector<Reply> out;
  Query set;
  set.op = Op::kSet;
  set.keys = {"n"};
  set.values = {" 41"};
  CHECK(e.apply(1, set, out).empty());
  Query add;
  add.op = Op::kAdd;
  add.keys = {"n"};
  add.number = 1;
  CHECK(e.apply(1, add, out).empty());  // std::stoll skips leading blanks, and so do we
  CHECK(out.back().bytes == std::string("\x2a\0\0\0\0\0\0\0", 8));
  add.number = std::numeric_limits<std::int64_t>::max();
  CHECK_THAT(e.apply(1, add, out), Catch::Contains("overflows"));
  e.clear();
  CHECK(e.keys() == 0);
  CHECK(e.bytes() == 0);
}

TEST_CASE("a client that does not read its replies is not read from either: the server holds one reply of its, and "
          "it gets every answer once it reads (#35 review: back-pressure)") {
  ServerThread s;
  boost::asio::io_context io;
  using tcp = boost::asio::ip::tcp;
  tcp::socket c(io);
  c.open(tcp::v4());
  c.set_option(boost::asio::socket_base::receive_buffer_size(4096));  // its replies stay in the server
  c.connect({boost::asio::ip::make_address("127.0.0.1"), static_cast<unsigned short>(s.port())});
  std::string value(32 * 1024, 'x');
  for (std::size_t i = 0; i < value.size(); ++i) value[i] = static_cast<char>('a' + i % 23);
  std::string q = validate() + byte(1) + str("big") + str(value);
  for (int i = 0; i < 400; ++i) q += byte(3) + str("big");  // 400 GETs of 32 KiB: 12.5 MiB of replies
  std::thread sender([&] {  // blocks once the server stops reading; ends as the replies are read
    boost::system::error_code ec;
    boost::asio::write(c, boost::asio::buffer(q), ec);
  });
  // The server stops reading its queries: it owes it little, not 12.5 MiB (before: all the
  // replies piled up until the client was disconnected).
  REQUIRE(eventually([&] { return on_io(s, [&] { return s.server->unwritten(); }) > 0; }, 20s));
  // (What the kernel's socket buffers take in is served: a few MiB, not all of it.)
  CHECK(on_io(s, [&] { return s.server->queries(); }) < 402);
  CHECK(on_io(s, [&] { return s.server->unwritten(); }) <= 64 * 1024 + value.size() + 8);
  CHECK(on_io(s, [&] { return s.server->buffered(); }) <= 64 * 1024 + 2 * value.size());
  // Reading, it gets every answer, in order.
  for (int i = 0; i < 400; ++i) {
    std::string reply(8 + value.size(), '\0');
    boost::system::error_code ec;
    boost::asio::read(c, boost::asio::buffer(reply), ec);
    REQUIRE(!ec);
    REQUIRE(reply == str(value));
  }
  sender.join();
  CHECK(on_io(s, [&] { return s.server->dropped(); }) == 0);
  CHECK(on_io(s, [&] { return s.server->queries(); }) == 402);
}

TEST_CASE("64 clients that GET one 3 MiB value at once and read it late all get it: the value is held once, not 64 "
          "times, and none is dropped (#35 review)") {
  using tcp = boost::asio::ip::tcp;
  ServerThread s;  // the default budget: 160 MiB, less than 64 copies of the value (192 MiB)
  constexpr std::size_t kValue = 3 << 20;
  constexpr int kClients = 64;
  std::string value(kValue, '\0');
  for (std::size_t i = 0; i < kValue; ++i) value[i] = static_cast<char>(i * 7 + i / 4096);
  boost::asio::io_context io;
  auto connect = [&] {
    auto c = std::make_unique<tcp::socket>(io);
    c->open(tcp::v4());
    c->set_option(boost::asio::socket_base::receive_buffer_size(4096));  // its reply stays in the server
    c->connect({boost::asio::ip::make_address("127.0.0.1"), static_cast<unsigned short>(s.port())});
    return c;
  };
  auto setter = connect();
  boost::asio::write(*setter, boost::asio::buffer(validate() + byte(1) + str("big") + str(value)));
  boost::asio::write(*setter, boost::asio::buffer(byte(4) + str("n") + u64(1)));  // ADD: the SET was served
  std::int64_t v = 0;
  boost::asio::read(*setter, boost::asio::buffer(&v, 8));
  REQUIRE(v == 1);
  std::vector<std::unique_ptr<tcp::socket>> readers;
  for (int i = 0; i < kClients; ++i) {
    readers.push_back(connect());
    boost::asio::write(*readers.back(), boost::asio::buffer(validate() + byte(3) + str("big")));
  }
  // Every GET is served (3 queries of the setter, 2 of each reader) and no reader has read.
  REQUIRE(eventually([&] { return on_io(s, [&] { return s.server->queries(); }) == 3 + 2 * kClients; }, 60s));
  const std::size_t held = on_io(s, [&] { return s.server->buffered(); });
  INFO("buffered " << held << " bytes, unwritten " << on_io(s, [&] { return s.server->unwritten(); }));
  CHECK(held <= kValue + (1 << 20));  // once, and a little of each reader's own
  // What they are owed is over the budget: held once per reader (before), it was.
  CHECK(on_io(s, [&] { return s.server->unwritten(); }) > ServerOptions().max_buffered);
  CHECK(on_io(s, [&] { return s.server->dropped(); }) == 0);
  // Each reads, late and slowly (64 KiB at a time, one after the other): the right bytes.
  for (auto& r : readers) {
    std::string reply(8 + kValue, '\0');
    boost::system::error_code ec;
    for (std::size_t at = 0; at < reply.size() && !ec;)
      at += boost::asio::read(*r, boost::asio::buffer(reply.data() + at, std::min<std::size_t>(64 << 10, reply.size() - at)), ec);
    REQUIRE(!ec);
    REQUIRE(reply.substr(0, 8) == u64(kValue));
    REQUIRE(reply.compare(8, kValue, value) == 0);
  }
  CHECK(on_io(s, [&] { return s.server->dropped(); }) == 0);
  CHECK(on_io(s, [&] { return s.server->clients(); }) == kClients + 1);
  CHECK(on_io(s, [&] { return s.server->buffered(); }) < 64 * 1024);
}

namespace {
std::size_t parked_of(ServerThread& s) {
  std::promise<std::size_t> p;
  auto f = p.get_future();
  boost::asio::post(s.io, [&] { p.set_value(s.server->parked()); });
  return f.get();
}
}  // namespace

TEST_CASE("reset empties the store and parks the ended attempt's clients: kept connected, never served (#26: torch "
          "1.13's c10d client busy-loops a core once its server closes the connection)") {
  ServerThread s;
  boost::asio::io_context io;
  using tcp = boost::asio::ip::tcp;
  tcp::socket c(io);
  c.connect({boost::asio::ip::make_address("127.0.0.1"), static_cast<unsigned short>(s.port())});
  boost::asio::write(c, boost::asio::buffer(validate() + byte(1) + str("k") + str("v") + byte(7)));  // SET, NUMKEYS
  std::int64_t n = 0;
  boost::asio::read(c, boost::asio::buffer(&n, 8));
  CHECK(n == 1);
  boost::asio::post(s.io, [&] { s.server->reset(); });
  REQUIRE(eventually([&] { return parked_of(s) == 1; }, 10s));
  // A new attempt's client finds the store empty; the old one is still connected.
  tcp::socket d(io);
  d.connect({boost::asio::ip::make_address("127.0.0.1"), static_cast<unsigned short>(s.port())});
  boost::asio::write(d, boost::asio::buffer(validate() + byte(7)));
  boost::asio::read(d, boost::asio::buffer(&n, 8));
  CHECK(n == 0);
  c.non_blocking(true);
  char x;
  boost::system::error_code ec;
  c.read_some(boost::asio::buffer(&x, 1), ec);
  CHECK(ec == boost::asio::error::would_block);  // not eof: the old client was not closed
  c.non_blocking(false);
  // Anything it sends ends it, unserved.
  boost::asio::write(c, boost::asio::buffer(byte(7)));
  boost::asio::read(c, boost::asio::buffer(&x, 1), ec);
  CHECK((ec == boost::asio::error::eof || ec == boost::asio::error::connection_reset));  // reset: its query unread
  REQUIRE(eventually([&] { return parked_of(s) == 0; }, 10s));
  CHECK(s.server->clients() == 1);  // d
}

TEST_CASE("a retired store stops listening and keeps its clients parked until they close (#26)") {
  ServerThread s;
  boost::asio::io_context io;
  using tcp = boost::asio::ip::tcp;
  const auto port = static_cast<unsigned short>(s.port());
  tcp::socket c(io);
  c.connect({boost::asio::ip::make_address("127.0.0.1"), port});
  boost::asio::write(c, boost::asio::buffer(validate() + byte(7)));
  std::int64_t n = -1;
  boost::asio::read(c, boost::asio::buffer(&n, 8));
  boost::asio::post(s.io, [&] { s.server->retire(); });
  REQUIRE(eventually([&] { return parked_of(s) == 1; }, 10s));
  tcp::socket d(io);
  boost::system::error_code ec;
  d.connect({boost::asio::ip::make_address("127.0.0.1"), port}, ec);
  CHECK(ec == boost::asio::error::connection_refused);
  c.close();
  REQUIRE(eventually([&] { return parked_of(s) == 0; }, 10s));
}

TEST_CASE("many clients breaking the protocol at once give one log line, not one each") {
  ServerThread s;
  boost::asio::io_context io;
  using tcp = boost::asio::ip::tcp;
  for (int i = 0; i < 20; ++i) {
    tcp::socket bad(io);
    bad.connect({boost::asio::ip::make_address("127.0.0.1"), static_cast<unsigned short>(s.port())});
    boost::asio::write(bad, boost::asio::buffer(validate() + byte(200)));
    char c;
    boost::system::error_code ec;
    boost::asio::read(bad, boost::asio::buffer(&c, 1), ec);  // closed by the server
  }
  REQUIRE(eventually([&] { return s.server->dropped() == 20; }, 10s));
  std::size_t lines = 0;
  boost::asio::post(s.io, [&] { lines = s.log.size(); });
  REQUIRE(eventually([&] { return lines > 0; }, 5s));
  CHECK(lines < 20);
}

TEST_CASE("when_idle runs once the last client left, not while one is connected") {
  ServerThread s;
  boost::asio::io_context io;
  using tcp = boost::asio::ip::tcp;
  std::atomic<int> idle{0};
  tcp::socket c(io);
  c.connect({boost::asio::ip::make_address("127.0.0.1"), static_cast<unsigned short>(s.port())});
  boost::asio::write(c, boost::asio::buffer(validate() + byte(7)));  // NUMKEYS: connected and served
  std::int64_t n = -1;
  boost::asio::read(c, boost::asio::buffer(&n, 8));
  std::atomic<bool> asked{false};
  boost::asio::post(s.io, [&] {
    s.server->when_idle([&] { ++idle; });
    asked = true;
  });
  for (int i = 0; i < 500 && !asked; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  REQUIRE(asked);
  // Still connected: a query served after when_idle shows the loop ran past it.
  boost::asio::write(c, boost::asio::buffer(byte(7)));
  boost::asio::read(c, boost::asio::buffer(&n, 8));
  CHECK(idle == 0);
  c.close();
  for (int i = 0; i < 1000 && idle == 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));  // bounded: 10 s
  CHECK(idle == 1);
  // With no client now: soon.
  std::atomic<int> again{0};
  boost::asio::post(s.io, [&] { s.server->when_idle([&] { ++again; }); });
  for (int i = 0; i < 1000 && again == 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  CHECK(again == 1);
}

namespace {

// A 2.x CHECK (type 5) of `n` one-byte keys.
std::string check_of(std::size_t n) {
  std::string q = byte(5) + u64(n);
  for (std::size_t i = 0; i < n; ++i) q += str(std::string(1, static_cast<char>('a' + i % 26)));
  return q;
}
}  // namespace

TEST_CASE("a multi-key query fed in small pieces is parsed in work linear in its bytes, not again from its first "
          "key at every piece (#35)") {
  // Re-parsed from the start at every piece (the old parser), the 4,700 pieces of this
  // CHECK of 50,000 keys read about 118 million length fields; resumed, each field once
  // to check it, once to read it, and at most one field again per piece.
  constexpr std::size_t kKeys = 50000, kPiece = 100;
  const std::string q = check_of(kKeys);
  Dialect d = Dialect::kV2;
  Progress pr;
  std::size_t fields = 0, pieces = 0;
  Parsed p;
  for (std::size_t end = kPiece;; end = std::min(end + kPiece, q.size())) {
    p = parse_query(std::string_view(q).substr(0, end), d, {}, &pr);
    fields += p.fields;
    ++pieces;
    if (p.status != Parsed::kNeedMore) break;
    REQUIRE(p.need > end);  // it says what it needs, and that is more than it has
  }
  REQUIRE(p.status == Parsed::kOk);
  CHECK(p.consumed == q.size());
  REQUIRE(p.query.keys.size() == kKeys);
  CHECK(p.query.keys[27] == "b");
  CHECK(fields <= 2 * (kKeys + 2) + pieces);

  // MULTI_SET (key and value fields) cut at every byte parses as it does whole, and a
  // value over the limit is refused when its length arrives, the keys before it unread.
  const std::string ms = byte(11) + u64(2) + str("k1") + str("v1") + str("k2") + str("value2");
  Progress pm;
  for (std::size_t end = 1; end < ms.size(); ++end)
    REQUIRE(parse_query(std::string_view(ms).substr(0, end), d, {}, &pm).status == Parsed::kNeedMore);
  p = parse_query(ms, d, {}, &pm);
  REQUIRE(p.status == Parsed::kOk);
  CHECK(p.query.keys == std::vector<std::string>{"k1", "k2"});
  CHECK(p.query.values == std::vector<std::string>{"v1", "value2"});
  Limits small;
  small.max_value = 4;
  Progress pb;
  p = parse_query(std::string_view(ms).substr(0, 47), d, small, &pb);  // up to value2's length
  CHECK(p.status == Parsed::kBad);
  CHECK_THAT(p.error, Catch::Contains("a value of 6 bytes is over the limit of 4"));
}

TEST_CASE("the store server resumes a multi-key query trickling in: its parse work stays linear in the bytes (#35)") {
  ServerThread s;
  boost::asio::io_context io;
  using tcp = boost::asio::ip::tcp;
  tcp::socket c(io);
  c.connect({boost::asio::ip::make_address("127.0.0.1"), static_cast<unsigned short>(s.port())});
  constexpr std::size_t kKeys = 20000, kPieces = 200;
  const std::string q = check_of(kKeys);
  boost::asio::write(c, boost::asio::buffer(validate()));
  // Each piece is in the server (held, unfinished; buffered() counts the memory held, at
  // least its bytes) before the next is sent: about 200 reads.
  const std::size_t piece = q.size() / kPieces + 1;
  for (std::size_t at = 0; at < q.size(); at += piece) {
    const std::size_t end = std::min(at + piece, q.size());
    boost::asio::write(c, boost::asio::buffer(q.data() + at, end - at));
    if (end < q.size()) REQUIRE(eventually([&] { return on_io(s, [&] { return s.server->buffered(); }) >= end; }, 10s));
  }
  std::uint8_t ready = 99;
  boost::asio::read(c, boost::asio::buffer(&ready, 1));
  CHECK(ready == kCheckNotReady);
  // Re-parsed from its start at each piece, about 2 million fields (kPieces * kKeys / 2).
  CHECK(on_io(s, [&] { return s.server->parse_fields(); }) <= 2 * (kKeys + 1) + 4 * kPieces);
}

TEST_CASE("the store's buffers over all clients are bounded: over the budget, the client holding the most is "
          "disconnected with one log line and the others are served (#35)") {
  using tcp = boost::asio::ip::tcp;
  ServerOptions o;
  constexpr std::size_t kValue = 8 << 20;  // more than the kernel buffers of a loopback socket take in
  o.max_buffered = 20 << 20;               // two unread replies of the value fit, not three
  ServerThread s(o);
  boost::asio::io_context io;
  auto connect = [&] {
    auto c = std::make_unique<tcp::socket>(io);
    c->open(tcp::v4());
    c->set_option(boost::asio::socket_base::receive_buffer_size(64 * 1024));  // a reply stays in the server
    c->connect({boost::asio::ip::make_address("127.0.0.1"), static_cast<unsigned short>(s.port())});
    boost::asio::write(*c, boost::asio::buffer(validate()));
    return c;
  };
  auto setter = connect();
  for (int i = 0; i < 5; ++i)
    boost::asio::write(*setter, boost::asio::buffer(byte(1) + str(fmt::format("big{}", i)) + str(std::string(kValue, 'x'))));
  boost::asio::write(*setter, boost::asio::buffer(byte(4) + str("n") + u64(1)));  // ADD: the SETs were served
  std::int64_t v = 0;
  boost::asio::read(*setter, boost::asio::buffer(&v, 8));
  REQUIRE(v == 1);
  // Five clients each GET a value of their own and never read it, and the value is then
  // deleted: the first two are kept, each of the next three is charged the most (its
  // reply, as large as theirs, the newest) and goes. (Clients reading one value share it: see the 64 readers below.)
  std::vector<std::unique_ptr<tcp::socket>> hoarders;
  for (int i = 0; i < 5; ++i) {
    hoarders.push_back(connect());
    boost::asio::write(*hoarders.back(), boost::asio::buffer(byte(3) + str(fmt::format("big{}", i))));
    // Its GET served, the value leaves the store: it is the hoarder's now (a value the store
    // holds costs its readers nothing, see the late readers below).
    REQUIRE(eventually([&] { return on_io(s, [&] { return s.server->queries(); }) == static_cast<std::size_t>(7 + 3 * i + 2); }, 20s));
    boost::asio::write(*setter, boost::asio::buffer(byte(8) + str(fmt::format("big{}", i))));
    boost::asio::read(*setter, boost::asio::buffer(&v, 8));
    REQUIRE(v == 1);
    const std::size_t want = i < 2 ? 0 : static_cast<std::size_t>(i - 1);
    REQUIRE(eventually([&] { return on_io(s, [&] { return s.server->dropped(); }) == want &&
                                    on_io(s, [&] { return s.server->buffered(); }) >= std::min(i + 1, 2) * kValue; },
                       20s));
  }
  CHECK(on_io(s, [&] { return s.server->buffered(); }) <= o.max_buffered);
  CHECK(on_io(s, [&] { return s.server->clients(); }) == 3);  // the setter and two hoarders
  CHECK_THAT(on_io(s, [&] { return s.log.at(0); }), Catch::Contains("over the store's limit of 20971520"));
  // A client with a small query is still served: an ADD's answer fits.
  boost::asio::write(*setter, boost::asio::buffer(byte(4) + str("n") + u64(1)));
  boost::asio::read(*setter, boost::asio::buffer(&v, 8));
  CHECK(v == 2);
  // A half-sent SET of a value as large: the budget counts it too; the first hoarder is
  // then the one holding the most (ties go to the client whose bytes came last).
  auto half = connect();
  const std::string partial = byte(1) + str("other") + u64(kValue) + std::string(kValue / 2, 'y');
  boost::asio::write(*half, boost::asio::buffer(partial));
  REQUIRE(eventually([&] { return on_io(s, [&] { return s.server->dropped(); }) == 4; }, 20s));
  CHECK(on_io(s, [&] { return s.server->buffered(); }) <= o.max_buffered);
}

namespace {
// A client of `s` from `from` (a 127.0.0.0/8 address); each read waits at most 20 s.
// `rcvbuf` (when not 0): its receive buffer, small for a client whose replies must stay in
// the server while it does not read.
std::unique_ptr<boost::asio::ip::tcp::socket> client_from(boost::asio::io_context& io, ServerThread& s,
                                                          const char* from = "127.0.0.1", int rcvbuf = 0) {
  using tcp = boost::asio::ip::tcp;
  auto c = std::make_unique<tcp::socket>(io);
  c->open(tcp::v4());
  if (rcvbuf) c->set_option(boost::asio::socket_base::receive_buffer_size(rcvbuf));
  c->bind({boost::asio::ip::make_address(from), 0});
  c->connect({boost::asio::ip::make_address("127.0.0.1"), static_cast<unsigned short>(s.port())});
  const timeval bound{20, 0};
  ::setsockopt(c->native_handle(), SOL_SOCKET, SO_RCVTIMEO, &bound, sizeof bound);
  return c;
}
bool numkeys_served(boost::asio::ip::tcp::socket& c) {  // NUMKEYS answered
  boost::system::error_code ec;
  boost::asio::write(c, boost::asio::buffer(byte(7)), ec);
  std::int64_t n = -1;
  boost::asio::read(c, boost::asio::buffer(&n, 8), ec);
  return !ec && n >= 0;
}
bool closed_by_server(boost::asio::ip::tcp::socket& c) {  // end of file or reset
  char b;
  boost::system::error_code ec;
  boost::asio::read(c, boost::asio::buffer(&b, 1), ec);
  return ec == boost::asio::error::eof || ec == boost::asio::error::connection_reset;
}
// Closed by the server (end of file or reset) within `bound`; false when it stays open.
bool closed_within(boost::asio::ip::tcp::socket& c, std::chrono::milliseconds bound) {
  pollfd p{c.native_handle(), POLLIN, 0};
  if (::poll(&p, 1, static_cast<int>(bound.count())) <= 0) return false;
  return closed_by_server(c);
}
}  // namespace

TEST_CASE("at the client limit a newcomer displaces the oldest client that has sent nothing, never one that has "
          "(#35)") {
  ServerOptions o;
  o.max_clients = 3;
  ServerThread s(o);
  boost::asio::io_context io;
  auto connect = [&] { return client_from(io, s); };
  auto served = numkeys_served;
  auto closed = closed_by_server;
  auto silent1 = connect();
  REQUIRE(eventually([&] { return on_io(s, [&] { return s.server->clients(); }) == 1; }, 10s));
  auto silent2 = connect();
  REQUIRE(eventually([&] { return on_io(s, [&] { return s.server->clients(); }) == 2; }, 10s));
  auto worker1 = connect();
  boost::asio::write(*worker1, boost::asio::buffer(validate()));
  REQUIRE(served(*worker1));
  // Each newcomer takes the place of the oldest silent client, in order.
  auto worker2 = connect();
  boost::asio::write(*worker2, boost::asio::buffer(validate()));
  CHECK(closed(*silent1));
  CHECK(served(*worker2));
  auto worker3 = connect();
  boost::asio::write(*worker3, boost::asio::buffer(validate()));
  CHECK(closed(*silent2));
  CHECK(served(*worker3));
  // Every client has spoken: the next one is refused, and they are all still served.
  auto late = connect();
  CHECK(closed(*late));
  CHECK(served(*worker1));
  CHECK(served(*worker2));
  CHECK(served(*worker3));
  CHECK_THAT(on_io(s, [&] { return s.log.at(0); }), Catch::Contains("it had sent no whole query"));
}

namespace {
Query set_of(std::string key, std::string value) {
  Query q;
  q.op = Op::kSet;
  q.keys = {std::move(key)};
  q.values = {std::move(value)};
  return q;
}
}  // namespace
TEST_CASE("a MULTI_GET naming one large key many times is refused before its reply is built: the client is closed "
          "with one log line and the others are served (#35)") {
  using tcp = boost::asio::ip::tcp;
  ServerOptions o;
  o.max_unread = 4 << 20;  // 200 replies of the 1 MiB value are 50 times that
  ServerThread s(o);
  boost::asio::io_context io;
  tcp::socket good(io), bad(io);
  good.connect({boost::asio::ip::make_address("127.0.0.1"), static_cast<unsigned short>(s.port())});
  bad.connect({boost::asio::ip::make_address("127.0.0.1"), static_cast<unsigned short>(s.port())});
  boost::asio::write(good, boost::asio::buffer(validate() + byte(1) + str("k") + str(std::string(1 << 20, 'v')) +
                                               byte(4) + str("n") + u64(1)));  // SET, then ADD: the SET was served
  std::int64_t v = 0;
  boost::asio::read(good, boost::asio::buffer(&v, 8));
  REQUIRE(v == 1);
  std::string q = validate() + byte(10) + u64(200);  // 2.x MULTI_GET
  for (int i = 0; i < 200; ++i) q += str("k");
  boost::asio::write(bad, boost::asio::buffer(q));
  char c;
  boost::system::error_code ec;
  boost::asio::read(bad, boost::asio::buffer(&c, 1), ec);
  CHECK((ec == boost::asio::error::eof || ec == boost::asio::error::connection_reset));
  boost::asio::write(good, boost::asio::buffer(byte(4) + str("n") + u64(1)));
  boost::asio::read(good, boost::asio::buffer(&v, 8));
  CHECK(v == 2);
  REQUIRE(eventually([&] { return on_io(s, [&] { return s.server->dropped(); }) == 1; }, 10s));
  CHECK_THAT(on_io(s, [&] { return s.log.at(0); }), Catch::Contains("a multi_get reply of 209716800 bytes"));
  // The engine alone: nothing is built, the query is refused.
  Engine e(1 << 30, 4 << 20);
  std::vector<Reply> out;
  REQUIRE(e.apply(1, set_of("k", std::string(1 << 20, 'v')), out).empty());
  Query get;
  get.op = Op::kMultiGet;
  get.keys.assign(200, "k");
  CHECK_THAT(e.apply(2, get, out), Catch::Contains("over the limit of 4194304"));
  CHECK(out.empty());
}

TEST_CASE("APPEND grows the stored value in place, not copying it at every call, and keeps the byte budget (#35)") {
  Engine e(4 << 20);
  std::vector<Reply> out;
  REQUIRE(e.apply(1, set_of("k", std::string(1 << 20, 'v')), out).empty());
  Query app;
  app.op = Op::kAppend;
  app.keys = {"k"};
  // 1000 one-byte appends: a copy each time moves the value every call; in place, its
  // storage moves only when it grows (geometrically, a few times at most).
  std::set<const char*> homes;
  for (int i = 0; i < 1000; ++i) {
    app.values = {"a"};
    REQUIRE(e.apply(1, app, out).empty());
    homes.insert(e.value("k")->data());
  }
  CHECK(homes.size() <= 3);
  CHECK(e.value("k")->size() == (1 << 20) + 1000);
  CHECK(e.bytes() == 1 + (1 << 20) + 1000);
  app.values = {std::string(3 << 20, 'b')};  // over the 4 MiB budget: refused, nothing changed
  CHECK_THAT(e.apply(1, app, out), Catch::Contains("more than 4194304 bytes"));
  CHECK(e.value("k")->size() == (1 << 20) + 1000);
  CHECK(e.bytes() == 1 + (1 << 20) + 1000);
}

namespace {
std::size_t vm_size_kib() {  // this process's VmSize: the server runs in it
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("VmSize:", 0) == 0) return std::stoul(line.substr(7));
  return 0;
}
}  // namespace
TEST_CASE("headers claiming large values reserve no memory ahead of the bytes received, and what a query holds is "
          "counted (#35)") {
  using tcp = boost::asio::ip::tcp;
  ServerThread s;
  boost::asio::io_context io;
  tcp::socket first(io);
  first.connect({boost::asio::ip::make_address("127.0.0.1"), static_cast<unsigned short>(s.port())});
  boost::asio::write(first, boost::asio::buffer(validate() + byte(4) + str("n") + u64(1)));  // the server is warm
  std::int64_t v = 0;
  boost::asio::read(first, boost::asio::buffer(&v, 8));
  REQUIRE(v == 1);
  const std::size_t before = vm_size_kib();
  constexpr int kClients = 40;
  // A 2.x SET of a 64 MiB value, of which 3 bytes come: 27 bytes.
  const std::string header = validate() + byte(1) + str("k") + u64(64 << 20) + "abc";
  std::vector<std::unique_ptr<tcp::socket>> cs;
  for (int i = 0; i < kClients; ++i) {
    cs.push_back(std::make_unique<tcp::socket>(io));
    cs.back()->connect({boost::asio::ip::make_address("127.0.0.1"), static_cast<unsigned short>(s.port())});
    boost::asio::write(*cs.back(), boost::asio::buffer(header));
  }
  // Every header is in (held in a client's pending query).
  REQUIRE(eventually([&] { return on_io(s, [&] { return s.server->buffered(); }) >= kClients * (header.size() - 5); },
                     20s));
  const std::size_t grown_kib = vm_size_kib() - before;
  INFO("VmSize grew by " << grown_kib << " KiB");
  CHECK(grown_kib < 256 * 1024);  // reserved for the claimed values: 40 x 64 MiB = 2.5 GiB
  CHECK(on_io(s, [&] { return s.server->buffered(); }) < kClients * 4096);
  CHECK(on_io(s, [&] { return s.server->dropped(); }) == 0);
}

TEST_CASE("the largest value fits the bounds with its headers: its GET's reply is not over max_unread, a "
          "COMPARE_SET of two of them is not over max_query (#35)") {
  const Limits l;
  {  // 2.x COMPARE_SET of the largest key and two largest values: all bytes but the last value's
    std::string q = byte(2) + str(std::string(l.max_key, 'k')) + str(std::string(l.max_value, 'e')) + u64(l.max_value);
    Dialect d = Dialect::kV2;
    const auto p = parse_query(q, d, l);
    CHECK(p.error == "");
    CHECK(p.status == Parsed::kNeedMore);
    CHECK(p.need == q.size() + l.max_value);
  }
  using tcp = boost::asio::ip::tcp;
  ServerThread s;  // the default bounds
  boost::asio::io_context io;
  tcp::socket c(io);
  c.connect({boost::asio::ip::make_address("127.0.0.1"), static_cast<unsigned short>(s.port())});
  boost::asio::write(c, boost::asio::buffer(validate() + byte(1) + str("big") + str(std::string(l.max_value, 'x'))));
  boost::asio::write(c, boost::asio::buffer(byte(4) + str("n") + u64(1)));  // ADD: the SET was served
  std::int64_t v = 0;
  boost::asio::read(c, boost::asio::buffer(&v, 8));
  REQUIRE(v == 1);
  boost::asio::write(c, boost::asio::buffer(byte(3) + str("big")));  // GET
  std::string reply(8 + l.max_value, '\0');
  boost::system::error_code ec;
  boost::asio::read(c, boost::asio::buffer(reply), ec);
  INFO(on_io(s, [&] { return s.log.empty() ? std::string() : s.log.front(); }));
  CHECK(!ec);
  CHECK(reply.substr(0, 8) == u64(l.max_value));
  CHECK(on_io(s, [&] { return s.server->dropped(); }) == 0);
}

TEST_CASE("a SET of the largest value and a GET of it sent at once are both served: the SET's buffer does not "
          "outgrow its query (#35)") {
  const Limits l;
  using tcp = boost::asio::ip::tcp;
  ServerThread s;  // the default bounds
  boost::asio::io_context io;
  tcp::socket c(io);
  c.connect({boost::asio::ip::make_address("127.0.0.1"), static_cast<unsigned short>(s.port())});
  boost::asio::write(c, boost::asio::buffer(validate() + byte(1) + str("big") + str(std::string(l.max_value, 'x')) +
                                            byte(3) + str("big")));  // SET, GET
  std::string reply(8 + l.max_value, '\0');
  boost::system::error_code ec;
  boost::asio::read(c, boost::asio::buffer(reply), ec);
  INFO(on_io(s, [&] { return s.log.empty() ? std::string() : s.log.front(); }));
  CHECK(!ec);
  CHECK(on_io(s, [&] { return s.server->dropped(); }) == 0);
}

TEST_CASE("a WAIT's keys are counted in the buffer budget: a client whose wait holds too much is disconnected (#35)") {
  using tcp = boost::asio::ip::tcp;
  ServerOptions o;
  o.max_buffered = 1 << 20;
  ServerThread s(o);
  boost::asio::io_context io;
  tcp::socket c(io);
  c.connect({boost::asio::ip::make_address("127.0.0.1"), static_cast<unsigned short>(s.port())});
  // A 2.x WAIT (type 6) for 14 keys of 60,000 bytes: an 840 KB query, held twice by its wait.
  std::string q = validate() + byte(6) + u64(14);
  for (int i = 0; i < 14; ++i) q += str(std::string(60000, static_cast<char>('a' + i)));
  boost::asio::write(c, boost::asio::buffer(q));
  REQUIRE(eventually([&] { return on_io(s, [&] { return s.server->dropped(); }) == 1; }, 20s));
  CHECK_THAT(on_io(s, [&] { return s.log.at(0); }), Catch::Contains("over the store's limit of 1048576"));
  CHECK(on_io(s, [&] { return s.server->buffered(); }) == 0);
  CHECK(on_io(s, [&] { return s.server->engine().waiting_clients(); }) == 0);
}

TEST_CASE("many waiters on many keys that disconnect or cancel leave the engine consistent: the others are woken, "
          "nothing of theirs is left behind (#35 review)") {
  Engine e;
  std::vector<Reply> out;
  constexpr int kClients = 2000, kKeys = 64;
  auto wait = [](int first, int count) {
    Query q;
    q.op = Op::kWait;
    for (int k = 0; k < count; ++k) q.keys.push_back(fmt::format("key{}", (first + k) % kKeys));
    return q;
  };
  // Every client waits for 32 of the 64 keys, at staggered offsets: each key has about
  // 1,000 waiters, in the order they came.
  for (int c = 1; c <= kClients; ++c) REQUIRE(e.apply(static_cast<ClientId>(c), wait(c, 32), out).empty());
  CHECK(e.waiting_clients() == kClients);
  CHECK(e.awaited_keys() == kKeys);
  CHECK(e.registrations() == kClients * 32);
  // Half the keys come: no wait is complete yet (each misses some of the other half).
  auto set = [](const std::string& k) {
    Query q;
    q.op = Op::kSet;
    q.keys = {k};
    q.values = {"v"};
    return q;
  };
  for (int k = 0; k < kKeys; k += 2) REQUIRE(e.apply(0, set(fmt::format("key{}", k)), out).empty());
  CHECK(out.empty());
  // Every odd client goes away, every client ≡ 2 (mod 4) cancels its wait.
  for (int c = 1; c <= kClients; c += 2) e.disconnected(static_cast<ClientId>(c));
  Query cancel;
  cancel.op = Op::kCancelWait;
  for (int c = 2; c <= kClients; c += 4) REQUIRE(e.apply(static_cast<ClientId>(c), cancel, out).empty());
  CHECK(out.size() == kClients / 4);  // the cancels' answers
  out.clear();
  CHECK(e.waiting_clients() == kClients / 4);
  CHECK(e.registrations() == kClients / 4 * 16);  // each has its 16 odd keys left
  // A key that came, was deleted and is awaited again by a new client: a gone client's
  // old registration for it must not touch the new list.
  Query del;
  del.op = Op::kDelete;
  del.keys = {"key0"};
  REQUIRE(e.apply(0, del, out).empty());
  out.clear();
  Query again;
  again.op = Op::kWait;
  again.keys = {"key0"};
  REQUIRE(e.apply(99999, again, out).empty());
  e.disconnected(4);  // waited for key0 (came) and odd keys
  // The other half comes: exactly the clients ≡ 0 (mod 4) but 4 are woken, each once.
  for (int k = 1; k < kKeys; k += 2) REQUIRE(e.apply(0, set(fmt::format("key{}", k)), out).empty());
  std::set<ClientId> woken;
  for (const auto& r : out) {
    CHECK(r.bytes == byte(kStopWaiting));
    CHECK(woken.insert(r.to).second);
  }
  CHECK(woken.size() == kClients / 4 - 1);
  CHECK(woken.count(4) == 0);
  for (ClientId c : woken) CHECK(c % 4 == 0);
  out.clear();
  CHECK(e.waiting_clients() == 1);  // 99999, for key0
  REQUIRE(e.apply(0, set("key0"), out).empty());
  REQUIRE(out.size() == 1);
  CHECK(out[0].to == 99999);
  CHECK(e.waiting_clients() == 0);
  CHECK(e.awaited_keys() == 0);
  CHECK(e.registrations() == 0);
}


TEST_CASE("a client that sent a byte but no whole query is still silent: at the client limit a newcomer displaces it "
          "(#35 review: one byte a connection kept the limit full)") {
  ServerOptions o;
  o.max_clients = 3;
  ServerThread s(o);
  boost::asio::io_context io;
  auto byte1 = client_from(io, s), byte2 = client_from(io, s);
  boost::asio::write(*byte1, boost::asio::buffer(byte(0)));  // the start of a VALIDATE, and no more
  boost::asio::write(*byte2, boost::asio::buffer(byte(0)));
  auto worker1 = client_from(io, s);
  boost::asio::write(*worker1, boost::asio::buffer(validate()));
  REQUIRE(numkeys_served(*worker1));
  REQUIRE(eventually([&] { return on_io(s, [&] { return s.server->engine().keys() == 0 && s.server->clients() == 3; }); }, 10s));
  auto worker2 = client_from(io, s);
  boost::asio::write(*worker2, boost::asio::buffer(validate()));
  CHECK(closed_by_server(*byte1));
  CHECK(numkeys_served(*worker2));
  auto worker3 = client_from(io, s);
  boost::asio::write(*worker3, boost::asio::buffer(validate()));
  CHECK(closed_by_server(*byte2));
  CHECK(numkeys_served(*worker3));
  CHECK(numkeys_served(*worker1));
  CHECK_THAT(on_io(s, [&] { return s.log.at(0); }), Catch::Contains("it had sent no whole query"));
}

TEST_CASE("a client whose query stays unfinished past the query deadline is displaced at the client limit, one that "
          "finishes its queries is not (#35 review)") {
  ServerOptions o;
  o.max_clients = 2;
  o.query_deadline = 100ms;
  ServerThread s(o);
  boost::asio::io_context io;
  auto trickler = client_from(io, s), worker = client_from(io, s);
  boost::asio::write(*trickler, boost::asio::buffer(validate()));
  REQUIRE(numkeys_served(*trickler));
  boost::asio::write(*trickler, boost::asio::buffer(byte(1) + u64(3)));  // a SET's start, never finished
  boost::asio::write(*worker, boost::asio::buffer(validate()));
  REQUIRE(numkeys_served(*worker));
  // Newcomers are refused until the trickler's query is past the deadline, then one takes
  // its place (before: refused for ever, the trickler having "spoken").
  bool in = false;
  std::unique_ptr<boost::asio::ip::tcp::socket> late;
  for (int i = 0; i < 400 && !in; ++i) {  // bounded: each try ends at once (served or closed)
    late = client_from(io, s);
    boost::asio::write(*late, boost::asio::buffer(validate()));
    in = numkeys_served(*late);
    if (!in) std::this_thread::sleep_for(50ms);
  }
  REQUIRE(in);
  CHECK(closed_by_server(*trickler));
  CHECK(numkeys_served(*worker));  // (the log's line may be one of those left out: one a second)
}

TEST_CASE("clients from one address are capped: over the cap a newcomer displaces a silent client of that address "
          "or is refused, and other addresses are served (#35 review)") {
  ServerOptions o;
  o.max_per_address = 2;
  ServerThread s(o);
  boost::asio::io_context io;
  auto a1 = client_from(io, s, "127.0.0.2"), a2 = client_from(io, s, "127.0.0.2");
  boost::asio::write(*a1, boost::asio::buffer(validate()));
  boost::asio::write(*a2, boost::asio::buffer(validate()));
  REQUIRE(numkeys_served(*a1));
  REQUIRE(numkeys_served(*a2));
  auto a3 = client_from(io, s, "127.0.0.2");
  CHECK(closed_by_server(*a3));  // a third from 127.0.0.2: refused
  CHECK_THAT(on_io(s, [&] { return s.log.at(0); }),
             Catch::Contains("refused a client from 127.0.0.2: 2 clients from one address is the limit"));
  // b2 silent, connected before b1 (one connected right after a served one is taken for its
  // torch 1.13 callback connection, and kept)
  auto b2 = client_from(io, s, "127.0.0.3");
  REQUIRE(eventually([&] { return on_io(s, [&] { return s.server->clients(); }) == 3; }, 10s));
  auto b1 = client_from(io, s, "127.0.0.3");
  boost::asio::write(*b1, boost::asio::buffer(validate()));
  REQUIRE(numkeys_served(*b1));
  auto b3 = client_from(io, s, "127.0.0.3");
  boost::asio::write(*b3, boost::asio::buffer(validate()));
  CHECK(closed_by_server(*b2));  // the silent one of 127.0.0.3 made room
  CHECK(numkeys_served(*b3));
  CHECK(numkeys_served(*a1));
  CHECK(numkeys_served(*a2));
  CHECK(numkeys_served(*b1));
  CHECK(on_io(s, [&] { return s.server->clients(); }) == 4);
}

namespace {
// Bytes the process has allocated (glibc: every arena's and the mmapped blocks).
std::size_t allocated() {
  const auto m = ::mallinfo2();
  return m.uordblks + m.hblkhd;
}
}  // namespace

TEST_CASE("a MULTI_GET's reply counts in the buffer budget at the memory it holds: each shared value's entry and "
          "iovecs, and small values are copied into it (#35 review 2, item 1)") {
  // The engine: a small value is copied (8 bytes of length and its bytes a key), a large one
  // shared.
  Engine e;
  std::vector<Reply> out;
  REQUIRE(e.apply(1, set_of("e", ""), out).empty());
  REQUIRE(e.apply(1, set_of("h", std::string(100, 'h')), out).empty());
  Query get;
  get.op = Op::kMultiGet;
  get.keys.assign(1000, "e");
  REQUIRE(e.apply(2, get, out).empty());
  CHECK(out.back().values.empty());  // before: 1000 entries of 24 bytes, and an iovec each
  CHECK(out.back().bytes == std::string(8000, '\0'));
  get.keys.assign(1000, "h");
  REQUIRE(e.apply(2, get, out).empty());
  CHECK(out.back().values.size() == 1000);
  // The server: clients that do not read MULTI_GETs naming a 100-byte key 32768 times. What
  // the server allocated for them is what `buffered` says (before: about 8 times it).
  ServerThread s;
  boost::asio::io_context io;
  auto setter = client_from(io, s);
  boost::asio::write(*setter, boost::asio::buffer(validate() + byte(1) + str("h") + str(std::string(100, 'h'))));
  REQUIRE(numkeys_served(*setter));
  constexpr int kClients = 8, kKeys = 32768;  // a reply of 3.4 MiB: more than the sockets take in
  std::string q = validate() + byte(10) + u64(kKeys);
  for (int i = 0; i < kKeys; ++i) q += str("h");
  std::vector<std::unique_ptr<boost::asio::ip::tcp::socket>> hoarders;
  for (int i = 0; i < kClients; ++i) hoarders.push_back(client_from(io, s, "127.0.0.1", 4096));
  const std::size_t before = on_io(s, [&] { return allocated(); });
  const std::size_t counted_before = on_io(s, [&] { return s.server->buffered(); });
  for (auto& h : hoarders) boost::asio::write(*h, boost::asio::buffer(q));
  REQUIRE(eventually([&] { return on_io(s, [&] { return s.server->queries(); }) == 3 + 2 * kClients; }, 60s));
  const std::size_t grown = on_io(s, [&] { return allocated(); }) - before;
  const std::size_t counted = on_io(s, [&] { return s.server->buffered(); }) - counted_before;
  INFO("allocated " << grown << " bytes, counted " << counted << ", unwritten "
                    << on_io(s, [&] { return s.server->unwritten(); }));
  CHECK(on_io(s, [&] { return s.server->unwritten(); }) > kClients * kKeys * 100);  // the replies are held
  CHECK(grown <= counted + counted / 4 + (1 << 20));
  CHECK(on_io(s, [&] { return s.server->dropped(); }) == 0);
}

TEST_CASE("readers sharing a value the store no longer holds are each charged it: hoarders in pairs go over the "
          "budget, not a worker's SET (#35 review 2, item 2)") {
  ServerOptions o;
  o.max_buffered = 16 << 20;
  constexpr std::size_t kValue = 6 << 20, kWorker = 5 << 20;
  ServerThread s(o);
  boost::asio::io_context io;
  auto setter = client_from(io, s);
  boost::asio::write(*setter, boost::asio::buffer(validate()));
  std::vector<std::unique_ptr<boost::asio::ip::tcp::socket>> hoarders;
  // Twice: key k gets a new value, and two clients GET it and never read; then k is deleted.
  // Both values have left the store, held by a pair of clients each (12 MiB).
  for (int i = 0; i < 2; ++i) {
    boost::asio::write(*setter, boost::asio::buffer(byte(1) + str("k") + str(std::string(kValue, 'A' + i))));
    REQUIRE(numkeys_served(*setter));
    for (int j = 0; j < 2; ++j) {
      hoarders.push_back(client_from(io, s, "127.0.0.1", 4096));
      boost::asio::write(*hoarders.back(), boost::asio::buffer(validate() + byte(3) + str("k")));
    }
    REQUIRE(eventually([&] { return on_io(s, [&] { return s.server->queries(); }) == static_cast<std::size_t>(1 + 6 * (i + 1)); }, 60s));
  }
  boost::asio::write(*setter, boost::asio::buffer(byte(8) + str("k")));
  std::int64_t deleted = 0;
  boost::asio::read(*setter, boost::asio::buffer(&deleted, 8));
  REQUIRE(deleted == 1);
  CHECK(on_io(s, [&] { return s.server->buffered(); }) >= 2 * kValue);
  CHECK(on_io(s, [&] { return s.server->dropped(); }) == 0);
  // A worker's SET of 5 MiB goes over the budget: a pair holding a value goes (each is
  // charged its 6 MiB), the worker is served (before: the value was charged to neither of
  // the pair, and the worker was disconnected).
  auto worker = client_from(io, s);
  boost::asio::write(*worker, boost::asio::buffer(validate() + byte(1) + str("ckpt") + str(std::string(kWorker, 'w'))));
  CHECK(numkeys_served(*worker));
  CHECK(on_io(s, [&] { const auto* v = s.server->engine().value("ckpt"); return v && v->size() == kWorker; }));
  CHECK(on_io(s, [&] { return s.server->dropped(); }) == 2);
  CHECK(on_io(s, [&] { return s.server->buffered(); }) <= o.max_buffered);
  CHECK_THAT(on_io(s, [&] { return s.log.at(0); }), Catch::Contains("over the store's limit of 16777216"));
}

TEST_CASE("readers of values the store still holds cost only their own bytes: late readers of three stored values "
          "over the budget together are all served (#35 review 2, item 5)") {
  ServerOptions o;
  o.max_buffered = 16 << 20;
  constexpr std::size_t kValue = 6 << 20;
  constexpr int kReaders = 4;  // of each value
  ServerThread s(o);
  boost::asio::io_context io;
  auto setter = client_from(io, s);
  boost::asio::write(*setter, boost::asio::buffer(validate()));
  for (int i = 0; i < 3; ++i)
    boost::asio::write(*setter, boost::asio::buffer(byte(1) + str(fmt::format("v{}", i)) +
                                                    str(std::string(kValue, 'A' + i))));
  REQUIRE(numkeys_served(*setter));
  std::vector<std::pair<int, std::unique_ptr<boost::asio::ip::tcp::socket>>> readers;
  for (int i = 0; i < 3; ++i)
    for (int j = 0; j < kReaders; ++j) {
      readers.emplace_back(i, client_from(io, s, "127.0.0.1", 4096));
      boost::asio::write(*readers.back().second, boost::asio::buffer(validate() + byte(3) + str(fmt::format("v{}", i))));
    }
  REQUIRE(eventually([&] { return on_io(s, [&] { return s.server->queries(); }) == 5 + 2 * 3 * kReaders; }, 60s));
  CHECK(on_io(s, [&] { return s.server->dropped(); }) == 0);  // before: the third value's readers went
  CHECK(on_io(s, [&] { return s.server->buffered(); }) < (1 << 20));
  for (auto& [i, r] : readers) {
    std::string reply(8 + kValue, '\0');
    boost::system::error_code ec;
    boost::asio::read(*r, boost::asio::buffer(reply), ec);
    REQUIRE(!ec);
    CHECK(reply == u64(kValue) + std::string(kValue, 'A' + i));
  }
  CHECK(on_io(s, [&] { return s.server->dropped(); }) == 0);
}

TEST_CASE("the query deadline counts from the start of the unfinished query, not from the previous one: a worker idle "
          "past it that starts a SET is not displaced (#35 review 2, item 4)") {
  ServerOptions o;
  o.max_clients = 2;
  o.query_deadline = 3s;  // generous: the test's steps below take far less on a loaded machine
  ServerThread s(o);
  boost::asio::io_context io;
  auto worker = client_from(io, s), other = client_from(io, s);
  boost::asio::write(*worker, boost::asio::buffer(validate()));
  REQUIRE(numkeys_served(*worker));
  boost::asio::write(*other, boost::asio::buffer(validate()));
  REQUIRE(numkeys_served(*other));
  std::this_thread::sleep_for(o.query_deadline + 1s);  // the worker idles between store calls
  const std::string set = byte(1) + str("ckpt") + str(std::string(1 << 20, 'x'));
  boost::asio::write(*worker, boost::asio::buffer(set.data(), set.size() / 2));  // its SET's first half
  REQUIRE(eventually([&] { return on_io(s, [&] { return s.server->buffered(); }) >= set.size() / 2; }, 10s));
  // A newcomer finds no silent client: it is refused (before: the worker was displaced, its
  // query "not whole after 3000 ms" though it had just begun).
  auto late = client_from(io, s);
  boost::system::error_code ec;  // (refused: the write may find the socket closed)
  boost::asio::write(*late, boost::asio::buffer(validate()), ec);
  CHECK(closed_by_server(*late));
  boost::asio::write(*worker, boost::asio::buffer(set.data() + set.size() / 2, set.size() - set.size() / 2));
  CHECK(numkeys_served(*worker));
  CHECK(on_io(s, [&] { return s.server->engine().value("ckpt") != nullptr; }));
}

TEST_CASE("out of descriptors, the store logs one line when its accepts pause and one when they resume, not one per "
          "pause (#36)") {
  ServerThread s;
  // Hold the io thread while clients queue in the listen backlog.
  std::atomic<bool> release{false}, held{false};
  boost::asio::post(s.io, [&] {
    held = true;
    for (int i = 0; i < 3000 && !release; ++i) std::this_thread::sleep_for(10ms);
  });
  REQUIRE(eventually([&] { return held.load(); }, 30s));
  boost::asio::io_context io;
  std::vector<std::unique_ptr<boost::asio::ip::tcp::socket>> cs;
  for (int i = 0; i < 4; ++i) cs.push_back(client_from(io, s));
  // No descriptor left for the store.
  NoFreeDescriptors none;
  release = true;
  const bool paused = eventually([&] { return on_io(s, [&] { return s.server->accept_failures(); }) >= 3; }, 60s);
  REQUIRE(none.restore());
  REQUIRE(paused);
  auto lines_with = [&](const std::string& text) {
    return on_io(s, [&] {
      std::size_t n = 0;
      for (const auto& l : s.log) n += l.find(text) != std::string::npos;
      return n;
    });
  };
  REQUIRE(eventually([&] { return lines_with("accepts resumed after") == 1; }, 60s));
  CHECK(lines_with("agent store: accept failed: Too many open files; pausing accepts for 100 ms") == 1);
  CHECK(lines_with("pausing") == 1);
  // Descriptors again: the queued clients are served.
  for (auto& c : cs) {
    boost::asio::write(*c, boost::asio::buffer(validate()));
    CHECK(numkeys_served(*c));
  }
}

TEST_CASE("torch 1.13's silent callback connection is never displaced at the client limit, so its client does not "
          "busy-loop a core (#35)") {
  // torch 1.13's TCPStore opens a second connection after its first (its callback client,
  // for watchKey) and sends nothing on it. At the client limit the store displaced it as
  // the oldest silent client; the client's worker thread then peeked 0 bytes and polled
  // again for ever: a core busy (found in the chaos soak). Both orders torch 1.13 opens
  // them in: an agent-store worker's (an ADD on the first, then the second) and
  // wait_for_workers=False's (both, then a query).
  require_installed(python_has_torch(), "torch for /usr/bin/python3", "python3-torch");
  for (const char* wait : {"1", "0"}) {
    INFO("WAIT=" << wait);
    ServerOptions o;
    o.max_clients = 3;
    ServerThread s(o);
    Proc worker = spawn({"/usr/bin/python3", client_script(), "hold", "127.0.0.1", std::to_string(s.port()), wait});
    REQUIRE(eventually([&] { return worker.out().find("up") != std::string::npos || !pid_alive(worker.pid); }, 120s));
    INFO(worker.out() << worker.err());
    REQUIRE(pid_alive(worker.pid));
    REQUIRE(eventually([&] { return on_io(s, [&] { return s.server->clients(); }) == 2; }, 10s));
    boost::asio::io_context io;
    auto other = client_from(io, s);  // the third, served: the store is at its limit
    boost::asio::write(*other, boost::asio::buffer(validate()));
    REQUIRE(numkeys_served(*other));
    auto late = client_from(io, s);  // before: it took the place of torch's callback connection
    CHECK(closed_within(*late, 30s));  // bounded: before, it stayed connected
    CHECK(on_io(s, [&] { return s.server->clients(); }) == 3);
    for (const auto& line : on_io(s, [&] { return s.log; })) CHECK_THAT(line, !Catch::Contains("no whole query"));
    ::kill(worker.pid, SIGUSR1);
    REQUIRE(worker.wait(60s));
    CHECK(worker.exit_code() == 0);
    // Its CPU in 2 s: about 2 when a thread spins (less on a loaded machine), near 0 idle.
    std::smatch m;
    const std::string out = worker.out();
    REQUIRE(std::regex_search(out, m, std::regex(R"(cpu ([0-9.]+))")));
    CHECK(std::stod(m[1]) < 0.8);
    CHECK(numkeys_served(*other));
  }
}

TEST_CASE("a finished query's bytes are not charged while the budget is checked inside it, so a SET replacing a "
          "value that a reader holds does not get its setter dropped (#35)") {
  // The budget was checked inside serve() while the finished SET's bytes were still in its
  // client's query buffer (they leave it once serve() returns), beside the value it replaced
  // (held by a reader that does not read): 11 MiB + 6 MiB over a budget of 16, though 6 MiB
  // were held once the query was done. The setter was dropped, its SET applied. Both checks:
  // the one after the value is let go, and the one of a reply to a query sent with the SET.
  for (const bool pipelined : {false, true}) {
    INFO("a NUM_KEYS sent with the SET: " << pipelined);
    ServerOptions o;
    o.max_buffered = 16 << 20;
    constexpr std::size_t kOld = 6 << 20, kNew = 11 << 20;
    ServerThread s(o);
    boost::asio::io_context io;
    auto setter = client_from(io, s);
    boost::asio::write(*setter, boost::asio::buffer(validate() + byte(1) + str("k") + str(std::string(kOld, 'o'))));
    REQUIRE(numkeys_served(*setter));
    auto reader = client_from(io, s, "127.0.0.1", 4096);
    boost::asio::write(*reader, boost::asio::buffer(validate() + byte(3) + str("k")));
    REQUIRE(eventually([&] { return on_io(s, [&] { return s.server->queries(); }) == 5; }, 60s));
    const std::string set = byte(1) + str("k") + str(std::string(kNew, 'n'));
    if (pipelined) {
      boost::system::error_code ec;
      boost::asio::write(*setter, boost::asio::buffer(set + byte(7)), ec);
      std::int64_t n = -1;
      boost::asio::read(*setter, boost::asio::buffer(&n, 8), ec);
      CHECK((!ec && n == 1));
    } else {
      boost::asio::write(*setter, boost::asio::buffer(set));
      CHECK(numkeys_served(*setter));
    }
    CHECK(on_io(s, [&] { const auto* v = s.server->engine().value("k"); return v && v->size() == kNew; }));
    CHECK(on_io(s, [&] { return s.server->dropped(); }) == 0);
    CHECK(on_io(s, [&] { return s.server->buffered(); }) <= o.max_buffered);
  }
}
