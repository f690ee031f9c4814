#include "launcher/prestart.h"

#include <signal.h>
#include <sys/wait.h>

#include <algorithm>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "control/protocol.h"
#include "launcher/report.h"
#include "process/command.h"

namespace mg::sup {

namespace {
// One out-of-line append per command type (GCC 12 -O2 warns falsely about the variant's
// storage when push_back is inlined into the loops).
template <class C>
[[gnu::noinline]] void add(PreCommands& out, C c) {
  out.emplace_back(std::in_place_type<C>, std::move(c));
}
double seconds(std::chrono::milliseconds d) { return std::chrono::duration<double>(d).count(); }
}  // namespace

PreCommands Prestart::begin(bool standby_waiting, bool control, const Now& now) {
  (void)now;
  PreCommands out;
  if (begun_ || !standby_waiting) return out;
  if (!control) {
    add(out, pre::Notice{
        "--prestart-standby: no control channel (see above): the workers start when this node is given a place"});
    return out;
  }
  begun_ = true;
  entries_.assign(static_cast<std::size_t>(nproc_), {});
  for (int lr = 0; lr < nproc_; ++lr) add(out, pre::Start{lr});
  add(out, pre::Notice{fmt::format("standby: {} worker(s) started ahead with {}=1 (--prestart-standby); they "
                                        "load and wait for this node's place",
                                        nproc_, control::kStandbyVar)});
  return out;
}

PreCommands Prestart::started(int lr, pid_t pid, const Now& now) {
  PreCommands out;
  if (!valid(lr)) return out;
  Entry& e = at(lr);
  e = {};
  e.pid = pid;
  e.started = now.steady;
  e.hello_by = now.steady + kHello;
  add(out, pre::Trace{"prestart", {{"local_rank", lr}, {"pid", pid}}});
  arm(out);
  return out;
}

void Prestart::arm(PreCommands& out) const {
  auto next = Clock::time_point::max();
  for (const Entry& e : entries_)
    if (e.pid) next = std::min(next, e.stopping ? e.kill_at : e.ready ? next : e.hello_by);
  if (next == Clock::time_point::max()) add(out, pre::CancelTimer{});
  else add(out, pre::ArmTimer{next});
}

PreCommands Prestart::timer_fired(const Now& now) {
  PreCommands out;
  std::vector<int> late;
  bool within_grace = false;  // a worker being stopped whose SIGKILL is not due yet
  for (int lr = 0; lr < static_cast<int>(entries_.size()); ++lr) {
    Entry& e = at(lr);
    if (!e.pid) continue;
    if (e.stopping && e.kill_at <= now.steady) {
      late.push_back(lr);
      e.kill_at = Clock::time_point::max();  // once
    } else if (e.stopping && e.kill_at != Clock::time_point::max()) {
      within_grace = true;
    } else if (!e.stopping && !e.ready && e.hello_by <= now.steady) {
      fall_back(lr, fmt::format("said no hello with \"standby\" within {} s", kHello.count()), false, now, out);
      within_grace = true;
    }
  }
  if (!late.empty()) {
    add(out, pre::Notice{fmt::format(
        "pre-started worker(s) of local rank(s) {} still running {:.1f}s after SIGTERM: sending SIGKILL",
        fmt::join(late, ","), seconds(grace_))});
    if (finish_code_ && !within_grace) {
      finish(out);  // the agent's finish SIGKILLs and reaps what is left
      return out;
    }
    add(out, pre::Signal{SIGKILL, late, false});
  }
  arm(out);
  return out;
}

PreCommands Prestart::hello(int lr, bool in_place, bool standby, const Now& now) {
  PreCommands out;
  if (!pending(lr) || at(lr).stopping) return out;
  if (!in_place || !standby) {
    fall_back(lr,
              in_place ? "said hello without \"standby\" (it cannot wait for a place)"
                       : "said hello without \"in_place\"",
              false, now, out);
    return out;
  }
  at(lr).ready = true;
  add(out, pre::Trace{"prestart ready", {{"local_rank", lr}, {"pid", at(lr).pid}}});
  arm(out);
  return out;
}

PreCommands Prestart::closed(int lr, const Now& now) {
  PreCommands out;
  fall_back(lr, "closed its control connection", /*closed=*/true, now, out);
  return out;
}

void Prestart::fall_back(int lr, const std::string& why, bool closed, const Now& now, PreCommands& out) {
  if (!pending(lr) || at(lr).stopping) return;
  Entry& e = at(lr);
  e.stopping = true;
  e.closed = closed;
  e.ready = false;
  e.kill_at = now.steady + grace_;  // its own: an earlier one's SIGKILL is not put off
  // (A worker that exits closes its connection first: what follows is said at its end.)
  add(out, pre::Notice{fmt::format("--prestart-standby: local rank {}'s pre-started worker (pid {}) {}: stopping "
                                        "it{}",
                                        lr, e.pid, why,
                                        closed ? "" : "; a fresh worker starts when this node is given a place")});
  add(out, pre::Signal{SIGTERM, {lr}, /*cont=*/true});
  arm(out);
}

PreCommands Prestart::ended(pid_t pid, int wait_status, bool standby_waiting, const Now& now) {
  PreCommands out;
  for (int lr = 0; lr < static_cast<int>(entries_.size()); ++lr) {
    Entry& e = at(lr);
    if (e.pid != pid || pid == 0) continue;
    const std::string how = WIFSIGNALED(wait_status) ? fmt::format("signal {}", signal_name(WTERMSIG(wait_status)))
                                                     : fmt::format("exit code {}", shell_exit_code(wait_status));
    // Stopped by the agent, for a reason of the agent's (one that closed its connection was
    // most likely ending on its own).
    const bool stopped = e.stopping && (!e.closed || finish_code_);
    const double lived = std::chrono::duration<double>(now.steady - e.started).count();
    e = {};
    add(out, pre::Forget{lr});  // no other worker of this local rank runs
    if (stopped) continue;
    // Ended on its own while the node waits (a worker that bounds its wait, a crash): another
    // takes its place ahead, unless it ended soon after its start (it would again).
    if (lived >= std::chrono::duration<double>(kMinLife).count() && !finish_code_ && standby_waiting) {
      add(out, pre::Notice{fmt::format("--prestart-standby: local rank {}'s pre-started worker (pid {}) ended "
                                            "({}) after {:.0f} s before this node was given a place: starting another",
                                            lr, pid, how, lived)});
      add(out, pre::Start{lr});
      continue;
    }
    add(out, pre::Notice{fmt::format("--prestart-standby: local rank {}'s pre-started worker (pid {}) ended ({}) "
                                          "before this node was given a place: a fresh worker starts then",
                                          lr, pid, how)});
  }
  if (finish_code_ && std::none_of(entries_.begin(), entries_.end(), [](const Entry& e) { return e.pid != 0; }))
    finish(out);
  else
    arm(out);
  return out;
}

PreCommands Prestart::retire(const Now& now) {
  (void)now;
  PreCommands out;
  for (int lr = 0; lr < static_cast<int>(entries_.size()); ++lr) {
    Entry& e = at(lr);
    if (!e.pid) continue;
    add(out, pre::Keep{lr});
    if (e.ready) continue;  // handed its place by take()
    if (!e.stopping)
      add(out, pre::Notice{fmt::format("--prestart-standby: local rank {}'s pre-started worker (pid {}) said no "
                                            "hello with \"standby\" before this node was given a place: killed; a "
                                            "fresh worker takes it",
                                            lr, e.pid)});
    // Killed, but its handle stays until it ended and its output drained (not dropped live
    // by the retire); its end finds no entry: it is no worker's.
    add(out, pre::Signal{SIGKILL, {lr}, false});
    e = {};
  }
  arm(out);
  return out;
}

pid_t Prestart::take(int lr, PreCommands& out) {
  if (!pending(lr)) return 0;
  const pid_t pid = at(lr).pid;
  at(lr) = {};
  arm(out);
  return pid;
}

PreCommands Prestart::stop_all(int code, const Now& now) {
  PreCommands out;
  std::vector<int> running, to_stop;
  for (int lr = 0; lr < static_cast<int>(entries_.size()); ++lr) {
    Entry& e = at(lr);
    if (!e.pid) continue;
    running.push_back(lr);
    if (e.stopping) continue;  // stopped already, by its own deadline
    e.stopping = true;
    e.kill_at = now.steady + grace_;
    to_stop.push_back(lr);
  }
  finish_code_ = code;
  if (running.empty()) {
    finish(out);
    return out;
  }
  add(out, pre::Notice{fmt::format("stopping this standby's {} pre-started worker(s): SIGTERM, SIGKILL after "
                                        "{:.1f}s",
                                        running.size(), seconds(grace_))});
  if (!to_stop.empty()) add(out, pre::Signal{SIGTERM, to_stop, /*cont=*/true});
  arm(out);
  return out;
}

PreCommands Prestart::signal(int sig, const Now& now) {
  (void)now;
  PreCommands out;
  if (!finish_code_ || sig == SIGUSR1 || sig == SIGUSR2) return out;  // those two do not stop the run
  // Another signal does not wait for them (as a second Ctrl-C does not wait for the workers).
  add(out, pre::Notice{fmt::format(
      "got {} while stopping this standby's pre-started workers: killing them now (SIGKILL)", signal_name(sig))});
  finish(out);
  return out;
}

void Prestart::finish(PreCommands& out) {
  const int code = finish_code_.value_or(0);
  finish_code_.reset();
  add(out, pre::CancelTimer{});
  add(out, pre::Finish{code});
}

PreCommands Prestart::end() {
  finish_code_.reset();
  PreCommands out;
  add(out, pre::CancelTimer{});
  return out;
}

}  // namespace mg::sup
