// The HTTP endpoints (mglaunch-rdzv --metrics-port and --http, the agent's --metrics-port;
// all one rdzv::HttpServer) against a hostile client of our own: slow connections from one
// address held open and reopened as they are dropped, oversized and malformed requests,
// and a status page bound beyond loopback without a token.
#include <catch2/catch.hpp>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <memory>
#include <regex>
#include <thread>
#include <vector>

#include "support/proc.h"
#include "support/rdzv_fixture.h"
#include "support/skip.h"

using namespace mgtest;
using namespace std::chrono_literals;

namespace {

bool send_all(int fd, const std::string& bytes) {
  std::size_t off = 0;
  while (off < bytes.size()) {
    ssize_t n = ::send(fd, bytes.data() + off, bytes.size() - off, MSG_NOSIGNAL);
    if (n <= 0) return false;
    off += static_cast<std::size_t>(n);
  }
  return true;
}

// Sends `raw` from `source` and reads until the server closes (at most 10 s): the whole
// response, "" when refused or closed without one.
std::string exchange(const std::string& source, int port, const std::string& raw) {
  int fd = connect_from(source, port);
  if (fd < 0) return "";
  std::string out;
  if (send_all(fd, raw)) {
    char buf[8192];
    const auto end = std::chrono::steady_clock::now() + 10s;
    while (std::chrono::steady_clock::now() < end) {
      pollfd p{fd, POLLIN, 0};
      if (::poll(&p, 1, 100) <= 0) continue;
      ssize_t n = ::recv(fd, buf, sizeof buf, 0);
      if (n <= 0) break;
      out.append(buf, static_cast<std::size_t>(n));
    }
  }
  ::close(fd);
  return out;
}

std::string get_from(const std::string& source, int port, const std::string& path, const std::string& auth = "") {
  return exchange(source, port,
                  "GET " + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\n" +
                      (auth.empty() ? "" : "Authorization: " + auth + "\r\n") + "Connection: close\r\n\r\n");
}

// Slowloris from one address: `count` connections to each port that send the start of a
// request and never finish it; the ones the server drops are reopened (up to 16 every
// 20 ms) until the hog is destroyed.
class SlowHog {
 public:
  SlowHog(std::string source, std::vector<int> ports, int count) : source_(std::move(source)), ports_(std::move(ports)) {
    for (int port : ports_)
      for (int i = 0; i < count; ++i) conns_.push_back({port, open(port)});
    thread_ = std::thread([this] { loop(); });
  }
  ~SlowHog() {
    stop_ = true;
    thread_.join();
    for (auto& c : conns_)
      if (c.fd >= 0) ::close(c.fd);
  }
  SlowHog(const SlowHog&) = delete;
  int reopened() const { return reopened_; }

 private:
  struct Conn {
    int port;
    int fd;
  };
  int open(int port) {
    int fd = connect_from(source_, port);
    if (fd >= 0) send_all(fd, "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ");
    return fd;
  }
  void loop() {
    while (!stop_) {
      std::vector<pollfd> fds;
      for (auto& c : conns_) fds.push_back({c.fd, POLLIN, 0});
      ::poll(fds.data(), fds.size(), 20);
      int budget = 16;
      for (std::size_t i = 0; i < conns_.size(); ++i) {
        auto& c = conns_[i];
        char b[256];
        if (c.fd >= 0 && fds[i].revents != 0 && ::recv(c.fd, b, sizeof b, MSG_DONTWAIT) <= 0) {
          ::close(c.fd);
          c.fd = -1;
        }
        if (c.fd < 0 && budget-- > 0) {
          c.fd = open(c.port);
          ++reopened_;
        }
      }
    }
  }
  std::string source_;
  std::vector<int> ports_;
  std::vector<Conn> conns_;
  std::atomic<bool> stop_{false};
  std::atomic<int> reopened_{0};
  std::thread thread_;
};

// The port at the end of the line of `text` that starts with `prefix`, 0 until printed.
int port_on_line(const std::string& text, const std::string& prefix) {
  for (const auto& l : split_lines(text))
    if (l.rfind(prefix, 0) == 0) {
      std::smatch m;
      static const std::regex port(R"(:([0-9]+)/)");
      if (std::regex_search(l, m, port)) return std::stoi(m[1]);
    }
  return 0;
}

}  // namespace

TEST_CASE("slow HTTP connections from one address leave the daemon's /metrics and status page to other addresses") {
  Daemon d = start_daemon({{"MGLAUNCH_RDZV_TOKEN", "http-token"}}, {"--metrics-port", "0", "--http", "0"});
  REQUIRE(eventually([&] { return split_lines(d.proc.out()).size() >= 3; }, 10s));
  const int metrics = port_on_line(d.proc.out(), "metrics on http://127.0.0.1:");
  const int status = port_on_line(d.proc.out(), "status page on http://127.0.0.1:");
  REQUIRE(metrics > 0);
  REQUIRE(status > 0);
  {
    // More connections than the whole server takes (64), from 127.0.0.2, kept open.
    SlowHog hog("127.0.0.2", {metrics, status}, 72);
    for (int i = 0; i < 3; ++i) {
      INFO("request " << i);
      CHECK_THAT(get_from("127.0.0.3", metrics, "/metrics"),
                 Catch::StartsWith("HTTP/1.1 200") && Catch::Contains("mglaunch_rdzv_connections"));
      CHECK_THAT(get_from("127.0.0.3", status, "/"), Catch::StartsWith("HTTP/1.1 200"));
      CHECK_THAT(get_from("127.0.0.4", status, "/api/jobs", "Bearer http-token"), Catch::StartsWith("HTTP/1.1 200"));
    }
    CHECK(eventually([&] { return hog.reopened() > 0; }, 10s));  // the server dropped the ones beyond its caps
  }
  // Once the hog has gone, its address is served again.
  CHECK(eventually([&] { return get_from("127.0.0.2", metrics, "/metrics").rfind("HTTP/1.1 200", 0) == 0; }, 20s));
  ::kill(d.proc.pid, SIGTERM);
  REQUIRE(d.proc.wait(10s));
  CHECK(d.proc.exit_code() == 0);
}

TEST_CASE("slow HTTP connections from many addresses, 8 each, cannot lock out one more address") {
  Daemon d = start_daemon({}, {"--metrics-port", "0"});
  REQUIRE(eventually([&] { return port_on_line(d.proc.out(), "metrics on http://127.0.0.1:") > 0; }, 10s));
  const int port = port_on_line(d.proc.out(), "metrics on http://127.0.0.1:");
  {
    std::vector<std::unique_ptr<SlowHog>> hogs;  // 10 addresses x 8 = 80 > 64
    for (int i = 10; i < 20; ++i) hogs.push_back(std::make_unique<SlowHog>("127.0.0." + std::to_string(i), std::vector<int>{port}, 8));
    for (int i = 0; i < 3; ++i)
      CHECK_THAT(get_from("127.0.0.3", port, "/metrics"), Catch::StartsWith("HTTP/1.1 200"));
  }
  ::kill(d.proc.pid, SIGTERM);
  REQUIRE(d.proc.wait(10s));
  CHECK(d.proc.exit_code() == 0);
}

TEST_CASE("slow HTTP connections from one address leave the agent's /metrics to other addresses") {
  Proc agent = spawn(launch({"--metrics-port", "0"}, {"hang", "300"}));
  REQUIRE(eventually([&] { return port_on_line(agent.err(), "[mglaunch] metrics on http://127.0.0.1:") > 0; }, 20s));
  const int port = port_on_line(agent.err(), "[mglaunch] metrics on http://127.0.0.1:");
  {
    SlowHog hog("127.0.0.2", {port}, 72);
    for (int i = 0; i < 3; ++i)
      CHECK_THAT(get_from("127.0.0.3", port, "/metrics"),
                 Catch::StartsWith("HTTP/1.1 200") && Catch::Contains("mglaunch_agent_info"));
  }
  ::kill(agent.pid, SIGTERM);
  REQUIRE(agent.wait(30s));
  CHECK(agent.exit_code() == 143);
}

// At its address's cap, a newcomer displaces that address's oldest connection still
// waiting for its request.
TEST_CASE("eight slow connections from 127.0.0.1 leave the loopback health check answered (#35)") {
  Proc agent = spawn(launch({"--nproc_per_node=1", "--master_port=0"}, {"hang", "300"}),
                     {{"TORCHELASTIC_HEALTH_CHECK_PORT", "0"}});
  REQUIRE(eventually([&] { return port_on_line(agent.err(), "[mglaunch] health check on http://127.0.0.1:") > 0; }, 20s));
  const int port = port_on_line(agent.err(), "[mglaunch] health check on http://127.0.0.1:");
  {
    SlowHog hog("127.0.0.1", {port}, 8);  // the per-address cap, from the prober's own address
    for (int i = 0; i < 3; ++i) {
      INFO("request " << i);
      CHECK_THAT(get_from("127.0.0.1", port, "/health"), Catch::StartsWith("HTTP/1.1 200"));
    }
  }
  ::kill(agent.pid, SIGTERM);
  REQUIRE(agent.wait(30s));
  CHECK(agent.exit_code() == 143);
}

TEST_CASE("a status page bound beyond loopback without a token warns like --listen does") {
  // In a network namespace of our own (only its loopback exists), 0.0.0.0 reaches nobody.
  if (run({"/usr/bin/unshare", "-n", "/bin/true"}).code != 0) {
    SKIP_TEST("cannot create a network namespace here (unshare -n)");
  }
  auto start = [](const std::string& http, const std::map<std::string, std::string>& env) {
    Proc p = spawn({"/usr/bin/unshare", "-n", "/bin/sh", "-c", "ip link set lo up 2>/dev/null; exec \"$@\"", "sh",
                    kRdzvDaemon, "--listen", "127.0.0.1:0", "--http", http},
                   env);
    REQUIRE(eventually([&] { return p.out().find("status page on") != std::string::npos || !pid_alive(p.pid); }, 10s));
    REQUIRE_THAT(p.out(), Catch::Contains("status page on"));
    ::kill(p.pid, SIGTERM);
    p.wait(5s);
    return p.err();
  };
  CHECK_THAT(start("0.0.0.0:0", {}),
             Catch::Contains("warning: status page on 0.0.0.0:") && Catch::Contains("without a token"));
  // A token of 256 random bits: a short one draws the token-strength warning (#35 D7).
  CHECK_THAT(start("0.0.0.0:0", {{"MGLAUNCH_RDZV_TOKEN", std::string(64, 'a')}}), !Catch::Contains("warning"));
  CHECK_THAT(start("127.0.0.1:0", {}), !Catch::Contains("warning"));
}

TEST_CASE("a stopped daemon closes its open HTTP connections instead of serving them until their deadline") {
  Daemon d = start_daemon({}, {"--metrics-port", "0"});
  REQUIRE(eventually([&] { return port_on_line(d.proc.out(), "metrics on http://127.0.0.1:") > 0; }, 10s));
  const int port = port_on_line(d.proc.out(), "metrics on http://127.0.0.1:");
  const int held = connect_from("127.0.0.2", port);
  REQUIRE(held >= 0);
  REQUIRE(send_all(held, "GET /metrics HTTP/1.1\r\n"));
  // Connections are accepted in order: once a later one is answered, `held` is open in the daemon.
  REQUIRE_THAT(get_from("127.0.0.3", port, "/metrics"), Catch::StartsWith("HTTP/1.1 200"));
  ::kill(d.proc.pid, SIGTERM);
  // Stopped: it takes no new connection.
  CHECK(eventually([&] {
    const int fd = connect_from("127.0.0.3", port);
    if (fd >= 0) ::close(fd);
    return fd < 0;
  }, 10s));
  // The rest of the held request gets no answer: the connection was closed with the server.
  send_all(held, "Host: 127.0.0.1\r\n\r\n");
  std::string answer;
  char buf[4096];
  for (int i = 0; i < 100; ++i) {  // at most 10 s
    pollfd p{held, POLLIN, 0};
    if (::poll(&p, 1, 100) <= 0) continue;
    ssize_t n = ::recv(held, buf, sizeof buf, 0);
    if (n <= 0) break;
    answer.append(buf, static_cast<std::size_t>(n));
  }
  ::close(held);
  CHECK(answer.empty());
  REQUIRE(d.proc.wait(10s));
  CHECK(d.proc.exit_code() == 0);
}

TEST_CASE("requests the HTTP server does not take are answered with a status that says why, and it serves on") {
  Daemon d = start_daemon({}, {"--metrics-port", "0"});
  REQUIRE(eventually([&] { return port_on_line(d.proc.out(), "metrics on http://127.0.0.1:") > 0; }, 10s));
  const int port = port_on_line(d.proc.out(), "metrics on http://127.0.0.1:");
  CHECK_THAT(exchange("127.0.0.2", port, "GET /metrics HTTP/1.1\r\nX-Big: " + std::string(9000, 'a') + "\r\n\r\n"),
             Catch::StartsWith("HTTP/1.1 431") && Catch::Contains("over 8192 bytes"));
  CHECK_THAT(exchange("127.0.0.2", port, "GET /" + std::string(9000, 'a') + " HTTP/1.1\r\n\r\n"),
             Catch::StartsWith("HTTP/1.1 431"));
  CHECK_THAT(exchange("127.0.0.2", port, "POST /metrics HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello"),
             Catch::StartsWith("HTTP/1.1 413") && Catch::Contains("no request body"));
  CHECK_THAT(exchange("127.0.0.2", port, "POST /metrics HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"),
             Catch::StartsWith("HTTP/1.1 413"));
  CHECK_THAT(exchange("127.0.0.2", port, std::string("\x01\x02 nonsense\r\n\r\n")), Catch::StartsWith("HTTP/1.1 400"));
  // A thousand small headers fit in 8 KiB: served.
  std::string many = "GET /metrics HTTP/1.1\r\n";
  for (int i = 0; i < 1000; ++i) many += "a: b\r\n";
  CHECK_THAT(exchange("127.0.0.2", port, many + "\r\n"), Catch::StartsWith("HTTP/1.1 200"));
  CHECK_THAT(get_from("127.0.0.2", port, "/metrics"), Catch::StartsWith("HTTP/1.1 200"));
  ::kill(d.proc.pid, SIGTERM);
  REQUIRE(d.proc.wait(10s));
  CHECK(d.proc.exit_code() == 0);
}
