// Multi-host bring-up: `mglaunch --hostfile FILE [...] PROGRAM ARGS` starts one agent per
// host over OpenSSH and hosts their rendezvous in-process.
//
// Pieces, from pure to wired:
//  - parse_multihost_args: consumes the fan-out's own flags (--hostfile, --include,
//    --exclude, --ssh-opts, --export, --dry-run, ...) and forwards every other flag and
//    the program verbatim to the agents.
//  - SshRunner: the seam that turns (host, remote shell command) into a local argv.
//    OpenSshRunner is `ssh -T -o BatchMode=yes [opts] -o ConnectTimeout=30 HOST -- CMD`;
//    LocalShellRunner runs CMD with /bin/sh -c on this machine (what sshd would do), for tests.
//  - make_multihost_plan: per host its node rank, agent argv and exact local argv.
//  - Fanout: runs the plan on an io_context: one child per host (own process group), the
//    rendezvous token written to its stdin (never on a command line) and the pipe kept
//    open for the job's lifetime, output relayed with [host:rankN] prefixes, stopping by
//    closing the pipes (the remote wrapper turns EOF into SIGTERM for its agent).
#pragma once

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <boost/asio/io_context.hpp>
#include <nlohmann/json.hpp>

#include "baremetal/hostfile.h"

namespace mg {

using EnvMap = std::map<std::string, std::string>;

// Exit code when a host cannot be reached (ssh itself failed with 255).
inline constexpr int kExitSshFailed = 255;

struct MultiHostOptions {
  std::string hostfile;
  std::string include;
  std::string exclude;
  std::vector<std::string> ssh_opts;  // --ssh-opts, split like a shell would
  std::vector<std::string> exports;   // NAME, NAME=VALUE or a glob like 'NCCL_*'
  bool dry_run = false;
  std::string rdzv_host;        // address the hosts reach us at; default: the route to the first host
  std::string remote_mglaunch;  // mglaunch on the hosts; default: this binary's absolute path
  std::string nproc_spec = "auto";  // for hosts without slots=N
  std::string workdir;  // where every agent starts; run_multihost fills in the current directory when empty
  std::chrono::milliseconds grace{30000};  // the agents' --grace (ours waits longer)
  std::chrono::milliseconds agree_window{10000};  // after a failure, time for the others to stop by themselves
  std::vector<std::string> forwarded;  // agent flags, verbatim
  std::vector<std::string> program;    // PROGRAM ARGS...
};

// True when argv (argv[0] skipped) asks for the fan-out: --hostfile before the program.
bool wants_multihost(const std::vector<std::string>& argv);

// Help text for the fan-out's own flags.
std::string multihost_help();

// argv[0] is skipped. Throws UsageError. An empty optional: --help was asked (print
// multihost_help()).
std::optional<MultiHostOptions> parse_multihost_args(const std::vector<std::string>& argv);

// Splits --ssh-opts text like sh would (quotes and backslashes; no expansions).
std::vector<std::string> split_shell_words(const std::string& text);

// --export patterns resolved against this environment: NAME=VALUE pairs. Throws
// UsageError for a plain NAME that is not set or a bad name. Rendezvous secrets
// (is_rdzv_secret) never go on a command line whatever the patterns say: they are left out
// and their names added to `left_out`.
EnvMap resolve_exports(const std::vector<std::string>& patterns, const EnvMap& env,
                       std::vector<std::string>* left_out = nullptr);
// MGLAUNCH_RDZV_* (the daemon token, a job's key) and MGLAUNCH_ETCD_PASSWORD.
bool is_rdzv_secret(std::string_view name);

class SshRunner {
 public:
  virtual ~SshRunner() = default;
  // The local argv that runs `remote_command` (a shell command line) on `host`.
  virtual std::vector<std::string> argv(const std::string& host, const std::string& remote_command) const = 0;
};

// How long ssh waits for a host's TCP connection and its sshd's banner (ssh's
// ConnectTimeout; without one a host whose port 22 accepts but never speaks, a hung sshd or
// a middlebox, held the run for ever). `-o ConnectTimeout=N` in --ssh-opts overrides it.
inline constexpr std::chrono::seconds kSshConnectTimeout{30};

class OpenSshRunner : public SshRunner {
 public:
  explicit OpenSshRunner(std::vector<std::string> opts, std::string ssh = "ssh")
      : opts_(std::move(opts)), ssh_(std::move(ssh)) {}
  std::vector<std::string> argv(const std::string& host, const std::string& remote_command) const override;

 private:
  std::vector<std::string> opts_;
  std::string ssh_;
};

// Runs the remote command locally with /bin/sh -c. `unreachable` hosts behave like ssh
// failing to connect (a message on stderr, exit 255).
class LocalShellRunner : public SshRunner {
 public:
  explicit LocalShellRunner(std::vector<std::string> unreachable = {}) : unreachable_(std::move(unreachable)) {}
  std::vector<std::string> argv(const std::string& host, const std::string& remote_command) const override;

 private:
  std::vector<std::string> unreachable_;
};

struct HostCommand {
  HostEntry host;
  int node_rank = 0;
  std::vector<std::string> agent_argv;  // mglaunch on the host, before quoting
  std::string remote_command;           // the shell command line the host runs
  std::vector<std::string> argv;        // what runs here (ssh ...)
};

struct MultiHostPlan {
  std::string rdzv_id;
  std::string rdzv_endpoint;  // ADDR:PORT of the in-process rendezvous
  std::string workdir;        // every host's agent starts here ("" = the remote shell's)
  EnvMap exports;
  std::vector<HostCommand> hosts;
};

// Pure: builds every host's command. `exports` are already resolved.
MultiHostPlan make_multihost_plan(const MultiHostOptions& o, const std::vector<HostEntry>& hosts,
                                  const EnvMap& exports, const std::string& rdzv_endpoint, const std::string& rdzv_id,
                                  const SshRunner& runner);

// The --dry-run document: nnodes, rdzv_endpoint, rdzv_id, exported names, and per node
// its host, slots, nproc_per_node, node_rank and ssh argv.
nlohmann::json multihost_plan_json(const MultiHostPlan& plan);

// Rewrites an agent's output line for the launcher's console: "[rank3]:x" ->
// "[host:rank3]:x", anything else -> "[host]:x".
std::string relay_prefix(const std::string& host, std::string_view& line);

// Every agent prints the same root-cause block (the rendezvous tells all of them); this
// keeps the first one whole and turns each identical one (the time line aside) into one
// line naming the host that showed it. Pure: stderr lines in, lines to show out.
class RootCauseFilter {
 public:
  std::vector<std::string> feed(const std::string& host, std::string_view line);
  // The host's stream ended: a block cut short comes out as it was.
  std::vector<std::string> finish(const std::string& host);
  // From now on every complete block is dropped: the user stopped the run (Ctrl-C), so the
  // agents reporting each other as stopped is no failure to show.
  void drop_blocks() { drop_ = true; }

 private:
  struct Open {
    std::vector<std::string> lines;
  };
  std::map<std::string, Open> open_;
  std::optional<std::string> shown_;  // the first block, time line aside
  std::string shown_host_;
  bool drop_ = false;
};

struct FanoutIo {
  int out_fd = 1;
  int err_fd = 2;
  bool handle_signals = true;  // SIGINT/SIGTERM/SIGHUP stop every host
};

// Runs a plan to completion on `io`. Single-threaded; start() sets SIGPIPE to ignored
// (a host may close its stdin early). Destroying it SIGKILLs the process
// groups of children still running (which closes their connections: the hosts see EOF).
class Fanout {
 public:
  Fanout(boost::asio::io_context& io, MultiHostPlan plan, std::string token, const MultiHostOptions& opts,
         FanoutIo fio);
  ~Fanout();
  void start();
  // Closes every host's stdin: their agents get SIGTERM and stop their workers.
  void stop_all(const std::string& why);
  // Valid once io.run() returned: 0, the first failing host's code, or 128+S when stopped by signal S.
  int exit_code() const { return exit_code_; }
  // Called once every host finished.
  std::function<void()> on_done;

 private:
  struct Host;
  void spawn_host(Host& h, const std::string& exe, const char* const* envp);
  void reap();
  void read_more(Host* h, int s);
  void relay(Host& h, int s, std::string_view line, bool cut);
  void ssh_ended(Host& h, int status);
  void on_host_exit(Host& h, int code);
  void maybe_done();
  void wait_signal();
  void notice(const std::string& text);

  boost::asio::io_context& io_;
  MultiHostPlan plan_;
  std::string token_;
  MultiHostOptions opts_;
  FanoutIo fio_;
  std::vector<std::unique_ptr<Host>> hosts_;
  struct Timers;
  std::unique_ptr<Timers> timers_;
  int first_failure_ = 0;
  int signal_ = 0;
  int interrupts_ = 0;
  bool stopping_ = false;
  bool done_ = false;
  bool waiting_children_ = false;  // a SIGCHLD wait is armed
  int exit_code_ = 0;
};

// The whole command: parses the hostfile, hosts the rendezvous, runs the fan-out (or
// prints the --dry-run plan to fio.out_fd). Returns the exit code; throws UsageError.
int run_multihost(const MultiHostOptions& o, const EnvMap& env, const SshRunner& runner, FanoutIo fio = {});

// main()'s entry: parse, pick OpenSshRunner (ssh from $MGLAUNCH_SSH or "ssh"), run.
int multihost_main(const std::vector<std::string>& argv, const EnvMap& env);

}  // namespace mg
