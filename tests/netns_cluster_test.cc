// The namespace cluster itself (support/netns_cluster.h, #34): every host has its address
// and name and reaches every other, a cut cuts both ways and nothing else, a one-way drop
// is one way, loss loses a share, a flapping link goes down and up, heal heals, an sshd per
// host answers, nothing leaves the cluster, nothing is left after it, and where namespaces
// cannot be made the test is Skipped (a failure under CI=true). The checks are sockets the
// test opens itself inside the hosts' namespaces (NetCluster::InHost).
#include <catch2/catch.hpp>

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <optional>
#include <filesystem>
#include <string>
#include <utility>

#include "support/netns_cluster.h"
#include "support/proc.h"

using namespace mgtest;
using namespace std::chrono_literals;

namespace {

sockaddr_in address(const std::string& ip, int port) {
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  ::inet_pton(AF_INET, ip.c_str(), &a.sin_addr);
  return a;
}

// An owned descriptor, closed at scope exit.
struct Sock {
  int fd = -1;
  explicit Sock(int f) : fd(f) {}
  ~Sock() {
    if (fd >= 0) ::close(fd);
  }
  Sock(Sock&& o) noexcept : fd(std::exchange(o.fd, -1)) {}
  Sock(const Sock&) = delete;
  Sock& operator=(const Sock&) = delete;
};

// A socket of `type` bound to host k's address (a port the kernel picks), in host k's
// namespace; TCP ones listen.
Sock bound(const NetCluster& c, int k, int type, int& port) {
  NetCluster::InHost in(c, k);
  Sock s(::socket(AF_INET, type | SOCK_CLOEXEC, 0));
  sockaddr_in a = address(c.addr(k), 0);
  socklen_t len = sizeof a;
  REQUIRE(::bind(s.fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  if (type == SOCK_STREAM) REQUIRE(::listen(s.fd, 64) == 0);
  REQUIRE(::getsockname(s.fd, reinterpret_cast<sockaddr*>(&a), &len) == 0);
  port = ntohs(a.sin_port);
  if (type == SOCK_DGRAM) {
    const int big = 8 << 20;
    ::setsockopt(s.fd, SOL_SOCKET, SO_RCVBUFFORCE, &big, sizeof big);
  }
  return s;
}

// How a TCP connect from host `from` to ip:port ends within `timeout`: 0 connected, else the
// errno (ECONNREFUSED: refused, ETIMEDOUT: no answer in time).
int connect_result(const NetCluster& c, int from, const std::string& ip, int port,
                   std::chrono::milliseconds timeout = 1500ms) {
  Sock s(-1);
  {
    NetCluster::InHost in(c, from);
    s.fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  }
  const sockaddr_in a = address(ip, port);
  if (::connect(s.fd, reinterpret_cast<const sockaddr*>(&a), sizeof a) == 0) return 0;
  if (errno != EINPROGRESS) return errno;
  pollfd p{s.fd, POLLOUT, 0};
  if (::poll(&p, 1, static_cast<int>(timeout.count())) != 1) return ETIMEDOUT;
  int err = 0;
  socklen_t len = sizeof err;
  ::getsockopt(s.fd, SOL_SOCKET, SO_ERROR, &err, &len);
  return err;
}

// Whether a TCP connection from host `from` to ip:port is made within `timeout` (refused,
// unreachable and no answer are all "no").
bool connects(const NetCluster& c, int from, const std::string& ip, int port,
              std::chrono::milliseconds timeout = 1500ms) {
  return connect_result(c, from, ip, port, timeout) == 0;
}

bool connects(const NetCluster& c, int from, int to, int port, std::chrono::milliseconds timeout = 1500ms) {
  return connects(c, from, c.addr(to), port, timeout);
}

// `count` UDP datagrams from host `from` to `to`: how many `to` received (read until
// nothing more came for 1 s).
int datagrams(const NetCluster& c, int from, int to, int count) {
  int port = 0;
  Sock rx = bound(c, to, SOCK_DGRAM, port);
  Sock tx(-1);
  {
    NetCluster::InHost in(c, from);
    tx.fd = ::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  }
  const sockaddr_in a = address(c.addr(to), port);
  for (int i = 0; i < count; ++i) ::sendto(tx.fd, "x", 1, 0, reinterpret_cast<const sockaddr*>(&a), sizeof a);
  int got = 0;
  char buf[16];
  for (int i = 0; i < count + 1; ++i) {
    pollfd p{rx.fd, POLLIN, 0};
    if (::poll(&p, 1, 1000) != 1) break;
    if (::recv(rx.fd, buf, sizeof buf, 0) > 0) ++got;
  }
  return got;
}

std::string self() {
  char buf[PATH_MAX];
  const ssize_t n = ::readlink("/proc/self/exe", buf, sizeof buf - 1);
  REQUIRE(n > 0);
  return std::string(buf, static_cast<std::size_t>(n));
}

std::string last_line(const std::string& out) {
  auto lines = split_lines(out);
  while (!lines.empty() && lines.back().empty()) lines.pop_back();
  return lines.empty() ? "" : lines.back();
}

}  // namespace

TEST_CASE("every host has its own address and host name, resolves every host's name, and "
          "reaches every other host") {
  NetCluster c(3);
  std::vector<Sock> listeners;
  std::vector<int> ports(3);
  for (int k = 0; k < 3; ++k) listeners.push_back(bound(c, k, SOCK_STREAM, ports[static_cast<std::size_t>(k)]));
  for (int k = 0; k < 3; ++k) {
    INFO("host " << k);
    const Result name = c.run_on(k, {"/bin/hostname"});
    CHECK(name.out == c.name(k) + "\n");
    const Result ip = c.run_on(k, {"/usr/sbin/ip", "-o", "-4", "addr", "show", "dev", "eth0"});
    CHECK_THAT(ip.out, Catch::Contains(c.addr(k) + "/24"));
    for (int j = 0; j < 3; ++j) {
      const Result host = c.run_on(k, {"/usr/bin/getent", "hosts", c.name(j)});
      CHECK_THAT(host.out, Catch::StartsWith(c.addr(j) + " "));
      if (j != k) CHECK(eventually([&] { return connects(c, k, j, ports[static_cast<std::size_t>(j)]); }, 10s));
    }
  }
}

TEST_CASE("a cut host reaches no host and no host reaches it, the others still reach each "
          "other, and reconnecting heals") {
  NetCluster c(3);
  std::vector<Sock> listeners;
  std::vector<int> ports(3);
  for (int k = 0; k < 3; ++k) listeners.push_back(bound(c, k, SOCK_STREAM, ports[static_cast<std::size_t>(k)]));
  auto port = [&](int k) { return ports[static_cast<std::size_t>(k)]; };
  REQUIRE(eventually([&] { return connects(c, 0, 2, port(2)) && connects(c, 2, 0, port(0)); }, 10s));
  c.cut(2);
  CHECK_THAT(c.switch_links(), Catch::Contains("h2@"));
  for (int k : {0, 1}) {
    CHECK_FALSE(connects(c, k, 2, port(2)));
    CHECK_FALSE(connects(c, 2, k, port(k)));
  }
  CHECK(connects(c, 0, 1, port(1)));
  CHECK(connects(c, 1, 0, port(0)));
  c.reconnect(2);
  CHECK(eventually([&] { return connects(c, 0, 2, port(2)) && connects(c, 2, 1, port(1)); }, 10s));
}

TEST_CASE("a one-way drop loses only that direction's packets, and heal heals") {
  NetCluster c(3);
  REQUIRE(eventually([&] { return datagrams(c, 0, 1, 1) == 1 && datagrams(c, 1, 0, 1) == 1; }, 10s));
  c.drop(0, 1);
  CHECK_THAT(c.switch_rules(), Catch::Contains("iifname \"h0\" oifname \"h1\""));
  CHECK(datagrams(c, 0, 1, 20) == 0);
  CHECK(datagrams(c, 1, 0, 20) == 20);
  CHECK(datagrams(c, 0, 2, 20) == 20);  // host 0's packets to other hosts pass
  c.drop(2, -1);                        // host 2's to every host
  CHECK(datagrams(c, 2, 0, 20) == 0);
  CHECK(datagrams(c, 2, 1, 20) == 0);
  CHECK(datagrams(c, 1, 2, 20) == 20);
  c.undrop(2, -1);
  CHECK(datagrams(c, 2, 1, 20) == 20);
  CHECK(datagrams(c, 0, 1, 20) == 0);  // the other drop holds
  c.heal();
  CHECK(datagrams(c, 0, 1, 20) == 20);
  CHECK_THAT(c.switch_rules(), !Catch::Contains("drop"));
}

TEST_CASE("a REJECT firewall on a host refuses every connection to and from it at once, resets one made before, "
          "leaves the others be, and heal heals") {
  NetCluster c(3);
  int p0 = 0, p1 = 0;
  Sock l0 = bound(c, 0, SOCK_STREAM, p0);
  Sock l1 = bound(c, 1, SOCK_STREAM, p1);
  REQUIRE(eventually([&] { return connects(c, 1, 0, p0); }, 10s));
  // A connection from host 1 to host 0, made before the firewall.
  Sock early(-1);
  {
    NetCluster::InHost in(c, 1);
    early.fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  }
  const sockaddr_in a0 = address(c.addr(0), p0);
  REQUIRE(::connect(early.fd, reinterpret_cast<const sockaddr*>(&a0), sizeof a0) == 0);
  c.reject(0);
  CHECK(connect_result(c, 1, c.addr(0), p0, 5s) == ECONNREFUSED);  // refused, not a timeout
  CHECK(connect_result(c, 0, c.addr(1), p1, 5s) == ECONNREFUSED);  // its own connects too
  CHECK(connects(c, 2, 1, p1));                                     // the others reach each other
  CHECK(datagrams(c, 1, 0, 5) == 0);
  // The connection made before is reset on its next segment.
  bool reset = false;
  for (int i = 0; i < 50 && !reset; ++i) {
    if (::send(early.fd, "x", 1, MSG_NOSIGNAL) < 0) reset = errno == ECONNRESET || errno == EPIPE;
    pollfd p{early.fd, POLLIN, 0};
    if (!reset && ::poll(&p, 1, 100) == 1) {
      char b;
      reset = ::recv(early.fd, &b, 1, 0) < 0 && errno == ECONNRESET;
    }
  }
  CHECK(reset);
  c.heal();
  CHECK(connects(c, 1, 0, p0));
  CHECK(connects(c, 0, 1, p1));
}

TEST_CASE("packet loss drops about its share at random, and ends") {
  NetCluster c(2);
  REQUIRE(eventually([&] { return datagrams(c, 0, 1, 1) == 1; }, 10s));
  c.loss(1, 50);
  const int got = datagrams(c, 0, 1, 400);
  INFO(got << " of 400 arrived at 50% loss");
  CHECK(got > 100);  // 200 expected; 100 or 300 lie 10 standard deviations away
  CHECK(got < 300);
  c.loss(1, 0);
  CHECK(datagrams(c, 0, 1, 400) >= 390);
}

TEST_CASE("a flapping link goes down and up again and again, and is up once it stops") {
  NetCluster c(2);
  int port = 0;
  Sock l = bound(c, 1, SOCK_STREAM, port);
  c.flap(1, 300ms, 300ms);
  int downs = 0, ups = 0;
  bool was_up = true;
  // h1's flags at the switch: "<BROADCAST,MULTICAST,UP,LOWER_UP>" while up, no ",UP" while down.
  CHECK(eventually([&] {
    std::string links = c.switch_links();
    const auto at = links.find("h1@");
    if (at == std::string::npos) return false;
    links = links.substr(at, links.find('>', at) - at);
    const bool up = links.find(",UP") != std::string::npos;
    if (up != was_up) (up ? ups : downs) += 1;
    was_up = up;
    return downs >= 2 && ups >= 2;
  }, 30s));
  c.stop_flap(1);
  CHECK_THAT(c.switch_links(), Catch::Contains("h1@") && !Catch::Contains("state DOWN"));
  CHECK(eventually([&] { return connects(c, 0, 1, port); }, 10s));
}

TEST_CASE("an sshd on every host runs a command on another host by its name") {
  NetCluster c(2);
  c.start_sshd();
  std::vector<std::string> argv{"/usr/bin/ssh"};
  for (const auto& o : c.ssh_opts()) argv.push_back(o);
  argv.insert(argv.end(), {"root@" + c.name(1), "hostname"});
  const Result r = c.run_on(0, argv, {}, 60s);
  INFO(r.err);
  CHECK(r.code == 0);
  CHECK(r.out == c.name(1) + "\n");
}

TEST_CASE("nothing leaves it (no route out, its loopback is its own), and nothing is left "
          "once it is gone, processes started on a host and their descendants included") {
  int outside_port = 0;
  const int outside = listen_on_loopback(outside_port, 8);  // in the test's own namespace
  REQUIRE(outside >= 0);
  Sock outside_sock(outside);
  std::vector<std::string> namespaces;
  pid_t orphan = -1;
  {
    std::optional<Proc> sleeper;  // declared before the cluster: it outlives it
    NetCluster c(2);
    namespaces = c.namespaces();
    REQUIRE(namespaces.size() == 3);
    CHECK_FALSE(connects(c, 0, "127.0.0.1", outside_port));
    CHECK_FALSE(connects(c, 0, "10.35.0.1", 22));  // no route: fails at once
    const Result routes = c.run_on(0, {"/usr/sbin/ip", "-4", "route", "show"});
    CHECK(routes.out == "10.34.0.0/24 dev eth0 proto kernel scope link src 10.34.0.1 \n");
    // A process of its own session whose parent exits at once: found by its namespace only.
    sleeper.emplace(c.spawn_on(1, {"/bin/sh", "-c", "/usr/bin/setsid /bin/sleep 300 </dev/null >/dev/null 2>&1 & echo $!"}));
    REQUIRE(sleeper->wait(10s));
    orphan = std::stoi(sleeper->out());
    CHECK(pid_alive(orphan));
  }
  CHECK(eventually([&] { return !pid_alive(orphan); }, 10s));
  std::error_code ec;
  int inside = 0;
  for (const auto& e : std::filesystem::directory_iterator("/proc", ec)) {
    const std::string ns = std::filesystem::read_symlink(e.path() / "ns" / "net", ec).string();
    if (!ns.empty() && std::find(namespaces.begin(), namespaces.end(), ns) != namespaces.end()) ++inside;
  }
  CHECK(inside == 0);
}

// Hidden ([.]): run by name from the case below, with or without what it needs.
TEST_CASE("probe: a namespace cluster of 2 hosts", "[.]") {
  NetCluster c(2);
  CHECK(c.run_on(1, {"/bin/hostname"}).out == "node1\n");
}

TEST_CASE("where namespaces cannot be made or nft is missing, the test is Skipped with one "
          "line saying why, and fails under CI=true") {
  auto probe = [](std::vector<std::string> prefix, std::map<std::string, std::string> env) {
    prefix.insert(prefix.end(), {self(), "probe: a namespace cluster of 2 hosts"});
    return run(prefix, env, 60s);
  };
  const Result ok = probe({}, {{"CI", "true"}});
  INFO(ok.out);
  CHECK(ok.code == 0);
  // Root without CAP_SYS_ADMIN (as in a container without it): unshare is refused.
  const std::vector<std::string> no_admin{"/usr/bin/setpriv", "--bounding-set=-sys_admin", "--"};
  const Result skipped = probe(no_admin, {{"CI", kUnset}});
  INFO(skipped.out);
  CHECK(skipped.code == 77);
  CHECK(last_line(skipped.out) ==
        "skipped: cannot make the namespace cluster's network namespaces here (unshare: Operation not permitted)");
  const Result failed = probe(no_admin, {{"CI", "true"}});
  INFO(failed.out);
  CHECK(failed.code == 1);
  CHECK_THAT(last_line(failed.out), Catch::StartsWith("error: cannot make the namespace cluster's network namespaces"));
  const Result no_nft = probe({}, {{"CI", kUnset}, {"MGTEST_MISSING", "nft"}});
  INFO(no_nft.out);
  CHECK(no_nft.code == 77);
  CHECK(last_line(no_nft.out) == "skipped: /usr/sbin/nft is missing (make setup installs Debian package nftables)");
  CHECK(probe({}, {{"CI", "true"}, {"MGTEST_MISSING", "nft"}}).code == 1);
}
