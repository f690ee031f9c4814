// Agent: runs one node's worker group to completion on a single io_context. It is the
// wiring around the supervision core (launcher/supervisor.h, which decides: stop the
// group on the first failure with SIGTERM, --grace, SIGKILL; restart while restarts
// remain; forward the agent's signals; the exit code): it feeds the core the events
// (signals, worker exits, timers, the rendezvous' messages) and carries out its actions
// (spawn, signal, timers, messages, console). It never calls exit() and prints only the
// relayed lines, its own one-line notices and the failure report.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include <boost/asio/io_context.hpp>
#include <boost/asio/posix/stream_descriptor.hpp>
#include <boost/asio/signal_set.hpp>
#include <boost/asio/steady_timer.hpp>
#include <nlohmann/json.hpp>

#include "logs/console.h"
#include "ops/hwprobe.h"
#include "logs/log_layout.h"
#include "launcher/options.h"
#include "launcher/plan.h"
#include "launcher/port.h"
#include "launcher/report.h"
#include "logs/stdin_relay.h"
#include "launcher/supervisor.h"
#include "launcher/watchdog.h"
#include "launcher/worker_group.h"
#include "launcher/worker_process.h"
#include "proto/messages.h"
#include "rendezvous/client.h"
#include "rendezvous/link.h"
#include "rendezvous/server.h"

namespace mg {

class TraceWriter;
namespace mon {
class AgentMonitor;
struct AgentFacts;
}  // namespace mon

class Agent {
 public:
  Agent(boost::asio::io_context& io, AgentOptions opts, RunPlan plan, EnvMap base_env);
  ~Agent();

  // Prepares the log directory, installs signal handlers and starts attempt 0. Throws
  // UsageError when --log_dir cannot be created.
  void start();
  // Valid once io.run() returned.
  int exit_code() const { return core_.exit_code(); }
  nlohmann::json summary() const;

 private:
  // The supervision rules live in core_ (launcher/supervisor.h): every event goes there
  // with the time, and run() carries out the actions it returns, in order.
  void run(sup::Actions actions);
  static sup::Now now();
  static sup::Config core_config(const AgentOptions& opts, const RunPlan& plan);
  boost::asio::steady_timer& timer(sup::Timer t) { return t == sup::Timer::kGrace ? grace_timer_ : leave_timer_; }

  void spawn_worker(int local_rank);
  void start_rendezvous();
  // Listens for the rendezvous here when this agent is meant to host it (once; a no-op
  // otherwise). Called early in start(), so the others are not refused while it starts.
  void host_rendezvous();
  void apply_assignment(const proto::Assignment& a);
  void on_worker_done(WorkerProcess& w);
  void finish(int code);  // the effects of the end: every handle stops, logs and summary written
  void wait_signal();
  // One "[mglaunch] text" line on stderr, in order with the relayed lines (never blocks).
  void notice(const std::string& text);
  void error_line(const std::string& text);  // "mglaunch: error: TEXT" on stderr: the run ends on it
  void wait_child();  // SIGCHLD: the group's one reaper
  // Checks that the worker count fits the descriptor limit, raising the soft limit to the
  // hard one when needed; throws ResourceError naming the limit and the count that fits.
  void check_descriptor_budget();
  // Holds plan_.master_port until the workers start (see launcher/port.h); with `fresh`,
  // or when the port was taken meanwhile, chooses a new one and updates the plan.
  void hold_master_port(bool fresh);
  void rejoin();  // re-join the rendezvous for the next round, offering a fresh master port
  std::string attempt_dir(int local_rank) const;
  WorkerOutcome outcome_of(const WorkerProcess& w) const;

  boost::asio::io_context& io_;
  AgentOptions opts_;
  RunPlan plan_;
  EnvMap base_env_;
  Console console_;
  boost::asio::signal_set signals_;
  boost::asio::signal_set children_;  // SIGCHLD: reaps orphans handed to the subreaper
  // Ctrl-Z (SIGTSTP): stop every worker group, then the agent itself; SIGCONT (fg, bg):
  // continue them. See README "Interactive use".
  boost::asio::signal_set job_control_;
  void wait_job_control();
  // SIGWINCH (the terminal was resized): passed to the workers' pseudo-terminals.
  boost::asio::signal_set winch_;
  void wait_winch();
  std::unique_ptr<StdinRelay> stdin_relay_;  // the agent's stdin is a terminal: relayed to --stdin-rank
  bool python_run_ = false;  // the program runs under opts_.python
  boost::asio::steady_timer grace_timer_;
  boost::asio::steady_timer leave_timer_;
  Watchdog watchdog_;  // kills what the workers left behind once the agent is gone, even by kill -9
  bool merge_streams_ = false;  // the agent's stdout and stderr are one file: one pipe per worker
  std::optional<struct rlimit> worker_nofile_;  // the original limit, when the agent raised its own
  WorkerGroup group_;  // the workers of the attempt: spawn, signals, reaping (launcher/worker_group.h)
  sup::Supervisor core_;
  LogLayout logs_;  // where this run's files go (logs/log_layout.h)
  // Multi-node rendezvous (nullptr in single-node and static runs). The client lives as
  // long as the agent: its cancelled handlers still run inside io.run().
  std::unique_ptr<rdzv::Server> embedded_server_;
  bool hosting_decided_ = false;  // host_rendezvous() ran
  std::unique_ptr<rdzv::Link> client_;  // rdzv::Client (own daemon) or rdzv::EtcdLink
  bool port_is_ours_ = false;  // the master port was chosen by mglaunch, not the user
  std::optional<PortReservation> port_hold_;
  // Until its exec a worker holds a copy of every descriptor of the agent, the hold socket
  // too. The attempt's workers also inherit the write end of this pipe (close-on-exec):
  // once the agent closed its own, end-of-file says every one has exec'd or exited, and
  // the port goes then (at most 1 s later), without stopping the event loop meanwhile.
  int exec_fence_w_ = -1;
  std::unique_ptr<boost::asio::posix::stream_descriptor> exec_fence_;
  boost::asio::steady_timer fence_timer_;
  std::uint64_t fence_gen_ = 0;
  void release_master_port_when_started();
  void let_master_port_go(std::uint64_t gen);
  void drop_exec_fence();
  std::vector<hw::Binding> bindings_;  // --cpu-bind, per local rank (empty: none)
  // Monitoring and operations, null unless --monitor/--metrics-json/--metrics-port or
  // --trace is given (ops/monitor.h, ops/trace.h). Declared last: gone before
  // the console they write through.
  void start_ops();
  mon::AgentFacts monitor_facts() const;
  void trace_instant(const std::string& name, const std::string& cat, nlohmann::json args = nlohmann::json::object());
  std::unique_ptr<TraceWriter> trace_;
  int trace_fd_ = -1;
  std::int64_t rdzv_since_us_ = 0, attempt_since_us_ = 0;
  std::unique_ptr<mon::AgentMonitor> monitor_;
};

}  // namespace mg
