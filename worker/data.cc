#include "worker/data.h"

#include <zlib.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

namespace mg::data {
namespace {

std::vector<unsigned char> read_gz(const std::string& path) {
  gzFile f = gzopen(path.c_str(), "rb");
  if (!f)
    throw std::runtime_error("cannot open " + path +
                             ": install Debian's dataset-fashion-mnist or point --data-dir at the IDX .gz files");
  std::vector<unsigned char> out;
  unsigned char buf[1 << 16];
  int n;
  while ((n = gzread(f, buf, sizeof(buf))) > 0) out.insert(out.end(), buf, buf + n);
  const bool failed = n < 0;
  gzclose(f);
  if (failed) throw std::runtime_error("corrupt gzip data in " + path);
  return out;
}

std::uint32_t be32(const std::vector<unsigned char>& b, std::size_t off) {
  return (std::uint32_t{b[off]} << 24) | (std::uint32_t{b[off + 1]} << 16) | (std::uint32_t{b[off + 2]} << 8) |
         std::uint32_t{b[off + 3]};
}

}  // namespace

Dataset load_fashion_mnist(const std::string& dir, bool train, std::int64_t limit) {
  const std::string prefix = dir + "/" + (train ? "train" : "t10k");
  auto images = read_gz(prefix + "-images-idx3-ubyte.gz");
  auto labels = read_gz(prefix + "-labels-idx1-ubyte.gz");
  if (images.size() < 16 || be32(images, 0) != 0x803 || labels.size() < 8 || be32(labels, 0) != 0x801)
    throw std::runtime_error("bad IDX header in " + prefix + "-*-ubyte.gz");
  std::int64_t n = be32(images, 4);
  Dataset d;
  d.rows = be32(images, 8);
  d.cols = be32(images, 12);
  if (be32(labels, 4) != n || images.size() != 16 + std::size_t(n * d.rows * d.cols) || labels.size() != 8 + std::size_t(n))
    throw std::runtime_error("IDX sizes do not match in " + prefix + "-*-ubyte.gz");
  if (limit >= 0) n = std::min(n, limit);
  const std::int64_t px = d.rows * d.cols;
  d.images.resize(std::size_t(n * px));
  d.labels.resize(std::size_t(n));
  constexpr float kMean = 0.2860f, kStd = 0.3530f;  // Fashion-MNIST training-set statistics
  for (std::int64_t i = 0; i < n * px; ++i) d.images[i] = (images[16 + i] / 255.0f - kMean) / kStd;
  for (std::int64_t i = 0; i < n; ++i) d.labels[i] = labels[8 + i];
  return d;
}

Dataset make_synthetic(std::int64_t n, std::uint64_t seed) {
  Dataset d;
  const std::int64_t px = d.rows * d.cols;
  d.images.resize(std::size_t(n * px));
  d.labels.resize(std::size_t(n));
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> noise(0.0f, 0.5f);
  for (std::int64_t i = 0; i < n; ++i) {
    const int label = static_cast<int>(rng() % 10);
    d.labels[i] = label;
    // Each class lights a different 7x7 block of a 4x4 grid (cells 0..9).
    const int br = (label / 4) * 7, bc = (label % 4) * 7;
    for (std::int64_t r = 0; r < d.rows; ++r)
      for (std::int64_t c = 0; c < d.cols; ++c) {
        const bool lit = r >= br && r < br + 7 && c >= bc && c < bc + 7;
        d.images[i * px + r * d.cols + c] = (lit ? 1.5f : -0.5f) + noise(rng);
      }
  }
  return d;
}

DistributedSampler::DistributedSampler(std::int64_t n, int replicas, int rank, bool shuffle, std::uint64_t seed,
                                       bool drop_last)
    : n_(n), replicas_(replicas), rank_(rank), shuffle_(shuffle), drop_last_(drop_last), seed_(seed) {
  if (replicas < 1 || rank < 0 || rank >= replicas) throw std::invalid_argument("sampler: rank must be in [0, replicas)");
  set_epoch(0, 0);
}

void DistributedSampler::set_epoch(std::int64_t epoch, std::int64_t offset) {
  epoch_ = epoch;
  offset_ = std::clamp<std::int64_t>(offset, 0, n_);
  const std::int64_t left = n_ - offset_;
  num_samples_ = drop_last_ && left % replicas_ != 0 ? left / replicas_ : (left + replicas_ - 1) / replicas_;
}

std::int64_t DistributedSampler::consumed(std::int64_t per_rank) const {
  return std::min(n_, offset_ + std::min(per_rank, num_samples_) * replicas_);
}

std::vector<std::int64_t> DistributedSampler::indices() const {
  std::vector<std::int64_t> perm(static_cast<std::size_t>(n_));
  std::iota(perm.begin(), perm.end(), 0);
  if (shuffle_) {
    std::mt19937_64 rng(seed_ + static_cast<std::uint64_t>(epoch_));
    std::shuffle(perm.begin(), perm.end(), rng);
  }
  std::vector<std::int64_t> all(perm.begin() + offset_, perm.end());
  const std::int64_t left = n_ - offset_;
  const std::int64_t total = num_samples_ * replicas_;
  if (total > left && left > 0) {
    for (std::int64_t i = left; i < total; ++i) all.push_back(all[std::size_t((i - left) % left)]);
  } else {
    all.resize(std::size_t(total));
  }
  std::vector<std::int64_t> mine;
  mine.reserve(std::size_t(num_samples_));
  for (std::int64_t i = rank_; i < total; i += replicas_) mine.push_back(all[std::size_t(i)]);
  return mine;
}

}  // namespace mg::data
