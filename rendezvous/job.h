// Job: the rendezvous state machine of one rdzv id, driven by messages and by tick(now)
// with the time passed in, so every transition is unit-tested with a fake clock. It owns
// no I/O: each call returns the frames to send, addressed by the server's session ids.
//
//   joining --(max nodes, or min nodes and last_call_timeout)--> running
//   running --(worker failed | node lost)--> restarting (restarts left) | failed
//   running --(a new node while below max)--> restarting (scale-up, restart count kept)
//   restarting --(survivors re-join)--> running
//   running --(every node done)--> done
//
// Standbys: a node that joins while the round is full (max nodes running, or the nodes
// told to restart fill it) is told Standby and kept, registered and heartbeating, until a
// place frees or the job ends. A restart (a node lost, a worker failed) takes standbys,
// the first arrived first, into the next round at once, as many as it has free places, so
// the round closes the moment the survivors re-joined (max reached, no last call). Every
// round after the first keeps the group ranks of the nodes that stay (their relative order
// when the round shrinks); the freed places go to standbys and newcomers. Done and Abort
// reach the standbys too. A standby is told Standby again whenever a round closes without
// it (the round's takeover candidates, for following a takeover), and the running nodes
// hear the standby count (Heartbeat::standbys) when it changes, so that survivors of the
// hosting agent's loss count the standbys (rendezvous/client.h).
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "proto/messages.h"
#include "proto/wire.h"

namespace mg::rdzv {

using Clock = std::chrono::steady_clock;
using SessionId = std::uint64_t;

// The exit code of every node of a job that ends because the agent hosting its rendezvous
// was lost (exit_code::kRendezvous in cli/errors.h; README, "Exit codes").
inline constexpr int kHostLostExitCode = 3;

// Who a reported failure is, in the words users read (restart lines, the daemon's log):
// "rank R on HOST"; a node that failed as a whole (stopped by a signal, cut off) has no
// rank: "node HOST". Pure.
std::string failed_who(const proto::WorkerFailed& f);
// The restart's or abort's reason for it: "rank R on HOST exited with CODE"; for a node as
// a whole its own message (which names it) with the code, else "node HOST exited with CODE".
std::string failure_text(const proto::WorkerFailed& f);

// What a survivor that takes over hosting a job knows of it (rendezvous/client.h): the
// round that ran, the restart its loss costs, and why.
struct TakeoverSeed {
  int round = 0;          // the last round assigned
  int restart_count = 0;  // of the next round (the lost host spends one restart)
  std::string reason;     // "rendezvous host H (ENDPOINT) lost: WHY"
  std::string lost_host;  // H
  Clock::time_point deadline;  // the survivors re-join by then, or the job fails
  // The last round's nodes expected to re-join (the new host included): their places are
  // kept from standbys until they joined or the deadline passed.
  int survivors = 0;
  // The last round's size: only a join claiming a group rank below it (Join::last_group_rank),
  // not claimed by another node yet, takes one of those kept places. 0: not known (any rank).
  int world_size = 0;
  // The highest epoch the new host has seen (its next round's is higher), and the voters of
  // that epoch (Assignment::voters): the round the new host opens needs a majority of them
  // among its joins (#34). Empty: none known, no majority asked.
  int epoch = 0;
  std::vector<std::string> voters{};
  // The voters of the epoch before that one, as the new host was told them (empty: none):
  // the new host's round needs a majority of them too (joint majority, see Job::has_quorum).
  std::vector<std::string> prev_voters{};
  // The new host saw its host's connection close (the host's machine answered: its agent is
  // gone, not cut off), not go silent. With two voters that is enough for the survivor to
  // go on alone; after silence it is not (docs/multinode.md, "Network partitions").
  bool host_closed = false;
  // The new host's group rank in the seed's round: its epochs are its own (takeover_epoch()).
  int host_rank = 0;
  // The job's run (Assignment::run): the new host's job keeps it, so both sides of a split
  // share one run and their epochs compare (#37). Empty: not told (the new host's own).
  std::string run{};
};

// Epochs after a takeover jump to a block of kEpochBlock of their own: the new host's first
// epoch is takeover_epoch(seed's epoch, its group rank in that round), at least two blocks
// past the seed's, offset by its rank. So two hosts never mint the same epoch: the lost host
// (cut off, not dead) counts on by one from the seed's epoch, within its block for fewer than
// kEpochBlock rounds; two nodes that each took over the same round differ by their ranks
// (below kMaxListedNodes); a later takeover lands two blocks further on (#34). Pure.
inline constexpr int kEpochBlock = 65536;
int takeover_epoch(int seed_epoch, int host_rank);

// A new rendezvous run (proto::run_problem(): "MS-HEX"), minted once where a job's Job is
// first created (the server of an agent or the daemon, the etcd log's first record) and
// carried from there (#37). mint_run is pure; new_run() reads the wall clock and
// std::random_device. Runs are ordered by their wall clock: hosts whose clocks differ by
// more than the time between two runs of a job may order them wrongly (docs/mgtrain.md).
std::string mint_run(std::int64_t unix_ms, std::uint64_t random);
std::string new_run();
// Run `a` was minted before run `b` (by MS, then HEX, as numbers; runs checked by
// proto::run_problem()). mgtrain orders checkpoints' runs the same way (worker/options.cc
// run_before(); rendezvous may not include worker/, so the rule is written twice).
bool run_older(const std::string& a, const std::string& b);

// A message for one session. Broadcasts share one encoding (proto::Wire), so a decision
// for N nodes holds its bytes once.
struct Outgoing {
  SessionId session = 0;
  proto::Wire frame;
};
using Actions = std::vector<Outgoing>;

// What happened to a job, for an operator: the daemon's log lines (text, or one JSON object
// each with --json-log), the status page's events and the --state-dir journal. The job
// records them as it acts, beside its actions; the caller takes them after each call
// (Job::take_events()), so every backend (the daemon, an agent's in-process host, the etcd
// replay) gets the same events and a fake-clock test sees them.
struct JobEvent {
  enum class Kind {
    kCreated,       // the first join: the node (host, addr, agent), min/max nodes, max restarts
    kJoined,        // a node joined the next round; how: "new", "survivor" (re-joined after a
                    // restart), "re-registered" (its round, after a rendezvous server restart)
    kStandby,       // a node registered as a standby (position: its place in the queue)
    kRoundStarted,  // round, restart_count, nodes, world_size, members ("HOST (ADDR)" by group rank)
    kWorkerFailed,  // a node reported a failed worker: rank, exit_code, signal, why
    kNodeLost,      // cause ("connection closed", "heartbeat timeout", "not re-registered"), why
    kStandbyLost,   // a standby left or was dropped: why
    kRestart,       // restart_count of max_restarts, why (the cause); a scale-up spends none
    kPromoted,      // a standby took a place in the next round; replaces: the host lost, if any
    kTakeover,      // a survivor took the job over after its hosting agent (host) was lost: why
    kDone,          // every node finished: round, restart_count, nodes
    kFailed,        // the job failed: why (the root cause), host, rank, exit_code
    kNoQuorum,      // the next round waits for a majority of the voters: nodes (joined voters), voters (#34)
  };
  Kind kind = Kind::kCreated;
  std::string job;
  std::string host, addr, agent;  // the node the event is about (may be empty)
  int round = 0, restart_count = 0, max_restarts = 0;
  int min_nodes = 0, max_nodes = 0;
  int nodes = 0;
  long long world_size = 0;
  std::vector<std::pair<std::string, std::string>> members;  // kRoundStarted: (host, addr), at most kListedMembers
  int position = 0;
  int voters = 0;  // kNoQuorum: the epoch's voters (nodes: those that joined)
  bool previous_voters = false;  // kNoQuorum: the voters counted are the epoch before's (joint majority)
  int rank = -1, exit_code = 0, signal = 0;
  std::string how, cause, why, replaces;
  // The job's run (Job::run()); in the json of kCreated, kRoundStarted, kTakeover and a
  // re-registered kJoined, so that a restarted daemon's --state-dir keeps it (review s38 M1).
  // Not while the run is open (Job::open_run(): not yet settled, review s38-late M2). With
  // the run, its epoch (Job::epoch(): the highest the job has seen), review s38-late H1.
  std::string run;
  int epoch = 0;

  static constexpr std::size_t kListedMembers = 8;
};
// "created", "joined", "standby", "round_started", "worker_failed", "node_lost",
// "standby_lost", "restart", "promoted", "takeover", "done", "failed", "no_quorum".
const char* kind_name(JobEvent::Kind k);
// (These three: rendezvous/job_events.cc.) The event as one line of text ("job 'J': node H (A, agent X) lost: WHY").
std::string text_of(const JobEvent& e);
// The event's fields: {"event": kind_name, "job": J, ...}, only those the kind has.
nlohmann::json json_of(const JobEvent& e);

class Job {
 public:
  enum class State { kJoining, kRunning, kRestarting, kDone, kFailed };

  // `quorum`: the job is hosted by one of its own agents (not a daemon or etcd, arbiters
  // apart from the nodes), so a new round after nodes were lost needs a majority of the
  // voters (#34; docs/multinode.md, "Network partitions").
  // `run`: the rendezvous run minted for this job (new_run()); a job taken over keeps the
  // seed's, a rebuilt one its nodes' (run()).
  explicit Job(std::string id, bool quorum = false, std::string run = {})
      : id_(std::move(id)), quorum_(quorum), run_(std::move(run)) {}
  // The agent id of the agent this job's server is built into (ServerOptions::host_agent_id):
  // only its Join's vote_port is the round's host vote address (review s41-b M1: a former
  // host's stale one is not). Empty (a daemon): none is.
  void set_host_agent_id(std::string id) { host_agent_id_ = std::move(id); }
  // The session of that agent's Join (a member, joined or a standby); 0: none (review s41-d M1).
  SessionId host_agent_session() const;

  Actions join(SessionId s, const proto::Join& j, Clock::time_point now);
  Actions heartbeat(SessionId s, Clock::time_point now);
  Actions worker_failed(SessionId s, const proto::WorkerFailed& f, Clock::time_point now);
  Actions node_done(SessionId s, int round, Clock::time_point now);
  // `why` ends the root cause "node H (A) lost: WHY" (the etcd backend: a lease expired).
  Actions disconnected(SessionId s, Clock::time_point now, std::string_view why = "its connection closed");
  // The node of session `s` was declared lost (disconnected()) while the job was `before`:
  // when that was a running round, it is told what a silent member the server drops is told
  // (tick()): Restart when the job goes on without it (it stops its workers and joins again),
  // the job's Abort when it failed; else nothing. For the etcd backend, which tells its own
  // agent (#34).
  Actions tell_lost(SessionId s, State before) const;
  // Closes a round after last call, detects silent nodes, expires a join that waits too long.
  Actions tick(Clock::time_point now);
  // Makes this new job go on from the round its lost hosting agent ran: the next round is
  // restart seed.restart_count for the nodes that join (the survivors, keeping their group
  // ranks: Join::last_group_rank) and the standbys that follow (Join::resume_standby), which
  // take the places the survivors leave free at once; with fewer than min nodes joined at
  // seed.deadline it fails with seed.reason as root cause (exit kHostLostExitCode
  // everywhere). A node that claims no rank of that round, or one another node claimed
  // first, joins as a newcomer: it takes no survivor's kept place. Call before any join.
  void take_over(const TakeoverSeed& seed, Clock::time_point now);

  State state() const { return state_; }
  int restart_count() const { return restart_count_; }
  int round() const { return round_; }
  // The epoch of the running (or last) round: one more at every round, never less than any
  // a joining node reported (Join::epoch), so it grows across a takeover and a daemon restart.
  int epoch() const { return epoch_; }
  // The epoch of the round running now; 0 while none runs (joining, restarting, waiting for
  // a majority, ended): proto::Welcome::round_epoch (#34).
  int running_epoch() const { return state_ == State::kRunning ? epoch_ : 0; }
  // The epoch of the last round this job opened, or (taken over, its first round not closed)
  // the seed's: the round whose takeover or restart this host leads. Two hosts without a
  // majority are peers of one cut only when theirs are equal (proto::Welcome, review s36 H1).
  int last_round_epoch() const { return last_round_epoch_; }
  // The rendezvous run (proto::Assignment::run, MGLAUNCH_RUN): the one this Job was made
  // with, else the seed's after take_over(), else the run of the round its nodes re-register
  // (a restarted daemon rebuilding it), so that it is minted once per run of the job and
  // never again (#37). A Job made without one takes that of the joining node with the
  // highest epoch above its own.
  const std::string& run() const { return run_; }
  // The daemon's Job of a job it knows nothing of (no --state-dir record: new, or the
  // daemon restarted without one while its nodes were between rounds): its minted run is
  // provisional until its first round closes, which takes the run its joiners name (the one
  // most of them name, the newest by run_older() among as many) and their epochs, so a restart
  // between rounds never switches the run (review s38 M1). A rebuild or a takeover settles
  // it too. An agent's server (quorum) keeps its own: it never restarts.
  void open_run() {
    if (!quorum_) run_open_ = true;
  }
  // The epoch a restarted daemon's --state-dir journal holds with the job's run: its next
  // round is one on, also for fresh joins that name no epoch (a Slurm requeue's; review s38-late H1).
  void seed_epoch(int epoch) {
    if (epoch > epoch_) epoch_ = last_round_epoch_ = epoch;
  }
  // A restarted daemon's --state-dir journal says this id's last run, `run`, ended: done, or
  // failed with `abort`. Its agents that re-register that run (a round, or as a standby: the
  // daemon died before they heard the end) are told that end, not refused; only fresh joins
  // start this Job's new run (review s38-late L1).
  void seed_ended(std::string run, std::optional<proto::Abort> abort) {
    ended_run_ = std::move(run);
    ended_abort_ = std::move(abort);
  }
  // A restarted daemon's --state-dir journal says this id's last run, `run`, was forgotten
  // (nobody connected for orphan_job_expiry: a daemon restart or an outage its agents ride
  // out, retrying for up to join_timeout, as well as a job whose agents were all killed).
  // Ended for fresh joins (a requeue's: this Job's new run), not for re-registrations: a
  // round of that run is rebuilt as without a journal, its workers still running (#34,
  // review s39 M2).
  void seed_forgotten(std::string run) { forgotten_run_ = std::move(run); }
  // Sets the run of a Job made without one (the etcd replay: its log's first record's).
  void set_run(std::string run) {
    run_open_ = false;
    if (run_.empty()) run_ = std::move(run);
  }
  // Whether this side hears a majority of the voters for the next round: those that joined
  // or stand by, and the nodes told to restart that still beat (alive, their workers still
  // stopping). false: the host is cut off from the rest, and looks for the job elsewhere
  // (rdzv::ClientMachine, "Seeking", #34). true where no majority is counted, and in a job
  // taken over until its seed's deadline: the survivors search for this host for up to
  // keep-alive x attempts (their places are kept until then), so none is missing yet.
  bool hears_majority() const;
  // For metrics: nodes in the running round (or waiting for the next), nodes lost by a
  // closed connection, and by missed heartbeats.
  std::size_t nodes() const { return members_.size() + joined_.size(); }
  std::size_t standbys() const { return standby_.size(); }
  int disconnects() const { return disconnects_; }
  int missed_heartbeats() const { return missed_heartbeats_; }
  bool finished() const { return state_ == State::kDone || state_ == State::kFailed; }
  Clock::time_point last_activity() const { return last_activity_; }
  // The job for the status page: state, round, restarts, settings, and its nodes (at most
  // proto::kMaxListedNodes) with their address, workers and status.
  nlohmann::json describe(Clock::time_point now) const;
  // Memory held for this job's nodes, roughly (the daemon's --max-memory accounting).
  std::size_t approx_bytes() const;
  // The events recorded since the last call, oldest first (at most kMaxPendingEvents: the
  // older half is dropped when nobody takes them).
  std::vector<JobEvent> take_events() { return std::exchange(events_, {}); }
  static constexpr std::size_t kMaxPendingEvents = 100000;

 private:
  struct Node {
    proto::Join join;
    Clock::time_point last_seen;
    bool done = false;
  };

  Actions close_round(Clock::time_point now);
  // tick(): the standbys silent past keep-alive x attempts, all of them; then the rest.
  Actions drop_silent_standbys(Clock::time_point now);
  // How long node `j` may be silent before it is lost: its own keep-alive x attempts, the
  // same numbers its fence timer counts (rendezvous/client_machine.h, fence_after; #34).
  static Clock::duration silent_limit(const proto::Join& j);
  Actions tick_deadlines(Clock::time_point now);
  // tick(): the nodes told to restart that stayed silent past keep-alive x attempts are lost.
  Actions drop_silent_rejoining(Clock::time_point now);
  Actions fail_or_restart(const proto::WorkerFailed& root_cause, const std::string& reason, SessionId lost,
                          Clock::time_point now);
  Actions broadcast(const proto::Wire& w, SessionId except = 0) const;
  Actions maybe_done();
  Actions make_standby(SessionId s, const proto::Join& j, Clock::time_point now);
  // What every standby is told (the last round's candidates; the position is its own), with
  // the epoch of the last round that ran and its voters, never a reserved epoch.
  proto::Standby standby_fields() const;
  // The running nodes hear the standby count (after it changed).
  Actions tell_standby_count() const;
  // Moves standbys into the next round while it has free places (max nodes, less those
  // that re-join or have re-joined); closes the round once full, else opens the last call.
  Actions promote_standbys(Clock::time_point now);
  // The order of a round after the first (see above): `nodes` sorted as for a first round.
  template <class Nodes>
  void keep_places(Nodes& nodes) const;
  // A re-registration (resume_round > 0) is believed only while a restarted server
  // rebuilds the round: no other node waits, the claims agree, the slot is free.
  std::string check_resume(SessionId s, const proto::Join& j) const;
  // A re-registration of a later round (restart count, then round) than the one rebuilt so
  // far: the nodes that claimed the earlier one were left out of the job while they were
  // away (one the job declared lost can reach a restarted server before the nodes that went
  // on). drop_rebuild() tells them so and starts the rebuild again from `j`. (Within one run:
  // another run's claim is weighed by hold_other_run().)
  bool newer_than_rebuild(const proto::Join& j) const;
  // A re-registration (resume_round > 0) with a server that did not restart: a node of the
  // running round that lost its connection takes its place back on its new session; one the
  // job went on without (a later restart or round) is told Restart, so that it stops its
  // workers and joins again (#34). nullopt: neither (a rebuild, or refused by check_resume).
  std::optional<Actions> resume_after_outage(SessionId s, const proto::Join& j, Clock::time_point now);
  // The job failed: every node hears `root_cause` (the broadcast reaches members, waiting
  // nodes and standbys) and the job forgets them.
  // `final` false: the job may go on elsewhere (a minority's end, a takeover's shortfall;
  // proto::Abort::final), so the agents keep their records of it.
  Actions fail_job(const proto::WorkerFailed& root_cause, const std::string& reason, bool final = true);
  // The root cause "node H (A) lost: WHY" of a node lost during round_.
  proto::WorkerFailed lost_cause(const proto::Join& j, std::string_view why) const;
  Actions drop_rebuild(const proto::Join& j);
  // A daemon's live rebuild and a re-registration of another run: held and counted (held_);
  // the rebuild is dropped for that run's held claims once more nodes claim it (job_epochs.cc).
  // nullopt: not such a claim (check_resume() weighs it).
  std::optional<Actions> hold_other_run(SessionId s, const proto::Join& j, Clock::time_point now);
  // The held claims hear that the rebuild went on as another run (the rebuild is over): `out` with their Errors.
  Actions refuse_held(Actions out);
  std::map<SessionId, Node> held_;  // re-registrations of another run than a live rebuild's
  // A join from a node that knows a newer epoch than this host's last round (a host cut off
  // epochs ago, reached again) brings that epoch's voters: the next round needs a majority
  // of them too (strictly more than half, even of two), so the votes of nodes that went on
  // never count only among this host's stale voters (review s36 H1).
  void adopt_voters(const proto::Join& j);
  // The voters of `voters` present for the next round: joined_ and standby_ whose agent id
  // is one of them, each once.
  // With `heard`: also the nodes told to restart that still beat (rejoining_).
  int voters_joined(const std::vector<std::string>& voters, bool heard = false) const;
  // A voter set without its majority present: how many of how many, and whether it is the
  // epoch before's (prev_voters_).
  struct Tally {
    int present = 0;
    int voters = 0;
    bool previous = false;
  };
  // Whether the next round may open (nullopt) or which voter set lacks its majority: none in
  // a job that counts no quorum (a daemon or etcd arbitrates) and for a first round; else
  // every round after the first (a node lost, a worker failed, a scale-up: a cut may come
  // during any restart) needs a majority of voters_ AND of prev_voters_ (and of
  // adopted_voters_, strictly: adopt_voters()) (with two voters,
  // the side that kept its host: see the .cc). The joint majority, as Raft's during a
  // configuration change: two sides that know different epochs' voters (one missed the
  // assignment that changed them) both need a majority of the older set, so at most one
  // goes on (docs/multinode.md, "Network partitions").
  // (With `heard`, counting the voters heard: hears_majority().)
  std::optional<Tally> short_of_majority(bool heard = false) const;
  bool has_quorum() const { return !short_of_majority(); }
  // Records an event of `kind` (about node `n` when given), with the job's round and restarts.
  JobEvent& emit(JobEvent::Kind kind, const proto::Join* n = nullptr);

  std::string id_;
  bool quorum_ = false;       // the job counts a majority after a loss (an agent hosts it)
  int epoch_ = 0;             // of the last round (epoch())
  int last_round_epoch_ = 0;  // last_round_epoch()
  std::string run_;           // run()
  // A join's epoch raises epoch_ (Join::epoch), within this job's run only (other_run()); a
  // Job without a run takes the run of the highest.
  void learn_epoch(const proto::Join& j);
  // `j` names a run and this job has another (a leftover agent of an earlier run of the job
  // id: epochs count from 1 again in every run). Its epoch and voters compare with none of
  // this job's: such a join teaches nothing and takes no survivor's place (#34). A join that
  // names none (nothing told yet, or an agent before #37) is of this run.
  bool other_run(const proto::Join& j) const {
    return !run_open_ && !run_.empty() && !j.run.empty() && j.run != run_;
  }
  bool run_open_ = false;  // open_run(); joins are kept whole until settle_run()
  // The first round's run of a Job whose run is open: the newest its nodes name, else its own.
  void settle_run(const std::vector<std::pair<SessionId, Node>>& nodes);
  // A join for which other_run(): a re-registration of the ended run (seed_ended()) hears
  // its end; another re-registration is weighed whole (nullopt: check_resume(),
  // resume_after_outage()); a fresh join (resume_round 0) is refused by a fresh job an agent
  // hosts when it ran rounds (epoch > 0), else taken as a plain newcomer's.
  std::optional<Actions> join_of_other_run(SessionId s, const proto::Join& j, Clock::time_point now);
  std::string ended_run_;                    // seed_ended()
  std::optional<proto::Abort> ended_abort_;  // its end when it failed (none: done)
  std::string forgotten_run_;                // seed_forgotten()
  // Whether a re-registration's run may not rebuild this Job's round (check_resume()).
  bool resume_of_other_run(const proto::Join& j) const {
    return other_run(j) && (quorum_ || run_older(j.run, run_)) && j.run != forgotten_run_;
  }
  // A restarted server rebuilds the round `j` re-registers (the first such join): that
  // round's run and epoch become the job's.
  void rebuild_run(const proto::Join& j);
  // The voters of epoch_ (agent ids): the round's nodes and the standbys when it closed;
  // empty when more than kMaxListedNodes (no majority is counted then).
  std::vector<std::string> voters_;
  // The voters of the epoch before epoch_ (those that decided it); empty: none (the first).
  std::vector<std::string> prev_voters_;
  // The voters of a newer epoch than last_round_epoch_ (adopted_epoch_), as the join that
  // reported the highest told them (adopt_voters()); empty: none. Until the next round
  // opens they count beside voters_ and prev_voters_, and become its prev_voters_.
  std::vector<std::string> adopted_voters_;
  int adopted_epoch_ = 0;
  bool quorum_told_ = false;  // the wait for a majority was recorded (kNoQuorum) for this round
  bool took_over_ = false;           // this job was taken over; its first round not closed yet
  bool voters_host_closed_ = false;  // the takeover's host was seen to close (TakeoverSeed)
  State state_ = State::kJoining;
  proto::Join config_;  // settings from the first join (min/max nodes, timeouts, restarts)
  bool configured_ = false;
  int round_ = 0;
  int restart_count_ = 0;
  std::map<SessionId, Node> joined_;   // waiting for the next round
  std::map<SessionId, Node> members_;  // in the running round
  std::map<SessionId, Node> standby_;  // waiting for a place; taken in session (arrival) order
  // Told to restart, not re-joined yet, with when each was last heard: one silent past
  // keep-alive x attempts is lost (its place freed, no voter counted for it).
  std::map<SessionId, Node> rejoining_;
  std::map<std::string, int> placed_;  // agent id -> group rank in the last round
  std::size_t expected_members_ = 0;   // size of the running round (members may re-register late)
  bool rebuilding_ = false;            // the round is being rebuilt from re-registrations
  // Since the first re-registration of the round being rebuilt: a node of that round that
  // has not re-registered within join_timeout of it is lost (a live node re-registers, or
  // gives the server up, within its own join_timeout of losing it).
  Clock::time_point rebuild_since_;
  std::optional<proto::Abort> abort_;  // the decision of a failed job, for late re-registrations
  std::string restart_reason_;         // of the restart in progress
  std::string restart_host_;           // the host that restart names (root_cause.host), may be empty
  std::string lost_host_;              // the node lost that restart replaces (empty: a worker failed)
  int disconnects_ = 0, missed_heartbeats_ = 0;
  std::optional<Clock::time_point> last_call_deadline_;
  std::optional<TakeoverSeed> takeover_;  // taken over, the survivors' round not closed yet
  int takeover_reserved_ = 0;  // survivors of a takeover not re-joined yet (their places wait)
  // The last round's advertised addresses and takeover ports by group rank (Standby).
  std::vector<std::string> round_nodes_;
  std::vector<int> round_ports_;
  // Its standby voters' (Assignment::standby_nodes; empty unless its voters were listed).
  std::vector<std::string> round_standby_nodes_;
  std::vector<int> round_standby_ports_;
  std::pair<std::string, int> round_host_vote_;  // Assignment::host_vote_addr and _port
  std::string host_agent_id_;                    // set_host_agent_id()
  Clock::time_point first_join_;
  Clock::time_point last_activity_;
  std::vector<JobEvent> events_;  // not taken yet (take_events())
};

}  // namespace mg::rdzv
