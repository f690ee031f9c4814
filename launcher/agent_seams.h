// The agent's seams where the outside world enters, besides processes
// (launcher/worker_launcher.h): the clock and its timers, the hardware probe, the
// rendezvous link, the agent's store (a listening socket on MASTER_PORT). main() passes the machine's (machine_deps()); tests pass fakes
// (tests/agent_seams_test.cc).
#pragma once

#include <unistd.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <boost/asio/io_context.hpp>

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

// Everything the agent takes from outside. Every member must be set (machine_deps()).
struct AgentDeps {
  std::unique_ptr<AgentClock> clock;
  std::function<std::unique_ptr<WorkerLauncher>(boost::asio::io_context&, Console&)> launcher;
  LinkFactory link;
  std::unique_ptr<AgentHardware> hardware;
  StoreFactory store;
  int stdout_fd = STDOUT_FILENO;  // where the console writes
  int stderr_fd = STDERR_FILENO;
};
// The real ones: the system clock, real processes, rdzv::Client or etcd, this machine,
// store::StoreServer.
// `env`: the agent's environment (MGLAUNCH_TEST_GPU_JSON).
AgentDeps machine_deps(boost::asio::io_context& io, const EnvMap& env);

}  // namespace mg
