// WorkerProcess: one supervised worker. It owns the child (its own process group, killed
// with the agent via PR_SET_PDEATHSIG), its stdout/stderr pipes, their log files and the
// line relay to the Console. Everything arrives as Asio completions on the agent's single
// io_context: pipe reads, the exit (pidfd), the drain timer. Destroying a handle whose
// child still runs SIGKILLs the child's process group.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <deque>
#include <fstream>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <boost/asio/io_context.hpp>

#include "launcher/console.h"
#include "launcher/line_splitter.h"

namespace mg {

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

  // Sends `sig` to the worker's process group (no-op once it was reaped).
  void signal_group(int sig);
  // SIGKILLs the process group even after the leader was reaped (stragglers).
  void kill_stragglers();

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

  boost::asio::io_context& io_;
  WorkerSpec spec_;
  Console& console_;
  DoneHandler on_done_;
  std::string prefix_;
  pid_t pid_ = -1;
  bool exited_ = false;
  bool done_ = false;
  bool drained_by_timeout_ = false;
  int status_ = 0;
  std::string spawn_error_;
  std::deque<std::string> tail_;
  std::chrono::steady_clock::time_point start_, end_;
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace mg
