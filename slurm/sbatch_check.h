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

// GPUs per node the job asks for: --gpus-per-node, else --sbatch=--gpus-per-node=[TYPE:]N
// (--sbatch=--gpus=N on one node), else the gpu entries of --gres (gpu[:TYPE][:N]); 0 when
// none. `known` is false when GPUs are asked for in a way not worked out here (--gpus over
// several nodes, --gpus-per-task, an abbreviated name).
struct JobGpus {
  int count = 0;
  bool known = true;
};
JobGpus job_gpus_per_node(const SbatchOptions& o);

// Why mglaunch would refuse o.command (its one-line usage error), nullopt when it parses.
// `env` is mglaunch-sbatch's environment (sbatch passes it on: PET_* and MGLAUNCH_* count).
// When the GPUs per node are not known, an error that another GPU count avoids (no GPU
// for --nproc_per_node=gpu, a --stdin-rank above the workers) is not one: it goes to
// `warning` instead. Pure apart from reading a --config file named in the command.
std::optional<std::string> mglaunch_usage_error(const SbatchOptions& o, const std::map<std::string, std::string>& env,
                                                std::string* warning = nullptr);

}  // namespace mg::slurm
