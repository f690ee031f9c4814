// The spawner of the process layer: every program the product starts goes through
// spawn_process() (workers, the watchdog, ssh clients, helper commands: process/run.h's
// run_capture is built on it).
//
// The mechanism is glibc's posix_spawn (sysdeps/unix/sysv/linux/spawni.c): the parent
// blocks every signal, then clone(CLONE_VM | CLONE_VFORK) runs the child on a stack of its
// own, in the parent's memory, while the calling thread waits; the calling thread goes on
// once the child has exec'd its program or exited. The child, in order:
//   1. resets every signal's action to SIG_DFL, in a loop over 1.._NSIG-1 (what the parent
//      ignored too: a worker starts as it would from a fresh shell);
//   2. own_group: its own process group (setpgid(0, 0));
//   3. die_with_parent: PR_SET_PDEATHSIG SIGKILL, and exits at once when the parent is
//      already gone. The kernel ties the death signal to the THREAD that made the child:
//      it comes when that thread ends, not only the process. The agent spawns from its one
//      io thread, which lives as long as the agent; other callers spawn from a thread that
//      outlives the child, or leave die_with_parent off;
//   4. the CPU set and RLIMIT_NOFILE when given;
//   5. stdin, stdout and stderr from `fds` (-1: the parent's own one, inherited), every other
//      descriptor close-on-exec (close_range CLOSE_RANGE_CLOEXEC, or a listing of
//      /proc/self/fd before Linux 5.11): nothing of the parent (sockets, other workers'
//      pipes, log files) reaches the program;
//   6. an empty signal mask, then execve.
// A step that fails (the exec of a file that is not a program, setpgid, ...) leaves its
// name and errno in memory the parent reads (the child shares it), and the child exits 127;
// the parent reaps that child and spawn_process() returns -1 with the step and errno. So
// when spawn_process() returns a pid, that process runs `path`; the kernel closes the
// descriptors it held for a moment (the parent's close-on-exec ones) within that execve,
// just after letting the parent go on.
//
// The child only makes async-signal-safe calls, allocates nothing and takes no lock; it
// shares the parent's memory and thread-local storage (errno) while the calling thread is
// suspended, as in posix_spawn. Any thread may spawn; each call is independent.
#pragma once

#include <sched.h>
#include <sys/resource.h>
#include <sys/types.h>

#include <string>

namespace mg {

struct SpawnRequest {
  const char* path = nullptr;          // what runs (no PATH search: process/command.h's find_executable)
  const char* const* argv = nullptr;   // argv[0] is what the program sees as its name
  const char* const* envp = nullptr;   // the whole environment, "KEY=VALUE"
  int fds[3] = {-1, -1, -1};           // the child's 0, 1, 2; -1: the parent's own (inherited)
  const cpu_set_t* cpus = nullptr;     // nullptr: keep the parent's affinity
  const struct rlimit* nofile = nullptr;  // RLIMIT_NOFILE for the child (nullptr: the parent's)
  bool own_group = true;               // its own process group, led by itself
  bool die_with_parent = true;         // PR_SET_PDEATHSIG SIGKILL (see above: tied to the calling thread)
};

// Why no program runs: the step that failed and its errno.
struct SpawnError {
  const char* step = nullptr;  // "clone" or "mmap" (the parent could make no child), "execve", "setpgid", ...
  int code = 0;                // errno
  // The parent could make no child (clone or mmap failed): EAGAIN or ENOMEM mean a process
  // or memory limit, not a missing program.
  bool no_child() const;
  // "execve: No such file or directory".
  std::string message() const;
};

// Starts the program; the pid, or -1 with `error` (and errno) set. The strings and arrays
// `req` points to need only outlive the call. The caller reaps the child (waitpid).
pid_t spawn_process(const SpawnRequest& req, SpawnError& error);

// Sets FD_CLOEXEC on every descriptor above 2, so that exec() passes on only stdin,
// stdout and stderr. Async-signal-safe (close_range with CLOSE_RANGE_CLOEXEC, Linux >= 5.11,
// else getdents64 on /proc/self/fd). False (errno set) when neither works.
bool mark_cloexec_above_stderr();
// The fallback alone (kernels before 5.11); exposed for its test.
bool mark_cloexec_above_stderr_by_listing();

}  // namespace mg
