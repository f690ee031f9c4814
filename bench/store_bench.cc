// store_bench: the agent's store (store/) against torch's own TCPStore server, on the store
// traffic of init_process_group. Each simulated client (a socket on one event loop):
//   add("init", 1); set("rank/R", 64 bytes); wait(["rank/0"]); get("rank/0");
//   add("barrier", 1) (the last one also sets "barrier/done"); wait(["barrier/done"]).
// Usage:
//   store_bench serve                      our server on 127.0.0.1:0 ("port P" on stdout); at
//                                          stdin's end prints {"rss_kib":..,"hwm_kib":..}
//   store_bench clients PORT N DIALECT     N clients against 127.0.0.1:PORT speaking torch 1.x
//                                          (DIALECT 1) or 2.x (2); prints {"clients":N,"seconds":S};
//                                          gives up after 120 s (exit 1, "done" < N)
//   store_bench inprocess N                the same queries for N clients through the parser and
//                                          the engine alone (no sockets); prints {"clients":N,"seconds":S}
//   store_bench waits N K                  N clients each WAIT for the same K keys, then all go away
//                                          (engine alone); prints {"waiters":N,"keys":K,"seconds":S}
//                                          for the goings: linear in N*K (each client forgets its
//                                          own K registrations), not quadratic in N
#include <sys/resource.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <boost/asio.hpp>
#include <fmt/format.h>

#include "store/engine.h"
#include "store/server.h"
#include "store/wire.h"

namespace asio = boost::asio;
using tcp = asio::ip::tcp;
using namespace mg::store;

namespace {

std::string u64(std::uint64_t v) { return std::string(reinterpret_cast<const char*>(&v), 8); }
std::string str(std::string_view s) { return u64(s.size()) + std::string(s); }

struct Codes {
  char set, get, add, wait;
};
Codes codes(int dialect) { return dialect == 1 ? Codes{0, 2, 3, 5} : Codes{1, 3, 4, 6}; }

const std::string kValue(64, 'a');

// The queries of client `r` for step `s` (see the top), and the reply bytes expected.
struct Step {
  std::string send;
  std::size_t reply = 0;
};
Step step(int s, int r, int n, int dialect, std::int64_t barrier_count) {
  const Codes c = codes(dialect);
  switch (s) {
    case 0: {
      std::string v;
      if (dialect == 2) {
        std::uint32_t m = kValidationMagic;
        v = std::string(1, 0) + std::string(reinterpret_cast<const char*>(&m), 4);
      }
      return {v + std::string(1, c.add) + str("init") + u64(1), 8};
    }
    case 1: return {std::string(1, c.set) + str("rank/" + std::to_string(r)) + str(kValue) +
                    std::string(1, c.wait) + u64(1) + str("rank/0"), 1};
    case 2: return {std::string(1, c.get) + str("rank/0"), 8 + kValue.size()};
    case 3: return {std::string(1, c.add) + str("barrier") + u64(1), 8};
    case 4: {
      std::string q;
      if (barrier_count == n) q = std::string(1, c.set) + str("barrier/done") + str("1");
      return {q + std::string(1, c.wait) + u64(1) + str("barrier/done"), 1};
    }
  }
  return {};
}
constexpr int kSteps = 5;

void raise_nofile() {
  rlimit rl{};
  getrlimit(RLIMIT_NOFILE, &rl);
  rl.rlim_cur = rl.rlim_max;
  setrlimit(RLIMIT_NOFILE, &rl);
}

long status_kib(const char* field) {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind(field, 0) == 0) return std::atol(line.c_str() + std::strlen(field));
  return -1;
}

int serve() {
  raise_nofile();
  asio::io_context io(1);
  ServerOptions o;
  // Every simulated client comes from 127.0.0.1, as no real job's do (a node's workers, at
  // most a few hundred connections; other nodes from their own addresses): the
  // per-address cap is not what is measured.
  o.max_per_address = std::numeric_limits<std::size_t>::max();
  o.log = [](const std::string& l) { std::fprintf(stderr, "%s\n", l.c_str()); };
  StoreServer server(io, "127.0.0.1", 0, o);
  std::printf("port %d\n", server.port());
  std::fflush(stdout);
  std::thread stdin_watch([&] {
    char buf[64];
    while (::read(0, buf, sizeof(buf)) > 0) {
    }
    asio::post(io, [&] { io.stop(); });
  });
  auto guard = asio::make_work_guard(io);
  io.run();
  stdin_watch.join();
  std::printf("{\"rss_kib\": %ld, \"hwm_kib\": %ld}\n", status_kib("VmRSS:"), status_kib("VmHWM:"));
  return 0;
}

struct Client {
  explicit Client(asio::io_context& io) : socket(io) {}
  tcp::socket socket;
  int step = 0;
  std::string out;
  char in[128];
};

int clients(int port, int n, int dialect) {
  raise_nofile();
  asio::io_context io(1);
  const tcp::endpoint ep(asio::ip::make_address("127.0.0.1"), static_cast<unsigned short>(port));
  std::vector<std::unique_ptr<Client>> cs;
  cs.reserve(static_cast<std::size_t>(n));
  int done = 0, failed = 0, connecting = 0, next = 0;
  std::function<void(int)> run_step, connect_more;
  run_step = [&](int r) {
    Client& c = *cs[static_cast<std::size_t>(r)];
    if (c.step == kSteps) {
      ++done;
      c.socket.close();
      return;
    }
    std::int64_t count = 0;
    if (c.step == 4) std::memcpy(&count, c.in, 8);
    Step s = step(c.step, r, n, dialect, count);
    c.out = std::move(s.send);
    asio::async_write(c.socket, asio::buffer(c.out), [&, r, reply = s.reply](boost::system::error_code ec, std::size_t) {
      Client& c = *cs[static_cast<std::size_t>(r)];
      if (ec) return void(++failed);
      asio::async_read(c.socket, asio::buffer(c.in, reply), [&, r](boost::system::error_code ec, std::size_t) {
        if (ec) return void(++failed);
        ++cs[static_cast<std::size_t>(r)]->step;
        run_step(r);
      });
    });
  };
  connect_more = [&](int) {
    while (next < n && connecting < 512) {
      const int r = next++;
      ++connecting;
      cs.push_back(std::make_unique<Client>(io));
      cs.back()->socket.async_connect(ep, [&, r](boost::system::error_code ec) {
        --connecting;
        if (ec) {
          ++failed;
        } else {
          cs[static_cast<std::size_t>(r)]->socket.set_option(tcp::no_delay(true));
          run_step(r);
        }
        connect_more(0);
      });
    }
  };
  const auto t0 = std::chrono::steady_clock::now();
  connect_more(0);
  asio::steady_timer deadline(io, std::chrono::seconds(120));  // a server that stalls ends the run
  deadline.async_wait([&](boost::system::error_code ec) {
    if (!ec) io.stop();
  });
  while (done + failed < n && io.run_one()) {
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("{\"clients\": %d, \"done\": %d, \"failed\": %d, \"seconds\": %.4f}\n", n, done, failed, s);
  return done == n ? 0 : 1;
}

int inprocess(int n) {
  Engine engine;
  std::vector<Dialect> dialects(static_cast<std::size_t>(n), Dialect::kUnknown);
  std::vector<Reply> replies;
  std::vector<std::string> last(static_cast<std::size_t>(n));
  int finished = 0;
  const auto t0 = std::chrono::steady_clock::now();
  auto feed = [&](int r, const std::string& bytes) {
    std::string_view in = bytes;
    while (!in.empty()) {
      Parsed p = parse_query(in, dialects[static_cast<std::size_t>(r)]);
      if (p.status != Parsed::kOk) throw std::runtime_error("bad query: " + p.error);
      in.remove_prefix(p.consumed);
      replies.clear();
      if (auto e = engine.apply(static_cast<ClientId>(r), p.query, replies); !e.empty()) throw std::runtime_error(e);
      for (auto& rep : replies) last[rep.to] = rep.flat();
    }
  };
  // Every client runs its steps in lock step, as a big job does after its processes start.
  for (int s = 0; s < kSteps; ++s) {
    for (int r = 0; r < n; ++r) {
      std::int64_t count = 0;
      if (s == 4) std::memcpy(&count, last[static_cast<std::size_t>(r)].data(), 8);
      feed(r, step(s, r, n, 2, count).send);
    }
  }
  for (int r = 0; r < n; ++r) finished += last[static_cast<std::size_t>(r)] == std::string(1, kStopWaiting);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("{\"clients\": %d, \"done\": %d, \"seconds\": %.4f}\n", n, finished, secs);
  return finished == n ? 0 : 1;
}

// N waiters of the same K keys disconnecting: each forgets its K registrations in O(K)
// (Engine keeps their places); a search of each key's waiters would cost O(N*K) a client.
int waits(int n, int k) {
  Engine engine;
  std::vector<Reply> replies;
  Query q;
  q.op = Op::kWait;
  for (int i = 0; i < k; ++i) q.keys.push_back(fmt::format("key{}", i));
  for (int c = 0; c < n; ++c)
    if (auto e = engine.apply(static_cast<ClientId>(c), q, replies); !e.empty()) throw std::runtime_error(e);
  const auto t0 = std::chrono::steady_clock::now();
  for (int c = 0; c < n; ++c) engine.disconnected(static_cast<ClientId>(c));  // first come, first gone
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("{\"waiters\": %d, \"keys\": %d, \"left\": %zu, \"seconds\": %.4f}\n", n, k,
              engine.registrations(), secs);
  return engine.registrations() == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  try {
    if (mode == "serve") return serve();
    if (mode == "clients" && argc == 5) return clients(std::atoi(argv[2]), std::atoi(argv[3]), std::atoi(argv[4]));
    if (mode == "inprocess" && argc == 3) return inprocess(std::atoi(argv[2]));
    if (mode == "waits" && argc == 4) return waits(std::atoi(argv[2]), std::atoi(argv[3]));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "store_bench: %s\n", e.what());
    return 1;
  }
  std::fprintf(stderr, "usage: store_bench serve | clients PORT N DIALECT | inprocess N | waits N K\n");
  return 2;
}
