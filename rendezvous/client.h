// Client: an agent's link to the rendezvous server. Connects (retrying while the server
// comes up, bounded by the join timeout), proves the job's key and checks the server's
// proof (an agent holding a token never talks to a server that cannot prove it), joins,
// sends heartbeats and watches their echo, and turns server messages into handler calls
// on the agent's io_context. A failure report or a "done" that could not be sent while the
// server was away is replayed when the node re-registers.
//
// A server built into an agent (Welcome::host_agent) does not come back once lost. The
// survivors then take it over (#26): the next round is a restart (delivered as one), hosted
// by the lowest live node by group rank of the last round (takeover_candidates()): each
// survivor tries those below itself in that order, one keep-alive interval each, and hosts
// itself when none answered (ClientHandlers::on_take_over); the whole search is bounded by
// keep-alive x attempts. A standby follows too: its Standby messages list the running
// round's candidates (kept current: sent again whenever a round closes); it tries them in
// the same order, never hosts, and re-registers as a standby (Join::resume_standby) with
// the node that took over, which gives it a place the survivors leave free at once. The
// survivors join with their last group rank (Join::last_group_rank), which the new host
// keeps. Where no takeover is possible (why_no_takeover(): the job's standbys count
// towards --nnodes' minimum, as Heartbeat::standbys tells them) or none succeeds in time,
// the node ends with the lost host as root cause (kHostLostExitCode). The new host proves
// the job's key like any server: no node obeys one that cannot.
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
#include "rendezvous/job.h"

namespace mg::rdzv {

struct ClientOptions {
  std::string host;
  int port = 0;
  std::string token;      // the daemon token (the job key is derived from it), or
  proto::Join join;       // sent on start() and on every rejoin()
  std::string job_token;  // the job's own key (mglaunch-rdzv --job-token); wins when set
};

// Where a node that took a job over listens: its advertised name may resolve here to another
// address than it bound (Debian's 127.0.1.1 for the host name), so it joins itself here.
struct TakeoverHost {
  std::string host;
  int port = 0;
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
  // This node is next in line to host the job after its host was lost: serve it from the
  // seed (Server::take_over) and return where it listens (port 0: it cannot, the next
  // node is tried; an empty host: at its advertised address). Empty: this node never hosts.
  std::function<TakeoverHost(const TakeoverSeed&)> on_take_over;
};

// Takeover: who hosts a job after its hosting agent was lost. Pure.
struct TakeoverCandidate {
  int group_rank = 0;
  std::string addr;
  int port = 0;
};
// The nodes of round `a` that advertised a takeover port, by group rank, without the lost
// host at lost_addr:lost_port (after a first takeover, the lost host is one of them): the
// order in which every survivor tries them.
std::vector<TakeoverCandidate> takeover_candidates(const std::vector<std::string>& nodes,
                                                   const std::vector<int>& takeover_ports,
                                                   const std::string& lost_addr, int lost_port);
inline std::vector<TakeoverCandidate> takeover_candidates(const proto::Assignment& a, const std::string& lost_addr,
                                                          int lost_port) {
  return takeover_candidates(a.nodes, a.takeover_ports, lost_addr, lost_port);
}
// Why the job cannot go on after losing its host (empty when a takeover may be tried): no
// restart left, no node that can host, fewer candidates and standbys than --nnodes' minimum.
std::string why_no_takeover(int restarts_spent, int max_restarts, std::size_t candidates, int standbys,
                            int min_nodes);

// Hints for a rendezvous endpoint that does not work, each one line saying what to do. Pure.
// Nothing answers (connection refused) at `host`, one of this machine's own addresses
// (`own_address`) that is not loopback: no agent here hosts it, since an agent hosts only at
// the address it advertises. Empty when the endpoint is not this machine's or is loopback.
std::string unanswered_endpoint_hint(const std::string& host, int port, bool own_address, bool loopback);
// Something answered at host:port and closed the connection (or spoke another protocol)
// before any welcome: another program may hold that port.
std::string foreign_server_hint(const std::string& host, int port);

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
  void take(const proto::Assignment& a);  // this node's place in a round: the agent hears it
  void lost(const std::string& why);
  // The agent hosting the rendezvous (host_agent_) is gone: it does not come back, so no
  // reconnection is tried; a survivor takes it over, or the node ends with the lost host as
  // root cause (end_host_lost).
  void host_lost(const std::string& why);
  void next_candidate(const std::string& why_previous);
  void end_host_lost(const std::string& reason);
  void drop_connection();  // the connection and any connect in flight, without a notice
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
  std::optional<proto::Assignment> last_;  // the last round assigned (kept through restarts)
  std::optional<proto::Standby> standby_of_;  // told while a standby: the round's takeover candidates
  int standbys_ = 0;  // the job's standby nodes, as last told (Assignment, Heartbeat)
  int restarts_seen_ = 0;  // the highest restart count heard (or spent on a takeover)
  // The agent asked to be in the next round (start, rejoin); false from a Restart until
  // rejoin(). An assignment that comes before (a join sent on reconnecting) waits in
  // pending_ for rejoin(): the agent takes one only once its workers stopped.
  bool join_wanted_ = true;
  std::optional<proto::Assignment> pending_;
  struct Takeover {
    std::vector<TakeoverCandidate> candidates;
    std::size_t next = 0;
    Clock::time_point deadline;
    std::string lost;   // "rendezvous host H (EP) lost: WHY"
    std::string lost_host;
    int restart_count = 0;
    int round = 0;       // the last round (the seed's)
    int self_rank = -1;  // this node's group rank in it; -1: a standby, which never hosts
    int listed = 0;      // nodes listed in that round
    std::string tried;  // what each candidate said, for the root cause
  };
  std::optional<Takeover> takeover_;  // looking for the node that took over
  bool decided_ = false;  // the job ended (Abort or Done heard): its host may go
  boost::asio::steady_timer takeover_timer_;
  std::uint64_t connect_gen_ = 0;  // a connect whose generation is stale is ignored
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
  bool answered_ = false;       // this connection brought a frame
  bool joined_early_ = false;   // this connection sent its join with the hello (no token)
  bool ever_welcomed_ = false;  // some connection did
  bool in_outage_ = false;      // lost a welcomed connection, not welcomed again yet
  // Callbacks of a connection that outlives this client (graceful close) check this.
  std::shared_ptr<int> alive_ = std::make_shared<int>(0);
};

}  // namespace mg::rdzv
