// The agent's supervision rules as pure functions: facts in, a decision out, no I/O, no
// clock. The agent (launcher/agent.cc) gathers the facts and carries the decision out.
// A first step towards a full events-in/actions-out core (as rendezvous/job is).
#pragma once

#include <signal.h>

#include <optional>
#include <string>
#include <vector>

#include "cli/errors.h"
#include "launcher/report.h"

namespace mg {

// What the agent does once every worker of a group it was stopping has ended.
enum class AfterStop {
  kStoppedBySignal,  // the agent itself got SIGTERM/SIGINT/SIGHUP: leave with 128+signal, or with
                     // our root cause's code when a worker failed before the signal came
  kAbort,            // the rendezvous aborted the job: print its root cause, exit its code
  kRejoin,           // the rendezvous decided a restart: join the next round
  kReportFailure,    // our worker failed: tell the rendezvous, which decides for every node
  kWait,             // multi-node, nothing to tell: wait for the rendezvous
  kRestart,          // single node, restarts left: start the next attempt
  kGiveUp,           // single node, restarts spent: print the root cause, exit its code
  kEndWithoutCause,  // stopped for a rendezvous that is gone: exit with node_exit_code()
};

struct StopFacts {
  int agent_signal = 0;   // the signal stopping the agent, 0 if none
  bool rdzv = false;      // a rendezvous server still decides for this node
  bool abort = false;     // an Abort was received
  bool rejoin = false;    // a Restart was received while running
  bool root_cause = false;  // one of our workers failed first
  int restart_count = 0;
  int max_restarts = 0;
  bool rdzv_lost = false;   // a rendezvous decided for this node once and is gone
};

inline AfterStop after_stop(const StopFacts& f) {
  // An abort already decided for the job wins over a signal that came during the stop
  // (srun --kill-on-bad-exit sends one as soon as any node exits).
  if (f.rdzv && f.abort) return AfterStop::kAbort;
  if (f.agent_signal) return AfterStop::kStoppedBySignal;
  if (f.rdzv) {
    if (f.abort) return AfterStop::kAbort;
    if (f.rejoin) return AfterStop::kRejoin;
    return f.root_cause ? AfterStop::kReportFailure : AfterStop::kWait;
  }
  if (!f.root_cause) return AfterStop::kEndWithoutCause;
  // A node that lost its rendezvous cannot restart its share of a job on its own: the other
  // nodes' workers would not restart with it (each attempt would wait for them in vain).
  if (f.rdzv_lost) return AfterStop::kGiveUp;
  return f.restart_count < f.max_restarts ? AfterStop::kRestart : AfterStop::kGiveUp;
}

// The exit code of a node that ends without a decision of the rendezvous: its root cause's
// code, else its last attempt's first non-zero worker code (in the order they ended); never
// 0 unless every worker of the last attempt exited 0 by itself; kRendezvous when none ran.
inline int node_exit_code(const std::optional<RootCause>& root_cause, const std::vector<AttemptRecord>& attempts) {
  if (root_cause) return root_cause->worker.exit_code;
  if (attempts.empty() || attempts.back().workers.empty()) return exit_code::kRendezvous;
  const auto& ws = attempts.back().workers;
  for (const auto& w : ws)
    if (w.exit_code != 0) return w.exit_code;
  for (const auto& w : ws)
    if (w.stopped_by_agent) return exit_code::kRendezvous;
  return exit_code::kOk;
}

// What the agent does with a signal sent to it.
enum class OnSignal {
  kForward,            // SIGUSR1/SIGUSR2: pass on to every worker group, keep running
  kKillNow,            // a second SIGINT: SIGKILL everything at once
  kEndWhileWaiting,    // no workers running (waiting for the rendezvous): exit 128+signal
  kForwardWhileStopping,  // a stop is under way: pass the signal on, keep the grace timer
  kStop,               // stop the group (SIGTERM-like, then SIGKILL after --grace)
};

struct SignalFacts {
  int sig = 0;
  int interrupts = 0;  // SIGINTs seen so far, this one included
  bool waiting = false;
  bool stopping = false;
};

inline OnSignal on_agent_signal(const SignalFacts& f) {
  if (f.sig == SIGUSR1 || f.sig == SIGUSR2) return OnSignal::kForward;
  if (f.sig == SIGINT && f.interrupts >= 2) return OnSignal::kKillNow;
  if (f.waiting) return OnSignal::kEndWhileWaiting;
  return f.stopping ? OnSignal::kForwardWhileStopping : OnSignal::kStop;
}

// When a worker failed because its torch has no libuv (Debian's torch 2.x) and was asked
// for a libuv TCPStore (torch 2.x's default; its last stderr lines hold "use_libuv was
// requested but PyTorch was build without libuv support"), the root cause's message: what
// to set. Empty otherwise.
inline std::string libuv_hint(const std::vector<std::string>& stderr_tail) {
  for (const auto& l : stderr_tail)
    if (l.find("use_libuv was requested but PyTorch was build without libuv support") != std::string::npos)
      return "this torch is built without libuv (as Debian's torch 2.x is) and the worker asked for a libuv "
             "TCPStore, torch 2.x's default: set USE_LIBUV=0 for the workers (env:// reads it), or pass "
             "use_libuv=False to the TCPStore it creates";
  return {};
}

}  // namespace mg
