// run_capture: a short helper command (scontrol, a python probe) started through the one
// spawner (process/spawn.h), its stdout read under a deadline. For programs that end by
// themselves in seconds; long-lived children (workers, ssh, sbatch --wait) use
// spawn_process() with their own pipes and reaping.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstddef>
#include <string>
#include <vector>

namespace mg {

struct RunOptions {
  // Past it the command's process group is killed (SIGKILL) and the result says timed_out.
  std::chrono::milliseconds timeout{std::chrono::seconds(60)};
  bool merge_stderr = false;              // stderr into the captured output; false: /dev/null
  std::size_t max_output = std::size_t{1} << 20;  // bytes kept; the rest is read and dropped
  const char* const* envp = nullptr;      // nullptr: this process's environment
};

struct RunResult {
  bool started = false;     // false: `error` says why nothing ran (not found, not a program)
  bool timed_out = false;   // killed at the deadline
  int status = 0;           // the raw wait status once it ended
  std::string out;          // stdout (and stderr with merge_stderr), at most max_output bytes
  std::string error;        // why it did not start, or that it was killed at the deadline
  // Started, ended by itself with exit code 0.
  bool ok() const;
};

// Runs argv (argv[0] looked up on $PATH like execvp) with stdin from /dev/null, in its own
// process group, and returns its output and wait status. Blocks until the command has
// ended and been reaped, at most `o.timeout` (plus at most 2 s for the SIGKILLed command to
// be reaped; one that cannot be, in state D or traced, is left behind and `error` says so). Whatever
// the command leaves in its process group once it has ended is killed too, so a straggler
// cannot hold the pipe open. Reaps only its own child (waitpid by pid). Never throws for a
// command that cannot run: `started` is false and `error` is one line.
RunResult run_capture(const std::vector<std::string>& argv, const RunOptions& o = {});

}  // namespace mg
