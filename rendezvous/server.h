// Server: the rendezvous daemon's core, embeddable in an agent. One acceptor, a session
// per connection (handshake with optional HMAC-SHA256 challenge, then job messages),
// many jobs keyed by rdzv id, and a 100 ms tick that drives the jobs' timers. Runs on the
// caller's io_context; stop() closes everything.
#pragma once

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <string>

#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/steady_timer.hpp>

#include "rendezvous/connection.h"
#include "rendezvous/job.h"

namespace mg::rdzv {

struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 0;
  std::string token;  // empty: no authentication
  std::size_t max_connections = 20000;
  int max_nodes_per_job = 100000;
  std::size_t max_frame = proto::kDefaultMaxFrame;
  std::chrono::milliseconds handshake_timeout{10000};
  std::chrono::milliseconds idle_job_expiry{3600 * 1000};
  std::chrono::milliseconds tick{100};
  std::function<void(const std::string&)> log;  // one line per event; may be empty
};

class Server {
 public:
  // Binds and listens at once; throws std::runtime_error naming the address on failure.
  Server(boost::asio::io_context& io, ServerOptions opts);
  ~Server();
  int port() const { return port_; }
  std::string address() const;
  // Stops accepting and closes every connection; with `flush`, after its queued frames
  // (a decision just broadcast) are written.
  void stop(bool flush = false);

 private:
  struct Session;
  void accept();
  void on_frame(const std::shared_ptr<Session>& s, const proto::Frame& f);
  void on_close(const std::shared_ptr<Session>& s, const std::string& why);
  void apply(const Actions& actions);
  void tick();
  void log(const std::string& line) const;

  boost::asio::io_context& io_;
  ServerOptions opts_;
  boost::asio::ip::tcp::acceptor acceptor_;
  boost::asio::steady_timer ticker_;
  int port_ = 0;
  bool stopped_ = false;
  SessionId next_id_ = 1;
  std::map<SessionId, std::shared_ptr<Session>> sessions_;
  std::map<std::string, Job> jobs_;
};

}  // namespace mg::rdzv
