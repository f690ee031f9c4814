// rdzv_scale: N simulated agents (clients on one event loop, each from its own 127.0.x.y
// source address) join one job of one mglaunch-rdzv daemon. Prints the time from the first
// connect to the last assignment received. Each agent sends its join with its hello, as
// mglaunch's client does without a token. Usage: rdzv_scale HOST:PORT [N] [JOB]
#include <sys/resource.h>

#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include <boost/asio.hpp>
#include <fmt/format.h>

#include "proto/messages.h"
#include "rendezvous/auth.h"
#include "rendezvous/connection.h"
#include "rendezvous/endpoint.h"

namespace asio = boost::asio;
using namespace mg;

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: rdzv_scale HOST:PORT [N] [JOB]\n");
    return 2;
  }
  const auto ep = rdzv::parse_endpoint(argv[1], 0);
  const int n = argc > 2 ? std::atoi(argv[2]) : 10000;
  const std::string job = argc > 3 ? argv[3] : "scale";
  rlimit rl{};
  getrlimit(RLIMIT_NOFILE, &rl);
  rl.rlim_cur = rl.rlim_max;
  setrlimit(RLIMIT_NOFILE, &rl);

  asio::io_context io(1);
  const asio::ip::tcp::endpoint server(asio::ip::make_address(ep.host), static_cast<unsigned short>(ep.port));
  std::vector<std::shared_ptr<rdzv::FramedConnection>> conns(static_cast<std::size_t>(n));
  int next = 0, assigned = 0, failed = 0, world = 0;
  constexpr int kInFlight = 256;  // connects outstanding at once (the listen backlog is finite)
  const auto t0 = std::chrono::steady_clock::now();
  std::chrono::steady_clock::time_point t_end;

  std::function<void()> launch = [&] {
    if (next >= n) return;
    const int i = next++;
    // 127.0.x.y from 127.0.1.1 up, skipping .0 and .255.
    const auto src = asio::ip::make_address_v4(fmt::format("127.0.{}.{}", 1 + i / 250, 1 + i % 250));
    auto sock = std::make_shared<asio::ip::tcp::socket>(io);
    sock->open(asio::ip::tcp::v4());
    sock->bind({src, 0});
    sock->async_connect(server, [&, i, sock](boost::system::error_code ec) {
      if (ec) {
        ++failed;
        launch();
        return;
      }
      auto c = std::make_shared<rdzv::FramedConnection>(std::move(*sock));
      conns[static_cast<std::size_t>(i)] = c;
      proto::Join j;
      j.job_id = job;
      j.agent_id = fmt::format("sim-{}", i);
      j.host = fmt::format("sim{}", i);
      j.addr = src.to_string();
      j.min_nodes = j.max_nodes = n;
      j.keep_alive_ms = 600000;
      j.join_timeout_ms = 600000;
      c->start(
          [&, c, j](const proto::Frame& f) {
            switch (proto::type_of(f)) {
              case proto::MsgType::kWelcome:  // the join went with the hello
                break;
              case proto::MsgType::kAssignment:
                world = proto::from_frame<proto::Assignment>(f).group_world_size;
                if (++assigned == n) {
                  t_end = std::chrono::steady_clock::now();
                  for (auto& x : conns)
                    if (x) x->close(true);
                }
                break;
              default:
                ++failed;
                c->close(true);
            }
          },
          [](const std::string&) {});
      // As an agent without a token does (rendezvous/client.cc): the join rides with the hello.
      c->send(proto::to_frame(proto::Hello{j.agent_id, job, rdzv::auth::random_hex(32)}));
      c->send(proto::to_frame(j));
      launch();
    });
  };
  for (int k = 0; k < kInFlight; ++k) launch();
  io.run();
  const double secs = std::chrono::duration<double>(t_end - t0).count();
  std::printf("%d simulated agents joined job '%s': %d assigned (group world %d), %d failed, %.3f s\n", n,
              job.c_str(), assigned, world, failed, assigned == n ? secs : -1.0);
  return assigned == n ? 0 : 1;
}
