#include <catch2/catch.hpp>

#include <algorithm>
#include <filesystem>
#include <set>

#include "worker/data.h"

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
  DistributedSampler a(1000, 2, 0, true, 1, false), b(1000, 2, 0, true, 1, false);
  a.set_epoch(0);
  b.set_epoch(0);
  CHECK(a.indices() == b.indices());
  b.set_epoch(1);
  CHECK(a.indices() != b.indices());
  DistributedSampler plain(10, 2, 1, false, 0, false);
  CHECK(plain.indices() == std::vector<std::int64_t>{1, 3, 5, 7, 9});
}

TEST_CASE("the synthetic dataset is deterministic and Fashion-MNIST loads with its documented shape") {
  auto a = mg::data::make_synthetic(50, 3), b = mg::data::make_synthetic(50, 3);
  CHECK(a.images == b.images);
  CHECK(a.labels == b.labels);
  CHECK_THROWS_WITH(mg::data::load_fashion_mnist("/nonexistent", true), Catch::Contains("dataset-fashion-mnist"));
  if (!std::filesystem::exists("/usr/share/datasets/fashion-mnist")) {
    WARN("skipped: Fashion-MNIST is not installed (apt-get install dataset-fashion-mnist)");
    return;
  }
  auto test = mg::data::load_fashion_mnist("/usr/share/datasets/fashion-mnist", false, 100);
  CHECK(test.size() == 100);
  CHECK(test.rows == 28);
  CHECK(test.images.size() == 100 * 28 * 28);
  CHECK(*std::max_element(test.labels.begin(), test.labels.end()) <= 9);
}
