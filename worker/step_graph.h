// --cuda-graphs: one training step captured once as a CUDA graph and replayed, so a step
// costs one graph launch instead of hundreds of kernel launches from the CPU. Included
// only by mgtrain's torch units.
#pragma once

#include <functional>
#include <memory>

#include <torch/torch.h>

namespace mg::train {

// Runs training steps of a fixed batch size through a captured graph. Usage: construct
// once, then call run() for every full batch; batches of another size (an epoch's last,
// partial one) run eagerly outside it, on the caller's stream.
//
// The first `warmup` calls run `step` eagerly on a side stream (PyTorch's rule for
// capture: lazily created state -- optimizer momentum, cuBLAS/cuDNN workspaces, NCCL
// communicators, a static-graph reducer's plan -- must exist before capture). The next
// call captures `step` on that stream and replays it; every later call copies the batch's
// sample indices into the graph's static index buffer and replays.
//
// `step(idx)` performs one whole optimizer step on the samples `idx` names and returns
// the step's loss. It must read its batch only through `idx` (it is captured once: any
// value the CPU computes inside it is frozen) and must not synchronise with the CPU.
// Not thread-safe; the owner keeps the model, optimizer and reducer alive while it lives.
class StepGraph {
 public:
  using Step = std::function<torch::Tensor(const torch::Tensor& idx)>;
  // Throws UsageError where no graph can be had: a build without CUDA, or `device` not a GPU.
  StepGraph(torch::Device device, std::int64_t batch_size, int warmup = 3);
  ~StepGraph();
  StepGraph(const StepGraph&) = delete;
  StepGraph& operator=(const StepGraph&) = delete;

  // `idx`: batch_size sample indices on the device. Returns the step's loss; after
  // capture it is the graph's static loss tensor, valid until the next call.
  torch::Tensor run(const torch::Tensor& idx, const Step& step);
  bool captured() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace mg::train
