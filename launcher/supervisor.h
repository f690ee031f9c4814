// Supervisor: the agent's supervision rules as a pure state machine, as rendezvous/job
// is: events in (start, the rendezvous' assignment/restart/abort/lost/done, a worker
// ended, the started workers' execs settled, a signal to the agent, job control, a timer
// fired, a spawn batch due) with the time passed in, actions out (spawn local rank N,
// signal the worker groups, arm or cancel a timer, tell the rendezvous, print a notice or
// the root cause, which exit is the root cause, hold the master port and when to let it
// go, finish with a code). It owns no I/O and reads no clock; the agent
// (launcher/agent.cc) feeds it and carries out what it returns, in order. The agent's other
// decisions are pure functions here too: the descriptor budget and whether this agent
// hosts the rendezvous (at the end of this file).
//
//   (start) --> waiting (multi-node: for the rendezvous' assignment) | running
//   running --(a worker failed | restart/abort decided | a signal)--> stopping
//   running --(every worker ended well)--> done (single node) | waiting (node done, multi-node)
//   stopping --(every worker ended)--> running (restart left) | waiting | done  (after_stop())
//   waiting --(assignment)--> running;  --(abort | lost | signal)--> done
//
// In-place recovery (docs/in-place-recovery.md): a worker that said hello with in_place
// over the control channel (worker_hello) and is alive when a restart is decided (a
// Restart from the rendezvous, or a local failure while restarts remain) gets Pause
// instead of the stop signal; its handle survives RetireWorkers, and the next attempt
// sends it Assign where the others get Spawn. A paused worker that ends before its Assign
// is spawned anew; once assigned, its end is an ordinary end of the new attempt. A paused
// worker answers with `paused` (worker_paused); its Assign waits for that answer, and one
// that has not answered within the grace of its Pause is taken for dead (SIGSTOPped, hung):
// SIGKILL, and spawned anew in its turn once the old process has ended.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include <nlohmann/json.hpp>

#include "launcher/report.h"
#include "launcher/supervision.h"
#include "proto/messages.h"

namespace mg::sup {

using Clock = std::chrono::steady_clock;

// The time of an event: the steady clock for durations and timers, the wall clock for
// the records people read (attempt start, root-cause time).
struct Now {
  Clock::time_point steady{};
  std::chrono::system_clock::time_point wall{};
};

enum class State { kRunning, kStopping, kWaiting, kDone };
// kGrace: SIGTERM to SIGKILL; kLeave: a stopped node waits for the job's decision;
// kFence: the longest the master port waits for the workers' exec (WatchExecs).
// kStoreLinger is the agent's own (the node-0 agent's store outliving its workers), never
// the supervisor's; kCount sizes the clock's table. kWatch: the next look for workers stopped
// by a signal (CheckStopped), while a worker that opted in to in-place recovery runs.
// kOverdue: armed at the first signal that ends the run (SIGTERM, SIGINT, SIGHUP, a handled
// one): whatever the run waits for then, it ends at that signal + grace + kOverdueMargin.
// kPrestart is the pre-started workers' (sup::Prestart, launcher/prestart.h): their earliest
// hello or SIGKILL deadline. kPortWatch is the agent's own: the next look at who listens on
// MASTER_PORT while the workers host the store (Agent::watch_master_port).
enum class Timer { kGrace, kLeave, kFence, kStoreLinger, kClosing, kWatch, kOverdue, kPrestart, kPortWatch, kCount };

struct Config {
  int nproc = 1;          // workers of this node
  int max_restarts = 0;
  std::chrono::milliseconds grace{30000};  // SIGTERM to SIGKILL
  bool rdzv = false;          // a rendezvous server decides for every node
  bool port_is_ours = false;  // mglaunch chose the master port (a fresh one per attempt)
  int master_port = 0;        // the plan's: held from start() when ours (0: none yet)
  int node_rank = 0;          // until an assignment says otherwise
  std::string host;           // this node's name, for the rendezvous' messages
  std::string program;        // for the root-cause block
  std::string rdzv_where;     // "etcd at URL" or the endpoint, for the time-out error
  std::string job_id;         // --rdzv_id, for the standby line
  std::chrono::milliseconds join_timeout{0};
  int spawn_batch = 128;  // workers started before the event loop gets a turn
  static constexpr std::chrono::seconds kLeaveTimeout{5};
  // After the grace: SIGKILLed workers reaped, the others told (kLeaveTimeout).
  static constexpr std::chrono::seconds kOverdueMargin{10};
  // A worker stopped before its exec must not keep the master port held for ever.
  static constexpr std::chrono::seconds kExecFenceTimeout{1};
  static constexpr std::chrono::seconds kWatchEvery{1};
};

// The actions, carried out in the order returned.
namespace act {
struct Notice { std::string text; };     // "[mglaunch] TEXT"
struct ErrorLine { std::string text; };  // "mglaunch: error: TEXT": the run ends on it
struct PrintRootCause { RootCause rc; };  // format_root_cause()
struct Trace { std::string name, cat; nlohmann::json args; };  // an instant on the agent's track
struct JoinRendezvous {};                // connect and join (multi-node start)
struct ApplyAssignment { proto::Assignment a; };  // the plan takes the round's ranks and master
struct AttemptStarted { int attempt = 0; };
struct AttemptEnded { int attempt = 0; bool failed = false; };
struct Spawn { int local_rank = 0; int attempt = 0; };
// The master port is held while workers start: until its exec a worker holds a copy of
// the hold socket (launcher/port.h). OpenExecFence comes before the first Spawn of an
// attempt: the workers started from now on are watched. WatchExecs comes after the last:
// feed execs_settled() once every watched worker has exec'd or exited (the kFence timer
// armed with it bounds the wait); then ReleaseMasterPort follows.
struct OpenExecFence {};
struct WatchExecs {};
// A worker of the attempt ended: what it was (stopped_by_agent set) and whether its exit
// is the attempt's root cause (then worker_ended() took its details).
struct WorkerEnded { WorkerOutcome o; int attempt = 0; bool root_cause = false; };
struct SpawnMoreLater { std::uint64_t gen = 0; };  // feed spawn_batch_due(gen) from the event loop
// Every worker group and (escaped) the descendants outside them; with `only`, the process
// groups of those local ranks alone (the paused ones are spared). `cont`: SIGCONT to the
// same ones right after, so that a worker stopped by SIGSTOP gets a stop signal now, not
// once someone continues it (SIGKILL needs none).
struct SignalWorkers { int sig = 0; bool escaped = true; std::optional<std::vector<int>> only; bool cont = false; };
struct PauseOutputDrains {};   // before the agent stops: an ended worker's output drain waits
struct ResumeOutputDrains {};  // the drains start over (the time stopped does not count)
struct StopSelf {};            // SIGSTOP the agent (Ctrl-Z, after the workers)
struct ArmTimer { Timer timer; Clock::time_point at; };
struct CancelTimer { Timer timer; };
struct RetireWorkers { std::vector<int> keep; };  // kill what is left of the attempt, drop its
                                                  // handles, but those of the local ranks in `keep` (paused)
// In-place recovery: tell local rank N's worker over the control channel.
struct Pause { int local_rank = 0; int round = 0; std::string reason; std::string lost; };  // the round that
                                                                                      // ended; lost: host or worker
struct Assign { int local_rank = 0; int round = 0; int restart_count = 0; };  // the new one's: its env from the plan
struct AttemptDue {};          // feed attempt_due() from the event loop
// Look up which live workers are stopped by a signal (/proc state T) and feed them to
// workers_stopped().
struct CheckStopped {};
struct HoldMasterPort { bool fresh = false; };
struct ReleaseMasterPort {};   // the workers may bind it now
struct Rejoin { bool offer_port = false; };  // join the next round (offering the port held now: ours)
struct SendWorkerFailed { proto::WorkerFailed f; };
struct SendNodeDone { int round = 0; };
struct Finish { int code = 0; };  // the run is over: every effect stops, exit with `code`
}  // namespace act

using Action = std::variant<act::Notice, act::ErrorLine, act::PrintRootCause, act::Trace, act::JoinRendezvous,
                            act::ApplyAssignment, act::AttemptStarted, act::AttemptEnded, act::Spawn,
                            act::OpenExecFence, act::WatchExecs, act::WorkerEnded,
                            act::SpawnMoreLater, act::SignalWorkers, act::PauseOutputDrains, act::ResumeOutputDrains, act::StopSelf,
                            act::ArmTimer, act::CancelTimer, act::RetireWorkers, act::AttemptDue,
                            act::HoldMasterPort, act::ReleaseMasterPort, act::Rejoin, act::SendWorkerFailed,
                            act::SendNodeDone, act::Finish, act::Pause, act::Assign, act::CheckStopped>;
using Actions = std::vector<Action>;

class Supervisor {
 public:
  explicit Supervisor(Config cfg)
      : cfg_(std::move(cfg)),
        node_rank_(cfg_.node_rank),
        ranks_(static_cast<std::size_t>(cfg_.nproc)) {}

  // The agent is set up: join the rendezvous (multi-node) or start attempt 0.
  Actions start(const Now& now);
  // A batch announced by SpawnMoreLater; stale (an attempt that ended meanwhile): nothing.
  Actions spawn_batch_due(std::uint64_t gen, const Now& now);
  // A restart announced by AttemptDue.
  Actions attempt_due(const Now& now);
  // The details of a failure that becomes the root cause (error file, stderr tail; see
  // worker_root_cause in launcher/report.h), gathered only then.
  using RootCauseDetails = std::function<RootCause()>;
  // A worker of the current attempt ended (its pipes drained). The first action is
  // WorkerEnded: the outcome as recorded (stopped_by_agent set) and whether this exit is
  // the root cause; only then is `details` called (once; empty: the outcome alone).
  Actions worker_ended(WorkerOutcome o, const Now& now, const RootCauseDetails& details = {});
  // Every worker watched since OpenExecFence has exec'd or exited (see WatchExecs).
  Actions execs_settled(const Now& now);
  // SIGINT, SIGTERM, SIGHUP, SIGUSR1, SIGUSR2 sent to the agent.
  Actions signal(int sig, const Now& now);
  // SIGTSTP (Ctrl-Z) or SIGCONT (fg, bg).
  Actions job_control(int sig, const Now& now);
  Actions timer_fired(Timer t, const Now& now);
  // From the rendezvous.
  Actions assignment(const proto::Assignment& a, const Now& now);
  Actions restart(const proto::Restart& r, const Now& now);
  Actions abort(const proto::Abort& a, const Now& now);
  Actions rendezvous_done(const Now& now);
  // The round is full: this node waits as a standby (no worker runs) until an assignment
  // (a place freed), Done (exit 0) or Abort (the job's root cause and exit code).
  Actions standby(const proto::Standby& s, const Now& now);
  Actions rendezvous_lost(const std::string& why, const Now& now);
  // From the control channel: local rank N's worker said hello (`in_place`: it opts in),
  // or its connection closed (a paused one is then stopped: it can no longer be assigned;
  // `why`: which side ended the connection and how, said in the notice).
  Actions worker_hello(int local_rank, bool in_place, const Now& now);
  Actions control_closed(int local_rank, const std::string& why, const Now& now);
  // Local rank N's worker answered its Pause (`paused`): it is alive and let go of its
  // group; its Assign, if held for this answer, goes now.
  Actions worker_paused(int local_rank, const Now& now);
  // The local ranks whose worker CheckStopped found stopped by a signal (SIGSTOP, not the
  // agent's Ctrl-Z). A worker that opted in and stays stopped for the grace is taken for
  // hung: SIGKILL, and its end is a failure of the attempt (the others are paused and kept),
  // before its peers' collectives time out and they give up their state.
  Actions workers_stopped(const std::vector<int>& local_ranks, const Now& now);
  // The preflight check (ops/preflight.h, --preflight=fail) found a slow or broken node
  // before any worker of the run started: the run ends with `line` (an error line and the
  // root cause) and exit code 5. Nothing once the run is past that point.
  Actions preflight_failed(const std::string& line, const Now& now);
  // An error the agent met while carrying out actions (an exception from an effect): the
  // run ends at once with `line` (an error line) and `code`; the agent's finish kills and
  // reaps whatever workers there are. Nothing once the run has ended.
  Actions fatal(int code, const std::string& line, const Now& now);

  State state() const { return state_; }
  int restart_count() const { return restart_count_; }
  int round() const { return round_; }
  int node_rank() const { return node_rank_; }
  int agent_signal() const { return agent_signal_; }
  int exit_code() const { return exit_code_; }
  bool rdzv() const { return rdzv_; }
  bool is_standby() const { return standby_; }
  const std::optional<RootCause>& root_cause() const { return root_cause_; }
  const std::vector<AttemptRecord>& attempts() const { return attempts_; }
  // Worker handles of the attempt (started, not yet retired).
  int handles() const { return handles_; }
  bool paused(int local_rank) const { return valid(local_rank) && rank(local_rank).paused; }
  bool in_place(int local_rank) const { return valid(local_rank) && rank(local_rank).in_place; }
  // Paused and its `paused` answer came.
  bool acknowledged(int local_rank) const { return paused(local_rank) && rank(local_rank).acked; }

 private:
  void start_attempt(const Now& now, Actions& out);
  void spawn_batch(std::uint64_t gen, const Now& now, Actions& out);
  void hold_port(bool fresh, Actions& out);
  void release_port(Actions& out);
  void stop_group(int sig, const Now& now, Actions& out);
  void group_stopped(const Now& now, Actions& out);
  void leave_job(int sig, const Now& now, Actions& out);
  void stop_on_signal(int sig, OnSignal what, const Now& now, Actions& out);
  void finish_with_abort(const Now& now, Actions& out);
  void rejoin(Actions& out);
  void retire(Actions& out);
  void finish(int code, Actions& out);
  bool valid(int lr) const { return lr >= 0 && lr < cfg_.nproc; }
  int paused_count() const;
  // Pause every live worker that opted in (a restart is coming); false when none.
  bool pause_in_place(const std::string& reason, const std::string& lost, const Now& now, Actions& out);
  // The paused workers are to be stopped after all (an abort, a signal): they count again
  // among the workers a stop waits for.
  void unpause_all();
  // The stop under way has nothing left to wait for (every handle ended or paused).
  bool stop_complete() const { return done_ + paused_count() >= handles_; }
  void notice(std::string text, Actions& out) { out.push_back(act::Notice{std::move(text)}); }
  void trace(std::string name, std::string cat, nlohmann::json args, Actions& out) {
    out.push_back(act::Trace{std::move(name), std::move(cat), std::move(args)});
  }

  Config cfg_;
  State state_ = State::kRunning;
  bool rdzv_ = false;
  int round_ = 0;
  int group_world_size_ = 1;  // nodes in the last round this node was given a place in
  int node_rank_ = 0;
  int restart_count_ = 0;
  int agent_signal_ = 0;  // TERM/INT/HUP that is stopping the run
  std::optional<Clock::time_point> overdue_due_;  // kOverdue armed for then (none: not armed)
  bool overdue_paused_ = false;                   // cancelled by Ctrl-Z, armed again on SIGCONT
  void arm_overdue(const Now& now, Actions& out);
  int interrupts_ = 0;    // SIGINTs seen (a second one kills at once)
  int stop_signal_ = SIGTERM;  // the signal of the stop under way, for the grace notice
  // When the grace of the stop under way runs out: set by stop_group and started over by
  // SIGCONT. A grace timer that fires before it (a completion queued while the agent was
  // stopped, before the SIGCONT that re-armed it was handled) is stale.
  Clock::time_point grace_due_{};
  int leaving_code_ = 0;  // set by leave_job(): the exit code once the decision is in
  bool rejoin_after_stop_ = false;
  bool standby_ = false;  // told Standby, no assignment since
  std::optional<proto::Abort> abort_;
  std::optional<RootCause> root_cause_;
  std::vector<AttemptRecord> attempts_;
  Clock::time_point attempt_start_{};
  std::uint64_t gen_ = 0;  // bumped by each attempt: stale batches stop
  int spawned_ = 0;        // workers of this attempt started so far
  int handles_ = 0;        // worker handles held (spawned since the last retire)
  int done_ = 0;           // of those, ended
  int exit_code_ = 0;
  bool port_held_ = false;     // HoldMasterPort was the last word on the port
  bool fence_pending_ = false;  // WatchExecs out, ReleaseMasterPort not yet
  Clock::time_point fence_due_{};
  // In-place recovery, per local rank.
  struct Rank {
    bool live = false;      // a handle is alive
    bool in_place = false;  // its worker opted in (hello with in_place)
    bool paused = false;    // it was sent Pause and waits for Assign
    bool acked = false;     // paused, and it answered (`paused`)
    bool assign_held = false;  // its turn in the attempt came before the answer: Assign goes with the answer
    // Paused, and its control connection closed: SIGTERM sent, SIGKILL at closing_due
    // (Timer::kClosing); its handle still counts until it ends.
    bool closing = false;
    bool respawn = false;  // closing, and its turn to start came: the new process starts once the old one ended
    Clock::time_point closing_due{};
    // A paused worker that has not answered by ack_due (its Pause + the grace) is taken for
    // dead: SIGKILL, then closing as above. The kClosing timer serves both deadlines.
    Clock::time_point ack_due{};
    // Since when CheckStopped has found it stopped (max: not stopped).
    Clock::time_point stopped_since = Clock::time_point::max();
  };
  std::vector<Rank> ranks_;
  const Rank& rank(int lr) const { return ranks_[static_cast<std::size_t>(lr)]; }
  // The ranks the stop under way signals (none: every worker).
  std::optional<std::vector<int>> stop_only_;
  // watching_: the kWatch timer is armed.
  bool watching_ = false;
  void watch(const Now& now, Actions& out);
  void arm_closing(Actions& out);
  // The paused workers whose answer is overdue: SIGKILL, closing (see Rank::ack_due).
  void kill_silent(const Now& now, Actions& out);
  void assign(int local_rank, Actions& out);
  // A stop signal: SIGCONT follows a signal other than SIGKILL (see act::SignalWorkers).
  static act::SignalWorkers stop_sig(int sig, std::optional<std::vector<int>> only, bool escaped = true) {
    return act::SignalWorkers{sig, escaped, std::move(only), sig != SIGKILL};
  }
  // The end of a closing worker's process; true when `o` was one (it is no worker of the attempt).
  bool closing_ended(const WorkerOutcome& o, Actions& out);
};

// ---- the agent's start-up decisions ----

// Descriptors: a worker costs the agent one pipe per stream (one when its stdout and
// stderr are merged), a log file per stream written, and the agent keeps a reserve for
// the rendezvous sockets, the watchdog's pipe and files opened while running.
struct DescriptorNeed {
  int nproc = 0;
  int per_worker = 2;
  int log_files = 0;   // held open for the run
  long long fixed = 0;   // what is open now + the reserve + the log files
  long long needed = 0;  // fixed + per_worker * nproc
  // The connections a rendezvous server this agent hosts (or takes over) keeps: one per
  // agent of the job; 0 when it can host none. Not in `needed` (a host short of them refuses
  // the agents beyond, as the daemon does), but the soft limit is raised for them.
  long long rendezvous = 0;
};
DescriptorNeed descriptor_need(int nproc, bool merge_streams, int log_files, int open_now, int rendezvous_agents = 0);
// A hosted rendezvous' connections besides one per agent (handshakes); also all that the
// takeover socket of an agent that hosts elsewhere may hold (review s39-listen L3).
inline constexpr unsigned long long kRendezvousHandshakes = 8;
// The descriptor limit (RLIMIT_NOFILE); nullopt: unlimited.
struct DescriptorLimit {
  std::optional<unsigned long long> soft, hard;
};
// Whether `need` fits under the soft limit.
bool fits(const DescriptorNeed& need, const DescriptorLimit& lim);
// When it does not fit (or leaves too few for the rendezvous' agents), whether raising the
// soft limit to the hard one is worth a try.
bool worth_raising(const DescriptorNeed& need, const DescriptorLimit& lim);
// The error (ResourceError's text) for a need that does not fit the limit in force: how
// many workers fit and how to raise the limit.
std::string descriptor_shortfall(const DescriptorNeed& need, const DescriptorLimit& lim);

// The agent's servers' connections, shared out from one place: what the soft limit leaves
// over the run's need (DescriptorNeed: the workers' pipes, the logs, the reserve) goes
// first to the rendezvous server the agent may host (or take over), when it may: one
// connection per agent and 8 for handshakes, at least an eighth of it and at most a half.
// The rest is split among the store (half), the control socket (a quarter), the metrics
// and the health check's HTTP endpoints (an eighth each), each capped at its own default
// (100,000 store clients, 4,096 control sessions, 64 HTTP connections) and given at least
// a few connections. None can then take the descriptors of another, nor those of the
// workers (their pipes, a restart's new ones); FileTimer's pipe is in the reserve.
// Unlimited: the defaults.
struct DescriptorShares {
  std::size_t store = 100000;  // the agent store's clients (parked ones included)
  std::size_t control = 4096;  // control sessions
  std::size_t metrics = 64;    // connections of the metrics endpoint
  std::size_t health = 64;     // connections of the health check
  std::size_t rendezvous = 0;  // the hosted rendezvous server's (0: its default, what the limit allows)
};
DescriptorShares descriptor_shares(const DescriptorNeed& need, const DescriptorLimit& lim);

// Whether this agent listens for the rendezvous itself (once nothing listens there yet):
// only with the own daemon's protocol (a rendezvous server that is not etcd), when told
// (--rdzv_conf is_host=) or clearly meant to: `endpoint_is_here()` (asked only without
// is_host) says the endpoint is a local address and the one this node advertises.
// (torchrun hosts whenever the endpoint is local; then an agent started during a daemon's
// outage takes the daemon's port.)
bool meant_to_host(bool rdzv_server, bool etcd, std::optional<bool> is_host,
                   const std::function<bool()>& endpoint_is_here);

}  // namespace mg::sup
