// Data for mgtrain, with no torch dependency so it is unit-tested with the launcher's
// tests: Fashion-MNIST from gzipped IDX files, a deterministic synthetic set, and a
// sampler with torch.utils.data.DistributedSampler's semantics.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace mg::data {

struct Dataset {
  std::int64_t rows = 28, cols = 28;
  std::vector<float> images;         // n * rows * cols, normalised
  std::vector<std::int64_t> labels;  // n, in 0..9
  std::int64_t size() const { return static_cast<std::int64_t>(labels.size()); }
};

// Reads {dir}/{train,t10k}-{images-idx3,labels-idx1}-ubyte.gz. Throws std::runtime_error
// naming the file (and the Debian package dataset-fashion-mnist) when missing or corrupt.
Dataset load_fashion_mnist(const std::string& dir, bool train, std::int64_t limit = -1);

// A deterministic 10-class set of 28x28 images (class-dependent blobs plus noise).
Dataset make_synthetic(std::int64_t n, std::uint64_t seed);

// DistributedSampler: permutation of range(n) from seed+epoch (when shuffling), padded
// by repeating from the start to a multiple of `replicas` (or truncated with drop_last),
// then rank r takes positions r, r+replicas, ...
class DistributedSampler {
 public:
  DistributedSampler(std::int64_t n, int replicas, int rank, bool shuffle, std::uint64_t seed, bool drop_last);
  void set_epoch(std::int64_t epoch) { epoch_ = epoch; }
  std::vector<std::int64_t> indices() const;
  std::int64_t num_samples() const { return num_samples_; }

 private:
  std::int64_t n_;
  int replicas_, rank_;
  bool shuffle_, drop_last_;
  std::uint64_t seed_;
  std::int64_t epoch_ = 0;
  std::int64_t num_samples_;
};

}  // namespace mg::data
