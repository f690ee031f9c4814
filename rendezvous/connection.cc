#include "rendezvous/connection.h"

#include <sys/socket.h>

#include <cerrno>
#include <cstring>

#include <fmt/format.h>

namespace mg::rdzv {

namespace asio = boost::asio;

namespace {

constexpr std::size_t kReadScratch = 64 * 1024;

// A per-thread buffer lent to one user at a time; a nested user (a handler that ends up
// here again) gets a buffer of its own.
class Scratch {
 public:
  explicit Scratch(int which) : which_(which) {
    if (!busy()[which_]) {
      busy()[which_] = true;
      lent_ = true;
      buf_ = &shared()[which_];
    } else {
      buf_ = &own_;
    }
  }
  ~Scratch() {
    if (lent_) busy()[which_] = false;
  }
  Scratch(const Scratch&) = delete;
  std::vector<std::uint8_t>& buf() { return *buf_; }

 private:
  static std::vector<std::uint8_t>* shared() {
    thread_local std::vector<std::uint8_t> bufs[2];
    return bufs;
  }
  static bool* busy() {
    thread_local bool flags[2] = {false, false};
    return flags;
  }
  int which_;
  bool lent_ = false;
  std::vector<std::uint8_t>* buf_ = nullptr;
  std::vector<std::uint8_t> own_;
};
constexpr int kReading = 0, kWriting = 1;

}  // namespace

FramedConnection::FramedConnection(asio::ip::tcp::socket socket, std::size_t max_frame,
                                   std::shared_ptr<MemoryBudget> budget, std::shared_ptr<Traffic> traffic,
                                   std::optional<asio::ip::tcp::endpoint> peer)
    : socket_(std::move(socket)), max_frame_(max_frame), budget_(std::move(budget)), traffic_(std::move(traffic)) {
  boost::system::error_code ec;
  if (peer) {
    peer_ = *peer;
    peer_known_ = true;
  } else {
    peer_ = socket_.remote_endpoint(ec);
    peer_known_ = !ec;
  }
  socket_.set_option(asio::ip::tcp::no_delay(true), ec);
}

FramedConnection::~FramedConnection() {
  if (budget_) budget_->release(in_charged_);
}

std::string FramedConnection::peer() const {
  return peer_known_ ? fmt::format("{}:{}", peer_.address().to_string(), peer_.port()) : "?";
}

std::string FramedConnection::peer_address() const { return peer_known_ ? peer_.address().to_string() : "?"; }

void FramedConnection::start(FrameHandler on_frame, CloseHandler on_close) {
  on_frame_ = std::move(on_frame);
  on_close_ = std::move(on_close);
  wait_readable();
}

void FramedConnection::sign_sent(const std::string& key, char direction) {
  send_mac_ = std::make_unique<auth::FrameMac>(key, direction);
}
void FramedConnection::verify_received(const std::string& key, char direction) {
  recv_mac_ = std::make_unique<auth::FrameMac>(key, direction);
}

void FramedConnection::wait_readable() {
  auto self = shared_from_this();
  socket_.async_wait(asio::ip::tcp::socket::wait_read, [this, self](boost::system::error_code ec) {
    if (!open_) return;
    if (ec) return shut(ec.message());
    try {
      on_readable();
    } catch (const std::exception& e) {
      // One connection's failure closes that connection only.
      shut(fmt::format("internal error while handling a frame: {}", e.what()));
    }
  });
}

void FramedConnection::on_readable() {
  // asio registers sockets edge-triggered: read until the socket reports nothing more
  // (EAGAIN), or an end of file that came with the last bytes would never be seen. The
  // wait below is queued before this (single) thread polls again, so bytes arriving
  // later wake it.
  Scratch scratch(kReading);
  auto& buf = scratch.buf();
  if (buf.size() < kReadScratch) buf.resize(kReadScratch);
  for (;;) {
    const ssize_t n = ::recv(socket_.native_handle(), buf.data(), buf.size(), MSG_DONTWAIT);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) break;
      reset_ = errno == ECONNRESET;
      return shut(std::strerror(errno));
    }
    if (n == 0) return shut("connection closed by peer");
    take(std::span<const std::uint8_t>(buf.data(), static_cast<std::size_t>(n)));
    if (!open_) return;
  }
  wait_readable();
}

void FramedConnection::take(std::span<const std::uint8_t> data) {
  if (traffic_) traffic_->bytes_in += data.size();
  if (lingering_) return;  // closing: the peer's last words are read and dropped
  if (in_.empty()) {
    const std::size_t used = decode_frames(data);
    if (!open_ || used == data.size()) return;
    if (keep_partial(data.subspan(used))) partial_since_ = Clock::now();
    return;
  }
  if (!keep_partial(data)) return;
  const std::size_t used = decode_frames(in_);
  if (!open_) return;
  if (used == in_.size()) {
    release_in();
    partial_since_.reset();
  } else if (used > 0) {
    in_.erase(in_.begin(), in_.begin() + static_cast<std::ptrdiff_t>(used));
    partial_since_ = Clock::now();
  }
}

std::size_t FramedConnection::decode_frames(std::span<const std::uint8_t> data) {
  std::size_t pos = 0;
  while (open_) {
    const auto avail = data.subspan(pos);
    auto size = proto::peek(avail, max_frame_);
    if (size.status == proto::DecodeResult::Status::kError) {
      shut(size.error);
      break;
    }
    if (size.status == proto::DecodeResult::Status::kNeedMore) break;
    const auto bytes = avail.first(size.consumed);
    const std::size_t trailer = recv_mac_ ? auth::kFrameMacBytes : 0;
    if (recv_mac_ && !recv_mac_->verify(bytes)) {
      shut("a frame failed authentication (bad MAC: forged, altered or replayed)");
      break;
    }
    auto r = proto::decode(bytes, max_frame_, trailer);
    if (r.status != proto::DecodeResult::Status::kOk) {
      shut(r.error.empty() ? "malformed frame" : r.error);
      break;
    }
    pos += r.consumed;
    last_frame_ = Clock::now();
    if (traffic_) ++traffic_->frames_in;
    on_frame_(r.frame);
  }
  return pos;
}

bool FramedConnection::keep_partial(std::span<const std::uint8_t> rest) {
  const std::size_t need = in_.size() + rest.size();
  if (need > in_.capacity()) {
    // Doubling as the frame's bytes arrive (a frame is at most max_frame + 4 bytes).
    const std::size_t cap = std::max(need, std::min(in_.capacity() * 2, max_frame_ + 4));
    if (budget_ && cap > in_charged_ && !budget_->charge(cap - in_charged_)) {
      shut("the daemon's memory limit is reached; closing");
      return false;
    }
    in_.reserve(cap);
    in_charged_ = std::max(in_charged_, cap);
  }
  in_.insert(in_.end(), rest.begin(), rest.end());
  return true;
}

void FramedConnection::release_in() {
  std::vector<std::uint8_t>().swap(in_);
  if (budget_) budget_->release(in_charged_);
  in_charged_ = 0;
}

bool FramedConnection::send(const proto::Wire& frame) {
  if (!open_ || close_after_write_) return false;
  const std::size_t trailer = send_mac_ ? auth::kFrameMacBytes : 0;
  const bool queued = !out_.empty();  // a write wait is pending; flush() takes this along
  Scratch scratch(kWriting);
  std::vector<std::uint8_t>& buf = queued ? out_ : scratch.buf();
  if (!queued) buf.clear();
  const std::size_t start = buf.size();
  try {
    proto::append_frame(frame, buf, max_frame_, trailer);
  } catch (const std::length_error& e) {
    shut(fmt::format("cannot send message type {}: {}", frame.type, e.what()));
    return false;
  }
  if (send_mac_) send_mac_->sign(buf, start);
  if (traffic_) {
    ++traffic_->frames_out;
    traffic_->bytes_out += buf.size() - start;
  }
  if (queued) {
    // A peer that does not read its replies must not make us buffer without bound.
    if (out_.size() - out_sent_ > 4 * std::max(max_frame_, proto::kDefaultMaxFrame)) {
      shut("the peer does not read what is sent to it; closing");
      return false;
    }
    return true;
  }
  std::size_t sent = 0;
  while (sent < buf.size()) {
    const ssize_t n = ::send(socket_.native_handle(), buf.data() + sent, buf.size() - sent, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) break;
      const std::string why = std::strerror(errno);
      shut(why);
      return false;
    }
    sent += static_cast<std::size_t>(n);
  }
  if (sent == buf.size()) return true;
  out_.assign(buf.begin() + static_cast<std::ptrdiff_t>(sent), buf.end());
  out_sent_ = 0;
  wait_writable();
  return true;
}

void FramedConnection::wait_writable() {
  auto self = shared_from_this();
  socket_.async_wait(asio::ip::tcp::socket::wait_write, [this, self](boost::system::error_code ec) {
    if (!open_) return;
    if (ec) return shut(ec.message());
    flush();
  });
}

void FramedConnection::flush() {
  while (out_sent_ < out_.size()) {
    const ssize_t n =
        ::send(socket_.native_handle(), out_.data() + out_sent_, out_.size() - out_sent_, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return wait_writable();
      reset_ = errno == ECONNRESET;
      return shut(std::strerror(errno));
    }
    out_sent_ += static_cast<std::size_t>(n);
  }
  std::vector<std::uint8_t>().swap(out_);
  out_sent_ = 0;
  if (close_after_write_) linger();
}

void FramedConnection::close(bool now) {
  if (!open_) return;
  if (now) return shut("closed");
  close_after_write_ = true;
  if (out_.empty()) linger();
}

void FramedConnection::linger() {
  if (!open_ || lingering_) return;
  lingering_ = true;
  boost::system::error_code ec;
  socket_.shutdown(asio::ip::tcp::socket::shutdown_send, ec);
  if (ec) return shut("closed");
  linger_timer_ = std::make_unique<asio::steady_timer>(socket_.get_executor(), std::chrono::seconds(3));
  auto self = shared_from_this();
  linger_timer_->async_wait([this, self](boost::system::error_code ec) {
    if (!ec) shut("closed");
  });
  // The read wait stays: bytes are dropped (take() checks lingering_), end of file shuts.
}

void FramedConnection::shut(const std::string& why) {
  if (!open_) return;
  open_ = false;
  partial_since_.reset();
  if (linger_timer_) linger_timer_->cancel();
  boost::system::error_code ec;
  socket_.shutdown(asio::ip::tcp::socket::shutdown_both, ec);
  socket_.close(ec);
  std::vector<std::uint8_t>().swap(out_);  // in_ may be being decoded: the destructor frees it
  out_sent_ = 0;
  if (on_close_) {
    auto cb = std::move(on_close_);
    on_close_ = nullptr;
    cb(why);
  }
}

}  // namespace mg::rdzv
