// Client: an agent's link to the rendezvous server. Connects (retrying while the server
// comes up, bounded by the join timeout), proves the job's key and checks the server's
// proof (an agent holding a token never talks to a server that cannot prove it), joins,
// sends heartbeats and watches their echo, and turns server messages into handler calls
// on the agent's io_context. A failure report or a "done" that could not be sent while the
// server was away is replayed when the node re-registers.
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
  std::string token;      // the daemon token (the job key is derived from it), or
  proto::Join join;       // sent on start() and on every rejoin()
  std::string job_token;  // the job's own key (mglaunch-rdzv --job-token); wins when set
};

struct ClientHandlers {
  std::function<void(const proto::Assignment&)> on_assignment;
  std::function<void(const proto::Restart&)> on_restart;
  std::function<void(const proto::Abort&)> on_abort;
  std::function<void()> on_done;
  // The round is full: this node waits as a standby until an assignment or the job's end.
  std::function<void(const proto::Standby&)> on_standby;
  std::function<void(const std::string&)> on_lost;  // refused, or unreachable past join_timeout
  std::function<void(const std::string&)> on_notice;  // connection dropped / re-registered
};

// The exit code an agent ends with when the agent hosting its rendezvous is lost and the
// job cannot go on (exit_code::kRendezvous in cli/errors.h; README, "Exit codes").
inline constexpr int kHostLostExitCode = 3;

// The wait before the `retry`-th new attempt (1, 2, ...) to reach a server that refused the
// connection (nothing listens yet). The agents of a job start together and the host listens
// moments after its own start, so the first retries come within a few milliseconds; the
// wait then grows by half each time, to 500 ms, so a host that is late costs little.
std::chrono::milliseconds connect_retry_delay(int retry);

class Client {
 public:
  Client(boost::asio::io_context& io, ClientOptions opts, ClientHandlers handlers);
  ~Client();
  void start();
  void rejoin();
  // The master port offered in later joins (a fresh one for each round).
  void set_master_port(int port) { opts_.join.master_port = port; }
  void worker_failed(proto::WorkerFailed f);
  void node_done(int round);
  void close();
  bool connected() const { return conn_ && conn_->open(); }
  int connect_attempts() const { return connect_attempts_; }  // since start(), refused ones included

 private:
  using Clock = std::chrono::steady_clock;
  void try_connect();
  void reconnect_later(const std::string& why);
  void failed_attempt(const std::string& why);  // a connection made that proved nothing
  void on_frame(const proto::Frame& f);
  void on_welcome();
  void lost(const std::string& why);
  // The agent hosting the rendezvous (host_agent_) is gone: it does not come back, so no
  // reconnection is tried; the node ends with the lost host as root cause.
  void host_lost(const std::string& why);
  bool shut(bool flush);  // false when already closed
  void send_join();
  void heartbeat();
  void schedule_heartbeat();
  void watch();
  void wait_for_decision();

  boost::asio::io_context& io_;
  ClientOptions opts_;
  ClientHandlers h_;
  std::string key_;  // the job key; empty without a token
  std::string nonce_, session_;
  std::shared_ptr<FramedConnection> conn_;
  std::unique_ptr<boost::asio::ip::tcp::socket> connecting_;
  boost::asio::steady_timer retry_timer_, heartbeat_timer_, watchdog_;
  Clock::time_point deadline_;                    // connect attempts give up here
  std::optional<Clock::time_point> waiting_since_;  // joined, no decision yet
  Clock::time_point connected_at_;
  int round_ = 0;
  std::optional<proto::Assignment> current_;  // the round this node runs, for re-registration
  bool assigned_ = false;  // some round was assigned to this node
  std::string host_agent_;  // the Welcome's: the server is built into that agent (empty: a daemon)
  std::optional<proto::WorkerFailed> unsent_failure_;
  bool done_sent_ = false;
  bool standby_ = false;  // told Standby, no assignment since: said again on re-registering
  std::chrono::milliseconds backoff_{100};          // between reconnects after a loss
  int refused_ = 0;  // refused connects in a row at start (connect_retry_delay)
  int connect_attempts_ = 0;
  bool closed_ = false;
  bool challenged_ = false;
  bool welcomed_ = false;       // this connection completed the handshake
  bool joined_early_ = false;   // this connection sent its join with the hello (no token)
  bool ever_welcomed_ = false;  // some connection did
  bool in_outage_ = false;      // lost a welcomed connection, not welcomed again yet
  // Callbacks of a connection that outlives this client (graceful close) check this.
  std::shared_ptr<int> alive_ = std::make_shared<int>(0);
};

}  // namespace mg::rdzv
