// The WorkerSpec of one local rank: what the agent hands to the spawner. Pure: the plan,
// the options and the agent's environment in, the spec out. The agent adds what needs the
// process (stdin pipe, descriptor limit, CPU set).
#pragma once

#include <string>

#include "launcher/options.h"
#include "launcher/plan.h"
#include "launcher/worker_process.h"

namespace mg {

struct SpecInputs {
  int local_rank = 0;
  int attempt = 0;          // the restart count (TORCHELASTIC_RESTART_COUNT)
  std::string dir;          // the rank's attempt directory (logs, error.json)
  std::string run_mark;     // MGLAUNCH_RUN_MARK for the watchdog ("" = none)
  bool merge_streams = false;  // the agent's stdout and stderr are one file
};

// argv and executable; torchrun's environment over `base_env` (TORCHELASTIC_ERROR_FILE in
// `dir`); the console and the log files of stdout/stderr by --redirects, --tee and
// --local_ranks_filter; one pipe when both streams go only to one console; the line prefix.
// The line prefix of local rank `local_rank`'s relayed lines ("[rank3]:", or
// --log-line-prefix-template's expansion).
std::string worker_line_prefix(const RunPlan& plan, const AgentOptions& opts, int local_rank);

WorkerSpec make_worker_spec(const RunPlan& plan, const AgentOptions& opts, const EnvMap& base_env, const SpecInputs& in);

}  // namespace mg
