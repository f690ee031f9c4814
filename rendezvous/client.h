// Client: an agent's link to the rendezvous server. Its policy is ClientMachine
// (rendezvous/client_machine.h, pure, tested with a fake clock); this is the effect layer
// that feeds it and performs its commands with Asio sockets and timers. Connects (retrying
// while the server comes up, bounded by the join timeout), proves the job's key and checks the server's
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

#include <functional>
#include <memory>
#include <string>

#include <boost/asio/io_context.hpp>
#include <boost/asio/steady_timer.hpp>

#include "proto/messages.h"
#include "rendezvous/client_machine.h"
#include "rendezvous/connection.h"
#include "rendezvous/job.h"
#include "rendezvous/lookup.h"

namespace mg::rdzv {

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
  // This node hosts the job without a majority and found it running elsewhere with one: stop
  // its own server now (ClientMachine's Seeking, #34). Empty: this node never hosts.
  std::function<void(const std::string&)> on_stop_hosting;
  // Whether this node's own server hears a majority of the job's voters (true: it hosts
  // nothing, or its job runs): asked every keep-alive interval while the node waits for a
  // next round (cmd::AskMajority). Empty: this node never hosts.
  std::function<bool()> hears_majority;
  // The recall found the job at none of the hosts of this node's record (ClientMachine's
  // Recall, #34 H1): the agent decides now whether it hosts the job, as at any start, and
  // says whether it does. Empty: it does not.
  std::function<bool()> on_recall_ended;
  // The recall found the job: `run`'s host welcomed this node, which joins it there
  // (cmd::RecallWelcomed). May be empty.
  std::function<void(const std::string&)> on_recall_welcomed;
};

// Calls the handler of `d`: the one dispatch of every backend's decisions (on_standby may
// be empty).
void tell(const ClientHandlers& h, const Decision& d);

class Client {
 public:
  Client(boost::asio::io_context& io, ClientOptions opts, ClientHandlers handlers);
  ~Client();
  // Before start(): look for the job at the hosts of this node's record first (Recall).
  void recall(std::vector<std::pair<std::string, int>> hosts, std::string run, Clock::time_point until,
              int epoch = 0, std::string record = {}, int voters = 0,
              std::vector<std::pair<std::string, int>> voter_hosts = {}, bool self_voter = true) {
    m_.recall(std::move(hosts), std::move(run), until, epoch, std::move(record), voters, std::move(voter_hosts),
              self_voter);
  }
  void start();
  void rejoin();
  // The master port offered in later joins (a fresh one for each round).
  void set_master_port(int port) { m_.set_master_port(port); }
  void worker_failed(proto::WorkerFailed f);
  void node_done(int round);
  // This node's own server's next round waits for a majority (JobEvent::Kind::kNoQuorum).
  void host_short_of_majority();
  void close();
  std::vector<std::pair<std::string, int>> job_hosts() const { return m_.job_hosts(); }
  int job_voters() const { return m_.job_voters(); }
  int job_voters_epoch() const { return m_.job_voters_epoch(); }
  int job_epoch() const { return m_.job_epoch(); }
  bool job_self_voter() const { return m_.job_self_voter(); }
  std::vector<std::pair<std::string, int>> job_voter_hosts() const { return m_.job_voter_hosts(); }
  std::optional<RecordFields> record_after(const proto::Assignment& a) const { return m_.record_after(a); }
  std::optional<RecordFields> record_after(const proto::Standby& s) const { return m_.record_after(s); }
  bool job_decided() const { return m_.job_over(); }
  std::string why_no_takeover_of_self() const { return m_.why_no_takeover_of_self(); }
  bool connected() const { return conn_ && conn_->open(); }
  int connect_attempts() const { return connect_attempts_; }  // since start(), refused ones included

 private:
  void run(ClientCommands cmds);  // performs the machine's commands, in order
  void perform(ClientCommand& c);
  void connect(const std::string& host, int port);
  void connect_to(const boost::asio::ip::tcp::endpoint& ep);  // connect() once the address is known
  void on_connected();
  boost::asio::steady_timer& timer(ClientTimer t);

  boost::asio::io_context& io_;
  ClientMachine m_;
  ClientHandlers h_;
  std::shared_ptr<FramedConnection> conn_;
  std::unique_ptr<boost::asio::ip::tcp::socket> connecting_;
  boost::asio::steady_timer retry_timer_, heartbeat_timer_, watchdog_, takeover_timer_, fence_timer_, majority_timer_;
  Lookups lookups_;  // the server's name, off the io thread
  struct Dialled {
    std::string host;
    std::vector<boost::asio::ip::tcp::endpoint> found;  // its addresses, as looked up for the last connect
  } dialled_;
  std::uint64_t connect_gen_ = 0;  // a connect whose generation is stale is ignored
  int connect_attempts_ = 0;
  bool agent_closed_ = false;  // close() was called: a refusal start() posted is not told
  // Inside run(): a connection's close (a send that fails shuts it at once) is reported after
  // the list, not in its middle, so the rest of the list never runs on a machine moved on.
  int running_ = 0;
  // Callbacks of a connection that outlives this client (graceful close) check this.
  std::shared_ptr<int> alive_ = std::make_shared<int>(0);
};

}  // namespace mg::rdzv
