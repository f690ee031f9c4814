// mglaunch: torchrun-compatible per-node agent. Parses flags, resolves the plan and runs
// the Agent; this is the only place that turns errors into exit codes.
#include <fcntl.h>
#include <malloc.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <boost/asio/io_context.hpp>
#include <fmt/format.h>

#include "cli/args.h"
#include "launcher/agent.h"
#include "ops/doctor.h"
#include "baremetal/multihost.h"
#include "cli/errors.h"
#include "launcher/options.h"
#include "launcher/plan.h"
#include "process/watchdog.h"
#include "proto/text.h"

extern char** environ;

namespace {

// Once the run is decided, a termination signal must not turn the exit code into death by
// that signal: srun --kill-on-bad-exit sends SIGTERM to every node still exiting when the
// first one ends, and srun reports a signalled task above every exit code.
void ignore_late_signals() {
  sigset_t set;
  sigemptyset(&set);
  for (int sig : {SIGTERM, SIGINT, SIGHUP, SIGUSR1, SIGUSR2}) {
    ::signal(sig, SIG_IGN);
    sigaddset(&set, sig);
  }
  ::pthread_sigmask(SIG_BLOCK, &set, nullptr);
}

}  // namespace

int main(int argc, char** argv) {
  using namespace mg;
  // The watchdog the agent starts (process/watchdog.h): this binary in a hidden mode.
  if (argc > 1 && std::strcmp(argv[1], kWatchdogMode) == 0) return watchdog_main(argc, argv);
  auto fail = [](int code, const std::string& msg) {
    write_all(STDERR_FILENO, "mglaunch: error: " + cli::one_line(msg) + "\n");
    return code;
  };
  // One malloc arena: a helper thread (a console writer) shares the main one instead of
  // mapping a 64 MiB-aligned arena of its own (an mmap, two munmaps and an mprotect, each a
  // TLB shootdown of the other CPUs running the agent's spawn children).
  ::mallopt(M_ARENA_MAX, 1);
  try {
    ::signal(SIGPIPE, SIG_IGN);
    EnvMap env;
    for (char** e = environ; *e; ++e) {
      std::string_view kv = *e;
      auto eq = kv.find('=');
      if (eq != std::string_view::npos) env.emplace(kv.substr(0, eq), kv.substr(eq + 1));
    }
    // Bare metal: `mglaunch doctor ...` and `mglaunch --hostfile F ...` (ops/doctor.h, multihost.h).
    if (const std::vector<std::string> args(argv, argv + argc); args.size() > 1 && args[1] == "doctor")
      return doctor_main(args, env);
    else if (wants_multihost(args))
      return multihost_main(args, env);
    ParseOutcome parsed = parse_agent_args(std::vector<std::string>(argv, argv + argc), env);
    if (!parsed.options) {
      write_all(STDOUT_FILENO, parsed.message);
      return exit_code::kOk;
    }
    AgentOptions& opts = *parsed.options;
    for (const auto& w : opts.usage_warnings) write_all(STDERR_FILENO, "mglaunch: warning: " + cli::one_line(w) + "\n");
    if (opts.slurm) write_all(STDERR_FILENO, "mglaunch: " + opts.slurm->summary + "\n");
    RunPlan plan = make_plan(opts, env);
    if (opts.dry_run) {
      write_all(STDOUT_FILENO, mg::proto::dump_json(plan_to_json(plan, opts, env), 2) + "\n");
      return exit_code::kOk;
    }
    // An unwritable --summary-json is a bad flag now, not a notice after the whole run.
    if (!opts.summary_json.empty()) {
      const int fd = ::open(opts.summary_json.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
      if (fd < 0)
        throw UsageError(fmt::format("--summary-json '{}' cannot be written: {}; pick a file you can write",
                                     opts.summary_json, std::strerror(errno)));
      ::close(fd);
    }
    int code = exit_code::kInternal;
    {
      boost::asio::io_context io(1);
      AgentDeps deps = machine_deps(io, env);
      Agent agent(io, std::move(opts), std::move(plan), std::move(env), std::move(deps));
      agent.start();
      io.run();
      code = agent.exit_code();
      ignore_late_signals();
    }
    ignore_late_signals();  // again: tearing the agent down restores the default actions
    return code;
  } catch (const UsageError& e) {
    return fail(exit_code::kUsage, e.what());
  } catch (const ResourceError& e) {
    return fail(exit_code::kResource, e.what());
  } catch (const RendezvousError& e) {
    return fail(exit_code::kRendezvous, e.what());
  } catch (const ProgramNotFound& e) {
    return fail(exit_code::kNotFound, e.what());
  } catch (const std::exception& e) {
    return fail(exit_code::kInternal, fmt::format("internal error: {}", e.what()));
  } catch (...) {
    return fail(exit_code::kInternal, "internal error: an unknown exception");
  }
}
