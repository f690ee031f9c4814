// The Slurm environment of one job step turned into a launch plan for the agent on this
// node: how many nodes, which one this is, where the rendezvous lives, how many workers.
// Pure: the environment comes in as a map, every value goes out with the variable it
// came from. Resolving node names to addresses (I/O) is the launcher's business.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace mg::slurm {

using Env = std::map<std::string, std::string>;

// A value and where it came from ("SLURM_STEP_NUM_NODES=3", "hash of job 42 step 0").
template <class T>
struct Sourced {
  T value{};
  std::string source;
};

// --- parsers of single variables; each throws std::invalid_argument naming the text ---

// "2(x3),1" -> {2, 2, 2, 1} (SLURM_TASKS_PER_NODE, SLURM_STEP_TASKS_PER_NODE).
std::vector<int> parse_tasks_per_node(std::string_view text);

// GPUs per node from SLURM_GPUS_PER_NODE: "4", "gpu:4", "a100:4", "gpu:a100:4",
// "gpu:a100:2(S:0),gpu:v100:1" (the counts are added up).
int parse_gpus_per_node(std::string_view text);

// Number of GPU indices in SLURM_JOB_GPUS / SLURM_STEP_GPUS: "0,1,2,3" or "0-3,6" -> 4 / 5.
int count_gpu_list(std::string_view text);

// A positive integer variable (SLURM_GPUS_ON_NODE, SLURM_CPUS_PER_TASK, SLURM_NNODES...).
int parse_count(std::string_view name, std::string_view text, int min_value);

// "12000-12003" or "12000,12005" (SLURM_STEP_RESV_PORTS) -> the ports, in order.
std::vector<int> parse_port_list(std::string_view text);

// NodeAddr=... from the output of `scontrol show node NAME`; empty when absent.
std::string parse_node_addr(std::string_view scontrol_output);

// --- the step ---

// True when `env` is the environment of a task of a Slurm job step (srun), as opposed to
// a plain shell, an salloc shell or the batch script itself.
bool in_slurm_step(const Env& env);

// A port range [lo, hi] (inclusive).
struct PortRange {
  int lo = 0, hi = 0;
};

// The range rendezvous ports are hashed into: the larger gap outside the kernel's
// ephemeral range (so no outgoing connection holds it by chance) above kLowestPort; a
// fixed fallback when the ephemeral range leaves no gap of at least 1000 ports.
inline constexpr int kLowestPort = 20000;
PortRange rendezvous_port_range(PortRange ephemeral);

// The rendezvous port every node of the step computes alike: the first port of
// SLURM_STEP_RESV_PORTS when Slurm reserved ports for the step (srun --resv-ports), else
// a hash of job id and step id into rendezvous_port_range(ephemeral). Two steps on the
// same first node collide only when their hashes do (about 1 in 12,000 for Linux's
// default ephemeral range).
Sourced<int> rendezvous_port(const Env& env, const std::string& job_id, const std::string& step_id,
                             PortRange ephemeral);

struct SlurmPlan {
  std::string job_id, step_id;
  Sourced<int> nnodes;
  Sourced<int> node_rank;
  Sourced<int> nproc_per_node;
  Sourced<std::string> rdzv_id;
  Sourced<std::string> rdzv_host;  // node name of node 0 (resolve before use)
  Sourced<int> rdzv_port;
  Sourced<std::string> node_name;  // this node's name (resolve before use)
  Sourced<std::vector<std::string>> nodes;  // the step's nodes, node 0 first
  std::optional<int> cpus_per_task;  // SLURM_CPUS_PER_TASK
  int restart_count = 0;  // SLURM_RESTART_COUNT: > 0 after a requeue
  std::vector<std::string> warnings;
};

// Builds the plan from the step's environment. Throws std::invalid_argument with the
// variable's name and value when one that is needed is missing or malformed.
SlurmPlan plan_from_env(const Env& env, PortRange ephemeral = {32768, 60999});

}  // namespace mg::slurm
