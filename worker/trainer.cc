// The training loop: data on the device, the model, SGD, the gradient reducer, buffer
// broadcasts, checkpoints, stop agreement, evaluation and the summary.
#include "worker/trainer.h"

#include <string.h>
#include <sys/resource.h>

#include <algorithm>
#include <atomic>
#include <chrono>
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

std::string with_rank(std::string path, int rank) {
  if (auto p = path.find("{rank}"); p != std::string::npos) path.replace(p, 6, std::to_string(rank));
  return path;
}

// A standby's pre-started worker (MGLAUNCH_STANDBY=1) with everything that needs no group
// done: waits for the agent's `assign` as long as the node is a standby, which may be the
// whole job (no --timeout: the agent stops it when the job ends; SIGTERM or SIGUSR1 ends the
// wait: false; the control channel closing throws), takes its variables and joins the
// group, as a worker spawned with them would.
bool take_place(const Options& o, Comm& comm, ControlChannel& control) {
  std::optional<Assignment> place;
  while (!place) {
    if (g_stop_signal.load()) return false;
    place = control.wait_assign(std::chrono::milliseconds(100));
    if (place) break;
    if (const std::string closed = control.closed_reason(); !closed.empty())
      throw SetupError("a standby's pre-started worker lost its control channel before its place: " + closed);
  }
  for (const auto& [k, v] : place->env) ::setenv(k.c_str(), v.c_str(), 1);
  comm = connect(o, read_env(process_env()));
  return true;
}

// `control`: the agent's control channel when --in-place-recovery is on (else null).
// `standby`: a standby's pre-started worker: `comm` is unplaced_comm() until take_place().
int train(const Options& o, Comm& comm, ControlChannel* control, const Interrupt* interrupt, bool standby) {
  using clock = std::chrono::steady_clock;
  bool recovery = control != nullptr;  // off for every rank when one rank has no channel (establish)
  bool lead = comm.rank == 0;
  data::Dataset train_set, test_set;
  try {
    if (o.dataset == "synthetic") {
      train_set = data::make_synthetic(o.synthetic_size, o.seed);
      test_set = data::make_synthetic(std::max<std::int64_t>(1, o.synthetic_size / 5), o.seed + 1000);
    } else {
      train_set = data::load_fashion_mnist(o.data_dir, true, o.train_subset);
      test_set = data::load_fashion_mnist(o.data_dir, false, o.test_subset);
    }
  } catch (const std::runtime_error& e) {
    throw SetupError(e.what());
  }
  auto to_tensors = [&](const data::Dataset& d) {
    auto x = torch::from_blob(const_cast<float*>(d.images.data()), {d.size(), 1, d.rows, d.cols}, torch::kFloat).clone();
    auto y = torch::from_blob(const_cast<std::int64_t*>(d.labels.data()), {d.size()}, torch::kLong).clone();
    return std::make_pair(x.to(comm.device), y.to(comm.device));
  };
  auto [train_x, train_y] = to_tensors(train_set);
  auto [test_x, test_y] = to_tensors(test_set);

  torch::manual_seed(o.seed);
  ModelOptions mo;
  mo.name = o.model;
  mo.rank = comm.rank;
  mo.channels_last = o.channels_last;
  if (o.sync_batchnorm && comm.world > 1) mo.sync_batchnorm = [&comm](torch::Tensor& t) { comm.allreduce_sum(t); };
  Model model = make_model(mo);
  model.module->to(comm.device);
  if (model.convolutional && o.channels_last) {
    train_x = train_x.contiguous(at::MemoryFormat::ChannelsLast);
    test_x = test_x.contiguous(at::MemoryFormat::ChannelsLast);
  }
  std::vector<torch::Tensor> params = model.module->parameters();
  std::vector<torch::Tensor> buffers = model.module->buffers();
  bool sync_buffers = false;
  auto broadcast_buffers = [&] {
    if (sync_buffers) comm.broadcast_coalesced(buffers);
  };

  auto lr_for = [&](int world) {
    return o.lr * (o.lr_scaling == "linear" ? world : o.lr_scaling == "sqrt" ? std::sqrt(world) : 1.0);
  };
  torch::optim::SGD opt(params, torch::optim::SGDOptions(lr_for(comm.world)).momentum(o.momentum));
  // A standby's pre-started worker: data, model and optimizer are ready; now its place, then
  // the group, as any newcomer (the state comes from the survivors in establish()).
  if (standby) {
    std::printf("mgtrain: standby worker ready (data, model and optimizer loaded): waiting for this node's place\n");
    std::fflush(stdout);
    if (!take_place(o, comm, *control)) {
      std::printf("mgtrain: stopped by a signal while this standby worker waited for its place\n");
      std::fflush(stdout);
      return kExitStopped;
    }
    lead = comm.rank == 0;
    static_cast<torch::optim::SGDOptions&>(opt.param_groups()[0].options()).lr(lr_for(comm.world));
  }
  std::unique_ptr<GradientSync> reducer;
  auto make_reducer = [&] {
    reducer.reset();
    if (!comm.distributed()) return;
    ReducerOptions ro;
    ro.bucket_cap_mb = o.bucket_cap_mb;
    ro.comm_dtype = o.comm_dtype == "fp16" ? torch::kHalf : o.comm_dtype == "bf16" ? torch::kBFloat16 : torch::kFloat;
    ro.find_unused = o.find_unused_parameters;
    ro.static_graph = o.static_graph;
    if (o.reducer == "c10d")
      reducer = std::make_unique<C10dReducer>(params, model.param_names, comm.pg, ro);
    else
      reducer = std::make_unique<GradReducer>(params, model.param_names, comm.pg, comm.world, ro);
  };
  make_reducer();

  Position state;
  // Every rank starts from one state: rank 0's initial parameters and buffers, and rank
  // 0's checkpoint when there is one. With in-place recovery the ranks first compare
  // their last applied steps: when some rank has trained, the lowest rank among the most
  // advanced sends its whole state (no checkpoint read) to those behind.
  auto establish = [&] {
    sync_buffers = o.broadcast_buffers && comm.distributed() && !buffers.empty();
    torch::Tensor steps;
    if (o.in_place_recovery && comm.distributed()) {
      // Every rank asked for recovery (the same flags): each says whether it has its control
      // channel, in the same collective as its step. Recovery is on for every rank or none: a
      // rank without it would skip the collectives of the state agreement (a hang).
      steps = torch::zeros({2 * comm.world}, torch::kLong);
      steps[comm.rank] = state.step;
      steps[comm.world + comm.rank] = recovery ? 1 : 0;
      steps = steps.to(comm.device);
      comm.allreduce_sum(steps);
      steps = steps.to(torch::kCPU);
      if (steps.slice(0, comm.world, 2 * comm.world).sum().item<std::int64_t>() < comm.world) {
        if (recovery) {
          std::fprintf(stderr, "mgtrain: --in-place-recovery: rank %d: another rank has no control channel: "
                               "recovery is off on every rank, training goes on as usual\n", comm.rank);
          // The agent took this worker's hello for an opt-in: it would pause this worker at a
          // failure (which it would then leave with an error) instead of stopping it.
          control->withdraw();
        }
        recovery = false;
      }
    }
    if (recovery && comm.distributed()) {
      std::int64_t best = 0;
      int source = 0;
      bool partial = false;
      for (int r = 0; r < comm.world; ++r)
        if (steps[r].item<std::int64_t>() > best) best = steps[r].item<std::int64_t>(), source = r;
      for (int r = 0; r < comm.world; ++r)
        partial = partial || (steps[r].item<std::int64_t>() > 0 && steps[r].item<std::int64_t>() < best);
      if (best > 0) {
        std::string bytes = comm.rank == source ? state_bytes(*model.module, opt, state) : std::string();
        bytes = broadcast_bytes(comm, source, std::move(bytes));
        if (state.step < best) {
          const std::int64_t was = state.step;
          state = load_state(bytes, comm.device, *model.module, opt);
          std::printf("mgtrain: rank %d took step %lld's state from rank %d (it was at step %lld)\n", comm.rank,
                      static_cast<long long>(best), source, static_cast<long long>(was));
        }
        if (partial && comm.rank == 0)
          std::printf("mgtrain: step %lld was applied on some ranks only: recovering from it, the most advanced state "
                      "(rank %d's)\n", static_cast<long long>(best), source);
        std::fflush(stdout);
        return;
      }
    }
    comm.broadcast_coalesced(state_tensors(*model.module));
    const std::string ckpt_dir = with_rank(o.checkpoint_dir, comm.rank);
    if (auto c = resume(ckpt_dir, comm, *model.module, opt)) {
      state = *c;
      if (lead)
        std::printf("resumed from %s at step %lld (epoch %lld)\n", checkpoint_file(ckpt_dir).c_str(),
                    static_cast<long long>(state.step), static_cast<long long>(state.epoch + 1));
    }
  };
  establish();

  // This rank's shard and the step counts follow the world size (a new round may change it).
  // A world that changes mid-epoch takes over the epoch where the old one left it: the
  // permutation positions the old world consumed are skipped, the rest is dealt to the new
  // ranks (DistributedSampler's offset), so each sample of the epoch is seen once.
  std::unique_ptr<data::DistributedSampler> sampler;
  std::int64_t micro_per_epoch = 0, steps_per_epoch = 0, total_steps = 0;
  auto micro_batches = [&](std::int64_t samples) { return (samples + o.batch_size - 1) / o.batch_size; };
  auto reshard = [&] {
    if (state.world > 0 && state.world != comm.world && (state.batch_in_epoch > 0 || state.epoch_offset > 0)) {
      data::DistributedSampler old(train_set.size(), static_cast<int>(state.world), 0, o.shuffle, o.seed, false);
      old.set_epoch(state.epoch, state.epoch_offset);
      const std::int64_t consumed = old.consumed(state.batch_in_epoch * o.batch_size);
      if (lead)
        std::printf("mgtrain: world %lld -> %d in epoch %lld: %lld of its %lld samples done, the other %lld dealt to the new ranks\n",
                    static_cast<long long>(state.world), comm.world, static_cast<long long>(state.epoch + 1),
                    static_cast<long long>(consumed), static_cast<long long>(train_set.size()),
                    static_cast<long long>(train_set.size() - consumed));
      state.epoch_offset = consumed;
      state.batch_in_epoch = 0;
    }
    state.world = comm.world;
    sampler = std::make_unique<data::DistributedSampler>(train_set.size(), comm.world, comm.rank, o.shuffle, o.seed, false);
    micro_per_epoch = micro_batches(sampler->num_samples());
    steps_per_epoch = (micro_per_epoch + o.grad_accum - 1) / o.grad_accum;
    // The steps left in the epoch under way (from its offset), then whole epochs.
    sampler->set_epoch(state.epoch, state.epoch_offset);
    const std::int64_t micro_now = micro_batches(sampler->num_samples());
    const std::int64_t left_now = (std::max<std::int64_t>(0, micro_now - state.batch_in_epoch) + o.grad_accum - 1) / o.grad_accum;
    total_steps = state.epoch >= o.epochs ? state.step
                                          : state.step + left_now + steps_per_epoch * (o.epochs - state.epoch - 1);
    if (o.max_steps >= 0) total_steps = std::min(total_steps, o.max_steps);
  };
  reshard();
  if (lead)
    std::printf("mgtrain: %s on %s, %s, world %d, backend %s, %lld steps/epoch (batch %d x %d accum per rank), %zu buckets\n",
                o.model.c_str(), o.dataset.c_str(), comm.distributed() ? "ddp" : "single process", comm.world,
                comm.backend.c_str(), static_cast<long long>(steps_per_epoch), o.batch_size, o.grad_accum,
                reducer ? reducer->bucket_count() : std::size_t{0});

  // One step's parts, shared by the eager loop and the captured graph.
  auto reset_grads = [&] {
    for (auto& p : params) p.mutable_grad().reset();  // set_to_none: no memset, no extra add
  };
  auto forward_backward = [&](const torch::Tensor& bi, std::int64_t k_n, bool sync) {
    auto x = train_x.index_select(0, bi), y = train_y.index_select(0, bi);
    broadcast_buffers();  // DDP: rank 0's buffers before every forward
    torch::Tensor logits;
    {
      AutocastScope amp(o.amp);
      logits = model.forward(x);
    }
    auto loss = torch::nn::functional::cross_entropy(logits.to(torch::kFloat), y) / static_cast<double>(k_n);
    if (reducer) reducer->arm(sync, {loss});
    loss.backward();
    return loss.detach();
  };
  // For tests only, never set otherwise (docs/mgtrain.md): MGTRAIN_TEST_UNAPPLIED_STEP=K:R
  // makes rank R leave step K unapplied once, as if its gradient all-reduce had failed
  // after its peers' completed (a peer lost at the very end of the exchange): the step is
  // then applied on some ranks only.
  int unapplied_rank = -1;
  long long unapplied_step = -1;
  if (const char* t = std::getenv("MGTRAIN_TEST_UNAPPLIED_STEP"); t && recovery)
    if (std::sscanf(t, "%lld:%d", &unapplied_step, &unapplied_rank) != 2) unapplied_rank = -1;
  auto finish_step = [&] {
    if (reducer) reducer->finish();
    if (comm.rank == unapplied_rank && state.step + 1 == unapplied_step) {
      unapplied_rank = -1;
      throw CollectiveError(fmt::format("MGTRAIN_TEST_UNAPPLIED_STEP: rank {} leaves step {} unapplied", comm.rank, unapplied_step));
    }
    if (o.clip_grad_norm > 0) torch::nn::utils::clip_grad_norm_(params, o.clip_grad_norm);
    opt.step();
  };
  std::unique_ptr<StepGraph> graph;
  if (o.cuda_graphs) {
    if (sampler->num_samples() < o.batch_size)
      throw UsageError(fmt::format("--cuda-graphs: no full batch of {} fits in this rank's {} samples; use a smaller "
                                   "--batch-size", o.batch_size, sampler->num_samples()));
    graph = std::make_unique<StepGraph>(comm.device, o.batch_size);
  }
  auto graph_step = [&](const torch::Tensor& bi) {
    reset_grads();
    auto loss = forward_backward(bi, 1, true);
    finish_step();
    return loss;
  };

  auto t_start = clock::now();
  const double cpu_start = cpu_seconds();
  std::int64_t samples_done = 0, steps_this_run = 0;
  double last_loss = 0, test_acc = 0;
  std::int64_t measured_epoch = 0;  // the epoch test_acc was measured after; 0: none finished
  std::string stop_checkpoint;      // rank 0: the checkpoint written when a signal stopped it
  // Losses stay on the device until a line or the summary needs them: no per-step sync.
  torch::Tensor last_loss_t, loss_sum_t = torch::zeros({}, torch::TensorOptions().dtype(torch::kDouble).device(comm.device));
  auto stop_flag = torch::zeros({1}, torch::TensorOptions().dtype(torch::kFloat).device(comm.device));
  bool stopped = false;
  // In-place recovery: the failure being recovered from, until the first step after it.
  struct Pending {
    clock::time_point detected;
    std::int64_t step = 0;
    std::string lost;
  };
  std::optional<Pending> pending;
  nlohmann::json recoveries = nlohmann::json::array();
  // From `state` to the end of training; a collective that fails leaves `state` at the
  // last step this rank applied, so a rerun of the loop redoes the interrupted step.
  auto train_loop = [&] {
  for (std::int64_t epoch = state.epoch; epoch < o.epochs && state.step < total_steps && !stopped; ++epoch) {
    sampler->set_epoch(epoch, epoch == state.epoch ? state.epoch_offset : 0);
    micro_per_epoch = micro_batches(sampler->num_samples());
    auto idx_all = sampler->indices();
    auto idx = torch::from_blob(idx_all.data(), {static_cast<std::int64_t>(idx_all.size())}, torch::kLong).to(comm.device);
    model.module->train();
    loss_sum_t.zero_();
    std::int64_t loss_n = 0;
    std::int64_t micro = epoch == state.epoch ? state.batch_in_epoch : 0;
    while (micro < micro_per_epoch && state.step < total_steps) {
      if (interrupt && interrupt->fired.load()) throw Interrupted("the agent paused this worker between steps");
      const std::int64_t first = micro * o.batch_size;
      if (graph && first + o.batch_size <= idx.size(0)) {
        // A full batch through the graph (an epoch's last, partial batch runs eagerly below).
        last_loss_t = graph->run(idx.slice(0, first, first + o.batch_size), graph_step);
        samples_done += o.batch_size * comm.world;
        ++micro;
      } else {
        reset_grads();
        torch::Tensor loss_acc = torch::zeros({}, comm.device);
        const std::int64_t k_end = std::min<std::int64_t>(micro + o.grad_accum, micro_per_epoch);
        const std::int64_t k_n = k_end - micro;
        for (; micro < k_end; ++micro) {
          const std::int64_t b0 = micro * o.batch_size;
          const std::int64_t b1 = std::min<std::int64_t>(b0 + o.batch_size, idx.size(0));
          loss_acc += forward_backward(idx.slice(0, b0, b1), k_n, micro + 1 == k_end);
          samples_done += (b1 - b0) * comm.world;
        }
        finish_step();
        last_loss_t = loss_acc;
      }
      loss_sum_t += last_loss_t;
      ++state.step;
      ++steps_this_run;
      ++loss_n;
      state.epoch = epoch;
      state.batch_in_epoch = micro;
      if (pending) {
        const double secs = std::chrono::duration<double>(clock::now() - pending->detected).count();
        recoveries.push_back({{"step", pending->step}, {"seconds", secs}, {"lost", pending->lost}});
        if (lead) std::printf("mgtrain: recovered in %.3f s: step %lld redone\n", secs, static_cast<long long>(pending->step));
        std::fflush(stdout);
        pending.reset();
      }

      if (o.fail_at_step >= 0 && state.step == o.fail_at_step && comm.rank == o.fail_rank) {
        const char* restarts = std::getenv("TORCHELASTIC_RESTART_COUNT");
        if (!restarts || std::atoi(restarts) == 0) {
          write_error_file(fmt::format("injected failure at step {} on rank {}", state.step, comm.rank));
          std::fflush(stdout);
          if (o.fail_signal > 0) {
            std::signal(o.fail_signal, SIG_DFL);
            std::raise(o.fail_signal);
          }
          std::_Exit(1);
        }
      }
      // Every rank learns of a stop request at the same step: ranks compare notes every
      // kStopCheckEvery steps (a collective per step would cost ~4% of a CPU step).
      bool stop_now = false;
      if (state.step % kStopCheckEvery == 0 || state.step == total_steps) {
        stop_flag.fill_(g_stop_signal.load() ? 1.0 : 0.0);
        comm.allreduce_sum(stop_flag);
        stop_now = stop_flag.item<float>() > 0;
      }
      const bool periodic = o.checkpoint_every > 0 && state.step % o.checkpoint_every == 0;
      if (!o.checkpoint_dir.empty() && (periodic || stop_now)) {
        broadcast_buffers();  // the checkpoint holds the buffers every rank's next forward gets
        Position c = state;
        if (c.batch_in_epoch >= micro_per_epoch) {
          c.batch_in_epoch = 0;
          c.epoch_offset = 0;
          ++c.epoch;
        }
        if (lead) {
          save_checkpoint(with_rank(o.checkpoint_dir, comm.rank), *model.module, opt, c);
          if (stop_now) stop_checkpoint = checkpoint_file(with_rank(o.checkpoint_dir, comm.rank));
        }
      }
      if (stop_now) {
        stopped = true;
        break;
      }
      if (lead && o.log_every > 0 && state.step % o.log_every == 0) {
        last_loss = last_loss_t.item<double>();
        const double secs = std::chrono::duration<double>(clock::now() - t_start).count();
        const double sps = static_cast<double>(samples_done) / std::max(secs, 1e-9);
        const double eta = static_cast<double>(total_steps - state.step) * secs /
                           static_cast<double>(std::max<std::int64_t>(1, steps_this_run));
        std::printf("epoch %lld/%d step %lld/%lld loss %.4f samples/s %.0f eta %.0fs\n", static_cast<long long>(epoch + 1),
                    o.epochs, static_cast<long long>(state.step), static_cast<long long>(total_steps), last_loss, sps, eta);
        std::fflush(stdout);
      }
    }
    if (stopped) break;
    // Test accuracy over every rank's disjoint shard of the test set, with rank 0's buffers.
    broadcast_buffers();
    model.module->eval();
    torch::NoGradGuard ng;
    auto shard =
        torch::arange(comm.rank, test_set.size(), comm.world, torch::TensorOptions().dtype(torch::kLong)).to(comm.device);
    double correct = 0;
    for (std::int64_t b = 0; b < shard.size(0); b += 1000) {
      auto bi = shard.slice(0, b, std::min<std::int64_t>(b + 1000, shard.size(0)));
      correct += model.forward(test_x.index_select(0, bi)).argmax(1).eq(test_y.index_select(0, bi)).sum().item<double>();
    }
    const double loss_sum = loss_sum_t.item<double>();
    auto acc = torch::tensor({correct, static_cast<double>(shard.size(0)), loss_sum, static_cast<double>(loss_n)},
                             torch::TensorOptions().dtype(torch::kDouble))
                   .to(comm.device);
    comm.allreduce_sum(acc);
    acc = acc.to(torch::kCPU);
    test_acc = acc[0].item<double>() / std::max(1.0, acc[1].item<double>());
    measured_epoch = epoch + 1;
    if (lead) {
      std::printf("epoch %lld/%d train loss %.4f test accuracy %.4f\n", static_cast<long long>(epoch + 1), o.epochs,
                  acc[2].item<double>() / std::max(1.0, acc[3].item<double>()), test_acc);
      std::fflush(stdout);
    }
    state.batch_in_epoch = 0;
    state.epoch_offset = 0;
    state.epoch = epoch + 1;
  }
  broadcast_buffers();  // the final model is the one the next forward would see
  };

  // A lost peer with --in-place-recovery: wait for the agent's pause (bounded), let go of
  // the group, take the new round's assignment, build a new group under its store prefix
  // and agree on the state; the loop then redoes the interrupted step.
  // A recovery that failed part-way (a peer lost again while the group formed) is tried
  // again, on the next pause, and counts from the first detection.
  std::optional<clock::time_point> unrecovered;
  int attempts = 0;
  std::int64_t attempts_at = -1;
  // Waits for the agent in slices, so SIGTERM/SIGUSR1 (the agent stopping the job) ends
  // the wait at once: nullopt then, with `stopped` set.
  auto wait_for = [&](auto&& wait_once) -> decltype(wait_once(std::chrono::milliseconds(0))) {
    const auto end = clock::now() + std::chrono::seconds(o.timeout_s);
    for (;;) {
      if (g_stop_signal.load()) {
        stopped = true;
        return std::nullopt;
      }
      if (auto got = wait_once(std::chrono::milliseconds(100))) return got;
      if (clock::now() >= end || !control->closed_reason().empty()) return std::nullopt;
    }
  };
  auto recover = [&](const std::string& what) {
    const auto failed_at = clock::now();
    // At most kRecoveryAttempts in a row that reach no new state (each wait bounded by --timeout).
    if (state.step != attempts_at) attempts = 0, attempts_at = state.step;
    if (++attempts > kRecoveryAttempts)
      throw std::runtime_error(fmt::format("{} (in-place recovery: {} attempts in a row at step {} failed)", what,
                                           kRecoveryAttempts, static_cast<long long>(state.step)));
    auto pause = wait_for([&](std::chrono::milliseconds t) { return control->wait_pause(t); });
    if (stopped) return;
    if (!pause) {
      const std::string closed = control->closed_reason();
      throw std::runtime_error(fmt::format("{} (in-place recovery: no pause from the agent within {} s{})", what,
                                           o.timeout_s, closed.empty() ? "" : ": " + closed));
    }
    unrecovered = std::min({unrecovered.value_or(failed_at), failed_at, pause->at});
    control->send_paused(state.step);
    if (reducer) reducer->abandon();
    reducer.reset();
    comm.abandon();
    auto next = wait_for([&](std::chrono::milliseconds t) { return control->wait_assign(t); });
    if (stopped) return;
    if (!next) {
      const std::string closed = control->closed_reason();
      throw std::runtime_error(fmt::format("in-place recovery: no assignment from the agent within {} s of its pause ({}){}",
                                           o.timeout_s, pause->reason, closed.empty() ? "" : ": " + closed));
    }
    for (const auto& [k, v] : next->env) ::setenv(k.c_str(), v.c_str(), 1);
    const Env env = read_env(process_env());
    try {
      // A pause while the group forms (a peer lost again) or a stop signal ends the wait at
      // once: the next round, not this one's --timeout.
      comm = connect_interruptible(o, env, [&] {
        return interrupt->fired.load() || g_stop_signal.load() != 0 || !control->closed_reason().empty();
      });
    } catch (const Interrupted&) {
      throw;
    } catch (const std::exception& e) {
      // The store out of reach too (its host lost): a later round may name another.
      std::string w = e.what();
      throw CollectiveError("the new round's process group did not form: " + w.substr(0, w.find('\n')));
    }
    lead = comm.rank == 0;
    make_reducer();
    establish();
    // The source's optimizer carried its learning rate: the one of this world size.
    static_cast<torch::optim::SGDOptions&>(opt.param_groups()[0].options()).lr(lr_for(comm.world));
    reshard();
    pending = Pending{pending ? std::min(pending->detected, *unrecovered) : *unrecovered, state.step + 1, pause->lost};
    unrecovered.reset();
    if (lead)
      std::printf("mgtrain: in-place recovery, round %d (%s): world %d, redoing step %lld\n", next->round,
                  pause->reason.c_str(), comm.world, static_cast<long long>(state.step + 1));
    std::fflush(stdout);
  };
  std::string failure;
  for (;;) {
    try {
      if (!failure.empty()) recover(std::exchange(failure, std::string()));
      if (stopped) {  // stopped while waiting for the agent: no group to checkpoint through
        if (lead) std::printf("mgtrain: stopped by a signal while waiting for the agent's new round\n");
        break;
      }
      train_loop();
      break;
    } catch (const CollectiveError& e) {
      if (!recovery) throw;
      failure = e.what();
    } catch (const Interrupted& e) {
      if (!recovery) throw;
      failure = e.what();
    }
  }
  if (last_loss_t.defined()) last_loss = last_loss_t.item<double>();
  const double secs = std::chrono::duration<double>(clock::now() - t_start).count();
  const double sps = static_cast<double>(samples_done) / std::max(secs, 1e-9);
  // Every rank did the same work: samples of all ranks over (this rank's CPU time x world).
  const double sp_cpu = static_cast<double>(samples_done) / std::max((cpu_seconds() - cpu_start) * comm.world, 1e-9);
  const auto tensors = state_tensors(*model.module);
  const std::string digest = sha256_of(tensors);
  if (lead && !stopped) {
    std::printf("done: %lld steps, %.0f samples/s, %.0f per cpu-s, test accuracy %.4f, weights sha256 %s\n",
                static_cast<long long>(state.step), sps, sp_cpu, test_acc, digest.c_str());
    std::fflush(stdout);
  } else if (lead) {
    // Stopped by a signal: what was saved and where, and only an accuracy that was measured.
    const int sig = g_stop_signal.load();
    const char* abbrev = sig > 0 ? ::sigabbrev_np(sig) : nullptr;
    const std::string saved =
        !stop_checkpoint.empty()
            ? fmt::format("checkpoint written to {} (a rerun with --checkpoint-dir {} resumes from it)", stop_checkpoint,
                          o.checkpoint_dir)
            : o.checkpoint_dir.empty() ? std::string("no checkpoint written (no --checkpoint-dir)")
                                       : std::string("no checkpoint written (stopped while waiting for the agent)");
    const std::string accuracy =
        measured_epoch > 0 ? fmt::format("test accuracy {:.4f} after epoch {}", test_acc, measured_epoch)
                           : std::string("test accuracy not measured (no epoch finished)");
    std::printf("stopped by %s at step %lld: %s; %.0f samples/s, %s, weights sha256 %s\n",
                abbrev ? fmt::format("SIG{}", abbrev).c_str() : "a signal", static_cast<long long>(state.step),
                saved.c_str(), sps, accuracy.c_str(), digest.c_str());
    std::fflush(stdout);
  }
  if (!o.summary_json.empty()) {
    nlohmann::json j = {{"rank", comm.rank},
                        {"world_size", comm.world},
                        {"backend", comm.backend},
                        {"mode", comm.distributed() ? "ddp" : "single"},
                        {"steps", state.step},
                        {"epochs", o.epochs},
                        {"final_train_loss", last_loss},
                        {"test_accuracy", measured_epoch > 0 ? nlohmann::json(test_acc) : nlohmann::json()},
                        {"checkpoint_at_stop", stop_checkpoint.empty() ? nlohmann::json() : nlohmann::json(stop_checkpoint)},
                        {"samples_per_sec", sps},
                        {"samples_per_cpu_sec", sp_cpu},
                        {"restart_count", std::getenv("TORCHELASTIC_RESTART_COUNT") ? std::atoi(std::getenv("TORCHELASTIC_RESTART_COUNT")) : 0},
                        {"weights_sha256", digest},
                        {"params_sha256", sha256_of(params)},
                        {"stopped_by_signal", stopped},
                        {"cuda_graphs", graph && graph->captured()},
                        {"recoveries", recoveries}};
    std::ofstream(with_rank(o.summary_json, comm.rank)) << j.dump(2) << "\n";
  }
  if (!o.save_weights.empty()) {
    const std::string path = with_rank(o.save_weights, comm.rank);
    if (lead || path != o.save_weights) {
      std::ofstream out(path, std::ios::binary);
      for (const auto& p : tensors) {
        auto c = p.detach().to(torch::kCPU).to(torch::kFloat).contiguous();
        out.write(static_cast<const char*>(c.data_ptr()), static_cast<std::streamsize>(c.numel() * sizeof(float)));
      }
    }
  }
  return stopped ? kExitStopped : 0;
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
  // A standby node's pre-started worker (mglaunch --prestart-standby): no rank until the
  // agent's assign; only with --in-place-recovery, which waits for it.
  const char* standby_var = std::getenv(kStandbyVar);
  const bool standby = standby_var && std::string_view(standby_var) == "1";
  if (standby && !o.in_place_recovery)
    throw UsageError(fmt::format("{}=1 (a standby's pre-started worker, mglaunch --prestart-standby) needs "
                                 "--in-place-recovery: without it mgtrain cannot wait for its place",
                                 kStandbyVar));
  if (standby && o.model == "mlp-rank-branch")
    throw UsageError(fmt::format("{}=1: --model mlp-rank-branch is built for its rank, which a pre-started worker "
                                 "does not know yet; leave out --prestart-standby",
                                 kStandbyVar));
  // In-place recovery lives through a peer's death: the agents' value (torchrun's and
  // ours: TORCH_NCCL_ASYNC_ERROR_HANDLING=1) and torch 2.x's default (3) take the whole
  // process down on an NCCL error; 2 aborts the communicators and lets the failed
  // collective throw. Set here, once, before any thread (the control channel's, a group's)
  // may read the environment: a setenv beside a getenv is a data race.
  if (o.in_place_recovery) ::setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2", 1);
  const Mode mode = standby ? Mode::ddp : resolve_mode(o, env);
  if (o.threads > 0) torch::set_num_threads(o.threads);
  // --in-place-recovery: the agent's control channel, connected before the group.
  std::shared_ptr<Interrupt> interrupt;
  std::unique_ptr<ControlChannel> control;
  if (o.in_place_recovery) {
    const char* name = std::getenv("MGLAUNCH_CONTROL_SOCKET");
    std::string off;
    if (mode == Mode::single) {
      off = "a single process has no peer to lose";
    } else if (!name || !*name) {
      off = "no MGLAUNCH_CONTROL_SOCKET (the launcher offers no control channel)";
    } else {
      try {
        interrupt = std::make_shared<Interrupt>();
        control = std::make_unique<ControlChannel>(name, env.local_rank, interrupt, std::chrono::seconds(10), standby);
        set_interrupt(interrupt);
      } catch (const std::exception& e) {
        off = e.what();
        interrupt.reset();
      }
    }
    if (!off.empty() && standby)
      throw SetupError(fmt::format("a standby's pre-started worker ({}=1) needs the control channel: {}", kStandbyVar, off));
    if (!off.empty() && env.rank == 0)
      std::fprintf(stderr, "mgtrain: --in-place-recovery: %s: recovery is off, training goes on as usual\n", off.c_str());
  }
  Comm comm = mode == Mode::single ? local_comm(o) : standby ? unplaced_comm(o, env) : connect(o, env);
  const int code =
      o.bench == "allreduce" ? run_allreduce_bench(o, comm) : train(o, comm, control.get(), interrupt.get(), standby);
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
