// Supervisor: the agent's supervision rules as a pure state machine, as rendezvous/job
// is: events in (start, the rendezvous' assignment/restart/abort/lost/done, a worker
// ended, a signal to the agent, job control, a timer fired, a spawn batch due) with the
// time passed in, actions out (spawn local rank N, signal the worker groups, arm or
// cancel a timer, tell the rendezvous, print a notice or the root cause, hold or release
// the master port, finish with a code). It owns no I/O and reads no clock; the agent
// (launcher/agent.cc) feeds it and carries out what it returns, in order.
//
//   (start) --> waiting (multi-node: for the rendezvous' assignment) | running
//   running --(a worker failed | restart/abort decided | a signal)--> stopping
//   running --(every worker ended well)--> done (single node) | waiting (node done, multi-node)
//   stopping --(every worker ended)--> running (restart left) | waiting | done  (after_stop())
//   waiting --(assignment)--> running;  --(abort | lost | signal)--> done
#pragma once

#include <chrono>
#include <cstdint>
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
enum class Timer { kGrace, kLeave };

struct Config {
  int nproc = 1;          // workers of this node
  int max_restarts = 0;
  std::chrono::milliseconds grace{30000};  // SIGTERM to SIGKILL
  bool rdzv = false;          // a rendezvous server decides for every node
  bool port_is_ours = false;  // mglaunch chose the master port (a fresh one per attempt)
  int node_rank = 0;          // until an assignment says otherwise
  std::string host;           // this node's name, for the rendezvous' messages
  std::string program;        // for the root-cause block
  std::string rdzv_where;     // "etcd at URL" or the endpoint, for the time-out error
  std::chrono::milliseconds join_timeout{0};
  int spawn_batch = 128;  // workers started before the event loop gets a turn
  static constexpr std::chrono::seconds kLeaveTimeout{5};
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
struct SpawnMoreLater { std::uint64_t gen = 0; };  // feed spawn_batch_due(gen) from the event loop
struct SignalWorkers { int sig = 0; bool escaped = true; };  // every worker group, and (escaped) the
                                                              // descendants outside them
struct PauseOutputDrains {};   // before the agent stops: an ended worker's output drain waits
struct ResumeOutputDrains {};  // the drains start over (the time stopped does not count)
struct StopSelf {};            // SIGSTOP the agent (Ctrl-Z, after the workers)
struct ArmTimer { Timer timer; Clock::time_point at; };
struct CancelTimer { Timer timer; };
struct RetireWorkers {};       // kill what is left of the attempt, drop its handles
struct AttemptDue {};          // feed attempt_due() from the event loop
struct HoldMasterPort { bool fresh = false; };
struct ReleaseMasterPort {};   // the workers may bind it now
struct Rejoin {};              // join the next round (with the port held now, when ours)
struct SendWorkerFailed { proto::WorkerFailed f; };
struct SendNodeDone { int round = 0; };
struct Finish { int code = 0; };  // the run is over: every effect stops, exit with `code`
}  // namespace act

using Action = std::variant<act::Notice, act::ErrorLine, act::PrintRootCause, act::Trace, act::JoinRendezvous,
                            act::ApplyAssignment, act::AttemptStarted, act::AttemptEnded, act::Spawn,
                            act::SpawnMoreLater, act::SignalWorkers, act::PauseOutputDrains, act::ResumeOutputDrains, act::StopSelf,
                            act::ArmTimer, act::CancelTimer, act::RetireWorkers, act::AttemptDue,
                            act::HoldMasterPort, act::ReleaseMasterPort, act::Rejoin, act::SendWorkerFailed,
                            act::SendNodeDone, act::Finish>;
using Actions = std::vector<Action>;

class Supervisor {
 public:
  explicit Supervisor(Config cfg) : cfg_(std::move(cfg)), node_rank_(cfg_.node_rank) {}

  // The agent is set up: join the rendezvous (multi-node) or start attempt 0.
  Actions start(const Now& now);
  // A batch announced by SpawnMoreLater; stale (an attempt that ended meanwhile): nothing.
  Actions spawn_batch_due(std::uint64_t gen, const Now& now);
  // A restart announced by AttemptDue.
  Actions attempt_due(const Now& now);
  // Whether a failure now becomes the root cause (the agent then gathers its details:
  // error file, stderr tail; see make_root_cause in launcher/report.h).
  bool takes_root_cause() const { return state_ == State::kRunning; }
  // A worker of the current attempt ended (its pipes drained). `rc`: the details of a
  // failure, when takes_root_cause(). The outcome is recorded with stopped_by_agent set.
  Actions worker_ended(WorkerOutcome o, std::optional<RootCause> rc, const Now& now);
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
  Actions rendezvous_lost(const std::string& why, const Now& now);

  State state() const { return state_; }
  int restart_count() const { return restart_count_; }
  int round() const { return round_; }
  int node_rank() const { return node_rank_; }
  int agent_signal() const { return agent_signal_; }
  int exit_code() const { return exit_code_; }
  bool rdzv() const { return rdzv_; }
  const std::optional<RootCause>& root_cause() const { return root_cause_; }
  const std::vector<AttemptRecord>& attempts() const { return attempts_; }
  // Worker handles of the attempt (started, not yet retired).
  int handles() const { return handles_; }

 private:
  void start_attempt(const Now& now, Actions& out);
  void spawn_batch(std::uint64_t gen, Actions& out);
  void stop_group(int sig, const Now& now, Actions& out);
  void group_stopped(const Now& now, Actions& out);
  void leave_job(int sig, const Now& now, Actions& out);
  void finish_with_abort(const Now& now, Actions& out);
  void rejoin(Actions& out);
  void retire(Actions& out);
  void finish(int code, Actions& out);
  void notice(std::string text, Actions& out) { out.push_back(act::Notice{std::move(text)}); }
  void trace(std::string name, std::string cat, nlohmann::json args, Actions& out) {
    out.push_back(act::Trace{std::move(name), std::move(cat), std::move(args)});
  }

  Config cfg_;
  State state_ = State::kRunning;
  bool rdzv_ = false;
  int round_ = 0;
  int node_rank_ = 0;
  int restart_count_ = 0;
  int agent_signal_ = 0;  // TERM/INT/HUP that is stopping the run
  int interrupts_ = 0;    // SIGINTs seen (a second one kills at once)
  int stop_signal_ = SIGTERM;  // the signal of the stop under way, for the grace notice
  // When the grace of the stop under way runs out: set by stop_group and started over by
  // SIGCONT. A grace timer that fires before it (a completion queued while the agent was
  // stopped, before the SIGCONT that re-armed it was handled) is stale.
  Clock::time_point grace_due_{};
  int leaving_code_ = 0;  // set by leave_job(): the exit code once the decision is in
  bool rejoin_after_stop_ = false;
  std::optional<proto::Abort> abort_;
  std::optional<RootCause> root_cause_;
  std::vector<AttemptRecord> attempts_;
  Clock::time_point attempt_start_{};
  std::uint64_t gen_ = 0;  // bumped by each attempt: stale batches stop
  int spawned_ = 0;        // workers of this attempt started so far
  int handles_ = 0;        // worker handles held (spawned since the last retire)
  int done_ = 0;           // of those, ended
  int exit_code_ = 0;
};

}  // namespace mg::sup
