// Agent: runs one node's worker group to completion on a single io_context. It is the
// wiring around the supervision core (launcher/supervisor.h, which decides: stop the
// group on the first failure with SIGTERM, --grace, SIGKILL; restart while restarts
// remain; forward the agent's signals; the exit code): it feeds the core the events
// (signals, worker exits, timers, the rendezvous' messages) and carries out its actions
// (spawn, signal, timers, messages, console). It never calls exit() and prints only the
// relayed lines, its own one-line notices and the failure report.
//
// It takes what it needs from outside (launcher/agent_seams.h): the clock and its timers,
// the signals it handles, the process launcher (launcher/worker_launcher.h), the
// rendezvous link, the hardware probe, the store's socket and the control channel; main()
// passes the machine's (machine_deps()), tests fakes.
#pragma once

#include <chrono>
#include <map>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <mutex>
#include <condition_variable>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include <boost/asio/io_context.hpp>
#include <boost/asio/steady_timer.hpp>
#include <nlohmann/json.hpp>

#include "control/server.h"
#include "logs/console.h"
#include "ops/hwprobe.h"
#include "ops/preflight.h"
#include "logs/log_layout.h"
#include "launcher/agent_seams.h"
#include "launcher/file_timer.h"
#include "launcher/job_record.h"
#include "launcher/options.h"
#include "launcher/plan.h"
#include "launcher/port.h"
#include "launcher/prestart.h"
#include "launcher/report.h"
#include "launcher/supervisor.h"
#include "launcher/worker_launcher.h"
#include "proto/messages.h"
#include "rendezvous/client.h"
#include "rendezvous/endpoint.h"
#include "rendezvous/link.h"
#include "rendezvous/lookup.h"
#include "rendezvous/server.h"

namespace mg {

class TraceWriter;
namespace mon {
class AgentMonitor;
class HealthServer;
struct AgentFacts;
}  // namespace mon

class Agent {
 public:
  // Every member of `deps` must be set (machine_deps() in launcher/agent_seams.h).
  Agent(boost::asio::io_context& io, AgentOptions opts, RunPlan plan, EnvMap base_env, AgentDeps deps);
  ~Agent();

  // Prepares the log directory, installs signal handlers and starts attempt 0. Throws
  // UsageError when --log_dir cannot be created.
  void start();
  // Valid once io.run() returned.
  int exit_code() const { return core_.exit_code(); }
  // The run is over (the event loop then runs out of work once its handlers are done).
  bool done() const { return core_.state() == sup::State::kDone; }
  nlohmann::json summary() const;

 private:
  // The supervision rules live in core_ (launcher/supervisor.h): every event goes there
  // with the time, and run() carries out the actions it returns, in order.
  void run(sup::Actions actions);
  sup::Now now() const { return clock_->now(); }
  static sup::Config core_config(const AgentOptions& opts, const RunPlan& plan);

  void spawn_worker(int local_rank);
  void start_rendezvous();
  // Runs the work of a rendezvous handler. An exception must not reach the rendezvous
  // connection, which takes it for a lost link while the core is left half-way through
  // its actions (it waited for ever on workers it never got): the run ends with the
  // error's documented code and one line (core's fatal()).
  void guarded(const std::function<void()>& work);
  // Listens for the rendezvous here when this agent is meant to host it (once; a no-op
  // otherwise). Called early in start(), so the others are not refused while it starts.
  void host_rendezvous();
  void apply_assignment(const proto::Assignment& a);
  // --preflight (ops/preflight.h): the first assignment waits for the network check, which
  // runs on a thread of its own; what the rendezvous says meanwhile (restart, abort, done,
  // lost) waits for its verdict, which the nodes learn together: a failed check ends the
  // run (exit 5), else those events are carried out instead of the assignment. The end of
  // the run (a signal) cancels the check.
  void on_assignment(const proto::Assignment& a);
  void start_preflight(const proto::Assignment& a);
  void preflight_done(const proto::Assignment& a, std::uint64_t gen, preflight::Result r);
  void stop_preflight();  // cancels the check under way, if any, and joins its thread
  bool preflight_tried_ = false;
  std::uint64_t preflight_gen_ = 0;
  std::thread preflight_thread_;
  // The check's thread says here that it ended; told to stop, it gets kThreadStop, else it
  // is abandoned (detached, its descriptors left open, its verdict never posted): a name
  // lookup (getaddrinfo) cannot be cancelled and may hang, the end of the run may not.
  struct PreflightEnd {
    std::mutex m;
    std::condition_variable cv;
    bool ended = false, abandoned = false;
  };
  std::shared_ptr<PreflightEnd> preflight_end_;
  int preflight_cancel_[2] = {-1, -1};  // a pipe: the write end closed cancels the check
  int preflight_coord_fd_ = -1;  // group rank 0: a copy of the held master port's listening socket
  std::vector<std::function<void()>> deferred_by_preflight_;  // the rendezvous' events meanwhile
  void on_worker_done(const WorkerEnd& w);
  void finish(int code);
  // The static form's node 0 after its workers succeeded: the store serves until its last
  // client leaves, at most until `deadline` (or a signal).
  void linger_store();
  void end_linger(bool timed_out);
  bool lingering_done_ = false;
  static constexpr std::chrono::seconds kStoreLingerLimit{300};  // torchrun's exit_barrier_timeout
  // How long a thread of the agent (the preflight check) told to stop is waited for at most.
  static constexpr std::chrono::seconds kThreadStop{2};
  bool lingering_said_ = false;  // the effects of the end: every handle stops, logs and summary written
  void wait_signal();
  // One "[mglaunch] text" line on stderr, in order with the relayed lines (never blocks).
  void notice(const std::string& text);
  void error_line(const std::string& text);  // "mglaunch: error: TEXT" on stderr: the run ends on it
  // Checks that the worker count fits the descriptor limit (sup::descriptor_need), raising
  // the soft limit to the hard one when needed; throws ResourceError naming the limit and
  // the count that fits.
  void check_descriptor_budget();
  // Holds plan_.master_port until the workers start (see launcher/port.h; the core says
  // when it goes); with `fresh`, or when the port was taken meanwhile, chooses a new one
  // and updates the plan.
  void hold_master_port(bool fresh);
  // This node's store will be served on the held master port (node 0 with the agent's store):
  // the hold is handed to it, never closed while workers may have connected to it.
  bool store_takes_hold() const {
    return plan_.agent_store && plan_.node_rank == 0 && port_hold_ && port_hold_->listening() &&
           port_hold_->port() == plan_.master_port;
  }
  // Whether the run has ended, as it can inside serve_store() (the master port's watch):
  // then no worker is started or assigned.
  bool run_ended() const;
  void rejoin(bool offer_port);  // re-join the rendezvous for the next round (offering the fresh master port)
  std::string attempt_dir(int local_rank) const;
  // The spec of local rank's worker in this attempt; its attempt directory is made.
  WorkerSpec attempt_spec(int local_rank);
  static WorkerOutcome outcome_of(const WorkerEnd& w);

  boost::asio::io_context& io_;
  std::unique_ptr<AgentClock> clock_;
  LinkFactory make_link_;
  std::unique_ptr<AgentHardware> hardware_;
  StoreFactory make_store_;
  ControlFactory make_control_;
  AgentOptions opts_;
  RunPlan plan_;
  EnvMap base_env_;
  int out_fd_, err_fd_;  // the console's stdout and stderr
  Console console_;
  // The stop signals (wait_signal); Ctrl-Z (SIGTSTP): stop every worker group, then the
  // agent itself; SIGCONT (fg, bg): continue them (see docs/running.md, "Interactive
  // use"); SIGWINCH (the terminal was resized): passed to the workers' pseudo-terminals.
  std::unique_ptr<AgentSignals> signals_;
  void wait_job_control();
  void wait_winch();
  // The agent's stdin is a terminal: the worker of --stdin-rank reads it itself, in the
  // agent's process group (WorkerSpec::in_agent_group).
  bool stdin_terminal_ = false;
  bool python_run_ = false;  // the program runs under opts_.python
  bool merge_streams_ = false;  // the agent's stdout and stderr are one file: one pipe per worker
  std::optional<struct rlimit> worker_nofile_;  // the original limit, when the agent raised its own
  sup::DescriptorShares shares_;  // each server's connections (check_descriptor_budget)
  // The workers: spawn, signals, reaping, the watchdog, the exec fence (declared after the
  // console it relays to).
  std::unique_ptr<WorkerLauncher> launcher_;
  sup::Supervisor core_;
  // The control channel of in-place recovery (control/server.h, docs/in-place-recovery.md):
  // listens from start() on, its name in every worker's MGLAUNCH_CONTROL_SOCKET; null when
  // it could not listen (then no worker can opt in).
  void start_control();
  int worker_of(pid_t pid) const;  // the local rank of the worker `pid` is or descends from; -1: none
  void assign_worker(const sup::act::Assign& a);
  std::unique_ptr<AgentControl> control_;  // made by make_control_
  // --prestart-standby (docs/in-place-recovery.md, "Pre-started workers"): its rules live in
  // prestart_ (launcher/prestart.h); the agent starts the workers ahead and carries out the
  // machine's commands. A pre-started worker's end goes to the machine until its place is
  // handed to it (adopt_prestarted), then it is a worker of the attempt.
  void run_prestart(sup::PreCommands commands);
  void prestart_one(int local_rank);
  // The core's Spawn of `local_rank`: true when its pre-started worker took the place.
  bool adopt_prestarted(int local_rank);
  sup::Prestart prestart_;
  // Per local rank, shared with the end callback of its pre-started worker: set when handed
  // its place (its end is then a worker's of the attempt).
  std::vector<std::shared_ptr<bool>> prestart_placed_;
  // SignalWorkers: the signal, then SIGCONT when asked (a SIGSTOPped worker gets it now).
  void signal_workers(const sup::act::SignalWorkers& a);
  LogLayout logs_;  // where this run's files go (logs/log_layout.h)
  // Multi-node rendezvous (nullptr in single-node and static runs). The client lives as
  // long as the agent: its cancelled handlers still run inside io.run().
  std::unique_ptr<rdzv::Server> embedded_server_;
  // The endpoint this agent is to host the job at (a loopback one, or its own address, and
  // nothing listens there yet); nullopt: none.
  std::optional<rdzv::Endpoint> endpoint_to_host() const;
  bool hosting_decided_ = false;  // host_rendezvous() ran
  // This node's record of the job (launcher/job_record.h, #34 H1). Read at start: a record
  // of this job makes the link look for the job at the record's hosts first (recall
  // pending: no hosting until it found none). Written at each assignment or standby (the
  // link's job_hosts()), removed when the job's end was heard from the rendezvous (for
  // good: no later write brings it back), or when its recall found it stale; those on
  // record_io_'s thread. A write's failure is told once, when it fails.
  void load_job_record();
  void end_recall();
  void remember_job(int epoch, const std::string& run);
  // Hosting: its server's decision about to go out; the first record, from this node's own
  // Assignment in it, before the other nodes hear the round (review s41-a M2).
  void record_ahead(const rdzv::Actions& actions, rdzv::SessionId own);
  void write_record(int epoch, const std::string& run, rdzv::RecordFields f);
  std::string agent_id_;  // this start's (its Join's, its servers' host_agent_id): agent_id()
  void warn_record_failure();  // once: the first write that failed (posted by record_io_'s thread)
  void recall_job();  // after the link is made: hands it the record's hosts
  // Once the takeover socket is bound: this node's own address there is no target, and it
  // counts itself only when it bound its record's port again (review s41-c M1); a record
  // that then names only this node starts afresh.
  void settle_recall();
  void vote_socket_only();  // the hosting agent's takeover socket: answers votes only
  void say_record_names_only_self();
  std::string record_path() const;  // this node's record file (its slot's)
  std::string record_node_, record_endpoint_;
  std::optional<JobRecordSlot> record_slot_;  // this agent's record slot, locked for its life (the lock: record_io_'s)
  std::shared_ptr<JobRecordDir> record_dir_;       // nullptr: no record kept
  std::unique_ptr<JobRecordWriter> record_io_;     // its writes, off the io thread (with record_dir_)
  std::optional<JobRecord> recalled_;
  bool recall_pending_ = false;
  bool record_warned_ = false;
  // A record of the job landed (JobRecordWriter::on_disk()): later ones are written after the
  // workers start. record_hung_: a first one did not land within its wait, none is waited for.
  bool record_on_disk_ = false, record_hung_ = false;
  // The rendezvous server's settings for this job (the token, this job only, this agent and
  // its Join's agent id).
  rdzv::ServerOptions server_options();
  const std::string& agent_id();  // agent_id_, made at its first use (review s39-late H3)
  // The socket this agent would host the job on if its host were lost (bound on the
  // advertised address, never on every address: its record's port, else any), advertised in
  // its Join (takeover_port); it listens from the start, a server answering "alive, not
  // hosting" (proto::NotHosting, rdzv::ServerOptions::not_hosting) until it takes the job
  // over; none when none could be bound (takeover_refused_: said once). A hosting agent binds
  // it too, as its vote socket (Join::vote_port, review s40-recall M1): never a takeover port.
  void bind_takeover_socket();
  bool takeover_refused_ = false;
  // The IPv4 addresses of the endpoint's host and of the advertised address, which
  // bind_takeover_socket() needs: looked up off the io thread (rendezvous/lookup.h) before
  // start_rendezvous() goes on, so a DNS server that does not answer holds no signal (#35).
  struct TakeoverAddresses {
    rdzv::Addresses endpoint, own;
    int left = 0;  // lookups still under way
  };
  bool look_up_takeover_addresses();  // false when they are known (or not needed)
  std::optional<TakeoverAddresses> takeover_addresses_;
  std::unique_ptr<rdzv::Lookups> lookups_;
  // rdzv::ClientHandlers::on_take_over: serves the job from `seed` on that socket.
  rdzv::TakeoverHost take_over(const rdzv::TakeoverSeed& seed);
  std::unique_ptr<rdzv::Server> takeover_server_;
  int takeover_port_ = 0;
  std::string takeover_host_;
  std::unique_ptr<rdzv::Link> client_;  // rdzv::Client (own daemon) or rdzv::EtcdLink
  // Listening until the store takes it over (launcher/port.h), or only bound once workers
  // that host the store themselves are due; gone at the core's ReleaseMasterPort.
  std::optional<PortReservation> port_hold_;
  // The agent's store (plan_.agent_store, on the node of group rank 0): c10d's TCPStore
  // protocol on MASTER_PORT, which workers connect to as clients. Serves from the first
  // spawn of an attempt on; moves with a fresh master port; gone with the agent. On the
  // other nodes, or when the workers host the store, the held port stops listening.
  // Returns why the store cannot serve this attempt ("" when it serves or is not ours):
  // the attempt's workers then fail with that reason and exit code 4, as ones that
  // cannot be started do, and the job decides as for any failure.
  std::string serve_store();
  // The hold stops listening, still bound (PortReservation::stop_listening): for workers
  // that bind the master port themselves. It resets every connection queued on it.
  void unlisten_hold();
  // Where the workers host the store (rank 0's TCPStore binds MASTER_PORT; the hold only
  // bound from just before the spawn): looks at the port's listeners every 100 ms for 60 s
  // from the spawn, until one of this agent's workers (or their descendants) listens there.
  // A listener of another uid took the port in that window: the run ends with exit 4 and a
  // line naming the uid (#35). A listener of this uid is no stranger: one line says so when
  // it is not provably this run's (another job of this user makes rank 0's bind fail and the
  // attempt restart with a fresh port; a worker that is not dumpable hides its sockets).
  // `until_assigned`: from the re-join, where the fresh port's hold stops listening, with no
  // end until the assignment (apply_assignment() stops it where this node is not node 0 or
  // the round's port is another; review s41-e M3).
  void watch_master_port(bool until_assigned = false);
  void check_master_port(int round, sup::Clock::time_point until);
  bool port_watch_warned_ = false;  // the one line about a listener of this uid, per watch
  int port_watch_round_ = 0;  // a check of an older watch finds a newer round and stops
  std::string store_error_;        // why the store could not serve attempt store_error_attempt_
  int store_error_attempt_ = -1;
  std::unique_ptr<AgentStore> store_;  // made by make_store_
  // Stores of earlier ports, retired (AgentStore::retire) while workers that lived through
  // the round change still hold their connections; each goes once none is left.
  void retire_store();
  std::vector<std::unique_ptr<AgentStore>> retired_stores_;
  int store_attempt_ = 0;  // the attempt the store's keys belong to
  std::vector<hw::Binding> bindings_;  // --cpu-bind, per local rank (empty: none)
  // The FileTimer watchdog (TORCHELASTIC_ENABLE_FILE_TIMER=1, launcher/file_timer.h): the
  // pipe the workers' FileTimerClient writes to; null when not enabled.
  void start_file_timer();
  void reap_expired(const ftimer::Expired& e);
  std::unique_ptr<ftimer::Server> file_timer_;
  struct TimerKill {
    pid_t pid = 0;
    int signal = 0;
    std::string scope_id;
  };
  std::map<int, TimerKill> timer_kills_;  // this attempt's, by local rank: for its root cause
  // torch's elastic events, printed with --event-log-handler console (one JSON line each on
  // stderr, torch's Event: name, source, timestamp, metadata); silent with null.
  void watchdog_event(const std::string& name, const ftimer::Request* r);
  void elastic_event(const std::string& state, bool from_worker, const WorkerOutcome* w, nlohmann::json raw_error,
                     std::optional<double> duration_ms, const nlohmann::ordered_json* md_given = nullptr,
                     const std::string& name = {});
  void final_events(int code);  // each worker of the last attempt, then the agent
  std::vector<WorkerOutcome> last_outcomes_;  // the attempt running or ended last
  sup::Clock::time_point started_at_;  // the agent's clock at construction
  std::optional<std::chrono::steady_clock::time_point> rdzv_began_;  // this round's rendezvous
  int stop_signal_ = 0;  // the signal that stopped the agent (0: none)
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
  // TORCHELASTIC_HEALTH_CHECK_PORT (ops/health.h): answered from this event loop.
  void start_health_check();
  std::unique_ptr<mon::HealthServer> health_;
};

}  // namespace mg
