// mglaunch-sbatch: one command line in, one correct multi-node batch script out. Parsing
// and script generation are pure; submitting (sbatch) lives in sbatch_main.cc.
//
// The script: #SBATCH lines (one task per node, --signal=B:USR1@N), then
//   srun --kill-on-bad-exit=1 --ntasks-per-node=1 /abs/mglaunch [flags] PROGRAM ARGS &
// in the background so the batch shell can take SIGUSR1 (pre-emption or the time limit)
// and hand it to the step; the agents pass it to the workers, which checkpoint and exit
// 75. With --requeue, a step that ended with 75 requeues the job, and the next run
// (SLURM_RESTART_COUNT > 0) resumes from the checkpoint.
#pragma once

#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace mg::slurm {

// Bad mglaunch-sbatch flags (exit code 2).
struct SbatchUsageError : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

inline constexpr int kStoppedExitCode = 75;  // mgtrain (and friends): checkpointed, run me again

struct SbatchOptions {
  int nodes = 1;
  std::optional<int> gpus_per_node;
  std::string partition, time, account, output, job_name = "mglaunch";
  std::optional<int> cpus_per_task;
  std::string mem, qos, gres;
  bool exclusive = false;
  // --sbatch OPTION (repeatable): any other sbatch option, written as `#SBATCH OPTION`.
  std::vector<std::string> sbatch_options;
  bool requeue = false;
  int signal_before = 120;  // seconds before the time limit that SIGUSR1 comes
  bool dry_run = false;
  bool wait = false;
  std::string mglaunch;  // absolute path of mglaunch; empty: found next to mglaunch-sbatch
  std::vector<std::string> command;  // mglaunch flags, PROGRAM, ARGS
};

// Result of parsing: options, or a text to print and exit 0 (--help, --version).
struct SbatchParse {
  std::optional<SbatchOptions> options;
  std::string message;
};

// argv[0] is skipped. Throws SbatchUsageError with one line saying what is wrong.
SbatchParse parse_sbatch_args(const std::vector<std::string>& argv);

// The batch script. `o.mglaunch` must be set (absolute).
std::string make_batch_script(const SbatchOptions& o);

}  // namespace mg::slurm
