#include "worker/reducer.h"

#include <fmt/format.h>
#if TORCH_VERSION_MAJOR < 2 || defined(MGLAUNCH_C10D_REDUCER_V2)
#include <torch/csrc/distributed/c10d/reducer.hpp>
#endif
#ifdef MGLAUNCH_C10D_REDUCER_V2
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#endif

namespace mg::train {

GradReducer::GradReducer(std::vector<torch::Tensor> params, std::vector<std::string> names, c10::intrusive_ptr<PG> pg,
                         int world, ReducerOptions o)
    : params_(std::move(params)), names_(std::move(names)), pg_(std::move(pg)), world_(world), o_(o) {
  if (params_.empty()) throw std::invalid_argument("gradient reducer: the model has no parameters");
  names_.resize(params_.size());
  for (std::size_t i = 0; i < names_.size(); ++i)
    if (names_[i].empty()) names_[i] = "#" + std::to_string(i);
  std::vector<int> order;  // DDP: reverse registration order, the order backward produces them
  for (int i = static_cast<int>(params_.size()) - 1; i >= 0; --i) order.push_back(i);
  build(order);
  got_.assign(params_.size(), 0);
  local_unused_.assign(params_.size(), 0);
  global_unused_.assign(params_.size(), 0);
  for (std::size_t i = 0; i < params_.size(); ++i)
    hooks_.push_back(params_[i].register_hook([this, i](torch::Tensor grad) { add_gradient(static_cast<int>(i), grad); }));
}

GradReducer::~GradReducer() {
  for (std::size_t i = 0; i < hooks_.size(); ++i) params_[i].remove_hook(hooks_[i]);
  for (auto& bk : buckets_)  // no collective of ours may outlive the buffers it reads
    if (bk.work) {
      try {
        bk.work->wait();
      } catch (const std::exception&) {  // a failed collective reads nothing more
      }
    }
}

void GradReducer::abandon() {
  for (auto& bk : buckets_) bk.work.reset();  // the abandoned group's work holds its tensors
}

void GradReducer::build(const std::vector<int>& order) {
  const std::int64_t cap = std::max<std::int64_t>(1, static_cast<std::int64_t>(o_.bucket_cap_mb * 1024 * 1024));
  const std::int64_t first_cap =
      std::min<std::int64_t>(cap, std::max<std::int64_t>(1, static_cast<std::int64_t>(o_.first_bucket_cap_mb * 1024 * 1024)));
  buckets_.clear();
  slot_.assign(params_.size(), {});
  std::int64_t bytes = 0;
  for (int i : order) {
    const std::int64_t b = params_[i].numel() * params_[i].element_size();
    const std::int64_t limit = buckets_.size() <= 1 ? first_cap : cap;
    if (buckets_.empty() || (bytes + b > limit && !buckets_.back().members.empty())) {
      buckets_.push_back({});
      bytes = 0;
    }
    auto& bk = buckets_.back();
    slot_[i] = {static_cast<int>(buckets_.size()) - 1, bk.numel};
    bk.members.push_back(i);
    bk.numel += params_[i].numel();
    bytes += b;
  }
  for (auto& bk : buckets_) bk.flat = torch::zeros({bk.numel}, params_[0].options());
}

std::vector<std::vector<int>> GradReducer::plan() const {
  std::vector<std::vector<int>> p;
  for (const auto& bk : buckets_) p.push_back(bk.members);
  return p;
}

torch::Tensor GradReducer::slot_view(int i) {
  return buckets_[slot_[i].bucket].flat.narrow(0, slot_[i].offset, params_[i].numel());
}

void GradReducer::arm(bool sync, const std::vector<torch::Tensor>&) {
  sync_ = sync;
  if (!sync_) return;
  std::fill(got_.begin(), got_.end(), 0);
  arrival_.clear();
  launch_log_.clear();
  next_launch_ = 0;
  for (auto& bk : buckets_) {
    bk.ready = false;
    bk.work.reset();
    bk.pending = 0;
    for (int i : bk.members) bk.pending += learned_ && local_unused_[i] ? 0 : 1;
  }
  // Static graph: a bucket of parameters this rank never uses is ready (zeros) at once.
  for (std::size_t b = 0; b < buckets_.size(); ++b)
    if (buckets_[b].pending == 0) mark_ready(static_cast<int>(b));
}

void GradReducer::add_gradient(int i, const torch::Tensor& grad) {
  if (!sync_) return;
  if (got_[i])
    throw std::runtime_error(fmt::format("parameter '{}' got a second gradient in one step: mgtrain's reducer expects "
                                         "one backward per step (use --grad-accum for several)", names_[i]));
  torch::NoGradGuard ng;
  auto& p = params_[i];
  auto dst = slot_view(i);
  // The hook runs before autograd adds `grad` into p.grad(): include what earlier
  // accumulation micro-steps left there.
  if (p.grad().defined())
    torch::add_out(dst, p.grad().reshape({-1}), grad.reshape({-1}));
  else
    dst.copy_(grad.reshape({-1}));
  got_[i] = 1;
  if (o_.static_graph && !learned_) arrival_.push_back(i);
  if (--buckets_[slot_[i].bucket].pending == 0) mark_ready(slot_[i].bucket);
}

void GradReducer::mark_ready(int b) {
  buckets_[b].ready = true;
  // Launch in plan order only: ranks whose gradients arrive in different orders still
  // issue the same sequence of collectives.
  while (next_launch_ < static_cast<int>(buckets_.size()) && buckets_[next_launch_].ready) launch(next_launch_++);
}

void GradReducer::launch(int b) {
  auto& bk = buckets_[b];
  torch::NoGradGuard no_grad;
  bk.comm = bk.flat.div(world_);
  if (o_.comm_dtype != bk.flat.scalar_type()) bk.comm = bk.comm.to(o_.comm_dtype);
  std::vector<torch::Tensor> tensors{bk.comm};
  bk.work = pg_->allreduce(tensors);
  launch_log_.push_back(b);
}

void GradReducer::finish() {
  if (!sync_) return;
  sync_ = false;
  torch::NoGradGuard ng;
  const bool learning = o_.static_graph && !learned_;
  const bool allow_missing = o_.find_unused || learning;
  std::vector<int> missing;
  for (std::size_t i = 0; i < params_.size(); ++i)
    if (!got_[i] && !(learned_ && local_unused_[i])) missing.push_back(static_cast<int>(i));
  if (!missing.empty() && !allow_missing) {
    std::string more = missing.size() > 1 ? fmt::format(" (and {} more)", missing.size() - 1) : "";
    throw std::runtime_error(fmt::format(
        "parameter '{}'{} received no gradient in this step: it was not used to compute the loss; pass "
        "--find-unused-parameters (or --static-graph when the same parameters are unused every step)",
        names_[missing[0]], more));
  }
  std::vector<char> used(params_.size(), 1);
  for (int i : missing) {
    auto& p = params_[i];
    auto dst = slot_view(i);
    if (p.grad().defined()) {  // used in an earlier accumulation micro-step only
      dst.copy_(p.grad().reshape({-1}));
    } else {
      dst.zero_();
      used[i] = 0;
    }
    if (--buckets_[slot_[i].bucket].pending == 0) mark_ready(slot_[i].bucket);
  }
  if (next_launch_ != static_cast<int>(buckets_.size()))
    throw std::logic_error("gradient reducer: a bucket was not launched after backward");
  // DDP: a parameter unused on every rank keeps its gradient untouched (an optimizer then
  // skips it); one used on some rank gets the average with this rank's zeros.
  std::vector<char> global_unused = global_unused_;
  if (allow_missing && !(learned_)) {
    auto t = torch::empty({static_cast<std::int64_t>(used.size())}, torch::kFloat);
    for (std::size_t i = 0; i < used.size(); ++i) t[i] = used[i] ? 1.0f : 0.0f;
    t = t.to(params_[0].device());
    std::vector<torch::Tensor> v{t};
    wait_work(pg_->allreduce(v));
    auto c = t.to(torch::kCPU);
    auto acc = c.accessor<float, 1>();
    for (std::size_t i = 0; i < used.size(); ++i) global_unused[i] = acc[i] == 0.0f;
  }
  for (auto& bk : buckets_) {
    wait_work(bk.work);
    torch::Tensor reduced = bk.comm.scalar_type() == bk.flat.scalar_type() ? bk.comm : bk.comm.to(bk.flat.scalar_type());
    for (int i : bk.members) {
      if (global_unused[i]) continue;
      auto& p = params_[i];
      auto view = reduced.narrow(0, slot_[i].offset, p.numel()).view_as(p);
      if (p.grad().defined())
        p.mutable_grad().copy_(view);
      else
        p.mutable_grad() = view.clone();
    }
    bk.work.reset();
  }
  if (learning) {
    // Static graph: fix the unused sets and rebuild the buckets in rank 0's arrival order.
    learned_ = true;
    for (std::size_t i = 0; i < params_.size(); ++i) local_unused_[i] = !used[i];
    global_unused_ = global_unused;
    std::vector<char> seen(params_.size(), 0);
    std::vector<std::int64_t> order;
    for (int i : arrival_) order.push_back(i), seen[i] = 1;
    for (int i = static_cast<int>(params_.size()) - 1; i >= 0; --i)
      if (!seen[i]) order.push_back(i);
    auto t = torch::tensor(order, torch::kLong).to(params_[0].device());
    std::vector<torch::Tensor> v{t};
    wait_work(pg_->broadcast(v));
    auto c = t.to(torch::kCPU);
    std::vector<int> agreed(c.data_ptr<std::int64_t>(), c.data_ptr<std::int64_t>() + c.numel());
    build(agreed);
  }
}

#if TORCH_VERSION_MAJOR < 2
C10dReducer::C10dReducer(std::vector<torch::Tensor> params, std::vector<std::string> names, c10::intrusive_ptr<PG> pg,
                         ReducerOptions o)
    : find_unused_(o.find_unused) {
  const auto cap = static_cast<std::size_t>(o.bucket_cap_mb * 1024 * 1024);
  const auto first = static_cast<std::size_t>(o.first_bucket_cap_mb * 1024 * 1024);
  std::vector<bool> sparse(params.size(), false);
  auto [indices, limits] = c10d::compute_bucket_assignment_by_size(params, {first, cap}, sparse);
  // As torch.nn.parallel.DistributedDataParallel: reversed, to approximate the order in
  // which backward produces the gradients.
  std::reverse(indices.begin(), indices.end());
  std::reverse(limits.begin(), limits.end());
  buckets_ = indices.size();
  std::unordered_map<std::size_t, std::string> param_names;
  for (std::size_t i = 0; i < names.size(); ++i) param_names[i] = names[i];
  reducer_ = std::make_unique<c10d::Reducer>(params, indices, limits, pg, sparse, static_cast<std::int64_t>(cap),
                                             o.find_unused, /*gradient_as_bucket_view=*/false, param_names,
                                             static_cast<std::int64_t>(first));
  if (o.static_graph) reducer_->set_static_graph();
}

C10dReducer::~C10dReducer() = default;

void C10dReducer::arm(bool sync, const std::vector<torch::Tensor>& outputs) {
  if (!sync) return;  // no prepare_for_backward: the hooks leave the gradients local
  reducer_->rebuild_buckets();
  reducer_->prepare_for_forward();
  reducer_->prepare_for_backward(find_unused_ ? outputs : std::vector<torch::Tensor>{});
}
#elif defined(MGLAUNCH_C10D_REDUCER_V2)
// LibTorch 2.x: c10d::Reducer takes a c10d::ProcessGroup, whose collectives dispatch by
// device type to a c10d::Backend; ours is a bare Backend (Gloo or NCCL), so it is wrapped.
// The constructors changed between 2.x releases: each form is picked at compile time by
// what the installed headers declare (templates, so that only the one that exists is
// instantiated).
namespace {

template <typename P = c10d::ProcessGroup>
c10::intrusive_ptr<P> wrap_backend(const c10::intrusive_ptr<PG>& backend) {
  auto store = c10::make_intrusive<c10d::HashStore>();  // never used: the backend is connected
  c10::intrusive_ptr<P> pg;
  if constexpr (std::is_constructible_v<P, c10::intrusive_ptr<c10d::Store>, int, int>) {
    pg = c10::make_intrusive<P>(store, backend->getRank(), backend->getSize());
  } else {
    auto opts = c10::make_intrusive<typename P::Options>(backend->getBackendName());
    pg = c10::make_intrusive<P>(store, backend->getRank(), backend->getSize(), opts);
  }
  const bool nccl = backend->getBackendName() == "nccl";
  const auto type = nccl ? P::BackendType::NCCL : P::BackendType::GLOO;
  pg->setBackend(nccl ? c10::DeviceType::CUDA : c10::DeviceType::CPU, type, backend);
  pg->setDefaultBackend(type);
  return pg;
}

template <typename R = c10d::Reducer>
std::unique_ptr<R> new_reducer(std::vector<at::Tensor> params, std::vector<std::vector<size_t>> indices,
                               std::vector<size_t> limits, c10::intrusive_ptr<c10d::ProcessGroup> pg, std::vector<bool> sparse,
                               std::int64_t cap, bool find_unused, std::unordered_map<size_t, std::string> names,
                               std::int64_t first) {
  using Params = std::vector<at::Tensor>;
  using Indices = std::vector<std::vector<size_t>>;
  using Pg = c10::intrusive_ptr<c10d::ProcessGroup>;
  using Sparse = std::vector<bool>;
  using Names = std::unordered_map<size_t, std::string>;
  using I = std::int64_t;
  // 2.8+: ..., skip_all_reduce_unused_params, use_python_reducer, bucket_bytes_cap_list[, batched_grad_copy]
  if constexpr (std::is_constructible_v<R, Params, Indices, Pg, Sparse, I, bool, bool, Names, I, bool, bool, std::vector<I>>)
    return std::make_unique<R>(params, indices, pg, sparse, cap, find_unused, false, names, first, false, false,
                               std::vector<I>{});
  else if constexpr (std::is_constructible_v<R, Params, Indices, Pg, Sparse, I, bool, bool, Names, I, bool, bool>)
    return std::make_unique<R>(params, indices, pg, sparse, cap, find_unused, false, names, first, false, false);
  else if constexpr (std::is_constructible_v<R, Params, Indices, Pg, Sparse, I, bool, bool, Names, I, bool>)
    return std::make_unique<R>(params, indices, pg, sparse, cap, find_unused, false, names, first, false);
  else if constexpr (std::is_constructible_v<R, Params, Indices, std::vector<size_t>, Pg, Sparse, I, bool, bool, Names, I>)
    return std::make_unique<R>(params, indices, limits, pg, sparse, cap, find_unused, false, names, first);
  else
    return std::make_unique<R>(params, indices, pg, sparse, cap, find_unused, false, names, first);
}

}  // namespace

C10dReducer::C10dReducer(std::vector<torch::Tensor> params, std::vector<std::string> names, c10::intrusive_ptr<PG> pg,
                         ReducerOptions o)
    : find_unused_(o.find_unused) {
  const auto cap = static_cast<std::size_t>(o.bucket_cap_mb * 1024 * 1024);
  const auto first = static_cast<std::size_t>(o.first_bucket_cap_mb * 1024 * 1024);
  std::vector<bool> sparse(params.size(), false);
  auto [indices, limits] = c10d::compute_bucket_assignment_by_size(params, {first, cap}, sparse);
  std::reverse(indices.begin(), indices.end());  // as DDP: approximately backward's order
  std::reverse(limits.begin(), limits.end());
  buckets_ = indices.size();
  std::unordered_map<std::size_t, std::string> param_names;
  for (std::size_t i = 0; i < names.size(); ++i) param_names[i] = names[i];
  reducer_ = new_reducer(params, indices, limits, wrap_backend(pg), sparse, static_cast<std::int64_t>(cap), o.find_unused,
                         param_names, static_cast<std::int64_t>(first));
  if (o.static_graph) reducer_->set_static_graph();
}

C10dReducer::~C10dReducer() = default;

void C10dReducer::arm(bool sync, const std::vector<torch::Tensor>& outputs) {
  if (!sync) return;
  reducer_->rebuild_buckets();
  reducer_->prepare_for_forward();
  reducer_->prepare_for_backward(find_unused_ ? outputs : std::vector<torch::Tensor>{});
}
#else
C10dReducer::C10dReducer(std::vector<torch::Tensor>, std::vector<std::string>, c10::intrusive_ptr<PG>, ReducerOptions)
    : find_unused_(false) {
  throw SetupError("--reducer c10d is not built into this mgtrain (LibTorch 2.x without MGLAUNCH_C10D_REDUCER_V2); "
                   "use --reducer mgtrain");
}
C10dReducer::~C10dReducer() = default;
void C10dReducer::arm(bool, const std::vector<torch::Tensor>&) {}
#endif

}  // namespace mg::train
