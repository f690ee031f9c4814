// mglaunch-sbatch's check of the mglaunch command it writes into the batch script: the
// flags after `--` go through mglaunch's own parser (launcher/options.h) as node 0 of the
// job would see them, so a typo is refused before anything is submitted. A separate unit
// from mg_slurm because it needs the launcher (the libraries' direction is launcher -> slurm).
#pragma once

#include <map>
#include <optional>
#include <string>

#include "slurm/sbatch.h"

namespace mg::slurm {

// The Slurm variables node 0 of the job's step would have (SLURM_JOB_ID, SLURM_NNODES,
// SLURM_NODEID=0, the node list, one task per node, the GPUs and CPUs asked for) on top of
// `env` (whose own SLURM_* variables are dropped: those of the submitting shell, if any).
std::map<std::string, std::string> simulated_step_env(const SbatchOptions& o, std::map<std::string, std::string> env);

// Why mglaunch would refuse o.command (its one-line usage error), nullopt when it parses.
// `env` is mglaunch-sbatch's environment (sbatch passes it on: PET_* and MGLAUNCH_* count).
// Pure apart from reading a --config file named in the command.
std::optional<std::string> mglaunch_usage_error(const SbatchOptions& o, const std::map<std::string, std::string>& env);

}  // namespace mg::slurm
