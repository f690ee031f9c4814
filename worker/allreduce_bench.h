// mgtrain --bench allreduce: nccl-tests' columns (size, count, type, time, algbw, busbw,
// #wrong) over the trainer's process group. Included only by torch units.
#pragma once

#include "worker/comm.h"

namespace mg::train {

// Returns the exit code: 0 when every element of every size was right, else 1.
int run_allreduce_bench(const Options& o, Comm& comm);

}  // namespace mg::train
