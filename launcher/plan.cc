#include "launcher/plan.h"

#include <netdb.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <filesystem>
#include <random>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli/errors.h"
#include "launcher/port.h"
#include "launcher/torch_version.h"
#include "ops/hwprobe.h"
#include "proto/limits.h"
#include "rendezvous/endpoint.h"
#include "rendezvous/lookup.h"
#include "process/command.h"

namespace mg {

EnvMap build_contract_env(const RunPlan& plan, const AgentOptions& opts, const EnvMap& base, int local_rank,
                          int restart_count, const std::string& error_file) {
  const int rank = plan.rank_offset + local_rank;
  auto inherit_or = [&base](const char* name, const char* fallback) {
    auto it = base.find(name);
    return it != base.end() ? it->second : std::string(fallback);
  };
  EnvMap env{
      {"LOCAL_RANK", std::to_string(local_rank)},
      {"RANK", std::to_string(rank)},
      {"GROUP_RANK", std::to_string(plan.node_rank)},
      {"ROLE_RANK", std::to_string(rank)},
      {"ROLE_NAME", opts.role},
      {"LOCAL_WORLD_SIZE", std::to_string(plan.nproc_per_node)},
      {"WORLD_SIZE", std::to_string(plan.world_size)},
      {"GROUP_WORLD_SIZE", std::to_string(plan.nnodes)},
      {"ROLE_WORLD_SIZE", std::to_string(plan.world_size)},
      {"MASTER_ADDR", plan.master_addr},
      {"MASTER_PORT", std::to_string(plan.master_port)},
      {"TORCHELASTIC_RESTART_COUNT", std::to_string(restart_count)},
      {"TORCHELASTIC_MAX_RESTARTS", std::to_string(opts.max_restarts)},
      {"TORCHELASTIC_RUN_ID", plan.run_id},
      {"TORCHELASTIC_USE_AGENT_STORE", plan.agent_store ? "True" : "False"},
      {"TORCHELASTIC_ERROR_FILE", error_file},
      {"TORCH_NCCL_ASYNC_ERROR_HANDLING", inherit_or("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")},
  };
  // torchrun 1.x's name, for workers that may be on 1.x (torch 2.x warns about it); a value
  // the user set is inherited either way.
  // (torch 2.0 and 2.1 read only this name.)
  if (plan.torch_major < 2 || (plan.torch_major == 2 && plan.torch_minor < 2))
    env["NCCL_ASYNC_ERROR_HANDLING"] = inherit_or("NCCL_ASYNC_ERROR_HANDLING", "1");
  // The agent's store speaks the classic TCPStore protocol, which every torch client speaks;
  // torch 2.x's env:// clients default to the libuv one, which Debian's torch 2.x lacks
  // ("use_libuv was requested but PyTorch was build without libuv support"). A USE_LIBUV the
  // user set is inherited.
  if (plan.agent_store && plan.torch_major >= 2) env["USE_LIBUV"] = inherit_or("USE_LIBUV", "0");
  // The round's epoch (#34): a worker writes its checkpoints only under the newest it saw.
  if (plan.epoch > 0) env["MGLAUNCH_EPOCH"] = std::to_string(plan.epoch);
  // Its run (#37): epochs compare only within one run; a new run of the job adopts the
  // checkpoint an older one left.
  if (plan.epoch > 0 && !plan.run.empty()) env["MGLAUNCH_RUN"] = plan.run;
  if (plan.set_omp_threads) env["OMP_NUM_THREADS"] = "1";
  // The shipped package first (import mglaunch_recovery with no install step), then the user's path.
  if (!plan.python_dir.empty()) {
    const auto pp = base.find("PYTHONPATH");
    env["PYTHONPATH"] = pp != base.end() && !pp->second.empty() ? plan.python_dir + ":" + pp->second : plan.python_dir;
  }
  if (!opts.gpu_ids.empty()) env["CUDA_VISIBLE_DEVICES"] = std::to_string(opts.gpu_ids.at(local_rank));
  if (opts.virtual_local_rank) {
    // torch 2.x's --virtual-local-rank: every worker is local rank 0 of its own one GPU: its
    // --gpu_ids entry, else its entry of the inherited CUDA_VISIBLE_DEVICES, else GPU N.
    env["LOCAL_RANK"] = "0";
    if (opts.gpu_ids.empty()) {
      std::string device = std::to_string(local_rank);
      if (auto it = base.find("CUDA_VISIBLE_DEVICES"); it != base.end()) {
        std::string_view rest = it->second;
        for (int i = 0; i < local_rank && rest.find(',') != std::string_view::npos; ++i) rest.remove_prefix(rest.find(',') + 1);
        device = std::string(rest.substr(0, rest.find(',')));
      }
      env["CUDA_VISIBLE_DEVICES"] = device;
    }
  }
  return env;
}

std::vector<std::string> build_worker_argv(const RunPlan& plan, const AgentOptions& opts, int local_rank) {
  std::vector<std::string> argv = plan.argv;
  // plan.argv ends with the program's own arguments; substitute only in those.
  const std::size_t first_user_arg = argv.size() - opts.program_args.size();
  for (std::size_t i = first_user_arg; i < argv.size(); ++i) argv[i] = substitute_local_rank(argv[i], local_rank);
  if (opts.local_rank_arg)
    argv.insert(argv.begin() + static_cast<std::ptrdiff_t>(first_user_arg), fmt::format("--local_rank={}", local_rank));
  return argv;
}


std::string shipped_python_dir() {
  std::error_code ec;
  const auto exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (ec) return "";
  const auto dir = (exe.parent_path() / ".." / "share" / "mglaunch" / "python").lexically_normal();
  return std::filesystem::is_directory(dir / "mglaunch_recovery", ec) ? dir.string() : "";
}

std::string local_hostname() {
  char host[256] = {};
  return ::gethostname(host, sizeof(host) - 1) == 0 ? std::string(host) : "localhost";
}

std::string fq_hostname() {
  const std::string host = local_hostname();
  // Within a bound, off this thread (rendezvous/lookup.h): a DNS server that does not
  // answer leaves the short name.
  return rdzv::run_within<std::string>(rdzv::kLookupBound, [host] {
           addrinfo hints{};
           hints.ai_family = AF_UNSPEC;
           addrinfo* ai = nullptr;
           std::string out = host;
           if (::getaddrinfo(host.c_str(), nullptr, &hints, &ai) == 0 && ai) {
             char name[NI_MAXHOST] = {};
             if (::getnameinfo(ai->ai_addr, ai->ai_addrlen, name, sizeof(name), nullptr, 0, NI_NAMEREQD) == 0)
               out = name;
             ::freeaddrinfo(ai);
           }
           return out;
         })
      .value_or(host);
}

void random_bytes(void* out, std::size_t n) {
  // getrandom(2): one system call. std::random_device probes the CPU (cpuid, which traps
  // to the hypervisor on a VM) before its first number: 1.3% of the agent's CPU per run.
  auto* p = static_cast<unsigned char*>(out);
  std::size_t got = 0;
  while (got < n) {
    const ssize_t r = ::getrandom(p + got, n - got, 0);
    if (r > 0) {
      got += static_cast<std::size_t>(r);
    } else if (r < 0 && errno != EINTR) {
      std::random_device rd;  // no getrandom (ENOSYS): the library's own source
      for (; got < n; ++got) p[got] = static_cast<unsigned char>(rd());
    }
  }
}

std::string new_agent_id(std::string_view host, long pid) {
  std::uint64_t r = 0;
  random_bytes(&r, sizeof(r));
  const std::string tail = fmt::format(":{}:{:016x}", pid, r);
  return fmt::format("{}{}", host.substr(0, proto::kMaxIdBytes - tail.size()), tail);
}

std::string random_uuid() {
  unsigned char b[16];
  random_bytes(b, sizeof(b));
  b[6] = (b[6] & 0x0f) | 0x40;
  b[8] = (b[8] & 0x3f) | 0x80;
  return fmt::format("{:02x}{:02x}{:02x}{:02x}-{:02x}{:02x}-{:02x}{:02x}-{:02x}{:02x}-{:02x}{:02x}{:02x}{:02x}{:02x}{:02x}",
                     b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14],
                     b[15]);
}

RunPlan make_plan(const AgentOptions& opts, const EnvMap& base_env) {
  RunPlan plan;
  plan.nnodes = opts.nnodes.max;
  plan.node_rank = opts.rdzv_backend == "static" ? opts.node_rank : 0;
  plan.nproc_per_node = opts.nproc_per_node;
  plan.world_size = plan.nnodes * plan.nproc_per_node;
  plan.rank_offset = plan.node_rank * plan.nproc_per_node;
  plan.rdzv_backend = opts.rdzv_backend;
  plan.run_id = opts.standalone ? random_uuid() : opts.rdzv_id;
  plan.set_omp_threads = opts.nproc_per_node > 1 && !base_env.contains("OMP_NUM_THREADS");
  plan.python_dir = shipped_python_dir();

  // Program and interpreter.
  const auto path_it = base_env.find("PATH");
  const std::string path = path_it != base_env.end() ? path_it->second : "/usr/local/bin:/usr/bin:/bin";
  const bool python = opts.module || (!opts.no_python && (opts.run_path || opts.program.ends_with(".py")));
  if (python) {
    plan.executable = find_executable(opts.python, path);
    if (plan.executable.empty())
      throw ProgramNotFound(fmt::format("python interpreter '{}' not found or not executable; set --python or "
                                        "MGLAUNCH_PYTHON",
                                        opts.python));
    if (auto v = find_torch_version(plan.executable, base_env)) plan.torch_major = v->major, plan.torch_minor = v->minor;
    plan.argv = {opts.python, "-u"};
    if (opts.module) {
      plan.argv.insert(plan.argv.end(), {"-m", opts.program});
    } else {
      if (::access(opts.program.c_str(), R_OK) != 0)
        throw ProgramNotFound(fmt::format("training script '{}' not found or not readable", opts.program));
      plan.argv.push_back(opts.program);
    }
  } else {
    plan.executable = find_executable(opts.program, path);
    if (plan.executable.empty())
      throw ProgramNotFound(fmt::format("program '{}' not found or not executable (searched PATH)", opts.program));
    plan.argv = {opts.program};
  }
  plan.argv.insert(plan.argv.end(), opts.program_args.begin(), opts.program_args.end());
  // A program that is not Python (a shell script, a C++ trainer) is taken to use the torch of
  // the Python it would find (torchrun's own interpreter, in torchrun's case).
  if (!python)
    if (auto py = find_executable(opts.python, path); !py.empty())
      if (auto v = find_torch_version(py, base_env)) plan.torch_major = v->major, plan.torch_minor = v->minor;
  // The agent's store, as torchrun's: torch 2.x's agent shares its store with the workers for
  // every backend unless TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1; torch 1.x's only in the static
  // form (its c10d and etcd workers have rank 0 host the store).
  const auto disable = base_env.find("TORCH_DISABLE_SHARE_RDZV_TCP_STORE");
  const bool static_form = opts.rdzv_backend == "static" && !opts.standalone;
  // torch 2.0 and 2.1 clients number their queries in a third way (no VALIDATE, DELETE_KEY=7)
  // that cannot be told from 1.x's on the wire: their rank 0 hosts the store.
  const bool torch_2_0_or_2_1 = plan.torch_major == 2 && plan.torch_minor < 2;
  plan.agent_store = !(disable != base_env.end() && disable->second == "1") && !torch_2_0_or_2_1 &&
                     (plan.torch_major != 1 || static_form);

  // Master address and port.
  if (opts.rdzv_backend == "static") {
    rdzv::Endpoint master{opts.master_addr, opts.master_port};
    try {
      // HOST without a port: --master_port (default 29500).
      if (!opts.rdzv_endpoint.empty()) master = rdzv::parse_endpoint(opts.rdzv_endpoint, opts.master_port);
    } catch (const std::invalid_argument& e) {
      throw UsageError(fmt::format("--rdzv_endpoint: {}", e.what()));
    }
    plan.master_addr = master.host;
    plan.master_port = master.port;
    if (!rdzv::resolves(plan.master_addr))
      throw UsageError(fmt::format("--master_addr '{}' does not resolve on this machine, so its workers could not "
                                   "reach it (torch retries for ever): give an IP address or a name in /etc/hosts",
                                   plan.master_addr));
    plan.rdzv_endpoint = fmt::format("{}:{}", master.host, master.port);
    if (plan.node_rank == 0 && plan.master_port != 0 && rdzv::is_local_host(plan.master_addr)) {
      if (auto err = rdzv::probe_listen(plan.master_addr, plan.master_port))
        throw UsageError(fmt::format("--master_port {} on {} cannot be used: {}; pick another port or use --standalone",
                                     plan.master_port, plan.master_addr, *err));
    }
    if (plan.master_port == 0) plan.master_port = reserve_master_port().port();  // see launcher/port.h
  } else {
    // Single node behind a dynamic backend: this agent is the host, as torchrun's c10d.
    rdzv::Endpoint ep;
    try {
      // etcd's endpoint list was checked with the options.
      if (opts.rdzv_backend != "etcd")
        ep = rdzv::parse_endpoint(opts.rdzv_endpoint.empty() ? "localhost:0" : opts.rdzv_endpoint, 29400);
    } catch (const std::invalid_argument& e) {
      throw UsageError(fmt::format("--rdzv_endpoint: {}", e.what()));
    }
    plan.rdzv_endpoint = opts.rdzv_backend == "etcd" ? opts.rdzv_endpoint : fmt::format("{}:{}", ep.host, ep.port);
    plan.master_addr = !opts.local_addr.empty() ? opts.local_addr : fq_hostname();
    // Workers connect to MASTER_ADDR: a name that does not resolve (a container or chroot
    // whose hosts file lacks its own name) makes torch 2.x workers retry for ever.
    if (!opts.local_addr.empty() && !rdzv::resolves(plan.master_addr))
      throw UsageError(fmt::format("--local_addr '{}' does not resolve on this machine: give an IP address or a "
                                   "name in /etc/hosts",
                                   plan.master_addr));
    if (opts.local_addr.empty() && !rdzv::resolves(plan.master_addr)) {
      if (opts.nnodes.max > 1)
        throw UsageError(fmt::format("this machine's name '{}' does not resolve here, so no worker could reach "
                                     "MASTER_ADDR: pass --local_addr=ADDRESS (an IP address the other nodes reach) "
                                     "or add the name to /etc/hosts",
                                     plan.master_addr));
      plan.notes.push_back(fmt::format("this machine's name '{}' does not resolve here: MASTER_ADDR is 127.0.0.1",
                                       plan.master_addr));
      plan.master_addr = "127.0.0.1";  // one node: its workers reach it on loopback
    }
    // Outside the ephemeral range; the agent holds it again until its workers start. A dry
    // run of a multi-node job binds nothing: the rendezvous decides the master.
    if (!(opts.dry_run && opts.nnodes.max > 1)) plan.master_port = reserve_master_port().port();
  }
  plan.nodes = {plan.node_rank == 0 ? plan.master_addr : (opts.local_addr.empty() ? fq_hostname() : opts.local_addr)};
  return plan;
}

nlohmann::json plan_to_json(const RunPlan& plan, const AgentOptions& opts, const EnvMap& base_env) {
  nlohmann::json workers = nlohmann::json::array();
  std::vector<hw::Binding> bindings;
  try {
    bindings = hw::bind_this_machine(opts.cpu_bind, plan.nproc_per_node, opts.gpu_ids);
  } catch (const std::invalid_argument& e) {
    throw UsageError(e.what());  // it names --cpu-bind and the fix
  }
  // A multi-node dynamic rendezvous decides the node's place, the ranks, the world size
  // and the master when the round closes: the plan says so instead of guessing.
  const bool rdzv_decides = opts.rdzv_backend != "static" && opts.nnodes.max > 1;
  const nlohmann::json decided = kDecidedAtRendezvous;
  auto or_decided = [&](auto value) { return rdzv_decides ? decided : nlohmann::json(value); };
  for (int lr = 0; lr < plan.nproc_per_node; ++lr) {
    nlohmann::json env = build_contract_env(plan, opts, base_env, lr, 0, "");
    if (rdzv_decides) {
      for (const char* k : {"RANK", "ROLE_RANK", "GROUP_RANK", "WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR",
                            "MASTER_PORT"})
        env[k] = decided;
      if (opts.nnodes.min != opts.nnodes.max) env["GROUP_WORLD_SIZE"] = decided;
    }
    workers.push_back({{"local_rank", lr},
                       {"rank", or_decided(plan.rank_offset + lr)},
                       {"argv", build_worker_argv(plan, opts, lr)},
                       {"env", std::move(env)}});
    if (opts.cpu_bind != "none")
      workers.back()["binding"] = hw::format_binding(lr, bindings[static_cast<std::size_t>(lr)]);
  }
  // An explicit --node_rank (or Slurm's) is what this node asks for: the rendezvous orders
  // the nodes by it.
  const nlohmann::json node_rank =
      rdzv_decides && !opts.node_rank_given ? decided : nlohmann::json(rdzv_decides ? opts.node_rank : plan.node_rank);
  nlohmann::json doc = {{"nnodes", opts.nnodes.min == opts.nnodes.max
                                       ? nlohmann::json(plan.nnodes)
                                       : nlohmann::json(fmt::format("{}:{}", opts.nnodes.min, opts.nnodes.max))},
                        {"node_rank", node_rank},
                        {"nproc_per_node", plan.nproc_per_node},
                        {"world_size", or_decided(plan.world_size)},
                        {"nodes", plan.nodes},
                        {"rdzv_backend", plan.rdzv_backend},
                        {"rdzv_endpoint", plan.rdzv_endpoint},
                        {"rdzv_id", plan.run_id},
                        {"master_addr", or_decided(plan.master_addr)},
                        {"master_port", or_decided(plan.master_port)},
                        {"max_restarts", opts.max_restarts},
                        {"cpu_bind", opts.cpu_bind},
                        {"executable", plan.executable},
                        {"workers", workers}};
  if (opts.slurm) {
    // Inside a Slurm step: the whole node list, and where each value came from.
    doc["nodes"] = opts.slurm->nodes;
    doc["local_addr"] = opts.local_addr;
    doc["slurm"] = {{"job_id", opts.slurm->job_id},
                    {"step_id", opts.slurm->step_id},
                    {"node_name", opts.slurm->node_name},
                    {"restart_count", opts.slurm->restart_count}};
    doc["source"] = opts.sources;
  }
  return doc;
}

}  // namespace mg
