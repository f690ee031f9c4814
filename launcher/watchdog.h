// Watchdog: a tiny process the agent forks before it starts any worker and that outlives
// the agent by design, so that nothing a worker started survives the agent, at any depth,
// also after `kill -9` of the agent (PR_SET_PDEATHSIG reaches only the workers
// themselves, and when the agent dies its descendants are handed to init, out of reach).
//
// Every worker gets MGLAUNCH_RUN_MARK in its environment, holding a random token of this
// agent (appended to an outer agent's, when mglaunch runs inside a worker); a process
// keeps its environment across fork and exec unless it clears it, so the token marks the
// workers' children, grandchildren and daemons, even those that left the worker's process
// group or session. The watchdog holds the read end of a pipe whose write end only the
// agent holds; when it reads end-of-file (the agent exited or died) it SIGKILLs every
// process whose /proc/PID/environ holds the token and every process group that holds
// such a process, in rounds until none is left (bounded), and exits.
//
// The watchdog runs in its own process group (no terminal signal reaches it: Ctrl-C,
// Ctrl-Z), ignores SIGINT, SIGHUP, SIGTERM, SIGQUIT and SIGTSTP, holds no descriptor of
// the agent but its pipe, and uses only system calls after fork (the agent has threads).
#pragma once

#include <sys/types.h>

#include <string>
#include <string_view>

namespace mg {

inline constexpr const char* kRunMarkVar = "MGLAUNCH_RUN_MARK";

// True when the NUL-separated environment block `environ` holds `token` in the value of
// MGLAUNCH_RUN_MARK. Pure; async-signal-safe.
bool environ_has_mark(std::string_view environ, std::string_view token);

class Watchdog {
 public:
  Watchdog() = default;
  ~Watchdog() { release(); }
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

  // Forks the watchdog for a fresh random token. False (with `error`) when it cannot.
  bool start(std::string& error);
  // The value of MGLAUNCH_RUN_MARK for a worker, given the agent's own (inherited) value.
  std::string mark_value(const std::string& inherited) const;
  const std::string& token() const { return token_; }
  pid_t pid() const { return pid_; }
  // The agent reaped the watchdog (it died early: the guarantee is gone).
  void forget() { pid_ = -1; }
  // Closes the pipe (the watchdog kills what carries the token) and waits for it to
  // finish, at most `wait_ms`.
  void release(int wait_ms = 10000);

 private:
  std::string token_;
  pid_t pid_ = -1;
  int pipe_fd_ = -1;
};

}  // namespace mg
