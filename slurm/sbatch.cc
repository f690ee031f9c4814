#include "slurm/sbatch.h"

#include <algorithm>

#include <CLI/CLI.hpp>

#include "cli/args.h"
#include "process/command.h"
#include <fmt/format.h>

namespace mg::slurm {
namespace {

// `text` on one line: control characters as \n, \t or \xNN.
std::string one_line(const std::string& text) {
  std::string out;
  for (unsigned char c : text) {
    if (c == '\n') out += "\\n";
    else if (c == '\t') out += "\\t";
    else if (c < 0x20 || c == 0x7f) out += fmt::format("\\x{:02x}", c);
    else out += static_cast<char>(c);
  }
  return out;
}

// #SBATCH values are split by sbatch at whitespace: refuse what would not survive.
void check_directive_value(const std::string& flag, const std::string& value) {
  if (value.empty()) throw SbatchUsageError(fmt::format("{} needs a value", flag));
  const bool control = std::any_of(value.begin(), value.end(), [](unsigned char c) { return c < 0x20 || c == 0x7f; });
  if (control || value.find_first_of(" '\"\\") != std::string::npos)
    throw SbatchUsageError(fmt::format(
        "bad {} '{}': spaces, quotes, backslashes and control characters cannot go into an #SBATCH line", flag,
        one_line(value)));
}

// An `--sbatch OPTION` word: one sbatch option, not one of those mglaunch-sbatch writes itself.
void check_sbatch_option(const std::string& opt) {
  check_directive_value("--sbatch", opt);
  if (opt.size() < 2 || opt[0] != '-')
    throw SbatchUsageError(fmt::format("bad --sbatch '{}': give one sbatch option, e.g. --sbatch=--constraint=a100",
                                       one_line(opt)));
  const auto start = opt.find_first_not_of('-');
  if (start == std::string::npos || opt[start] == '=')
    throw SbatchUsageError(fmt::format("bad --sbatch '{}': give one sbatch option, e.g. --sbatch=--constraint=a100",
                                       one_line(opt)));
  std::string name = opt.substr(start);
  name = name.substr(0, name.find('='));
  const bool long_name = opt[1] == '-';
  if (!long_name) name = name.substr(0, 1);  // -N4, -n 4
  // The one-agent-per-node layout and the signal are the script's own; the others have a flag here.
  static const std::pair<const char*, const char*> kOwn[] = {
      {"nodes", "--nodes"}, {"N", "--nodes"}, {"ntasks-per-node", ""}, {"ntasks", ""}, {"n", ""},
      {"signal", "--signal-before"}, {"requeue", "--requeue"}, {"no-requeue", "--requeue"},
      {"job-name", "--job-name"}, {"J", "--job-name"}, {"wait", "--wait"}, {"W", "--wait"}};
  // sbatch takes an unambiguous start of a long name for the name: --ntasks-per-nod, --sig.
  for (const auto& [own, flag] : kOwn)
    if (name == own || (long_name && std::string_view(own).size() > 1 && std::string_view(own).starts_with(name)))
      throw SbatchUsageError(
          *flag ? fmt::format("bad --sbatch '{}': use mglaunch-sbatch's {} instead", one_line(opt), flag)
                : fmt::format("bad --sbatch '{}': the script runs one mglaunch agent per node (--ntasks-per-node=1); "
                              "set workers per node with mglaunch's --nproc_per_node after '--'",
                              one_line(opt)));
}

}  // namespace


SbatchParse parse_sbatch_args(const std::vector<std::string>& argv) {
  SbatchOptions o;
  CLI::App app{"mglaunch-sbatch: submit a multi-node mglaunch job to Slurm in one line.", "mglaunch-sbatch"};
  app.prefix_command();
  app.set_version_flag("--version", std::string("mglaunch-sbatch ") + MGLAUNCH_VERSION);
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  app.get_formatter()->column_width(30);
  app.footer(
      "\nUsage: mglaunch-sbatch [FLAGS] -- [MGLAUNCH FLAGS] PROGRAM [ARGS...]\n"
      "Writes a batch script that runs `srun mglaunch ...` with one agent per node; the agents take nodes, ranks,\n"
      "rendezvous and workers per node from Slurm. SIGUSR1 (pre-emption, time limit) reaches the workers;\n"
      "with --requeue a step that exits 75 (checkpointed) requeues the job, which then resumes.\n"
      "Exit codes: 0 submitted (with --wait: the job succeeded); 2 bad flags; 127 sbatch not found;\n"
      "otherwise sbatch's own exit code, which with --wait is the job's exit code.");
  int gpus = -1;
  app.add_option("-N,--nodes", o.nodes, "Number of nodes (default 1)");
  app.add_option("--gpus-per-node,--gpus_per_node", gpus, "GPUs per node; mglaunch starts one worker per GPU");
  app.add_option("-p,--partition", o.partition, "Slurm partition");
  app.add_option("-t,--time", o.time, "Time limit, as sbatch takes it (e.g. 2:00:00)");
  app.add_option("-A,--account", o.account, "Account to charge");
  app.add_option("-o,--output", o.output, "Batch output file (sbatch's patterns such as %j work)");
  app.add_option("-J,--job-name,--job_name", o.job_name, "Job name (default mglaunch)");
  int cpus = -1;
  app.add_option("-c,--cpus-per-task,--cpus_per_task", cpus, "CPUs per node for the agent and its workers");
  app.add_option("--mem", o.mem, "Memory per node, as sbatch takes it (e.g. 64G)");
  app.add_flag("--exclusive", o.exclusive, "Nodes not shared with other jobs");
  app.add_option("-q,--qos", o.qos, "Quality of service");
  app.add_option("--gres", o.gres, "Generic resources per node (e.g. gpu:a100:4)");
  app.add_option("--sbatch", o.sbatch_options,
                 "Any other sbatch option, as one word: --sbatch=--constraint=a100 (repeatable)")
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  app.add_flag("--requeue", o.requeue, "Requeue the job when its step stops with 75 (checkpointed)");
  app.add_option("--signal-before,--signal_before", o.signal_before,
                 "Seconds before the time limit that the job gets SIGUSR1 (default 120)");
  app.add_flag("--dry-run,--dry_run", o.dry_run, "Print the batch script and submit nothing");
  app.add_flag("--wait", o.wait, "Wait for the job to end and exit with its exit code");
  app.add_option("--mglaunch", o.mglaunch, "mglaunch to run on the nodes (default: the one next to mglaunch-sbatch)");

  // argparse's rules as mglaunch: `--flag=` is an empty value that never takes the next
  // argument, unique prefixes name a flag; the command after the flags is not looked at.
  mg::cli::Normalized norm;
  try {
    norm = mg::cli::normalize_args(std::vector<std::string>(argv.begin() + (argv.empty() ? 0 : 1), argv.end()),
                                   mg::cli::specs_of(app), /*stop_at_positional=*/true);
  } catch (const mg::cli::ArgsError& e) {
    throw SbatchUsageError(fmt::format("{}; mglaunch's own flags go after '--' (see mglaunch-sbatch --help)", e.what()));
  }
  std::vector<std::string> args(norm.args.begin(), norm.args.begin() + static_cast<std::ptrdiff_t>(norm.rest));
  std::reverse(args.begin(), args.end());
  try {
    app.parse(args);
  } catch (const CLI::CallForVersion&) {
    return {std::nullopt, std::string("mglaunch-sbatch ") + MGLAUNCH_VERSION + "\n"};
  } catch (const CLI::Success&) {
    return {std::nullopt, app.help()};
  } catch (const CLI::ParseError& e) {
    std::string what = e.what();
    if (auto nl = what.find('\n'); nl != std::string::npos) what.resize(nl);
    throw SbatchUsageError(fmt::format("{} (see mglaunch-sbatch --help)", what));
  }
  o.command.assign(norm.args.begin() + static_cast<std::ptrdiff_t>(norm.rest), norm.args.end());
  if (!o.command.empty() && o.command.front() == "--") o.command.erase(o.command.begin());
  if (o.command.empty())
    throw SbatchUsageError("no program given: usage is mglaunch-sbatch [FLAGS] -- [MGLAUNCH FLAGS] PROGRAM [ARGS...]");
  if (o.nodes < 1) throw SbatchUsageError(fmt::format("bad --nodes '{}': must be >= 1", o.nodes));
  if (app.get_option("--gpus-per-node")->count() > 0) {
    if (gpus < 1) throw SbatchUsageError(fmt::format("bad --gpus-per-node '{}': must be >= 1", gpus));
    o.gpus_per_node = gpus;
  }
  if (o.signal_before < 1 || o.signal_before > 65535)
    throw SbatchUsageError(fmt::format("bad --signal-before '{}': use 1..65535 seconds", o.signal_before));
  if (app.get_option("--cpus-per-task")->count() > 0) {
    if (cpus < 1) throw SbatchUsageError(fmt::format("bad --cpus-per-task '{}': must be >= 1", cpus));
    o.cpus_per_task = cpus;
  }
  for (const auto& [flag, value] : {std::pair<const char*, const std::string*>{"--mem", &o.mem}, {"--qos", &o.qos},
                                    {"--gres", &o.gres}})
    if (app.get_option(flag)->count() > 0) check_directive_value(flag, *value);
  for (const auto& opt : o.sbatch_options) check_sbatch_option(opt);
  if (!o.partition.empty()) check_directive_value("--partition", o.partition);
  if (!o.time.empty()) check_directive_value("--time", o.time);
  if (!o.account.empty()) check_directive_value("--account", o.account);
  if (!o.output.empty()) check_directive_value("--output", o.output);
  check_directive_value("--job-name", o.job_name);
  if (!o.mglaunch.empty() && o.mglaunch.front() != '/')
    throw SbatchUsageError(fmt::format("bad --mglaunch '{}': give an absolute path (the nodes run it)", o.mglaunch));
  return {std::move(o), {}};
}

std::string make_batch_script(const SbatchOptions& o) {
  std::string s = "#!/bin/bash\n";
  auto directive = [&](const std::string& text) { s += "#SBATCH " + text + "\n"; };
  directive("--job-name=" + o.job_name);
  directive(fmt::format("--nodes={}", o.nodes));
  directive("--ntasks-per-node=1");
  if (o.gpus_per_node) directive(fmt::format("--gpus-per-node={}", *o.gpus_per_node));
  if (!o.partition.empty()) directive("--partition=" + o.partition);
  if (!o.time.empty()) directive("--time=" + o.time);
  if (!o.account.empty()) directive("--account=" + o.account);
  if (!o.output.empty()) directive("--output=" + o.output);
  if (o.cpus_per_task) directive(fmt::format("--cpus-per-task={}", *o.cpus_per_task));
  if (!o.mem.empty()) directive("--mem=" + o.mem);
  if (o.exclusive) directive("--exclusive");
  if (!o.qos.empty()) directive("--qos=" + o.qos);
  if (!o.gres.empty()) directive("--gres=" + o.gres);
  for (const auto& opt : o.sbatch_options) directive(opt);
  directive(fmt::format("--signal=B:USR1@{}", o.signal_before));
  directive(o.requeue ? "--requeue" : "--no-requeue");

  std::string cmd = "srun --kill-on-bad-exit=1 --ntasks-per-node=1 ";
  // Slurm 22.05 and later: a step does not take the job's --cpus-per-task, it must say so.
  if (o.cpus_per_task) cmd += fmt::format("--cpus-per-task={} ", *o.cpus_per_task);
  cmd += shell_quote(o.mglaunch);
  for (const auto& a : o.command) cmd += " " + shell_quote(a);

  s += fmt::format(
      "# Written by mglaunch-sbatch {}. One mglaunch agent per node; it takes the node count, node rank,\n"
      "# rendezvous and workers per node from Slurm. SIGUSR1 (scancel --signal=USR1 --batch, or {} s before\n"
      "# the time limit) goes to the step; workers that checkpoint and exit {} end the step with {}.\n",
      MGLAUNCH_VERSION, o.signal_before, kStoppedExitCode, kStoppedExitCode);
  s += "echo \"mglaunch-sbatch: job $SLURM_JOB_ID run ${SLURM_RESTART_COUNT:-0} on $SLURM_JOB_NODELIST\" >&2\n";
  s += cmd + " &\n";
  s += "step=$!\n"
       "interrupted=0 preempted=0\n"
       "forward() { interrupted=1 preempted=1; echo \"mglaunch-sbatch: got SIGUSR1, passing it to the step\" >&2; "
       "kill -USR1 \"$step\" 2>/dev/null; }\n"
       "trap forward USR1\n"
       "# A trapped signal ends `wait` early: wait again until the step itself has ended.\n"
       "while :; do\n"
       "  interrupted=0\n"
       "  wait \"$step\"; rc=$?\n"
       "  if [ \"$interrupted\" = 0 ] || [ \"$rc\" -le 128 ]; then break; fi\n"
       "done\n";
  if (o.requeue) {
    // After a SIGUSR1, 143 counts as stopped too: when the first node ends with 75, srun
    // --kill-on-bad-exit sends SIGTERM to the nodes still stopping, and an agent stopped by
    // SIGTERM ends with 143 although its workers checkpointed.
    s += fmt::format(
        "if [ \"$rc\" -eq {0} ] || {{ [ \"$preempted\" = 1 ] && [ \"$rc\" -eq 143 ]; }}; then\n"
        "  echo \"mglaunch-sbatch: the step stopped with $rc after checkpointing: requeueing job $SLURM_JOB_ID\" >&2\n"
        "  scontrol requeue \"$SLURM_JOB_ID\"\n"
        "fi\n",
        kStoppedExitCode);
  }
  s += "exit \"$rc\"\n";
  return s;
}

}  // namespace mg::slurm
