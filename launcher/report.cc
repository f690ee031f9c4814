#include "launcher/report.h"

#include <string.h>
#include <sys/resource.h>

#include <algorithm>
#include <cctype>
#include <ctime>
#include <filesystem>
#include <fstream>

#include <fmt/format.h>

#include "launcher/torch_version.h"
#include "ops/doctor.h"
#include "proto/text.h"

namespace mg {

std::string now_text() { return time_text(std::chrono::system_clock::now()); }

std::string time_text(std::chrono::system_clock::time_point when) {
  std::time_t t = std::chrono::system_clock::to_time_t(when);
  std::tm tm{};
  ::localtime_r(&t, &tm);
  return fmt::format("{:04}-{:02}-{:02}_{:02}:{:02}:{:02}", tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday, tm.tm_hour,
                     tm.tm_min, tm.tm_sec);
}

RootCause worker_root_cause(const WorkerOutcome& o, const std::string& host, const std::string& error_file,
                            const std::string& spawn_error, std::vector<std::string> stderr_tail) {
  RootCause rc;
  rc.time = now_text();
  rc.host = host;
  rc.worker = o;
  rc.error_file = error_file;
  rc.message = !spawn_error.empty() ? spawn_error : read_error_file_message(rc.error_file);
  // Named only when there is one to read (a worker that never ran wrote none).
  std::error_code ec;
  if (!std::filesystem::exists(rc.error_file, ec)) rc.error_file.clear();
  rc.stderr_tail = std::move(stderr_tail);
  return rc;
}

std::string missing_module(const std::vector<std::string>& stderr_tail) {
  static constexpr std::string_view kSays = "No module named ";
  for (auto l = stderr_tail.rbegin(); l != stderr_tail.rend(); ++l) {
    const auto at = l->find(kSays);
    if (at == std::string::npos || (l->find("ModuleNotFoundError") == std::string::npos &&
                                    l->find("ImportError") == std::string::npos))
      continue;
    std::string_view name = std::string_view(*l).substr(at + kSays.size());
    if (name.starts_with('\'')) {
      name.remove_prefix(1);
      name = name.substr(0, name.find('\''));
    } else {
      name = name.substr(0, name.find_first_of(" \t"));
    }
    const bool valid = !name.empty() && std::all_of(name.begin(), name.end(), [](char c) {
      return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '.';
    });
    if (valid) return std::string(name);
  }
  return {};
}

std::string missing_module_hint(const std::string& module, const std::string& interpreter, const std::string& source,
                                const std::string& alternative) {
  const std::string top = module.substr(0, module.find('.'));
  const std::string ran = fmt::format("the worker ran under {} ({}), which has no module '{}'", interpreter, source, module);
  if (!alternative.empty())
    return fmt::format("{}; {} has '{}' (`mglaunch doctor` lists each Python and its torch): choose it with --python {} "
                       "or MGLAUNCH_PYTHON={} (torchrun runs workers under its own Python), or install '{}' for {}",
                       ran, alternative, top, alternative, alternative, top, interpreter);
  return fmt::format("{}, nor has any other Python mglaunch knows of (MGLAUNCH_PYTHON, python3 on PATH, "
                     "/usr/bin/python3; `mglaunch doctor` lists them): install '{}' for {}, or choose a Python that has "
                     "it with --python PATH or MGLAUNCH_PYTHON=PATH",
                     ran, top, interpreter);
}

std::string python_with_module(const std::string& module, const std::string& interpreter,
                               const std::vector<std::string>& candidates, const std::map<std::string, std::string>& env) {
  const std::string used = python_identity(interpreter);
  for (const auto& c : candidates)
    if (python_identity(c) != used && find_python_module(c, env, module)) return c;
  return {};
}

std::string process_limit_text(unsigned long long soft, unsigned long long hard) {
  auto text = [](unsigned long long v) { return v == RLIM_INFINITY ? std::string("unlimited") : std::to_string(v); };
  return fmt::format(
      "too many processes: the process limit (RLIMIT_NPROC, `ulimit -u`, counted over every process and thread of "
      "this user) is {} and its hard limit {}, or the cgroup's pids.max (TasksMax= of a service) is reached; raise "
      "it (`ulimit -u`, nproc in /etc/security/limits.conf, TasksMax= or pids.max) or start fewer workers",
      text(soft), text(hard));
}

std::string process_limit_text() {
  rlimit lim{RLIM_INFINITY, RLIM_INFINITY};
  ::getrlimit(RLIMIT_NPROC, &lim);
  return process_limit_text(lim.rlim_cur, lim.rlim_max);
}

std::string signal_name(int sig) {
  const char* abbrev = ::sigabbrev_np(sig);
  return abbrev ? fmt::format("SIG{}", abbrev) : fmt::format("signal {}", sig);
}

std::string read_error_file_message(const std::string& path) {
  std::ifstream in(path);
  if (!in) return {};
  nlohmann::json j = nlohmann::json::parse(in, nullptr, false);
  if (j.is_discarded() || !j.is_object() || !j.contains("message")) return {};
  const auto& m = j["message"];
  if (m.is_string()) return m.get<std::string>();
  if (m.is_object() && m.contains("message") && m["message"].is_string()) return m["message"].get<std::string>();
  return mg::proto::dump_json(m);
}

std::string format_root_cause(const RootCause& rc, const std::string& program) {
  const std::string rule(60, '=');
  std::string out = fmt::format("{}\n{} FAILED\n{}\nRoot Cause (first observed failure):\n", rule, program,
                                std::string(60, '-'));
  const auto& w = rc.worker;
  out += fmt::format("  time       : {}\n  host       : {}\n", rc.time, rc.host);
  // A node that failed as a whole (killed, stopped, cut off, interrupted) has no rank: say
  // which node it was; the message says what happened to it.
  out += w.rank >= 0 ? fmt::format("  rank       : {} (local_rank: {})\n", w.rank, w.local_rank)
                     : fmt::format("  rank       : none (node {} failed, not one of its workers)\n",
                                   rc.host.empty() ? std::string("?") : rc.host);
  out += w.pid > 0 ? fmt::format("  exitcode   : {} (pid: {})\n", w.exit_code, w.pid)
                   : fmt::format("  exitcode   : {}\n", w.exit_code);
  if (w.signal) out += fmt::format("  signal     : {} ({})\n", signal_name(w.signal), w.signal);
  if (!rc.error_file.empty()) out += fmt::format("  error_file : {}\n", rc.error_file);
  out += fmt::format("  message    : {}\n", rc.message.empty() ? "<no error file written>" : rc.message);
  if (!rc.stderr_tail.empty()) {
    out += "  last stderr lines:\n";
    for (const auto& l : rc.stderr_tail) out += "    " + l + "\n";
  }
  out += rule + "\n";
  return out;
}

nlohmann::json summary_json(const RunRecord& run) {
  auto signal_or_null = [](int sig) { return sig ? nlohmann::json(signal_name(sig)) : nlohmann::json(); };
  nlohmann::json attempts = nlohmann::json::array();
  for (const auto& a : run.attempts) {
    auto sorted = a.workers;
    std::stable_sort(sorted.begin(), sorted.end(), [](const auto& x, const auto& y) { return x.rank < y.rank; });
    nlohmann::json workers = nlohmann::json::array();
    for (const auto& w : sorted)
      workers.push_back({{"rank", w.rank},
                         {"local_rank", w.local_rank},
                         {"pid", w.pid},
                         {"exit_code", w.exit_code},
                         {"signal", signal_or_null(w.signal)},
                         {"duration_s", w.duration_s},
                         {"stopped_by_agent", w.stopped_by_agent}});
    attempts.push_back({{"restart_count", a.restart_count},
                        {"start_unix", static_cast<long long>(std::chrono::system_clock::to_time_t(a.start))},
                        {"duration_s", a.duration_s},
                        {"workers", workers}});
  }
  nlohmann::json root = nullptr;
  if (run.root_cause) {
    const auto& rc = *run.root_cause;
    root = {{"time", rc.time},
            {"host", rc.host},
            {"rank", rc.worker.rank >= 0 ? nlohmann::json(rc.worker.rank) : nlohmann::json()},
            {"local_rank", rc.worker.rank >= 0 ? nlohmann::json(rc.worker.local_rank) : nlohmann::json()},
            {"exit_code", rc.worker.exit_code},
            {"signal", signal_or_null(rc.worker.signal)},
            {"message", rc.message},
            {"error_file", rc.error_file},
            {"stderr_tail", rc.stderr_tail}};
  }
  return {{"mglaunch_version", MGLAUNCH_VERSION},
          {"run_id", run.run_id},
          {"program", run.program},
          {"nnodes", run.nnodes},
          {"node_rank", run.node_rank},
          {"nproc_per_node", run.nproc_per_node},
          {"world_size", run.world_size},
          {"max_restarts", run.max_restarts},
          {"restarts", run.restarts},
          {"exit_code", run.exit_code},
          {"agent_signal", signal_or_null(run.agent_signal)},
          {"root_cause", root},
          {"attempts", attempts}};
}

}  // namespace mg
