// WorkerProcess: one supervised worker. It owns the child (its own process group, killed
// with the agent via PR_SET_PDEATHSIG), its stdout/stderr pipes, their log files and the
// line relay to the Console. Everything arrives as Asio completions on the agent's single
// io_context: pipe reads, the exit (pidfd), the drain timer. Destroying a handle whose
// child still runs SIGKILLs the child's process group.
#pragma once

#include <signal.h>
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

#include "launcher/console.h"
#include "launcher/line_splitter.h"

namespace mg {

// The fields of /proc/PID/stat the agent needs to find its descendants.
struct ProcStat {
  pid_t pid = 0;
  pid_t ppid = 0;
  pid_t pgrp = 0;
  char state = '?';  // 'Z': a zombie, already dead
};

// Parses one /proc/PID/stat text ("pid (comm) state ppid pgrp ..."; comm may hold spaces
// and parentheses). Pure. nullopt when malformed.
std::optional<ProcStat> parse_proc_stat(std::string_view text);

// Every process /proc shows now (those that vanish while reading are skipped).
std::vector<ProcStat> scan_processes();

// The living (non-zombie) descendants of `root` in `table`, `root` excluded. Pure.
std::vector<ProcStat> descendants_of(const std::vector<ProcStat>& table, pid_t root);

// Sets FD_CLOEXEC on every descriptor above 2, so that exec() passes on only stdin,
// stdout and stderr. For the child side of any spawn (between fork and exec): only
// async-signal-safe calls (close_range with CLOSE_RANGE_CLOEXEC, Linux >= 5.11, else
// getdents64 on /proc/self/fd). False (errno set) when neither works.
bool mark_cloexec_above_stderr();
// The fallback alone (kernels before 5.11); exposed for its test.
bool mark_cloexec_above_stderr_by_listing();

struct WorkerSpec {
  int local_rank = 0;
  int rank = 0;
  std::string executable;
  std::vector<std::string> argv;  // argv[0] is shown, executable is what runs
  std::vector<std::string> env;   // "KEY=VALUE"
  bool console[2] = {true, true};    // relay stdout / stderr to the console
  std::string log_file[2];           // raw copy of stdout / stderr ("" = none)
  std::size_t max_line_bytes = 64 * 1024;
  std::size_t tail_lines = 10;       // last stderr lines kept for the failure report
  std::vector<int> cpus;             // CPU affinity set in the child (--cpu-bind); empty: inherited
};

class WorkerProcess {
 public:
  using DoneHandler = std::function<void(WorkerProcess&)>;

  // Starts the worker. On a spawn failure (exec error) the worker is reported done at
  // once with exit status 127 and `spawn_error()` says why.
  WorkerProcess(boost::asio::io_context& io, WorkerSpec spec, Console& console, DoneHandler on_done);
  ~WorkerProcess();
  WorkerProcess(const WorkerProcess&) = delete;
  WorkerProcess& operator=(const WorkerProcess&) = delete;

  // Sends `sig` to the worker's process group as long as any member of it lives, also
  // after the leader was reaped (a member is then one of the agent's descendants).
  void signal_group(int sig);
  // SIGKILLs what is left of the process group (stragglers of a finished worker).
  void kill_stragglers() { signal_group(SIGKILL); }

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
  void read_more(int s);
  void on_data(int s, std::string_view data);
  void emit(int s, std::string_view line, bool cut);
  void on_exit(int status);
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
  bool done_ = false;
  bool paused_[2] = {false, false};  // not reading: the console is congested
  std::shared_ptr<int> alive_ = std::make_shared<int>(0);  // expires with this handle
  int status_ = 0;
  std::string spawn_error_;
  std::deque<std::string> tail_;
  std::chrono::steady_clock::time_point start_, end_;
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace mg
