// Reporting of a node's run: the failure report block (torchrun's "Root Cause"), the
// --summary-json document and the torchelastic error-file reader. Pure functions of the
// recorded outcomes (read_error_file_message reads one file); the agent records, this
// unit formats.
#pragma once

#include <chrono>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace mg {

struct WorkerOutcome {
  int rank = 0;
  int local_rank = 0;
  int pid = -1;
  int exit_code = 0;  // shell style: N or 128+signal
  int signal = 0;     // terminating signal, 0 if it exited
  double duration_s = 0;
  bool stopped_by_agent = false;  // ended because the agent stopped the group
};

struct RootCause {
  std::string time;
  std::string host;
  WorkerOutcome worker;
  std::string error_file;
  std::string message;  // from the torchelastic error file, or the spawn error
  std::vector<std::string> stderr_tail;
};

struct AttemptRecord {
  int restart_count = 0;
  std::chrono::system_clock::time_point start;
  double duration_s = 0;
  std::vector<WorkerOutcome> workers;  // in the order they ended
};

// What --summary-json reports about one node's run.
struct RunRecord {
  std::string run_id;
  std::string program;
  int nnodes = 1;
  int node_rank = 0;
  int nproc_per_node = 1;
  int world_size = 1;
  int max_restarts = 0;
  int restarts = 0;
  int exit_code = 0;
  int agent_signal = 0;  // the signal that stopped the agent, 0 if none
  std::optional<RootCause> root_cause;
  std::vector<AttemptRecord> attempts;
};

// Reads the message of a torchelastic error file ({"message": {"message": ...}} or
// {"message": "..."}); empty when absent or unreadable.
std::string read_error_file_message(const std::string& path);

// The root cause of a worker that failed on its own: its outcome, the message of its
// torchelastic error file at `error_file` (or `spawn_error` when it never ran; the path
// is kept only when the file exists), its last stderr lines, the time now.
RootCause worker_root_cause(const WorkerOutcome& o, const std::string& host, const std::string& error_file,
                            const std::string& spawn_error, std::vector<std::string> stderr_tail);

// The module a Python worker could not import, from its last stderr lines
// ("ModuleNotFoundError: No module named 'torch.distributed'", Python 2's "ImportError: No
// module named torch"): "torch.distributed"; empty when there is none.
std::string missing_module(const std::vector<std::string>& stderr_tail);

// The root cause's message for a worker that could not import `module`: the interpreter
// that ran it (`interpreter`, how it was chosen: `source`), another Python that has the
// module (`alternative`, found as `mglaunch doctor` finds Pythons: python_with_module();
// empty when none has it) and how to choose it. One line.
std::string missing_module_hint(const std::string& module, const std::string& interpreter, const std::string& source,
                                const std::string& alternative);

// The first of `candidates` (ops/doctor.h's python_candidates()) that is not `interpreter`
// (ops/doctor.h's python_identity()) and has `module`'s top-level package on its search path (found without
// starting Python: launcher/torch_version.h); empty when none.
std::string python_with_module(const std::string& module, const std::string& interpreter,
                               const std::vector<std::string>& candidates, const std::map<std::string, std::string>& env);

// The failure report block (several lines, each ending in '\n').
std::string format_root_cause(const RootCause& rc, const std::string& program);

// Why a worker could not be made (clone: EAGAIN, ENOMEM) and what to do: the process
// limit (RLIMIT_NPROC, `ulimit -u`) with its soft and hard values as getrlimit gave them
// (RLIM_INFINITY: unlimited), a cgroup's pids.max, fewer workers. process_limit_text()
// reads this process's limit.
std::string process_limit_text(unsigned long long soft, unsigned long long hard);
std::string process_limit_text();

// "SIGTERM", or "signal N" for a number without a name.
std::string signal_name(int sig);

// The local time as torchrun prints it: 2026-11-23_10:45:41.
std::string now_text();
std::string time_text(std::chrono::system_clock::time_point when);

// The --summary-json document; workers of each attempt sorted by rank.
nlohmann::json summary_json(const RunRecord& run);

}  // namespace mg
