// Client: an agent's link to the rendezvous server. Connects (retrying while the server
// comes up, bounded by the join timeout), answers the token challenge, joins, sends
// heartbeats, and turns server messages into handler calls on the agent's io_context.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include <boost/asio/io_context.hpp>
#include <boost/asio/steady_timer.hpp>

#include "proto/messages.h"
#include "rendezvous/connection.h"

namespace mg::rdzv {

struct ClientOptions {
  std::string host;
  int port = 0;
  std::string token;
  proto::Join join;  // sent on start() and on every rejoin()
};

struct ClientHandlers {
  std::function<void(const proto::Assignment&)> on_assignment;
  std::function<void(const proto::Restart&)> on_restart;
  std::function<void(const proto::Abort&)> on_abort;
  std::function<void()> on_done;
  std::function<void(const std::string&)> on_lost;  // refused, or unreachable past join_timeout
  std::function<void(const std::string&)> on_notice;  // connection dropped / re-registered
};

class Client {
 public:
  Client(boost::asio::io_context& io, ClientOptions opts, ClientHandlers handlers);
  ~Client();
  void start();
  void rejoin();
  void worker_failed(const proto::WorkerFailed& f);
  void node_done(int round);
  void close();
  bool connected() const { return conn_ && conn_->open(); }

 private:
  void try_connect();
  void reconnect_later(const std::string& why);
  void on_frame(const proto::Frame& f);
  void lost(const std::string& why);
  bool shut(bool flush);  // false when already closed
  void heartbeat();

  boost::asio::io_context& io_;
  ClientOptions opts_;
  ClientHandlers h_;
  std::shared_ptr<FramedConnection> conn_;
  std::unique_ptr<boost::asio::ip::tcp::socket> connecting_;
  boost::asio::steady_timer retry_timer_, heartbeat_timer_;
  std::chrono::steady_clock::time_point deadline_;
  int round_ = 0;
  std::optional<proto::Assignment> current_;  // the round this node runs, for re-registration
  bool done_sent_ = false;
  std::chrono::milliseconds backoff_{100};          // between reconnects after a loss
  std::chrono::milliseconds connect_backoff_{10};  // between refused connects at start
  bool closed_ = false;
  bool welcomed_ = false;
  // Callbacks of a connection that outlives this client (graceful close) check this.
  std::shared_ptr<int> alive_ = std::make_shared<int>(0);
};

}  // namespace mg::rdzv
