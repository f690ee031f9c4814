#include "launcher/supervisor.h"

#include <signal.h>

#include <algorithm>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "cli/errors.h"

namespace mg::sup {

namespace {
double seconds(std::chrono::milliseconds ms) { return static_cast<double>(ms.count()) / 1000.0; }
}  // namespace

Actions Supervisor::start(const Now& now) {
  Actions out;
  // A port mglaunch chose is held from the start (the rendezvous offers it to the others).
  if (cfg_.port_is_ours && cfg_.master_port > 0) hold_port(/*fresh=*/false, out);
  if (cfg_.rdzv) {
    rdzv_ = true;
    state_ = State::kWaiting;
    out.push_back(act::JoinRendezvous{});
  } else {
    start_attempt(now, out);
  }
  return out;
}

void Supervisor::start_attempt(const Now& now, Actions& out) {
  state_ = State::kRunning;
  root_cause_.reset();
  attempts_.push_back({restart_count_, now.wall, 0, {}});
  attempt_start_ = now.steady;
  out.push_back(act::AttemptStarted{restart_count_});
  spawned_ = 0;
  done_ = 0;
  spawn_batch(++gen_, now, out);
}

Actions Supervisor::spawn_batch_due(std::uint64_t gen, const Now& now) {
  Actions out;
  spawn_batch(gen, now, out);
  return out;
}

void Supervisor::spawn_batch(std::uint64_t gen, const Now& now, Actions& out) {
  // An attempt that is over or stopping: nothing to start, and the master port stays as
  // it is (held for the next attempt or round by then).
  if (gen != gen_ || state_ != State::kRunning) return;
  // A batch at a time, then back to the event loop: exits and failures are handled while
  // the rest start, so a run of many short workers never holds all their descriptors and
  // zombies at once.
  const int end = std::min(cfg_.nproc, spawned_ + std::max(1, cfg_.spawn_batch));
  if (spawned_ == 0 && port_held_) out.push_back(act::OpenExecFence{});
  while (state_ == State::kRunning && spawned_ < end) {
    const auto lr = static_cast<std::size_t>(spawned_++);
    if (ranks_[lr].paused) {  // kept in place: its handle counts already
      if (ranks_[lr].acked) assign(static_cast<int>(lr), out);
      else ranks_[lr].assign_held = true;  // once it answered its pause, or SIGKILL and a new one (timer_fired)
      continue;
    }
    if (ranks_[lr].closing) {  // its old process is still being stopped: the new one starts after it ended
      ranks_[lr].respawn = true;
      continue;
    }
    out.push_back(act::Spawn{static_cast<int>(lr), restart_count_});
    ranks_[lr].live = true;
    ranks_[lr].in_place = false;  // a new process: not opted in until it says so
    ++handles_;
  }
  if (state_ == State::kRunning && spawned_ < cfg_.nproc) {
    out.push_back(act::SpawnMoreLater{gen});
    return;
  }
  if (!port_held_) return;
  // Every worker started: the port goes once each has exec'd or exited, or after
  // kExecFenceTimeout (one stopped before its exec must not keep it), so that a worker
  // binding it without SO_REUSEADDR finds it free.
  fence_pending_ = true;
  fence_due_ = now.steady + Config::kExecFenceTimeout;
  out.push_back(act::ArmTimer{Timer::kFence, fence_due_});
  out.push_back(act::WatchExecs{});
}

void Supervisor::hold_port(bool fresh, Actions& out) {
  if (fence_pending_) {  // a release still waiting was for the port this one replaces
    fence_pending_ = false;
    out.push_back(act::CancelTimer{Timer::kFence});
  }
  port_held_ = true;
  out.push_back(act::HoldMasterPort{fresh});
}

void Supervisor::release_port(Actions& out) {
  fence_pending_ = false;
  port_held_ = false;
  out.push_back(act::CancelTimer{Timer::kFence});
  out.push_back(act::ReleaseMasterPort{});
}

Actions Supervisor::execs_settled(const Now&) {
  Actions out;
  if (fence_pending_) release_port(out);
  return out;
}

Actions Supervisor::attempt_due(const Now& now) {
  Actions out;
  if (state_ != State::kDone) start_attempt(now, out);
  return out;
}

bool Supervisor::closing_ended(const WorkerOutcome& o, Actions& out) {
  if (!valid(o.local_rank) || !ranks_[static_cast<std::size_t>(o.local_rank)].closing) return false;
  const auto lr = static_cast<std::size_t>(o.local_rank);
  ranks_[lr].closing = false;
  ranks_[lr].live = ranks_[lr].in_place = false;
  --handles_;  // a handle kept from the attempt before: no worker of this one
  arm_closing(out);
  if (ranks_[lr].respawn) {
    ranks_[lr].respawn = false;
    if (state_ == State::kRunning) {
      out.push_back(act::Spawn{o.local_rank, restart_count_});
      ranks_[lr].live = true;
      ++handles_;
    }
  }
  return true;
}

Actions Supervisor::worker_ended(WorkerOutcome o, const Now& now, const RootCauseDetails& details) {
  Actions out;
  if (state_ == State::kDone || attempts_.empty()) return out;
  if (valid(o.local_rank) && state_ == State::kRunning && ranks_[static_cast<std::size_t>(o.local_rank)].paused) {
    // Kept for this attempt, ended before its Assign (held for its answer, or its turn not
    // come yet): no worker of the attempt; a new process takes its place (closing_ended).
    const auto lr = static_cast<std::size_t>(o.local_rank);
    notice(fmt::format("local rank {} ended while paused: it is started anew", o.local_rank), out);
    ranks_[lr].paused = ranks_[lr].acked = false;
    ranks_[lr].closing = true;
    ranks_[lr].closing_due = Clock::time_point::max();
    ranks_[lr].respawn = ranks_[lr].assign_held;
    ranks_[lr].assign_held = false;
  }
  if (closing_ended(o, out)) {
    // Not a worker of the attempt under way: neither recorded nor a root cause; a stop may
    // have waited for it.
    if (state_ == State::kStopping && stop_complete()) {
      out.push_back(act::AttemptEnded{restart_count_, true});
      group_stopped(now, out);
    } else if (state_ == State::kRunning && spawned_ == cfg_.nproc && done_ >= handles_) {
      out.push_back(act::AttemptEnded{restart_count_, root_cause_.has_value()});
      attempts_.back().duration_s = std::chrono::duration<double>(now.steady - attempt_start_).count();
      if (rdzv_) {
        state_ = State::kWaiting;
        out.push_back(act::SendNodeDone{round_});
      } else {
        finish(exit_code::kOk, out);
      }
    }
    return out;
  }
  o.stopped_by_agent = state_ != State::kRunning;
  attempts_.back().workers.push_back(o);
  // The first failure of a running attempt is its root cause; later ones are the stop's doing.
  const bool cause = state_ == State::kRunning && o.exit_code != 0;
  out.push_back(act::WorkerEnded{o, restart_count_, cause});
  if (valid(o.local_rank)) {
    const auto lr = static_cast<std::size_t>(o.local_rank);
    if (ranks_[lr].paused)
      notice(fmt::format("local rank {} ended while paused: it is started anew in the next attempt", o.local_rank), out);
    Rank& r = ranks_[lr];
    r.live = r.in_place = r.paused = r.acked = r.assign_held = false;
  }
  if (cause) {
    RootCause rc;
    if (details) {
      rc = details();
    } else {  // nothing to gather: the outcome alone
      rc.time = time_text(now.wall);
      rc.host = cfg_.host;
    }
    rc.worker = o;
    root_cause_ = std::move(rc);
    // While restarts remain (this node's count; with a rendezvous it decides, and an abort
    // stops the paused workers after all), the workers that opted in wait in place.
    if (restart_count_ < cfg_.max_restarts)
      pause_in_place(fmt::format("rank {} (local_rank {}) on {} failed with exit code {}", o.rank, o.local_rank,
                                 cfg_.host, o.exit_code),
                     "worker", now, out);
    stop_group(SIGTERM, now, out);
  }
  // Ranks still to start count while running; once stopping, they never will.
  ++done_;
  if (state_ == State::kWaiting) return out;  // a paused worker ended between rounds
  const bool all_done = (state_ == State::kRunning ? done_ >= handles_ : stop_complete()) &&
                        (spawned_ == cfg_.nproc || state_ != State::kRunning);
  if (!all_done) return out;
  out.push_back(act::AttemptEnded{restart_count_, state_ != State::kRunning || root_cause_.has_value()});
  if (state_ == State::kRunning) {
    attempts_.back().duration_s = std::chrono::duration<double>(now.steady - attempt_start_).count();
    if (rdzv_) {
      state_ = State::kWaiting;  // the job is done when every node is
      out.push_back(act::SendNodeDone{round_});
      return out;
    }
    finish(exit_code::kOk, out);
  } else if (state_ == State::kStopping) {
    group_stopped(now, out);
  }
  return out;
}

void Supervisor::assign(int local_rank, Actions& out) {
  const auto lr = static_cast<std::size_t>(local_rank);
  ranks_[lr].paused = ranks_[lr].acked = ranks_[lr].assign_held = false;
  out.push_back(act::Assign{local_rank, rdzv_ ? round_ : restart_count_, restart_count_});
  arm_closing(out);  // its answer deadline is gone
}

int Supervisor::paused_count() const {
  return static_cast<int>(std::count_if(ranks_.begin(), ranks_.end(), [](const Rank& r) { return r.paused; }));
}

bool Supervisor::pause_in_place(const std::string& reason, const std::string& lost, const Now& now, Actions& out) {
  std::string ranks;
  for (int lr = 0; lr < cfg_.nproc; ++lr) {
    const auto i = static_cast<std::size_t>(lr);
    if (!ranks_[i].live || !ranks_[i].in_place || ranks_[i].paused) continue;
    ranks_[i].paused = true;
    ranks_[i].acked = false;
    ranks_[i].ack_due = now.steady + cfg_.grace;  // the time a stopped worker has to exit
    out.push_back(act::Pause{lr, rdzv_ ? round_ : restart_count_, reason, lost});
    ranks += (ranks.empty() ? "" : ",") + std::to_string(lr);
  }
  if (ranks.empty()) return false;
  arm_closing(out);
  notice(fmt::format("in-place recovery: local rank(s) {} paused, kept for the next attempt", ranks), out);
  trace("pause", "restart", {{"local_ranks", ranks}, {"reason", reason}}, out);
  return true;
}

void Supervisor::unpause_all() {
  for (Rank& r : ranks_) r.paused = r.assign_held = false;
  stop_only_.reset();
}

void Supervisor::stop_group(int sig, const Now& now, Actions& out) {
  if (state_ == State::kDone) return;
  state_ = State::kStopping;
  for (Rank& r : ranks_) r.respawn = r.assign_held = false;  // the attempt they were due in is over
  stop_signal_ = sig;
  stop_only_.reset();
  if (paused_count() > 0) {  // the paused ones are spared
    stop_only_.emplace();
    for (int lr = 0; lr < cfg_.nproc; ++lr)
      if (const Rank& r = ranks_[static_cast<std::size_t>(lr)]; r.live && !r.paused) stop_only_->push_back(lr);
  }
  trace(fmt::format("send {} to the workers", signal_name(sig)), "signal", {{"signal", sig}}, out);
  if (!stop_only_ || !stop_only_->empty()) out.push_back(stop_sig(sig, stop_only_));
  grace_due_ = now.steady + cfg_.grace;
  out.push_back(act::ArmTimer{Timer::kGrace, grace_due_});
}

Actions Supervisor::timer_fired(Timer t, const Now& now) {
  Actions out;
  if (t == Timer::kGrace) {
    if (state_ != State::kStopping || now.steady < grace_due_) return out;
    notice(fmt::format("workers still running {:.1f}s after {}: sending SIGKILL", seconds(cfg_.grace),
                       signal_name(stop_signal_)),
           out);
    trace("send SIGKILL to the workers", "signal", {{"signal", SIGKILL}, {"after_grace_s", seconds(cfg_.grace)}}, out);
    out.push_back(act::SignalWorkers{SIGKILL, true, stop_only_});
  } else if (t == Timer::kLeave) {
    if (state_ != State::kDone) finish(leaving_code_, out);
  } else if (t == Timer::kOverdue) {
    if (state_ == State::kDone || !overdue_due_ || now.steady < *overdue_due_) return out;
    // The stop is waiting for something that did not come (a worker that outlived SIGKILL,
    // a worker the agent could not start and never heard the end of): end now, as the
    // stop would have; whatever is left of the workers is killed on the way out.
    const int code = leaving_code_ ? leaving_code_
                     : root_cause_ ? root_cause_->worker.exit_code
                                   : exit_code::kSignalBase + agent_signal_;
    out.push_back(act::ErrorLine{fmt::format(
        "the run did not end within {:.1f}s of {} (grace {:.1f}s, then {} s for the workers' ends and the other nodes): "
        "ending it now and killing what is left of its workers",
        seconds(cfg_.grace + Config::kOverdueMargin), signal_name(agent_signal_), seconds(cfg_.grace),
        Config::kOverdueMargin.count())});
    if (root_cause_ && !leaving_code_) out.push_back(act::PrintRootCause{*root_cause_});
    finish(code, out);
  } else if (t == Timer::kWatch) {
    watching_ = false;
    if (state_ == State::kDone) return out;
    bool any = false;
    for (int lr = 0; lr < cfg_.nproc; ++lr)
      if (const Rank& r = ranks_[static_cast<std::size_t>(lr)]; r.live && r.in_place) any = true;
    if (!any) return out;  // the next hello with in_place starts it again
    out.push_back(act::CheckStopped{});
    watch(now, out);
  } else if (t == Timer::kFence) {
    if (fence_pending_ && now.steady >= fence_due_) release_port(out);
  } else if (t == Timer::kClosing) {
    kill_silent(now, out);
    std::vector<int> late;
    for (int lr = 0; lr < cfg_.nproc; ++lr) {
      const auto i = static_cast<std::size_t>(lr);
      if (!ranks_[i].closing || ranks_[i].closing_due > now.steady) continue;
      ranks_[i].closing_due = Clock::time_point::max();  // SIGKILL once; its end clears closing
      late.push_back(lr);
    }
    if (!late.empty()) {
      notice(fmt::format("local rank(s) {} still running {:.1f}s after SIGTERM: sending SIGKILL",
                         fmt::join(late, ","), seconds(cfg_.grace)),
             out);
      out.push_back(act::SignalWorkers{SIGKILL, true, late});
    }
    arm_closing(out);
  }
  return out;
}

void Supervisor::kill_silent(const Now& now, Actions& out) {
  std::vector<int> silent;
  for (int lr = 0; lr < cfg_.nproc; ++lr) {
    const auto i = static_cast<std::size_t>(lr);
    if (!ranks_[i].paused || ranks_[i].acked || ranks_[i].ack_due > now.steady) continue;
    // No answer to its pause within the grace: stopped (SIGSTOP, which only SIGKILL gets
    // through) or hung. It can no longer be trusted with the next round: it goes, and a new
    // process takes its place in its turn, once the old one has ended (closing_ended).
    ranks_[i].paused = false;
    ranks_[i].closing = true;
    ranks_[i].closing_due = Clock::time_point::max();  // SIGKILL already
    ranks_[i].respawn = ranks_[i].assign_held;  // its turn came already
    ranks_[i].assign_held = false;
    if (state_ == State::kStopping && stop_only_) stop_only_->push_back(lr);
    silent.push_back(lr);
  }
  if (silent.empty()) return;
  notice(fmt::format("local rank(s) {} did not answer the pause within {:.1f}s (stopped or hung): sending SIGKILL; "
                     "started anew in the next attempt",
                     fmt::join(silent, ","), seconds(cfg_.grace)),
         out);
  trace("pause unanswered", "restart", {{"local_ranks", fmt::format("{}", fmt::join(silent, ","))}}, out);
  out.push_back(act::SignalWorkers{SIGKILL, false, silent});
}

void Supervisor::arm_closing(Actions& out) {
  auto next = Clock::time_point::max();
  for (std::size_t i = 0; i < ranks_.size(); ++i) {
    if (ranks_[i].closing) next = std::min(next, ranks_[i].closing_due);
    if (ranks_[i].paused && !ranks_[i].acked) next = std::min(next, ranks_[i].ack_due);
  }
  if (next == Clock::time_point::max()) out.push_back(act::CancelTimer{Timer::kClosing});
  else out.push_back(act::ArmTimer{Timer::kClosing, next});
}

void Supervisor::group_stopped(const Now& now, Actions& out) {
  out.push_back(act::CancelTimer{Timer::kGrace});
  if (!attempts_.empty())
    attempts_.back().duration_s = std::chrono::duration<double>(now.steady - attempt_start_).count();
  StopFacts facts;
  facts.agent_signal = agent_signal_;
  facts.rdzv = rdzv_;
  facts.abort = abort_.has_value();
  facts.rejoin = rejoin_after_stop_;
  facts.root_cause = root_cause_.has_value();
  facts.restart_count = restart_count_;
  facts.max_restarts = cfg_.max_restarts;
  facts.rdzv_lost = cfg_.rdzv && !rdzv_ && group_world_size_ > 1;
  const AfterStop next = after_stop(facts);
  if (rdzv_ && next != AfterStop::kStoppedBySignal) state_ = State::kWaiting;
  switch (next) {
    case AfterStop::kStoppedBySignal:
      notice(fmt::format("stopped by {}", signal_name(agent_signal_)), out);
      // A worker that failed before the signal came is still the root cause.
      if (root_cause_) out.push_back(act::PrintRootCause{*root_cause_});
      leave_job(agent_signal_, now, out);
      return;
    case AfterStop::kAbort:
      finish_with_abort(now, out);
      return;
    case AfterStop::kRejoin:
      rejoin_after_stop_ = false;
      rejoin(out);
      return;
    case AfterStop::kReportFailure: {
      // Our failure: the server decides (restart everywhere or abort everywhere).
      const auto& w = root_cause_->worker;
      proto::WorkerFailed f;
      f.round = round_;
      f.host = root_cause_->host;
      f.rank = w.rank;
      f.local_rank = w.local_rank;
      f.exit_code = w.exit_code;
      f.signal = w.signal;
      f.message = root_cause_->message;
      f.last_lines = root_cause_->stderr_tail;
      out.push_back(act::SendWorkerFailed{std::move(f)});
      return;
    }
    case AfterStop::kWait:
      return;
    case AfterStop::kEndWithoutCause:
      finish(node_exit_code(root_cause_, attempts_), out);  // the rendezvous was lost while stopping for it
      return;
    case AfterStop::kRestart: {
      const auto& w = root_cause_->worker;
      ++restart_count_;
      // As torchrun: a fresh master port for each attempt (the last one may still be held
      // by a straggler, in TIME_WAIT, or taken by someone else: EADDRINUSE).
      if (cfg_.port_is_ours) hold_port(/*fresh=*/true, out);
      notice(fmt::format("rank {} (local_rank {}) failed with exit code {}; restarting the worker group ({} of {})",
                         w.rank, w.local_rank, w.exit_code, restart_count_, cfg_.max_restarts),
             out);
      trace("restart", "restart",
            {{"restart_count", restart_count_}, {"max_restarts", cfg_.max_restarts}, {"failed_rank", w.rank},
             {"exit_code", w.exit_code}, {"by", "agent"}},
            out);
      retire(out);
      out.push_back(act::AttemptDue{});
      return;
    }
    case AfterStop::kGiveUp:
      out.push_back(act::PrintRootCause{*root_cause_});
      finish(root_cause_->worker.exit_code, out);
      return;
  }
}

void Supervisor::retire(Actions& out) {
  std::vector<int> keep;
  for (int lr = 0; lr < cfg_.nproc; ++lr) {
    const auto i = static_cast<std::size_t>(lr);
    if (ranks_[i].paused) {
      keep.push_back(lr);
    } else {
      ranks_[i].live = ranks_[i].in_place = false;
    }
  }
  handles_ = static_cast<int>(keep.size());
  done_ = 0;
  stop_only_.reset();
  // A closing worker's handle goes too (RetireWorkers SIGKILLs it): nothing waits for it.
  for (Rank& r : ranks_) r.closing = r.respawn = false;
  arm_closing(out);  // what is left: the kept workers' answer deadlines
  out.push_back(act::RetireWorkers{std::move(keep)});
}

void Supervisor::rejoin(Actions& out) {
  // A new round gets a fresh master port, as a restart on one node does (the last one may
  // be held by a straggler, in TIME_WAIT, or taken meanwhile).
  if (cfg_.port_is_ours) hold_port(/*fresh=*/true, out);
  out.push_back(act::Rejoin{cfg_.port_is_ours});
}

void Supervisor::finish(int code, Actions& out) {
  if (state_ == State::kDone) return;
  state_ = State::kDone;
  exit_code_ = code;
  fence_pending_ = false;
  out.push_back(act::CancelTimer{Timer::kGrace});
  out.push_back(act::CancelTimer{Timer::kLeave});
  out.push_back(act::CancelTimer{Timer::kFence});
  out.push_back(act::CancelTimer{Timer::kClosing});
  out.push_back(act::CancelTimer{Timer::kWatch});
  if (overdue_due_) out.push_back(act::CancelTimer{Timer::kOverdue});
  watching_ = false;
  out.push_back(act::Finish{code});
}

void Supervisor::arm_overdue(const Now& now, Actions& out) {
  if (state_ == State::kDone || overdue_due_) return;
  overdue_due_ = now.steady + cfg_.grace + Config::kOverdueMargin;
  out.push_back(act::ArmTimer{Timer::kOverdue, *overdue_due_});
}

Actions Supervisor::signal(int sig, const Now& now) {
  Actions out;
  if (state_ == State::kDone) return out;
  if (sig == SIGINT) ++interrupts_;
  trace(fmt::format("got {}", signal_name(sig)), "signal", {{"signal", sig}}, out);
  SignalFacts facts;
  facts.sig = sig;
  facts.interrupts = interrupts_;
  facts.waiting = state_ == State::kWaiting;
  facts.stopping = state_ == State::kStopping;
  const OnSignal what = on_agent_signal(facts);
  if (what == OnSignal::kForward) {
    out.push_back(act::SignalWorkers{sig, false, std::nullopt});
    return out;
  }
  stop_on_signal(sig, what, now, out);
  // Whatever the stop waits for (a worker that outlives SIGKILL, a decision that never
  // comes), the run ends in bounded time after the first such signal.
  arm_overdue(now, out);
  return out;
}

void Supervisor::stop_on_signal(int sig, OnSignal what, const Now& now, Actions& out) {
  if (what == OnSignal::kKillNow) {
    notice("second interrupt: killing the workers now", out);
    unpause_all();  // the paused ones too: the stop waits for them
    out.push_back(act::SignalWorkers{SIGKILL, true, std::nullopt});
    if (agent_signal_ == 0) agent_signal_ = SIGINT;  // the run's code stays the first signal's
    return;
  }
  if (agent_signal_ == 0) agent_signal_ = sig;
  if (what == OnSignal::kEndWhileWaiting && paused_count() > 0 && !leaving_code_) {
    // Paused workers wait for the next round: they are stopped as a running group is.
    notice(fmt::format("got {}: stopping the paused workers (grace {:.1f}s)", signal_name(sig), seconds(cfg_.grace)),
           out);
    unpause_all();
    stop_group(sig, now, out);
    return;
  }
  if (what == OnSignal::kEndWhileWaiting) {
    if (leaving_code_) {  // a second signal while telling the others: go now
      finish(leaving_code_, out);
      return;
    }
    notice(fmt::format("got {} while waiting for the rendezvous", signal_name(sig)), out);
    leave_job(sig, now, out);
    return;
  }
  if (state_ == State::kStopping && handles_ == 0) {
    // Between attempts (every worker gone, the restart due): nothing to stop, and the
    // failure that came before was dealt with by the restart. The restart never starts;
    // the run ends as any run stopped by a signal does (128+S), the last attempt's
    // record as it was.
    --restart_count_;  // announced, never started
    root_cause_.reset();
    notice(fmt::format("got {} before restart {} started: not restarting", signal_name(sig), restart_count_ + 1),
           out);
    finish(exit_code::kSignalBase + sig, out);
    return;
  }
  notice(fmt::format("got {}: stopping the workers (grace {:.1f}s)", signal_name(sig), seconds(cfg_.grace)), out);
  if (what == OnSignal::kForwardWhileStopping) {
    unpause_all();  // the paused workers go too
    out.push_back(stop_sig(sig, std::nullopt));
  } else
    stop_group(sig, now, out);
}

Actions Supervisor::job_control(int sig, const Now& now) {
  Actions out;
  if (state_ == State::kDone) return out;
  // Stopped with us (Ctrl-Z), or continued: what was seen stopped before does not count.
  for (Rank& r : ranks_) r.stopped_since = Clock::time_point::max();
  if (sig == SIGTSTP) {
    // Ctrl-Z: the workers first (they are in process groups of their own, the terminal
    // stopped only us and the stdin rank in our group), then the agent, as the shell
    // expects of its job.
    out.push_back(act::SignalWorkers{SIGSTOP, true, std::nullopt});
    trace("stopped (SIGTSTP)", "signal", {{"signal", sig}}, out);
    out.push_back(act::PauseOutputDrains{});
    // The grace must not run out while we are stopped: a timer that expired meanwhile
    // would fire the moment we go on, before the SIGCONT that starts it over is handled.
    if (state_ == State::kStopping) out.push_back(act::CancelTimer{Timer::kGrace});
    if (overdue_due_) {  // armed anew when we go on (the time stopped does not count)
      out.push_back(act::CancelTimer{Timer::kOverdue});
      overdue_due_.reset();
      overdue_paused_ = true;
    }
    out.push_back(act::StopSelf{});
    return out;
  }
  // fg or bg (or anyone's SIGCONT): the workers go on with us. The time spent stopped
  // counts neither against the workers' grace nor against the drain of an ended
  // worker's output.
  out.push_back(act::SignalWorkers{SIGCONT, true, std::nullopt});
  trace("continued (SIGCONT)", "signal", {{"signal", sig}}, out);
  out.push_back(act::ResumeOutputDrains{});
  if (state_ == State::kStopping) {
    grace_due_ = now.steady + cfg_.grace;
    out.push_back(act::ArmTimer{Timer::kGrace, grace_due_});
  }
  if (overdue_paused_) {  // the time stopped does not count against it either
    overdue_paused_ = false;
    arm_overdue(now, out);
  }
  return out;
}

void Supervisor::leave_job(int sig, const Now& now, Actions& out) {
  const int code = root_cause_ ? root_cause_->worker.exit_code : exit_code::kSignalBase + sig;
  // Not in a multi-node job, or not placed in a round yet: nobody to tell.
  if (!rdzv_ || round_ == 0) {
    finish(code, out);
    return;
  }
  leaving_code_ = code;
  state_ = State::kWaiting;
  proto::WorkerFailed f;
  f.round = round_;
  f.host = cfg_.host;
  f.rank = -1;
  f.local_rank = -1;
  f.exit_code = code;
  f.signal = sig;
  f.message = fmt::format("node {} (node rank {}) was stopped by {}", f.host, node_rank_, signal_name(sig));
  if (root_cause_) {  // our worker's failure, which came first
    f.rank = root_cause_->worker.rank;
    f.local_rank = root_cause_->worker.local_rank;
    f.signal = root_cause_->worker.signal;
    f.message = root_cause_->message;
    f.last_lines = root_cause_->stderr_tail;
  }
  out.push_back(act::SendWorkerFailed{std::move(f)});
  // The decision (a hosting agent's server still delivers it to the others) or this.
  out.push_back(act::ArmTimer{Timer::kLeave, now.steady + Config::kLeaveTimeout});
}

Actions Supervisor::assignment(const proto::Assignment& a, const Now& now) {
  Actions out;
  if (state_ != State::kWaiting || leaving_code_) return out;
  round_ = a.round;
  group_world_size_ = a.group_world_size;
  node_rank_ = a.group_rank;
  restart_count_ = a.restart_count;
  standby_ = false;
  out.push_back(act::ApplyAssignment{a});
  notice(fmt::format("round {}: node {} of {}, ranks {}..{} of {}, master {}:{}, restart {}", a.round, a.group_rank,
                     a.group_world_size, a.rank_offset, a.rank_offset + cfg_.nproc - 1, a.world_size, a.master_addr,
                     a.master_port, a.restart_count),
         out);
  retire(out);
  start_attempt(now, out);
  return out;
}

Actions Supervisor::restart(const proto::Restart& r, const Now& now) {
  Actions out;
  if (state_ == State::kDone) return out;
  if (leaving_code_) {
    finish(leaving_code_, out);  // the others heard it: this node is gone
    return out;
  }
  // A fence is this node's own decision (rendezvous/client_machine.h): its one line says why.
  if (r.reason.starts_with("this node fenced itself")) notice(r.reason, out);
  else notice(fmt::format("restart {} decided by the rendezvous: {}", r.restart_count, r.reason), out);
  trace("restart", "restart", {{"restart_count", r.restart_count}, {"reason", r.reason}, {"by", "rendezvous"}}, out);
  if (state_ == State::kRunning) {
    rejoin_after_stop_ = true;
    // The Restart carries only its reason: a worker's failure reads "rank R on HOST exited
    // with N" (rendezvous/job.cc); anything else is a change of the nodes.
    pause_in_place(r.reason, r.reason.starts_with("rank ") ? "worker" : "host", now, out);
    stop_group(SIGTERM, now, out);
    if (stop_complete()) {  // every worker is paused: nothing to wait for
      out.push_back(act::AttemptEnded{restart_count_, true});
      group_stopped(now, out);
    }
  } else if (state_ == State::kWaiting) {
    rejoin(out);
  } else {
    rejoin_after_stop_ = true;  // already stopping: re-join once stopped
  }
  return out;
}

Actions Supervisor::abort(const proto::Abort& a, const Now& now) {
  Actions out;
  if (state_ == State::kDone) return out;
  if (leaving_code_) {
    finish(leaving_code_, out);
    return out;
  }
  abort_ = a;
  if (paused_count() > 0) {
    // The paused workers wait for a round that will not come: they are stopped too.
    unpause_all();
    if (state_ == State::kStopping) out.push_back(stop_sig(SIGTERM, std::nullopt));
    else stop_group(SIGTERM, now, out);
    return out;
  }
  if (state_ == State::kRunning) {
    stop_group(SIGTERM, now, out);
  } else if (state_ == State::kWaiting) {
    finish_with_abort(now, out);
  }
  return out;
}

Actions Supervisor::standby(const proto::Standby& s, const Now&) {
  Actions out;
  if (state_ != State::kWaiting || leaving_code_ || standby_) return out;
  standby_ = true;
  notice(fmt::format("standby for job {} (the round is full: {} nodes run it; standby {}): this node takes the place "
                     "of a lost node, or exits when the job ends",
                     cfg_.job_id, s.active_nodes, s.position),
         out);
  trace("standby", "rendezvous", {{"active_nodes", s.active_nodes}, {"position", s.position}}, out);
  return out;
}

void Supervisor::finish_with_abort(const Now& now, Actions& out) {
  const auto& f = abort_->root_cause;
  // A standby's job failed: the same root cause and exit code as every node's (below).
  if (f.rank < 0 && attempts_.empty() && !standby_) {
    // The job ended before any worker of this node ran (join_timeout): no root-cause block
    // with an empty host and rank -1, but what happened and what to check.
    RootCause rc;
    rc.time = time_text(now.wall);
    rc.worker.rank = -1;
    rc.worker.exit_code = exit_code::kRendezvous;
    rc.message = abort_->reason;
    root_cause_ = rc;
    out.push_back(act::ErrorLine{fmt::format(
        "the rendezvous timed out, no worker started: {} ({} s, rendezvous {}); check that every node runs mglaunch "
        "with the same --rdzv_endpoint, --rdzv_id and --nnodes, that it can reach {}, or give late nodes more time "
        "with --rdzv_conf=join_timeout=SECONDS",
        abort_->reason, seconds(cfg_.join_timeout), cfg_.rdzv_where, cfg_.rdzv_where)});
    finish(exit_code::kRendezvous, out);
    return;
  }
  RootCause rc;
  rc.time = time_text(now.wall);
  rc.host = f.host;
  rc.worker.rank = f.rank;
  rc.worker.local_rank = f.local_rank;
  rc.worker.exit_code = f.exit_code;
  rc.worker.signal = f.signal;
  rc.message = f.message.empty() ? abort_->reason : f.message;
  rc.stderr_tail = f.last_lines;
  out.push_back(act::PrintRootCause{rc});
  root_cause_ = rc;
  finish(f.exit_code > 0 ? f.exit_code : exit_code::kInternal, out);
}

Actions Supervisor::rendezvous_done(const Now&) {
  Actions out;
  finish(leaving_code_ ? leaving_code_ : exit_code::kOk, out);
  return out;
}

Actions Supervisor::preflight_failed(const std::string& given, const Now& now) {
  Actions out;
  if (state_ != State::kWaiting || !attempts_.empty() || leaving_code_) return out;
  // The check always says why; should it not, the line still says what failed.
  const std::string line = given.empty() ? std::string("preflight failed without a reason") : given;
  RootCause rc;
  rc.time = time_text(now.wall);
  rc.host = cfg_.host;
  rc.worker.rank = -1;
  rc.worker.exit_code = exit_code::kPreflight;
  rc.message = line;
  root_cause_ = rc;
  out.push_back(act::ErrorLine{line + "; fix or leave out the named node, or run with --preflight=warn"});
  finish(exit_code::kPreflight, out);
  return out;
}

Actions Supervisor::fatal(int code, const std::string& line, const Now&) {
  Actions out;
  if (state_ == State::kDone) return out;
  out.push_back(act::ErrorLine{line});
  finish(code, out);
  return out;
}

Actions Supervisor::rendezvous_lost(const std::string& why, const Now&) {
  Actions out;
  if (state_ == State::kDone) return out;
  if (leaving_code_) {
    finish(leaving_code_, out);
    return out;
  }
  if (state_ == State::kWaiting && attempts_.empty() && !root_cause_)
    out.push_back(act::ErrorLine{fmt::format("rendezvous: {}", why)});  // this ends the run (exit 3) before any worker ran
  else
    notice(fmt::format("rendezvous: {}", why), out);
  rdzv_ = false;  // from here on this node decides alone
  if (state_ == State::kWaiting) {
    // No decision will come: this node answers for its own workers.
    if (root_cause_) out.push_back(act::PrintRootCause{*root_cause_});
    finish(node_exit_code(root_cause_, attempts_), out);
  }
  return out;
}

}  // namespace mg::sup

namespace mg::sup {

DescriptorNeed descriptor_need(int nproc, bool merge_streams, int log_files, int open_now, int rendezvous_agents) {
  constexpr int kReserve = 64;  // rendezvous sockets, the watchdog's pipe, files opened while running
  DescriptorNeed n;
  n.nproc = nproc;
  n.per_worker = merge_streams ? 1 : 2;
  n.log_files = log_files;
  n.fixed = static_cast<long long>(open_now) + kReserve + log_files;
  n.needed = n.fixed + static_cast<long long>(n.per_worker) * nproc;
  n.rendezvous = rendezvous_agents > 0 ? rendezvous_agents + static_cast<long long>(kRendezvousHandshakes) : 0;
  return n;
}

bool fits(const DescriptorNeed& need, const DescriptorLimit& lim) {
  return !lim.soft || static_cast<unsigned long long>(need.needed) <= *lim.soft;
}

bool worth_raising(const DescriptorNeed& need, const DescriptorLimit& lim) {
  const bool short_of = lim.soft && static_cast<unsigned long long>(need.needed + need.rendezvous) > *lim.soft;
  return short_of && lim.hard != lim.soft;
}

std::string descriptor_shortfall(const DescriptorNeed& need, const DescriptorLimit& lim) {
  const unsigned long long soft = lim.soft.value_or(0);
  const long long fit = std::max<long long>(0, (static_cast<long long>(soft) - need.fixed) / need.per_worker);
  return fmt::format(
      "{} workers need about {} open descriptors ({} per worker{}, {} for the agent) but the descriptor limit "
      "(RLIMIT_NOFILE, `ulimit -n`) is {} and its hard limit {}: at most {} workers fit; raise the hard limit "
      "(`ulimit -Hn`, LimitNOFILE= for a service, nofile in /etc/security/limits.conf) or start fewer workers",
      need.nproc, need.needed, need.per_worker, need.log_files ? " and the log files" : "", need.fixed - need.log_files,
      soft, lim.hard ? std::to_string(*lim.hard) : std::string("unlimited"), fit);
}

DescriptorShares descriptor_shares(const DescriptorNeed& need, const DescriptorLimit& lim) {
  DescriptorShares d;
  if (!lim.soft) return d;
  const unsigned long long spare =
      *lim.soft > static_cast<unsigned long long>(need.needed) ? *lim.soft - static_cast<unsigned long long>(need.needed) : 0;
  unsigned long long rest = spare;
  if (need.rendezvous > 0) {
    const unsigned long long want = std::max(static_cast<unsigned long long>(need.rendezvous), spare / 8);
    d.rendezvous = static_cast<std::size_t>(std::clamp(want, kRendezvousHandshakes, std::max(kRendezvousHandshakes, spare / 2)));
    rest = spare - std::min<unsigned long long>(spare, d.rendezvous);
  }
  auto share = [&](std::size_t cap, unsigned long long part, std::size_t at_least) {
    return static_cast<std::size_t>(std::clamp<unsigned long long>(rest / part, at_least, cap));
  };
  d.store = share(d.store, 2, 8);
  d.control = share(d.control, 4, 4);
  d.metrics = share(d.metrics, 8, 2);
  d.health = share(d.health, 8, 2);
  return d;
}

bool meant_to_host(bool rdzv_server, bool etcd, std::optional<bool> is_host,
                   const std::function<bool()>& endpoint_is_here) {
  if (!rdzv_server || etcd) return false;
  return is_host ? *is_host : endpoint_is_here();
}

}  // namespace mg::sup

namespace mg::sup {

Actions Supervisor::worker_hello(int local_rank, bool in_place, const Now& now) {
  Actions out;
  if (!valid(local_rank) || !ranks_[static_cast<std::size_t>(local_rank)].live || state_ == State::kDone) return out;
  ranks_[static_cast<std::size_t>(local_rank)].in_place = in_place;
  if (in_place) watch(now, out);
  return out;
}

void Supervisor::watch(const Now& now, Actions& out) {
  if (watching_) return;
  watching_ = true;
  out.push_back(act::ArmTimer{Timer::kWatch, now.steady + Config::kWatchEvery});
}

Actions Supervisor::workers_stopped(const std::vector<int>& local_ranks, const Now& now) {
  Actions out;
  if (state_ == State::kDone) return out;
  std::vector<int> hung;
  for (int lr = 0; lr < cfg_.nproc; ++lr) {
    const auto i = static_cast<std::size_t>(lr);
    const bool stopped = std::find(local_ranks.begin(), local_ranks.end(), lr) != local_ranks.end();
    // Only a running worker of a running attempt that opted in: a paused one has its own
    // bound (Rank::ack_due), the others are stopped by the stop under way or restarted anyway.
    Rank& r = ranks_[i];
    if (!stopped || state_ != State::kRunning || !r.live || !r.in_place || r.paused || r.closing) {
      r.stopped_since = Clock::time_point::max();
      continue;
    }
    if (r.stopped_since == Clock::time_point::max()) r.stopped_since = now.steady;
    if (now.steady - r.stopped_since < cfg_.grace) continue;
    r.stopped_since = Clock::time_point::max();
    hung.push_back(lr);
  }
  if (hung.empty()) return out;
  notice(fmt::format("local rank(s) {} stopped by a signal (SIGSTOP) for {:.1f}s: taken for hung, sending SIGKILL",
                     fmt::join(hung, ","), seconds(cfg_.grace)),
         out);
  trace("stopped worker", "restart", {{"local_ranks", fmt::format("{}", fmt::join(hung, ","))}}, out);
  out.push_back(act::SignalWorkers{SIGKILL, false, hung});
  return out;
}

Actions Supervisor::control_closed(int local_rank, const std::string& why, const Now& now) {
  Actions out;
  if (!valid(local_rank) || state_ == State::kDone) return out;
  const auto lr = static_cast<std::size_t>(local_rank);
  ranks_[lr].in_place = false;
  if (!ranks_[lr].paused) return out;
  if (ranks_[lr].assign_held) ranks_[lr].respawn = true;  // its turn came already: the new process starts once it ended
  ranks_[lr].assign_held = false;
  // It can no longer be assigned: stopped (SIGTERM, SIGKILL after the grace), started
  // anew in its next turn, once the old process has ended.
  ranks_[lr].paused = ranks_[lr].acked = false;
  notice(fmt::format("local rank {}'s control connection closed while paused ({}): stopping it", local_rank, why), out);
  if (state_ == State::kStopping && stop_only_) stop_only_->push_back(local_rank);
  ranks_[lr].closing = true;
  ranks_[lr].closing_due = now.steady + cfg_.grace;
  out.push_back(stop_sig(state_ == State::kStopping ? stop_signal_ : SIGTERM, std::vector<int>{local_rank}, false));
  arm_closing(out);
  return out;
}

}  // namespace mg::sup

namespace mg::sup {

Actions Supervisor::worker_paused(int local_rank, const Now&) {
  Actions out;
  if (!valid(local_rank) || state_ == State::kDone || !ranks_[static_cast<std::size_t>(local_rank)].paused) return out;
  const auto lr = static_cast<std::size_t>(local_rank);
  ranks_[lr].acked = true;
  if (ranks_[lr].assign_held && state_ == State::kRunning) assign(local_rank, out);
  else arm_closing(out);
  return out;
}

}  // namespace mg::sup
