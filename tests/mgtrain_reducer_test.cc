// mgtrain's gradient reducer and SyncBatchNorm on their own: N ranks as threads in one
// process over a c10d::HashStore and Gloo, gradients fed in chosen orders, results
// checked exactly. Catch's assertions are not thread-safe: the rank threads only record
// what they saw, the checks run on the test's thread after they joined.
#include <functional>
#include <thread>

#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include "worker/models.h"
#include "worker/reducer.h"

// glog (through torch) defines CHECK; Catch's must win in this file.
#undef CHECK
#undef CHECK_EQ
#include <catch2/catch.hpp>

using namespace mg::train;

namespace {

// Runs body(rank, pg) on `world` threads; rethrows the first failure (by rank).
void ranks(int world, const std::function<void(int, c10::intrusive_ptr<PG>)>& body) {
  c10::intrusive_ptr<c10d::Store> store = c10::make_intrusive<c10d::HashStore>();
  std::vector<std::exception_ptr> errors(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r)
    threads.emplace_back([&, r] {
      try {
        body(r, make_gloo(store, r, world, 30));
      } catch (...) {
        errors[r] = std::current_exception();
      }
    });
  for (auto& t : threads) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

// Three parameters of distinct sizes.
std::vector<torch::Tensor> make_params() {
  return {torch::zeros({3}, torch::requires_grad()), torch::zeros({5}, torch::requires_grad()),
          torch::zeros({7}, torch::requires_grad())};
}

ReducerOptions tiny_buckets() {
  ReducerOptions o;
  o.bucket_cap_mb = 1e-6;  // one parameter per bucket
  o.first_bucket_cap_mb = 1e-6;
  return o;
}

// Rank r's "gradient" for parameter i: filled with (r + 1) * (i + 1).
torch::Tensor grad_of(int rank, int i, const torch::Tensor& p) { return torch::full_like(p, (rank + 1.0) * (i + 1.0)); }

// The single value a gradient holds (NaN if undefined or not constant).
double value(const torch::Tensor& g) {
  if (!g.defined()) return std::nan("");
  if (!torch::equal(g, torch::full_like(g, g.reshape({-1})[0].item<double>()))) return std::nan("");
  return g.reshape({-1})[0].item<double>();
}

using Plan = std::vector<std::vector<int>>;

}  // namespace

TEST_CASE("buckets are all-reduced in one fixed order whatever order each rank's gradients arrive in") {
  std::vector<Plan> plans(2);
  std::vector<std::vector<int>> launched(2);
  std::vector<std::vector<double>> grads(2);
  ranks(2, [&](int rank, c10::intrusive_ptr<PG> pg) {
    auto params = make_params();
    GradReducer red(params, {"a", "b", "c"}, pg, 2, tiny_buckets());
    plans[rank] = red.plan();
    red.arm(true);
    const std::vector<int> order = rank == 0 ? std::vector<int>{2, 1, 0} : std::vector<int>{0, 1, 2};
    for (int i : order) red.add_gradient(i, grad_of(rank, i, params[i]));
    red.finish();
    launched[rank] = red.launch_log();
    for (auto& p : params) grads[rank].push_back(value(p.grad()));
  });
  for (int r = 0; r < 2; ++r) {
    CHECK(plans[r] == Plan{{2}, {1}, {0}});  // reverse registration order
    CHECK(launched[r] == std::vector<int>{0, 1, 2});
    CHECK(grads[r] == std::vector<double>{1.5, 3.0, 4.5});  // mean of (i+1) and 2(i+1)
  }
}

TEST_CASE("a parameter unused in one step gets no stale gradient from the step before") {
  std::vector<std::vector<std::vector<double>>> seen(2);  // [rank][step][param]
  ranks(2, [&](int rank, c10::intrusive_ptr<PG> pg) {
    auto params = make_params();
    auto o = tiny_buckets();
    o.find_unused = true;
    GradReducer red(params, {"a", "b", "c"}, pg, 2, o);
    // Step 1: all used. Step 2: rank 1 does not use b. Step 3: nobody uses c.
    for (int step = 0; step < 3; ++step) {
      for (auto& p : params) p.mutable_grad().reset();
      red.arm(true);
      for (int i = 0; i < 3; ++i) {
        if (step == 1 && rank == 1 && i == 1) continue;
        if (step == 2 && i == 2) continue;
        red.add_gradient(i, grad_of(rank, i, params[i]));
      }
      red.finish();
      std::vector<double> v;
      for (auto& p : params) v.push_back(value(p.grad()));
      seen[rank].push_back(v);
    }
  });
  for (int r = 0; r < 2; ++r) {
    INFO("rank " << r);
    CHECK(seen[r][0] == std::vector<double>{1.5, 3.0, 4.5});
    CHECK(seen[r][1] == std::vector<double>{1.5, 1.0, 4.5});  // b: (2 + 0) / 2, not (2 + 4) / 2
    CHECK(seen[r][2][0] == 1.5);
    CHECK(seen[r][2][1] == 3.0);
    CHECK(std::isnan(seen[r][2][2]));  // unused everywhere: left untouched (none), as DDP
  }
}

TEST_CASE("without find_unused a parameter that got no gradient is an error naming it") {
  std::vector<std::string> errors(2);
  ranks(2, [&](int rank, c10::intrusive_ptr<PG> pg) {
    auto params = make_params();
    GradReducer red(params, {"fc.weight", "branch.weight", "fc.bias"}, pg, 2, tiny_buckets());
    red.arm(true);
    red.add_gradient(0, grad_of(rank, 0, params[0]));
    red.add_gradient(2, grad_of(rank, 2, params[2]));
    try {
      red.finish();
    } catch (const std::runtime_error& e) {
      errors[rank] = e.what();
    }
  });
  for (const auto& e : errors) CHECK_THAT(e, Catch::Contains("'branch.weight'") && Catch::Contains("--find-unused-parameters"));
}

TEST_CASE("a static graph learns the bucket order and the unused set on the first step") {
  std::vector<std::vector<std::vector<double>>> seen(2);
  std::vector<Plan> plans(2);
  ranks(2, [&](int rank, c10::intrusive_ptr<PG> pg) {
    auto params = make_params();
    auto o = tiny_buckets();
    o.static_graph = true;
    GradReducer red(params, {"a", "b", "c"}, pg, 2, o);
    for (int step = 0; step < 3; ++step) {
      for (auto& p : params) p.mutable_grad().reset();
      red.arm(true);
      // Rank 0 produces a then c; rank 1 only c: b is unused everywhere, a on rank 1.
      if (rank == 0) red.add_gradient(0, grad_of(rank, 0, params[0]));
      red.add_gradient(2, grad_of(rank, 2, params[2]));
      red.finish();
      std::vector<double> v;
      for (auto& p : params) v.push_back(value(p.grad()));
      seen[rank].push_back(v);
    }
    plans[rank] = red.plan();
  });
  for (int r = 0; r < 2; ++r) {
    for (const auto& v : seen[r]) {
      CHECK(v[0] == 0.5);
      CHECK(std::isnan(v[1]));
      CHECK(v[2] == 4.5);
    }
    CHECK(plans[r] == Plan{{0}, {2}, {1}});  // rank 0's arrival order (a, c), then the rest (b)
  }
}

TEST_CASE("gradients arriving through autograd hooks are averaged, accumulation micro-steps included") {
  std::vector<double> got(2);
  ranks(2, [&](int rank, c10::intrusive_ptr<PG> pg) {
    auto w = torch::ones({4}, torch::requires_grad());
    GradReducer red({w}, {"w"}, pg, 2, ReducerOptions{});
    red.arm(false);
    (w * (rank + 1.0)).sum().backward();  // local only: grad r+1
    red.arm(true);
    (w * 10.0).sum().backward();  // synchronised: r+1+10, averaged
    red.finish();
    got[rank] = value(w.grad());
  });
  CHECK(got == std::vector<double>{11.5, 11.5});
}

TEST_CASE("SyncBatchNorm over 2 ranks of batch B matches BatchNorm over the joint batch of 2B") {
  torch::manual_seed(3);
  auto x = torch::randn({8, 4, 5, 5});
  auto upstream = torch::randn({8, 4, 5, 5});
  SyncBatchNorm2d ref(4, nullptr);  // plain BatchNorm over all 8 samples
  auto xr = x.clone().requires_grad_();
  (ref(xr) * upstream).sum().backward();
  std::vector<torch::Tensor> grads(2), means(2), vars(2), wgrads(2);
  ranks(2, [&](int rank, c10::intrusive_ptr<PG> pg) {
    SyncBatchNorm2d bn(4, [pg](torch::Tensor& t) {
      std::vector<torch::Tensor> v{t};
      pg->allreduce(v)->wait();
    });
    auto xi = x.narrow(0, rank * 4, 4).clone().requires_grad_();
    (bn(xi) * upstream.narrow(0, rank * 4, 4)).sum().backward();
    grads[rank] = xi.grad();
    means[rank] = bn->running_mean.clone();
    vars[rank] = bn->running_var.clone();
    wgrads[rank] = bn->weight.grad().clone();
  });
  CHECK(torch::allclose(torch::cat({grads[0], grads[1]}), xr.grad(), 1e-4, 1e-5));
  for (int r = 0; r < 2; ++r) {
    CHECK(torch::allclose(means[r], ref->running_mean, 1e-5, 1e-6));
    CHECK(torch::allclose(vars[r], ref->running_var, 1e-5, 1e-6));
  }
  CHECK(torch::allclose(wgrads[0] + wgrads[1], ref->weight.grad(), 1e-4, 1e-5));
  // And without the all-reduce the statistics are the local ones: the check above can fail.
  SyncBatchNorm2d local(4, nullptr);
  local(x.narrow(0, 0, 4));
  CHECK_FALSE(torch::allclose(local->running_mean, ref->running_mean, 1e-5, 1e-6));
}
