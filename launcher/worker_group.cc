#include "launcher/worker_group.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <unordered_set>

#include <boost/asio/post.hpp>
#include <fmt/format.h>

#include "process/reap.h"

namespace mg {

bool WorkerGroup::close() {
  // Nothing below the agent at the last scan and no worker left to reap since: nothing can
  // have started since either (only a live descendant could have started it).
  const bool known_clean = clean_ && leaders_.empty();
  for (auto* list : {&workers_, &retired_})
    for (auto& w : *list)
      if ((!w->exited() || w->held()) && w->pid() > 0 && !w->left_behind() && !w->kill_and_reap(reap_deadline()))
        leave_behind(w->pid());
  leaders_.clear();
  workers_.clear();  // (SIGKILLed and reaped above, or left behind)
  retired_.clear();
  return known_clean || (kill_leftovers(/*reap=*/true) && left_behind_.empty());
}

std::chrono::steady_clock::time_point WorkerGroup::reap_deadline() {
  if (!reap_deadline_) reap_deadline_ = std::chrono::steady_clock::now() + kReapBound;
  return *reap_deadline_;
}

void WorkerGroup::leave_behind(pid_t pid) {
  const auto st = read_proc_stat(pid);
  const std::string what = fmt::format("pid {} (state {})", pid, st ? st->state : '?');
  if (std::find(left_behind_.begin(), left_behind_.end(), what) == left_behind_.end()) left_behind_.push_back(what);
}

WorkerProcess& WorkerGroup::spawn(WorkerSpec spec, WorkerProcess::DoneHandler on_done) {
  clean_ = false;
  workers_.push_back(std::make_unique<WorkerProcess>(io_, std::move(spec), console_, std::move(on_done)));
  WorkerProcess& w = *workers_.back();
  if (w.pid() > 0) leaders_[w.pid()] = &w;
  return w;
}

void WorkerGroup::signal(int sig, bool escaped) {
  for (auto& w : workers_) w->signal_group(sig);
  if (escaped) signal_escaped(sig, scan_family(::getpid()));
}

void WorkerGroup::signal_escaped(int sig, const std::vector<ProcStat>& table) {
  // The agent's own group holds the family of a worker in it (WorkerSpec::in_agent_group),
  // which that worker's signal_group() reached already.
  const bool family_in_agent_group =
      std::any_of(workers_.begin(), workers_.end(), [](const auto& w) { return w->spec().in_agent_group; });
  const pid_t agent_group = ::getpgrp();
  for (const auto& p : descendants_of(table, ::getpid())) {
    if (p.pid == watchdog_.pid()) continue;
    const bool in_worker_group = leaders_.contains(p.pgrp) || (family_in_agent_group && p.pgrp == agent_group);
    if (!in_worker_group && !is_live_leader(p.pid)) signal_same_process(p, sig);
  }
}

void WorkerGroup::signal_some(int sig, const std::vector<int>& local_ranks) {
  for (auto& w : workers_)
    if (std::find(local_ranks.begin(), local_ranks.end(), w->spec().local_rank) != local_ranks.end())
      w->signal_group(sig);
}

void WorkerGroup::retire(const std::vector<int>& keep) {
  // SIGKILL to every worker's group and to every other descendant but the unreaped
  // leaders, the kept workers' families and the watchdog (reap() reaps them), from one scan.
  const pid_t self = ::getpid();
  const std::vector<ProcStat> table = scan_family(self);
  std::vector<std::unique_ptr<WorkerProcess>> kept;
  std::unordered_set<pid_t> spared;  // the kept workers' process groups and descendants
  for (auto& w : workers_) {
    // (kept until done: a handle dropped before its output drained would be read into after)
    const bool stays = !w->done() && w->pid() > 0 &&
                       std::find(keep.begin(), keep.end(), w->spec().local_rank) != keep.end();
    if (!stays) {
      w->signal_group(SIGKILL);
      release(*w);
      continue;
    }
    spared.insert(w->pid());
    for (const auto& p : descendants_of(table, w->pid())) spared.insert(p.pid);
  }
  const pid_t agent_group = ::getpgrp();
  for (const auto& p : descendants_of(table, self)) {
    if (is_live_leader(p.pid) || p.pid == watchdog_.pid() || spared.contains(p.pid)) continue;
    bool in_kept_group = false;
    for (auto& w : workers_)
      if (spared.contains(w->pid()) && p.pgrp == (w->spec().in_agent_group ? agent_group : w->pid()))
        in_kept_group = true;
    if (!in_kept_group) signal_same_process(p, SIGKILL);
  }
  for (auto& p : workers_) {
    if (spared.contains(p->pid()) && !p->done()) kept.push_back(std::move(p));
    else retired_.push_back(std::move(p));
  }
  workers_ = std::move(kept);
  boost::asio::post(io_, [this] {
    // A retired worker still running is SIGKILLed and reaped by its handle's destructor:
    // the reaper must not look its pid up any more.
    for (const auto& w : retired_)
      if (auto it = leaders_.find(w->pid()); it != leaders_.end() && it->second == w.get()) leaders_.erase(it);
    retired_.clear();
  });
}

bool WorkerGroup::kill_all() {
  // A reaped leader's group holds only descendants of the agent (a subreaper keeps them
  // all), which kill_leftovers() kills one by one: no scan for the groups first.
  for (auto& w : workers_)
    if (!w->exited() || w->held()) w->signal_group(SIGKILL);
  // The leaders too are reaped here, by the deadline: the reaper (SIGCHLD) is gone by now.
  for (auto& w : workers_)
    if ((!w->exited() || w->held()) && w->pid() > 0 && !w->left_behind()) {
      leaders_.erase(w->pid());
      if (!w->kill_and_reap(reap_deadline())) leave_behind(w->pid());
    }
  return kill_leftovers(/*reap=*/true) && left_behind_.empty();
}

bool WorkerGroup::kill_leftovers(bool reap) {
  const pid_t self = ::getpid();
  // A few rounds: a process may fork between the scan and its SIGKILL.
  for (int round = 0; round < 10; ++round) {
    std::unordered_set<pid_t> victims;
    for (const auto& p : descendants_of(scan_family(self), self))
      if (!is_live_leader(p.pid) && p.pid != watchdog_.pid()) {
        victims.insert(p.pid);
        signal_same_process(p, SIGKILL);  // only the process scanned, never a later one given its pid
      }
    if (victims.empty()) {
      clean_ = leaders_.empty();
      return true;
    }
    if (!reap) return false;  // reap() reaps them
    // Waits only for children that cannot outlive them (killed ones, zombies), and only
    // until the deadline: one in state D, or traced by another process, is left behind.
    for (const auto& p : scan_family(self)) {
      if (p.ppid != self || is_live_leader(p.pid) || p.pid == watchdog_.pid()) continue;
      if (p.state != 'Z' && !victims.contains(p.pid)) continue;
      int status = 0;
      if (!reap_by(p.pid, reap_deadline(), status)) leave_behind(p.pid);
    }
    if (!left_behind_.empty() && std::chrono::steady_clock::now() >= reap_deadline()) return false;
  }
  return false;
}

namespace {
// waitpid's status word for what waitid says of an ended child.
int wait_status_of(const siginfo_t& si) {
  switch (si.si_code) {
    case CLD_EXITED: return (si.si_status & 0xff) << 8;
    case CLD_KILLED: return si.si_status & 0x7f;
    case CLD_DUMPED: return (si.si_status & 0x7f) | 0x80;
    default: return 0;
  }
}
}  // namespace

bool WorkerGroup::reap() {
  bool watchdog_alive = true;
  for (;;) {
    siginfo_t si{};  // the next ended child, looked at, not reaped (WNOWAIT)
    if (::waitid(P_ALL, 0, &si, WEXITED | WNOHANG | WNOWAIT) != 0) {
      if (errno == EINTR) continue;
      return watchdog_alive;
    }
    if (si.si_pid == 0) return watchdog_alive;
    if (auto it = leaders_.find(si.si_pid); it != leaders_.end() && it->second->held()) {
      // A held zombie comes first again and again: the others are found through /proc.
      for (const auto& p : scan_family(::getpid())) {
        if (p.ppid != ::getpid() || (leaders_.contains(p.pid) && leaders_.at(p.pid)->held())) continue;
        siginfo_t one{};
        if (::waitid(P_PID, static_cast<id_t>(p.pid), &one, WEXITED | WNOHANG | WNOWAIT) == 0 && one.si_pid == p.pid)
          reap_child(one, watchdog_alive);
      }
      return watchdog_alive;
    }
    reap_child(si, watchdog_alive);
  }
}

void WorkerGroup::reap_child(const siginfo_t& si, bool& watchdog_alive) {
  const pid_t pid = si.si_pid;
  if (auto it = leaders_.find(pid); it != leaders_.end()) {
    WorkerProcess* w = it->second;
    if (!w->spec().in_agent_group) {
      // Its zombie keeps the group's id until the group is SIGKILLed (release): a signal to
      // the group meanwhile cannot reach another group that took a recycled id.
      w->on_exit(wait_status_of(si), /*held=*/true);
      return;
    }
    leaders_.erase(it);
    int status = 0;
    while (::waitpid(pid, &status, WNOHANG) < 0 && errno == EINTR) {
    }
    w->on_exit(status);
    return;
  }
  int status = 0;
  while (::waitpid(pid, &status, WNOHANG) < 0 && errno == EINTR) {
  }
  if (pid == watchdog_.pid()) {
    // Its exit is news only while the agent still holds the pipe (not yet let go).
    watchdog_alive = watchdog_.let_go_done();
    watchdog_.forget();
  }
}

void WorkerGroup::release(WorkerProcess& w) {
  if (!w.held()) return;
  if (auto it = leaders_.find(w.pid()); it != leaders_.end() && it->second == &w) leaders_.erase(it);
  w.release();
}

void WorkerGroup::pause_drains() {
  for (auto& w : workers_) w->pause_drain();
}

void WorkerGroup::resume_drains() {
  for (auto& w : workers_) w->resume_drain();
}

}  // namespace mg
