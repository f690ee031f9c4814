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

TEST_CASE("a world size change mid-epoch deals the epoch's unconsumed samples to the new world: every sample once") {
  // World 2 took 3 micro-batches of 8 per rank of a 103-sample epoch (positions [0, 48) of
  // the permutation), then goes on at world 1, 3 or 2 from there.
  const std::int64_t n = 103, bs = 8, micro = 3;
  for (int new_world : {1, 3, 2}) {
    INFO("new world " << new_world);
    std::multiset<std::int64_t> seen;
    std::int64_t offset = 0;
    for (int r = 0; r < 2; ++r) {
      DistributedSampler s(n, 2, r, true, 7, false);
      s.set_epoch(4);
      auto idx = s.indices();
      seen.insert(idx.begin(), idx.begin() + micro * bs);
      offset = s.consumed(micro * bs);
    }
    CHECK(offset == 48);
    std::int64_t dealt = 0;
    for (int r = 0; r < new_world; ++r) {
      DistributedSampler s(n, new_world, r, true, 7, false);
      s.set_epoch(4, offset);
      auto idx = s.indices();
      CHECK(static_cast<std::int64_t>(idx.size()) == s.num_samples());
      CHECK(s.num_samples() == (n - offset + new_world - 1) / new_world);
      dealt += static_cast<std::int64_t>(idx.size());
      seen.insert(idx.begin(), idx.end());
    }
    // Each of the 103 samples at least once; the repeats are the new world's padding only.
    for (std::int64_t i = 0; i < n; ++i) CHECK(seen.count(i) >= 1);
    CHECK(static_cast<std::int64_t>(seen.size()) == 48 + dealt);
    CHECK(dealt - (n - offset) < new_world);
  }
  // An offset at the end of the epoch leaves nothing to deal; an offset of 0 is the usual epoch.
  DistributedSampler done(n, 2, 1, true, 7, false);
  done.set_epoch(4, n);
  CHECK(done.num_samples() == 0);
  CHECK(done.indices().empty());
  DistributedSampler a(n, 2, 1, true, 7, false), b(n, 2, 1, true, 7, false);
  a.set_epoch(4);
  b.set_epoch(4, 0);
  CHECK(a.indices() == b.indices());
}
