// WorkerLauncher: the agent's seam for processes, at the level the agent uses them: start
// a worker from its WorkerSpec, signal the attempt's workers, retire them, and learn of
// each worker's end. ProcessLauncher is the real one (the WorkerGroup of WorkerProcess
// handles, the one SIGCHLD reaper, the watchdog and the exec fence); tests drive the agent
// with a fake (tests/agent_seams_test.cc). Everything runs on the agent's io_context.
#pragma once

#include <sys/types.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <boost/asio/io_context.hpp>

#include "launcher/worker_process.h"

namespace mg {

class Console;

// A worker that ended: its exit was reaped and its output drained.
struct WorkerEnd {
  int rank = 0, local_rank = 0;
  pid_t pid = -1;
  int wait_status = 0;  // raw waitpid status
  double duration_s = 0;
  std::string spawn_error;  // why its program could not run ("execve: ..."), "" if it ran
  std::vector<std::string> stderr_tail;  // its last stderr lines
};

// A worker of the current attempt, as the monitor shows it.
struct WorkerState {
  int rank = 0, local_rank = 0;
  pid_t pid = -1;
  bool exited = false;
  int wait_status = 0;
};

class WorkerLauncher {
 public:
  using Notice = std::function<void(const std::string&)>;
  using Ended = std::function<void(const WorkerEnd&)>;
  virtual ~WorkerLauncher() = default;

  // Before the first worker: whatever the launcher needs to keep every process the workers
  // start within reach (the real one: the agent becomes a child subreaper, reaps on SIGCHLD,
  // starts the watchdog, which removes `temporary_tree` when not empty and the agent is
  // killed). What did not work comes as notices; the run goes on.
  virtual void prepare(const std::string& temporary_tree, Notice notice) = 0;
  // The value of MGLAUNCH_RUN_MARK for the workers ("" : none), given the inherited one.
  virtual std::string run_mark(const std::string& inherited) const = 0;
  // Starts one worker of the current attempt and returns its pid. `ended` comes from the
  // event loop, also for a worker whose program could not run (status 127, spawn_error).
  virtual pid_t start(WorkerSpec spec, Ended ended) = 0;
  // `sig` to every worker's process group; with `escaped`, also to the descendants outside them.
  virtual void signal(int sig, bool escaped) = 0;
  // `sig` to the process groups of the workers of these local ranks only.
  virtual void signal_some(int sig, const std::vector<int>& local_ranks) = 0;
  // Nothing of a finished attempt lives on into the next one: SIGKILL to what is left, the
  // handles dropped; but the workers of the local ranks in `keep` (paused for in-place
  // recovery), their process groups and their descendants stay, with their handles.
  virtual void retire(const std::vector<int>& keep) = 0;
  // A kept worker takes its place in the new attempt: its global rank (and the line
  // prefix, WorkerSpec::prefix, of that rank) from now on.
  virtual void reassign(int local_rank, int rank, const std::string& prefix) = 0;
  virtual void pause_drains() = 0;   // Ctrl-Z: an ended worker's output drain waits
  virtual void resume_drains() = 0;  // SIGCONT: the drains start over
  virtual void window_changed() = 0;  // SIGWINCH: the workers' terminals take the new size
  virtual std::vector<WorkerState> workers() const = 0;
  // The exec fence (sup::act::OpenExecFence, WatchExecs): the workers started after open
  // are watched; `settled` comes from the event loop once each has exec'd or exited,
  // never when the fence was dropped first.
  virtual void open_exec_fence() = 0;
  virtual void watch_execs(std::function<void()> settled) = 0;
  virtual void drop_exec_fence() = 0;
  // The end of the run: no more reaping; SIGKILL to every worker and what they started,
  // reaped; with nothing left, the watchdog may go.
  virtual void finish() = 0;
  // The agent is going: every handle dropped (SIGKILLing what still runs) and the watchdog
  // let go, without waiting for it; the destructor waits (the agent tidies up meanwhile).
  virtual void close() = 0;
};

// The real processes. `console` relays the workers' output and outlives the launcher.
// Destroying it closes it first when the agent did not.
std::unique_ptr<WorkerLauncher> make_process_launcher(boost::asio::io_context& io, Console& console);

}  // namespace mg
