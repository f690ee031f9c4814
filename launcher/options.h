// AgentOptions: everything the agent needs, built from torchrun-compatible flags, PET_*
// environment fallbacks and an optional JSON config (flags > environment > config).
// Parsing and validation are pure apart from the hardware probe seam.
#pragma once

#include <chrono>
#include <csignal>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "logs/line_splitter.h"

namespace mg::cli {
struct FlagSpec;
}

namespace mg {

// torchrun's Std: which of stdout/stderr a redirect or tee applies to.
enum class Streams : unsigned { kNone = 0, kOut = 1, kErr = 2, kAll = 3 };

// "3" (every local rank) or "0:1,1:2" (per local rank), as torchrun's -r/-t.
struct StreamSpec {
  Streams all = Streams::kNone;
  std::map<int, Streams> per_rank;
  Streams for_rank(int local_rank) const;
  bool covers(int local_rank, Streams which) const;
};
StreamSpec parse_stream_spec(const std::string& flag, const std::string& text);

// Documented limits (docs/flags.md, --nproc_per_node): workers on one node, and ranks in
// a job (RANK is a 32-bit signed integer in torch). Beyond them parse_agent_args refuses
// the run (exit 2).
inline constexpr int kMaxWorkersPerNode = 4096;
inline constexpr long long kMaxRanks = 2147483647;  // 2^31 - 1

struct NodeRange {
  int min = 1;
  int max = 1;
};
// `flag` names where the text came from in errors ("--nnodes", "PET_NNODES", ...).
NodeRange parse_nnodes(const std::string& text, const std::string& flag = "--nnodes");

// True when this agent takes part in a multi-node dynamic rendezvous (c10d/mglaunch).
bool uses_rendezvous_server(const struct AgentOptions& o);

// What the node and its network look like; tests pass fakes. Empty members fall back to
// the real probe.
struct HardwareProbe {
  std::function<int()> gpu_count;  // visible NVIDIA GPUs
  std::function<int()> cpu_count;
  // An address other nodes reach a Slurm node by: the name when it resolves, else Slurm's
  // NodeAddr (`scontrol show node NAME`); `how` says which.
  struct NodeAddress {
    std::string address, how;
  };
  std::function<NodeAddress(const std::string& node_name)> node_address{};
  std::function<std::pair<int, int>()> ephemeral_ports{};  // /proc/sys/net/ipv4/ip_local_port_range
  // Why HOST:PORT cannot be listened on (in use, ...), nullopt when it can.
  std::function<std::optional<std::string>(const std::string& host, int port)> listen_error{};
  static HardwareProbe system();
};

// What mglaunch took from the Slurm step it runs in (absent with --no-slurm or outside one).
struct SlurmContext {
  std::string job_id, step_id;
  std::string node_name;           // this node (SLURMD_NODENAME)
  std::vector<std::string> nodes;  // the step's nodes, node 0 first
  int restart_count = 0;           // SLURM_RESTART_COUNT
  std::string summary;             // the one line mglaunch prints about it
};

struct AgentOptions {
  // torchrun flags
  NodeRange nnodes;
  std::string nproc_spec = "1";
  int nproc_per_node = 1;  // resolved from nproc_spec
  int node_rank = 0;
  bool node_rank_given = false;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  std::string rdzv_backend = "static";
  std::string rdzv_endpoint;
  std::string rdzv_id = "none";
  std::string rdzv_conf;
  bool standalone = false;
  int max_restarts = 0;
  double monitor_interval = 5.0;  // accepted; supervision is event-driven
  std::string role = "default";
  std::string local_addr;
  bool module = false;
  bool no_python = false;
  bool run_path = false;
  std::string log_dir;
  StreamSpec redirects;
  StreamSpec tee;
  std::vector<int> local_ranks_filter;  // empty: all
  std::string start_method = "spawn";
  bool local_rank_arg = false;  // --local-rank-arg: pass --local_rank=N (torch.distributed.launch)
  // rendezvous (--rdzv_conf keys, torchrun's names and defaults) and its token
  std::chrono::milliseconds join_timeout{600000};
  std::chrono::milliseconds last_call_timeout{30000};
  std::chrono::milliseconds keep_alive_interval{5000};
  int keep_alive_max_attempt = 3;
  std::string rdzv_token;  // from --token-file or MGLAUNCH_RDZV_TOKEN
  std::optional<bool> rdzv_is_host;  // --rdzv_conf is_host=true|false; unset: auto
  std::string rdzv_job_token;  // MGLAUNCH_RDZV_JOB_TOKEN: the key of this job only (mglaunch-rdzv --job-token)
  // --rdzv_backend=etcd: --rdzv_conf cacert=,cert=,key= (TLS), user= (password from
  // MGLAUNCH_ETCD_PASSWORD), etcd_prefix= (default /mglaunch), protocol=https
  std::string etcd_cacert, etcd_cert, etcd_key, etcd_user, etcd_password, etcd_prefix = "/mglaunch";
  bool etcd_https = false;
  // torch 2.x's flags (#25; docs/flags.md)
  // --signals-to-handle (PET_SIGNALS_TO_HANDLE, TORCHELASTIC_SIGNALS_TO_HANDLE): the
  // signals the agent passes on to its workers; parsed and checked here.
  std::vector<int> signals_to_handle{SIGTERM, SIGINT, SIGHUP, SIGQUIT};
  std::string numa_binding;  // --numa-binding node|socket|exclusive|core-complex ("": none); sets cpu_bind
  bool virtual_local_rank = false;  // --virtual-local-rank: LOCAL_RANK=0, CUDA_VISIBLE_DEVICES its one GPU
  // --duplicate-stdout-filters / --duplicate-stderr-filters: lines of tee'd ranks holding
  // any of these go to {attempt dir}/filtered_stdout.log / filtered_stderr.log too.
  std::vector<std::string> duplicate_filters[2];
  std::string event_log_handler = "null";  // --event-log-handler null|console
  // mglaunch's own
  std::vector<int> gpu_ids;
  std::string cpu_bind = "none";  // --cpu-bind none|cores|numa|socket|core-complex
  std::chrono::milliseconds grace{30000};
  std::string summary_json;
  bool dry_run = false;
  // --prestart-standby: a standby node starts its workers at once, with MGLAUNCH_STANDBY=1
  // and no rank yet; a worker that says hello with "standby" is handed the place by `assign`
  // (docs/in-place-recovery.md). Opt-in: only for workers that implement it.
  bool prestart_standby = false;
  bool timestamps = false;
  std::string python = "python3";
  std::string python_source = "python3 from PATH";  // how `python` was chosen: --python, MGLAUNCH_PYTHON, default
  int stdin_rank = 0;  // --stdin-rank: the local rank that reads the agent's stdin; -1 (none): all get /dev/null
  std::optional<std::string> log_line_prefix_template;  // --log-line-prefix-template; "" = raw, unprefixed lines
  std::size_t max_line_bytes = kDefaultMaxLine;  // longer lines are cut (logs/line_splitter.h)
  bool no_slurm = false;                         // --no-slurm
  // monitoring and operations (ops/monitor.h, ops/trace.h); all off by default
  double monitor_s = 0;                          // --monitor[=SECONDS]: console status line (0: off)
  std::string metrics_json;                      // --metrics-json FILE: every sample as a JSON line
  int metrics_port = -1;                         // --metrics-port P: Prometheus /metrics (0: any port)
  std::string metrics_host = "127.0.0.1";        // --metrics-host: where /metrics listens
  std::string trace_file;                        // --trace FILE: Chrome trace of the run
  // --preflight[=fail|warn] (ops/preflight.h): before the first round's workers, the nodes
  // check the network between them; "fail" ends the run (exit 5) on a slow or broken node
  std::string preflight = "off";                 // off | fail | warn
  std::optional<SlurmContext> slurm;             // set when running inside a Slurm step
  std::map<std::string, std::string> sources;   // option name -> where its value came from (Slurm)
  // the training program
  std::string program;
  std::vector<std::string> program_args;
  std::vector<std::string> warnings;  // to print once before starting
  // Said about the command line itself, on stderr as "mglaunch: warning: ..." right after
  // parsing (main.cc), before anything starts (--dry-run too).
  std::vector<std::string> usage_warnings;
};

// Result of parsing: either options to run, or a text to print and exit 0 (--help, --version).
struct ParseOutcome {
  std::optional<AgentOptions> options;
  std::string message;
};

// argv[0] is skipped. `env` supplies PET_* and MGLAUNCH_PYTHON and, inside a Slurm step
// (srun), the SLURM_* variables that fill every flag the user did not give (explicit
// flags, PET_* and --config win; --no-slurm turns this off). Throws UsageError.
ParseOutcome parse_agent_args(const std::vector<std::string>& argv, const std::map<std::string, std::string>& env,
                              const HardwareProbe& probe = HardwareProbe::system());

// The agent's flags as parse_agent_args knows them (for the --hostfile fan-out, which
// checks the flags it forwards by the same rules). cli::FlagSpec is in cli/args.h.
std::vector<cli::FlagSpec> agent_flag_specs();

// Applies "key=value,..." to `o` as torchrun 2.x reads --rdzv_conf: every key one of
// torch's rendezvous backends reads is accepted (known_rdzv_conf_keys(); those that mean
// nothing here, such as read_timeout or use_libuv, are checked and ignored); any other key
// adds one usage warning naming the nearest known key. Spaces around keys and values and
// one pair of matching outer quotes of the whole text and of each value are dropped
// ('join_timeout=5,timeout=5' as PyTorch's tests pass it). Throws UsageError for a bad value.
void apply_rdzv_conf(AgentOptions& o, const std::string& conf);
const std::vector<std::string>& known_rdzv_conf_keys();

// torchrun's comma_separated_list: "a,b" -> {a, b}; ",," is a comma inside an item; empty
// items are dropped (an empty list duplicates nothing).
std::vector<std::string> parse_filter_list(const std::string& text);

// "SIGTERM,SIGUSR1" (names with or without SIG, any case) -> signal numbers. Throws
// UsageError naming `flag` and the bad name; SIGKILL and SIGSTOP cannot be handled.
std::vector<int> parse_signal_list(const std::string& flag, const std::string& text);

// Python string.Template.safe_substitute with the single name `local_rank`.
std::string substitute_local_rank(const std::string& arg, int local_rank);

}  // namespace mg
