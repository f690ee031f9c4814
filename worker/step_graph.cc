#include "worker/step_graph.h"

#include <string>

#include "worker/options.h"
#ifdef MGLAUNCH_WITH_NCCL
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/cuda.h>
#endif

namespace mg::train {

#ifdef MGLAUNCH_WITH_NCCL
struct StepGraph::Impl {
  Impl(torch::Device d, std::int64_t batch, int warmup)
      : side(c10::cuda::getStreamFromPool(false, d.index())),
        idx(torch::empty({batch}, torch::TensorOptions().dtype(torch::kLong).device(d))),
        warmup_left(warmup) {}
  at::cuda::CUDAGraph graph;
  c10::cuda::CUDAStream side;
  torch::Tensor idx, loss;  // static: the graph reads idx and writes loss at fixed addresses
  int warmup_left;
  bool captured = false, failed = false;
};

StepGraph::StepGraph(torch::Device device, std::int64_t batch_size, int warmup) {
  if (!device.is_cuda())
    throw UsageError("--cuda-graphs needs a GPU: this rank trains on the CPU (no GPU visible, or --backend gloo)");
  impl_ = std::make_unique<Impl>(device, batch_size, warmup);
}

torch::Tensor StepGraph::run(const torch::Tensor& idx, const Step& step) {
  Impl& g = *impl_;
  if (g.failed) throw std::logic_error("StepGraph::run after a failed capture");
  if (idx.numel() != g.idx.numel())
    throw std::logic_error("StepGraph::run: a batch of " + std::to_string(idx.numel()) + " samples, captured for " +
                           std::to_string(g.idx.numel()));
  g.idx.copy_(idx, /*non_blocking=*/true);  // on the caller's stream, before the replay on it
  if (g.captured) {
    g.graph.replay();
    return g.loss;
  }
  // Warm-up and capture run on the side stream, fenced by device-wide synchronisation on
  // both sides (a few times per run, never per step).
  torch::cuda::synchronize();
  torch::Tensor loss;
  {
    c10::cuda::CUDAStreamGuard on_side(g.side);
    if (g.warmup_left > 0) {
      --g.warmup_left;
      loss = step(g.idx);
    } else {
      // Thread-local mode: the capture is not broken by other threads' legal CUDA calls
      // (the NCCL watchdog polls events); autograd's device thread still launches into
      // the captured stream.
      g.graph.capture_begin({0, 0}, cudaStreamCaptureModeThreadLocal);
      try {
        g.loss = step(g.idx);
      } catch (...) {
        g.failed = true;
        try {
          g.graph.capture_end();
        } catch (...) {
        }
        throw;
      }
      g.graph.capture_end();
      g.captured = true;
    }
  }
  torch::cuda::synchronize();
  if (!g.captured) return loss;
  g.graph.replay();  // the captured step has not run yet: capture only records it
  return g.loss;
}

bool StepGraph::captured() const { return impl_->captured; }
#else
struct StepGraph::Impl {};
StepGraph::StepGraph(torch::Device, std::int64_t, int) {
  throw UsageError("--cuda-graphs needs a CUDA build of mgtrain (LibTorch with CUDA; see docs/mgtrain.md)");
}
torch::Tensor StepGraph::run(const torch::Tensor&, const Step&) { return {}; }
bool StepGraph::captured() const { return false; }
#endif

StepGraph::~StepGraph() = default;

}  // namespace mg::train
