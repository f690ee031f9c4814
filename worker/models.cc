#include "worker/models.h"

#include <stdexcept>

namespace mg::train {
namespace nn = torch::nn;

SyncBatchNorm2dImpl::SyncBatchNorm2dImpl(std::int64_t channels, AllReduceSum s) : sync(std::move(s)) {
  weight = register_parameter("weight", torch::ones({channels}));
  bias = register_parameter("bias", torch::zeros({channels}));
  running_mean = register_buffer("running_mean", torch::zeros({channels}));
  running_var = register_buffer("running_var", torch::ones({channels}));
  num_batches_tracked = register_buffer("num_batches_tracked", torch::zeros({}, torch::kLong));
}

torch::Tensor SyncBatchNorm2dImpl::forward(const torch::Tensor& x) {
  if (!is_training() || !sync) {
    if (is_training()) {
      torch::NoGradGuard ng;
      num_batches_tracked.add_(1);
    }
    return torch::batch_norm(x, weight, bias, running_mean, running_var, is_training(), momentum, eps,
                             /*cudnn_enabled=*/true);
  }
  const std::int64_t c = x.size(1);
  // Sums in double: E[x^2] - E[x]^2 then loses nothing a float two-pass variance keeps.
  auto local = torch::cat({x.sum({0, 2, 3}, false, torch::kDouble), x.square().sum({0, 2, 3}, false, torch::kDouble),
                           torch::full({1}, static_cast<double>(x.numel() / c), x.options().dtype(torch::kDouble))});
  // Differentiable all-reduce: the forward value is the global sum, the gradient reaching
  // `local` is the sum of every rank's gradient of the global statistics.
  torch::Tensor summed = local.detach().clone();
  sync(summed);
  torch::Tensor global = local + (summed - local).detach();
  global.register_hook([s = sync](torch::Tensor g) {
    auto h = g.clone();
    s(h);
    return h;
  });
  const double n = summed[2 * c].item<double>();
  auto mean = global.narrow(0, 0, c) / n;
  auto var = global.narrow(0, c, c) / n - mean.square();
  {
    torch::NoGradGuard ng;
    running_mean.mul_(1 - momentum).add_(mean.detach().to(running_mean.scalar_type()), momentum);
    running_var.mul_(1 - momentum).add_((var.detach() * (n / std::max(1.0, n - 1))).to(running_var.scalar_type()), momentum);
    num_batches_tracked.add_(1);
  }
  auto scale = weight * (var.to(x.scalar_type()) + eps).rsqrt();
  auto shift = bias - mean.to(x.scalar_type()) * scale;
  return x * scale.view({1, c, 1, 1}) + shift.view({1, c, 1, 1});
}

namespace {

struct MlpImpl : nn::Module {
  explicit MlpImpl(int extra_mode = 0, int rank = 0) : mode(extra_mode), rank(rank) {
    fc1 = register_module("fc1", nn::Linear(784, 256));
    fc2 = register_module("fc2", nn::Linear(256, 128));
    if (mode) branch = register_module("branch", nn::Linear(128, 128));
    fc3 = register_module("fc3", nn::Linear(128, 10));
  }
  torch::Tensor forward(const torch::Tensor& in) {
    auto x = torch::relu(fc2(torch::relu(fc1(in.flatten(1)))));
    // mode 1: `branch` is never used; mode 2: only odd ranks use it.
    if (mode == 2 && rank % 2 == 1) x = x + torch::tanh(branch(x));
    return fc3(x);
  }
  int mode, rank;
  nn::Linear fc1{nullptr}, fc2{nullptr}, branch{nullptr}, fc3{nullptr};
};

// The seed guides' small convnet: two 3x3 convs (16, 32), max-pool, FC 128, FC 10.
struct CnnImpl : nn::Module {
  CnnImpl() {
    conv1 = register_module("conv1", nn::Conv2d(nn::Conv2dOptions(1, 16, 3)));
    conv2 = register_module("conv2", nn::Conv2d(nn::Conv2dOptions(16, 32, 3)));
    fc1 = register_module("fc1", nn::Linear(32 * 12 * 12, 128));
    fc2 = register_module("fc2", nn::Linear(128, 10));
  }
  // max-pool and ReLU commute (both monotone), so pooling first gives the same values
  // with a quarter of the ReLU work; in-place ReLUs save allocations. The Python twin
  // runs the same graph.
  torch::Tensor forward(const torch::Tensor& in) {
    auto x = conv1(in).relu_();
    x = torch::max_pool2d(conv2(x), 2).relu_();
    return fc2(fc1(x.flatten(1)).relu_());
  }
  nn::Conv2d conv1{nullptr}, conv2{nullptr};
  nn::Linear fc1{nullptr}, fc2{nullptr};
};

nn::Conv2d conv3x3(std::int64_t in, std::int64_t out, std::int64_t stride = 1) {
  return nn::Conv2d(nn::Conv2dOptions(in, out, 3).stride(stride).padding(1).bias(false));
}

// A basic residual block (two 3x3 convs with BatchNorm); a 1x1 conv + BN projects the
// shortcut when the shape changes.
struct BlockImpl : nn::Module {
  BlockImpl(std::int64_t in, std::int64_t out, std::int64_t stride, const AllReduceSum& sync) {
    conv1 = register_module("conv1", conv3x3(in, out, stride));
    bn1 = register_module("bn1", SyncBatchNorm2d(out, sync));
    conv2 = register_module("conv2", conv3x3(out, out));
    bn2 = register_module("bn2", SyncBatchNorm2d(out, sync));
    if (stride != 1 || in != out) {
      down = register_module("down", nn::Conv2d(nn::Conv2dOptions(in, out, 1).stride(stride).bias(false)));
      down_bn = register_module("down_bn", SyncBatchNorm2d(out, sync));
    }
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto y = bn1(conv1(x)).relu_();
    y = bn2(conv2(y));
    return (y + (down ? down_bn(down(x)) : x)).relu_();
  }
  nn::Conv2d conv1{nullptr}, conv2{nullptr}, down{nullptr};
  SyncBatchNorm2d bn1{nullptr}, bn2{nullptr}, down_bn{nullptr};
};
TORCH_MODULE(Block);

// 28x28x1 -> conv 16 + BN -> block 16 -> block 32 (stride 2) -> global average -> FC 10.
struct ResNetImpl : nn::Module {
  explicit ResNetImpl(const AllReduceSum& sync) {
    stem = register_module("stem", conv3x3(1, 16));
    stem_bn = register_module("stem_bn", SyncBatchNorm2d(16, sync));
    block1 = register_module("block1", Block(16, 16, 1, sync));
    block2 = register_module("block2", Block(16, 32, 2, sync));
    fc = register_module("fc", nn::Linear(32, 10));
  }
  torch::Tensor forward(const torch::Tensor& in) {
    auto x = stem_bn(stem(in)).relu_();
    x = block2(block1(x));
    return fc(x.mean({2, 3}));
  }
  nn::Conv2d stem{nullptr};
  SyncBatchNorm2d stem_bn{nullptr};
  Block block1{nullptr}, block2{nullptr};
  nn::Linear fc{nullptr};
};

template <typename M>
Model wrap(std::shared_ptr<M> m, bool conv) {
  Model r;
  r.forward = [m](const torch::Tensor& x) { return m->forward(x); };
  r.module = m;
  for (const auto& item : m->named_parameters()) r.param_names.push_back(item.key());
  r.convolutional = conv;
  return r;
}

}  // namespace

Model make_model(const ModelOptions& o) {
  Model m;
  if (o.name == "mlp")
    m = wrap(std::make_shared<MlpImpl>(), false);
  else if (o.name == "mlp-unused")
    m = wrap(std::make_shared<MlpImpl>(1, o.rank), false);
  else if (o.name == "mlp-rank-branch")
    m = wrap(std::make_shared<MlpImpl>(2, o.rank), false);
  else if (o.name == "cnn")
    m = wrap(std::make_shared<CnnImpl>(), true);
  else if (o.name == "resnet")
    m = wrap(std::make_shared<ResNetImpl>(o.sync_batchnorm), true);
  else
    throw std::invalid_argument("unknown model '" + o.name + "': use mlp, cnn or resnet");
  if (m.convolutional && o.channels_last) {
    // NHWC lets oneDNN run the convolutions and the max-pool without layout conversions
    // (1.4x faster on CPU here); the model and its results are unchanged.
    torch::NoGradGuard ng;
    for (auto& p : m.module->parameters())
      if (p.dim() == 4) p.set_data(p.data().contiguous(at::MemoryFormat::ChannelsLast));
  }
  return m;
}

}  // namespace mg::train
