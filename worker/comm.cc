#include "worker/comm.h"

#include <fmt/format.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#ifdef MGLAUNCH_WITH_GLOO
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#endif
#ifdef MGLAUNCH_WITH_NCCL
#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

namespace mg::train {
namespace {

// Calls pg.shutdown() on LibTorch versions whose backend has it (NCCL in torch >= 2.4).
template <typename T>
void shutdown_if_supported(T& pg) {
  if constexpr (requires { pg.shutdown(); }) pg.shutdown();
}

bool cuda_visible() {
#ifdef MGLAUNCH_WITH_NCCL
  return torch::cuda::is_available();
#else
  return false;
#endif
}

}  // namespace

void Comm::allreduce_sum(torch::Tensor& t) const {
  if (!pg) return;
  std::vector<torch::Tensor> v{t};
  pg->allreduce(v)->wait();
}

void Comm::broadcast_coalesced(const std::vector<torch::Tensor>& tensors) const {
  if (!pg || tensors.empty()) return;
  torch::NoGradGuard ng;
  std::map<c10::ScalarType, std::vector<torch::Tensor>> by_dtype;
  for (const auto& t : tensors) by_dtype[t.scalar_type()].push_back(t);
  for (auto& [dtype, group] : by_dtype) {
    std::vector<torch::Tensor> flat_parts;
    for (const auto& t : group) flat_parts.push_back(t.reshape({-1}));
    std::vector<torch::Tensor> v{torch::cat(flat_parts)};
    pg->broadcast(v)->wait();
    std::int64_t off = 0;
    for (auto& t : group) {
      t.copy_(v[0].narrow(0, off, t.numel()).view(t.sizes()));
      off += t.numel();
    }
  }
}

c10::intrusive_ptr<PG> make_gloo(const c10::intrusive_ptr<c10d::Store>& store, int rank, int world, int timeout_s) {
#ifndef MGLAUNCH_WITH_GLOO
  (void)store, (void)rank, (void)world, (void)timeout_s;
  throw SetupError("this mgtrain was built without Gloo headers (pip/conda LibTorch); use --backend nccl");
#else
  auto opts = c10d::ProcessGroupGloo::Options::create();
  opts->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
  opts->timeout = std::chrono::seconds(timeout_s);
  return c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, world, opts);
#endif
}

Comm local_comm(const Options& o) {
  Comm c;
  if (cuda_visible() && o.backend != "gloo") c.device = torch::Device(torch::kCUDA, 0);
  return c;
}

Comm connect(const Options& o, const Env& env) {
  Comm c;
  c.rank = env.rank;
  c.world = env.world;
  const bool cuda = cuda_visible();
  if (o.backend == "nccl" && !cuda)
    throw SetupError("--backend nccl needs a CUDA build of mgtrain and a visible GPU; use --backend gloo");
  c.backend = o.backend == "auto" ? (cuda ? "nccl" : "gloo") : o.backend;
  c10d::TCPStoreOptions so;
  so.port = static_cast<std::uint16_t>(env.master_port);
  so.isServer = env.rank == 0 && !env.agent_store;
  so.numWorkers = env.world;
  so.waitWorkers = false;
  so.timeout = std::chrono::seconds(o.timeout_s);
  try {
    c.store = c10::make_intrusive<c10d::TCPStore>(env.master_addr, so);
    // The agent's store outlives a restart: each attempt keeps to its own keys.
    if (env.agent_store)
      c.store = c10::make_intrusive<c10d::PrefixStore>(fmt::format("/worker/attempt_{}", env.restart_count), c.store);
  } catch (const std::exception& e) {
    std::string what = e.what();
    throw SetupError(fmt::format("cannot {} the c10d store at {}:{} within {} s: {}", so.isServer ? "serve" : "reach",
                                 env.master_addr, env.master_port, o.timeout_s, what.substr(0, what.find('\n'))));
  }
  if (c.backend == "gloo") {
    c.pg = make_gloo(c.store, env.rank, env.world, o.timeout_s);
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

}  // namespace mg::train
