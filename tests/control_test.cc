// The agent <-> worker control channel (control/protocol.h, control/server.h;
// docs/in-place-recovery.md): the pure framing and messages, then the server on a real
// abstract Unix socket, with a client of the test's own.
#include <catch2/catch.hpp>

#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>
#include <nlohmann/json.hpp>

#include "control/protocol.h"
#include "control/server.h"
#include "support/net.h"
#include "support/proc.h"
#include "support/skip.h"

using namespace mg::control;
using json = nlohmann::json;
namespace asio = boost::asio;

TEST_CASE("control lines are split at newlines, across reads") {
  LineBuffer b;
  auto r = b.feed("{\"a\":1}\n{\"b\"");
  REQUIRE(r.lines == std::vector<std::string>{"{\"a\":1}"});
  CHECK_FALSE(r.too_long);
  r = b.feed(":2}\n\n");
  CHECK(r.lines == std::vector<std::string>{"{\"b\":2}", ""});
  CHECK(b.pending() == 0);
}

TEST_CASE("a control message of 64 KiB passes, one byte more is refused, also when it arrives in pieces") {
  LineBuffer ok;
  auto r = ok.feed(std::string(kMaxMessage, 'x') + "\n");
  CHECK_FALSE(r.too_long);
  REQUIRE(r.lines.size() == 1);
  CHECK(r.lines[0].size() == kMaxMessage);
  LineBuffer big;
  CHECK_FALSE(big.feed(std::string(kMaxMessage, 'x')).too_long);
  CHECK(big.feed("y").too_long);
}

TEST_CASE("hello and paused parse - a wrong version, a bad field or an unknown type is refused") {
  auto h = parse_from_worker(R"({"type":"hello","version":1,"pid":42,"local_rank":3,"in_place":true,"extra":"ignored"})");
  REQUIRE(std::holds_alternative<Hello>(h));
  CHECK(std::get<Hello>(h).in_place);
  CHECK(std::get<Hello>(h).local_rank == 3);
  CHECK(std::get<Hello>(h).pid == 42);
  CHECK_FALSE(std::get<Hello>(h).standby);  // absent: an ordinary worker
  auto s = parse_from_worker(R"({"type":"hello","version":1,"in_place":true,"standby":true})");
  REQUIRE(std::holds_alternative<Hello>(s));
  CHECK(std::get<Hello>(s).standby);  // a pre-started worker (--prestart-standby)
  auto p = parse_from_worker(R"({"type":"paused","step":17})");
  REQUIRE(std::holds_alternative<Paused>(p));
  CHECK(std::get<Paused>(p).step == 17);
  auto bad = [](std::string_view line) {
    auto m = parse_from_worker(line);
    REQUIRE(std::holds_alternative<Bad>(m));
    return std::get<Bad>(m).message;
  };
  CHECK_THAT(bad(R"({"type":"hello","version":2,"in_place":true})"), Catch::Contains("version 2"));
  CHECK_THAT(bad(R"({"type":"hello","in_place":true})"), Catch::Contains("version"));
  CHECK_THAT(bad(R"({"type":"hello","version":1,"in_place":"yes"})"), Catch::Contains("in_place"));
  CHECK_THAT(bad(R"({"type":"hello","version":1,"local_rank":"0"})"), Catch::Contains("local_rank"));
  CHECK_THAT(bad(R"({"type":"hello","version":1,"in_place":true,"standby":1})"), Catch::Contains("standby"));
  CHECK_THAT(bad(R"({"type":"reboot"})"), Catch::Contains("unknown message type 'reboot'"));
  CHECK_THAT(bad("not json"), Catch::Contains("JSON object"));
  CHECK_THAT(bad("[1,2]"), Catch::Contains("JSON object"));
  CHECK_THAT(bad(R"({"version":1})"), Catch::Contains("type"));
}

TEST_CASE("the agent's messages are one JSON object and a newline each") {
  auto parse = [](const std::string& line) {
    REQUIRE(line.back() == '\n');
    REQUIRE(line.find('\n') == line.size() - 1);
    return json::parse(line);
  };
  CHECK(parse(welcome()) == json{{"type", "welcome"}, {"version", 1}});
  auto p = parse(pause(4, "node n1 (127.0.0.3) lost: its connection closed\nsecond line", "host"));
  CHECK(p["type"] == "pause");
  CHECK(p["lost"] == "host");
  CHECK(p["round"] == 4);
  auto a = parse(assign(5, 2, {{"RANK", "3"}, {"WORLD_SIZE", "4"}}));
  CHECK(a["type"] == "assign");
  CHECK(a["restart_count"] == 2);
  CHECK(a["env"]["RANK"] == "3");
  CHECK(parse(error("no"))["message"] == "no");
  CHECK(parse(pause(1, "\xff bad utf-8", "worker"))["type"] == "pause");  // replaced, never thrown
  CHECK(at_notation("x") == "@x");
  CHECK(abstract_address("@x") == std::string("\0x", 2));
}

namespace {

// The server on its own io thread; the test is its clients.
struct Fixture {
  asio::io_context io;
  asio::executor_work_guard<asio::io_context::executor_type> work{io.get_executor()};
  std::unique_ptr<Server> server;
  std::thread thread;
  std::mutex m;
  std::vector<std::string> events;
  std::atomic<int> owner{0};  // what worker_of answers
  std::atomic<pid_t> worker{0};  // what worker_pid answers (0: unknown, every peer is the worker)
  std::vector<std::string> logged;

  explicit Fixture(ServerOptions o = {}) {
    o.worker_of = [this](pid_t pid) { return pid == ::getpid() ? owner.load() : -1; };
    o.worker_pid = [this](int) { return worker.load(); };
    o.log = [this](const std::string& line) {
      std::lock_guard<std::mutex> l(m);
      logged.push_back(line);
    };
    Handlers h;
    h.hello = [this](int lr, const Hello& x) { add(fmt("hello", lr, x.in_place)); };
    h.paused = [this](int lr, const Paused& p) { add("paused " + std::to_string(lr) + " " + std::to_string(p.step)); };
    h.closed = [this](int lr, const std::string& why) {
      add("closed " + std::to_string(lr));
      add("closed " + std::to_string(lr) + ": " + why);  // which side ended it, and how
    };
    server = std::make_unique<Server>(io, std::move(o), std::move(h));
    thread = std::thread([this] { io.run(); });
  }
  ~Fixture() {
    asio::post(io, [this] { server->stop(); });
    work.reset();
    io.stop();
    thread.join();
  }
  static std::string fmt(const char* what, int lr, bool b) {
    return std::string(what) + " " + std::to_string(lr) + (b ? " in_place" : "");
  }
  void add(std::string e) {
    std::lock_guard<std::mutex> l(m);
    events.push_back(std::move(e));
  }
  bool saw(const std::string& e) {
    for (int i = 0; i < 500; ++i) {  // bounded: 5 s
      {
        std::lock_guard<std::mutex> l(m);
        for (auto& x : events)
          if (x == e) return true;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return false;
  }
  // Runs `f` on the io thread and waits for it.
  template <class F>
  void on_io(F f) {
    std::atomic<bool> done{false};
    asio::post(io, [&] {
      f();
      done = true;
    });
    for (int i = 0; i < 500 && !done; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    REQUIRE(done);
  }
};

// A blocking client with a receive deadline.
struct Client {
  int fd = -1;
  std::string buf;
  explicit Client(const std::string& at_name) {
    fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_un a{};
    a.sun_family = AF_UNIX;
    const std::string raw = abstract_address(at_name);
    std::memcpy(a.sun_path, raw.data(), raw.size());
    REQUIRE(::connect(fd, reinterpret_cast<sockaddr*>(&a),
                      static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + raw.size())) == 0);
  }
  ~Client() { ::close(fd); }
  void send(const std::string& s) { REQUIRE(::write(fd, s.data(), s.size()) == static_cast<ssize_t>(s.size())); }
  // The next line ("" at end of file); fails after 10 s.
  std::string line() {
    for (;;) {
      if (auto nl = buf.find('\n'); nl != std::string::npos) {
        std::string l = buf.substr(0, nl);
        buf.erase(0, nl + 1);
        return l;
      }
      pollfd p{fd, POLLIN, 0};
      REQUIRE(::poll(&p, 1, 10000) == 1);
      char tmp[4096];
      const ssize_t n = ::read(fd, tmp, sizeof(tmp));
      if (n <= 0) return "";
      buf.append(tmp, static_cast<std::size_t>(n));
    }
  }
  bool at_eof() { return line().empty() && buf.empty(); }
  std::string error_line() {
    auto j = json::parse(line());
    REQUIRE(j["type"] == "error");
    return j["message"].get<std::string>();
  }
};

}  // namespace

TEST_CASE("the control socket lives in the abstract namespace and greets a worker's hello with welcome") {
  Fixture f;
  const std::string& addr = f.server->address();
  REQUIRE(addr.starts_with("@mglaunch-" + std::to_string(::getpid()) + "-"));
  CHECK(addr.size() == std::string("@mglaunch-").size() + std::to_string(::getpid()).size() + 1 + 16);
  Client c(addr);
  c.send(R"({"type":"hello","version":1,"pid":1,"local_rank":0,"in_place":true})" "\n");
  CHECK(json::parse(c.line()) == json{{"type", "welcome"}, {"version", 1}});
  REQUIRE(f.saw("hello 0 in_place"));
  bool sent = false;
  f.on_io([&] { sent = f.server->send(0, pause(3, "peer lost", "host")); });
  CHECK(sent);
  auto p = json::parse(c.line());
  CHECK(p["type"] == "pause");
  CHECK(p["reason"] == "peer lost");
  c.send(R"({"type":"paused","step":9})" "\n");
  CHECK(f.saw("paused 0 9"));
  f.on_io([&] { sent = f.server->send(1, welcome()); });
  CHECK_FALSE(sent);  // local rank 1 has no session
}

TEST_CASE("an unknown message type is answered with an error and the connection closes") {
  Fixture f;
  Client c(f.server->address());
  c.send(R"({"type":"hello","version":1,"in_place":true})" "\n");
  REQUIRE(json::parse(c.line())["type"] == "welcome");
  c.send(R"({"type":"shutdown"})" "\n");
  auto e = json::parse(c.line());
  CHECK(e["type"] == "error");
  CHECK_THAT(e["message"].get<std::string>(), Catch::Contains("unknown message type 'shutdown'"));
  CHECK(c.at_eof());
  CHECK(f.saw("closed 0"));  // the worker is no longer in place
}

TEST_CASE("a closed session says which side ended it and how - ended_why() explains a failed send") {
  Fixture f;
  auto why = [&](int lr) {  // the reason given with the closed event of local rank `lr`
    const std::string prefix = "closed " + std::to_string(lr) + ": ";
    std::lock_guard<std::mutex> l(f.m);
    std::string last;
    for (auto& e : f.events)
      if (e.rfind(prefix, 0) == 0) last = e.substr(prefix.size());
    return last;
  };
  {
    Client c(f.server->address());
    c.send(R"({"type":"hello","version":1,"in_place":true})" "\n");
    REQUIRE(json::parse(c.line())["type"] == "welcome");
  }  // the worker's end: its socket closes
  REQUIRE(f.saw("closed 0"));
  CHECK(why(0) == "the worker closed it (end of file)");
  bool sent = true;
  std::string ended;
  f.on_io([&] {
    sent = f.server->send(0, pause(1, "x", "host"));
    ended = f.server->ended_why(0);
  });
  CHECK_FALSE(sent);
  CHECK(ended == "the worker closed it (end of file)");
  f.owner = 1;
  Client r(f.server->address());
  r.send(R"({"type":"hello","version":1,"in_place":true})" "\n");
  REQUIRE(json::parse(r.line())["type"] == "welcome");
  r.send(R"({"type":"shutdown"})" "\n");
  CHECK_THAT(r.error_line(), Catch::Contains("unknown message type"));
  REQUIRE(f.saw("closed 1"));
  CHECK_THAT(why(1), Catch::StartsWith("the agent refused it: ") && Catch::Contains("unknown message type 'shutdown'"));
  f.owner = 2;
  Client g(f.server->address());
  g.send(R"({"type":"hello","version":1,"in_place":true})" "\n");
  REQUIRE(json::parse(g.line())["type"] == "welcome");
  f.on_io([&] {
    CHECK(f.server->ended_why(2).empty());  // it has a session
    f.server->forget(2);
    ended = f.server->ended_why(2);
  });
  CHECK_THAT(ended, Catch::Contains("the agent let it go"));
}

TEST_CASE("a message over 64 KiB closes the connection with an error") {
  Fixture f;
  Client c(f.server->address());
  c.send(std::string(kMaxMessage + 10, ' '));
  auto e = json::parse(c.line());
  CHECK(e["type"] == "error");
  CHECK_THAT(e["message"].get<std::string>(), Catch::Contains("65536 bytes"));
  CHECK(c.at_eof());
}

TEST_CASE("a first message other than hello is refused") {
  Fixture f;
  Client c(f.server->address());
  c.send(R"({"type":"paused","step":1})" "\n");
  CHECK(json::parse(c.line())["message"] == "the first message must be hello");
  CHECK(c.at_eof());
}

TEST_CASE("a process that is not a worker is refused at once (SO_PEERCRED)") {
  Fixture f;
  f.owner = -1;
  Client c(f.server->address());
  auto e = json::parse(c.line());
  CHECK(e["type"] == "error");
  CHECK_THAT(e["message"].get<std::string>(),
             Catch::Contains("pid " + std::to_string(::getpid()) + " is neither a worker of this agent"));
  CHECK(c.at_eof());
}

TEST_CASE("a session belongs to the local rank of the peer's worker, whatever local_rank its hello says") {
  Fixture f;
  f.owner = 2;
  Client c(f.server->address());
  // (--virtual-local-rank: LOCAL_RANK is 0 in every worker)
  c.send(R"({"type":"hello","version":1,"local_rank":0,"in_place":true})" "\n");
  CHECK(json::parse(c.line())["type"] == "welcome");
  CHECK(f.saw("hello 2 in_place"));
}

TEST_CASE("a newer hello of the same worker replaces its session - forget() closes it without a closed event") {
  Fixture f;
  Client a(f.server->address());
  a.send(R"({"type":"hello","version":1,"in_place":true})" "\n");
  REQUIRE(json::parse(a.line())["type"] == "welcome");
  Client b(f.server->address());
  b.send(R"({"type":"hello","version":1,"in_place":false})" "\n");
  REQUIRE(json::parse(b.line())["type"] == "welcome");
  CHECK_THAT(a.error_line(), Catch::Contains("replaced by a newer hello of local rank 0"));
  CHECK(a.at_eof());
  f.on_io([&] { f.server->forget(0); });
  CHECK(b.at_eof());
  std::lock_guard<std::mutex> l(f.m);
  for (auto& e : f.events) CHECK(e.rfind("closed", 0) != 0);
}

TEST_CASE("a descendant's hello cannot replace the worker's own session - the worker's replaces a descendant's") {
  Fixture f;
  f.worker = ::getpid();  // the test's clients are the worker itself
  Client w(f.server->address());
  w.send(R"({"type":"hello","version":1,"in_place":true})" "\n");
  REQUIRE(json::parse(w.line())["type"] == "welcome");
  f.worker = 1;  // from now on the clients are descendants of a worker with another pid
  Client d(f.server->address());
  d.send(R"({"type":"hello","version":1,"in_place":false})" "\n");
  CHECK_THAT(d.error_line(), Catch::Contains("a descendant cannot replace it"));
  CHECK(d.at_eof());
  bool sent = false;
  f.on_io([&] { sent = f.server->send(0, pause(1, "x", "worker")); });
  CHECK(sent);
  CHECK(json::parse(w.line())["type"] == "pause");  // the worker kept its session
  {
    std::lock_guard<std::mutex> l(f.m);
    for (auto& e : f.events) CHECK(e != "hello 0");  // its opt-in was not withdrawn
  }
  // A descendant that holds the session (the worker never said hello) gives way to the worker.
  f.on_io([&] { f.server->forget(0); });
  CHECK(w.at_eof());
  Client d2(f.server->address());
  d2.send(R"({"type":"hello","version":1,"in_place":false})" "\n");
  REQUIRE(json::parse(d2.line())["type"] == "welcome");
  f.worker = ::getpid();
  Client w2(f.server->address());
  w2.send(R"({"type":"hello","version":1,"in_place":true})" "\n");
  REQUIRE(json::parse(w2.line())["type"] == "welcome");
  CHECK_THAT(d2.error_line(), Catch::Contains("replaced by a newer hello"));
}

TEST_CASE("a connection that says no hello within the deadline is closed with an error") {
  ServerOptions o;
  o.hello_timeout = std::chrono::milliseconds(200);
  Fixture f(std::move(o));
  Client c(f.server->address());
  CHECK_THAT(c.error_line(), Catch::Contains("no hello within 200 ms"));
  CHECK(c.at_eof());
  f.on_io([] {});
  CHECK(f.server->sessions() == 0);
}

TEST_CASE("one local rank holds at most max_pending_per_rank connections before hello - refusals log one line a second") {
  ServerOptions o;
  o.max_pending_per_rank = 4;
  Fixture f(std::move(o));
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::unique_ptr<Client>> silent;
  for (int i = 0; i < 4; ++i) silent.push_back(std::make_unique<Client>(f.server->address()));
  std::vector<std::unique_ptr<Client>> refused;
  for (int i = 0; i < 40; ++i) {
    refused.push_back(std::make_unique<Client>(f.server->address()));
    CHECK_THAT(refused.back()->error_line(), Catch::Contains("already has 4 connections that have not said hello"));
  }
  const auto seconds = std::chrono::duration_cast<std::chrono::seconds>(std::chrono::steady_clock::now() - start).count();
  {
    std::lock_guard<std::mutex> l(f.m);
    CHECK(f.logged.size() <= static_cast<std::size_t>(seconds) + 2);  // not 40 lines
  }
  // The silent ones still count; once one says hello, a new connection is let in.
  silent[0]->send(R"({"type":"hello","version":1,"in_place":true})" "\n");
  REQUIRE(json::parse(silent[0]->line())["type"] == "welcome");
  Client more(f.server->address());
  more.send(R"({"type":"hello","version":1,"in_place":true})" "\n");
  CHECK(json::parse(more.line())["type"] == "welcome");
}

TEST_CASE("max_sessions defaults below the descriptor limit") {
  // The common soft limit of 1024 for the test (restored after): 4096 sessions would not fit.
  rlimit saved{};
  REQUIRE(::getrlimit(RLIMIT_NOFILE, &saved) == 0);
  if (saved.rlim_cur != RLIM_INFINITY && saved.rlim_cur < 1024) SKIP_TEST("the soft descriptor limit is below 1024");
  struct Restore {
    rlimit r;
    ~Restore() { ::setrlimit(RLIMIT_NOFILE, &r); }
  } restore{saved};
  rlimit low = saved;
  low.rlim_cur = 1024;
  REQUIRE(::setrlimit(RLIMIT_NOFILE, &low) == 0);
  ServerOptions o;
  o.max_pending_per_rank = 1 << 20;
  Fixture f(std::move(o));
  const std::size_t cap = 256;  // a quarter of 1024
  std::vector<std::unique_ptr<Client>> cs;
  for (std::size_t i = 0; i < cap; ++i) cs.push_back(std::make_unique<Client>(f.server->address()));
  for (int i = 0; i < 500; ++i) {  // bounded: until the server has taken them all
    std::size_t n = 0;
    f.on_io([&] { n = f.server->sessions(); });
    if (n >= cap) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  f.owner = 1;  // another local rank: the per-rank cap is not what refuses it
  Client over(f.server->address());
  CHECK_THAT(over.error_line(), Catch::Contains("256 connections is the limit"));
}

TEST_CASE("out of descriptors, the server pauses its accepts instead of spinning, and serves again after") {
  Fixture f;
  // Hold the io thread while clients queue in the listen backlog.
  std::atomic<bool> release{false}, held{false};
  asio::post(f.io, [&] {
    held = true;
    for (int i = 0; i < 1000 && !release; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  });
  for (int i = 0; i < 500 && !held; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  REQUIRE(held);
  std::vector<std::unique_ptr<Client>> cs;
  for (int i = 0; i < 4; ++i) cs.push_back(std::make_unique<Client>(f.server->address()));
  // No descriptor left.
  mgtest::NoFreeDescriptors none;
  const auto start = std::chrono::steady_clock::now();
  release = true;
  std::this_thread::sleep_for(std::chrono::milliseconds(1000));
  std::size_t failures = 0;
  f.on_io([&] { failures = f.server->accept_failures(); });
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - start).count();
  REQUIRE(none.restore());
  CHECK(failures >= 1);
  // One try per 100 ms pause (a spinning acceptor tries hundreds of thousands of times).
  CHECK(failures <= static_cast<std::size_t>(ms / 100) + 3);
  {
    std::lock_guard<std::mutex> l(f.m);
    REQUIRE_FALSE(f.logged.empty());
    CHECK_THAT(f.logged.front(), Catch::Contains("pausing accepts for 100 ms"));
  }
  // Descriptors again: the queued clients are served.
  for (auto& c : cs) {
    c->send(R"({"type":"hello","version":1,"in_place":true})" "\n");
    CHECK(json::parse(c->line())["type"] == "welcome");
  }
}
