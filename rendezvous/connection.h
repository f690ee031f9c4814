// FramedConnection: one TCP connection carrying proto frames, shared by the server's
// sessions and the agent's client. Reads decode frames as they complete (a garbage or
// oversized frame closes this connection only); writes are queued with exactly one in
// flight. Owned through shared_ptr; callbacks run on the socket's io_context.
#pragma once

#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <boost/asio/ip/tcp.hpp>

#include "proto/frame.h"

namespace mg::rdzv {

class FramedConnection : public std::enable_shared_from_this<FramedConnection> {
 public:
  using FrameHandler = std::function<void(const proto::Frame&)>;
  using CloseHandler = std::function<void(const std::string& why)>;

  FramedConnection(boost::asio::ip::tcp::socket socket, std::size_t max_frame = proto::kDefaultMaxFrame);
  void start(FrameHandler on_frame, CloseHandler on_close);
  void send(const proto::Frame& frame);
  // Closes once the queued frames are written (or at once when `now`).
  void close(bool now = false);
  bool open() const { return open_; }
  std::string peer() const { return peer_; }

 private:
  void read_more();
  void write_next();
  void shut(const std::string& why);

  boost::asio::ip::tcp::socket socket_;
  std::size_t max_frame_;
  std::vector<std::uint8_t> in_;
  std::size_t in_used_ = 0;
  std::deque<std::vector<std::uint8_t>> out_;
  bool writing_ = false;
  bool open_ = true;
  bool close_after_write_ = false;
  std::string peer_;
  FrameHandler on_frame_;
  CloseHandler on_close_;
};

// hex(HMAC-SHA256(key, data)) and a constant-time comparison of two such strings.
std::string hmac_sha256_hex(const std::string& key, const std::string& data);
bool equal_ct(const std::string& a, const std::string& b);
std::string random_hex(std::size_t bytes);

}  // namespace mg::rdzv
