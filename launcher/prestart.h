// Prestart: the policy of --prestart-standby (docs/in-place-recovery.md, "Pre-started
// workers") as a pure state machine, as sup::Supervisor is: events in (the node became a
// standby, a pre-started worker started, said hello, closed its control connection,
// ended; the node was given a place; the run ends; a signal meanwhile; its timer fired)
// with the time passed in, commands out (start a worker ahead, signal some, a notice, a
// trace instant, arm or cancel the one timer, finish the run). It owns no I/O and reads no
// clock; the agent (launcher/agent.cc) starts the processes and carries out the commands
// in order.
//
// The rules:
// - While this node is a standby, one worker per local rank runs ahead (MGLAUNCH_STANDBY=1,
//   no rank). One that said hello with in_place and standby is ready: it is handed its
//   local rank's place (take()) when the node is given one.
// - One that said no such hello within kHello, said hello without it or closed its
//   channel is stopped: SIGTERM and SIGCONT, SIGKILL --grace later, with one line; its
//   local rank starts a fresh worker when the node is given a place.
// - One that ends on its own after kMinLife while the node is still a standby is replaced
//   by another (a shorter-lived one would end again).
// - The node is given a place (retire()): the ready ones are kept for take(); the others
//   are SIGKILLed, their handles kept until they ended.
// - The run ends while they run (stop_all()): SIGTERM and SIGCONT to each, SIGKILL
//   --grace later, and the run finishes once none is left; a second stop signal meanwhile
//   finishes it at once (the agent's finish SIGKILLs and reaps what is left).
#pragma once

#include <sys/types.h>

#include <chrono>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include <nlohmann/json.hpp>

#include "launcher/supervisor.h"

namespace mg::sup {

namespace pre {
struct Start { int local_rank = 0; };  // start local rank N's worker ahead; tell started() its pid
// Signal the pre-started workers of these local ranks; `cont`: SIGCONT right after (one
// stopped by SIGSTOP gets the SIGTERM now).
struct Signal { int sig = 0; std::vector<int> local_ranks; bool cont = false; };
struct Notice { std::string text; };  // "[mglaunch] TEXT"
struct Trace { std::string name; nlohmann::json args; };  // an instant of category "worker"
// Local rank N runs no pre-started worker any more: its control session can be forgotten.
struct Forget { int local_rank = 0; };
// retire(): the handle of local rank N stays with the retire (ready: for take(); killed:
// until it ended and its output drained).
struct Keep { int local_rank = 0; };
struct ArmTimer { Clock::time_point at; };  // Timer::kPrestart: feed timer_fired() then
struct CancelTimer {};
struct Finish { int code = 0; };  // the run ends now with `code` (what is left is SIGKILLed and reaped)
}  // namespace pre

using PreCommand = std::variant<pre::Start, pre::Signal, pre::Notice, pre::Trace, pre::Forget, pre::Keep,
                                pre::ArmTimer, pre::CancelTimer, pre::Finish>;
using PreCommands = std::vector<PreCommand>;

class Prestart {
 public:
  static constexpr std::chrono::seconds kHello{30};   // a hello with "standby" due after the start
  static constexpr std::chrono::seconds kMinLife{5};  // a shorter-lived one is not replaced

  Prestart(int nproc, std::chrono::milliseconds grace) : nproc_(nproc), grace_(grace) {}

  // The node waits as a standby (`standby_waiting`; with --prestart-standby): one worker per
  // local rank starts ahead, once. Without a control channel (`control`: false) none can be
  // handed a place: one line, nothing started.
  PreCommands begin(bool standby_waiting, bool control, const Now& now);
  // Local rank N's worker ahead started as `pid` (after pre::Start).
  PreCommands started(int local_rank, pid_t pid, const Now& now);
  // Its hello over the control channel; its connection closed.
  PreCommands hello(int local_rank, bool in_place, bool standby, const Now& now);
  PreCommands closed(int local_rank, const Now& now);
  // A pre-started process ended (not one handed its place); `standby_waiting`: the node is
  // still a standby waiting for a place.
  PreCommands ended(pid_t pid, int wait_status, bool standby_waiting, const Now& now);
  PreCommands timer_fired(const Now& now);
  // The node was given a place: which handles the retire keeps, the others' SIGKILL.
  PreCommands retire(const Now& now);
  // Local rank N's place: the pid of its pre-started worker, which is its from now on
  // (0: none; start a fresh one).
  pid_t take(int local_rank, PreCommands& out);
  // The run is over: stop the pre-started workers first (pre::Finish once none is left).
  PreCommands stop_all(int code, const Now& now);
  // A signal to the agent while stop_all() waits: one that stops the run ends the wait.
  PreCommands signal(int sig, const Now& now);
  // The run finished: nothing is waited for any more.
  PreCommands end();

  // A pre-started worker runs for local rank N (started, not handed its place, not ended).
  bool pending(int local_rank) const { return valid(local_rank) && at(local_rank).pid != 0; }
  bool ready(int local_rank) const { return pending(local_rank) && at(local_rank).ready; }
  bool stopping(int local_rank) const { return pending(local_rank) && at(local_rank).stopping; }
  // stop_all() waits for them.
  bool finishing() const { return finish_code_.has_value(); }

 private:
  struct Entry {
    pid_t pid = 0;          // 0: none (not started, handed its place, or ended)
    bool ready = false;     // said hello with in_place and standby
    bool stopping = false;  // being stopped: its end is expected
    bool closed = false;    // stopped for closing its control connection: ending on its own, maybe
    Clock::time_point started{};
    Clock::time_point hello_by = Clock::time_point::max();  // !ready
    Clock::time_point kill_at = Clock::time_point::max();   // stopping
  };
  bool valid(int lr) const { return lr >= 0 && lr < static_cast<int>(entries_.size()); }
  const Entry& at(int lr) const { return entries_[static_cast<std::size_t>(lr)]; }
  Entry& at(int lr) { return entries_[static_cast<std::size_t>(lr)]; }
  void fall_back(int lr, const std::string& why, bool closed, const Now& now, PreCommands& out);
  // The one timer: the earliest hello or SIGKILL deadline.
  void arm(PreCommands& out) const;
  void finish(PreCommands& out);

  int nproc_;
  std::chrono::milliseconds grace_;
  bool begun_ = false;
  std::vector<Entry> entries_;
  std::optional<int> finish_code_;  // stop_all()'s code while it waits
};

}  // namespace mg::sup
