// Master ports the agent chooses (--standalone, dynamic backends, --master_port=0). A busy
// machine hands out its ephemeral range to outgoing connections all the time, so a port
// found by binding port 0 (which the kernel takes from that range) may be in use again
// before the workers bind it. The agent therefore picks ports outside the range
// (/proc/sys/net/ipv4/ip_local_port_range) and holds the chosen one with a socket bound
// to the wildcard address with SO_REUSEADDR, not listening, until the workers start: a
// bind without SO_REUSEADDR fails meanwhile, while c10d's TCPStore (which sets
// SO_REUSEADDR) can still bind and listen on it. Header-only.
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

// A held port: a TCP socket bound to 0.0.0.0:port with SO_REUSEADDR, never listening.
class PortReservation {
 public:
  // Holds `port`, or nullopt when something else uses it (errno kept).
  static std::optional<PortReservation> try_hold(int port) {
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return std::nullopt;
    const int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_ANY);
    a.sin_port = htons(static_cast<uint16_t>(port));
    if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
      const int err = errno;
      ::close(fd);
      errno = err;
      return std::nullopt;
    }
    return PortReservation(fd, port);
  }

  PortReservation(PortReservation&& o) noexcept : fd_(std::exchange(o.fd_, -1)), port_(o.port_) {}
  PortReservation& operator=(PortReservation&& o) noexcept {
    if (this != &o) {
      if (fd_ >= 0) ::close(fd_);
      fd_ = std::exchange(o.fd_, -1);
      port_ = o.port_;
    }
    return *this;
  }
  PortReservation(const PortReservation&) = delete;
  PortReservation& operator=(const PortReservation&) = delete;
  ~PortReservation() {
    if (fd_ >= 0) ::close(fd_);
  }
  int port() const { return port_; }
  // Hands the bound socket over (to the agent's store, which listens on it); -1 when empty.
  int release() {
    port_ = 0;
    return std::exchange(fd_, -1);
  }

 private:
  PortReservation(int fd, int port) : fd_(fd), port_(port) {}
  int fd_ = -1;
  int port_ = 0;
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
