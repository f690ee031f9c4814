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
//
// With an offset (set_epoch's second argument) the epoch starts at that position of the
// permutation: the positions before it were consumed at another world size (in-place
// recovery into a new world, docs/mgtrain.md), and the rest, padded and dealt the same way,
// is this world's share of the epoch. After m micro-batches of b samples on every rank of a
// world w, positions [offset, offset + min(m*b, num_samples()) * w) are consumed: consumed().
class DistributedSampler {
 public:
  DistributedSampler(std::int64_t n, int replicas, int rank, bool shuffle, std::uint64_t seed, bool drop_last);
  void set_epoch(std::int64_t epoch, std::int64_t offset = 0);
  std::vector<std::int64_t> indices() const;
  std::int64_t num_samples() const { return num_samples_; }
  // The permutation positions consumed once every rank took `per_rank` samples of this
  // epoch (offset included), at most n.
  std::int64_t consumed(std::int64_t per_rank) const;

 private:
  std::int64_t n_;
  int replicas_, rank_;
  bool shuffle_, drop_last_;
  std::uint64_t seed_;
  std::int64_t epoch_ = 0, offset_ = 0;
  std::int64_t num_samples_;
};

}  // namespace mg::data
