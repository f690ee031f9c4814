// Bounded reaping of a child (the end of the run may not wait for ever on one process).
// Defined in process/spawn.cc, beside the spawner whose children it reaps.
#pragma once

#include <sys/types.h>

#include <chrono>

namespace mg {

// Reaps `pid`, a child of this process, by `deadline`, never in a blocking waitpid: it waits
// on the child's pidfd (readable once it exits), else in 5 ms slices. True once reaped
// (`status` set) or when it is no child of ours any more (ECHILD: reaped elsewhere, status
// 0); false at the deadline: it has not ended (SIGKILLed, yet in state D: a disk or a
// network file system), or it ended but another process traces it and has not waited for
// it (the kernel reports the exit to the tracer first), so we cannot reap it yet.
bool reap_by(pid_t pid, std::chrono::steady_clock::time_point deadline, int& status);

}  // namespace mg
