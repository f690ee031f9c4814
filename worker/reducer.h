// The data-parallel gradient reducer: parameters grouped into flat buckets, each
// all-reduced (averaged) as soon as its gradients are in, from autograd hooks during
// backward. DDP's semantics: buckets are launched in one fixed order on every rank
// (reverse registration order, or the order learned on the first step with
// static_graph), whatever order this rank's gradients arrive in; every slot of a bucket
// is rewritten each step (never last step's gradient); a parameter without a gradient is
// an error naming it, or with find_unused contributes zeros (and a parameter unused on
// every rank keeps its gradient untouched, as in DDP). Included only by torch units.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "worker/comm.h"

namespace c10d {
class Reducer;
}

namespace mg::train {

struct ReducerOptions {
  double bucket_cap_mb = 25;
  double first_bucket_cap_mb = 1;  // DDP: a small first bucket starts communicating early
  torch::ScalarType comm_dtype = torch::kFloat;
  bool find_unused = false;
  bool static_graph = false;
};

// The interface the training loop drives: arm() before each backward, finish() after the
// last backward of an optimizer step; after finish() p.grad() holds the global average.
class GradientSync {
 public:
  virtual ~GradientSync() = default;
  // `sync` false: an accumulation micro-step whose gradients stay local. `outputs`: the
  // forward's outputs (c10d::Reducer walks the graph from them to find unused parameters).
  virtual void arm(bool sync, const std::vector<torch::Tensor>& outputs) = 0;
  virtual void finish() = 0;
  virtual std::size_t bucket_count() const = 0;
  // In-place recovery: forget the collectives in flight (their group is abandoned), so
  // the destructor waits for none.
  virtual void abandon() {}
};

// Our reducer. Owns hooks on `params` for its lifetime (removed by the destructor);
// single-threaded except that the hooks run on autograd's thread during backward.
class GradReducer final : public GradientSync {
 public:
  GradReducer(std::vector<torch::Tensor> params, std::vector<std::string> names, c10::intrusive_ptr<PG> pg, int world,
              ReducerOptions o);
  ~GradReducer() override;
  GradReducer(const GradReducer&) = delete;
  GradReducer& operator=(const GradReducer&) = delete;

  void arm(bool sync, const std::vector<torch::Tensor>& outputs = {}) override;
  // Throws std::runtime_error naming the first parameter that got no gradient when
  // find_unused is off (no collective of this step is left half-issued on this rank).
  void finish() override;
  std::size_t bucket_count() const override { return buckets_.size(); }
  void abandon() override;

  // What the hooks call: parameter i's gradient of this backward. Public for tests that
  // feed gradients in a chosen order.
  void add_gradient(int i, const torch::Tensor& grad);
  // Bucket members (parameter indices) in launch order.
  std::vector<std::vector<int>> plan() const;
  // The buckets in the order they were launched in the last step (equal to plan order).
  const std::vector<int>& launch_log() const { return launch_log_; }

 private:
  struct Bucket {
    std::vector<int> members;
    std::int64_t numel = 0;
    torch::Tensor flat, comm;
    int pending = 0;
    bool ready = false;
    c10::intrusive_ptr<c10d::Work> work;
  };
  struct Slot {
    int bucket = 0;
    std::int64_t offset = 0;
  };

  void build(const std::vector<int>& order);
  void mark_ready(int b);
  void launch(int b);
  torch::Tensor slot_view(int i);

  std::vector<torch::Tensor> params_;
  std::vector<std::string> names_;
  c10::intrusive_ptr<PG> pg_;
  int world_;
  ReducerOptions o_;
  std::vector<Bucket> buckets_;
  std::vector<Slot> slot_;
  std::vector<unsigned> hooks_;
  std::vector<char> got_;            // parameter i got a gradient this step
  std::vector<char> local_unused_;   // static graph: learned on step 1
  std::vector<char> global_unused_;  // static graph: learned on step 1
  std::vector<int> arrival_;         // static graph: gradient arrival order of step 1
  std::vector<int> launch_log_;
  int next_launch_ = 0;
  bool sync_ = false, learned_ = false;
};

// c10d::Reducer, the engine under Python's DDP (LibTorch < 2 here, where the Gloo
// process group is a c10d::ProcessGroup). Throws SetupError where unavailable.
class C10dReducer final : public GradientSync {
 public:
  C10dReducer(std::vector<torch::Tensor> params, std::vector<std::string> names, c10::intrusive_ptr<PG> pg,
              ReducerOptions o);
  ~C10dReducer() override;
  void arm(bool sync, const std::vector<torch::Tensor>& outputs) override;
  void finish() override {}
  std::size_t bucket_count() const override { return buckets_; }

 private:
  std::unique_ptr<c10d::Reducer> reducer_;
  std::size_t buckets_ = 0;
  bool find_unused_;
};

}  // namespace mg::train
