#include "slurm/sbatch_check.h"

#include <fmt/format.h>

#include "launcher/errors.h"
#include "launcher/options.h"

namespace mg::slurm {

std::map<std::string, std::string> simulated_step_env(const SbatchOptions& o, std::map<std::string, std::string> env) {
  std::erase_if(env, [](const auto& kv) { return kv.first.starts_with("SLURM"); });
  env["SLURM_JOB_ID"] = "1";
  env["SLURM_STEP_ID"] = "0";
  env["SLURM_NNODES"] = std::to_string(o.nodes);
  env["SLURM_STEP_NUM_NODES"] = std::to_string(o.nodes);
  env["SLURM_NODEID"] = "0";
  env["SLURM_PROCID"] = "0";
  env["SLURM_NTASKS"] = std::to_string(o.nodes);
  env["SLURM_STEP_NODELIST"] = o.nodes == 1 ? "node0" : fmt::format("node[0-{}]", o.nodes - 1);
  env["SLURMD_NODENAME"] = "node0";
  env["SLURM_STEP_TASKS_PER_NODE"] = o.nodes == 1 ? "1" : fmt::format("1(x{})", o.nodes);
  if (o.gpus_per_node) env["SLURM_GPUS_ON_NODE"] = std::to_string(*o.gpus_per_node);
  if (o.cpus_per_task) env["SLURM_CPUS_PER_TASK"] = std::to_string(*o.cpus_per_task);
  if (o.requeue) env["SLURM_RESTART_COUNT"] = "0";
  return env;
}

std::optional<std::string> mglaunch_usage_error(const SbatchOptions& o, const std::map<std::string, std::string>& env) {
  std::vector<std::string> argv{"mglaunch"};
  argv.insert(argv.end(), o.command.begin(), o.command.end());
  // The machine as the job will see it, not this login node: nothing is probed or bound.
  HardwareProbe probe;
  probe.gpu_count = [&] { return o.gpus_per_node.value_or(0); };
  probe.cpu_count = [&] { return o.cpus_per_task.value_or(1); };
  probe.node_address = [](const std::string& name) { return HardwareProbe::NodeAddress{name, "simulated"}; };
  probe.ephemeral_ports = [] { return std::pair<int, int>{32768, 60999}; };
  probe.listen_error = [](const std::string&, int) { return std::optional<std::string>{}; };
  try {
    parse_agent_args(argv, simulated_step_env(o, env), probe);
  } catch (const UsageError& e) {
    return std::string(e.what());
  }
  return std::nullopt;
}

}  // namespace mg::slurm
