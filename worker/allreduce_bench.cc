#include "worker/allreduce_bench.h"

#include <chrono>
#include <cstdio>

namespace mg::train {

int run_allreduce_bench(const Options& o, Comm& comm) {
  const torch::ScalarType dtype = o.dtype == "float" ? torch::kFloat : o.dtype == "double" ? torch::kDouble
                                  : o.dtype == "half"   ? torch::kHalf
                                  : o.dtype == "int"    ? torch::kInt
                                                        : throw SetupError("--dtype: use float, double, half or int");
  const std::int64_t esize = c10::elementSize(dtype);
  const std::int64_t lo = std::max<std::int64_t>(esize, parse_bytes(o.min_bytes)), hi = parse_bytes(o.max_bytes);
  if (comm.rank == 0) {
    std::printf("# mgtrain allreduce benchmark: backend %s, world %d, %d iters after %d warm-up\n", comm.backend.c_str(),
                comm.world, o.iters, o.warmup);
    std::printf("%12s %12s %8s %12s %10s %10s %8s\n", "size(B)", "count", "type", "time(us)", "algbw(GB/s)", "busbw(GB/s)",
                "#wrong");
  }
  auto sync = [&] {
#ifdef MGLAUNCH_WITH_NCCL
    if (comm.device.is_cuda()) torch::cuda::synchronize();
#endif
  };
  long total_wrong = 0;
  for (std::int64_t bytes = lo; bytes <= hi;
       bytes = std::max<std::int64_t>(bytes + esize, static_cast<std::int64_t>(static_cast<double>(bytes) * o.step_factor))) {
    const std::int64_t count = bytes / esize;
    auto t = torch::ones({count}, torch::TensorOptions().dtype(dtype).device(comm.device));
    std::vector<torch::Tensor> v{t};
    for (int i = 0; i < o.warmup; ++i) comm.pg->allreduce(v)->wait();
    sync();
    comm.pg->barrier()->wait();
    auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < o.iters; ++i) comm.pg->allreduce(v)->wait();
    sync();
    const double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / o.iters;
    // Correctness: rank r contributes r+1, so every element must be world*(world+1)/2.
    t.fill_(comm.rank + 1);
    comm.pg->allreduce(v)->wait();
    sync();
    const double expect = comm.world * (comm.world + 1) / 2.0;
    long wrong = t.to(torch::kCPU).to(torch::kDouble).ne(expect).sum().item<long>();
    total_wrong += wrong;
    const double algbw = static_cast<double>(bytes) / us / 1e3;
    const double busbw = algbw * 2.0 * (comm.world - 1) / comm.world;
    if (comm.rank == 0)
      std::printf("%12lld %12lld %8s %12.1f %10.3f %10.3f %8ld\n", static_cast<long long>(bytes),
                  static_cast<long long>(count), o.dtype.c_str(), us, algbw, busbw, wrong);
  }
  std::fflush(stdout);
  return total_wrong == 0 ? 0 : 1;
}

}  // namespace mg::train
