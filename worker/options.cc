#include "worker/options.h"

#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <string_view>
#include <tuple>

#include <CLI/CLI.hpp>

extern char** environ;

namespace mg::train {

std::int64_t parse_bytes(const std::string& text) {
  std::size_t pos = 0;
  double v = -1;
  try {
    v = std::stod(text, &pos);
  } catch (const std::exception&) {
    pos = 0;
  }
  const std::string unit = pos ? text.substr(pos) : "?";
  const std::int64_t mult = unit.empty() || unit == "B" ? 1 : unit == "K" ? 1 << 10 : unit == "M" ? 1 << 20 : unit == "G" ? 1 << 30 : -1;
  if (mult < 0 || v < 0) throw UsageError("bad byte size '" + text + "': use N, NK, NM or NG");
  return static_cast<std::int64_t>(v * static_cast<double>(mult));
}

namespace {

// CLI::PositiveNumber names its bound as a 300-digit number; this says what it means.
std::string positive_check(std::string& text) {
  double v = 0;
  auto [p, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (text.empty() || ec != std::errc{} || p != text.data() + text.size()) return "'" + text + "' is not a number";
  if (!(v > 0)) return "'" + text + "' must be greater than 0";
  return {};
}

}  // namespace

ParseResult parse_options(int argc, const char* const* argv) {
  const CLI::Validator positive(positive_check, "POSITIVE");
  ParseResult r;
  Options& o = r.options;
  CLI::App app{"mgtrain: LibTorch data-parallel trainer (c10d Gloo/NCCL); run it under mglaunch or torchrun", "mgtrain"};
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  app.add_option("--backend", o.backend, "auto, nccl or gloo")->check(CLI::IsMember({"auto", "nccl", "gloo"}));
  app.add_option("--mode", o.mode, "auto (ddp under a launcher, else single), single or ddp; data-parallel means ddp")
      ->check(CLI::IsMember({"auto", "single", "ddp", "data-parallel", "dp"}));
  app.add_option("--dataset", o.dataset, "fashion-mnist or synthetic")->check(CLI::IsMember({"fashion-mnist", "synthetic"}));
  app.add_option("--data-dir", o.data_dir, "Directory with the Fashion-MNIST IDX .gz files");
  app.add_option("--synthetic-size", o.synthetic_size, "Training samples of --dataset synthetic")->check(positive);
  app.add_option("--train-subset", o.train_subset, "Use only the first N training samples");
  app.add_option("--test-subset", o.test_subset, "Use only the first N test samples");
  app.add_option("--model", o.model, "mlp, cnn or resnet (test models: mlp-unused, mlp-rank-branch)")
      ->check(CLI::IsMember({"mlp", "cnn", "resnet", "mlp-unused", "mlp-rank-branch"}));
  app.add_option("--epochs", o.epochs, "Epochs")->check(positive);
  app.add_option("--max-steps", o.max_steps, "Stop after this many optimizer steps");
  app.add_option("--batch-size", o.batch_size, "Micro-batch per rank")->check(positive);
  app.add_option("--lr", o.lr, "Learning rate (before --lr-scaling)");
  app.add_option("--momentum", o.momentum, "SGD momentum");
  app.add_option("--seed", o.seed, "Seed for init and shuffling");
  app.add_option("--bucket-cap-mb", o.bucket_cap_mb, "Gradient bucket size in MiB")->check(positive);
  app.add_option("--grad-accum", o.grad_accum, "Micro-steps per optimizer step")->check(positive);
  app.add_option("--clip-grad-norm", o.clip_grad_norm, "Clip the gradient norm (0: off)");
  app.add_option("--lr-scaling", o.lr_scaling, "none, linear or sqrt in the world size")
      ->check(CLI::IsMember({"none", "linear", "sqrt"}));
  app.add_option("--comm-dtype", o.comm_dtype, "fp32, fp16 or bf16 for the gradient all-reduce")
      ->check(CLI::IsMember({"fp32", "fp16", "bf16"}));
  app.add_option("--reducer", o.reducer, "mgtrain (our buckets, default) or c10d (c10d::Reducer, Python DDP's engine)")
      ->check(CLI::IsMember({"mgtrain", "c10d"}));
  app.add_flag("--find-unused-parameters", o.find_unused_parameters,
               "Parameters without a gradient in a step contribute zeros (else that step is an error)");
  app.add_flag("--static-graph", o.static_graph, "The graph is the same every step: learn the bucket plan and unused set once");
  app.add_flag("--broadcast-buffers,!--no-broadcast-buffers", o.broadcast_buffers,
               "Broadcast buffers (BatchNorm statistics) from rank 0 before each forward (default on)");
  app.add_flag("--sync-batchnorm", o.sync_batchnorm, "BatchNorm statistics reduced across ranks (SyncBatchNorm)");
  app.add_flag("!--no-channels-last", o.channels_last, "Keep the CNN in NCHW (default: channels-last on CPU)");
  app.add_flag("--amp", o.amp, "bf16 mixed precision on CUDA (CUDA builds with LibTorch >= 2.4)");
  app.add_flag("--cuda-graphs", o.cuda_graphs,
               "Capture the whole training step (forward, backward, gradient all-reduce, optimizer) once as a "
               "CUDA graph and replay it (CUDA builds; a GPU)");
  app.add_flag("--in-place-recovery", o.in_place_recovery,
               "On a lost peer, keep the model, wait for the agent's new assignment (MGLAUNCH_CONTROL_SOCKET) and "
               "go on from the state the ranks agree on, with no checkpoint read (docs/in-place-recovery.md)");
  app.add_option("--log-every", o.log_every, "Progress line every N steps (rank 0)");
  app.add_option("--summary-json", o.summary_json, "Per-rank summary; {rank} is replaced");
  app.add_option("--save-weights", o.save_weights, "Rank 0 writes the final parameters and buffers as raw float32");
  app.add_option("--checkpoint-dir", o.checkpoint_dir, "Checkpoint directory (resume from it when present)");
  app.add_option("--checkpoint-every", o.checkpoint_every, "Checkpoint every N steps (0: only on signals)");
  app.add_option("--checkpoint-take-over", o.checkpoint_take_over,
                 "Take over the checkpoint that run RUN (MGLAUNCH_RUN's MS-HEX) holds, as if RUN were older than this "
                 "run: the way on when a run minted on a clock that ran ahead refuses every later run (exit 4); "
                 "never while run RUN still trains");
  app.add_option("--fail-at-step", o.fail_at_step, "Fault injection: fail at this step (first attempt only)");
  app.add_option("--fail-rank", o.fail_rank, "Fault injection: the rank that fails");
  app.add_option("--fail-signal", o.fail_signal, "Fault injection: raise this signal instead of exit 1");
  app.add_option("--step-ms", o.step_ms, "Sleep this long after each step (tests, benchmarks: a slower pace)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--threads", o.threads, "Intra-op threads (default: OMP_NUM_THREADS / torch default)");
  app.add_option("--timeout", o.timeout_s, "Seconds to wait for the store and collectives")->check(positive);
  app.add_option("--bench", o.bench, "allreduce: run the collective benchmark instead of training")
      ->check(CLI::IsMember({"allreduce"}));
  app.add_option("--min-bytes", o.min_bytes, "Benchmark: smallest size (N, NK, NM, NG)");
  app.add_option("--max-bytes", o.max_bytes, "Benchmark: largest size");
  app.add_option("--step-factor", o.step_factor, "Benchmark: size multiplier")->check(CLI::Range(1.01, 1024.0));
  app.add_option("--iters", o.iters, "Benchmark: timed iterations")->check(positive);
  app.add_option("--warmup", o.warmup, "Benchmark: warm-up iterations");
  app.add_option("--dtype", o.dtype, "Benchmark: float, double, half or int");
  app.footer("Exit codes: 0 done; 1 failure; 2 bad flags; 3 setup error (data, master, backend, checkpoint); "
             "4 fenced (a newer MGLAUNCH_EPOCH or MGLAUNCH_RUN of the job holds the checkpoint); "
             "75 stopped by SIGTERM/SIGUSR1 after checkpointing (run again to resume).");
  try {
    app.parse(argc, argv);
  } catch (const CLI::Success&) {
    r.help = app.help();
    return r;
  } catch (const CLI::Error& e) {
    std::string what = e.what();
    throw UsageError(what.substr(0, what.find('\n')) + " (see mgtrain --help)");
  }
  if (o.mode == "data-parallel" || o.mode == "dp") o.mode = "ddp";  // the guides' DataParallel: see docs/mgtrain.md
  if (!o.checkpoint_take_over.empty())
    if (auto bad = run_problem(o.checkpoint_take_over); !bad.empty())
      throw UsageError("--checkpoint-take-over '" + o.checkpoint_take_over.substr(0, 64) + "' " + bad +
                       ": name the run that the refusal line ('... belongs to run RUN ...') names");
  parse_bytes(o.min_bytes);
  parse_bytes(o.max_bytes);
  if (o.reducer == "c10d" && o.comm_dtype != "fp32")
    throw UsageError("--comm-dtype " + o.comm_dtype + " needs --reducer mgtrain (c10d::Reducer's hooks are Python-only here)");
  if (o.in_place_recovery) {
    // What a rebuilt process group cannot take over. Said before any training (exit 2).
    if (o.cuda_graphs)
      throw UsageError("--in-place-recovery cannot rebuild --cuda-graphs (the captured step holds the old process "
                       "group's communicators): drop one of them");
    if (o.reducer != "mgtrain")
      throw UsageError("--in-place-recovery needs --reducer mgtrain (c10d::Reducer keeps its process group for life)");
    if (o.sync_batchnorm)
      throw UsageError("--in-place-recovery cannot interrupt --sync-batchnorm's all-reduce inside autograd: drop one "
                       "of them");
    if (!o.bench.empty()) throw UsageError("--in-place-recovery is for training, not --bench");
  }
  if (o.cuda_graphs) {
    // What the captured step cannot hold: work whose shape or control flow the CPU decides
    // anew each step. Said before any GPU work (exit 2).
    if (o.find_unused_parameters)
      throw UsageError("--cuda-graphs cannot capture --find-unused-parameters (its unused-parameter search reads a "
                       "bitmap on the CPU every step): use --static-graph, or drop --cuda-graphs");
    if (o.grad_accum != 1)
      throw UsageError("--cuda-graphs captures one micro-batch per optimizer step: drop --grad-accum or --cuda-graphs");
    if (o.clip_grad_norm > 0)
      throw UsageError("--cuda-graphs cannot capture --clip-grad-norm (the norm is read on the CPU): drop one of them");
    if (o.sync_batchnorm)
      throw UsageError("--cuda-graphs cannot capture --sync-batchnorm (the global sample count is read on the CPU)");
    if (o.reducer != "mgtrain")
      throw UsageError("--cuda-graphs needs --reducer mgtrain (c10d::Reducer prepares every step on the CPU)");
    if (!o.bench.empty()) throw UsageError("--cuda-graphs is for training, not --bench");
    if (o.backend == "gloo") throw UsageError("--cuda-graphs needs a GPU: drop --backend gloo");
  }
  return r;
}

namespace {
int to_int(const std::map<std::string, std::string>& vars, const char* name, int fallback) {
  auto it = vars.find(name);
  if (it == vars.end() || it->second.empty()) return fallback;
  try {
    std::size_t pos = 0;
    int v = std::stoi(it->second, &pos);
    if (pos == it->second.size()) return v;
  } catch (const std::exception&) {
  }
  throw UsageError(std::string(name) + "='" + it->second + "' is not an integer; run under mglaunch or torchrun");
}
}  // namespace

std::string run_problem(const std::string& run) {
  const auto dash = run.find('-');
  const auto digits = [](std::string_view v, bool hex) {
    return !v.empty() && std::all_of(v.begin(), v.end(), [hex](char c) {
      return (c >= '0' && c <= '9') || (hex && c >= 'a' && c <= 'f');
    });
  };
  if (run.size() > 64 || dash == std::string::npos || dash > 19 || !digits(std::string_view(run).substr(0, dash), false) ||
      !digits(std::string_view(run).substr(dash + 1), true))
    return "is not MS-HEX (ms since the Unix epoch, a dash, lowercase hex digits; at most 64 characters)";
  return {};
}

bool run_before(const std::string& a, const std::string& b) {
  const auto key = [](const std::string& r) {
    const auto dash = r.find('-');
    const std::string_view ms = std::string_view(r).substr(0, dash), hex = std::string_view(r).substr(dash + 1);
    // Numbers without leading zeros compare by length, then digit by digit.
    return std::tuple{ms.size() - std::min(ms.find_first_not_of('0'), ms.size()),
                      ms.substr(std::min(ms.find_first_not_of('0'), ms.size())), hex.size(), hex};
  };
  return key(a) < key(b);
}

std::int64_t run_ahead_ms(const std::string& run, std::int64_t now_ms) {
  std::int64_t ms = 0;
  const char* end = run.data() + std::min(run.find('-'), run.size());
  if (std::from_chars(run.data(), end, ms).ec != std::errc{}) return 0;  // 19 digits past int64: no claim
  return ms - now_ms;
}

CheckpointOrder checkpoint_order(bool has_run, bool has_epoch) {
  return has_run ? CheckpointOrder::kByRun : has_epoch ? CheckpointOrder::kByEpoch : CheckpointOrder::kByStep;
}

bool older_checkpoint(const CheckpointKey& a, const CheckpointKey& b, const Supersessions& taken, CheckpointOrder order) {
  if (order == CheckpointOrder::kByStep) return a.step < b.step;
  if (order == CheckpointOrder::kByEpoch) return std::tie(a.epoch, a.step) < std::tie(b.epoch, b.step);
  // A superseded run stands just below the run that took it over: compared as that run, and below it.
  const auto placed = [&](const CheckpointKey& k) {
    const auto it = taken.find(k.run);
    return it == taken.end() || k.run.empty() ? std::pair<std::string, bool>{k.run, false} : std::pair{it->second, true};
  };
  const auto [ra, a_taken] = placed(a);
  const auto [rb, b_taken] = placed(b);
  if (ra.empty() != rb.empty()) return ra.empty();  // none recorded: before any run
  if (ra != rb) return run_before(ra, rb);
  if (a_taken != b_taken) return a_taken;
  if (a.run != b.run) return run_before(a.run, b.run);  // two runs taken over by one
  return std::tie(a.epoch, a.step) < std::tie(b.epoch, b.step);
}

bool older_checkpoint(const CheckpointKey& a, const CheckpointKey& b, const std::string& run, const std::string& take_over) {
  Supersessions taken;
  if (!run.empty() && !take_over.empty()) taken[take_over] = run;
  return older_checkpoint(a, b, taken, CheckpointOrder::kByRun);
}

Env read_env(const std::map<std::string, std::string>& vars) {
  Env env;
  env.rank = to_int(vars, "RANK", 0);
  env.world = to_int(vars, "WORLD_SIZE", 1);
  env.local_rank = to_int(vars, "LOCAL_RANK", 0);
  env.restart_count = to_int(vars, "TORCHELASTIC_RESTART_COUNT", 0);
  if (auto it = vars.find("MASTER_ADDR"); it != vars.end() && !it->second.empty()) env.master_addr = it->second;
  env.master_port = to_int(vars, "MASTER_PORT", 0);
  if (auto it = vars.find("TORCHELASTIC_USE_AGENT_STORE"); it != vars.end()) env.agent_store = it->second == "True";
  if (auto it = vars.find("USE_LIBUV"); it != vars.end()) env.use_libuv = it->second == "1";
  if (auto it = vars.find("MGLAUNCH_EPOCH"); it != vars.end() && !it->second.empty()) {  // empty: unset
    std::int64_t v = -1;
    const auto [end, ec] = std::from_chars(it->second.data(), it->second.data() + it->second.size(), v);
    if (ec != std::errc{} || end != it->second.data() + it->second.size() || v < 0)
      throw UsageError("MGLAUNCH_EPOCH='" + it->second + "' is not a non-negative integer (the rendezvous' epoch of " +
                       "this round, set by mglaunch); unset it or run under mglaunch");
    env.epoch = v;
  }
  if (auto it = vars.find("MGLAUNCH_RUN"); it != vars.end() && !it->second.empty()) {  // empty: unset
    if (auto bad = run_problem(it->second); !bad.empty())
      throw UsageError("MGLAUNCH_RUN='" + it->second.substr(0, 64) + "' " + bad +
                       " (the rendezvous run of this round, set by mglaunch); unset it or run under mglaunch");
    env.run = it->second;
  }
  env.launched = env.master_port > 0 || env.world > 1;
  if (env.world < 1 || env.rank < 0 || env.rank >= env.world)
    throw UsageError("RANK=" + std::to_string(env.rank) + " WORLD_SIZE=" + std::to_string(env.world) +
                     " is not a valid pair; run under mglaunch or torchrun");
  if (env.world > 1 && env.master_port <= 0) throw UsageError("MASTER_PORT is not set; run under mglaunch or torchrun");
  return env;
}

std::map<std::string, std::string> process_env() {
  std::map<std::string, std::string> m;
  for (char** e = environ; e && *e; ++e) {
    std::string kv = *e;
    if (auto eq = kv.find('='); eq != std::string::npos) m[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  return m;
}

std::optional<std::map<std::string, std::string>> environment_to_reexec(const Options& o,
                                                                        const std::map<std::string, std::string>& vars,
                                                                        bool nccl) {
  constexpr const char* kVar = "TORCH_NCCL_ASYNC_ERROR_HANDLING";
  if (!nccl || !o.in_place_recovery || o.backend == "gloo") return std::nullopt;
  if (auto it = vars.find(kVar); it != vars.end() && it->second == "2") return std::nullopt;
  auto env = vars;
  env[kVar] = "2";
  return env;
}

Mode resolve_mode(const Options& o, const Env& env) {
  if (o.mode == "single") {
    if (env.world > 1)
      throw UsageError("--mode single with WORLD_SIZE=" + std::to_string(env.world) +
                       ": drop --mode single or launch one process");
    return Mode::single;
  }
  if (o.mode == "ddp" || !o.bench.empty()) return Mode::ddp;
  return env.launched ? Mode::ddp : Mode::single;
}

}  // namespace mg::train

#include <ctime>
#include <fstream>
#include <mutex>

#include <nlohmann/json.hpp>

namespace mg::train {
namespace {
struct ErrorFile {
  std::mutex m;
  std::optional<std::string> path;  // set by use_error_file()
};
ErrorFile& error_file() {
  static ErrorFile f;
  return f;
}
}  // namespace

void use_error_file(const std::string& path) {
  auto& f = error_file();
  std::lock_guard lk(f.m);
  f.path = path;
}

void write_error_file(const std::string& message) {
  std::string path;
  {
    auto& f = error_file();
    std::lock_guard lk(f.m);
    if (f.path) {
      path = *f.path;
    } else if (const char* p = std::getenv("TORCHELASTIC_ERROR_FILE")) {
      path = p;
    }
  }
  if (path.empty()) return;
  // Never throws (review s39 L3: rank 0 writes it before a collective the others are in):
  // bytes that are not UTF-8 (a path's) become U+FFFD, and any other failure writes nothing.
  try {
    nlohmann::json j = {{"message",
                         {{"message", message},
                          {"extraInfo", {{"py_callstack", "mgtrain (C++)"}, {"timestamp", std::to_string(std::time(nullptr))}}}}}};
    std::ofstream(path) << j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  } catch (const std::exception&) {
  }
}
}  // namespace mg::train
