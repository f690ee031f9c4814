// ClientMachine: the policy of an agent's link to the rendezvous server (rdzv::Client in
// rendezvous/client.h is its effect layer), pure like rdzv::Job: it owns no socket and no
// timer and never reads the clock. Each input is an event with the time passed in (the
// agent's calls, a connection made, refused or closed, a frame received, a timer fired, a
// takeover hosted or not); each returns the commands to perform, in order (connect to X,
// send a frame, arm a timer for T, tell the agent, give up with a reason). So every
// transition is unit-tested with a fake clock (tests/client_machine_test.cc).
//
//   connecting --(refused: connect_retry_delay, within join_timeout)--> connecting
//   connecting --(connected)--> handshake --(Welcome, the key proven)--> welcomed
//   welcomed --(closed, silent past keep-alive x (attempts + 1))--> outage (a daemon):
//       reconnect with a back-off of 100 ms doubling to 2 s, one join_timeout for the
//       whole outage, re-register the round (or the standby) on the next welcome; past
//       join_timeout the node ends on the lost rendezvous (ClientHandlers::on_lost)
//   welcomed --(closed, silent; the host is an agent)--> takeover: the survivors restart
//       and try the last round's candidates (takeover_candidates()) lowest group rank first,
//       one keep-alive interval each, the whole search bounded by keep-alive x attempts; the
//       node that reaches itself hosts (cmd::HostTakeover, answered by hosted()); a standby
//       follows and never hosts; none found, or why_no_takeover(): an Abort with the lost
//       host as root cause (kHostLostExitCode)
//   any --(Error, a bad frame after the welcome, give_up(), close())--> closed
//   Abort and Done are told and only mark the job decided (decided_): the link stays open
//   until the agent's close(), and a host that then closes is no loss (no takeover).
//
// Quorum and fencing (#34; docs/design.md, "Quorum and fencing"): the takeover search waits
// for a candidate that refuses (alive, not noticed yet) and passes over a silent one; the
// seed carries the epoch's voters, which the new host's rdzv::Job counts; a node running a
// round that hears nothing from its rendezvous for fence_after() stops its workers (kFence)
// before the server may drop it; a heartbeat's echo, an assignment and a reconnection's
// accept, proven challenge and welcome are words from it, a refused, reset or closed
// connection is none (a REJECT firewall sends them).
//
// Seeking (#34): an agent that hosts the job (its own server, "home") hears from that server
// that the next round waits for a majority of the voters and that it hears no majority
// (Job::hears_majority(): a node told to restart that still beats keeps it home) through
// host_short_of_majority(). Still without a decision K x A later, it looks for the job elsewhere: the job's former hosts and the last round's
// nodes that could host, then home, in turn, one keep-alive interval each, until
// join_timeout after the shortfall (then it ends, exit 3). A server elsewhere is left for
// (cmd::StopHosting, then a join as a newcomer: its next round or a standby) only when its
// Welcome shows that it runs a round newer than this node's (opened with a majority), or
// that it runs none either and leads a last round (Welcome's last_round_epoch) not older
// than home's: a newer one (a takeover on the other side that lost a node since, whose
// server counts this round's voters and the previous round's), or the same one with its job's epoch lower than
// home's (it precedes: the job's host before a cut precedes a node that took over, and of
// two that took the same round over the lower group rank). A host whose last round is older
// is never left for: one cut off epochs ago counts its own stale voters (review s36 H1). So
// a host with a majority never seeks, and of two minority hosts that reach each other
// exactly one leaves for the other (by last round, then by job's epoch); at home it joins
// its own round (which opens once a minority host that left for it is there).
//
// Recall (#34 H1): a restarted agent with a record of its agent-hosted job (its run, hosts;
// launcher/job_record.h) must not start the job afresh while it runs on elsewhere. start()
// tries the record's hosts in passes (a refused or failed connect, a server that proves
// nothing: the next at once; a silent one after one keep-alive interval) and joins the first
// whose Welcome names the record's run (or, from a server before `run`, shows rounds), as a
// new member. A pass in which every host answered that no host of the run is there (a
// takeover socket's proven NotHosting of no run or another, a Welcome of another run or
// none: a whole job rerun at once) ends it as stale: one line, then cmd::RecallEnded lets
// the agent host as without a record (recall_ended()). Silence and refusals prove nothing
// (a partition, review s38 H1b): past `until` (join_timeout at most) it ends (Lost, exit 3).
#pragma once

#include <algorithm>
#include <array>
#include <chrono>
#include <deque>
#include <cstdint>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "proto/messages.h"
#include "proto/wire.h"
#include "rendezvous/job.h"
#include "rendezvous/record_fields.h"

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

// "HOST:PORT" ("[HOST]:PORT" for an IPv6 address), for messages. Pure.
std::string host_port(const std::string& host, int port);

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

// A decision of the rendezvous for the agent (ClientHandlers), whatever backend brought it:
// the daemon's or a host agent's link (ClientMachine) or etcd's log (EtcdLink).
using Decision = std::variant<proto::Assignment, proto::Restart, proto::Abort, proto::Done, proto::Standby>;
// The decision a frame carries (nullopt: a frame of another type). Throws ProtocolError.
std::optional<Decision> decision_of(const proto::Frame& f);

// The machine's timers: one of each at most is armed (arming again moves it). Each arm has
// a generation, reported back with the fire: a fire of an earlier arm, or of a cancelled one
// (an Asio handler already queued runs with success after cancel() or expires_at()), is
// stale and ignored.
// kMajority: while this node waits for a next round, every keep-alive interval, ask the
// agent whether its own server (if it hosts) hears a majority (cmd::AskMajority).
enum class ClientTimer { kRetry, kHeartbeat, kWatchdog, kTakeover, kFence, kMajority };

// How long a node that runs a round may go without a word from its rendezvous (heard())
// before it stops its workers on its own: half a keep-alive interval before the server drops
// a silent member (this node's keep-alive x attempts), so the majority never runs beside a
// minority that still trains (#34). Pure.
// 0 (no fence) below kMinFenceAttempts attempts: with one or two, the bound falls within
// one or two keep-alive intervals of the last echo, and one late echo would fence the node.
inline constexpr int kMinFenceAttempts = 3;
std::chrono::milliseconds fence_after(int keep_alive_ms, int keep_alive_max_attempt);

// What the effect layer does, in the order given.
namespace cmd {
struct Connect { std::string host; int port = 0; };  // report connected / connect_failed / unresolvable
struct Drop {};                    // close the connection and any connect in flight at once, silently
struct Send { proto::Wire frame; };  // on the connection, if one is open
struct SignSent { std::string session; };  // frames sent from now on carry a MAC under this key
// The handshake is over: verify the server's MACs under `session` (none when empty) and
// accept frames of any size.
struct Welcomed { std::string session; };
// Report timer_fired(timer, generation) at `at`.
struct Arm { ClientTimer timer; Clock::time_point at; std::uint64_t generation = 0; };
struct Cancel { ClientTimer timer; };
struct Shut { bool flush = false; };  // the link ends: every timer, the connection (flushed or at once)
struct Tell { Decision d; };  // for the agent (tell() in rendezvous/client.h)
// The end (on_lost). `unanswered`: nothing answered at host:port; the layer adds
// unanswered_endpoint_hint() when that address is this machine's.
struct Lost { std::string why; bool unanswered = false; std::string host; int port = 0; };
struct Notice { std::string text; };
// This node is next in line to host: ClientHandlers::on_take_over(seed), answered by hosted().
struct HostTakeover { TakeoverSeed seed; };
// This node's own server (it hosts the job) must stop at once, before any other command: the
// job runs elsewhere with a majority, and this node joins it there (Seeking, #34).
struct StopHosting { std::string why; };
struct TakePending {};  // call take_pending() soon (not from within the agent's call)
// Ask the agent whether its own server hears a majority of the job's voters; when it hosts
// and hears none, the answer is host_short_of_majority(). Sent every keep-alive interval
// while this node waits for a next round, so a shortfall whose event came too early (the
// Restart not read yet) or never (no last call below --nnodes' minimum) is heard within K
// (review s37 M).
struct AskMajority {};
// The recall found the job at none of the record's hosts: the agent decides now whether it
// hosts the job (as at any start), and answers with recall_ended().
struct RecallEnded {};
// The recall found the job: the Welcome of `run`'s host. The agent's takeover socket names
// that run from now on ("a node of the run"), not "recalling it": another restarted node's
// recall must not count this one as in no round of it (review s39-late H3).
struct RecallWelcomed { std::string run; };
}  // namespace cmd

using ClientCommand = std::variant<cmd::Connect, cmd::Drop, cmd::Send, cmd::SignSent, cmd::Welcomed, cmd::Arm,
                                   cmd::Cancel, cmd::Shut, cmd::Tell, cmd::Lost, cmd::Notice, cmd::HostTakeover,
                                   cmd::TakePending, cmd::StopHosting, cmd::AskMajority, cmd::RecallEnded,
                                   cmd::RecallWelcomed>;
using ClientCommands = std::vector<ClientCommand>;

class ClientMachine {
 public:
  explicit ClientMachine(ClientOptions opts);

  // The agent's calls.
  // Before start(): the hosts this node's record of the job names (job_hosts() of its
  // agent's last run) and its run; start() tries them first until `until` (Recall, above).
  // `epoch`, the record's: a server of the run whose rounds are all older (a stale host of it)
  // is passed over. `record`: the record's path, which the end past `until` names.
  // `voters`, the record's: its last round's voters (nodes and standbys, this node one of
  // them); > 0: the record is stale once a strict majority of them, this node counted,
  // answered that they run no round of the run (review s39 H1); 0 (an older record): once
  // every host answered so in one pass. `voter_hosts`, the record's: the voters' takeover
  // addresses; only their answers count toward that majority, each once a pass (the endpoint
  // and former hosts are tried, never counted: review s39-late H2); none (an older record):
  // the every-host rule. This node's own takeover address (its Join's addr and takeover
  // port, bound again) is no target: it would count itself twice (review s39-late H1).
  void recall(std::vector<std::pair<std::string, int>> hosts, std::string run, Clock::time_point until,
              int epoch = 0, std::string record = {}, int voters = 0,
              std::vector<std::pair<std::string, int>> voter_hosts = {}, bool self_voter = true);
  ClientCommands start(Clock::time_point now);
  // The answer to cmd::RecallEnded: `hosting`, the agent hosts the job now (its join offers
  // no takeover port); the endpoint is joined.
  ClientCommands recall_ended(bool hosting, Clock::time_point now);
  ClientCommands rejoin(Clock::time_point now);
  void set_master_port(int port) { opts_.join.master_port = port; }
  ClientCommands worker_failed(proto::WorkerFailed f, Clock::time_point now);
  ClientCommands node_done(int round);
  ClientCommands close();             // flushes what is queued (e.g. NodeDone) first
  ClientCommands give_up(const std::string& why);  // ends the link: on_lost(why)

  // The effect layer's reports, about the last cmd::Connect and the connection it made.
  ClientCommands connected(const std::string& nonce, Clock::time_point now);
  ClientCommands connect_failed(bool refused, const std::string& error, Clock::time_point now);
  ClientCommands unresolvable(Clock::time_point now);
  ClientCommands frame(const proto::Frame& f, Clock::time_point now);
  // not by a command; `reset`: the peer reset it (ECONNRESET), as a firewall that REJECTs does
  ClientCommands connection_closed(const std::string& why, Clock::time_point now, bool reset = false);
  // `generation`: the cmd::Arm's; a stale one (re-armed or cancelled since) is ignored.
  ClientCommands timer_fired(ClientTimer t, std::uint64_t generation, Clock::time_point now);
  ClientCommands hosted(const TakeoverHost& where, Clock::time_point now);  // port 0: it cannot host
  ClientCommands take_pending(Clock::time_point now);
  // This node hosts the job and its server's next round waits for a majority (Seeking).
  // Ignored unless this node waits for that round on its own server.
  ClientCommands host_short_of_majority(Clock::time_point now);

  bool closed() const { return closed_; }
  const std::string& host() const { return opts_.host; }  // the server tried now
  int port() const { return opts_.port; }
  bool searching() const { return takeover_.has_value(); }  // for the node that took over
  bool seeking() const { return seek_.has_value() && seek_->started; }  // away from home, or between tries
  bool recalling() const { return recall_.has_value(); }
  bool decided() const { return decided_; }  // the job's end (Abort, Done) was heard from its server
  // The job cannot go on for this node's record (launcher/job_record.h) to be of use: its end
  // was heard (Done, or an Abort that is final: not a minority's "no majority" nor a
  // takeover's shortfall, after which the majority's side may go on), or this node saw its
  // host lost with no survivor able to take over (why_no_takeover()).
  bool job_over() const { return over_; }
  // Why no survivor could take the job over if this node, its host, stopped now
  // (why_no_takeover() for the last round's other nodes); "" when one could or no round ran.
  std::string why_no_takeover_of_self() const;
  // Where the job may be found if this node's agent is restarted (its record): the server it
  // is joined to now, the job's former hosts, then the last round's nodes that could host
  // but this one (lowest group rank first), at most kMaxRecallHosts. Empty unless an agent
  // hosts the job (a daemon or etcd is found again at its own address).
  std::vector<std::pair<std::string, int>> job_hosts() const;
  // The last round's voters (its nodes and the standbys); 0: none. job_self_voter(): this node
  // is one of them (a standby that registered after that round closed is not: its recall
  // does not count itself, review s40-recall M1).
  int job_voters() const;
  int job_voters_epoch() const { return voters_epoch_; }  // their epoch
  // The newest epoch this node was told (the record's: review s41-b L3), >= job_voters_epoch().
  int job_epoch() const { return opts_.join.epoch; }
  bool job_self_voter() const;
  std::vector<std::pair<std::string, int>> job_voter_hosts() const;  // their takeover addresses
  // The five above as they would be once this node took `a` (its own Assignment, not heard
  // yet): the hosting agent's record written before its server sends the round (review s41-a M2).
  RecordFields record_after(const proto::Assignment& a) const;
  RecordFields record_after(const proto::Standby& s) const;  // (its own Standby: review s41-d M1)
  // A copy of this machine as its own server's Welcome (already sent) makes it: host_agent_
  // this agent, welcomed (review s41-e M1).
  ClientMachine own_server_welcomed() const;
  static constexpr std::size_t kMaxRecallHosts = proto::kMaxListedNodes;
  // The generation of t's current arm (what a fire that is not stale carries).
  std::uint64_t generation(ClientTimer t) const { return generation_[static_cast<std::size_t>(t)]; }

 private:
  void try_connect();
  // `silent`: the server went silent (not a closed connection).
  void reconnect_later(const std::string& why, Clock::time_point now, bool silent = false, bool reset = false);
  void failed_attempt(const std::string& why, Clock::time_point now);  // a connection made that proved nothing
  void on_frame(const proto::Frame& f, Clock::time_point now);
  void on_welcome(Clock::time_point now);
  void take(const proto::Assignment& a, Clock::time_point now);  // this node's place in a round: the agent hears it
  void take_standby(proto::Standby m);  // no place in a round: the agent hears it
  void lost(const std::string& why, bool unanswered = false);
  // The agent hosting the rendezvous (host_agent_) is gone: it does not come back, so no
  // reconnection is tried; a survivor takes it over, or the node ends with the lost host as
  // root cause (end_host_lost).
  void host_lost(const std::string& why, Clock::time_point now, bool silent, bool reset);
  void next_candidate(const std::string& why_previous, Clock::time_point now);
  // Waiting to rejoin (Takeover::rejoining): the next target in turn, or a fresh join where
  // another run was found (Takeover::other_host), or the end at the rejoin deadline.
  void next_rejoin_target(Clock::time_point now);
  // Taking over or rejoining, a server's Welcome: false when it names another run than this
  // node's (passed over: the next target), unless this node joins it as a fresh newcomer.
  bool takeover_welcomed(const proto::Welcome& w, Clock::time_point now);
  // A Welcome without a run (a server before #37) from a server whose job ran rounds: the
  // round it runs, its job's epoch or its last round, any above 0 (a build before
  // last_round_epoch sends the first two only). The recall and the takeover search take such
  // a server for the job's; a node waiting to rejoin does not (review s39-late L4). Pure.
  static bool older_server_ran_rounds(const proto::Welcome& w) {
    return w.run.empty() && std::max({w.round_epoch, w.epoch, w.last_round_epoch}) > 0;
  }
  // Rejoining: the server that named another run is tried once more, to be joined afresh.
  void try_fresh(Clock::time_point now);
  // This node leaves its run behind: it joins as a newcomer of none (no run, epoch, voters,
  // group rank or standby place of the old one), with a fresh join_timeout.
  void join_fresh(Clock::time_point now);
  void connect_candidate(const std::string& host, int port, Clock::time_point now);
  void end_seek();  // a decision came (or a loss): no seek, its timer cancelled
  // Seeking: the next of the targets (home after the others), or the end past its deadline.
  void next_seek_target(Clock::time_point now);
  // Seeking ends without a majority found: exit 3, the lost host's root cause with `detail`.
  void end_seek_no_majority(const std::string& detail);
  // Seeking, a server's Welcome: whether to stay on it (home, or a server left for).
  bool seek_welcomed(const proto::Welcome& w, Clock::time_point now);
  // Where the job could be hosted but at home: its former hosts, the last round's nodes
  // that could host but this one.
  std::vector<std::pair<std::string, int>> seek_targets(const std::string& home_host, int home_port) const;
  void end_host_lost(const std::string& reason);
  void drop_connection();  // the connection and any connect in flight, without a notice
  bool shut(bool flush);   // false when already closed
  void send_join();
  void send(proto::Wire w) { out_.push_back(cmd::Send{std::move(w)}); }
  void arm(ClientTimer t, Clock::time_point at) { out_.push_back(cmd::Arm{t, at, new_generation(t)}); }
  void cancel(ClientTimer t) {
    if (t == ClientTimer::kFence) fence_at_.reset();
    new_generation(t);  // a fire already queued is stale
    out_.push_back(cmd::Cancel{t});
  }
  std::uint64_t new_generation(ClientTimer t) { return generation_[static_cast<std::size_t>(t)] = ++generations_; }
  void schedule_heartbeat(Clock::time_point now);
  // The rendezvous answered at `at` (a connection accepted, a proven Challenge, a Welcome,
  // an assignment, the echo of a heartbeat sent at `at`): the fence timer starts again from
  // there, while this node runs a round (#34). A refused, reset or closed connection is no
  // answer (a REJECT firewall sends them).
  void heard(Clock::time_point at);
  // Silent past fence_after(): stop the workers (a Restart for the agent, the round kept for
  // re-registration with a failure report) and wait to rejoin.
  void fence(Clock::time_point now);
  void watch(Clock::time_point now);
  ClientCommands take_out() { return std::exchange(out_, {}); }

  ClientOptions opts_;
  std::string key_;  // the job key; empty without a token
  std::string nonce_, session_;
  ClientCommands out_;                            // of the event being handled
  std::array<std::uint64_t, 6> generation_{};     // of each timer's current arm (ClientTimer)
  std::uint64_t generations_ = 0;                 // the last generation given
  Clock::time_point deadline_;                    // connect attempts give up here
  std::optional<Clock::time_point> waiting_since_;  // joined, no decision yet
  Clock::time_point connected_at_, last_frame_;
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
    std::string tried;   // what each candidate said, for the root cause
    bool asking = false;  // cmd::HostTakeover given, hosted() not heard yet
    // The candidate tried now refused a connect: its machine answers, its agent has not
    // noticed the loss yet; it is waited for (to the search's deadline), not passed over.
    bool refused = false;
    int epoch = 0;                    // the highest this node saw (the seed's)
    std::vector<std::string> voters;  // of that epoch
    std::vector<std::string> prev_voters;  // of the epoch told before it (TakeoverSeed::prev_voters)
    bool host_closed = false;         // the host's connection closed (not silence)
    // The host's connection was reset (not closed: a SIGKILLed host's kernel closes it with
    // an end of file) and some candidate refused a connect during the search: the machines
    // answer, yet nobody took over for this node, as when a REJECT firewall cut this node off
    // (#34). A search that ends so does not end the node: it waits to rejoin (rejoining),
    // until rejoin_deadline. (A dead host and dead candidates on machines that live answer
    // the same way, but close rather than reset: they end the node at once, as before.)
    bool host_reset = false;
    bool refused_any = false;
    // The lost host was not the job's endpoint: a node this one reached by an earlier
    // takeover (or seek). Such a host may have stopped hosting for the job's host elsewhere
    // (Seeking: a minority host that found the majority), which its nodes and standbys never
    // try as a candidate (the endpoint offers no takeover port): a search that ends so waits
    // to rejoin too, the job's former hosts among its targets (review s38, 4).
    bool host_followed = false;
    // Waiting to rejoin: the job's last host (lost_addr:lost_port, which may be only cut off),
    // the candidates but this node and the job's former hosts (job_hosts_) are tried in turn,
    // one keep-alive interval each; this node never hosts; the first server that proves the
    // job's key is joined as a newcomer.
    bool rejoining = false;
    std::string lost_addr;
    int lost_port = 0;
    std::size_t turn = 0;                // the next of the rejoin's targets
    Clock::time_point rejoin_deadline;  // the loss plus join_timeout
    // A server whose Welcome names another run of the job id than this node's (its agent was
    // started again there and hosts a fresh run) is passed over, as the recall does: joined
    // with this node's run and epoch, it would refuse the node (Job::join_of_other_run),
    // while the node's run may go on at a next target (review s38-late M1). The last such
    // server is remembered: when a whole pass of the targets gave a proven answer that none
    // hosts this node's run (each a Welcome of another run or of none, or a takeover socket's
    // proven NotHosting of another run or of none: the recall's rule), this node joins it as
    // a fresh newcomer (join_fresh()). A refused connect (a REJECT firewall refuses too), a
    // silent target, a failed handshake or a NotHosting of this node's own run (a live node
    // of the run: it goes on elsewhere) proves nothing: the node keeps trying, and at
    // rejoin_deadline it ends (review s39 H1: a fresh join then forked the job).
    std::string other_host;
    int other_port = 0;
    bool positive = false;     // the target tried now gave such a proven answer
    bool pass_unsure = false;  // a target of this pass did not
    bool fresh = false;        // the server tried now is joined as a fresh newcomer
    // An older build's server that ran rounds (older_server_ran_rounds()), last seen while
    // rejoining: it cannot show which run it hosts, so it is neither joined nor proof that
    // the run is gone; the end at the deadline names it (review s39-late L4).
    std::string unproven;
  };
  std::optional<Takeover> takeover_;  // looking for the node that took over
  struct Seek {
    std::string home_host;  // this node's own server
    int home_port = 0;
    int home_epoch = 0;     // its job's epoch (its Welcome): the tie-break between minority hosts
    int home_last = 0;      // its last round's epoch (this node's epoch, its Welcome's last_round_epoch)
    std::vector<std::pair<std::string, int>> targets;
    std::size_t turn = 0;
    bool started = false;  // the grace after the shortfall passed
    bool at_home = false;  // the connection tried now is home's
    Clock::time_point deadline;  // the shortfall plus join_timeout
    std::string tried;           // what the servers tried last said, for the end's reason
  };
  std::optional<Seek> seek_;  // this node hosts the job without a majority (Seeking)
  struct Recall {
    std::vector<std::pair<std::string, int>> targets;
    std::string run;              // the record's: a server running it runs the job
    int epoch = 0;                // the record's: a server whose rounds are all older is stale
    Clock::time_point until;      // passes go on until here
    std::size_t turn = 0;         // the next target
    bool pausing = false;         // between two passes
    std::string endpoint_host;    // where a fresh start goes (opts_ before the recall)
    int endpoint_port = 0;
    std::string tried;            // what each target said, this pass
    std::string last;             // the last full pass's
    bool all_positive = true;     // every target of this pass answered that it runs no host of the run
    std::size_t positives = 0;    // how many of this pass did
    int voters = 0;               // the record's (recall())
    bool self_voter = true;       // the record's: this node is one of them, counted itself
    std::vector<std::pair<std::string, int>> voter_hosts;  // the record's: whose answers count
    std::vector<std::pair<std::string, int>> counted;      // those counted this pass
    std::string record;           // the record's path, for the end past `until`
  };
  std::optional<Recall> recall_;  // start() looks for the job at its record's hosts first
  void start_recall(Clock::time_point now);  // from start(): its end no later than join_timeout
  // `positive`: the target tried answered that no host of the record's run is there (a
  // takeover socket's NotHosting of another run or none, a Welcome of another run or none).
  void next_recall_target(Clock::time_point now, const std::string& why_previous = {}, bool positive = false);
  // A takeover socket's NotHosting before any welcome (#34, review s38 M2).
  void not_hosting(const proto::Frame& f, Clock::time_point now);
  void refused_connect(bool refused, const std::string& error, Clock::time_point now);  // connect_failed()'s
  bool recall_welcomed(const proto::Welcome& w, Clock::time_point now);
  // The takeover addresses of the last round's voters (this node's too, or not), in order.
  std::vector<std::pair<std::string, int>> voter_addresses(bool with_self) const;  // false: not the job's run
  // The Standby or (else) the Assignment that voter_addresses() reads: the voters' epoch's.
  std::pair<const proto::Standby*, const proto::Assignment*> voters_message() const;
  // The hosts this node knew the job at (the endpoint, each host lost since), at most kMaxHosts.
  std::vector<std::pair<std::string, int>> job_hosts_;
  static constexpr std::size_t kMaxHosts = 8;
  int welcome_epoch_ = 0;  // the last Welcome's job epoch
  int welcome_last_round_ = 0;  // the last Welcome's last_round_epoch
  bool decided_ = false;  // the job ended (Abort or Done heard): its host may go
  bool over_ = false;     // job_over()
  std::string host_agent_;  // the Welcome's: the server is built into that agent (empty: a daemon)
  // Reported, no decision heard since: sent again with every re-registration of the round,
  // since a connection that closed may have taken it along unsent (the job ignores a repeat).
  std::optional<proto::WorkerFailed> unanswered_failure_;
  bool done_sent_ = false;
  bool standby_ = false;  // told Standby, no assignment since: said again on re-registering
  bool fenced_ = false;   // stopped its workers on the fence timer; the round's decision not heard yet
  std::optional<Clock::time_point> fence_at_;  // when the armed fence fires (none armed: nullopt)
  // When each heartbeat not echoed yet went out on this connection, oldest first (heard()).
  std::deque<Clock::time_point> beats_;
  static constexpr std::size_t kMaxBeats = 64;
  bool unfenced_told_ = false;  // the no-fence notice (keep_alive_max_attempt < 3) was given
  std::vector<std::string> voters_;  // of the last epoch told (Assignment, Standby)
  int voters_epoch_ = 0;                  // that epoch
  std::vector<std::string> prev_voters_;  // of the epoch told before it (joint majority, #34)
  // A new epoch's voters: the last ones become the previous (the same epoch told again, as a
  // standby is at every round, only replaces them).
  void learn_voters(int epoch, const std::vector<std::string>& voters);
  // A message of another run (or a fresh start): the voters above are the old run's, counted
  // or recorded for none of the new one's, whose epochs count from 1 again (review s41-b L6).
  void forget_voters();
  bool two_voters_told_ = false;     // the two-voter notice was given
  bool old_server_told_ = false;     // an assignment without an epoch (a server before #34) was said
  std::chrono::milliseconds backoff_{100};  // between reconnects after a loss
  int refused_ = 0;  // refused connects in a row at start (connect_retry_delay)
  bool closed_ = false;
  bool connected_ = false;      // a connection is open (from connected() to its close)
  bool challenged_ = false;
  bool welcomed_ = false;       // this connection completed the handshake
  bool answered_ = false;       // this connection brought a frame
  bool joined_early_ = false;   // this connection sent its join with the hello (no token)
  bool ever_welcomed_ = false;  // some connection did
  bool in_outage_ = false;      // lost a welcomed connection, not welcomed again yet
};

}  // namespace mg::rdzv
