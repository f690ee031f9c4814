// mgtrain's models: an MLP, the guides' small CNN, a small residual CNN with BatchNorm
// for 28x28 inputs, and two test models whose graphs leave parameters unused. BatchNorm
// can reduce its statistics across ranks (SyncBatchNorm) through a sum all-reduce handed
// in by the caller, so this unit knows nothing of c10d. Included only by torch units.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>

namespace mg::train {

// In-place sum over every rank; empty: statistics stay local (plain BatchNorm).
using AllReduceSum = std::function<void(torch::Tensor&)>;

struct ModelOptions {
  std::string name = "cnn";  // mlp, cnn, resnet, mlp-unused, mlp-rank-branch
  int rank = 0;               // mlp-rank-branch uses its branch on odd ranks only
  AllReduceSum sync_batchnorm;
  bool channels_last = false;  // conv weights in NHWC (inputs must be too)
};

struct Model {
  std::shared_ptr<torch::nn::Module> module;
  std::function<torch::Tensor(const torch::Tensor&)> forward;
  std::vector<std::string> param_names;  // named_parameters() order = parameters() order
  bool convolutional = false;            // benefits from channels-last inputs
};

// Throws std::invalid_argument for an unknown name.
Model make_model(const ModelOptions& o);

// BatchNorm2d with torch::nn::BatchNorm2d's parameters, buffers and defaults (momentum
// 0.1, eps 1e-5). With `sync` set and in training, mean and variance are computed over
// the batch of every rank (the all-reduce is differentiable: its backward all-reduces
// the incoming gradient), and the running statistics get the global values.
struct SyncBatchNorm2dImpl : torch::nn::Module {
  SyncBatchNorm2dImpl(std::int64_t channels, AllReduceSum sync);
  torch::Tensor forward(const torch::Tensor& x);
  torch::Tensor weight, bias, running_mean, running_var, num_batches_tracked;
  AllReduceSum sync;
  double momentum = 0.1, eps = 1e-5;
};
TORCH_MODULE(SyncBatchNorm2d);

}  // namespace mg::train
