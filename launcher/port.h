// Master ports the agent chooses (--standalone, dynamic backends, --master_port=0). A busy
// machine hands out its ephemeral range to outgoing connections all the time, so a port
// found by binding port 0 (which the kernel takes from that range) may be in use again
// before the workers bind it. The agent therefore picks ports outside the range
// (/proc/sys/net/ipv4/ip_local_port_range) and holds the chosen one until the workers start.
//
// The hold listens (backlog 128, SO_REUSEADDR, the wildcard address of both families: [::]
// with IPV6_V6ONLY off): Linux lets any
// user bind and listen beside a socket that is only bound with SO_REUSEADDR, but no one
// (of any user, with SO_REUSEADDR or SO_REUSEPORT) beside a listening one. The node-0
// agent's store takes that very listening socket over (release()), so the port is never
// free between the hold and the store. Where the workers host the store themselves
// (c10d's TCPStore binds it), stop_listening() turns the hold into a bound socket just
// before they start (shutdown(): the port stays bound), which their SO_REUSEADDR bind can
// share, and it goes once they have exec'd. Header-only.
#pragma once

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <cstring>
#include <fstream>
#include <iterator>
#include <optional>
#include <algorithm>
#include <random>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>

#include "launcher/plan.h"
#include "process/proc.h"

namespace mg {

struct PortRange {
  int lo = 32768;  // Linux's default ephemeral range
  int hi = 60999;
};

// Parses the text of ip_local_port_range ("32768\t60999\n"). Pure. nullopt when malformed.
inline std::optional<PortRange> parse_port_range(std::string_view text) {
  const auto r = parse_port_range_text(text);
  if (!r) return std::nullopt;
  return PortRange{r->first, r->second};
}

// The kernel's ephemeral range (process/proc.h), or Linux's default when it cannot be read.
inline PortRange ephemeral_port_range() {
  const auto r = ephemeral_port_range_of_kernel();
  return r ? PortRange{r->first, r->second} : PortRange{};
}

// The ports a master port is drawn from: [kLowestMasterPort, 65535] minus `eph`. Maps
// `r` (any number) onto one of them. Pure. 0 when nothing is left.
inline constexpr int kLowestMasterPort = 20000;  // below: many well-known services
inline int port_outside(PortRange eph, unsigned r) {
  const int lo = kLowestMasterPort;
  const int below = eph.lo > lo ? eph.lo - lo : 0;                      // [lo, eph.lo)
  const int above = 65535 - std::max(eph.hi, lo - 1);                   // (max(eph.hi, lo-1), 65535]
  const int total = below + std::max(above, 0);
  if (total <= 0) return 0;
  const int k = static_cast<int>(r % static_cast<unsigned>(total));
  return k < below ? lo + k : std::max(eph.hi, lo - 1) + 1 + (k - below);
}

// A held port: a TCP socket bound to [::]:port, IPv4 included (0.0.0.0:port without IPv6),
// with SO_REUSEADDR, listening (or, after stop_listening(), only bound). Non-blocking,
// close-on-exec.
class PortReservation {
 public:
  // Connections queued before the store (or preflight's coordinator) accepts them: as many
  // as a listener of c10d's TCPStore or of preflight's data port queues, so that strangers
  // connecting while the port is held but not yet served fill it no sooner (#35).
  static constexpr int kBacklog = 128;

  // Holds `port` (listening), or nullopt when something else uses it (errno kept).
  static std::optional<PortReservation> try_hold(int port) {
    const int fd = bound_socket(port, /*listening=*/true);
    if (fd < 0) return std::nullopt;
    return PortReservation(fd, port);
  }

  PortReservation(PortReservation&& o) noexcept
      : fd_(std::exchange(o.fd_, -1)), port_(o.port_), listening_(o.listening_) {}
  PortReservation& operator=(PortReservation&& o) noexcept {
    if (this != &o) {
      if (fd_ >= 0) ::close(fd_);
      fd_ = std::exchange(o.fd_, -1);
      port_ = o.port_;
      listening_ = o.listening_;
    }
    return *this;
  }
  PortReservation(const PortReservation&) = delete;
  PortReservation& operator=(const PortReservation&) = delete;
  ~PortReservation() {
    if (fd_ >= 0) ::close(fd_);
  }
  int port() const { return port_; }
  int fd() const { return fd_; }
  bool listening() const { return listening_; }
  // Hands the socket over (to the agent's store, which accepts on it); -1 when empty.
  int release() {
    port_ = 0;
    listening_ = false;
    return std::exchange(fd_, -1);
  }
  // For workers that bind the port themselves: the socket stops listening but stays bound
  // (shutdown() of a listener whose port was bound by number keeps the port: Linux moves it
  // to CLOSE with its bind), so the port is never free between the two; from here until
  // rank 0's TCPStore listens, another user can bind and listen beside it with SO_REUSEADDR
  // (the agent then sees that listener's uid: Agent::watch_master_port). Where shutdown()
  // fails, the socket is replaced by a bound one (free for a moment in between). False,
  // with errno, when the port could not be bound again (then nothing is held).
  bool stop_listening() {
    if (!listening_ || fd_ < 0) return fd_ >= 0;
    listening_ = false;
    if (::shutdown(fd_, SHUT_RD) == 0) return true;
    ::close(std::exchange(fd_, -1));
    fd_ = bound_socket(port_, /*listening=*/false);
    return fd_ >= 0;
  }

 private:
  PortReservation(int fd, int port) : fd_(fd), port_(port), listening_(true) {}
  // A socket on the wildcard address with SO_REUSEADDR, listening when asked; -1 (errno
  // kept) on failure. Both families at once where the machine has IPv6: [::] with
  // IPV6_V6ONLY off takes the port on every IPv4 and IPv6 address, so no one else can bind
  // [::]:port (V6ONLY) beside a hold of 0.0.0.0:port and take the workers that resolve
  // MASTER_ADDR (localhost) to ::1 (#35). 0.0.0.0 only where IPv6 is missing.
  static int bound_socket(int port, bool listening) {
    const int fd6 = bind_wildcard(AF_INET6, port, listening);
    if (fd6 >= 0 || (errno != EAFNOSUPPORT && errno != EADDRNOTAVAIL && errno != EPROTONOSUPPORT)) return fd6;
    return bind_wildcard(AF_INET, port, listening);
  }
  static int bind_wildcard(int family, int port, bool listening) {
    const int fd = ::socket(family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) return -1;
    const int one = 1, zero = 0;
    // SO_REUSEADDR only once the socket listens: between bind() and listen() another user's
    // SO_REUSEADDR socket could bind beside one that has it, and then listen first (seen
    // under load by the held-port test). Bound without it, the port is ours alone; only
    // where that fails (connections of an earlier attempt in TIME_WAIT) is it bound with it.
    bool reuse = false;
    sockaddr_storage ss{};
    socklen_t len = 0;
    if (family == AF_INET6) {
      ::setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof(zero));
      auto* a = reinterpret_cast<sockaddr_in6*>(&ss);
      a->sin6_family = AF_INET6;
      a->sin6_addr = in6addr_any;
      a->sin6_port = htons(static_cast<uint16_t>(port));
      len = sizeof(sockaddr_in6);
    } else {
      auto* a = reinterpret_cast<sockaddr_in*>(&ss);
      a->sin_family = AF_INET;
      a->sin_addr.s_addr = htonl(INADDR_ANY);
      a->sin_port = htons(static_cast<uint16_t>(port));
      len = sizeof(sockaddr_in);
    }
    if (::bind(fd, reinterpret_cast<sockaddr*>(&ss), len) != 0) {
      reuse = errno == EADDRINUSE;
      if (reuse) ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
      if (!reuse || ::bind(fd, reinterpret_cast<sockaddr*>(&ss), len) != 0) return close_keeping_errno(fd);
    }
    if (listening && ::listen(fd, kBacklog) != 0) return close_keeping_errno(fd);
    // From here on with SO_REUSEADDR: the workers' own SO_REUSEADDR bind after
    // stop_listening() needs it on both sockets.
    if (!reuse) ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    return fd;
  }
  static int close_keeping_errno(int fd) {
    const int err = errno;
    ::close(fd);
    errno = err;
    return -1;
  }
  int fd_ = -1;
  int port_ = 0;
  bool listening_ = false;
};

// Chooses and holds a free master port outside the ephemeral range (random draws, at
// most 200). Throws std::runtime_error naming the range when none could be held.
inline PortReservation reserve_master_port() {
  const PortRange eph = ephemeral_port_range();
  unsigned seed = 0;
  random_bytes(&seed, sizeof(seed));
  std::mt19937 gen(seed);
  for (int attempt = 0; attempt < 200; ++attempt) {
    const int port = port_outside(eph, static_cast<unsigned>(gen()));
    if (port == 0) break;
    if (auto r = PortReservation::try_hold(port)) return std::move(*r);
  }
  throw std::runtime_error("cannot find a free master port outside the ephemeral range " + std::to_string(eph.lo) +
                           "-" + std::to_string(eph.hi) + " (net.ipv4.ip_local_port_range); pass --master_port");
}

}  // namespace mg
