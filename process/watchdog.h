// The watchdog (see below) and the run mark its agent gives to the workers.
// Watchdog: a small program the agent starts (process/spawn.h) before any worker and that
// outlives the agent by design, so that nothing a worker started survives the agent, at any depth,
// also after `kill -9` of the agent (PR_SET_PDEATHSIG reaches only the workers
// themselves, and when the agent dies its descendants are handed to init, out of reach).
//
// While the agent lives, the watchdog takes a snapshot of the agent's descendants
// (pid and start time, from /proc) about once a second; the agent is a child subreaper,
// so every process a worker started, even one that called setsid() or double-forked,
// stays below the agent. Every worker also gets MGLAUNCH_RUN_MARK in its environment,
// holding a random token of this agent (appended to an outer agent's, when mglaunch runs
// inside a worker). The watchdog holds the read end of a pipe whose write end only the
// agent holds; when it reads end-of-file (the agent exited or died) it stops, then
// SIGKILLs:
//   - every process of the last snapshot that is still the same process (same start
//     time: a reused pid is spared), whatever it did to its environment or name;
//   - every descendant of those, as /proc shows them then;
//   - every process carrying the token that started after the last snapshot (it could
//     not be in it yet: a daemon started in the agent's last second) and is an orphan of
//     the agent's tree: going up through processes that are fresh too, the first older
//     one is the agent or one of its ancestors (where orphans land: the agent while it
//     lives, as a subreaper; init or a subreaper above it after). A process that carries
//     the token but was already alive, and not a descendant, at the last snapshot is not
//     ours (a copied environment: tmux, at, a batch job) and is spared, and so are its
//     new children. The environment of a process in state D is not read (the read can
//     block for ever on its memory-map lock): such a process is spared, counted in the
//     trace ("environ not read (state D) N");
//   - the process groups whose leader is one of those.
// At a normal end the agent first checks that nothing below it is alive (no descendant
// can leave a live subreaper's tree); then it writes one byte before closing the pipe, and
// the watchdog exits at once without that sweep, which could find nothing.
// It first SIGSTOPs each victim and rescans until no new one appears (a process cannot
// fork past it), then SIGKILLs them all, in bounded rounds, and exits. Each signal goes
// through a pidfd after re-checking the start time (signal_same_process), so a pid
// reused since the scan is never hit. Its tables hold at most 65,536 processes; when one
// is full it says so once on the agent's stderr ("mglaunch: warning: watchdog: ...").
//
// The watchdog runs in its own process group (no terminal signal reaches it: Ctrl-C,
// Ctrl-Z), ignores SIGINT, SIGHUP, SIGTERM, SIGQUIT and SIGTSTP, and holds no descriptor of
// the agent but its pipe (its stdin) and the agent's stderr (for that one warning).
//
// It is an ordinary program, exec'd: the agent's own binary (/proc/self/exe) with the
// hidden first argument kWatchdogMode, which main() hands to watchdog_main() before
// anything else. Its own binary rather than a helper next to it: nothing to find or to
// install beside mglaunch, and the same code (a replaced binary on disk does not matter:
// /proc/self/exe is the running one). The agent passes its own and its ancestors' pid and
// start time as arguments, the token in the watchdog's environment (MGLAUNCH_WATCHDOG_TOKEN:
// readable only by the user, unlike the command line).
// MGLAUNCH_WATCHDOG_TRACE=FILE (a diagnostic and test seam) makes it append one line per
// snapshot ("snapshot N") and per kill round to FILE; MGLAUNCH_WATCHDOG_MAX_PROCS=N (a
// test seam) lowers the table size to N.
#pragma once

#include <sys/types.h>

#include <string>
#include <string_view>

#include "process/proc.h"  // signal_same_process

namespace mg {

inline constexpr const char* kRunMarkVar = "MGLAUNCH_RUN_MARK";
// argv[1] of the hidden mode of a program that runs watchdog_main (mglaunch, the tests).
inline constexpr const char* kWatchdogMode = "__mglaunch_watchdog__";

// True when the NUL-separated environment block `environ` holds `token` in the value of
// MGLAUNCH_RUN_MARK. Pure.
bool environ_has_mark(std::string_view environ, std::string_view token);

// The watchdog program: argv[1] is kWatchdogMode, then "--agent PID:START", one
// "--ancestor PID:START" per ancestor of the agent (the agent first, up to pid 1) and
// optionally "--tree DIR"; its stdin is the agent's pipe. Returns the exit code (2: bad
// arguments).
int watchdog_main(int argc, char** argv);

class Watchdog {
 public:
  Watchdog() = default;
  ~Watchdog() { release(); }
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

  // Starts the watchdog, `program` in kWatchdogMode (default: this process's own binary),
  // for a fresh random token. False (with `error`) when it cannot.
  bool start(std::string& error, const char* program = "/proc/self/exe");
  // Before start(): the run's temporary directory, which nobody else knows of. Should the
  // agent die without let_go() (kill -9), the watchdog removes it after its sweep.
  static void set_temporary_tree(std::string_view path);
  // The value of MGLAUNCH_RUN_MARK for a worker, given the agent's own (inherited) value.
  std::string mark_value(const std::string& inherited) const;
  const std::string& token() const { return token_; }
  pid_t pid() const { return pid_; }
  // The agent reaped the watchdog (it died early: the guarantee is gone).
  void forget() { pid_ = -1; }
  // Closes the pipe (the watchdog kills what carries the token) and waits for it to
  // finish, at most `wait_ms`. `clean`: the agent saw nothing of its tree left alive
  // (WorkerGroup::close): the watchdog is told so first and exits without its
  // sweep, which would find nothing (a descendant cannot leave a live subreaper's tree).
  void release(bool clean = false, int wait_ms = 10000);
  // The first half of release(): closes the pipe (telling the watchdog first when `clean`)
  // without waiting, so the agent can tidy up while the watchdog exits; release() (or the
  // destructor) then waits for it.
  void let_go(bool clean);
  // let_go() (or release()) was called: the watchdog's exit is expected now.
  bool let_go_done() const { return pipe_fd_ < 0; }

 private:
  std::string token_;
  pid_t pid_ = -1;
  int pipe_fd_ = -1;
};

}  // namespace mg
