// The resolved plan of one agent: who the workers are (ranks, world), where the master
// is, what each worker runs and which environment it gets. build_* functions are pure so
// the torchrun environment contract is unit-tested without starting anything.
#pragma once

#include <cstddef>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "launcher/options.h"

namespace mg {

using EnvMap = std::map<std::string, std::string>;

struct RunPlan {
  std::string run_id = "none";
  int nnodes = 1;
  int node_rank = 0;
  int nproc_per_node = 1;
  int world_size = 1;
  int rank_offset = 0;
  std::string master_addr;
  int master_port = 0;
  std::string rdzv_backend;
  std::string rdzv_endpoint;
  std::vector<std::string> nodes;  // addresses of the nodes, when known
  std::string executable;          // absolute path of what exec() runs
  std::vector<std::string> argv;   // argv[0..]: before ${local_rank} substitution
  bool set_omp_threads = false;    // OMP_NUM_THREADS=1 added (torchrun's rule)
  // The major version of the torch a Python worker imports (launcher/torch_version.h); 0:
  // unknown (not Python, or not found). 2 and later: no NCCL_ASYNC_ERROR_HANDLING, whose
  // 1.x name draws a deprecation warning from every 2.x NCCL process group.
  int torch_major = 0, torch_minor = 0;
  // Workers connect to the agent's store at MASTER_ADDR:MASTER_PORT as clients
  // (TORCHELASTIC_USE_AGENT_STORE=True), as torchrun 2.x does; the agent serves it.
  bool agent_store = false;
  // The round's epoch from the rendezvous (proto::Assignment::epoch), MGLAUNCH_EPOCH in the
  // workers' environment; 0: none (no rendezvous, or one before #34): not set.
  int epoch = 0;
  // The rendezvous run that epoch belongs to (proto::Assignment::run), MGLAUNCH_RUN; empty:
  // none (no rendezvous, or one before #37): not set.
  std::string run;
  // The directory of the Python package mglaunch ships (mglaunch_recovery, in-place recovery
  // for torch scripts: docs/python-recovery.md), put first on the workers' PYTHONPATH; empty
  // when this mglaunch has none beside it (<bin>/../share/mglaunch/python).
  std::string python_dir;
  std::vector<std::string> notes;  // "[mglaunch] ..." lines for the agent to print at start
};

// <directory of this executable>/../share/mglaunch/python when it exists (the build tree,
// `make install` and the .deb lay it out so), else empty.
std::string shipped_python_dir();

// Variables mglaunch sets for one worker (the base environment is added on top at spawn).
EnvMap build_contract_env(const RunPlan& plan, const AgentOptions& opts, const EnvMap& base, int local_rank,
                          int restart_count, const std::string& error_file);

// argv of one worker, with ${local_rank} substituted and --local_rank=N when asked.
std::vector<std::string> build_worker_argv(const RunPlan& plan, const AgentOptions& opts, int local_rank);

// Resolves the plan for this node: program and interpreter paths (ProgramNotFound when
// missing), master address and port (probing for a free one with --standalone, checking
// that a static master port is free on node 0: UsageError naming the port when not).
RunPlan make_plan(const AgentOptions& opts, const EnvMap& base_env);

// What the --dry-run document shows for a value a multi-node dynamic rendezvous decides.
inline constexpr const char* kDecidedAtRendezvous = "decided at rendezvous";

// The --dry-run document: nnodes, node_rank, nproc_per_node, nodes, rdzv_endpoint,
// rdzv_id and per worker its rank, argv and the environment mglaunch sets. With a
// multi-node dynamic rendezvous (c10d, mglaunch, etcd; a Slurm step) the ranks, world
// size, master address and port (and the node rank unless given) read
// kDecidedAtRendezvous.
nlohmann::json plan_to_json(const RunPlan& plan, const AgentOptions& opts, const EnvMap& base_env);

// gethostname(), or "localhost" when it fails.
std::string local_hostname();

// Python's socket.getfqdn() for this host (what torchrun advertises as MASTER_ADDR).
std::string fq_hostname();

// `n` random bytes from the kernel (getrandom).
void random_bytes(void* out, std::size_t n);
// This agent's id in the rendezvous (proto::Join::agent_id): `HOST:PID:` and 64 random bits
// in 16 hex digits, new at each start. The job counts its voters by this id, and a pod's
// restart (PID 1, the pod name as host name) or a service started again after a reboot has
// the same host and pid: without the random part it would count as its former voter
// (review s39-late H3). HOST is cut so that the id fits proto::kMaxIdBytes.
std::string new_agent_id(std::string_view host, long pid);
// A random UUID4 string, used as run id for --standalone.
std::string random_uuid();

}  // namespace mg
