// FramedConnection: one TCP connection carrying proto frames, shared by the server's
// sessions and the agent's client. Reads decode frames as they complete (a garbage or
// oversized frame, a bad MAC or a throwing handler closes this connection only); writes
// are queued with exactly one in flight, and a peer that stops reading is dropped once
// the queue passes a bound. The read buffer starts small, grows to the frame in progress
// and shrinks back after a large frame; its bytes are charged to an optional shared
// MemoryBudget. Owned through shared_ptr; callbacks run on the socket's io_context.
#pragma once

#include <chrono>
#include <list>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/steady_timer.hpp>

#include "proto/frame.h"
#include "rendezvous/auth.h"

namespace mg::rdzv {

// Bytes held by connection buffers (and whatever else the owner charges), against a limit.
// Single-threaded, like the io_context that uses it.
struct MemoryBudget {
  std::size_t limit = SIZE_MAX;
  std::size_t used = 0;
  bool charge(std::size_t n) {
    if (n > limit || used > limit - n) return false;
    used += n;
    return true;
  }
  void release(std::size_t n) { used -= std::min(n, used); }
};

// Frames and bytes through every connection that shares it (for metrics).
struct Traffic {
  std::uint64_t frames_in = 0, frames_out = 0, bytes_in = 0, bytes_out = 0;
};

class FramedConnection : public std::enable_shared_from_this<FramedConnection> {
 public:
  using Clock = std::chrono::steady_clock;
  using FrameHandler = std::function<void(const proto::Frame&)>;
  using CloseHandler = std::function<void(const std::string& why)>;

  FramedConnection(boost::asio::ip::tcp::socket socket, std::size_t max_frame = proto::kDefaultMaxFrame,
                   std::shared_ptr<MemoryBudget> budget = nullptr, std::shared_ptr<Traffic> traffic = nullptr);
  ~FramedConnection();
  void start(FrameHandler on_frame, CloseHandler on_close);
  // Returns false (and closes, telling the close handler why) when the frame cannot be sent.
  bool send(const proto::Frame& frame);
  // Closes once the queued frames are written (or at once when `now`). The graceful way
  // half-closes and waits (up to 3 s) for the peer to close too, reading and discarding
  // meanwhile: closing with unread input would send a reset, which can destroy the last
  // frames (a decision) before the peer has read them.
  void close(bool now = false);
  void set_max_frame(std::size_t n) { max_frame_ = n; }
  // From now on, frames sent / received carry a MAC under this session key.
  void sign_sent(const std::string& session_key, char direction);
  void verify_received(const std::string& session_key, char direction);

  bool open() const { return open_; }
  std::string peer() const { return peer_; }
  std::string peer_address() const { return peer_address_; }
  // When the first byte of a frame that is still incomplete arrived (nullopt: none pending).
  std::optional<Clock::time_point> partial_since() const { return partial_since_; }
  Clock::time_point last_frame() const { return last_frame_; }

 private:
  void read_more();
  void on_read(std::size_t n);
  bool reserve(std::size_t bytes);  // grows the read buffer within the budget
  void shrink();
  void write_next();
  void shut(const std::string& why);
  void linger();

  boost::asio::ip::tcp::socket socket_;
  std::size_t max_frame_;
  std::shared_ptr<MemoryBudget> budget_;
  std::shared_ptr<Traffic> traffic_;
  std::vector<std::uint8_t> in_;
  std::size_t in_used_ = 0;
  // A list, not a deque: an idle connection holds no queue storage (a deque allocates
  // ~570 bytes up front, a quarter of the daemon's memory per agent).
  std::list<std::vector<std::uint8_t>> out_;
  std::size_t out_bytes_ = 0;
  bool writing_ = false;
  bool open_ = true;
  bool close_after_write_ = false;
  bool lingering_ = false;
  std::unique_ptr<boost::asio::steady_timer> linger_timer_;
  std::string peer_, peer_address_;
  std::optional<auth::FrameMac> send_mac_, recv_mac_;
  std::optional<Clock::time_point> partial_since_;
  Clock::time_point last_frame_ = Clock::now();
  FrameHandler on_frame_;
  CloseHandler on_close_;
};

}  // namespace mg::rdzv
