#include <catch2/catch.hpp>

#include <algorithm>
#include <filesystem>
#include <set>

#include "worker/data.h"
#include "support/skip.h"

using mg::data::DistributedSampler;

TEST_CASE("sampler shards are disjoint and together cover the dataset") {
  const std::int64_t n = 103;
  std::multiset<std::int64_t> seen;
  for (int r = 0; r < 4; ++r) {
    DistributedSampler s(n, 4, r, true, 7, false);
    s.set_epoch(3);
    auto idx = s.indices();
    CHECK(static_cast<std::int64_t>(idx.size()) == s.num_samples());
    CHECK(s.num_samples() == 26);
    seen.insert(idx.begin(), idx.end());
  }
  CHECK(seen.size() == 104);  // padded by one repeat, as torch does
  for (std::int64_t i = 0; i < n; ++i) CHECK(seen.count(i) >= 1);
}

TEST_CASE("drop_last truncates instead of padding") {
  std::set<std::int64_t> seen;
  for (int r = 0; r < 4; ++r) {
    DistributedSampler s(103, 4, r, false, 0, true);
    auto idx = s.indices();
    CHECK(idx.size() == 25);
    for (auto i : idx) CHECK(seen.insert(i).second);
  }
  CHECK(seen.size() == 100);
}

TEST_CASE("shuffling changes per epoch and is the same on every rank for an epoch") {
  // Rank 0 and rank 1 must split one permutation: disjoint halves that cover the data set
  // (ranks shuffling differently would overlap), and not the unshuffled stride.
  DistributedSampler r0(1000, 2, 0, true, 1, false), r1(1000, 2, 1, true, 1, false);
  r0.set_epoch(0);
  r1.set_epoch(0);
  const auto a = r0.indices(), b = r1.indices();
  std::set<std::int64_t> all(a.begin(), a.end());
  all.insert(b.begin(), b.end());
  CHECK(all.size() == 1000);
  DistributedSampler unshuffled(1000, 2, 0, false, 1, false);
  CHECK(a != unshuffled.indices());
  r0.set_epoch(1);
  CHECK(r0.indices() != a);
  DistributedSampler again(1000, 2, 0, true, 1, false);  // a new process, same seed and epoch
  again.set_epoch(0);
  CHECK(again.indices() == a);
  DistributedSampler plain(10, 2, 1, false, 0, false);
  CHECK(plain.indices() == std::vector<std::int64_t>{1, 3, 5, 7, 9});
}

TEST_CASE("the synthetic dataset is deterministic and Fashion-MNIST loads with its documented shape") {
  auto a = mg::data::make_synthetic(50, 3), b = mg::data::make_synthetic(50, 3);
  CHECK(a.images == b.images);
  CHECK(a.labels == b.labels);
  CHECK_THROWS_WITH(mg::data::load_fashion_mnist("/nonexistent", true), Catch::Contains("dataset-fashion-mnist"));
  mgtest::require_path("/usr/share/datasets/fashion-mnist", "dataset-fashion-mnist");
  auto test = mg::data::load_fashion_mnist("/usr/share/datasets/fashion-mnist", false, 100);
  CHECK(test.size() == 100);
  CHECK(test.rows == 28);
  CHECK(test.images.size() == 100 * 28 * 28);
  CHECK(*std::max_element(test.labels.begin(), test.labels.end()) <= 9);
}
