#include "rendezvous/client.h"

#include <boost/asio/connect.hpp>
#include <fmt/format.h>

namespace mg::rdzv {

namespace asio = boost::asio;
using proto::MsgType;

Client::Client(asio::io_context& io, ClientOptions opts, ClientHandlers handlers)
    : io_(io), opts_(std::move(opts)), h_(std::move(handlers)), retry_timer_(io), heartbeat_timer_(io) {}

Client::~Client() {
  close();
  alive_.reset();
}

void Client::start() {
  deadline_ = std::chrono::steady_clock::now() + std::chrono::milliseconds(opts_.join.join_timeout_ms);
  try_connect();
}

void Client::try_connect() {
  if (closed_) return;
  boost::system::error_code ec;
  auto addr = asio::ip::make_address(opts_.host, ec);
  asio::ip::tcp::endpoint ep;
  if (!ec) {
    ep = {addr, static_cast<unsigned short>(opts_.port)};
  } else {
    asio::ip::tcp::resolver resolver(io_);
    auto results = resolver.resolve(opts_.host, std::to_string(opts_.port), ec);
    if (ec || results.empty()) return lost(fmt::format("cannot resolve rendezvous host '{}'", opts_.host));
    ep = *results.begin();
  }
  connecting_ = std::make_unique<asio::ip::tcp::socket>(io_);
  connecting_->async_connect(ep, [this](boost::system::error_code ec) {
    if (closed_) return;
    if (ec) {
      if (std::chrono::steady_clock::now() >= deadline_)
        return lost(fmt::format("cannot reach the rendezvous server at {}:{}: {}", opts_.host, opts_.port, ec.message()));
      retry_timer_.expires_after(connect_backoff_);
      connect_backoff_ = std::min(connect_backoff_ * 2, std::chrono::milliseconds(500));
      retry_timer_.async_wait([this](boost::system::error_code ec) {
        if (!ec) try_connect();
      });
      return;
    }
    conn_ = std::make_shared<FramedConnection>(std::move(*connecting_));
    connecting_.reset();
    std::weak_ptr<int> alive = alive_;
    conn_->start(
        [this, alive](const proto::Frame& f) {
          if (alive.lock() && !closed_) on_frame(f);
        },
        [this, alive](const std::string& why) {
          if (!alive.lock()) return;
          // A server that welcomed us and then vanished may come back: keep trying.
          if (welcomed_) reconnect_later(why);
          else lost(why);
        });
    conn_->send(proto::to_frame(proto::Hello{opts_.join.agent_id}));
  });
}

void Client::on_frame(const proto::Frame& f) {
  try {
    switch (proto::type_of(f)) {
      case MsgType::kChallenge: {
        auto c = proto::from_frame<proto::Challenge>(f);
        if (opts_.token.empty())
          return lost("the rendezvous server wants a token: set --token-file or MGLAUNCH_RDZV_TOKEN");
        conn_->send(proto::to_frame(proto::Auth{hmac_sha256_hex(opts_.token, c.nonce)}));
        return;
      }
      case MsgType::kWelcome: {
        welcomed_ = true;
        backoff_ = std::chrono::milliseconds(100);
        proto::Join j = opts_.join;
        if (current_) {
          if (h_.on_notice) h_.on_notice(fmt::format("reconnected; re-registered round {}", current_->round));
          j.resume_round = current_->round;
          j.resume_group_rank = current_->group_rank;
          j.resume_group_world_size = current_->group_world_size;
          j.resume_restart_count = current_->restart_count;
          j.resume_done = done_sent_;
        }
        conn_->send(proto::to_frame(j));
        heartbeat_timer_.cancel();
        heartbeat();
        return;
      }
      case MsgType::kAssignment: {
        auto a = proto::from_frame<proto::Assignment>(f);
        round_ = a.round;
        current_ = a;
        done_sent_ = false;
        h_.on_assignment(a);
        return;
      }
      case MsgType::kRestart:
        current_.reset();
        h_.on_restart(proto::from_frame<proto::Restart>(f));
        return;
      case MsgType::kAbort:
        h_.on_abort(proto::from_frame<proto::Abort>(f));
        return;
      case MsgType::kDone:
        h_.on_done();
        return;
      case MsgType::kError:
        return lost(fmt::format("refused by the rendezvous server: {}", proto::from_frame<proto::Error>(f).message));
      default:
        return lost(fmt::format("unexpected message type {} from the rendezvous server", f.type));
    }
  } catch (const proto::ProtocolError& e) {
    lost(e.what());
  }
}

void Client::heartbeat() {
  if (closed_ || !connected()) return;
  conn_->send(proto::to_frame(proto::Heartbeat{round_}));
  heartbeat_timer_.expires_after(std::chrono::milliseconds(opts_.join.keep_alive_ms));
  heartbeat_timer_.async_wait([this](boost::system::error_code ec) {
    if (!ec) heartbeat();
  });
}

void Client::rejoin() {
  if (connected()) conn_->send(proto::to_frame(opts_.join));
}

void Client::worker_failed(const proto::WorkerFailed& f) {
  if (connected()) conn_->send(proto::to_frame(f));
}

void Client::node_done(int round) {
  done_sent_ = true;
  if (connected()) conn_->send(proto::to_frame(proto::NodeDone{round}));
}

void Client::reconnect_later(const std::string& why) {
  if (closed_) return;
  heartbeat_timer_.cancel();
  if (conn_) conn_->close(true);
  conn_.reset();
  deadline_ = std::chrono::steady_clock::now() + std::chrono::milliseconds(opts_.join.join_timeout_ms);
  retry_timer_.expires_after(backoff_);
  backoff_ = std::min(backoff_ * 2, std::chrono::milliseconds(2000));
  retry_timer_.async_wait([this](boost::system::error_code ec) {
    if (!ec) try_connect();
  });
  if (h_.on_notice) h_.on_notice(fmt::format("lost the rendezvous server ({}); workers keep running, reconnecting", why));
}

void Client::lost(const std::string& why) {
  if (!shut(/*flush=*/false)) return;
  if (h_.on_lost) h_.on_lost(why);
}

void Client::close() { shut(/*flush=*/true); }  // flush what is queued (e.g. NodeDone) first

bool Client::shut(bool flush) {
  if (closed_) return false;
  closed_ = true;
  retry_timer_.cancel();
  heartbeat_timer_.cancel();
  boost::system::error_code ec;
  if (connecting_) connecting_->close(ec);
  if (conn_) conn_->close(!flush);
  return true;
}

}  // namespace mg::rdzv
