#include "rendezvous/connection.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include <boost/asio/write.hpp>
#include <fmt/format.h>

namespace mg::rdzv {

namespace asio = boost::asio;

FramedConnection::FramedConnection(asio::ip::tcp::socket socket, std::size_t max_frame)
    : socket_(std::move(socket)), max_frame_(max_frame), in_(64 * 1024) {
  boost::system::error_code ec;
  auto ep = socket_.remote_endpoint(ec);
  peer_ = ec ? "?" : fmt::format("{}:{}", ep.address().to_string(), ep.port());
  socket_.set_option(asio::ip::tcp::no_delay(true), ec);
}

void FramedConnection::start(FrameHandler on_frame, CloseHandler on_close) {
  on_frame_ = std::move(on_frame);
  on_close_ = std::move(on_close);
  read_more();
}

void FramedConnection::read_more() {
  if (in_used_ == in_.size()) in_.resize(std::min(in_.size() * 2, max_frame_ + 64));
  auto self = shared_from_this();
  socket_.async_read_some(asio::buffer(in_.data() + in_used_, in_.size() - in_used_),
                          [this, self](boost::system::error_code ec, std::size_t n) {
                            if (!open_) return;
                            if (ec) {
                              shut(ec == asio::error::eof ? "connection closed by peer" : ec.message());
                              return;
                            }
                            in_used_ += n;
                            std::size_t pos = 0;
                            while (open_) {
                              auto r = proto::decode(std::span(in_.data() + pos, in_used_ - pos), max_frame_);
                              if (r.status == proto::DecodeResult::Status::kNeedMore) break;
                              if (r.status == proto::DecodeResult::Status::kError) {
                                shut(r.error);
                                return;
                              }
                              pos += r.consumed;
                              on_frame_(r.frame);
                            }
                            if (!open_) return;
                            std::copy(in_.begin() + static_cast<std::ptrdiff_t>(pos),
                                      in_.begin() + static_cast<std::ptrdiff_t>(in_used_), in_.begin());
                            in_used_ -= pos;
                            read_more();
                          });
}

void FramedConnection::send(const proto::Frame& frame) {
  if (!open_ || close_after_write_) return;
  out_.push_back(proto::encode(frame, max_frame_));
  if (!writing_) write_next();
}

void FramedConnection::write_next() {
  if (out_.empty()) {
    writing_ = false;
    if (close_after_write_) shut("closed");
    return;
  }
  writing_ = true;
  auto self = shared_from_this();
  asio::async_write(socket_, asio::buffer(out_.front()), [this, self](boost::system::error_code ec, std::size_t) {
    if (!open_) return;
    if (ec) {
      shut(ec.message());
      return;
    }
    out_.pop_front();
    write_next();
  });
}

void FramedConnection::close(bool now) {
  if (!open_) return;
  if (now || (!writing_ && out_.empty())) {
    shut("closed");
    return;
  }
  close_after_write_ = true;
}

void FramedConnection::shut(const std::string& why) {
  if (!open_) return;
  open_ = false;
  boost::system::error_code ec;
  socket_.shutdown(asio::ip::tcp::socket::shutdown_both, ec);
  socket_.close(ec);
  if (on_close_) {
    auto cb = std::move(on_close_);
    on_close_ = nullptr;
    cb(why);
  }
}

std::string hmac_sha256_hex(const std::string& key, const std::string& data) {
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()), reinterpret_cast<const unsigned char*>(data.data()),
       data.size(), md, &len);
  std::string hex;
  for (unsigned i = 0; i < len; ++i) hex += fmt::format("{:02x}", md[i]);
  return hex;
}

bool equal_ct(const std::string& a, const std::string& b) {
  return a.size() == b.size() && CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

std::string random_hex(std::size_t bytes) {
  std::vector<unsigned char> buf(bytes);
  RAND_bytes(buf.data(), static_cast<int>(buf.size()));
  std::string hex;
  for (unsigned char c : buf) hex += fmt::format("{:02x}", c);
  return hex;
}

}  // namespace mg::rdzv
