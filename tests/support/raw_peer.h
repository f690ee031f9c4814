// A blocking client of the rendezvous protocol for the hostile tests (every read bounded by
// a timeout), from a source address of 127.0.0.0/8: raw frames, the handshake with a token,
// frames signed and checked after it. Shared by hostile_rdzv_test.cc and
// takeover_socket_test.cc.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "proto/frame.h"
#include "proto/messages.h"
#include "rendezvous/auth.h"

namespace mgtest {

// The token of the hostile tests' daemons and servers.
inline const std::string kToken = "hostile-test-token";

class RawPeer {
 public:
  // Connects to 127.0.0.1:port from `source` (127.0.0.x), or fails the test.
  struct Adopt {};
  RawPeer(Adopt, int fd) : fd_(fd) {}  // an accepted connection (FakeServer)
  explicit RawPeer(int port, const std::string& source = "127.0.0.1") {
    fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in src{};
    src.sin_family = AF_INET;
    ::inet_pton(AF_INET, source.c_str(), &src.sin_addr);
    REQUIRE(::bind(fd_, reinterpret_cast<sockaddr*>(&src), sizeof src) == 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(port));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    REQUIRE(::connect(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  }
  ~RawPeer() { ::close(fd_); }
  RawPeer(const RawPeer&) = delete;

  // Sends raw bytes; false when the daemon already closed the connection.
  bool send_bytes(const std::vector<std::uint8_t>& bytes) {
    std::size_t off = 0;
    while (off < bytes.size()) {
      ssize_t n = ::send(fd_, bytes.data() + off, bytes.size() - off, MSG_NOSIGNAL);
      if (n <= 0) return false;
      off += static_cast<std::size_t>(n);
    }
    return true;
  }
  std::vector<std::uint8_t> encoded(const mg::proto::Frame& f) {
    auto bytes = mg::proto::encode(f, 1 << 26, mac_out_ ? mg::rdzv::auth::kFrameMacBytes : 0);
    if (mac_out_) mac_out_->sign(bytes);
    return bytes;
  }
  bool send(const mg::proto::Frame& f) { return send_bytes(encoded(f)); }

  // The next frame, or nullopt on close, timeout or a bad frame.
  std::optional<mg::proto::Frame> read(std::chrono::milliseconds timeout = std::chrono::seconds(10)) {
    std::vector<std::uint8_t> buf(4);
    if (!read_exact(buf.data(), 4, timeout)) return std::nullopt;
    const std::size_t len = (std::size_t{buf[0]} << 24) | (buf[1] << 16) | (buf[2] << 8) | buf[3];
    if (len > (1 << 22)) return std::nullopt;
    buf.resize(4 + len);
    if (!read_exact(buf.data() + 4, len, timeout)) return std::nullopt;
    if (mac_in_ && !mac_in_->verify(buf)) return std::nullopt;
    auto r = mg::proto::decode(buf, 1 << 22, mac_in_ ? mg::rdzv::auth::kFrameMacBytes : 0);
    if (r.status != mg::proto::DecodeResult::Status::kOk) return std::nullopt;
    return r.frame;
  }

  // True when the daemon closes the connection within `timeout` (frames before the close,
  // such as an Error, are read and kept in `last`).
  bool closed_within(std::chrono::milliseconds timeout) {
    const auto end = std::chrono::steady_clock::now() + timeout;
    char c[4096];
    while (std::chrono::steady_clock::now() < end) {
      pollfd p{fd_, POLLIN, 0};
      if (::poll(&p, 1, 50) <= 0) continue;
      ssize_t n = ::recv(fd_, c, sizeof c, 0);
      if (n <= 0) return true;
      received_.append(c, static_cast<std::size_t>(n));
    }
    return false;
  }
  const std::string& received() const { return received_; }
  int fd() const { return fd_; }

  // Hello -> (Challenge -> Auth) -> Welcome for `job`, with the job key derived from
  // `token`; from then on frames are signed and checked. False if refused.
  bool handshake(const std::string& job, const std::string& token = kToken) {
    const std::string cn = mg::rdzv::auth::random_hex(32);
    if (!send(mg::proto::to_frame(mg::proto::Hello{"hostile", job, cn}))) return false;
    auto f = read();
    if (!f) return false;
    if (mg::proto::type_of(*f) == mg::proto::MsgType::kWelcome) return true;
    if (mg::proto::type_of(*f) != mg::proto::MsgType::kChallenge) return false;
    auto c = mg::proto::from_frame<mg::proto::Challenge>(*f);
    const std::string key = mg::rdzv::auth::job_key(token, job);
    if (!send(mg::proto::to_frame(mg::proto::Auth{mg::rdzv::auth::client_proof(key, cn, c.nonce)}))) return false;
    const std::string session = mg::rdzv::auth::session_key(key, cn, c.nonce);
    mac_out_.emplace(session, 'c');
    f = read();
    if (!f || mg::proto::type_of(*f) != mg::proto::MsgType::kWelcome) return false;
    mac_in_.emplace(session, 's');
    return true;
  }

 private:
  bool read_exact(std::uint8_t* p, std::size_t n, std::chrono::milliseconds timeout) {
    const auto end = std::chrono::steady_clock::now() + timeout;
    while (n > 0) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(end - std::chrono::steady_clock::now());
      if (left.count() <= 0) return false;
      pollfd pfd{fd_, POLLIN, 0};
      if (::poll(&pfd, 1, static_cast<int>(left.count())) <= 0) return false;
      ssize_t got = ::recv(fd_, p, n, 0);
      if (got <= 0) return false;
      p += got;
      n -= static_cast<std::size_t>(got);
    }
    return true;
  }
  int fd_ = -1;
  std::optional<mg::rdzv::auth::FrameMac> mac_out_, mac_in_;
  std::string received_;
};

// A Join of `job` by node 127.0.0.9 (2 nodes).
inline mg::proto::Join join_for(const std::string& job) {
  mg::proto::Join j;
  j.job_id = job;
  j.agent_id = "hostile:1";
  j.host = "hostile";
  j.addr = "127.0.0.9";
  j.min_nodes = j.max_nodes = 2;
  return j;
}
}  // namespace mgtest
