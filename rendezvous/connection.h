// FramedConnection: one TCP connection carrying proto frames, shared by the server's
// sessions and the agent's client. Reads decode frames as they complete (a garbage or
// oversized frame, a bad MAC or a throwing handler closes this connection only).
//
// Memory is spent only while something is in flight, so that a daemon holding 10,000
// idle agents holds no buffers for them: the socket is read (when readable) into one
// scratch buffer per thread, and only the bytes of a frame that is still incomplete are
// kept, in a buffer of this connection charged to an optional shared MemoryBudget (a
// header announcing 1 MiB costs nothing until the megabyte really arrives). A frame sent
// is written at once from a per-thread scratch buffer when nothing is queued (no
// allocation; one send() per frame); what the socket does not take is queued, frames
// sent meanwhile are appended to that queue and leave in one send(), and a peer that
// stops reading is dropped once the queue passes a bound.
//
// Owned through shared_ptr; callbacks run on the socket's io_context, which must be run
// by one thread (the reads rely on it: see on_readable()).
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/steady_timer.hpp>

#include "proto/frame.h"
#include "proto/wire.h"
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

  // `peer`: the remote endpoint when the caller knows it (accept() reported it), else it
  // is asked from the socket.
  FramedConnection(boost::asio::ip::tcp::socket socket, std::size_t max_frame = proto::kDefaultMaxFrame,
                   std::shared_ptr<MemoryBudget> budget = nullptr, std::shared_ptr<Traffic> traffic = nullptr,
                   std::optional<boost::asio::ip::tcp::endpoint> peer = std::nullopt);
  ~FramedConnection();
  void start(FrameHandler on_frame, CloseHandler on_close);
  // Returns false (and closes, telling the close handler why) when the frame cannot be sent.
  bool send(const proto::Wire& frame);
  bool send(const proto::Frame& frame) { return send(proto::wire_of(frame)); }
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
  // Whether it ended on the peer's reset (ECONNRESET), not an end of file or a local close.
  bool reset() const { return reset_; }
  std::string peer() const;          // "address:port"
  std::string peer_address() const;  // "address"
  // When the first byte of a frame that is still incomplete arrived (nullopt: none pending).
  std::optional<Clock::time_point> partial_since() const { return partial_since_; }
  Clock::time_point last_frame() const { return last_frame_; }
  // Bytes this connection holds for an incomplete frame received and for unsent frames.
  std::size_t buffered() const { return in_.capacity() + out_.capacity(); }

 private:
  void wait_readable();
  void on_readable();
  void take(std::span<const std::uint8_t> data);  // frames out of newly received bytes
  std::size_t decode_frames(std::span<const std::uint8_t> data);  // bytes consumed
  bool keep_partial(std::span<const std::uint8_t> rest);  // within the budget
  void release_in();
  void wait_writable();
  void flush();
  void shut(const std::string& why);
  void linger();

  boost::asio::ip::tcp::socket socket_;
  std::size_t max_frame_;
  std::shared_ptr<MemoryBudget> budget_;
  std::shared_ptr<Traffic> traffic_;
  std::vector<std::uint8_t> in_;   // an incomplete frame's bytes; no capacity when none
  std::size_t in_charged_ = 0;     // in_'s capacity as charged to budget_
  std::vector<std::uint8_t> out_;  // bytes not written yet (from out_sent_ on); no capacity when none
  std::size_t out_sent_ = 0;
  bool open_ = true;
  bool reset_ = false;  // reset()
  bool close_after_write_ = false;
  bool lingering_ = false;
  std::unique_ptr<boost::asio::steady_timer> linger_timer_;
  boost::asio::ip::tcp::endpoint peer_;
  bool peer_known_ = false;
  std::unique_ptr<auth::FrameMac> send_mac_, recv_mac_;
  std::optional<Clock::time_point> partial_since_;
  Clock::time_point last_frame_ = Clock::now();
  FrameHandler on_frame_;
  CloseHandler on_close_;
};

}  // namespace mg::rdzv
