#include "slurm/sbatch_check.h"

#include <cctype>
#include <stdexcept>
#include <string_view>

#include <fmt/format.h>

#include "cli/errors.h"
#include "launcher/options.h"
#include "slurm/env.h"

namespace mg::slurm {

namespace {

// GPUs in a --gres value ("gpu:a100:4,nvme:1", "gpu:2(S:0-1)", "gpu" is 1): the gpu
// entries' counts added up; nullopt when a count cannot be read.
std::optional<int> gres_gpus(std::string_view gres) {
  int total = 0;
  while (!gres.empty()) {
    const auto comma = gres.find(',');
    std::string_view item = gres.substr(0, comma);
    gres = comma == std::string_view::npos ? std::string_view{} : gres.substr(comma + 1);
    item = item.substr(0, item.find('('));
    if (item.substr(0, item.find(':')) != "gpu") continue;
    const auto colon = item.rfind(':');
    if (colon == std::string_view::npos || item.find(':') == colon) {  // gpu, gpu:N, gpu:TYPE
      const std::string_view last = colon == std::string_view::npos ? "" : item.substr(colon + 1);
      if (!last.empty() && std::isdigit(static_cast<unsigned char>(last[0]))) {
        try {
          total += parse_gpus_per_node(last);
        } catch (const std::invalid_argument&) {
          return std::nullopt;
        }
      } else {
        total += 1;
      }
      continue;
    }
    try {  // gpu:TYPE:N
      total += parse_gpus_per_node(item.substr(colon + 1));
    } catch (const std::invalid_argument&) {
      return std::nullopt;
    }
  }
  return total;
}

}  // namespace

JobGpus job_gpus_per_node(const SbatchOptions& o) {
  if (o.gpus_per_node) return {*o.gpus_per_node, true};
  std::optional<int> per_node;       // --sbatch=--gpus-per-node, or --gpus on one node
  std::optional<std::string> gres = o.gres.empty() ? std::nullopt : std::optional<std::string>(o.gres);
  bool known = true;
  for (const auto& opt : o.sbatch_options) {
    const auto start = opt.find_first_not_of('-');
    if (start == std::string::npos) continue;
    const bool long_name = opt.size() > 1 && opt[1] == '-';
    const auto eq = opt.find('=');
    const std::string name = long_name ? opt.substr(start, eq == std::string::npos ? eq : eq - start) : opt.substr(1, 1);
    const std::string value = long_name ? (eq == std::string::npos ? "" : opt.substr(eq + 1))
                                        : opt.substr(opt.size() > 2 && opt[2] == '=' ? 3 : 2);
    if (long_name && name == "gres") {
      gres = value;
    } else if ((long_name && name == "gpus-per-node") || ((name == "gpus" || (!long_name && name == "G")) && o.nodes == 1)) {
      try {
        per_node = parse_gpus_per_node(value);  // N or TYPE:N
      } catch (const std::invalid_argument&) {
        known = false;
      }
    } else if ((long_name && name.starts_with("gpu")) || (!long_name && name == "G")) {
      known = false;  // --gpus over several nodes, --gpus-per-task, an abbreviation: not known here
    }
  }
  if (per_node) return {*per_node, known};
  if (gres) {
    const auto n = gres_gpus(*gres);
    return {n.value_or(0), known && n.has_value()};
  }
  return {0, known};
}

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
  if (const auto gpus = job_gpus_per_node(o); gpus.known && gpus.count > 0)
    env["SLURM_GPUS_ON_NODE"] = std::to_string(gpus.count);
  if (o.cpus_per_task) env["SLURM_CPUS_PER_TASK"] = std::to_string(*o.cpus_per_task);
  if (o.requeue) env["SLURM_RESTART_COUNT"] = "0";
  return env;
}

std::optional<std::string> mglaunch_usage_error(const SbatchOptions& o, const std::map<std::string, std::string>& env,
                                                std::string* warning) {
  std::vector<std::string> argv{"mglaunch"};
  argv.insert(argv.end(), o.command.begin(), o.command.end());
  const auto step_env = simulated_step_env(o, env);
  // The machine as the job will see it, not this login node: nothing is probed or bound.
  auto check = [&](int gpus) -> std::optional<std::string> {
    HardwareProbe probe;
    probe.gpu_count = [gpus] { return gpus; };
    probe.cpu_count = [&] { return o.cpus_per_task.value_or(1); };
    probe.node_address = [](const std::string& name) { return HardwareProbe::NodeAddress{name, "simulated"}; };
    probe.ephemeral_ports = [] { return std::pair<int, int>{32768, 60999}; };
    probe.listen_error = [](const std::string&, int) { return std::optional<std::string>{}; };
    auto e = step_env;
    if (gpus > 0) e["SLURM_GPUS_ON_NODE"] = std::to_string(gpus);
    try {
      parse_agent_args(argv, e, probe);
    } catch (const UsageError& err) {
      return std::string(err.what());
    }
    return std::nullopt;
  };
  const auto gpus = job_gpus_per_node(o);
  if (gpus.known) return check(gpus.count);
  // GPUs asked for in a way not worked out here: what depends on their count is not refused.
  auto why = check(8);
  if (!why) return std::nullopt;
  for (int n : {1, 64})
    if (!check(n)) {
      if (warning)
        *warning = fmt::format("{} (with 8 GPUs per node; the job's GPUs per node are not known here: give "
                               "--gpus-per-node N to have this checked)",
                               *why);
      return std::nullopt;
    }
  return why;
}

}  // namespace mg::slurm
