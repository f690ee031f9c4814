// The spawner of the process layer: every program the agent starts goes through
// spawn_process().
#pragma once

#include <sched.h>
#include <sys/resource.h>
#include <sys/types.h>

#include <chrono>
#include <memory>
#include <string>

namespace mg {

// Starts `path` and returns at once, without waiting for the child's exec: a child that
// has to wait for a CPU on a busy machine no longer holds up the agent, so the agent
// starts the next worker meanwhile. The child is made with clone(CLONE_VM) (no copy of
// the agent's memory: start time does not grow with the agent's size) on a stack of its
// own, and runs only raw system calls until its exec: stdin/stdout/stderr from `fds`,
// every other descriptor closed on exec, its own process group, PR_SET_PDEATHSIG SIGKILL
// (and _exit if the parent is already gone), the CPU set and descriptor limit when given,
// default signal dispositions and an empty signal mask. Where raw system calls or
// close_range(CLOSE_RANGE_CLOEXEC) are missing (not x86-64 or arm64, Linux < 5.11) the
// agent waits for the exec as before (CLONE_VFORK); the results are the same.
//
// Returns the pid, or -1 with `error` set when no child could be made (clone failed;
// errno is clone's: EAGAIN or ENOMEM for a process limit).
// When a step in the child fails (the exec of a file that is not a program, setpgid, ...)
// the child exits with status 127 and, once the caller has reaped it, ticket.failure()
// says which step and why ("execve: Exec format error").
//
// Lifetimes: the strings and arrays `req` points to must stay valid until the child has
// exec'd or exited (ticket.settled(), always true once it was reaped). A ticket destroyed
// before then hands the child's state to a pool that frees it once the child settles; a
// ticket whose child has not settled cannot start another (-1, errno EBUSY). One thread
// spawns at a time.
struct SpawnRequest {
  const char* path = nullptr;
  const char* const* argv = nullptr;
  const char* const* envp = nullptr;
  int fds[3] = {-1, -1, -1};
  const cpu_set_t* cpus = nullptr;  // nullptr: keep the agent's affinity (copied: need not outlive the call)
  const struct rlimit* nofile = nullptr;  // RLIMIT_NOFILE for the child (the agent may have raised its own; copied)
  bool wait_exec = false;  // wait for the exec (CLONE_VFORK) even where not needed (tests)
};
class SpawnTicket {
 public:
  SpawnTicket();
  ~SpawnTicket();
  SpawnTicket(const SpawnTicket&) = delete;
  SpawnTicket& operator=(const SpawnTicket&) = delete;
  // The child has exec'd its program or exited: its stack and the request are free.
  bool settled() const;
  // Why the child could not run its program ("execve: No such file or directory"), "" if
  // it did (or it has not got that far yet). Read it after the child was reaped.
  std::string failure() const;
  struct State;

 private:
  friend pid_t spawn_process(const SpawnRequest&, SpawnTicket&, std::string&);
  std::unique_ptr<State> state_;
};
pid_t spawn_process(const SpawnRequest& req, SpawnTicket& ticket, std::string& error);
// Waits, at most `timeout`, until every child spawn_process() has made so far has exec'd or
// exited; true if all have. Until its exec a child holds copies of the agent's descriptors
// (a held master port, listeners): the agent calls this before it lets a port go.
bool spawn_settle_all(std::chrono::milliseconds timeout);
// Whether spawn_process() returns before the child's exec on this machine (false: it waits,
// CLONE_VFORK). For tests and diagnostics.
bool spawn_skips_exec_wait();

// Sets FD_CLOEXEC on every descriptor above 2, so that exec() passes on only stdin,
// stdout and stderr. For the child side of any spawn (between fork and exec): only
// async-signal-safe calls (close_range with CLOSE_RANGE_CLOEXEC, Linux >= 5.11, else
// getdents64 on /proc/self/fd). False (errno set) when neither works.
bool mark_cloexec_above_stderr();
// The fallback alone (kernels before 5.11); exposed for its test.
bool mark_cloexec_above_stderr_by_listing();

}  // namespace mg
