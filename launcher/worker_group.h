// WorkerGroup: the agent's spawner and its process hygiene, behind the supervision core
// (launcher/supervisor.h decides, this carries out Spawn, SignalWorkers, RetireWorkers and
// the drains). It holds the worker handles of the current attempt (launcher/worker_process,
// used through its public API only), the attempt's retired handles until the event loop
// has left their callbacks, and the unreaped worker leaders for the one reaper.
//
// The agent is a child subreaper: a worker's daemonised grandchild (double fork, setsid)
// becomes the agent's child, so every process a worker started stays among the agent's
// descendants. The group assumes all of the agent's descendants belong to its workers (the
// agent starts nothing else but the watchdog, which is spared).
#pragma once

#include <signal.h>
#include <sys/types.h>

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include <boost/asio/io_context.hpp>

#include "logs/console.h"
#include "process/watchdog.h"
#include "launcher/worker_process.h"

namespace mg {

class WorkerGroup {
 public:
  WorkerGroup(boost::asio::io_context& io, Console& console, Watchdog& watchdog)
      : io_(io), console_(console), watchdog_(watchdog) {}
  ~WorkerGroup() { close(); }
  // Drops every handle (SIGKILLing and reaping its worker) and kills what is left. True
  // when a last scan found nothing below the agent alive but the watchdog: then no process
  // the workers started can remain once the agent exits. Every reap is bounded (kReapBound
  // in all): what could not be reaped by then is in left_behind().
  bool close();
  // The processes the end of the run SIGKILLed but could not reap within kReapBound (a
  // process in state D, or one another process traces), as "pid P (state S)"; empty: none.
  const std::vector<std::string>& left_behind() const { return left_behind_; }
  WorkerGroup(const WorkerGroup&) = delete;
  WorkerGroup& operator=(const WorkerGroup&) = delete;

  // Starts one worker of the current attempt; `on_done` comes from the event loop.
  WorkerProcess& spawn(WorkerSpec spec, WorkerProcess::DoneHandler on_done);
  // Sends `sig` to every worker's process group (one /proc scan for all the groups whose
  // leader was reaped, not one per worker); with `escaped`, also to the descendants
  // outside every live worker's process group.
  void signal(int sig, bool escaped);
  // Sends `sig` to the process groups of the workers of these local ranks.
  void signal_some(int sig, const std::vector<int>& local_ranks);
  // Nothing of a finished attempt may live on into the next one: SIGKILL to what is left,
  // the handles dropped (destroyed from the event loop: we may be inside their callbacks).
  // The live workers of the local ranks in `keep` stay, with their process groups and
  // their descendants (those still below them, or in their groups).
  void retire(const std::vector<int>& keep = {});
  // The end of the run: SIGKILL to every worker's group and every descendant but the
  // watchdog, reaping them (kill_leftovers(true)); true as kill_leftovers.
  bool kill_all();
  // SIGKILLs every descendant but the unreaped worker leaders and the watchdog; with
  // `reap`, waits for the killed children (end of the run; until kReapBound from the first
  // such wait) instead of leaving them to reap(). True when its last scan found nothing to kill.
  bool kill_leftovers(bool reap);
  // The one reaper (on SIGCHLD): every ended child until none is left. A worker leader's
  // status goes to its handle, and the leader stays a zombie (WorkerProcess::held) until
  // its group is SIGKILLed (retire, kill_all, close: release), so that its group's id is
  // never recycled while the agent may still signal the group; a leader in the agent's
  // group is reaped at once. Anything else (an orphan handed to the subreaper) is reaped and
  // dropped. False when the watchdog was among them before the agent let it go (it is
  // forgotten either way).
  bool reap();
  void pause_drains();
  void resume_drains();
  const std::vector<std::unique_ptr<WorkerProcess>>& workers() const { return workers_; }

 private:
  bool is_live_leader(pid_t pid) const { return leaders_.contains(pid); }
  void reap_child(const siginfo_t& si, bool& watchdog_alive);
  // A held zombie's group SIGKILLed and the zombie reaped (WorkerProcess::release).
  void release(WorkerProcess& w);
  void signal_escaped(int sig, const std::vector<ProcStat>& table);

  boost::asio::io_context& io_;
  Console& console_;
  Watchdog& watchdog_;
  std::unordered_map<pid_t, WorkerProcess*> leaders_;  // unreaped worker leaders (alive or held), by pid
  std::vector<std::unique_ptr<WorkerProcess>> workers_;
  std::vector<std::unique_ptr<WorkerProcess>> retired_;
  // The last kill_leftovers() scan found nothing but the watchdog with every leader reaped,
  // and nothing was spawned since: close() needs no scan of its own.
  bool clean_ = false;
  // The end of the run's reaps share one deadline (set by the first).
  std::optional<std::chrono::steady_clock::time_point> reap_deadline_;
  std::chrono::steady_clock::time_point reap_deadline();
  void leave_behind(pid_t pid);
  std::vector<std::string> left_behind_;
};

}  // namespace mg
