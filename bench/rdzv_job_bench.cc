// rdzv_job_bench: N agents through the rendezvous job state machine in one process (no
// sockets: these machines cap descriptors at 20,000), each assignment encoded as the
// server would send it. Prints the time from the first join to the last encoded frame.
// A real 100k-node run would be driven from many client machines (or network namespaces)
// of up to ~20k connections each against one daemon with a raised descriptor limit.
// Usage: rdzv_job_bench [N]
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>

#include <fmt/format.h>

#include "proto/frame.h"
#include "proto/wire.h"
#include "rendezvous/job.h"

using namespace mg;

int main(int argc, char** argv) {
  const int n = argc > 1 ? std::atoi(argv[1]) : 100000;
  if (n < 1 || n > proto::kMaxNodes) {
    std::fprintf(stderr, "rdzv_job_bench: N must be 1..%d\n", proto::kMaxNodes);
    return 2;
  }
  rdzv::Job job("bench");
  const auto now = rdzv::Clock::now();
  const auto t0 = std::chrono::steady_clock::now();
  std::size_t frames = 0, bytes = 0, log_bytes = 0;
  std::vector<std::uint8_t> wire;  // each frame as the server writes it
  for (int i = 0; i < n; ++i) {
    proto::Join j;
    j.job_id = "bench";
    j.agent_id = fmt::format("sim-{}", i);
    j.host = fmt::format("sim{}", i);
    j.addr = fmt::format("10.{}.{}.{}", i >> 16, (i >> 8) & 255, i & 255);
    j.min_nodes = j.max_nodes = n;
    for (const auto& out : job.join(static_cast<rdzv::SessionId>(i + 1), j, now)) {
      wire.clear();
      proto::append_frame(out.frame, wire);
      bytes += wire.size();
      ++frames;
    }
    // The job's events, taken and formatted as the daemon logs them (#38).
    for (const auto& e : job.take_events()) log_bytes += rdzv::text_of(e).size();
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("%d agents through the job state machine: %zu assignments (%zu bytes), %zu bytes of event log, in %.3f s\n",
              n, frames, bytes, log_bytes, secs);
  return frames == static_cast<std::size_t>(n) ? 0 : 1;
}
