#include "rendezvous/connection.h"

#include <boost/asio/write.hpp>
#include <fmt/format.h>

namespace mg::rdzv {

namespace asio = boost::asio;

namespace {
constexpr std::size_t kInitialBuffer = 512;  // a Hello, a Join or a heartbeat fits
constexpr std::size_t kKeepBuffer = 64 * 1024;  // larger buffers shrink back once idle
}  // namespace

FramedConnection::FramedConnection(asio::ip::tcp::socket socket, std::size_t max_frame,
                                   std::shared_ptr<MemoryBudget> budget, std::shared_ptr<Traffic> traffic)
    : socket_(std::move(socket)), max_frame_(max_frame), budget_(std::move(budget)), traffic_(std::move(traffic)) {
  boost::system::error_code ec;
  auto ep = socket_.remote_endpoint(ec);
  peer_address_ = ec ? "?" : ep.address().to_string();
  peer_ = ec ? "?" : fmt::format("{}:{}", peer_address_, ep.port());
  socket_.set_option(asio::ip::tcp::no_delay(true), ec);
  // Charged even past the budget: the owner refuses new connections before that.
  in_.resize(kInitialBuffer);
  if (budget_) budget_->used += kInitialBuffer;
}

FramedConnection::~FramedConnection() {
  if (budget_) budget_->release(in_.size());
}

void FramedConnection::start(FrameHandler on_frame, CloseHandler on_close) {
  on_frame_ = std::move(on_frame);
  on_close_ = std::move(on_close);
  read_more();
}

bool FramedConnection::reserve(std::size_t bytes) {
  if (bytes <= in_.size()) return true;
  if (budget_ && !budget_->charge(bytes - in_.size())) return false;
  std::vector<std::uint8_t> bigger(bytes);
  std::copy(in_.begin(), in_.begin() + static_cast<std::ptrdiff_t>(in_used_), bigger.begin());
  in_.swap(bigger);
  return true;
}

void FramedConnection::shrink() {
  if (in_.size() <= kKeepBuffer || in_used_ > kInitialBuffer) return;
  std::vector<std::uint8_t> small(kInitialBuffer);
  std::copy(in_.begin(), in_.begin() + static_cast<std::ptrdiff_t>(in_used_), small.begin());
  if (budget_) budget_->release(in_.size() - small.size());
  in_.swap(small);
}

void FramedConnection::sign_sent(const std::string& key, char direction) { send_mac_.emplace(key, direction); }
void FramedConnection::verify_received(const std::string& key, char direction) { recv_mac_.emplace(key, direction); }

void FramedConnection::read_more() {
  if (in_used_ == in_.size() && !reserve(std::min(in_.size() * 2, max_frame_ + 4)))
    return shut("the daemon's memory limit is reached; closing");
  auto self = shared_from_this();
  socket_.async_read_some(asio::buffer(in_.data() + in_used_, in_.size() - in_used_),
                          [this, self](boost::system::error_code ec, std::size_t n) {
                            if (!open_) return;
                            if (ec) return shut(ec == asio::error::eof ? "connection closed by peer" : ec.message());
                            try {
                              on_read(n);
                            } catch (const std::exception& e) {
                              // One connection's failure closes that connection only.
                              shut(fmt::format("internal error while handling a frame: {}", e.what()));
                            }
                          });
}

void FramedConnection::on_read(std::size_t n) {
  if (lingering_) {  // closing: the peer's last words are read and dropped
    in_used_ = 0;
    return read_more();
  }
  if (in_used_ == 0 && n > 0) partial_since_ = Clock::now();
  in_used_ += n;
  if (traffic_) traffic_->bytes_in += n;
  std::size_t pos = 0;
  while (open_) {
    const auto avail = std::span<const std::uint8_t>(in_.data() + pos, in_used_ - pos);
    auto size = proto::peek(avail, max_frame_);
    if (size.status == proto::DecodeResult::Status::kError) return shut(size.error);
    // An incomplete frame: the buffer grows (doubling) only as its bytes arrive, so a
    // header announcing 1 MiB costs nothing until the megabyte is really sent.
    if (size.status == proto::DecodeResult::Status::kNeedMore) break;
    const auto bytes = avail.first(size.consumed);
    const std::size_t trailer = recv_mac_ ? auth::kFrameMacBytes : 0;
    if (recv_mac_ && !recv_mac_->verify(bytes))
      return shut("a frame failed authentication (bad MAC: forged, altered or replayed)");
    auto r = proto::decode(bytes, max_frame_, trailer);
    if (r.status != proto::DecodeResult::Status::kOk) return shut(r.error.empty() ? "malformed frame" : r.error);
    pos += r.consumed;
    last_frame_ = Clock::now();
    if (traffic_) ++traffic_->frames_in;
    on_frame_(r.frame);
  }
  if (!open_) return;
  if (pos > 0) {
    std::copy(in_.begin() + static_cast<std::ptrdiff_t>(pos), in_.begin() + static_cast<std::ptrdiff_t>(in_used_),
              in_.begin());
    in_used_ -= pos;
    partial_since_ = in_used_ > 0 ? std::optional(Clock::now()) : std::nullopt;
    shrink();
  }
  read_more();
}

bool FramedConnection::send(const proto::Frame& frame) {
  if (!open_ || close_after_write_) return false;
  std::vector<std::uint8_t> bytes;
  try {
    bytes = proto::encode(frame, max_frame_, send_mac_ ? auth::kFrameMacBytes : 0);
  } catch (const std::length_error& e) {
    shut(fmt::format("cannot send message type {}: {}", frame.type, e.what()));
    return false;
  }
  if (send_mac_) send_mac_->sign(bytes);
  out_bytes_ += bytes.size();
  if (traffic_) {
    ++traffic_->frames_out;
    traffic_->bytes_out += bytes.size();
  }
  // A peer that does not read its replies must not make us buffer without bound.
  if (out_bytes_ > 4 * std::max(max_frame_, proto::kDefaultMaxFrame)) {
    shut("the peer does not read what is sent to it; closing");
    return false;
  }
  out_.push_back(std::move(bytes));
  if (!writing_) write_next();
  return true;
}

void FramedConnection::write_next() {
  if (out_.empty()) {
    writing_ = false;
    if (close_after_write_) linger();
    return;
  }
  writing_ = true;
  auto self = shared_from_this();
  asio::async_write(socket_, asio::buffer(out_.front()), [this, self](boost::system::error_code ec, std::size_t) {
    if (!open_) return;
    if (ec) return shut(ec.message());
    out_bytes_ -= out_.front().size();
    out_.pop_front();
    write_next();
  });
}

void FramedConnection::close(bool now) {
  if (!open_) return;
  if (now) return shut("closed");
  close_after_write_ = true;
  if (!writing_ && out_.empty()) linger();
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
  // The read loop keeps running: frames are dropped (on_read checks lingering_), EOF shuts.
}

void FramedConnection::shut(const std::string& why) {
  if (!open_) return;
  open_ = false;
  partial_since_.reset();
  if (linger_timer_) linger_timer_->cancel();
  boost::system::error_code ec;
  socket_.shutdown(asio::ip::tcp::socket::shutdown_both, ec);
  socket_.close(ec);
  out_.clear();
  out_bytes_ = 0;
  if (on_close_) {
    auto cb = std::move(on_close_);
    on_close_ = nullptr;
    cb(why);
  }
}

}  // namespace mg::rdzv
