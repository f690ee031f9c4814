// mgtrain's options and environment: the flags (parsed by pure functions, no torch), the
// torchrun environment contract, the exit codes and the training mode rule. Included by
// mgtrain's main and by every mgtrain unit; it includes no torch header.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace mg::train {

// Exit codes (README, docs/mgtrain.md): 0 done; 1 failure (incl. injected); 2 usage; 3 setup error
// (data, master unreachable, backend, checkpoint); 4 fenced (a newer epoch of the job holds
// the checkpoint: this side is stale); 75 stopped on SIGTERM/SIGUSR1 after checkpointing.
constexpr int kExitFailure = 1, kExitUsage = 2, kExitSetup = 3, kExitFenced = 4, kExitStopped = 75;

// Bad flags or environment: exit 2.
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
// Setup failed (data, store, backend, checkpoint): exit 3.
struct SetupError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct Options {
  std::string backend = "auto", dataset = "fashion-mnist", data_dir = "/usr/share/datasets/fashion-mnist";
  std::string model = "cnn", lr_scaling = "none", comm_dtype = "fp32", summary_json, checkpoint_dir, save_weights;
  std::string bench;
  // --checkpoint-take-over RUN: this run takes over a checkpoint that run RUN holds, as if
  // RUN were older than this run (docs/mgtrain.md: a run minted on a clock that ran ahead).
  std::string checkpoint_take_over;
  std::string mode = "auto";      // auto | single | ddp (data-parallel is accepted as ddp)
  std::string reducer = "mgtrain";  // mgtrain (our buckets) | c10d (c10d::Reducer, as Python's DDP)
  std::int64_t synthetic_size = 8192, train_subset = -1, test_subset = -1, max_steps = -1;
  int epochs = 1, batch_size = 64, grad_accum = 1, log_every = 100, checkpoint_every = 0, threads = 0;
  int fail_at_step = -1, fail_rank = 0, fail_signal = 0, timeout_s = 300;
  int step_ms = 0;  // --step-ms: a sleep after each step (tests: a slower pace, less CPU)
  double lr = 0.02, momentum = 0.9, clip_grad_norm = 0, bucket_cap_mb = 25;
  std::uint64_t seed = 1;
  bool amp = false, shuffle = true, channels_last = true;
  bool cuda_graphs = false;  // capture the training step once, replay it (CUDA builds)
  // On a lost peer, wait for the agent's new assignment instead of exiting, rebuild the
  // process group and go on (docs/in-place-recovery.md).
  bool in_place_recovery = false;
  // DDP's options (MultiGPUConfig / torch.nn.parallel.DistributedDataParallel).
  bool find_unused_parameters = false, static_graph = false, broadcast_buffers = true, sync_batchnorm = false;
  // --bench allreduce
  std::string min_bytes = "8", max_bytes = "64M", dtype = "float";
  double step_factor = 2;
  int iters = 20, warmup = 5;
};

// The torchrun contract as read from the environment.
struct Env {
  int rank = 0, world = 1, local_rank = 0, restart_count = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 0;
  bool launched = false;  // RANK/WORLD_SIZE/MASTER_PORT came from a launcher
  // TORCHELASTIC_USE_AGENT_STORE=True: the launcher's agent serves the c10d store on
  // MASTER_PORT; every rank (rank 0 too) connects as a client, under the prefix
  // /worker/attempt_N (N = restart_count), as torch's env:// rendezvous does.
  bool agent_store = false;
  // USE_LIBUV, as torch 2.x's env:// reads it ("1": the libuv TCPStore, else the classic
  // one; both speak the same protocol). Unset: libuv where this LibTorch has it.
  std::optional<bool> use_libuv;
  // MGLAUNCH_EPOCH: the rendezvous' epoch of this round, monotonic per job (the fence of
  // checkpoint writes, docs/mgtrain.md); unset under torchrun and older agents.
  std::optional<std::int64_t> epoch;
  // MGLAUNCH_RUN: the rendezvous run that epoch belongs to ("MS-HEX", run_problem()): epochs
  // compare only within one run (#37); empty: unset (torchrun, agents before #37).
  std::string run;
};

// "" when `run` is a rendezvous run (MGLAUNCH_RUN: "MS-HEX", ms since the Unix epoch when the
// run's rendezvous job was made, a dash, lowercase hex; at most 64 characters), else what is
// wrong with it ("is not MS-HEX ...").
std::string run_problem(const std::string& run);
// Whether run `a` was made before run `b` (by MS, then HEX); both valid runs.
bool run_before(const std::string& a, const std::string& b);
// How many ms run `run` is dated after `now_ms` (its MS minus now; negative: before), for
// the refusal line: a run dated in this host's future was minted on a clock that ran ahead.
std::int64_t run_ahead_ms(const std::string& run, std::int64_t now_ms);
// The clock skew past which a run dated in the future is named as suspect: Kerberos' default
// (5 minutes); hosts under NTP differ by milliseconds.
constexpr std::int64_t kRunAheadSuspectMs = 5 * 60 * 1000;

// Where a checkpoint stands in the job's training (docs/mgtrain.md, Checkpoints): the run
// that wrote it, its epoch in that run and its step, and the run its run took over.
struct CheckpointKey {
  std::string run;          // empty: none recorded (unfenced, or written before #37)
  std::int64_t epoch = -1;  // -1: none recorded
  std::int64_t step = 0;
  std::string supersedes;   // a run `run` took over (--checkpoint-take-over, or inherited); empty: none
};
// Runs taken over: each superseded run (one minted on a clock that ran ahead) and the run
// that took it over, from the checkpoints' keys and this run's --checkpoint-take-over.
using Supersessions = std::map<std::string, std::string>;
// Whether checkpoint `a` holds older training than `b`: by run first (none recorded before
// any run; then run_before, a run in `taken` placed just below the run that took it over),
// then by epoch, then by step. The fence's order: an older run's checkpoint is older than any
// of a newer run's, whatever its epoch and step (kByRun). A job with no run of its own cannot
// place runs: with an epoch (an agent after #34, before #37) by epoch, then step, whatever the
// run (kByEpoch: a cut-off side's higher step of an older epoch loses, review s38 M5); with
// neither (torchrun, an older agent) by step alone (kByStep).
enum class CheckpointOrder { kByRun, kByEpoch, kByStep };
CheckpointOrder checkpoint_order(bool has_run, bool has_epoch);
bool older_checkpoint(const CheckpointKey& a, const CheckpointKey& b, const Supersessions& taken, CheckpointOrder order);
// The same for a writer of run `run` that takes over run `take_over` (empty: none).
bool older_checkpoint(const CheckpointKey& a, const CheckpointKey& b, const std::string& run = {},
                      const std::string& take_over = {});

// Parses argv into Options. Returns the text to print and exit 0 for --help; throws
// UsageError with a one-line message for bad flags.
struct ParseResult {
  Options options;
  std::string help;  // non-empty: print it and exit 0
};
ParseResult parse_options(int argc, const char* const* argv);

// Reads the contract from `vars` (the process environment in main). Throws UsageError
// when RANK/WORLD_SIZE are not a valid pair, a multi-process world has no MASTER_PORT, or
// MGLAUNCH_EPOCH is not a non-negative integer, or MGLAUNCH_RUN not a run.
Env read_env(const std::map<std::string, std::string>& vars);
std::map<std::string, std::string> process_env();

// The environment mgtrain must start with for `o`, when `vars` (the process's) lacks
// something only the environment can say; nullopt when `vars` will do. NCCL reads
// TORCH_NCCL_ASYNC_ERROR_HANDLING from the environment when a group is built (no option
// for it): --in-place-recovery needs 2 (the agents' 1 and torch 2.x's default 3 take the
// process down on a peer's death). `nccl`: a CUDA build. main starts mgtrain again with it
// (execve) before anything else: a setenv while another thread reads the environment is a
// data race, and torch's and the control channel's threads do.
std::optional<std::map<std::string, std::string>> environment_to_reexec(const Options& o,
                                                                        const std::map<std::string, std::string>& vars,
                                                                        bool nccl);

// "8", "64K", "1.5M", "2G" -> bytes; throws UsageError.
std::int64_t parse_bytes(const std::string& text);

// --mode: "single" trains in one process without a process group; "ddp" joins the
// process group of the launcher. auto: ddp under a launcher (or WORLD_SIZE > 1), else
// single. Throws UsageError for --mode single with WORLD_SIZE > 1.
enum class Mode { single, ddp };
Mode resolve_mode(const Options& o, const Env& env);

}  // namespace mg::train

namespace mg::train {
// Writes torchelastic's error file when the launcher named one: TORCHELASTIC_ERROR_FILE of
// the round this worker is in (the process environment's, until use_error_file()).
// Never throws: bytes that are not UTF-8 become U+FFFD (review s39 L3).
void write_error_file(const std::string& message);
// A new round's TORCHELASTIC_ERROR_FILE (an in-place recovery's assignment names the new
// attempt's): write_error_file() writes there from now on. Thread-safe.
void use_error_file(const std::string& path);
}  // namespace mg::train
