// The training loop as the phases of one Trainer: load the data, build the model, establish
// one state on every rank, shard, step, evaluate, recover from a lost peer (in place) and
// summarise. Nothing here writes the process environment: a new round's variables (a
// standby's place, an in-place recovery's assignment) go into the Trainer's own copy, and
// the store and process group get them as arguments (comm.h).
#include "worker/trainer.h"

#include <string.h>
#include <sys/resource.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <thread>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <fstream>
#include <optional>
#include <string_view>
#include <utility>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <openssl/sha.h>

#include "worker/allreduce_bench.h"
#include "worker/checkpoint.h"
#include "worker/comm.h"
#include "worker/control.h"
#include "worker/data.h"
#include "worker/models.h"
#include "worker/reducer.h"
#include "worker/step_graph.h"
#ifdef MGLAUNCH_WITH_NCCL
#include <ATen/autocast_mode.h>
#endif

namespace mg::train {
namespace {

namespace data = mg::data;
using Clock = std::chrono::steady_clock;
constexpr std::int64_t kStopCheckEvery = 8;
constexpr int kRecoveryAttempts = 8;  // in-place recoveries in a row from one step

std::atomic<int> g_stop_signal{0};
extern "C" void on_stop_signal(int sig) { g_stop_signal.store(sig); }

// bf16 autocast on CUDA for the forward pass (bf16 keeps fp32's range: no loss scaling).
// Needs the device-type autocast API of LibTorch >= 2.4; elsewhere --amp is refused.
#if defined(MGLAUNCH_WITH_NCCL) && (TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4))
constexpr bool kAmpSupported = true;
class AutocastScope {
 public:
  explicit AutocastScope(bool on) : on_(on) {
    if (!on_) return;
    at::autocast::set_autocast_enabled(at::kCUDA, true);
    at::autocast::set_autocast_dtype(at::kCUDA, at::kBFloat16);
    at::autocast::increment_nesting();
  }
  ~AutocastScope() {
    if (!on_) return;
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    at::autocast::set_autocast_enabled(at::kCUDA, false);
  }

 private:
  bool on_;
};
#else
constexpr bool kAmpSupported = false;
struct AutocastScope {
  explicit AutocastScope(bool) {}
};
#endif

// Parameters then buffers, in registration order: what weights_sha256 and
// --save-weights cover.
std::vector<torch::Tensor> state_tensors(torch::nn::Module& m) {
  auto v = m.parameters();
  for (auto& b : m.buffers()) v.push_back(b);
  return v;
}

std::string sha256_of(const std::vector<torch::Tensor>& tensors) {
  SHA256_CTX ctx;
  SHA256_Init(&ctx);
  for (const auto& p : tensors) {
    auto c = p.detach().to(torch::kCPU).contiguous();
    SHA256_Update(&ctx, c.data_ptr(), c.numel() * c.element_size());
  }
  unsigned char md[SHA256_DIGEST_LENGTH];
  SHA256_Final(md, &ctx);
  std::string hex;
  for (unsigned char ch : md) hex += fmt::format("{:02x}", ch);
  return hex;
}

// CPU seconds of this process (all threads): samples per CPU second compares trainers
// fairly on a machine that other jobs load.
double cpu_seconds() {
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  return static_cast<double>(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) +
         static_cast<double>(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) / 1e6;
}

std::pair<torch::Tensor, torch::Tensor> to_device(const data::Dataset& d, const torch::Device& device) {
  auto x = torch::from_blob(const_cast<float*>(d.images.data()), {d.size(), 1, d.rows, d.cols}, torch::kFloat).clone();
  auto y = torch::from_blob(const_cast<std::int64_t*>(d.labels.data()), {d.size()}, torch::kLong).clone();
  return {x.to(device), y.to(device)};
}

// One worker's training. Owns everything but the Comm (run()'s, replaced in place when a
// new round's group forms) and the control channel; single-threaded.
class Trainer {
 public:
  // `control`: the agent's control channel when --in-place-recovery is on (else null).
  // `vars`: the process environment as it was at start (a new round's assignment goes
  // on top of this copy), `env` the torchrun contract read from it.
  Trainer(const Options& o, Comm& comm, ControlChannel* control, const Interrupt* interrupt,
          std::map<std::string, std::string> vars, Env env)
      : o_(o), comm_(comm), control_(control), interrupt_(interrupt), vars_(std::move(vars)), env_(std::move(env)),
        recovery_(control != nullptr), lead_(comm.rank == 0) {}

  // `standby`: a standby's pre-started worker: `comm` is unplaced_comm() until its place.
  // Returns the exit code (0, or kExitStopped).
  int run(bool standby);

 private:
  // Phases, in the order run() calls them.
  void load_data();
  void build_model();
  bool take_place();
  void make_reducer();
  void establish();
  bool agree_on_recovery(LiveStates& live);
  void take_most_advanced(const LiveStates& live, int source);
  bool checkpoint_is_newer(const LiveStates& live, int source, const Newest& newest);
  Fence fence() const {
    return Fence{env_.epoch, env_.run, o_.timeout_s, take_over_.empty() ? o_.checkpoint_take_over : take_over_, taken_by_};
  }
  void reshard();
  void prepare_steps();
  void train_with_recovery();
  void train_loop();
  std::int64_t train_epoch(std::int64_t epoch);
  torch::Tensor eager_step(const torch::Tensor& idx, std::int64_t& micro);
  void after_step(std::int64_t epoch, std::int64_t micro);
  bool stop_or_checkpoint();
  bool checkpoint(bool stop_now);
  void log_progress(std::int64_t epoch);
  void evaluate(std::int64_t epoch, std::int64_t loss_n);
  void recover(const std::string& what);
  void adopt(const Assignment& place);
  void summarise();
  void write_summary(double sps, double sp_cpu, const std::string& digest);

  // One step's parts, shared by the eager loop and the captured graph.
  torch::Tensor forward_backward(const torch::Tensor& bi, std::int64_t k_n, bool sync);
  void finish_step();
  void broadcast_buffers() {
    if (sync_buffers_) comm_.broadcast_coalesced(buffers_);
  }
  double lr_for(int world) const {
    return o_.lr * (o_.lr_scaling == "linear" ? world : o_.lr_scaling == "sqrt" ? std::sqrt(world) : 1.0);
  }
  void set_lr_for_world() { static_cast<torch::optim::SGDOptions&>(opt_->param_groups()[0].options()).lr(lr_for(comm_.world)); }
  std::int64_t micro_batches(std::int64_t samples) const { return (samples + o_.batch_size - 1) / o_.batch_size; }
  // Waits for the agent in slices, so SIGTERM/SIGUSR1 (the agent stopping the job) ends
  // the wait at once: nullopt then, with `stopped_` set. nullopt also past --timeout or
  // once the channel closed.
  template <typename WaitOnce>
  auto wait_for(WaitOnce&& wait_once) -> decltype(wait_once(std::chrono::milliseconds(0)));

  const Options& o_;
  Comm& comm_;
  ControlChannel* control_;
  const Interrupt* interrupt_;
  std::map<std::string, std::string> vars_;  // the environment of this worker's round
  Env env_;
  bool recovery_;  // off for every rank when one rank has no channel (establish)
  bool lead_;

  // Data and model.
  data::Dataset train_set_, test_set_;
  torch::Tensor train_x_, train_y_, test_x_, test_y_;
  Model model_;
  std::vector<torch::Tensor> params_, buffers_;
  bool sync_buffers_ = false;
  std::unique_ptr<torch::optim::SGD> opt_;
  std::unique_ptr<GradientSync> reducer_;
  std::unique_ptr<StepGraph> graph_;
  int unapplied_rank_ = -1;  // MGTRAIN_TEST_UNAPPLIED_STEP
  long long unapplied_step_ = -1;

  // Position and shard.
  Position state_;
  CheckpointKey held_;  // the run and epoch of the round that last established state_ (in-place recovery)
  std::unique_ptr<data::DistributedSampler> sampler_;
  std::int64_t micro_per_epoch_ = 0, steps_per_epoch_ = 0, total_steps_ = 0;

  // Progress and results.
  Clock::time_point t_start_;
  double cpu_start_ = 0;
  std::int64_t samples_done_ = 0, steps_this_run_ = 0;
  double last_loss_ = 0, test_acc_ = 0;
  std::int64_t measured_epoch_ = 0;  // the epoch test_acc_ was measured after; 0: none finished
  std::string stop_checkpoint_;      // rank 0: the checkpoint written when a signal stopped it
  // Losses stay on the device until a line or the summary needs them: no per-step sync.
  torch::Tensor last_loss_t_, loss_sum_t_, stop_flag_;
  bool stopped_ = false;  // by a signal
  std::string take_over_;  // a take-over the resumed checkpoint records (supersedes=T), carried on
  std::string taken_by_;   // a run that took this run over (a checkpoint records it): no write
  bool fenced_ = false;   // a newer epoch holds the checkpoint: every rank stops (kExitFenced)

  // In-place recovery: the failure being recovered from, until the first step after it.
  struct Pending {
    Clock::time_point detected;
    std::int64_t step = 0;
    std::string lost;
  };
  std::optional<Pending> pending_;
  nlohmann::json recoveries_ = nlohmann::json::array();
  // A recovery that failed part-way counts from the first detection.
  std::optional<Clock::time_point> unrecovered_;
  int attempts_ = 0;
  std::int64_t attempts_at_ = -1;
};

int Trainer::run(bool standby) {
  load_data();
  build_model();
  // A standby's pre-started worker: data, model and optimizer are ready; now its place, then
  // the group, as any newcomer (the state comes from the survivors in establish()).
  if (standby) {
    std::printf("mgtrain: standby worker ready (data, model and optimizer loaded): waiting for this node's place\n");
    std::fflush(stdout);
    if (!take_place()) {
      std::printf("mgtrain: stopped by a signal while this standby worker waited for its place\n");
      std::fflush(stdout);
      return kExitStopped;
    }
    set_lr_for_world();
  }
  make_reducer();
  establish();
  reshard();
  if (lead_)
    std::printf("mgtrain: %s on %s, %s, world %d, backend %s, %lld steps/epoch (batch %d x %d accum per rank), %zu buckets\n",
                o_.model.c_str(), o_.dataset.c_str(), comm_.distributed() ? "ddp" : "single process", comm_.world,
                comm_.backend.c_str(), static_cast<long long>(steps_per_epoch_), o_.batch_size, o_.grad_accum,
                reducer_ ? reducer_->bucket_count() : std::size_t{0});
  prepare_steps();
  train_with_recovery();
  summarise();
  return fenced_ ? kExitFenced : stopped_ ? kExitStopped : 0;
}

// ---- load the data, build the model ----

void Trainer::load_data() {
  try {
    if (o_.dataset == "synthetic") {
      train_set_ = data::make_synthetic(o_.synthetic_size, o_.seed);
      test_set_ = data::make_synthetic(std::max<std::int64_t>(1, o_.synthetic_size / 5), o_.seed + 1000);
    } else {
      train_set_ = data::load_fashion_mnist(o_.data_dir, true, o_.train_subset);
      test_set_ = data::load_fashion_mnist(o_.data_dir, false, o_.test_subset);
    }
  } catch (const std::runtime_error& e) {
    throw SetupError(e.what());
  }
  std::tie(train_x_, train_y_) = to_device(train_set_, comm_.device);
  std::tie(test_x_, test_y_) = to_device(test_set_, comm_.device);
}

void Trainer::build_model() {
  torch::manual_seed(o_.seed);
  ModelOptions mo;
  mo.name = o_.model;
  mo.rank = comm_.rank;
  mo.channels_last = o_.channels_last;
  if (o_.sync_batchnorm && comm_.world > 1) mo.sync_batchnorm = [&comm = comm_](torch::Tensor& t) { comm.allreduce_sum(t); };
  model_ = make_model(mo);
  model_.module->to(comm_.device);
  if (model_.convolutional && o_.channels_last) {
    train_x_ = train_x_.contiguous(at::MemoryFormat::ChannelsLast);
    test_x_ = test_x_.contiguous(at::MemoryFormat::ChannelsLast);
  }
  params_ = model_.module->parameters();
  buffers_ = model_.module->buffers();
  opt_ = std::make_unique<torch::optim::SGD>(params_, torch::optim::SGDOptions(lr_for(comm_.world)).momentum(o_.momentum));
}

// A new round's variables on top of this worker's copy of the environment, and its group.
// Never setenv: other threads (the control channel's, torch's) read the environment.
void Trainer::adopt(const Assignment& place) {
  for (const auto& [k, v] : place.env) vars_[k] = v;
  env_ = read_env(vars_);
  if (auto it = vars_.find("TORCHELASTIC_ERROR_FILE"); it != vars_.end()) use_error_file(it->second);
}

// A standby's pre-started worker (MGLAUNCH_STANDBY=1) with everything that needs no group
// done: waits for the agent's `assign` as long as the node is a standby, which may be the
// whole job (no --timeout: the agent stops it when the job ends; SIGTERM or SIGUSR1 ends the
// wait: false; the control channel closing throws), takes its variables and joins the
// group, as a worker spawned with them would.
bool Trainer::take_place() {
  std::optional<Assignment> place;
  while (!place) {
    if (g_stop_signal.load()) return false;
    place = control_->wait_assign(std::chrono::milliseconds(100));
    if (place) break;
    if (const std::string closed = control_->closed_reason(); !closed.empty())
      throw SetupError("a standby's pre-started worker lost its control channel before its place: " + closed);
  }
  adopt(*place);
  comm_ = connect(o_, env_);
  lead_ = comm_.rank == 0;
  return true;
}

void Trainer::make_reducer() {
  reducer_.reset();
  if (!comm_.distributed()) return;
  ReducerOptions ro;
  ro.bucket_cap_mb = o_.bucket_cap_mb;
  ro.comm_dtype = o_.comm_dtype == "fp16" ? torch::kHalf : o_.comm_dtype == "bf16" ? torch::kBFloat16 : torch::kFloat;
  ro.find_unused = o_.find_unused_parameters;
  ro.static_graph = o_.static_graph;
  if (o_.reducer == "c10d")
    reducer_ = std::make_unique<C10dReducer>(params_, model_.param_names, comm_.pg, ro);
  else
    reducer_ = std::make_unique<GradReducer>(params_, model_.param_names, comm_.pg, comm_.world, ro);
}

// ---- establish one state ----

// Every rank starts from one state: rank 0's initial parameters and buffers, and the
// newest checkpoint among the ranks' when there is one (newest_checkpoint: by run, epoch,
// step). With in-place recovery the ranks first compare their last applied steps: when some
// rank has trained, the lowest rank among the most advanced sends its whole state (no
// checkpoint read) to those behind.
void Trainer::establish() {
  sync_buffers_ = o_.broadcast_buffers && comm_.distributed() && !buffers_.empty();
  if (comm_.distributed() && (o_.in_place_recovery || !o_.checkpoint_dir.empty())) check_census_version(comm_);
  LiveStates live;
  if (o_.in_place_recovery && comm_.distributed() && !agree_on_recovery(live)) recovery_ = false;
  const bool alive = std::any_of(live.keys.begin(), live.keys.end(), [](const auto& k) { return k.step > 0; });
  const Newest newest = newest_checkpoint(o_.checkpoint_dir, comm_, fence(), recovery_ && alive);
  // A take-over persists (docs/mgtrain.md): this run records the one its checkpoint records,
  // and a run that was taken over writes nothing more.
  if (o_.checkpoint_take_over.empty() && newest.rank >= 0 && newest.key.supersedes != env_.run)
    take_over_ = newest.key.supersedes;
  taken_by_ = newest.taken_by;
  // state_ belongs to this round once it is established: a transfer that throws (a peer lost
  // again) leaves the old round's key on the old state (review s39 M1).
  const CheckpointKey round{env_.run, env_.epoch.value_or(-1), 0, {}};
  const int source = recovery_ && comm_.distributed() ? live.newest(newest) : -1;
  if (source >= 0 && !checkpoint_is_newer(live, source, newest)) {
    take_most_advanced(live, source);
    held_ = round;
    return;
  }
  // Every rank starts from rank 0's initial parameters, then the checkpoint's whole state. With
  // a live state that one replaces every rank's whole state, or where it cannot be read the
  // newest live state does (review s38 M4: it stopped every rank).
  if (source < 0) comm_.broadcast_coalesced(state_tensors(*model_.module));
  bool unreadable = false;
  if (auto c = resume(comm_, *model_.module, *opt_, newest, source >= 0 ? &unreadable : nullptr)) {
    state_ = *c;
    if (lead_) say_resumed(o_.checkpoint_dir, newest, state_);
  } else if (unreadable) {
    take_most_advanced(live, source);
  }
  held_ = round;
}

// Every rank asked for recovery (the same flags): each says whether it has its control
// channel, in the same collective as its live state's key (`live`: its step, and the run and
// epoch of the round that last held it). Recovery is on for every rank or none (false): a
// rank without it would skip the collectives of the state agreement (a hang).
bool Trainer::agree_on_recovery(LiveStates& live) {
  live = gather_live_states(comm_, CheckpointKey{held_.run, held_.epoch, state_.step, {}}, recovery_);
  if (live.channels >= comm_.world) return true;
  if (recovery_) {
    std::fprintf(stderr, "mgtrain: --in-place-recovery: rank %d: another rank has no control channel: "
                         "recovery is off on every rank, training goes on as usual\n", comm_.rank);
    // The agent took this worker's hello for an opt-in: it would pause this worker at a
    // failure (which it would then leave with an error) instead of stopping it.
    control_->withdraw();
  }
  return false;
}

// Whether the newest checkpoint (the one resume() reads) holds newer training than every
// rank's state (`live`, its newest rank's `source`), in the census's order (run, epoch, step:
// older_checkpoint): a rank back from a cut-off side with an old state must not beat it (nor
// then overwrite it), and a cut-off side's checkpoint of an older epoch at a later step must
// not beat the newer epoch's live states (review s38 M3). The round resumes from it then, as
// a restarted job does.
bool Trainer::checkpoint_is_newer(const LiveStates& live, int source, const Newest& newest) {
  const CheckpointKey& best = live.keys[static_cast<std::size_t>(source)];
  if (newest.rank < 0 || !older_checkpoint(best, newest.key, newest.taken, newest.order)) return false;
  // Under an epoch the line says which: a checkpoint of a newer epoch (or run) than the states'.
  const std::string rounds =
      newest.order == CheckpointOrder::kByStep
          ? std::string()
          : fmt::format(" of epoch {} of run {}; the checkpoint's: epoch {} of run {}", best.epoch,
                        best.run.empty() ? "(none)" : best.run, newest.key.epoch,
                        newest.key.run.empty() ? "(none)" : newest.key.run);
  if (lead_)
    std::printf("mgtrain: %s holds step %lld, later than every rank's state (the newest: step %lld%s): resuming from it\n",
                checkpoint_file(with_rank(o_.checkpoint_dir, newest.rank)).c_str(), static_cast<long long>(newest.key.step),
                static_cast<long long>(best.step), rounds.c_str());
  return true;
}

// Rank `source`, the newest of the ranks' live states (`live`: by run, epoch, step), sends its
// whole state to every rank; a rank whose state differs (behind, or of an older epoch: a
// cut-off side's, review s38 M3) takes it.
void Trainer::take_most_advanced(const LiveStates& live, int source) {
  const CheckpointKey best = live.keys[static_cast<std::size_t>(source)];
  const auto same_round = [&](const CheckpointKey& k) { return k.run == best.run && k.epoch == best.epoch; };
  bool partial = false;
  for (const auto& k : live.keys) partial = partial || (k.step > 0 && k.step < best.step && same_round(k));
  std::string bytes = comm_.rank == source ? state_bytes(*model_.module, *opt_, state_) : std::string();
  bytes = broadcast_bytes(comm_, source, std::move(bytes));
  if (const auto& mine = live.keys[static_cast<std::size_t>(comm_.rank)]; mine.step != best.step || !same_round(mine)) {
    const std::int64_t was = state_.step;
    state_ = load_state(bytes, comm_.device, *model_.module, *opt_);
    std::printf("mgtrain: rank %d took step %lld's state from rank %d (it was at step %lld%s)\n", comm_.rank,
                static_cast<long long>(best.step), source, static_cast<long long>(was),
                mine.step > 0 && !same_round(mine) ? fmt::format(" of epoch {}", mine.epoch).c_str() : "");
  }
  if (partial && comm_.rank == 0)
    std::printf("mgtrain: step %lld was applied on some ranks only: recovering from it, the most advanced state "
                "(rank %d's)\n", static_cast<long long>(best.step), source);
  std::fflush(stdout);
}

// ---- shard ----

// This rank's shard and the step counts follow the world size (a new round may change it).
// A world that changes mid-epoch takes over the epoch where the old one left it: the
// permutation positions the old world consumed are skipped, the rest is dealt to the new
// ranks (DistributedSampler's offset), so each sample of the epoch is seen once.
void Trainer::reshard() {
  if (state_.world > 0 && state_.world != comm_.world && (state_.batch_in_epoch > 0 || state_.epoch_offset > 0)) {
    data::DistributedSampler old(train_set_.size(), static_cast<int>(state_.world), 0, o_.shuffle, o_.seed, false);
    old.set_epoch(state_.epoch, state_.epoch_offset);
    const std::int64_t consumed = old.consumed(state_.batch_in_epoch * o_.batch_size);
    if (lead_)
      std::printf("mgtrain: world %lld -> %d in epoch %lld: %lld of its %lld samples done, the other %lld dealt to the new ranks\n",
                  static_cast<long long>(state_.world), comm_.world, static_cast<long long>(state_.epoch + 1),
                  static_cast<long long>(consumed), static_cast<long long>(train_set_.size()),
                  static_cast<long long>(train_set_.size() - consumed));
    state_.epoch_offset = consumed;
    state_.batch_in_epoch = 0;
  }
  state_.world = comm_.world;
  sampler_ = std::make_unique<data::DistributedSampler>(train_set_.size(), comm_.world, comm_.rank, o_.shuffle, o_.seed, false);
  micro_per_epoch_ = micro_batches(sampler_->num_samples());
  steps_per_epoch_ = (micro_per_epoch_ + o_.grad_accum - 1) / o_.grad_accum;
  // The steps left in the epoch under way (from its offset), then whole epochs.
  sampler_->set_epoch(state_.epoch, state_.epoch_offset);
  const std::int64_t micro_now = micro_batches(sampler_->num_samples());
  const std::int64_t left_now =
      (std::max<std::int64_t>(0, micro_now - state_.batch_in_epoch) + o_.grad_accum - 1) / o_.grad_accum;
  total_steps_ = state_.epoch >= o_.epochs ? state_.step
                                           : state_.step + left_now + steps_per_epoch_ * (o_.epochs - state_.epoch - 1);
  if (o_.max_steps >= 0) total_steps_ = std::min(total_steps_, o_.max_steps);
}

// ---- step ----

// The step's machinery (the graph, the test-only unapplied step) and the counters.
void Trainer::prepare_steps() {
  // For tests only, never set otherwise (docs/mgtrain.md): MGTRAIN_TEST_UNAPPLIED_STEP=K:R
  // makes rank R leave step K unapplied once, as if its gradient all-reduce had failed
  // after its peers' completed (a peer lost at the very end of the exchange): the step is
  // then applied on some ranks only.
  if (auto t = vars_.find("MGTRAIN_TEST_UNAPPLIED_STEP"); t != vars_.end() && recovery_)
    if (std::sscanf(t->second.c_str(), "%lld:%d", &unapplied_step_, &unapplied_rank_) != 2) unapplied_rank_ = -1;
  if (o_.cuda_graphs) {
    if (sampler_->num_samples() < o_.batch_size)
      throw UsageError(fmt::format("--cuda-graphs: no full batch of {} fits in this rank's {} samples; use a smaller "
                                   "--batch-size", o_.batch_size, sampler_->num_samples()));
    graph_ = std::make_unique<StepGraph>(comm_.device, o_.batch_size);
  }
  t_start_ = Clock::now();
  cpu_start_ = cpu_seconds();
  loss_sum_t_ = torch::zeros({}, torch::TensorOptions().dtype(torch::kDouble).device(comm_.device));
  stop_flag_ = torch::zeros({1}, torch::TensorOptions().dtype(torch::kFloat).device(comm_.device));
}

torch::Tensor Trainer::forward_backward(const torch::Tensor& bi, std::int64_t k_n, bool sync) {
  auto x = train_x_.index_select(0, bi), y = train_y_.index_select(0, bi);
  broadcast_buffers();  // DDP: rank 0's buffers before every forward
  torch::Tensor logits;
  {
    AutocastScope amp(o_.amp);
    logits = model_.forward(x);
  }
  auto loss = torch::nn::functional::cross_entropy(logits.to(torch::kFloat), y) / static_cast<double>(k_n);
  if (reducer_) reducer_->arm(sync, {loss});
  loss.backward();
  return loss.detach();
}

void Trainer::finish_step() {
  if (reducer_) reducer_->finish();
  if (comm_.rank == unapplied_rank_ && state_.step + 1 == unapplied_step_) {
    unapplied_rank_ = -1;
    throw CollectiveError(
        fmt::format("MGTRAIN_TEST_UNAPPLIED_STEP: rank {} leaves step {} unapplied", comm_.rank, unapplied_step_));
  }
  if (o_.clip_grad_norm > 0) torch::nn::utils::clip_grad_norm_(params_, o_.clip_grad_norm);
  opt_->step();
}

// The micro-batches of one optimizer step from `micro` on (at most --grad-accum, within
// the epoch), run eagerly; `micro` moves past them. Returns the step's loss.
torch::Tensor Trainer::eager_step(const torch::Tensor& idx, std::int64_t& micro) {
  for (auto& p : params_) p.mutable_grad().reset();  // set_to_none: no memset, no extra add
  torch::Tensor loss_acc = torch::zeros({}, comm_.device);
  const std::int64_t k_end = std::min<std::int64_t>(micro + o_.grad_accum, micro_per_epoch_);
  const std::int64_t k_n = k_end - micro;
  for (; micro < k_end; ++micro) {
    const std::int64_t b0 = micro * o_.batch_size;
    const std::int64_t b1 = std::min<std::int64_t>(b0 + o_.batch_size, idx.size(0));
    loss_acc += forward_backward(idx.slice(0, b0, b1), k_n, micro + 1 == k_end);
    samples_done_ += (b1 - b0) * comm_.world;
  }
  finish_step();
  return loss_acc;
}

// From `state_` to the end of training; a collective that fails leaves `state_` at the
// last step this rank applied, so a rerun of the loop redoes the interrupted step.
void Trainer::train_loop() {
  for (std::int64_t epoch = state_.epoch; epoch < o_.epochs && state_.step < total_steps_ && !stopped_; ++epoch) {
    const std::int64_t loss_n = train_epoch(epoch);
    if (stopped_ || fenced_) break;
    evaluate(epoch, loss_n);
    state_.batch_in_epoch = 0;
    state_.epoch_offset = 0;
    state_.epoch = epoch + 1;
  }
  broadcast_buffers();  // the final model is the one the next forward would see
}

// The steps of `epoch` from `state_` on, until its end, total_steps_ or a stop. Returns
// how many steps it ran (their losses are in loss_sum_t_).
std::int64_t Trainer::train_epoch(std::int64_t epoch) {
  sampler_->set_epoch(epoch, epoch == state_.epoch ? state_.epoch_offset : 0);
  micro_per_epoch_ = micro_batches(sampler_->num_samples());
  auto idx_all = sampler_->indices();
  auto idx = torch::from_blob(idx_all.data(), {static_cast<std::int64_t>(idx_all.size())}, torch::kLong).to(comm_.device);
  model_.module->train();
  loss_sum_t_.zero_();
  std::int64_t loss_n = 0;
  std::int64_t micro = epoch == state_.epoch ? state_.batch_in_epoch : 0;
  auto graph_step = [this](const torch::Tensor& bi) {
    for (auto& p : params_) p.mutable_grad().reset();
    auto loss = forward_backward(bi, 1, true);
    finish_step();
    return loss;
  };
  while (micro < micro_per_epoch_ && state_.step < total_steps_) {
    if (interrupt_ && interrupt_->fired.load()) throw Interrupted("the agent paused this worker between steps");
    const std::int64_t first = micro * o_.batch_size;
    if (graph_ && first + o_.batch_size <= idx.size(0)) {
      // A full batch through the graph (an epoch's last, partial batch runs eagerly).
      last_loss_t_ = graph_->run(idx.slice(0, first, first + o_.batch_size), graph_step);
      samples_done_ += o_.batch_size * comm_.world;
      ++micro;
    } else {
      last_loss_t_ = eager_step(idx, micro);
    }
    loss_sum_t_ += last_loss_t_;
    ++loss_n;
    after_step(epoch, micro);
    if (stop_or_checkpoint()) break;
    log_progress(epoch);
    if (o_.step_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(o_.step_ms));  // --step-ms
  }
  return loss_n;
}

// The position after a step, a recovery it completes, and the injected failure.
void Trainer::after_step(std::int64_t epoch, std::int64_t micro) {
  ++state_.step;
  ++steps_this_run_;
  state_.epoch = epoch;
  state_.batch_in_epoch = micro;
  if (pending_) {
    const double secs = std::chrono::duration<double>(Clock::now() - pending_->detected).count();
    recoveries_.push_back({{"step", pending_->step}, {"seconds", secs}, {"lost", pending_->lost}});
    if (lead_) std::printf("mgtrain: recovered in %.3f s: step %lld redone\n", secs, static_cast<long long>(pending_->step));
    std::fflush(stdout);
    pending_.reset();
  }
  if (o_.fail_at_step >= 0 && state_.step == o_.fail_at_step && comm_.rank == o_.fail_rank && env_.restart_count == 0) {
    write_error_file(fmt::format("injected failure at step {} on rank {}", state_.step, comm_.rank));
    std::fflush(stdout);
    if (o_.fail_signal > 0) {
      std::signal(o_.fail_signal, SIG_DFL);
      std::raise(o_.fail_signal);
    }
    std::_Exit(1);
  }
}

// Whether every rank stops after this step (a stop signal on any rank: stopped_; the
// checkpoint fenced: fenced_), and the checkpoint of a periodic or stopping step. Every
// rank learns of a stop request at the same step: ranks compare notes every
// kStopCheckEvery steps (a collective per step would cost ~4% of a CPU step).
bool Trainer::stop_or_checkpoint() {
  bool stop_now = false;
  if (state_.step % kStopCheckEvery == 0 || state_.step == total_steps_) {
    stop_flag_.fill_(g_stop_signal.load() ? 1.0 : 0.0);
    comm_.allreduce_sum(stop_flag_);
    stop_now = stop_flag_.item<float>() > 0;
  }
  const bool periodic = o_.checkpoint_every > 0 && state_.step % o_.checkpoint_every == 0;
  if (!o_.checkpoint_dir.empty() && (periodic || stop_now) && !checkpoint(stop_now)) fenced_ = true;
  if (stop_now) stopped_ = true;
  return stop_now || fenced_;
}

// Rank 0 writes the checkpoint of this step, fenced by this round's epoch and run
// (MGLAUNCH_EPOCH, MGLAUNCH_RUN). False on every rank when rank 0 refused (a newer epoch of
// this run, or a newer run, holds the path): this side of the job is stale, and every rank
// stops; rank 0 says why in one line. A write that failed throws on every rank (exit 1).
bool Trainer::checkpoint(bool stop_now) {
  broadcast_buffers();  // the checkpoint holds the buffers every rank's next forward gets
  Position c = state_;
  if (c.batch_in_epoch >= micro_per_epoch_) {
    c.batch_in_epoch = 0;
    c.epoch_offset = 0;
    ++c.epoch;
  }
  Saved saved;
  std::string failed;  // rank 0's write failed: every rank stops after the all-reduce below
  if (lead_) {
    const std::string dir = with_rank(o_.checkpoint_dir, comm_.rank);
    try {
      saved = save_checkpoint(dir, *model_.module, *opt_, c, fence());
    } catch (const std::exception& e) {
      failed = e.what();
    }
    if (saved.written && stop_now) stop_checkpoint_ = checkpoint_file(dir);
    if (!saved.taken_over.empty())
      std::printf("mgtrain: checkpoint at step %lld: took %s over from run %s (--checkpoint-take-over), dated after "
                  "this run's MGLAUNCH_RUN=%s; recorded there (lock, key, archive): run %s's checkpoints count as "
                  "older than this run's from now on, and a writer of run %s is refused\n",
                  static_cast<long long>(state_.step), checkpoint_file(dir).c_str(), saved.taken_over.c_str(),
                  env_.run.c_str(), saved.taken_over.c_str(), saved.taken_over.c_str());
    if (!saved.written) {
      const auto now = std::chrono::system_clock::now().time_since_epoch();
      const std::string why = refusal(saved, fence(), state_.step, checkpoint_file(dir),
                                      std::chrono::duration_cast<std::chrono::milliseconds>(now).count());
      std::fprintf(stderr, "mgtrain: %s\n", why.c_str());
      write_error_file(why);
    }
  }
  // Every rank learns whether rank 0 refused or failed (one all-reduce: rank 0 never throws
  // before a collective the others enter, review s38 L2), and fails with it.
  if (!comm_.distributed()) {
    if (!failed.empty()) throw std::runtime_error(failed);
    return saved.written;
  }
  auto flags = torch::tensor({saved.written ? 0.0f : 1.0f, failed.empty() ? 0.0f : 1.0f},
                             torch::TensorOptions().dtype(torch::kFloat)).to(comm_.device);
  comm_.allreduce_sum(flags);
  flags = flags.to(torch::kCPU);
  if (flags[1].item<float>() > 0)
    throw std::runtime_error(lead_ ? failed : "rank 0 could not write its checkpoint (see rank 0's error): every rank stops");
  return flags[0].item<float>() == 0;  // only a fenced write can be refused
}

void Trainer::log_progress(std::int64_t epoch) {
  if (!lead_ || o_.log_every <= 0 || state_.step % o_.log_every != 0) return;
  last_loss_ = last_loss_t_.item<double>();
  const double secs = std::chrono::duration<double>(Clock::now() - t_start_).count();
  const double sps = static_cast<double>(samples_done_) / std::max(secs, 1e-9);
  const double eta = static_cast<double>(total_steps_ - state_.step) * secs /
                     static_cast<double>(std::max<std::int64_t>(1, steps_this_run_));
  std::printf("epoch %lld/%d step %lld/%lld loss %.4f samples/s %.0f eta %.0fs\n", static_cast<long long>(epoch + 1),
              o_.epochs, static_cast<long long>(state_.step), static_cast<long long>(total_steps_), last_loss_, sps, eta);
  std::fflush(stdout);
}

// ---- evaluate ----

// Test accuracy over every rank's disjoint shard of the test set, with rank 0's buffers,
// and the epoch's mean train loss over its `loss_n` steps.
void Trainer::evaluate(std::int64_t epoch, std::int64_t loss_n) {
  broadcast_buffers();
  model_.module->eval();
  torch::NoGradGuard ng;
  auto shard =
      torch::arange(comm_.rank, test_set_.size(), comm_.world, torch::TensorOptions().dtype(torch::kLong)).to(comm_.device);
  double correct = 0;
  for (std::int64_t b = 0; b < shard.size(0); b += 1000) {
    auto bi = shard.slice(0, b, std::min<std::int64_t>(b + 1000, shard.size(0)));
    correct += model_.forward(test_x_.index_select(0, bi)).argmax(1).eq(test_y_.index_select(0, bi)).sum().item<double>();
  }
  const double loss_sum = loss_sum_t_.item<double>();
  auto acc = torch::tensor({correct, static_cast<double>(shard.size(0)), loss_sum, static_cast<double>(loss_n)},
                           torch::TensorOptions().dtype(torch::kDouble))
                 .to(comm_.device);
  comm_.allreduce_sum(acc);
  acc = acc.to(torch::kCPU);
  test_acc_ = acc[0].item<double>() / std::max(1.0, acc[1].item<double>());
  measured_epoch_ = epoch + 1;
  if (lead_) {
    std::printf("epoch %lld/%d train loss %.4f test accuracy %.4f\n", static_cast<long long>(epoch + 1), o_.epochs,
                acc[2].item<double>() / std::max(1.0, acc[3].item<double>()), test_acc_);
    std::fflush(stdout);
  }
}

// ---- recover ----

// The loop, and with in-place recovery a recovery after each failed collective or pause.
void Trainer::train_with_recovery() {
  std::string failure;
  for (;;) {
    try {
      if (!failure.empty()) recover(std::exchange(failure, std::string()));
      if (stopped_) {  // stopped while waiting for the agent: no group to checkpoint through
        if (lead_) std::printf("mgtrain: stopped by a signal while waiting for the agent's new round\n");
        return;
      }
      train_loop();
      return;
    } catch (const CollectiveError& e) {
      if (!recovery_) throw;
      failure = e.what();
    } catch (const Interrupted& e) {
      if (!recovery_) throw;
      failure = e.what();
    }
  }
}

template <typename WaitOnce>
auto Trainer::wait_for(WaitOnce&& wait_once) -> decltype(wait_once(std::chrono::milliseconds(0))) {
  const auto end = Clock::now() + std::chrono::seconds(o_.timeout_s);
  for (;;) {
    if (g_stop_signal.load()) {
      stopped_ = true;
      return std::nullopt;
    }
    if (auto got = wait_once(std::chrono::milliseconds(100))) return got;
    if (Clock::now() >= end || !control_->closed_reason().empty()) return std::nullopt;
  }
}

// A lost peer with --in-place-recovery: wait for the agent's pause (bounded), let go of
// the group, take the new round's assignment, build a new group under its store prefix
// and agree on the state; the loop then redoes the interrupted step. A recovery that
// failed part-way (a peer lost again while the group formed) is tried again, on the next
// pause, and counts from the first detection.
void Trainer::recover(const std::string& what) {
  const auto failed_at = Clock::now();
  // At most kRecoveryAttempts in a row that reach no new state (each wait bounded by --timeout).
  if (state_.step != attempts_at_) attempts_ = 0, attempts_at_ = state_.step;
  if (++attempts_ > kRecoveryAttempts)
    throw std::runtime_error(fmt::format("{} (in-place recovery: {} attempts in a row at step {} failed)", what,
                                         kRecoveryAttempts, static_cast<long long>(state_.step)));
  auto pause = wait_for([&](std::chrono::milliseconds t) { return control_->wait_pause(t); });
  if (stopped_) return;
  if (!pause) {
    const std::string closed = control_->closed_reason();
    throw std::runtime_error(fmt::format("{} (in-place recovery: no pause from the agent within {} s{})", what,
                                         o_.timeout_s, closed.empty() ? "" : ": " + closed));
  }
  unrecovered_ = std::min({unrecovered_.value_or(failed_at), failed_at, pause->at});
  control_->send_paused(state_.step);
  if (reducer_) reducer_->abandon();
  reducer_.reset();
  comm_.abandon();
  auto next = wait_for([&](std::chrono::milliseconds t) { return control_->wait_assign(t); });
  if (stopped_) return;
  if (!next) {
    const std::string closed = control_->closed_reason();
    throw std::runtime_error(fmt::format("in-place recovery: no assignment from the agent within {} s of its pause ({}){}",
                                         o_.timeout_s, pause->reason, closed.empty() ? "" : ": " + closed));
  }
  adopt(*next);
  try {
    // A pause while the group forms (a peer lost again) or a stop signal ends the wait at
    // once: the next round, not this one's --timeout.
    comm_ = connect_interruptible(o_, env_, [&] {
      return interrupt_->fired.load() || g_stop_signal.load() != 0 || !control_->closed_reason().empty();
    });
  } catch (const Interrupted&) {
    throw;
  } catch (const std::exception& e) {
    // The store out of reach too (its host lost): a later round may name another.
    std::string w = e.what();
    throw CollectiveError("the new round's process group did not form: " + w.substr(0, w.find('\n')));
  }
  lead_ = comm_.rank == 0;
  make_reducer();
  establish();
  set_lr_for_world();  // the source's optimizer carried its learning rate: the one of this world size
  reshard();
  pending_ = Pending{pending_ ? std::min(pending_->detected, *unrecovered_) : *unrecovered_, state_.step + 1, pause->lost};
  unrecovered_.reset();
  if (lead_)
    std::printf("mgtrain: in-place recovery, round %d (%s): world %d, redoing step %lld\n", next->round,
                pause->reason.c_str(), comm_.world, static_cast<long long>(state_.step + 1));
  std::fflush(stdout);
}

// ---- summarise ----

// Rank 0's last line, --summary-json and --save-weights.
void Trainer::summarise() {
  if (last_loss_t_.defined()) last_loss_ = last_loss_t_.item<double>();
  const double secs = std::chrono::duration<double>(Clock::now() - t_start_).count();
  const double sps = static_cast<double>(samples_done_) / std::max(secs, 1e-9);
  // Every rank did the same work: samples of all ranks over (this rank's CPU time x world).
  const double sp_cpu =
      static_cast<double>(samples_done_) / std::max((cpu_seconds() - cpu_start_) * comm_.world, 1e-9);
  const auto tensors = state_tensors(*model_.module);
  const std::string digest = sha256_of(tensors);
  if (lead_ && fenced_) {
    std::printf("fenced at step %lld: no checkpoint written (a newer epoch or run of the job holds it; see the error above), "
                "%.0f samples/s, weights sha256 %s\n", static_cast<long long>(state_.step), sps, digest.c_str());
    std::fflush(stdout);
  } else if (lead_ && !stopped_) {
    std::printf("done: %lld steps, %.0f samples/s, %.0f per cpu-s, test accuracy %.4f, weights sha256 %s\n",
                static_cast<long long>(state_.step), sps, sp_cpu, test_acc_, digest.c_str());
    std::fflush(stdout);
  } else if (lead_) {
    // Stopped by a signal: what was saved and where, and only an accuracy that was measured.
    const int sig = g_stop_signal.load();
    const char* abbrev = sig > 0 ? ::sigabbrev_np(sig) : nullptr;
    const std::string saved =
        !stop_checkpoint_.empty()
            ? fmt::format("checkpoint written to {} (a rerun with --checkpoint-dir {} resumes from it)", stop_checkpoint_,
                          o_.checkpoint_dir)
            : o_.checkpoint_dir.empty() ? std::string("no checkpoint written (no --checkpoint-dir)")
                                        : std::string("no checkpoint written (stopped while waiting for the agent)");
    const std::string accuracy =
        measured_epoch_ > 0 ? fmt::format("test accuracy {:.4f} after epoch {}", test_acc_, measured_epoch_)
                            : std::string("test accuracy not measured (no epoch finished)");
    std::printf("stopped by %s at step %lld: %s; %.0f samples/s, %s, weights sha256 %s\n",
                abbrev ? fmt::format("SIG{}", abbrev).c_str() : "a signal", static_cast<long long>(state_.step),
                saved.c_str(), sps, accuracy.c_str(), digest.c_str());
    std::fflush(stdout);
  }
  if (!o_.summary_json.empty()) write_summary(sps, sp_cpu, digest);
  if (!o_.save_weights.empty()) {
    const std::string path = with_rank(o_.save_weights, comm_.rank);
    if (lead_ || path != o_.save_weights) {
      std::ofstream out(path, std::ios::binary);
      for (const auto& p : tensors) {
        auto c = p.detach().to(torch::kCPU).to(torch::kFloat).contiguous();
        out.write(static_cast<const char*>(c.data_ptr()), static_cast<std::streamsize>(c.numel() * sizeof(float)));
      }
    }
  }
}

void Trainer::write_summary(double sps, double sp_cpu, const std::string& digest) {
  nlohmann::json j = {{"rank", comm_.rank},
                      {"world_size", comm_.world},
                      {"backend", comm_.backend},
                      {"mode", comm_.distributed() ? "ddp" : "single"},
                      {"steps", state_.step},
                      {"epochs", o_.epochs},
                      {"final_train_loss", last_loss_},
                      {"test_accuracy", measured_epoch_ > 0 ? nlohmann::json(test_acc_) : nlohmann::json()},
                      {"checkpoint_at_stop", stop_checkpoint_.empty() ? nlohmann::json() : nlohmann::json(stop_checkpoint_)},
                      {"samples_per_sec", sps},
                      {"samples_per_cpu_sec", sp_cpu},
                      {"restart_count", env_.restart_count},
                      {"weights_sha256", digest},
                      {"params_sha256", sha256_of(params_)},
                      {"stopped_by_signal", stopped_},
                      {"mglaunch_epoch", env_.epoch ? nlohmann::json(*env_.epoch) : nlohmann::json()},
                      {"mglaunch_run", env_.run.empty() ? nlohmann::json() : nlohmann::json(env_.run)},
                      {"fenced", fenced_},
                      {"cuda_graphs", graph_ && graph_->captured()},
                      {"recoveries", recoveries_}};
  std::ofstream(with_rank(o_.summary_json, comm_.rank)) << j.dump(2) << "\n";
}

// The control channel, or why in-place recovery is off (`off`; the channel null then).
std::unique_ptr<ControlChannel> open_control(const Env& env, const std::map<std::string, std::string>& vars, bool single,
                                             bool standby, std::shared_ptr<Interrupt>& interrupt, std::string& off) {
  const auto name = vars.find("MGLAUNCH_CONTROL_SOCKET");
  if (single) {
    off = "a single process has no peer to lose";
  } else if (name == vars.end() || name->second.empty()) {
    off = "no MGLAUNCH_CONTROL_SOCKET (the launcher offers no control channel)";
  } else {
    try {
      interrupt = std::make_shared<Interrupt>();
      auto control = std::make_unique<ControlChannel>(name->second, env.local_rank, interrupt, std::chrono::seconds(10), standby);
      set_interrupt(interrupt);
      return control;
    } catch (const std::exception& e) {
      off = e.what();
      interrupt.reset();
    }
  }
  return nullptr;
}

}  // namespace

void install_stop_handlers() {
  std::signal(SIGTERM, on_stop_signal);
  std::signal(SIGUSR1, on_stop_signal);
  // Gloo writes to its peers with writev(), which raises SIGPIPE on a connection the peer
  // reset: a peer lost killed this worker silently (no line, no core), typically while an
  // abandoned group's queued collective still ran after the agent's pause. Python ignores
  // SIGPIPE for torch; here the write fails with EPIPE instead and Gloo reports it.
  std::signal(SIGPIPE, SIG_IGN);
}

int run(const Options& o, const Env& env) {
  if (o.amp && !kAmpSupported) throw UsageError("--amp needs a CUDA build of mgtrain against LibTorch >= 2.4");
#ifndef MGLAUNCH_WITH_NCCL
  if (o.cuda_graphs) throw UsageError("--cuda-graphs needs a CUDA build of mgtrain (LibTorch with CUDA; see docs/mgtrain.md)");
#endif
  auto vars = process_env();
  // A standby node's pre-started worker (mglaunch --prestart-standby): no rank until the
  // agent's assign; only with --in-place-recovery, which waits for it.
  const auto standby_var = vars.find(kStandbyVar);
  const bool standby = standby_var != vars.end() && standby_var->second == "1";
  if (standby && !o.in_place_recovery)
    throw UsageError(fmt::format("{}=1 (a standby's pre-started worker, mglaunch --prestart-standby) needs "
                                 "--in-place-recovery: without it mgtrain cannot wait for its place",
                                 kStandbyVar));
  if (standby && o.model == "mlp-rank-branch")
    throw UsageError(fmt::format("{}=1: --model mlp-rank-branch is built for its rank, which a pre-started worker "
                                 "does not know yet; leave out --prestart-standby",
                                 kStandbyVar));
  if (!o.checkpoint_take_over.empty() && !standby) {  // a standby learns its run with its place
    if (!env.epoch || env.run.empty())
      throw UsageError("--checkpoint-take-over needs MGLAUNCH_RUN and MGLAUNCH_EPOCH (a round of mglaunch after #37): "
                       "without them this run records no run to take anything over with; leave the flag out");
    if (env.run == o.checkpoint_take_over)
      throw UsageError("--checkpoint-take-over " + env.run + " names this run itself (MGLAUNCH_RUN): name the run "
                       "that the refusal line says holds the checkpoint");
  }
  const Mode mode = standby ? Mode::ddp : resolve_mode(o, env);
  if (o.threads > 0) torch::set_num_threads(o.threads);
  // --in-place-recovery: the agent's control channel, connected before the group.
  std::shared_ptr<Interrupt> interrupt;
  std::unique_ptr<ControlChannel> control;
  if (o.in_place_recovery) {
    std::string off;
    control = open_control(env, vars, mode == Mode::single, standby, interrupt, off);
    if (!off.empty() && standby)
      throw SetupError(fmt::format("a standby's pre-started worker ({}=1) needs the control channel: {}", kStandbyVar, off));
    if (!off.empty() && env.rank == 0)
      std::fprintf(stderr, "mgtrain: --in-place-recovery: %s: recovery is off, training goes on as usual\n", off.c_str());
  }
  Comm comm = mode == Mode::single ? local_comm(o) : standby ? unplaced_comm(o, env) : connect(o, env);
  const int code = o.bench == "allreduce"
                       ? run_allreduce_bench(o, comm)
                       : Trainer(o, comm, control.get(), interrupt.get(), std::move(vars), env).run(standby);
  comm.shutdown();
  if (abandoned_groups() > 0) {
    // A group abandoned by a recovery may hold a thread blocked on a lost peer: exit
    // without running destructors that would join it.
    std::fflush(nullptr);
    std::_Exit(code);
  }
  return code;
}

}  // namespace mg::train
