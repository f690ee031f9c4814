// mgtrain: a LibTorch data-parallel trainer on c10d (Gloo on CPU, NCCL on GPU builds).
// It reads the torchrun environment contract (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
// MASTER_PORT), trains an MLP or a small CNN on Fashion-MNIST (or a synthetic set) with
// gradients all-reduced in buckets launched from autograd hooks during backward, and
// checkpoints/resumes. This is the only translation unit that includes torch.
#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <optional>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <openssl/sha.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
// pip/conda LibTorch ships no Gloo headers: such builds (the CUDA ones) use NCCL only.
#if __has_include(<gloo/algorithm.h>)
#define MGLAUNCH_WITH_GLOO 1
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#endif
#include <torch/torch.h>
#include <torch/version.h>
#ifdef MGLAUNCH_WITH_NCCL
#include <ATen/autocast_mode.h>
#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include "worker/data.h"

namespace {

namespace data = mg::data;

#if TORCH_VERSION_MAJOR >= 2
using PG = c10d::Backend;
#else
using PG = c10d::ProcessGroup;
#endif

// Exit codes (README): 0 done; 1 failure (incl. injected); 2 usage; 3 setup error
// (data, master unreachable, backend); 75 stopped on SIGTERM/SIGUSR1 after checkpointing.
constexpr int kExitUsage = 2, kExitSetup = 3, kExitStopped = 75;
constexpr std::int64_t kStopCheckEvery = 8;

struct SetupError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

std::atomic<int> g_stop_signal{0};
extern "C" void on_stop_signal(int sig) { g_stop_signal.store(sig); }

struct Options {
  std::string backend = "auto", dataset = "fashion-mnist", data_dir = "/usr/share/datasets/fashion-mnist";
  std::string model = "cnn", lr_scaling = "none", comm_dtype = "fp32", summary_json, checkpoint_dir, save_weights;
  std::string bench;
  std::int64_t synthetic_size = 8192, train_subset = -1, test_subset = -1, max_steps = -1;
  int epochs = 1, batch_size = 64, grad_accum = 1, log_every = 100, checkpoint_every = 0, threads = 0;
  int fail_at_step = -1, fail_rank = 0, fail_signal = 0, timeout_s = 300;
  double lr = 0.02, momentum = 0.9, clip_grad_norm = 0, bucket_cap_mb = 25;
  std::uint64_t seed = 1;
  bool amp = false, shuffle = true, channels_last = true;
  // --bench allreduce
  std::string min_bytes = "8", max_bytes = "64M", dtype = "float";
  double step_factor = 2;
  int iters = 20, warmup = 5;
};

struct Env {
  int rank = 0, world = 1, local_rank = 0, restart_count = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 0;
};

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::atoi(v) : fallback;
}

std::int64_t parse_bytes(const std::string& text) {
  std::size_t pos = 0;
  double v = std::stod(text, &pos);
  std::string unit = text.substr(pos);
  std::int64_t mult = unit.empty() || unit == "B" ? 1 : unit == "K" ? 1 << 10 : unit == "M" ? 1 << 20 : unit == "G" ? 1 << 30 : -1;
  if (mult < 0 || v < 0) throw CLI::ValidationError("bad byte size '" + text + "': use N, NK, NM or NG");
  return static_cast<std::int64_t>(v * mult);
}

// ---- models ---------------------------------------------------------------------------

struct MlpImpl : torch::nn::Module {
  MlpImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(784, 256));
    fc2 = register_module("fc2", torch::nn::Linear(256, 128));
    fc3 = register_module("fc3", torch::nn::Linear(128, 10));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = torch::relu(fc1(x.flatten(1)));
    return fc3(torch::relu(fc2(x)));
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, fc3{nullptr};
};

// The seed guides' small convnet: two 3x3 convs (16, 32), max-pool, FC 128, FC 10.
struct CnnImpl : torch::nn::Module {
  CnnImpl() {
    conv1 = register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 16, 3)));
    conv2 = register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(16, 32, 3)));
    fc1 = register_module("fc1", torch::nn::Linear(32 * 12 * 12, 128));
    fc2 = register_module("fc2", torch::nn::Linear(128, 10));
  }
  // max-pool and ReLU commute (both monotone), so pooling first gives the same values
  // with a quarter of the ReLU work; in-place ReLUs save allocations.
  torch::Tensor forward(torch::Tensor x) {
    x = conv1(x).relu_();
    x = torch::max_pool2d(conv2(x), 2).relu_();
    return fc2(fc1(x.flatten(1)).relu_());
  }
  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr};
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};

// ---- mixed precision --------------------------------------------------------------------

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

// ---- gradient buckets -----------------------------------------------------------------

// Parameters grouped (in reverse registration order, the order backward produces them)
// into flat buckets of at most cap bytes. A bucket's all-reduce is launched from the
// autograd hook of its last parameter to become ready, so communication overlaps the rest
// of backward; finish() waits for all of them and writes the averaged gradients back.
class GradBuckets {
 public:
  GradBuckets(std::vector<torch::Tensor> params, c10::intrusive_ptr<PG> pg, int world, double cap_mb,
              torch::ScalarType comm_dtype)
      : params_(std::move(params)), pg_(std::move(pg)), world_(world), comm_dtype_(comm_dtype) {
    // Like DDP, the first bucket (the last layers, whose gradients come first) is small so
    // its all-reduce starts early and overlaps the rest of backward.
    const std::int64_t cap = std::max<std::int64_t>(1, static_cast<std::int64_t>(cap_mb * 1024 * 1024));
    const std::int64_t first_cap = std::min<std::int64_t>(cap, 1 << 20);
    std::int64_t bytes = 0;
    for (int i = static_cast<int>(params_.size()) - 1; i >= 0; --i) {
      const std::int64_t b = params_[i].numel() * params_[i].element_size();
      const std::int64_t limit = buckets_.size() <= 1 ? first_cap : cap;
      if (buckets_.empty() || (bytes + b > limit && !buckets_.back().members.empty())) {
        buckets_.push_back({});
        bytes = 0;
      }
      auto& bk = buckets_.back();
      slot_.resize(params_.size());
      slot_[i] = {static_cast<int>(buckets_.size()) - 1, bk.numel};
      bk.members.push_back(i);
      bk.numel += params_[i].numel();
      bytes += b;
    }
    for (auto& bk : buckets_) bk.flat = torch::zeros({bk.numel}, params_[0].options());
    for (std::size_t i = 0; i < params_.size(); ++i) {
      params_[i].register_hook([this, i](torch::Tensor grad) { on_grad(static_cast<int>(i), grad); });
    }
  }

  std::size_t bucket_count() const { return buckets_.size(); }
  // Whether this backward's gradients are to be synchronised (false on accumulation steps).
  void arm(bool sync) {
    sync_ = sync;
    for (auto& bk : buckets_) {
      bk.pending = static_cast<int>(bk.members.size());
      bk.work.reset();
    }
  }

  void finish() {
    if (!sync_) return;
    for (std::size_t b = 0; b < buckets_.size(); ++b)
      if (!buckets_[b].work) launch(static_cast<int>(b));  // a parameter without gradient
    for (auto& bk : buckets_) {
      bk.work->wait();
      torch::Tensor reduced = bk.comm.scalar_type() == bk.flat.scalar_type() ? bk.comm : bk.comm.to(bk.flat.scalar_type());
      for (int i : bk.members) {
        auto& p = params_[i];
        auto view = reduced.narrow(0, slot_[i].offset, p.numel()).view_as(p);
        if (p.grad().defined())
          p.mutable_grad().copy_(view);
        else
          p.mutable_grad() = view.clone();
      }
    }
    sync_ = false;
  }

 private:
  struct Bucket {
    std::vector<int> members;
    std::int64_t numel = 0;
    torch::Tensor flat, comm;
    int pending = 0;
    c10::intrusive_ptr<c10d::Work> work;
  };
  struct Slot {
    int bucket = 0;
    std::int64_t offset = 0;
  };

  void on_grad(int i, const torch::Tensor& grad) {
    if (!sync_) return;
    auto& p = params_[i];
    auto& bk = buckets_[slot_[i].bucket];
    auto dst = bk.flat.narrow(0, slot_[i].offset, p.numel());
    // The hook runs before autograd adds `grad` into p.grad(): include what earlier
    // accumulation micro-steps left there.
    if (p.grad().defined())
      torch::add_out(dst, p.grad().reshape({-1}), grad.reshape({-1}));
    else
      dst.copy_(grad.reshape({-1}));
    if (--bk.pending == 0) launch(slot_[i].bucket);
  }

  void launch(int b) {
    auto& bk = buckets_[b];
    torch::NoGradGuard no_grad;
    bk.comm = bk.flat.div(world_);
    if (comm_dtype_ != bk.flat.scalar_type()) bk.comm = bk.comm.to(comm_dtype_);
    std::vector<torch::Tensor> tensors{bk.comm};
    bk.work = pg_->allreduce(tensors);
  }

  std::vector<torch::Tensor> params_;
  c10::intrusive_ptr<PG> pg_;
  int world_;
  torch::ScalarType comm_dtype_;
  std::vector<Bucket> buckets_;
  std::vector<Slot> slot_;
  bool sync_ = false;
};

// ---- helpers --------------------------------------------------------------------------

void allreduce_sum(PG& pg, torch::Tensor& t) {
  std::vector<torch::Tensor> v{t};
  pg.allreduce(v)->wait();
}

std::string sha256_of_params(const std::vector<torch::Tensor>& params) {
  SHA256_CTX ctx;
  SHA256_Init(&ctx);
  for (const auto& p : params) {
    auto c = p.detach().to(torch::kCPU).contiguous();
    SHA256_Update(&ctx, c.data_ptr(), c.numel() * c.element_size());
  }
  unsigned char md[SHA256_DIGEST_LENGTH];
  SHA256_Final(md, &ctx);
  std::string hex;
  for (unsigned char ch : md) hex += fmt::format("{:02x}", ch);
  return hex;
}

void fsync_path(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
}

void write_error_file(const std::string& message) {
  const char* path = std::getenv("TORCHELASTIC_ERROR_FILE");
  if (!path || !*path) return;
  nlohmann::json j = {{"message",
                       {{"message", message},
                        {"extraInfo", {{"py_callstack", "mgtrain (C++)"}, {"timestamp", std::to_string(std::time(nullptr))}}}}}};
  std::ofstream(path) << j.dump();
}

struct Checkpoint {
  std::int64_t step = 0;  // optimizer steps done
  std::int64_t epoch = 0;
  std::int64_t batch_in_epoch = 0;  // micro-batches of `epoch` already consumed
};

std::string checkpoint_path(const Options& o) { return o.checkpoint_dir + "/checkpoint.pt"; }

void save_checkpoint(const Options& o, torch::nn::Module& model, torch::optim::Optimizer& opt, const Checkpoint& c) {
  std::filesystem::create_directories(o.checkpoint_dir);
  torch::serialize::OutputArchive ar;
  model.save(ar);
  torch::serialize::OutputArchive opt_ar;
  opt.save(opt_ar);
  ar.write("optimizer", opt_ar);
  ar.write("step", torch::tensor(c.step));
  ar.write("epoch", torch::tensor(c.epoch));
  ar.write("batch_in_epoch", torch::tensor(c.batch_in_epoch));
  at::Generator gen = at::detail::getDefaultCPUGenerator();
  ar.write("rng", gen.get_state());
  const std::string tmp = checkpoint_path(o) + ".tmp";
  ar.save_to(tmp);
  fsync_path(tmp);
  std::filesystem::rename(tmp, checkpoint_path(o));
  fsync_path(o.checkpoint_dir);
}

std::optional<Checkpoint> load_checkpoint(const Options& o, torch::nn::Module& model, torch::optim::Optimizer& opt,
                                          const torch::Device& device) {
  if (o.checkpoint_dir.empty() || !std::filesystem::exists(checkpoint_path(o))) return std::nullopt;
  torch::serialize::InputArchive ar;
  ar.load_from(checkpoint_path(o), device);
  model.load(ar);
  torch::serialize::InputArchive opt_ar;
  ar.read("optimizer", opt_ar);
  opt.load(opt_ar);
  auto read_int = [&ar](const char* key) {
    torch::Tensor t;  // a fresh tensor per key: read() cannot re-seat one that holds storage
    ar.read(key, t);
    return t.item<std::int64_t>();
  };
  Checkpoint c;
  c.step = read_int("step");
  c.epoch = read_int("epoch");
  c.batch_in_epoch = read_int("batch_in_epoch");
  torch::Tensor rng;
  ar.read("rng", rng);
  at::Generator gen = at::detail::getDefaultCPUGenerator();
  gen.set_state(rng);
  return c;
}

// ---- process group --------------------------------------------------------------------

struct Comm {
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<PG> pg;
  std::string backend;
  torch::Device device{torch::kCPU};
  std::function<void()> shutdown = [] {};  // orderly teardown where the backend has one
};

// Calls pg.shutdown() on LibTorch versions whose backend has it (NCCL in torch >= 2.4).
template <typename T>
void shutdown_if_supported(T& pg) {
  if constexpr (requires { pg.shutdown(); }) pg.shutdown();
}

Comm connect(const Options& o, const Env& env) {
  Comm c;
  bool cuda = false;
#ifdef MGLAUNCH_WITH_NCCL
  cuda = torch::cuda::is_available();
#endif
  if (o.backend == "nccl" && !cuda)
    throw SetupError("--backend nccl needs a CUDA build of mgtrain and a visible GPU; use --backend gloo");
  c.backend = o.backend == "auto" ? (cuda ? "nccl" : "gloo") : o.backend;
  c10d::TCPStoreOptions so;
  so.port = static_cast<std::uint16_t>(env.master_port);
  so.isServer = env.rank == 0;
  so.numWorkers = env.world;
  so.waitWorkers = false;
  so.timeout = std::chrono::seconds(o.timeout_s);
  try {
    c.store = c10::make_intrusive<c10d::TCPStore>(env.master_addr, so);
  } catch (const std::exception& e) {
    std::string what = e.what();
    throw SetupError(fmt::format("cannot {} the c10d store at {}:{} within {} s: {}", env.rank == 0 ? "serve" : "reach",
                                 env.master_addr, env.master_port, o.timeout_s, what.substr(0, what.find('\n'))));
  }
  if (c.backend == "gloo") {
#ifndef MGLAUNCH_WITH_GLOO
    throw SetupError("this mgtrain was built without Gloo headers (pip/conda LibTorch); use --backend nccl");
#else
    auto opts = c10d::ProcessGroupGloo::Options::create();
    opts->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
    opts->timeout = std::chrono::seconds(o.timeout_s);
    c.pg = c10::make_intrusive<c10d::ProcessGroupGloo>(c.store, env.rank, env.world, opts);
#endif
  } else {
#ifdef MGLAUNCH_WITH_NCCL
    const int devices = static_cast<int>(torch::cuda::device_count());
    const int dev = env.local_rank % std::max(1, devices);
    c10::cuda::set_device(dev);
    c.device = torch::Device(torch::kCUDA, dev);
    auto opts = c10d::ProcessGroupNCCL::Options::create();
    auto nccl = c10::make_intrusive<c10d::ProcessGroupNCCL>(c.store, env.rank, env.world, opts);
    c.shutdown = [nccl] { shutdown_if_supported(*nccl); };
    c.pg = nccl;
#endif
  }
  return c;
}

// ---- allreduce benchmark (nccl-tests columns) -----------------------------------------

int run_bench(const Options& o, const Env& env, Comm& comm) {
  const torch::ScalarType dtype = o.dtype == "float" ? torch::kFloat : o.dtype == "double" ? torch::kDouble
                                  : o.dtype == "half"   ? torch::kHalf
                                  : o.dtype == "int"    ? torch::kInt
                                                        : throw SetupError("--dtype: use float, double, half or int");
  const std::int64_t esize = c10::elementSize(dtype);
  const std::int64_t lo = std::max<std::int64_t>(esize, parse_bytes(o.min_bytes)), hi = parse_bytes(o.max_bytes);
  if (env.rank == 0) {
    std::printf("# mgtrain allreduce benchmark: backend %s, world %d, %d iters after %d warm-up\n",
                comm.backend.c_str(), env.world, o.iters, o.warmup);
    std::printf("%12s %12s %8s %12s %10s %10s %8s\n", "size(B)", "count", "type", "time(us)", "algbw(GB/s)", "busbw(GB/s)",
                "#wrong");
  }
  auto sync = [&] {
#ifdef MGLAUNCH_WITH_NCCL
    if (comm.device.is_cuda()) torch::cuda::synchronize();
#endif
  };
  long total_wrong = 0;
  for (std::int64_t bytes = lo; bytes <= hi;
       bytes = std::max<std::int64_t>(bytes + esize, static_cast<std::int64_t>(bytes * o.step_factor))) {
    const std::int64_t count = bytes / esize;
    auto t = torch::ones({count}, torch::TensorOptions().dtype(dtype).device(comm.device));
    std::vector<torch::Tensor> v{t};
    for (int i = 0; i < o.warmup; ++i) comm.pg->allreduce(v)->wait();
    sync();
    comm.pg->barrier()->wait();
    auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < o.iters; ++i) comm.pg->allreduce(v)->wait();
    sync();
    const double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / o.iters;
    // Correctness: rank r contributes r+1, so every element must be world*(world+1)/2.
    t.fill_(env.rank + 1);
    comm.pg->allreduce(v)->wait();
    sync();
    const double expect = env.world * (env.world + 1) / 2.0;
    long wrong = t.to(torch::kCPU).to(torch::kDouble).ne(expect).sum().item<long>();
    total_wrong += wrong;
    const double algbw = bytes / us / 1e3;
    const double busbw = algbw * 2.0 * (env.world - 1) / env.world;
    if (env.rank == 0)
      std::printf("%12lld %12lld %8s %12.1f %10.3f %10.3f %8ld\n", static_cast<long long>(bytes),
                  static_cast<long long>(count), o.dtype.c_str(), us, algbw, busbw, wrong);
  }
  std::fflush(stdout);
  return total_wrong == 0 ? 0 : 1;
}

// ---- training -------------------------------------------------------------------------

int train(const Options& o, const Env& env, Comm& comm) {
  using clock = std::chrono::steady_clock;
  const bool lead = env.rank == 0;
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
  std::shared_ptr<torch::nn::Module> model;
  std::function<torch::Tensor(torch::Tensor)> forward;
  if (o.model == "mlp") {
    auto m = std::make_shared<MlpImpl>();
    forward = [m](torch::Tensor x) { return m->forward(x); };
    model = m;
  } else {
    auto m = std::make_shared<CnnImpl>();
    forward = [m](torch::Tensor x) { return m->forward(x); };
    model = m;
  }
  model->to(comm.device);
  std::vector<torch::Tensor> params = model->parameters();
  if (o.model == "cnn" && o.channels_last) {
    // NHWC lets oneDNN run the convolutions and the max-pool without layout conversions
    // (1.4x faster on CPU here); the model and its results are unchanged.
    torch::NoGradGuard ng;
    for (auto& p : params)
      if (p.dim() == 4) p.set_data(p.data().contiguous(at::MemoryFormat::ChannelsLast));
    train_x = train_x.contiguous(at::MemoryFormat::ChannelsLast);
    test_x = test_x.contiguous(at::MemoryFormat::ChannelsLast);
  }
  {
    torch::NoGradGuard ng;
    for (auto& p : params) {  // every rank starts from rank 0's weights
      std::vector<torch::Tensor> v{p};
      comm.pg->broadcast(v)->wait();
    }
  }
  const double scale = o.lr_scaling == "linear" ? env.world : o.lr_scaling == "sqrt" ? std::sqrt(env.world) : 1.0;
  torch::optim::SGD opt(params, torch::optim::SGDOptions(o.lr * scale).momentum(o.momentum));
  const auto comm_dtype = o.comm_dtype == "fp16" ? torch::kHalf : o.comm_dtype == "bf16" ? torch::kBFloat16 : torch::kFloat;
  GradBuckets buckets(params, comm.pg, env.world, o.bucket_cap_mb, comm_dtype);

  Checkpoint state;
  if (auto c = load_checkpoint(o, *model, opt, comm.device)) {
    state = *c;
    if (lead) std::printf("resumed from %s at step %lld (epoch %lld)\n", checkpoint_path(o).c_str(),
                          static_cast<long long>(state.step), static_cast<long long>(state.epoch + 1));
  }
  data::DistributedSampler sampler(train_set.size(), env.world, env.rank, o.shuffle, o.seed, false);
  const std::int64_t micro_per_epoch = (sampler.num_samples() + o.batch_size - 1) / o.batch_size;
  const std::int64_t steps_per_epoch = (micro_per_epoch + o.grad_accum - 1) / o.grad_accum;
  std::int64_t total_steps = steps_per_epoch * o.epochs;
  if (o.max_steps >= 0) total_steps = std::min(total_steps, o.max_steps);
  if (lead)
    std::printf("mgtrain: %s on %s, world %d, backend %s, %lld steps/epoch (batch %d x %d accum per rank), %zu buckets\n",
                o.model.c_str(), o.dataset.c_str(), env.world, comm.backend.c_str(),
                static_cast<long long>(steps_per_epoch), o.batch_size, o.grad_accum, buckets.bucket_count());

  auto t_start = clock::now();
  std::int64_t samples_done = 0, steps_this_run = 0;
  double last_loss = 0, test_acc = 0;
  auto stop_flag = torch::zeros({1}, torch::TensorOptions().dtype(torch::kFloat).device(comm.device));
  bool stopped = false;
  for (std::int64_t epoch = state.epoch; epoch < o.epochs && state.step < total_steps && !stopped; ++epoch) {
    sampler.set_epoch(epoch);
    auto idx_all = sampler.indices();
    auto idx = torch::from_blob(idx_all.data(), {static_cast<std::int64_t>(idx_all.size())}, torch::kLong).to(comm.device);
    model->train();
    double loss_sum = 0;
    std::int64_t loss_n = 0;
    std::int64_t micro = epoch == state.epoch ? state.batch_in_epoch : 0;
    while (micro < micro_per_epoch && state.step < total_steps) {
      for (auto& p : params) p.mutable_grad().reset();  // set_to_none: no memset, no extra add
      torch::Tensor loss_acc = torch::zeros({}, comm.device);
      const std::int64_t k_end = std::min<std::int64_t>(micro + o.grad_accum, micro_per_epoch);
      const std::int64_t k_n = k_end - micro;
      for (; micro < k_end; ++micro) {
        const std::int64_t b0 = micro * o.batch_size;
        const std::int64_t b1 = std::min<std::int64_t>(b0 + o.batch_size, idx.size(0));
        auto bi = idx.slice(0, b0, b1);
        auto x = train_x.index_select(0, bi), y = train_y.index_select(0, bi);
        torch::Tensor logits;
        {
          AutocastScope amp(o.amp);
          logits = forward(x);
        }
        auto loss = torch::nn::functional::cross_entropy(logits.to(torch::kFloat), y) / static_cast<double>(k_n);
        buckets.arm(micro + 1 == k_end);
        loss.backward();
        loss_acc += loss.detach();
        samples_done += (b1 - b0) * env.world;
      }
      buckets.finish();
      if (o.clip_grad_norm > 0) torch::nn::utils::clip_grad_norm_(params, o.clip_grad_norm);
      opt.step();
      ++state.step;
      ++steps_this_run;
      last_loss = loss_acc.item<double>();
      loss_sum += last_loss;
      ++loss_n;
      state.epoch = epoch;
      state.batch_in_epoch = micro;

      if (o.fail_at_step >= 0 && state.step == o.fail_at_step && env.rank == o.fail_rank && env.restart_count == 0) {
        write_error_file(fmt::format("injected failure at step {} on rank {}", state.step, env.rank));
        std::fflush(stdout);
        if (o.fail_signal > 0) {
          std::signal(o.fail_signal, SIG_DFL);
          std::raise(o.fail_signal);
        }
        std::_Exit(1);
      }
      // Every rank learns of a stop request at the same step: ranks compare notes every
      // kStopCheckEvery steps (a collective per step would cost ~4% of a CPU step).
      bool stop_now = false;
      if (state.step % kStopCheckEvery == 0 || state.step == total_steps) {
        stop_flag.fill_(g_stop_signal.load() ? 1.0 : 0.0);
        allreduce_sum(*comm.pg, stop_flag);
        stop_now = stop_flag.item<float>() > 0;
      }
      const bool periodic = o.checkpoint_every > 0 && state.step % o.checkpoint_every == 0;
      if (lead && !o.checkpoint_dir.empty() && (periodic || stop_now)) {
        Checkpoint c = state;
        if (c.batch_in_epoch >= micro_per_epoch) {
          c.batch_in_epoch = 0;
          ++c.epoch;
        }
        save_checkpoint(o, *model, opt, c);
      }
      if (stop_now) {
        stopped = true;
        break;
      }
      if (lead && o.log_every > 0 && state.step % o.log_every == 0) {
        const double secs = std::chrono::duration<double>(clock::now() - t_start).count();
        const double sps = samples_done / std::max(secs, 1e-9);
        const double eta = (total_steps - state.step) * secs / std::max<std::int64_t>(1, steps_this_run);
        std::printf("epoch %lld/%d step %lld/%lld loss %.4f samples/s %.0f eta %.0fs\n",
                    static_cast<long long>(epoch + 1), o.epochs, static_cast<long long>(state.step),
                    static_cast<long long>(total_steps), last_loss, sps, eta);
        std::fflush(stdout);
      }
    }
    if (stopped) break;
    // Test accuracy over every rank's disjoint shard of the test set.
    model->eval();
    torch::NoGradGuard ng;
    auto shard = torch::arange(env.rank, test_set.size(), env.world, torch::TensorOptions().dtype(torch::kLong)).to(comm.device);
    double correct = 0;
    for (std::int64_t b = 0; b < shard.size(0); b += 1000) {
      auto bi = shard.slice(0, b, std::min<std::int64_t>(b + 1000, shard.size(0)));
      correct += forward(test_x.index_select(0, bi)).argmax(1).eq(test_y.index_select(0, bi)).sum().item<double>();
    }
    auto acc = torch::tensor({correct, static_cast<double>(shard.size(0)), loss_sum, static_cast<double>(loss_n)},
                             torch::TensorOptions().dtype(torch::kDouble)).to(comm.device);
    allreduce_sum(*comm.pg, acc);
    acc = acc.to(torch::kCPU);
    test_acc = acc[0].item<double>() / std::max(1.0, acc[1].item<double>());
    if (lead) {
      std::printf("epoch %lld/%d train loss %.4f test accuracy %.4f\n", static_cast<long long>(epoch + 1), o.epochs,
                  acc[2].item<double>() / std::max(1.0, acc[3].item<double>()), test_acc);
      std::fflush(stdout);
    }
    state.batch_in_epoch = 0;
    state.epoch = epoch + 1;
  }
  const double secs = std::chrono::duration<double>(clock::now() - t_start).count();
  const double sps = samples_done / std::max(secs, 1e-9);
  const std::string digest = sha256_of_params(params);
  if (lead) {
    std::printf("done: %lld steps, %.0f samples/s, test accuracy %.4f, weights sha256 %s\n",
                static_cast<long long>(state.step), sps, test_acc, digest.c_str());
    std::fflush(stdout);
  }
  if (!o.summary_json.empty()) {
    std::string path = o.summary_json;
    if (auto p = path.find("{rank}"); p != std::string::npos) path.replace(p, 6, std::to_string(env.rank));
    nlohmann::json j = {{"rank", env.rank},           {"world_size", env.world},       {"backend", comm.backend},
                        {"steps", state.step},        {"epochs", o.epochs},            {"final_train_loss", last_loss},
                        {"test_accuracy", test_acc},  {"samples_per_sec", sps},        {"restart_count", env.restart_count},
                        {"weights_sha256", digest},   {"stopped_by_signal", stopped}};
    std::ofstream(path) << j.dump(2) << "\n";
  }
  if (lead && !o.save_weights.empty()) {
    std::ofstream out(o.save_weights, std::ios::binary);
    for (const auto& p : params) {
      auto c = p.detach().to(torch::kCPU).to(torch::kFloat).contiguous();
      out.write(static_cast<const char*>(c.data_ptr()), c.numel() * sizeof(float));
    }
  }
  return stopped ? kExitStopped : 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"mgtrain: LibTorch data-parallel trainer (c10d Gloo/NCCL); run it under mglaunch or torchrun", "mgtrain"};
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  app.add_option("--backend", o.backend, "auto, nccl or gloo")->check(CLI::IsMember({"auto", "nccl", "gloo"}));
  app.add_option("--dataset", o.dataset, "fashion-mnist or synthetic")->check(CLI::IsMember({"fashion-mnist", "synthetic"}));
  app.add_option("--data-dir", o.data_dir, "Directory with the Fashion-MNIST IDX .gz files");
  app.add_option("--synthetic-size", o.synthetic_size, "Training samples of --dataset synthetic")->check(CLI::PositiveNumber);
  app.add_option("--train-subset", o.train_subset, "Use only the first N training samples");
  app.add_option("--test-subset", o.test_subset, "Use only the first N test samples");
  app.add_option("--model", o.model, "mlp or cnn")->check(CLI::IsMember({"mlp", "cnn"}));
  app.add_option("--epochs", o.epochs, "Epochs")->check(CLI::PositiveNumber);
  app.add_option("--max-steps", o.max_steps, "Stop after this many optimizer steps");
  app.add_option("--batch-size", o.batch_size, "Micro-batch per rank")->check(CLI::PositiveNumber);
  app.add_option("--lr", o.lr, "Learning rate (before --lr-scaling)");
  app.add_option("--momentum", o.momentum, "SGD momentum");
  app.add_option("--seed", o.seed, "Seed for init and shuffling");
  app.add_option("--bucket-cap-mb", o.bucket_cap_mb, "Gradient bucket size in MiB")->check(CLI::PositiveNumber);
  app.add_option("--grad-accum", o.grad_accum, "Micro-steps per optimizer step")->check(CLI::PositiveNumber);
  app.add_option("--clip-grad-norm", o.clip_grad_norm, "Clip the gradient norm (0: off)");
  app.add_option("--lr-scaling", o.lr_scaling, "none, linear or sqrt in the world size")
      ->check(CLI::IsMember({"none", "linear", "sqrt"}));
  app.add_option("--comm-dtype", o.comm_dtype, "fp32, fp16 or bf16 for the gradient all-reduce")
      ->check(CLI::IsMember({"fp32", "fp16", "bf16"}));
  app.add_flag("!--no-channels-last", o.channels_last, "Keep the CNN in NCHW (default: channels-last on CPU)");
  app.add_flag("--amp", o.amp, "bf16 mixed precision on CUDA (CUDA builds with LibTorch >= 2.4)");
  app.add_option("--log-every", o.log_every, "Progress line every N steps (rank 0)");
  app.add_option("--summary-json", o.summary_json, "Per-rank summary; {rank} is replaced");
  app.add_option("--save-weights", o.save_weights, "Rank 0 writes the final parameters as raw float32");
  app.add_option("--checkpoint-dir", o.checkpoint_dir, "Checkpoint directory (resume from it when present)");
  app.add_option("--checkpoint-every", o.checkpoint_every, "Checkpoint every N steps (0: only on signals)");
  app.add_option("--fail-at-step", o.fail_at_step, "Fault injection: fail at this step (first attempt only)");
  app.add_option("--fail-rank", o.fail_rank, "Fault injection: the rank that fails");
  app.add_option("--fail-signal", o.fail_signal, "Fault injection: raise this signal instead of exit 1");
  app.add_option("--threads", o.threads, "Intra-op threads (default: OMP_NUM_THREADS / torch default)");
  app.add_option("--timeout", o.timeout_s, "Seconds to wait for the store and collectives")->check(CLI::PositiveNumber);
  app.add_option("--bench", o.bench, "allreduce: run the collective benchmark instead of training")
      ->check(CLI::IsMember({"allreduce"}));
  app.add_option("--min-bytes", o.min_bytes, "Benchmark: smallest size (N, NK, NM, NG)");
  app.add_option("--max-bytes", o.max_bytes, "Benchmark: largest size");
  app.add_option("--step-factor", o.step_factor, "Benchmark: size multiplier")->check(CLI::Range(1.01, 1024.0));
  app.add_option("--iters", o.iters, "Benchmark: timed iterations")->check(CLI::PositiveNumber);
  app.add_option("--warmup", o.warmup, "Benchmark: warm-up iterations");
  app.add_option("--dtype", o.dtype, "Benchmark: float, double, half or int");
  app.footer("Exit codes: 0 done; 1 failure; 2 bad flags; 3 setup error (data, master, backend); "
             "75 stopped by SIGTERM/SIGUSR1 after checkpointing (run again to resume).");
  try {
    app.parse(argc, argv);
    if (o.amp && !kAmpSupported)
      throw CLI::ValidationError("--amp needs a CUDA build of mgtrain against LibTorch >= 2.4");
    parse_bytes(o.min_bytes);
    parse_bytes(o.max_bytes);
  } catch (const CLI::Success& e) {
    return app.exit(e);
  } catch (const CLI::Error& e) {
    std::string what = e.what();
    std::fprintf(stderr, "mgtrain: error: %s (see mgtrain --help)\n", what.substr(0, what.find('\n')).c_str());
    return kExitUsage;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "mgtrain: error: %s\n", e.what());
    return kExitUsage;
  }
  Env env;
  env.rank = env_int("RANK", 0);
  env.world = env_int("WORLD_SIZE", 1);
  env.local_rank = env_int("LOCAL_RANK", 0);
  env.restart_count = env_int("TORCHELASTIC_RESTART_COUNT", 0);
  if (const char* a = std::getenv("MASTER_ADDR")) env.master_addr = a;
  env.master_port = env_int("MASTER_PORT", 0);
  if (env.world < 1 || env.rank < 0 || env.rank >= env.world) {
    std::fprintf(stderr, "mgtrain: error: RANK=%d WORLD_SIZE=%d is not a valid pair; run under mglaunch or torchrun\n",
                 env.rank, env.world);
    return kExitUsage;
  }
  if (env.world > 1 && env.master_port <= 0) {
    std::fprintf(stderr, "mgtrain: error: MASTER_PORT is not set; run under mglaunch or torchrun\n");
    return kExitUsage;
  }
  if (o.threads > 0) torch::set_num_threads(o.threads);
  std::signal(SIGTERM, on_stop_signal);
  std::signal(SIGUSR1, on_stop_signal);
  try {
    if (env.world == 1 && env.master_port <= 0) env.master_port = 0;  // single process: any free port
    Comm comm = connect(o, env);
    const int code = o.bench == "allreduce" ? run_bench(o, env, comm) : train(o, env, comm);
    comm.shutdown();
    return code;
  } catch (const SetupError& e) {
    std::fprintf(stderr, "mgtrain: error: %s\n", e.what());
    write_error_file(e.what());
    return kExitSetup;
  } catch (const std::exception& e) {
    std::string what = e.what();
    what = what.substr(0, what.find('\n'));
    std::fprintf(stderr, "mgtrain: error: %s\n", what.c_str());
    write_error_file(what);
    return 1;
  }
}
