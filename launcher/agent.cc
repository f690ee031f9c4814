#include "launcher/agent.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <algorithm>
#include <type_traits>
#include <variant>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <unordered_set>

#include <boost/asio/post.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "cli/args.h"
#include "cli/errors.h"
#include "ops/doctor.h"
#include "ops/health.h"
#include "ops/monitor.h"
#include "ops/trace.h"
#include "process/watchdog.h"
#include "launcher/worker_spec.h"
#include "proto/text.h"
#include "process/command.h"
#include "process/proc.h"

namespace mg {

namespace asio = boost::asio;
namespace fs = std::filesystem;

namespace {

// "; its process (pid P) still runs" (or "is exiting", "had ended"): said with a closed
// control connection, it tells a worker's exit or crash from a close while it runs.
std::string process_state(const std::vector<WorkerState>& workers, int local_rank) {
  for (const auto& w : workers) {
    if (w.exited || w.local_rank != local_rank || w.pid <= 0) continue;
    constexpr std::uint64_t kPfExiting = 0x4;  // PF_EXITING: in exit(), its descriptors closing
    const auto st = read_proc_stat(w.pid);
    const bool exiting = !st || st->state == 'Z' || (st->flags & kPfExiting);
    return fmt::format("; its process (pid {}) {}", w.pid, exiting ? "is exiting" : "still runs");
  }
  return "; its process had ended";
}

}  // namespace

Agent::Agent(asio::io_context& io, AgentOptions opts, RunPlan plan, EnvMap base_env, AgentDeps deps)
    : io_(io),
      clock_(std::move(deps.clock)),
      make_link_(std::move(deps.link)),
      hardware_(std::move(deps.hardware)),
      make_store_(std::move(deps.store)),
      make_control_(std::move(deps.control)),
      opts_(std::move(opts)),
      plan_(std::move(plan)),
      base_env_(std::move(base_env)),
      out_fd_(deps.stdout_fd),
      err_fd_(deps.stderr_fd),
      console_(io, out_fd_, err_fd_, opts_.timestamps),
      signals_(std::move(deps.signals)),
      launcher_(deps.launcher(io, console_)),
      core_(core_config(opts_, plan_)),
      prestart_(plan_.nproc_per_node, opts_.grace) {
  // The rendezvous token authenticates this agent; a worker (user code) must not see it.
  base_env_.erase("MGLAUNCH_RDZV_TOKEN");
  base_env_.erase("MGLAUNCH_RDZV_JOB_TOKEN");
  base_env_.erase("MGLAUNCH_ETCD_PASSWORD");
  started_at_ = now().steady;
}

Agent::~Agent() {
  stop_preflight();
  health_.reset();
  file_timer_.reset();  // the pipe removed (its hooks use the console)
  monitor_.reset();
  if (trace_) {
    trace_->close();
    trace_.reset();
    console_.close_file(trace_fd_);
  }
  // SIGKILLs anything still running; with nothing left, the temporary tree goes while the
  // watchdog exits (the launcher's destructor waits for it).
  if (control_) control_->stop();
  launcher_->close();
  logs_.clean_up();
}

void Agent::check_descriptor_budget() {
  int files = 0;  // log files held open for the run
  for (int lr = 0; lr < plan_.nproc_per_node; ++lr)
    for (Streams which : {Streams::kOut, Streams::kErr})
      if (opts_.redirects.covers(lr, which) || opts_.tee.covers(lr, which)) ++files;
  int open_now = 0;
  if (DIR* d = ::opendir("/proc/self/fd")) {
    while (dirent* e = ::readdir(d))
      if (e->d_name[0] != '.') ++open_now;
    ::closedir(d);
  }
  // A rendezvous server this agent may host or take over (the own daemon's protocol, not
  // etcd) keeps one connection per agent of the job, up to the server's own bound.
  const int agents = uses_rendezvous_server(opts_) && opts_.rdzv_backend != "etcd"
                         ? std::min(opts_.nnodes.max, rdzv::ServerOptions{}.max_nodes_per_job)
                         : 0;
  const sup::DescriptorNeed need = sup::descriptor_need(plan_.nproc_per_node, merge_streams_, files, open_now, agents);
  rlimit lim{};
  if (::getrlimit(RLIMIT_NOFILE, &lim) != 0) return;
  auto limit = [](const rlimit& l) {
    sup::DescriptorLimit d;
    if (l.rlim_cur != RLIM_INFINITY) d.soft = l.rlim_cur;
    if (l.rlim_max != RLIM_INFINITY) d.hard = l.rlim_max;
    return d;
  };
  if (sup::worth_raising(need, limit(lim))) {
    rlimit raised = lim;
    raised.rlim_cur = lim.rlim_max;
    if (::setrlimit(RLIMIT_NOFILE, &raised) == 0) {
      worker_nofile_ = lim;  // the workers start with the limit they would have had
      lim = raised;
    }
  }
  if (!sup::fits(need, limit(lim))) throw ResourceError(sup::descriptor_shortfall(need, limit(lim)));
  shares_ = sup::descriptor_shares(need, limit(lim));
}

void Agent::start() {
  {
    // One pipe per worker when stdout and stderr are the same file (a terminal, 2>&1):
    // nothing is lost by merging, and a worker costs one descriptor instead of two.
    struct stat out{}, err{};
    merge_streams_ = ::fstat(out_fd_, &out) == 0 && ::fstat(err_fd_, &err) == 0 &&
                     out.st_dev == err.st_dev && out.st_ino == err.st_ino && out.st_rdev == err.st_rdev;
  }
  check_descriptor_budget();
  for (const auto& note : plan_.notes) notice(note);
  const bool files_wanted = [&] {
    for (int lr = 0; lr < plan_.nproc_per_node; ++lr)
      if (opts_.redirects.for_rank(lr) != Streams::kNone || opts_.tee.for_rank(lr) != Streams::kNone) return true;
    return false;
  }();
  LogLayoutOptions lo;
  lo.log_dir = opts_.log_dir;
  lo.rdzv_id = opts_.rdzv_id;
  lo.run_id = plan_.run_id;
  lo.files_wanted = files_wanted;
  if (!opts_.log_dir.empty()) lo.time_text = now_text();  // (reads the time zone: only when used)
  if (std::string text = logs_.create(lo); !text.empty()) notice(text);
  if (plan_.set_omp_threads)
    notice("setting OMP_NUM_THREADS=1 for each worker (more than one per node); set it yourself to tune");
  for (const auto& w : opts_.warnings) notice(w);
  if (opts_.preflight != "off" && !uses_rendezvous_server(opts_))
    notice(opts_.nnodes.max <= 1 ? "preflight: one node, nothing to check between nodes"
                                 : "preflight: skipped (it needs a rendezvous, which lists the nodes: "
                                   "--rdzv_backend=c10d or etcd)");
  if (opts_.cpu_bind != "none") {
    try {
      bindings_ = hardware_->bind(opts_.cpu_bind, plan_.nproc_per_node, opts_.gpu_ids);
    } catch (const std::invalid_argument& e) {
      throw UsageError(e.what());  // it names --cpu-bind and the fix
    }
    for (int lr = 0; lr < plan_.nproc_per_node; ++lr)
      notice(hw::format_binding(lr, bindings_[static_cast<std::size_t>(lr)]));
  }

  start_file_timer();
  start_health_check();
  start_ops();
  // The agent that hosts the rendezvous listens once every start-up step that can fail has
  // passed (the log directory, --cpu-bind, the trace and metrics files) and before the rest
  // (the watchdog's fork): the agents started with it find it listening sooner, and one
  // that connects never meets a host that then gives up (a refused agent retries until
  // join_timeout; a connection reset before the welcome ends its run).
  load_job_record();
  host_rendezvous();
  using Set = AgentSignals::Set;
  for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGUSR1, SIGUSR2}) signals_->add(Set::kStop, sig);
  // torchrun's --signals-to-handle (default SIGTERM,SIGINT,SIGHUP,SIGQUIT): each one listed
  // stops the workers with that signal and ends the run with 128+S, as the ones above do.
  for (int sig : opts_.signals_to_handle) signals_->add(Set::kStop, sig);
  wait_signal();
  signals_->add(Set::kJobControl, SIGTSTP);
  signals_->add(Set::kJobControl, SIGCONT);
  wait_job_control();
  if (console_.live(0) || console_.live(1)) {
    signals_->add(Set::kWinch, SIGWINCH);
    wait_winch();
  }
  python_run_ = opts_.module || (!opts_.no_python && (opts_.run_path || opts_.program.ends_with(".py")));
  stdin_terminal_ = opts_.stdin_rank >= 0 && ::isatty(STDIN_FILENO) == 1;
  // The subreaper, the reaper and the watchdog; a temporary tree nobody was told of goes
  // with the watchdog when the agent is killed.
  launcher_->prepare(logs_.kept() ? std::string() : logs_.root(), [this](const std::string& text) { notice(text); });
  start_control();
  // The core holds the master port (HoldMasterPort) only now: the watchdog (a fork that
  // closes what it inherited once it runs, which on a busy machine may be after the first
  // worker's bind) gets no copy of it.
  run(core_.start(now()));
  if (monitor_) monitor_->start();
}

std::string Agent::attempt_dir(int local_rank) const {
  return logs_.attempt_dir(core_.restart_count(), local_rank);
}

WorkerSpec Agent::attempt_spec(int lr) {
  SpecInputs in;
  in.local_rank = lr;
  in.attempt = core_.restart_count();
  in.dir = attempt_dir(lr);
  in.merge_streams = merge_streams_;
  std::error_code ec;
  fs::create_directories(in.dir, ec);
  auto inherited = base_env_.find(kRunMarkVar);
  in.run_mark = launcher_->run_mark(inherited == base_env_.end() ? std::string() : inherited->second);
  return make_worker_spec(plan_, opts_, base_env_, in);
}

void Agent::spawn_worker(int lr) {
  // Before the first worker of an attempt can connect to it. A store that cannot serve
  // fails the worker before it starts, from the event loop (as a spawn that failed).
  if (std::string why = serve_store(); !why.empty()) {
    WorkerEnd end;
    end.rank = plan_.rank_offset + lr;
    end.local_rank = lr;
    end.wait_status = exit_code::kResource << 8;
    end.spawn_error = std::move(why);
    asio::post(io_, [this, end = std::move(end)] { on_worker_done(end); });
    return;
  }
  if (run_ended()) return;
  {
    WorkerSpec spec = attempt_spec(lr);
    std::error_code ec;
    fs::remove(attempt_dir(lr) + "/error.json", ec);  // a stale file from an earlier run must not be taken as this one's
    if (lr == opts_.stdin_rank) {
      // A file or a pipe is passed on as it is; a terminal too, and the worker joins the
      // agent's process group, the terminal's foreground job when the agent is in it.
      spec.stdin_fd = STDIN_FILENO;
      spec.in_agent_group = stdin_terminal_;
    }
    if (worker_nofile_) spec.nofile = &*worker_nofile_;
    if (!bindings_.empty()) spec.cpus = bindings_[static_cast<std::size_t>(lr)].cpus;
    const pid_t pid = launcher_->start(std::move(spec), [this](const WorkerEnd& done) { on_worker_done(done); });
    if (trace_)
      trace_->instant(fmt::format("spawn rank {}", plan_.rank_offset + lr), "worker", TraceWriter::worker_tid(lr),
                      {{"rank", plan_.rank_offset + lr}, {"local_rank", lr}, {"pid", pid},
                       {"attempt", core_.restart_count()}});
  }
}

bool Agent::run_ended() const {
  // serve_store()'s first look at the master port (watch_master_port) can end the run at
  // once (another user listens there, exit 4): finish() has killed the workers, so the
  // worker being started or assigned must not be (#35: it was, and node 0 waited for it).
  return core_.state() == sup::State::kDone;
}

WorkerOutcome Agent::outcome_of(const WorkerEnd& w) {
  WorkerOutcome o;
  o.rank = w.rank;
  o.local_rank = w.local_rank;
  o.pid = w.pid;
  o.exit_code = shell_exit_code(w.wait_status);
  o.signal = WIFSIGNALED(w.wait_status) ? WTERMSIG(w.wait_status) : 0;
  o.duration_s = w.duration_s;
  return o;
}

void Agent::start_control() {
  control::ServerOptions co;
  co.worker_of = [this](pid_t pid) { return worker_of(pid); };
  co.worker_pid = [this](int lr) -> pid_t {
    for (const auto& w : launcher_->workers())
      if (!w.exited && w.local_rank == lr) return w.pid;
    return 0;
  };
  co.log = [this](const std::string& line) { notice(line); };
  co.max_sessions = shares_.control;
  control::Handlers h;
  h.hello = [this](int lr, const control::Hello& m) {
    if (prestart_.pending(lr)) run_prestart(prestart_.hello(lr, m.in_place, m.standby, now()));
    else run(core_.worker_hello(lr, m.in_place, now()));
  };
  h.closed = [this](int lr, const std::string& why) {
    if (prestart_.pending(lr)) return run_prestart(prestart_.closed(lr, now()));
    run(core_.control_closed(lr, why + process_state(launcher_->workers(), lr), now()));
  };
  h.paused = [this](int lr, const control::Paused& p) {
    trace_instant("paused", "restart", {{"local_rank", lr}, {"step", p.step}});
    run(core_.worker_paused(lr, now()));  // it answered: alive, its Assign may go
  };
  try {
    control_ = make_control_(io_, std::move(co), std::move(h));
    base_env_[control::kSocketVar] = control_->address();
  } catch (const std::runtime_error& e) {
    notice(std::string(e.what()) + ": no worker can opt in to in-place recovery in this run");
  }
}

int Agent::worker_of(pid_t pid) const {
  const std::vector<WorkerState> ws = launcher_->workers();
  auto of = [&](pid_t leader) {
    for (const auto& w : ws)
      if (!w.exited && w.pid == leader) return w.local_rank;
    return -1;
  };
  // Up the parent chain (bounded) to a worker, or a process in a worker's process group.
  for (int hop = 0; hop < 64 && pid > 1 && pid != ::getpid(); ++hop) {
    if (int lr = of(pid); lr >= 0) return lr;
    const auto st = read_proc_stat(pid);
    if (!st) return -1;
    if (int lr = of(st->pgrp); lr >= 0) return lr;
    pid = st->ppid;
  }
  return -1;
}

void Agent::assign_worker(const sup::act::Assign& a) {
  const int lr = a.local_rank;
  if (std::string why = serve_store(); !why.empty()) {  // the new attempt's (emptied) store
    notice(fmt::format("local rank {} was paused but the attempt's store cannot serve ({}): killing it", lr, why));
    launcher_->signal_some(SIGKILL, {lr});
    return;
  }
  if (run_ended()) return;  // its worker was killed with the others
  const std::string dir = attempt_dir(lr);
  std::error_code ec;
  fs::create_directories(dir, ec);
  fs::remove(dir + "/error.json", ec);
  // The same environment a spawned worker of this attempt gets (launcher/plan).
  const EnvMap env = build_contract_env(plan_, opts_, base_env_, lr, a.restart_count, dir + "/error.json");
  launcher_->reassign(lr, plan_.rank_offset + lr, worker_line_prefix(plan_, opts_, lr));
  if (trace_)
    trace_->instant(fmt::format("assign rank {}", plan_.rank_offset + lr), "worker", TraceWriter::worker_tid(lr),
                    {{"rank", plan_.rank_offset + lr}, {"local_rank", lr}, {"attempt", a.restart_count}});
  if (!control_ || !control_->send(lr, control::assign(a.round, a.restart_count, env))) {
    // It can no longer hear of the round: its end is a failure of this attempt.
    notice(fmt::format("local rank {} was paused but its control connection is gone: killing it", lr));
    launcher_->signal_some(SIGKILL, {lr});
  }
}

// ---- --prestart-standby (docs/in-place-recovery.md, "Pre-started workers") ----

void Agent::run_prestart(sup::PreCommands commands) {
  for (auto& command : commands) {
    std::visit(
        [&](auto& c) {
          using C = std::decay_t<decltype(c)>;
          if constexpr (std::is_same_v<C, sup::pre::Start>) {
            prestart_one(c.local_rank);
          } else if constexpr (std::is_same_v<C, sup::pre::Signal>) {
            signal_workers({c.sig, false, c.local_ranks, c.cont});
          } else if constexpr (std::is_same_v<C, sup::pre::Notice>) {
            notice(c.text);
          } else if constexpr (std::is_same_v<C, sup::pre::Trace>) {
            trace_instant(c.name, "worker", std::move(c.args));
          } else if constexpr (std::is_same_v<C, sup::pre::Forget>) {
            if (control_) control_->forget(c.local_rank);
          } else if constexpr (std::is_same_v<C, sup::pre::Keep>) {
            // (read by RetireWorkers, which asked)
          } else if constexpr (std::is_same_v<C, sup::pre::ArmTimer>) {
            clock_->arm(sup::Timer::kPrestart, c.at, [this] { run_prestart(prestart_.timer_fired(now())); });
          } else if constexpr (std::is_same_v<C, sup::pre::CancelTimer>) {
            clock_->cancel(sup::Timer::kPrestart);
          } else if constexpr (std::is_same_v<C, sup::pre::Finish>) {
            finish(c.code);
          }
        },
        command);
  }
}

void Agent::prestart_one(int lr) {
  WorkerSpec spec = attempt_spec(lr);
  // The round's variables are unknown yet: left out, so that a worker that ignores the
  // marker fails to join any group rather than join a wrong one.
  static const char* const kRoundVars[] = {"RANK",           "GROUP_RANK",      "ROLE_RANK",   "WORLD_SIZE",
                                           "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                                           "TORCHELASTIC_RESTART_COUNT", "MGLAUNCH_EPOCH",
                                           "MGLAUNCH_RUN"};
  std::erase_if(spec.env, [](const std::string& kv) {
    const std::string_view name = std::string_view(kv).substr(0, kv.find('='));
    if (name == control::kStandbyVar) return true;
    for (const char* v : kRoundVars)
      if (name == v) return true;
    return false;
  });
  spec.env.push_back(std::string(control::kStandbyVar) + "=1");
  spec.rank = -1;  // none yet
  spec.prefix = fmt::format("[standby{}]:", lr);
  if (worker_nofile_) spec.nofile = &*worker_nofile_;
  if (!bindings_.empty()) spec.cpus = bindings_[static_cast<std::size_t>(lr)].cpus;
  auto placed = std::make_shared<bool>(false);
  const pid_t pid = launcher_->start(std::move(spec), [this, placed](const WorkerEnd& w) {
    if (*placed) return on_worker_done(w);
    if (file_timer_) file_timer_->process_ended(w.pid);  // its pid is free: its timers and admission go
    const bool waiting = core_.is_standby() && core_.state() == sup::State::kWaiting;
    run_prestart(prestart_.ended(w.pid, w.wait_status, waiting, now()));
  });
  prestart_placed_.resize(static_cast<std::size_t>(plan_.nproc_per_node));
  prestart_placed_[static_cast<std::size_t>(lr)] = std::move(placed);
  run_prestart(prestart_.started(lr, pid, now()));
}

bool Agent::adopt_prestarted(int lr) {
  sup::PreCommands out;
  const pid_t pid = prestart_.take(lr, out);
  run_prestart(std::move(out));
  if (!pid) return false;
  std::shared_ptr<bool> placed = std::exchange(prestart_placed_[static_cast<std::size_t>(lr)], nullptr);
  if (std::string why = serve_store(); !why.empty()) {  // the attempt's store, as for a spawned worker
    notice(fmt::format("--prestart-standby: local rank {}'s pre-started worker (pid {}) killed: {}", lr, pid, why));
    launcher_->signal_some(SIGKILL, {lr});  // its end finds no entry in prestart_: no worker's
    return false;  // a spawn in its place fails with the same reason
  }
  if (run_ended()) return true;  // killed with the others; no spawn in its place
  const std::string dir = attempt_dir(lr);
  std::error_code ec;
  fs::create_directories(dir, ec);
  fs::remove(dir + "/error.json", ec);
  const EnvMap env = build_contract_env(plan_, opts_, base_env_, lr, core_.restart_count(), dir + "/error.json");
  if (!control_ || !control_->send(lr, control::assign(core_.round(), core_.restart_count(), env))) {
    notice(fmt::format("--prestart-standby: local rank {}'s pre-started worker (pid {}) lost its control connection: "
                       "killed; a fresh worker takes the place",
                       lr, pid));
    launcher_->signal_some(SIGKILL, {lr});  // its end finds no entry in prestart_: no worker's
    return false;
  }
  if (placed) *placed = true;  // from now on a worker of the attempt
  launcher_->reassign(lr, plan_.rank_offset + lr, worker_line_prefix(plan_, opts_, lr));
  notice(fmt::format("local rank {}: the pre-started worker (pid {}) takes rank {}", lr, pid, plan_.rank_offset + lr));
  if (trace_)
    trace_->instant(fmt::format("assign rank {}", plan_.rank_offset + lr), "worker", TraceWriter::worker_tid(lr),
                    {{"rank", plan_.rank_offset + lr}, {"local_rank", lr}, {"pid", pid}, {"prestarted", true},
                     {"attempt", core_.restart_count()}});
  run(core_.worker_hello(lr, /*in_place=*/true, now()));  // it opted in with its hello
  return true;
}

void Agent::on_worker_done(const WorkerEnd& w) {
  if (file_timer_) file_timer_->process_ended(w.pid);  // its pid is free: its timers and admission go
  if (control_) control_->forget(w.local_rank);  // (its connection ended with it)
  const WorkerOutcome o = outcome_of(w);
  // The core says whether this exit is the root cause (act::WorkerEnded) and asks for its
  // details only then.
  run(core_.worker_ended(o, now(), [&] {
    RootCause rc = worker_root_cause(o, local_hostname(), attempt_dir(o.local_rank) + "/error.json", w.spawn_error,
                                     w.stderr_tail);
    // A module the worker's Python lacks (torch, typically: another python3 first on PATH):
    // which Python ran, and one that has the module, as doctor finds them.
    if (const std::string module = python_run_ ? missing_module(rc.stderr_tail) : std::string(); !module.empty()) {
      const std::string hint = missing_module_hint(
          module, plan_.executable, opts_.python_source,
          python_with_module(module, plan_.executable, python_candidates(base_env_), base_env_));
      rc.message = rc.message.empty() ? hint : hint + "; " + rc.message;
    }
    if (auto hint = libuv_hint(rc.stderr_tail); !hint.empty())
      rc.message = rc.message.empty() ? hint : hint + "; " + rc.message;
    if (auto k = timer_kills_.find(o.local_rank); k != timer_kills_.end()) {
      const std::string why =
          fmt::format("its FileTimer '{}' expired: the agent sent {} to pid {} (TORCHELASTIC_ENABLE_FILE_TIMER)",
                      k->second.scope_id, signal_name(k->second.signal), k->second.pid);
      rc.message = rc.message.empty() ? why : why + "; " + rc.message;
    }
    return rc;
  }));
}

sup::Config Agent::core_config(const AgentOptions& opts, const RunPlan& plan) {
  sup::Config c;
  c.nproc = plan.nproc_per_node;
  c.max_restarts = opts.max_restarts;
  c.grace = opts.grace;
  c.rdzv = uses_rendezvous_server(opts);
  c.port_is_ours = opts.rdzv_backend != "static" || opts.master_port == 0;
  c.master_port = plan.master_port;
  c.node_rank = plan.node_rank;
  c.host = local_hostname();
  c.program = opts.program;
  c.rdzv_where = opts.rdzv_backend == "etcd" ? "etcd at " + opts.rdzv_endpoint : opts.rdzv_endpoint;
  c.join_timeout = opts.join_timeout;
  c.job_id = plan.run_id;
  return c;
}

void Agent::run(sup::Actions actions) {
  for (auto& action : actions) {
    std::visit(
        [&](auto& a) {
          using A = std::decay_t<decltype(a)>;
          if constexpr (std::is_same_v<A, sup::act::Notice>) {
            notice(a.text);
          } else if constexpr (std::is_same_v<A, sup::act::ErrorLine>) {
            error_line(a.text);
          } else if constexpr (std::is_same_v<A, sup::act::PrintRootCause>) {
            console_.write(1, format_root_cause(a.rc, opts_.program));
          } else if constexpr (std::is_same_v<A, sup::act::Trace>) {
            trace_instant(a.name, a.cat, std::move(a.args));
          } else if constexpr (std::is_same_v<A, sup::act::JoinRendezvous>) {
            start_rendezvous();
          } else if constexpr (std::is_same_v<A, sup::act::ApplyAssignment>) {
            apply_assignment(a.a);
          } else if constexpr (std::is_same_v<A, sup::act::AttemptStarted>) {
            if (trace_) attempt_since_us_ = trace_->now();
            if (file_timer_) file_timer_->clear();  // a new attempt starts without timers, as torch's
            timer_kills_.clear();
            last_outcomes_.clear();
            elastic_event("RENDEZVOUS", false, nullptr, nullptr,
                          rdzv_began_ ? std::chrono::duration<double, std::milli>(now().steady - *rdzv_began_).count()
                                      : 0.0);
            rdzv_began_.reset();
          } else if constexpr (std::is_same_v<A, sup::act::AttemptEnded>) {
            if (trace_)
              trace_->complete(fmt::format("attempt {}", a.attempt), "attempt", 0, attempt_since_us_,
                               {{"attempt", a.attempt}, {"failed", a.failed}});
          } else if constexpr (std::is_same_v<A, sup::act::Spawn>) {
            if (!adopt_prestarted(a.local_rank)) spawn_worker(a.local_rank);
          } else if constexpr (std::is_same_v<A, sup::act::OpenExecFence>) {
            launcher_->open_exec_fence();
          } else if constexpr (std::is_same_v<A, sup::act::WatchExecs>) {
            launcher_->watch_execs([this] { run(core_.execs_settled(now())); });
          } else if constexpr (std::is_same_v<A, sup::act::WorkerEnded>) {
            const WorkerOutcome& o = a.o;
            last_outcomes_.push_back(o);
            if (trace_)
              trace_->complete(fmt::format("rank {}", o.rank), "worker", TraceWriter::worker_tid(o.local_rank),
                               trace_->now() - static_cast<std::int64_t>(o.duration_s * 1e6),
                               {{"rank", o.rank}, {"local_rank", o.local_rank}, {"pid", o.pid}, {"attempt", a.attempt},
                                {"exit_code", o.exit_code}, {"signal", o.signal},
                                {"stopped_by_agent", o.stopped_by_agent}});
          } else if constexpr (std::is_same_v<A, sup::act::SpawnMoreLater>) {
            asio::post(io_, [this, gen = a.gen] { run(core_.spawn_batch_due(gen, now())); });
          } else if constexpr (std::is_same_v<A, sup::act::SignalWorkers>) {
            signal_workers(a);
          } else if constexpr (std::is_same_v<A, sup::act::PauseOutputDrains>) {
            launcher_->pause_drains();
          } else if constexpr (std::is_same_v<A, sup::act::ResumeOutputDrains>) {
            launcher_->resume_drains();
          } else if constexpr (std::is_same_v<A, sup::act::StopSelf>) {
            signals_->stop_self();
          } else if constexpr (std::is_same_v<A, sup::act::ArmTimer>) {
            const sup::Timer t = a.timer;
            clock_->arm(t, a.at, [this, t] { run(core_.timer_fired(t, now())); });
          } else if constexpr (std::is_same_v<A, sup::act::CancelTimer>) {
            clock_->cancel(a.timer);
          } else if constexpr (std::is_same_v<A, sup::act::RetireWorkers>) {
            sup::PreCommands pre = prestart_.retire(now());
            for (const auto& c : pre)  // the pre-started workers' handles stay
              if (const auto* k = std::get_if<sup::pre::Keep>(&c)) a.keep.push_back(k->local_rank);
            run_prestart(std::move(pre));
            launcher_->retire(a.keep);
          } else if constexpr (std::is_same_v<A, sup::act::AttemptDue>) {
            asio::post(io_, [this] { run(core_.attempt_due(now())); });
          } else if constexpr (std::is_same_v<A, sup::act::HoldMasterPort>) {
            hold_master_port(a.fresh);
          } else if constexpr (std::is_same_v<A, sup::act::ReleaseMasterPort>) {
            launcher_->drop_exec_fence();
            // For workers that bind the master port themselves. Where this agent serves the
            // store, the store takes the hold over (serve_store): closing it would reset every
            // connection queued on it, as a pre-started standby's store client that connected
            // before this node's paused worker answered (#36, torch 1.13: std::terminate).
            if (!store_takes_hold()) port_hold_.reset();  // the workers may bind the master port now
          } else if constexpr (std::is_same_v<A, sup::act::Rejoin>) {
            rejoin(a.offer_port);
          } else if constexpr (std::is_same_v<A, sup::act::SendWorkerFailed>) {
            client_->worker_failed(a.f);
          } else if constexpr (std::is_same_v<A, sup::act::SendNodeDone>) {
            client_->node_done(a.round);
          } else if constexpr (std::is_same_v<A, sup::act::Pause>) {
            if (!control_ || !control_->send(a.local_rank, control::pause(a.round, a.reason, a.lost))) {
              const int lr = a.local_rank;
              std::string why = "the agent could not send its pause: ";
              if (!control_) why += "no control channel";
              else if (const std::string ended = control_->ended_why(lr); !ended.empty())
                why += "its session had ended (" + ended + ")";
              else why += "it has no session";
              why += process_state(launcher_->workers(), lr);
              asio::post(io_, [this, lr, why] { run(core_.control_closed(lr, why, now())); });
            }
          } else if constexpr (std::is_same_v<A, sup::act::Assign>) {
            assign_worker(a);
          } else if constexpr (std::is_same_v<A, sup::act::CheckStopped>) {
            asio::post(io_, [this] {
              std::vector<int> stopped;  // state T: stopped by a signal (t, a tracer's stop, is not)
              for (const auto& w : launcher_->workers())
                if (const auto st = w.exited || w.pid <= 0 ? std::nullopt : read_proc_stat(w.pid); st && st->state == 'T')
                  stopped.push_back(w.local_rank);
              run(core_.workers_stopped(stopped, now()));
            });
          } else if constexpr (std::is_same_v<A, sup::act::Finish>) {
            run_prestart(prestart_.stop_all(a.code, now()));  // Finish once they are stopped
          }
        },
        action);
  }
}

void Agent::signal_workers(const sup::act::SignalWorkers& a) {
  for (int sig : {a.sig, a.cont ? SIGCONT : 0}) {  // SIGCONT: a SIGSTOPped worker gets the stop signal now
    if (sig == 0) continue;
    if (a.only) launcher_->signal_some(sig, *a.only);
    else launcher_->signal(sig, a.escaped);
  }
}

void Agent::finish(int code) {
  run_prestart(prestart_.end());
  if (lookups_) lookups_->cancel();
  stop_preflight();
  final_events(code);
  if (monitor_) monitor_->stop();
  for (auto set : {AgentSignals::Set::kStop, AgentSignals::Set::kJobControl, AgentSignals::Set::kWinch})
    signals_->cancel(set);
  // The job ended for good (its end heard from the rendezvous, or no survivor can take it
  // over: this node saw its host lost so, or it hosts and its own stop leaves none that
  // could): a rerun starts afresh, without a recall.
  if (record_io_ && client_ &&  // (remove(): nothing when no record was asked)
      (client_->job_decided() || (embedded_server_ && !client_->why_no_takeover_of_self().empty())))
    record_io_->remove();  // (for good; done before the agent is gone: its destructor waits 2 s for it)
  if (client_) client_->close();
  // The other nodes still hear the decision already queued for them.
  if (embedded_server_) embedded_server_->stop(/*flush=*/true);
  if (takeover_server_) takeover_server_->stop();  // its accepts and ticks hold the io loop
  for (auto& s : retired_stores_) s->stop();
  retired_stores_.clear();
  // Its clients are gone with the workers, but for the static form's other nodes: there
  // no rendezvous says when they are done, so the store outlives this node's workers until
  // the others' leave it (torchrun's exit barrier; a rendezvous' "done" waits for every node).
  if (store_ && code == 0 && opts_.rdzv_backend == "static" && opts_.nnodes.max > 1) {
    signals_->wait(AgentSignals::Set::kStop, [this](int) {
      if (!store_ || lingering_done_) return;
      lingering_done_ = true;
      clock_->cancel(sup::Timer::kStoreLinger);
      store_->stop();
    });
    linger_store();
  } else if (store_) {
    store_->stop();
  }
  if (file_timer_) file_timer_->stop();  // the pipe removed
  if (health_) health_->stop();
  if (control_) control_->stop();
  // Every worker and what they started killed and reaped; the exec fence dropped.
  launcher_->finish();
  if (std::string text = logs_.finish(code); !text.empty()) notice(text);
  if (!opts_.summary_json.empty()) {
    std::ofstream out(opts_.summary_json);
    out << proto::dump_json(summary(), 2) << "\n";
    if (!out) error_line(fmt::format("cannot write --summary-json '{}'; pick a file you can write", opts_.summary_json));
  }
  if (trace_) {
    trace_instant("exit", "agent", {{"exit_code", code}, {"restarts", core_.restart_count()}});
    trace_->close();
    console_.close_file(trace_fd_);
    trace_.reset();
  }
}

void Agent::wait_signal() {
  signals_->wait(AgentSignals::Set::kStop, [this](int sig) {
    const bool stops = sig != SIGUSR1 && sig != SIGUSR2;  // the others stop the run
    if (prestart_.finishing()) {
      // The run is over but for the standby's pre-started workers being stopped: another
      // stop signal does not wait for them (the machine's Finish).
      sup::PreCommands out = prestart_.signal(sig, now());
      if (prestart_.finishing()) wait_signal();
      return run_prestart(std::move(out));
    }
    if (stops && !stop_signal_) stop_signal_ = sig;
    run(core_.signal(sig, now()));
    if (core_.state() != sup::State::kDone || prestart_.finishing()) wait_signal();
  });
}

void Agent::notice(const std::string& text) { console_.write(1, "[mglaunch] " + text + "\n"); }

void Agent::error_line(const std::string& text) { console_.write(1, "mglaunch: error: " + cli::one_line(text) + "\n"); }

void Agent::wait_job_control() {
  signals_->wait(AgentSignals::Set::kJobControl, [this](int sig) {
    // SIGTSTP (Ctrl-Z): the workers, then the agent stop; SIGCONT (fg, bg, anyone's): they
    // go on, and the time stopped counts neither against the grace nor the output drains.
    run(core_.job_control(sig, now()));
    if (core_.state() != sup::State::kDone) wait_job_control();
  });
}

void Agent::wait_winch() {
  signals_->wait(AgentSignals::Set::kWinch, [this](int) {
    launcher_->window_changed();
    if (core_.state() != sup::State::kDone) wait_winch();
  });
}

nlohmann::json Agent::summary() const {
  RunRecord run;
  run.run_id = plan_.run_id;
  run.program = opts_.program;
  run.nnodes = plan_.nnodes;
  run.node_rank = plan_.node_rank;
  run.nproc_per_node = plan_.nproc_per_node;
  run.world_size = plan_.world_size;
  run.max_restarts = opts_.max_restarts;
  run.restarts = core_.restart_count();
  run.exit_code = core_.exit_code();
  run.agent_signal = core_.agent_signal();
  run.root_cause = core_.root_cause();
  run.attempts = core_.attempts();
  return summary_json(run);
}

}  // namespace mg
