// The Agent's operations side (launcher/agent.h): the FileTimer watchdog, the health
// check, torch's elastic events (--event-log-handler console), the trace and the monitor.
#include "launcher/agent.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <iterator>

#include <fmt/format.h>

#include "cli/errors.h"
#include "ops/health.h"
#include "ops/monitor.h"
#include "ops/trace.h"
#include "process/proc.h"

namespace mg {

void Agent::start_file_timer() {
  // As torch's LocalElasticAgent: on with TORCHELASTIC_ENABLE_FILE_TIMER=1; the pipe is
  // TORCHELASTIC_TIMER_FILE, else one of its own, and the workers get its path.
  const auto on = base_env_.find("TORCHELASTIC_ENABLE_FILE_TIMER");
  if (on == base_env_.end() || on->second != "1") return;
  auto path = base_env_.find("TORCHELASTIC_TIMER_FILE");
  if (path == base_env_.end() || path->second.empty())
    path = base_env_.insert_or_assign("TORCHELASTIC_TIMER_FILE", ftimer::default_pipe_path()).first;
  ftimer::ServerHooks h;
  h.admit = [this](const ProcStat& st) { return worker_of(st.pid) >= 0; };  // its workers' process trees only
  h.is_worker = [this](pid_t pid) {
    for (const WorkerState& w : launcher_->workers())
      if (w.pid == pid && !w.exited) return true;
    return false;
  };
  h.reap = [this](const ftimer::Expired& e) { reap_expired(e); };
  h.log = [this](const std::string& line) { notice(line); };
  h.event = [this](const std::string& name, const ftimer::Request* r) { watchdog_event(name, r); };
  try {
    file_timer_ = std::make_unique<ftimer::Server>(io_, path->second, std::move(h));
  } catch (const std::runtime_error& e) {
    throw UsageError(e.what());  // it names the variable, the path and the fix
  }
}

void Agent::start_health_check() {
  const auto var = base_env_.find("TORCHELASTIC_HEALTH_CHECK_PORT");
  if (var == base_env_.end()) return;
  int port = 0;
  try {
    port = mon::parse_health_port(var->second);
  } catch (const std::invalid_argument& e) {
    throw UsageError(e.what());  // names the variable and the fix
  }
  try {
    health_ = std::make_unique<mon::HealthServer>(io_, opts_.metrics_host, port, [this] { return monitor_facts(); },
                                                  shares_.health);
  } catch (const std::exception& e) {
    // torchrun never fails a run for its health-check server (the stock one listens on
    // nothing; another program may serve the port, as a cluster's own checker does).
    notice(fmt::format("warning: no health check: {}", e.what()));
    return;
  }
  notice(fmt::format("health check on {}", health_->url()));
}

void Agent::reap_expired(const ftimer::Expired& e) {
  // The timer was admitted for one of this agent's workers or a process of its tree (a
  // setsid() daemon of a worker included: its own group, but still below the agent, a
  // subreaper). As torch's FileTimerServer, the signal goes to that process only (what it
  // started goes with the worker group, at the latest when the attempt ends), and only
  // while it is still the same process: through a pidfd, after checking its start time.
  const int lr = worker_of(e.pid);  // -1: its worker ended since (it lives on below the agent)
  const std::string who = lr >= 0 ? fmt::format("rank {}: ", plan_.rank_offset + lr) : std::string();
  notice(fmt::format("{}FileTimer '{}' expired; sending {} to pid {}", who, e.scope_id, signal_name(e.signal), e.pid));
  if (const int sent = signal_same_process(e.pid, e.start, e.signal); sent != 1) {
    notice(fmt::format("FileTimer '{}': pid {} {}: nothing sent", e.scope_id, e.pid,
                       sent == 0 ? std::string("has ended") : std::string("cannot be signalled: ") + std::strerror(errno)));
    return;
  }
  if (lr >= 0) timer_kills_[lr] = {e.pid, e.signal, e.scope_id};
  ftimer::Request r;
  r.pid = e.pid;
  r.scope_id = e.scope_id;
  r.expiration_time = e.expiration_time;
  r.signal = e.signal;
  watchdog_event("kill worker process", &r);
}

namespace {
// Python's json.dumps of `j` (", " and ": " between items, as torch's Event.serialize()).
std::string python_json(const nlohmann::ordered_json& j) {
  if (j.is_object()) {
    std::string out = "{";
    for (auto it = j.begin(); it != j.end(); ++it) {
      if (it != j.begin()) out += ", ";
      out += nlohmann::json(it.key()).dump() + ": " + python_json(it.value());
    }
    return out + "}";
  }
  if (j.is_array()) {
    std::string out = "[";
    for (std::size_t i = 0; i < j.size(); ++i) out += (i ? ", " : "") + python_json(j[i]);
    return out + "]";
  }
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}
}  // namespace

void Agent::elastic_event(const std::string& state, bool from_worker, const WorkerOutcome* w,
                          nlohmann::json raw_error, std::optional<double> duration_ms,
                          const nlohmann::ordered_json* md_given, const std::string& name) {
  if (opts_.event_log_handler != "console") return;
  // torch's _construct_event: the inner "metadata" is itself a JSON string.
  nlohmann::ordered_json md;
  md["group_world_size"] = plan_.nnodes;
  md["entry_point"] = opts_.program;
  if (w) {
    md["local_rank"] = nlohmann::json::array({w->local_rank});
    md["role_rank"] = nlohmann::json::array({w->rank});
    md["role_world_size"] = nlohmann::json::array({plan_.world_size});
  }
  if (md_given) md = *md_given;
  nlohmann::ordered_json m;
  m["run_id"] = plan_.run_id;
  m["global_rank"] = w ? nlohmann::json(w->rank) : nlohmann::json();
  m["group_rank"] = plan_.node_rank;
  m["worker_id"] = w ? nlohmann::json(std::to_string(w->pid)) : nlohmann::json();
  m["role"] = opts_.role;
  m["hostname"] = local_hostname();
  m["state"] = state;
  m["total_run_time"] =
      std::chrono::duration_cast<std::chrono::seconds>(now().steady - started_at_).count();
  m["rdzv_backend"] = opts_.rdzv_backend;
  m["raw_error"] = raw_error;
  m["metadata"] = python_json(md);
  m["agent_restarts"] = core_.restart_count();
  m["duration_ms"] = duration_ms ? nlohmann::json(*duration_ms) : nlohmann::json();
  nlohmann::ordered_json e;
  e["name"] = name.empty() ? "torchelastic.worker.status." + state : name;
  e["source"] = from_worker ? "WORKER" : "AGENT";
  e["timestamp"] = std::chrono::duration_cast<std::chrono::milliseconds>(now().wall.time_since_epoch()).count();
  e["metadata"] = m;
  console_.write(1, python_json(e) + "\n");
}

void Agent::watchdog_event(const std::string& name, const ftimer::Request* r) {
  // torch's _log_watchdog_event: the event's name is the watchdog's, its state RUNNING.
  nlohmann::ordered_json md;
  md["watchdog_event"] = name;
  if (r) {
    md["worker_pid"] = std::to_string(r->pid);
    md["scope_id"] = r->scope_id;
    md["expiration_time"] = fmt::format("{}", r->expiration_time);
    md["signal"] = std::to_string(r->signal);
  }
  elastic_event("RUNNING", false, nullptr, nullptr, std::nullopt, &md, name);
}

void Agent::final_events(int code) {
  (void)code;
  std::sort(last_outcomes_.begin(), last_outcomes_.end(),
            [](const WorkerOutcome& a, const WorkerOutcome& b) { return a.rank < b.rank; });  // torch's order
  for (const WorkerOutcome& o : last_outcomes_) {
    const std::string state = o.stopped_by_agent ? "TERMINATED" : o.exit_code == 0 ? "SUCCEEDED" : "FAILED";
    nlohmann::json raw = nullptr;
    if (state == "FAILED") {
      std::ifstream in(logs_.attempt_dir(core_.restart_count(), o.local_rank) + "/error.json");
      std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      if (!text.empty()) raw = text;
    }
    elastic_event(state, true, &o, raw, std::nullopt);
  }
  // As torchrun's launcher: SUCCEEDED says the agent's run() returned (its workers may have
  // failed), FAILED that it was stopped (by a signal).
  if (stop_signal_)
    elastic_event("FAILED", false, nullptr, fmt::format("stopped by {}", signal_name(stop_signal_)), std::nullopt);
  else
    elastic_event("SUCCEEDED", false, nullptr, nullptr, std::nullopt);
}

void Agent::start_ops() {
  if (!opts_.trace_file.empty()) {
    trace_fd_ = open_output_file(opts_.trace_file, O_TRUNC);
    if (trace_fd_ < 0)
      throw UsageError(fmt::format("--trace '{}' cannot be written: {}; pick a file you can write", opts_.trace_file,
                                   errno == ENXIO ? "a FIFO that no process reads" : std::strerror(errno)));
    trace_ = std::make_unique<TraceWriter>([this](std::string_view text) { console_.write_file(trace_fd_, text); },
                                           ::getpid(), fmt::format("mglaunch {} {}", local_hostname(), plan_.run_id));
    for (int lr = 0; lr < plan_.nproc_per_node; ++lr)
      trace_->thread_name(TraceWriter::worker_tid(lr), fmt::format("local_rank {}", lr));
  }
  const bool sampling = opts_.monitor_s > 0 || !opts_.metrics_json.empty() || opts_.metrics_port >= 0;
  if (!sampling) return;
  mon::MonitorOptions mo;
  mo.interval_s = opts_.monitor_s > 0 ? opts_.monitor_s : 5.0;
  mo.console_line = opts_.monitor_s > 0;
  mo.json_file = opts_.metrics_json;
  mo.metrics_port = opts_.metrics_port;
  mo.metrics_host = opts_.metrics_host;
  mo.metrics_max_connections = shares_.metrics;
  mo.host = local_hostname();
  mo.run_id = plan_.run_id;
  mo.gpu_probe = hardware_->gpu_probe();
  try {
    monitor_ = std::make_unique<mon::AgentMonitor>(io_, console_, std::move(mo), [this] { return monitor_facts(); },
                                                   [this](const std::string& line) { notice(line); });
  } catch (const std::runtime_error& e) {
    throw UsageError(e.what());
  }
  if (monitor_->metrics_port() >= 0) notice(fmt::format("metrics on {}", monitor_->metrics_url()));
}

mon::AgentFacts Agent::monitor_facts() const {
  mon::AgentFacts f;
  f.host = local_hostname();
  f.run_id = plan_.run_id;
  f.node_rank = plan_.node_rank;
  f.round = core_.round();
  f.restarts = core_.restart_count();
  f.max_restarts = opts_.max_restarts;
  for (const WorkerState& w : launcher_->workers()) {
    mon::RankTarget t;
    t.rank = w.rank;
    t.local_rank = w.local_rank;
    t.pid = w.pid;
    t.reaped = w.exited;
    if (!w.exited) t.state = core_.state() == sup::State::kStopping ? "stopping" : "running";
    else t.state = w.wait_status == 0 ? "exited" : "failed";
    f.ranks.push_back(std::move(t));
  }
  return f;
}

void Agent::trace_instant(const std::string& name, const std::string& cat, nlohmann::json args) {
  if (trace_) trace_->instant(name, cat, 0, std::move(args));
}

}  // namespace mg
