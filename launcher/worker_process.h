// WorkerProcess: one supervised worker. It owns the child (its own process group, killed
// with the agent via PR_SET_PDEATHSIG), its stdout/stderr pipes, their log files and the
// line relay to the Console. Everything arrives as Asio completions on the agent's single
// io_context: pipe reads, the drain timer; the exit comes from the agent's one reaper
// (waitpid(-1) on SIGCHLD), which calls on_exit(). A worker costs the agent one or two
// descriptors (its pipes, one when stdout and stderr are merged) plus its log files, no
// pidfd. Destroying a handle whose child still runs SIGKILLs and reaps the child (a few
// seconds at most: WorkerGroup::close says what it could not reap); its
// pending reads and timers are cancelled, and their handlers, which run later, leave the
// gone handle alone (alive_).
#pragma once

#include <sched.h>
#include <sys/resource.h>
#include <signal.h>
#include <sys/ioctl.h>
#include <sys/types.h>

#include <chrono>
#include <deque>
#include <fstream>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <boost/asio/io_context.hpp>

#include "logs/console.h"
#include "logs/line_splitter.h"
#include "process/proc.h"
#include "process/spawn.h"

namespace mg {

struct WorkerSpec {
  int local_rank = 0;
  int rank = 0;
  std::string executable;
  std::vector<std::string> argv;  // argv[0] is shown, executable is what runs
  std::vector<std::string> env;   // "KEY=VALUE"
  bool console[2] = {true, true};    // relay stdout / stderr to the console
  std::string log_file[2];           // raw copy of stdout / stderr ("" = none)
  std::size_t max_line_bytes = kDefaultMaxLine;  // longer lines are cut (logs/line_splitter.h)
  std::size_t tail_lines = 10;       // last stderr lines kept for the failure report
  std::vector<int> cpus;             // CPU affinity set in the child (--cpu-bind); empty: inherited
  int stdin_fd = -1;                 // the worker's stdin (the agent keeps it open); -1: /dev/null
  // The worker stays in the agent's process group instead of taking its own: the stdin
  // rank when the agent's stdin is a terminal, so that it is in the terminal's foreground
  // job with the agent, as torchrun's workers are (getpass, pdb, isatty(0); Ctrl-C and
  // Ctrl-Z reach it from the terminal). It is then signalled with its descendants in that
  // group, one by one, never through the group (the agent, or a pipeline's other programs).
  bool in_agent_group = false;
  bool merge_streams = false;        // stderr into the stdout pipe (the agent's stdout and stderr are one file)
  std::string prefix;                // put before each relayed line, e.g. "[rank3]:"
  // A stream relayed to a terminal comes through a pseudo-terminal of its own, sized like
  // the real one: the worker sees a terminal (isatty, its width) as under torchrun.
  bool terminal = true;
  const struct rlimit* nofile = nullptr;  // the descriptor limit the worker starts with (null: the agent's)
  // Sees every byte of stdout / stderr as it is read (end: the stream ended, data empty);
  // empty: none. The --duplicate-*-filters copy (launcher/worker_spec.cc).
  std::function<void(std::string_view data, bool end)> tap[2];
};

// How long the end of the run waits for the processes it SIGKILLed to be reaped.
inline constexpr std::chrono::seconds kReapBound{2};

class WorkerProcess {
 public:
  using DoneHandler = std::function<void(WorkerProcess&)>;

  // Starts the worker. On a spawn failure (exec error) the worker is reported done from
  // the event loop with exit status 127 and `spawn_error()` says why.
  WorkerProcess(boost::asio::io_context& io, WorkerSpec spec, Console& console, DoneHandler on_done);
  ~WorkerProcess();
  WorkerProcess(const WorkerProcess&) = delete;
  WorkerProcess& operator=(const WorkerProcess&) = delete;

  // Sends `sig` to the worker's process group while its leader is not reaped: alive, or
  // ended and kept a zombie by the reaper (held()), which it is until its group was
  // SIGKILLed. The zombie holds the group's id, so the signal cannot reach a later group
  // that took the same id (a recycled pid). Once reaped (after that SIGKILL) nothing.
  // A worker in the agent's group (in_agent_group): the worker and every descendant of the
  // agent in the agent's group (its family: every other process the agent starts has a
  // group of its own), one by one.
  void signal_group(int sig);
  // The exit, from the agent's reaper: `status` as waitpid returned it; `held`: the leader
  // is left a zombie (WorkerGroup::reap) until release().
  void on_exit(int status, bool held = false);
  bool held() const { return held_; }
  // SIGKILL to the held zombie's group, then the zombie reaped (at once: it has ended).
  void release();
  // The end of the run: SIGKILL to its process group, then reaped by `deadline`, never in a
  // blocking waitpid (process/reap.h). False when it could not be reaped by then
  // (state D, or traced by another process): it is left to the agent's parent (or init),
  // and the handle's destructor no longer waits for it.
  bool kill_and_reap(std::chrono::steady_clock::time_point deadline);
  bool left_behind() const { return left_behind_; }
  // The agent stops (Ctrl-Z) / goes on: an ended worker's output drain (kDrainTimeout)
  // waits meanwhile and starts over, so the time stopped does not count against it.
  // resume_drain() without a pause_drain() before it (anyone's SIGCONT) changes nothing.
  void pause_drain();
  void resume_drain();
  // The agent's terminal changed size (SIGWINCH): the worker's pseudo-terminals take the
  // new size and the worker's process group gets SIGWINCH. Nothing without one.
  void window_changed();
  // Kept for the next attempt (in-place recovery): its global rank and line prefix (a
  // template's ${pid} filled in) from now on.
  void reassign(int rank, const std::string& prefix);
  // Whether stream `s` (0 stdout, 1 stderr) is a pseudo-terminal for the worker.
  bool on_terminal(int s) const;

  const WorkerSpec& spec() const { return spec_; }
  pid_t pid() const { return pid_; }
  bool exited() const { return exited_; }
  bool done() const { return done_; }
  int wait_status() const { return status_; }  // raw waitpid status
  const std::string& spawn_error() const { return spawn_error_; }
  const std::deque<std::string>& stderr_tail() const { return tail_; }
  double duration_s() const;

 private:
  struct Stream;
  void signal_family(int sig);  // signal_group() of a worker in the agent's group
  void read_more(int s);
  void on_data(int s, std::string_view data);
  void emit(int s, std::string_view line, bool cut, bool to_console);
  void keep_tail(int s, std::string_view run);  // run: complete lines from LineSplitter::feed_runs
  bool keeps_tail(int s) const { return s == 1 || spec_.merge_streams; }
  void close_stream(int s);
  void maybe_done();
  void arm_drain();

  boost::asio::io_context& io_;
  WorkerSpec spec_;
  Console& console_;
  DoneHandler on_done_;
  std::string prefix_;
  pid_t pid_ = -1;
  bool exited_ = false;
  bool left_behind_ = false;  // kill_and_reap() could not reap it
  bool held_ = false;  // exited, its zombie not reaped yet: its pid still names its group
  bool done_ = false;
  bool paused_[2] = {false, false};  // not reading: the console is congested
  bool drain_paused_ = false;        // pause_drain() (Ctrl-Z) until resume_drain()
  LiveLine live_[2];                 // where each stream stands on a terminal (Console::relay)
  bool open_line_[2] = {false, false};  // a pipe or file: the current line went out in part (Console::relay)
  std::shared_ptr<int> alive_ = std::make_shared<int>(0);  // expires with this handle
  int status_ = 0;
  std::string spawn_error_;
  std::deque<std::string> tail_;
  std::chrono::steady_clock::time_point start_, end_;
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace mg
