// The agent's seams where the outside world enters, besides processes
// (launcher/worker_launcher.h): the clock and its timers, the signals it handles, the
// hardware probe, the rendezvous link, the agent's store (a listening socket on
// MASTER_PORT), the control channel of in-place recovery (an abstract Unix socket). main() passes the machine's (machine_deps()); tests pass fakes
// (tests/agent_seams_test.cc).
#pragma once

#include <unistd.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <boost/asio/io_context.hpp>

#include "control/server.h"
#include "launcher/plan.h"
#include "launcher/supervisor.h"
#include "launcher/worker_launcher.h"
#include "ops/hwprobe.h"
#include "rendezvous/client.h"
#include "rendezvous/link.h"

namespace mg {

struct AgentOptions;

// The time and the supervisor's timers (sup::Timer).
class AgentClock {
 public:
  virtual ~AgentClock() = default;
  virtual sup::Now now() const = 0;
  // Calls `fire` once the steady time reached `at` (from the event loop); arming the same
  // timer again or cancel() drops a call still due.
  virtual void arm(sup::Timer t, sup::Clock::time_point at, std::function<void()> fire) = 0;
  virtual void cancel(sup::Timer t) = 0;
};
// std::chrono's steady and system clocks, the timers on `io`.
std::unique_ptr<AgentClock> make_system_clock(boost::asio::io_context& io);

// The signals the agent handles, in three sets it waits on apart: kStop (SIGTERM, SIGINT,
// SIGHUP, SIGUSR1, SIGUSR2 and --signals-to-handle), kJobControl (SIGTSTP, SIGCONT) and
// kWinch (SIGWINCH). As boost::asio::signal_set: a signal of a set that comes while no
// wait is pending is kept for the next wait.
class AgentSignals {
 public:
  enum class Set { kStop, kJobControl, kWinch };
  virtual ~AgentSignals() = default;
  virtual void add(Set set, int sig) = 0;
  // `got` runs once, from the event loop, with the next signal of `set`; cancel(set), or
  // the seam's end, drops it unrun.
  virtual void wait(Set set, std::function<void(int sig)> got) = 0;
  virtual void cancel(Set set) = 0;
  // The agent stops itself (SIGSTOP: Ctrl-Z, once its workers stopped); the real one
  // returns when the agent is continued.
  virtual void stop_self() = 0;
};
// This process's signals (asio::signal_set on `io`).
std::unique_ptr<AgentSignals> make_process_signals(boost::asio::io_context& io);

// What the agent asks of the machine's hardware.
class AgentHardware {
 public:
  virtual ~AgentHardware() = default;
  // --cpu-bind: the CPUs of each local rank (see hw::bind_this_machine). Throws
  // std::invalid_argument naming the policy when it cannot be satisfied.
  virtual std::vector<hw::Binding> bind(const std::string& policy, int nproc, const std::vector<int>& gpu_ids) = 0;
  // The GPUs the monitor samples (null: none).
  virtual std::unique_ptr<hw::GpuProbe> gpu_probe() = 0;
};
// This machine's (/proc, /sys, NVML). `fake_gpu_json` (MGLAUNCH_TEST_GPU_JSON, the monitor
// tests' seam): the monitor's GPUs come from that file instead of NVML.
std::unique_ptr<AgentHardware> make_machine_hardware(std::string fake_gpu_json);

// The rendezvous link for `join`, reporting through `handlers` on `io`: the own daemon
// (rdzv::Client) or etcd (rdzv::EtcdLink), as the options say.
using LinkFactory = std::function<std::unique_ptr<rdzv::Link>(boost::asio::io_context& io, const AgentOptions& opts,
                                                              proto::Join join, rdzv::ClientHandlers handlers)>;
std::unique_ptr<rdzv::Link> make_rendezvous_link(boost::asio::io_context& io, const AgentOptions& opts, proto::Join join,
                                                 rdzv::ClientHandlers handlers);

// The agent's store: c10d's TCPStore protocol on the master port (store/server.h), which
// the node-0 agent serves when the plan says so (RunPlan::agent_store).
class AgentStore {
 public:
  virtual ~AgentStore() = default;
  virtual int port() const = 0;
  // A new attempt: its keys are forgotten and its clients parked (never served again, kept
  // until they close: store/server.h); the port stays.
  virtual void reset() = 0;
  // The store moves to another port: this one stops listening and forgets its keys; its
  // clients are parked as by reset(). (Default: stop().)
  virtual void retire() { stop(); }
  // Parked clients still connected (0 when none is left: a retired store can go).
  virtual std::size_t parked() const { return 0; }
  // Closes the port and every client.
  virtual void stop() = 0;
  // Clients connected now.
  virtual std::size_t clients() const = 0;
  // `f` runs once, from the event loop, as soon as no client is connected (soon when none
  // is now); stop() forgets it.
  virtual void when_idle(std::function<void()> f) = 0;
};
// Starts serving on `port`: on `held_fd` (a socket bound to it, listening already when the
// agent held the port, which the factory then owns) when it is >= 0, else on a socket of
// its own bound to 0.0.0.0:`port`; at most `max_clients` clients (the store's share of the
// descriptors, sup::descriptor_shares). `log` gets the store's one-line notices. Throws
// ResourceError naming the port when it cannot listen (the agent fails the attempt's
// workers with it).
using StoreFactory = std::function<std::unique_ptr<AgentStore>(boost::asio::io_context& io, int port, int held_fd,
                                                               std::size_t max_clients,
                                                               std::function<void(const std::string&)> log)>;
std::unique_ptr<AgentStore> serve_machine_store(boost::asio::io_context& io, int port, int held_fd,
                                                std::size_t max_clients, std::function<void(const std::string&)> log);

// The control channel of in-place recovery (control/server.h): the agent's end, where its
// workers say hello and paused and hear pause and assign.
class AgentControl {
 public:
  virtual ~AgentControl() = default;
  // What MGLAUNCH_CONTROL_SOCKET holds ("@name").
  virtual const std::string& address() const = 0;
  // Queues `line` for local rank `local_rank`'s session; false when it has none.
  virtual bool send(int local_rank, std::string line) = 0;
  // Why local rank `local_rank`'s last session ended, one phrase ("" while it has one).
  virtual std::string ended_why(int local_rank) const = 0;
  // Closes local rank `local_rank`'s session without `closed` (its worker ended).
  virtual void forget(int local_rank) = 0;
  // Closes the socket and every session.
  virtual void stop() = 0;
};
// Listens at once, with control::Server's options and handlers (called from the event
// loop). Throws std::runtime_error naming the address when it cannot listen (then no
// worker can opt in to in-place recovery).
using ControlFactory = std::function<std::unique_ptr<AgentControl>(boost::asio::io_context& io,
                                                                   control::ServerOptions opts, control::Handlers h)>;
std::unique_ptr<AgentControl> serve_machine_control(boost::asio::io_context& io, control::ServerOptions opts,
                                                    control::Handlers h);

// Everything the agent takes from outside. Every member must be set (machine_deps()).
struct AgentDeps {
  std::unique_ptr<AgentClock> clock;
  std::unique_ptr<AgentSignals> signals;
  std::function<std::unique_ptr<WorkerLauncher>(boost::asio::io_context&, Console&)> launcher;
  LinkFactory link;
  std::unique_ptr<AgentHardware> hardware;
  StoreFactory store;
  ControlFactory control;
  int stdout_fd = STDOUT_FILENO;  // where the console writes
  int stderr_fd = STDERR_FILENO;
};
// The real ones: the system clock, this process's signals, real processes, rdzv::Client or etcd, this machine,
// store::StoreServer, control::Server.
// `env`: the agent's environment (MGLAUNCH_TEST_GPU_JSON).
AgentDeps machine_deps(boost::asio::io_context& io, const EnvMap& env);

}  // namespace mg
