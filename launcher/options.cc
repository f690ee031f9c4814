#include "launcher/options.h"

#include <netdb.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli/args.h"
#include "cli/errors.h"
#include "launcher/option_values.h"
#include "ops/hwprobe.h"
#include "process/proc.h"
#include "process/run.h"
#include "rendezvous/endpoint.h"
#include "rendezvous/etcd_log.h"
#include "rendezvous/token_strength.h"
#include "slurm/env.h"

namespace mg {

namespace {

// "--nproc_per_node,--nproc-per-node" for a torchrun flag name with underscores.
std::string both_spellings(const std::string& name) {
  std::string dashed = name;
  std::replace(dashed.begin(), dashed.end(), '_', '-');
  return dashed == name ? "--" + name : "--" + name + ",--" + dashed;
}

// JSON config files for CLI11: {"nproc_per_node": 4, "standalone": true, ...}. A key that
// is no flag name is an error naming the nearest one.
class JsonConfig : public CLI::Config {
 public:
  std::vector<std::string> valid_keys;  // long flag names, set once every option is added

  std::string to_config(const CLI::App*, bool, bool, std::string) const override { return "{}"; }
  std::vector<CLI::ConfigItem> from_config(std::istream& in) const override {
    nlohmann::json j = nlohmann::json::parse(in, nullptr, false);
    if (j.is_discarded() || !j.is_object()) throw CLI::ConversionError("--config: the file is not a JSON object");
    std::vector<CLI::ConfigItem> items;
    for (auto& [key, value] : j.items()) {
      if (std::find(valid_keys.begin(), valid_keys.end(), key) == valid_keys.end()) {
        auto near = cli::nearest_name(key, valid_keys);
        throw CLI::ConversionError(fmt::format("--config: unknown key '{}'{}", key,
                                               near ? fmt::format(": did you mean '{}'?", *near) : ""));
      }
      CLI::ConfigItem item;
      item.name = key;
      auto text = [](const nlohmann::json& v) { return v.is_string() ? v.get<std::string>() : v.dump(); };
      if (value.is_array()) {
        for (auto& v : value) item.inputs.push_back(text(v));
      } else {
        item.inputs.push_back(text(value));
      }
      items.push_back(std::move(item));
    }
    return items;
  }
};

int read_sysfs_gpu_count() {
  std::error_code ec;
  int n = 0;
  for (auto it = std::filesystem::directory_iterator("/proc/driver/nvidia/gpus", ec);
       !ec && it != std::filesystem::directory_iterator(); it.increment(ec))
    ++n;
  return n;
}

// stdout of argv (stderr discarded), or nullopt when it cannot run, exits non-zero or
// takes longer than 30 s (scontrol with an unreachable slurmctld).
std::optional<std::string> capture(const std::vector<std::string>& argv) {
  RunOptions o;
  o.timeout = std::chrono::seconds(30);
  RunResult r = run_capture(argv, o);
  if (!r.ok()) return std::nullopt;
  return std::move(r.out);
}

HardwareProbe::NodeAddress system_node_address(const std::string& name) {
  if (rdzv::resolves(name)) return {name, "resolves"};
  if (auto out = capture({"scontrol", "show", "node", name})) {
    if (std::string addr = slurm::parse_node_addr(*out); !addr.empty())
      return {addr, fmt::format("'{}' does not resolve: NodeAddr from scontrol show node", name)};
  }
  return {name, fmt::format("'{}' does not resolve and scontrol show node gave no NodeAddr", name)};
}

std::pair<int, int> system_ephemeral_ports() {
  return ephemeral_port_range_of_kernel().value_or(std::pair<int, int>{32768, 60999});  // else Linux's default
}

// Fills what the user left open from the Slurm step; `given(flag)` says what was explicit.
void apply_slurm(AgentOptions& o, std::string& nnodes, const std::map<std::string, std::string>& env,
                 const HardwareProbe& probe, const std::function<bool(const char*)>& given) {
  const auto eph = probe.ephemeral_ports ? probe.ephemeral_ports() : system_ephemeral_ports();
  slurm::SlurmPlan sp;
  try {
    sp = slurm::plan_from_env(env, {eph.first, eph.second});
  } catch (const std::invalid_argument& e) {
    throw UsageError(fmt::format("inside a Slurm step: {}", e.what()));
  }
  auto address = [&](const std::string& name) {
    return probe.node_address ? probe.node_address(name) : system_node_address(name);
  };
  SlurmContext ctx{sp.job_id, sp.step_id, sp.node_name.value, sp.nodes.value, sp.restart_count, {}};
  auto& src = o.sources;
  auto fill = [&](const char* flag, const char* key, const std::string& source, auto&& set) {
    if (given(flag)) {
      src[key] = "flag " + std::string(flag);
      return false;
    }
    src[key] = source;
    set();  // may refine src[key]
    return true;
  };
  fill("--nproc_per_node", "nproc_per_node", sp.nproc_per_node.source,
       [&] { o.nproc_spec = std::to_string(sp.nproc_per_node.value); });
  src["nodes"] = sp.nodes.source;
  std::string where;
  if (o.standalone) {
    // --standalone keeps this a single-node job; only the worker count comes from Slurm.
    where = "--standalone: single node";
  } else {
    fill("--nnodes", "nnodes", sp.nnodes.source, [&] { nnodes = std::to_string(sp.nnodes.value); });
    fill("--node_rank", "node_rank", sp.node_rank.source, [&] {
      o.node_rank = sp.node_rank.value;
      o.node_rank_given = true;  // the rendezvous keeps Slurm's node order
    });
    fill("--rdzv_backend", "rdzv_backend", "Slurm step: multi-node rendezvous hosted by node 0",
         [&] { o.rdzv_backend = "c10d"; });
    fill("--rdzv_id", "rdzv_id", sp.rdzv_id.source, [&] { o.rdzv_id = sp.rdzv_id.value; });
    fill("--local_addr", "local_addr", "", [&] {
      auto a = address(sp.node_name.value);
      o.local_addr = a.address;
      src["local_addr"] = fmt::format("{} ({})", sp.node_name.source, a.how);
    });
    if (o.rdzv_backend == "static") {
      // An explicit static rendezvous: node 0 is the master, on the step's port.
      const bool need_addr = !given("--master_addr"), need_port = !given("--master_port");
      if (need_addr) {
        auto a = address(sp.rdzv_host.value);
        o.master_addr = a.address;
        src["master_addr"] = fmt::format("{} '{}' ({})", sp.rdzv_host.source, sp.rdzv_host.value, a.how);
      }
      if (need_port) {
        o.master_port = sp.rdzv_port.value;
        src["master_port"] = sp.rdzv_port.source;
      }
      where = fmt::format("master {}:{}", o.master_addr, o.master_port);
    } else {
      fill("--rdzv_endpoint", "rdzv_endpoint", "", [&] {
        auto a = address(sp.rdzv_host.value);
        o.rdzv_endpoint = fmt::format("{}:{}", a.address.find(':') != std::string::npos ? "[" + a.address + "]" : a.address,
                                      sp.rdzv_port.value);
        src["rdzv_endpoint"] = fmt::format("{} '{}' ({}), port: {}", sp.rdzv_host.source, sp.rdzv_host.value, a.how,
                                           sp.rdzv_port.source);
        // Node 0 hosts it, the others only join (an explicit --rdzv_conf is_host=... still wins).
        o.rdzv_is_host = o.node_rank == 0;
        if (o.node_rank != 0 || o.rdzv_conf.find("is_host") != std::string::npos) return;
        auto busy = probe.listen_error ? probe.listen_error(a.address, sp.rdzv_port.value)
                                       : rdzv::probe_listen(a.address, sp.rdzv_port.value);
        if (busy)
          throw UsageError(fmt::format(
              "the rendezvous port of this Slurm step, {}:{} ({}), cannot be used on node 0: {}; another program or a "
              "step whose hash collides holds it: run srun with --resv-ports, or give --rdzv_endpoint={}:FREE_PORT",
              a.address, sp.rdzv_port.value, sp.rdzv_port.source, *busy, a.address));
      });
      where = fmt::format("rendezvous {} on {}", o.rdzv_endpoint, sp.rdzv_host.value);
    }
  }
  const std::string nproc_src = given("--nproc_per_node") ? "flag" : sp.nproc_per_node.source;
  ctx.summary = fmt::format(
      "Slurm step {}.{}{}: node {} of {} ({}), {} workers per node ({}), {}; flags you give win, --no-slurm turns "
      "this off",
      sp.job_id, sp.step_id, sp.restart_count > 0 ? fmt::format(" (restart {})", sp.restart_count) : "",
      o.node_rank_given ? o.node_rank : sp.node_rank.value, given("--nnodes") ? nnodes : std::to_string(sp.nnodes.value),
      sp.node_name.value, o.nproc_spec, nproc_src, where);
  for (const auto& w : sp.warnings) o.warnings.push_back("Slurm: " + w);
  o.slurm = std::move(ctx);
}

}  // namespace

HardwareProbe HardwareProbe::system() {
  // GPUs: NVML's count when a driver is there, else the NVIDIA devices in sysfs. CPUs: what
  // this process may really use (affinity mask and cgroup quota), not the online count.
  auto gpus = [] {
    std::string error;
    const auto nvml = hw::make_nvml_probe()->gpus(error);
    return nvml.empty() ? read_sysfs_gpu_count() : static_cast<int>(nvml.size());
  };
  return {gpus, [] { return std::max(1, hw::probe_cpus().usable()); }, system_node_address, system_ephemeral_ports};
}


namespace {

// One parse of mglaunch's command line: the flag table (CLI11 writes into `o` and the
// text members), where each value came from, and the checks of the values, in the order
// their errors are reported. Not movable: CLI11 holds pointers to the members.
struct AgentParse {
  AgentParse(const std::map<std::string, std::string>& env_in, const HardwareProbe& probe_in)
      : env(env_in), probe(probe_in) {
    declare_flags();
  }
  AgentParse(const AgentParse&) = delete;
  AgentParse& operator=(const AgentParse&) = delete;

  ParseOutcome parse(const std::vector<std::string>& argv);

  const std::map<std::string, std::string>& env;
  const HardwareProbe& probe;
  AgentOptions o;
  CLI::App app{"mglaunch: a drop-in for torchrun. Starts and supervises the workers of one node.", "mglaunch"};
  std::shared_ptr<JsonConfig> json_config = std::make_shared<JsonConfig>();
  // Options with a PET_* fallback; applied after parsing (flags > PET_* > --config).
  std::vector<std::pair<CLI::Option*, std::string>> pet_options;
  // Where each value came from, for error messages: the flag, its PET_* variable or --config.
  std::map<const CLI::Option*, std::string> source;

  std::string nnodes = "1:1", redirects, tee, filter, gpu_ids;
  // Numbers are taken as text and checked below, so that every error names where the
  // value came from (flag, PET_* variable or --config key) and the valid range.
  std::string node_rank = "0", master_port = "29500", max_restarts = "0", monitor_interval = "5", grace = "30";
  bool use_env = false;
  std::string token_file, stdin_rank = "0", prefix_template, monitor, preflight;
  std::string shutdown_timeout, signals = "SIGTERM,SIGINT,SIGHUP,SIGQUIT", numa_binding, dup_filters[2], logs_specs;

 private:
  void declare_flags();
  static std::string pet(std::string name) {
    std::transform(name.begin(), name.end(), name.begin(), ::toupper);
    return "PET_" + name;
  }
  template <typename T>
  CLI::Option* opt(const std::string& name, T& var, const std::string& help) {
    auto* option = app.add_option(both_spellings(name), var, help);
    pet_options.emplace_back(option, pet(name));
    return option;
  }
  CLI::Option* flag(const std::string& names, const std::string& env_name, bool& var, const std::string& help) {
    auto* f = app.add_flag(names, var, help);
    if (!env_name.empty()) pet_options.emplace_back(f, pet(env_name));
    return f;
  }
  void take_environment(const cli::Normalized& norm, const std::vector<cli::FlagSpec>& specs);
  std::string from(const std::string& flag_name) const;
  void read_place_and_program(const cli::Normalized& norm);
  void check_workers();
  void check_stop_and_binding();
  void check_streams_and_gpus();
  void check_monitoring_and_program();
  void check_rendezvous();
  void check_addresses();
  void read_tokens();
};

void AgentParse::declare_flags() {
  app.prefix_command();
  app.set_version_flag("--version", std::string("mglaunch ") + MGLAUNCH_VERSION);
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  auto json_config = std::make_shared<JsonConfig>();
  app.config_formatter(json_config);
  app.set_config("--config", "", "JSON file with flag values (keys as flag names); flags override it");
  app.get_formatter()->column_width(36);
  app.footer(
      "\nUsage: mglaunch [FLAGS] PROGRAM [ARGS...]  (flags stop at PROGRAM; its ARGS pass through untouched)\n"
      "       mglaunch --hostfile FILE [FLAGS] PROGRAM [ARGS...]  one agent per host of FILE over ssh\n"
      "                (see mglaunch --hostfile FILE --help)\n"
      "       mglaunch doctor [--json]  what this machine offers and suggested settings (see mglaunch doctor --help)\n"
      "Exit codes: 0 all workers succeeded; N the failing worker's exit code (128+S if killed by signal S);\n"
      "2 bad flags or config; 127 program or interpreter not found; 128+S the agent was stopped by signal S;\n"
      "1 internal error. See README.md.");

  opt("nnodes", nnodes, "Number of nodes, N or MIN:MAX (elastic)");
  opt("nproc_per_node", o.nproc_spec, "Workers per node: N, auto, gpu or cpu");
  opt("node_rank", node_rank, "Rank of this node (static rendezvous)");
  opt("master_addr", o.master_addr, "Master address (static rendezvous)");
  opt("master_port", master_port, "Master port (static rendezvous)");
  opt("rdzv_backend", o.rdzv_backend, "static, c10d, mglaunch or etcd");
  opt("rdzv_endpoint", o.rdzv_endpoint, "Rendezvous HOST[:PORT]");
  opt("rdzv_id", o.rdzv_id, "Job id shared by every node");
  opt("rdzv_conf", o.rdzv_conf, "Rendezvous settings, KEY=VALUE,...");
  flag(both_spellings("standalone"), "standalone", o.standalone, "Single node: local rendezvous on a free port");
  opt("max_restarts", max_restarts, "Restarts of the worker group before failing");
  opt("monitor_interval", monitor_interval, "Accepted for torchrun compatibility (supervision is event-driven)");
  opt("role", o.role, "Worker role name");
  opt("local_addr", o.local_addr, "Address this node advertises");
  flag("-m,--module", "module", o.module, "Run the program as a Python module (python -m)");
  flag(both_spellings("no_python"), "no_python", o.no_python, "Run the program directly, not through Python");
  flag(both_spellings("run_path"), "run_path", o.run_path, "Run a Python script by path (same as the default)");
  opt("log_dir", o.log_dir, "Directory for per-rank logs and error files");
  pet_options.emplace_back(
      app.add_option("-r,--redirects", redirects, "Send worker streams to log files only: 0-3 or RANK:N,..."),
      "PET_REDIRECTS");
  pet_options.emplace_back(app.add_option("-t,--tee", tee, "Copy worker streams to log files too: 0-3 or RANK:N,..."),
                           "PET_TEE");
  opt("local_ranks_filter", filter, "Show only these local ranks' output on the console, e.g. 0,3");
  opt("start_method", o.start_method, "Accepted for torchrun compatibility; has no effect (always fork+exec)");
  flag("--local-rank-arg,--local_rank_arg", "", o.local_rank_arg, "Pass --local_rank=N to the program");
  flag("--use_env,--use-env", "", use_env, "Accepted for torch.distributed.launch scripts; no effect");
  app.add_option("--cpu-bind,--cpu_bind", o.cpu_bind,
                 "Pin each worker: none (default), cores (disjoint cores, near its GPU), numa (its NUMA node), "
                 "socket (its GPU's package), core-complex (one L3 cache of its node)");
  app.add_option("--gpu_ids,--gpu-ids", gpu_ids, "GPU ids for local ranks 0,1,...: CUDA_VISIBLE_DEVICES per worker");
  app.add_option("--grace", grace, "Seconds between SIGTERM and SIGKILL when stopping workers (default 30)");
  app.add_option("--summary-json,--summary_json", o.summary_json, "Write the run's summary as JSON to this file");
  flag("--dry-run,--dry_run", "", o.dry_run, "Print the resolved plan as JSON and start nothing");
  // Not "--standby-...": a flag starting with "stand" would make torchrun's abbreviation
  // `--stand` (of --standalone) ambiguous.
  flag("--prestart-standby,--prestart_standby", "", o.prestart_standby,
       "On a standby node, start the workers at once with MGLAUNCH_STANDBY=1 and no rank; a worker that supports it "
       "loads and waits for the place (docs/in-place-recovery.md); only for such workers, e.g. mgtrain "
       "--in-place-recovery");
  flag("--timestamps", "", o.timestamps, "Prefix relayed worker lines with the time");
  app.add_option("--token-file,--token_file", token_file,
                 "File with the rendezvous token (HMAC-SHA256 challenge); or set MGLAUNCH_RDZV_TOKEN");
  app.add_option("--python", o.python, "Interpreter for .py programs and -m (default $MGLAUNCH_PYTHON or python3)");
  app.add_option("--stdin-rank,--stdin_rank", stdin_rank,
                 "Local rank that reads mglaunch's stdin (default 0), or none: the others read /dev/null");
  app.add_option("--log-line-prefix-template,--log_line_prefix_template", prefix_template,
                 "Prefix of relayed lines: ${role_name}, ${rank}, ${local_rank} (default [rank${rank}]:); empty: raw")
      ->envname("PET_LOG_LINE_PREFIX_TEMPLATE");
  flag("--no-slurm,--no_slurm", "", o.no_slurm,
       "Ignore the Slurm step mglaunch runs in (by default its SLURM_* variables fill the flags not given)");

  app.add_flag("--monitor", monitor,
               "Print each worker's CPU%/RSS (whole process tree) and each GPU's figures every SECONDS "
               "(--monitor or --monitor=SECONDS, default 5)")
      ->option_text("[=SECONDS]");
  app.add_option("--metrics-json,--metrics_json", o.metrics_json, "Append every monitor sample as one JSON line to FILE");
  app.add_option("--metrics-port,--metrics_port", o.metrics_port,
                 "Serve Prometheus metrics at http://METRICS-HOST:P/metrics (0 picks a port; printed)");
  app.add_option("--metrics-host,--metrics_host", o.metrics_host, "Address for --metrics-port (default 127.0.0.1)");
  app.add_option("--trace", o.trace_file, "Write a Chrome/Perfetto trace (JSON) of the run to FILE");
  app.add_flag("--preflight", preflight,
               "Before the job's workers start, the nodes run a short all-reduce and a point-to-point bandwidth "
               "check between them and name a slow or broken node: fail (the default) ends the run with exit 5, "
               "warn goes on (--preflight or --preflight=fail|warn|off)")
      ->option_text("[=MODE]");
  // torch 2.x's flags (#25; docs/flags.md)
  opt("shutdown_timeout", shutdown_timeout,
      "torchrun's name for --grace: seconds from SIGTERM to SIGKILL (else $TORCH_ELASTIC_SHUTDOWN_TIMEOUT, 30)");
  opt("signals_to_handle", signals,
      "Signals that stop the workers with that signal and end the run with 128+S (default "
      "SIGTERM,SIGINT,SIGHUP,SIGQUIT; SIGUSR1/SIGUSR2 are always forwarded)");
  app.add_option(both_spellings("numa_binding"), numa_binding,
                 "Pin each worker near its GPU: node (its NUMA node), socket, exclusive (disjoint cores of its "
                 "node) or core-complex (CPUs of one L3 cache); torchrun's names for --cpu-bind");
  flag(both_spellings("virtual_local_rank"), "virtual_local_rank", o.virtual_local_rank,
       "LOCAL_RANK=0 for every worker, CUDA_VISIBLE_DEVICES its own GPU only");
  opt("duplicate_stdout_filters", dup_filters[0],
      "Copy stdout lines of tee'd ranks holding any of A,B,... (,, for a comma) to filtered_stdout.log");
  opt("duplicate_stderr_filters", dup_filters[1],
      "Copy stderr lines of tee'd ranks holding any of A,B,... (,, for a comma) to filtered_stderr.log");
  opt("event_log_handler", o.event_log_handler,
      "torchrun's event handler: null (default, silent) or console prints the agent's elastic events on stderr, "
      "one JSON line each in torch's Event form");
  app.add_option(both_spellings("logs_specs"), logs_specs,
                 "torchrun's logs specs plugin: only the default (torch's DefaultLogsSpecs) exists here");

  if (auto it = env.find("MGLAUNCH_PYTHON"); it != env.end() && !it->second.empty()) {
    o.python = it->second;
    o.python_source = "MGLAUNCH_PYTHON";
  }
  json_config->valid_keys = cli::long_names(cli::specs_of(app));
}

ParseOutcome AgentParse::parse(const std::vector<std::string>& argv) {
  // Argparse's rules first (explicit empty values, unique prefixes, a value never taken
  // from the next flag), then CLI11 on the flags alone; the program and its arguments are
  // never looked at.
  const std::vector<cli::FlagSpec> specs = cli::specs_of(app);
  cli::Normalized norm;
  try {
    norm = cli::normalize_args(std::vector<std::string>(argv.begin() + (argv.empty() ? 0 : 1), argv.end()), specs,
                               /*stop_at_positional=*/true);
  } catch (const cli::ArgsError& e) {
    throw UsageError(fmt::format("{} (see mglaunch --help)", e.what()));
  }
  std::vector<std::string> args(norm.args.begin(), norm.args.begin() + static_cast<std::ptrdiff_t>(norm.rest));
  std::reverse(args.begin(), args.end());  // CLI11 consumes from the back
  try {
    app.parse(args);
  } catch (const CLI::CallForVersion&) {
    return {std::nullopt, std::string("mglaunch ") + MGLAUNCH_VERSION + "\n"};
  } catch (const CLI::Success&) {
    return {std::nullopt, app.help()};
  } catch (const CLI::ParseError& e) {
    std::string what = e.what();
    if (auto nl = what.find('\n'); nl != std::string::npos) what.resize(nl);
    throw UsageError(fmt::format("{} (see mglaunch --help)", what));
  }
  take_environment(norm, specs);
  read_place_and_program(norm);
  check_workers();
  check_stop_and_binding();
  check_streams_and_gpus();
  check_monitoring_and_program();
  check_rendezvous();
  check_addresses();
  read_tokens();
  return {std::move(o), {}};
}

void AgentParse::take_environment(const cli::Normalized& norm, const std::vector<cli::FlagSpec>& specs) {
  for (auto k : norm.given) source[app.get_option(specs[k].display())] = specs[k].display();
  for (auto& [option, var] : pet_options) {
    if (source.count(option)) continue;  // a flag beats the environment
    auto it = env.find(var);
    if (it == env.end()) continue;
    const bool text = option->get_type_name().starts_with("TEXT") && option->get_expected_max() > 0;
    if (it->second.empty() && !text)
      throw UsageError(fmt::format("{} is set but empty: give it a value or unset it", var));
    option->clear();
    option->add_result(it->second);
    try {
      option->run_callback();
    } catch (const CLI::ParseError&) {
      throw UsageError(fmt::format("bad {} '{}': expected {}", var, it->second,
                                   option->get_expected_max() == 0 ? "0 or 1" : option->get_type_name()));
    }
    source[option] = var;
  }
}

std::string AgentParse::from(const std::string& flag_name) const {
  const CLI::Option* option = app.get_option(flag_name);
  if (auto it = source.find(option); it != source.end()) return it->second;
  if (option->count() > 0) return fmt::format("--config key '{}'", option->get_lnames().front());
  return flag_name;
}

void AgentParse::read_place_and_program(const cli::Normalized& norm) {
  o.node_rank = parse_int(from("--node_rank"), node_rank, 0);
  o.node_rank_given = app.get_option("--node_rank")->count() > 0;
  o.master_port = parse_int(from("--master_port"), master_port, 0, 65535);
  if (!o.no_slurm && slurm::in_slurm_step(env))
    apply_slurm(o, nnodes, env, probe, [&](const char* name) { return app.get_option(name)->count() > 0; });
  std::vector<std::string> rest(norm.args.begin() + static_cast<std::ptrdiff_t>(norm.rest), norm.args.end());
  if (!rest.empty() && rest.front() == "--") rest.erase(rest.begin());
  if (rest.empty())
    throw UsageError("no training program given: usage is mglaunch [FLAGS] PROGRAM [ARGS...] (see mglaunch --help)");
  o.program = rest.front();
  o.program_args.assign(rest.begin() + 1, rest.end());
}

// Values that need more than a type check.
void AgentParse::check_workers() {
  o.nnodes = parse_nnodes(nnodes, from("--nnodes"));
  if (o.rdzv_id.empty()) o.rdzv_id = "none";  // as torchrun: an empty run id is no run id
  if (o.nproc_spec == "auto" || o.nproc_spec == "gpu" || o.nproc_spec == "cpu") {
    const int gpus = probe.gpu_count();
    if (o.nproc_spec == "gpu" && gpus == 0)
      throw UsageError("--nproc_per_node=gpu but no GPU is visible; give a number or use cpu");
    o.nproc_per_node = (o.nproc_spec == "cpu" || (o.nproc_spec == "auto" && gpus == 0)) ? probe.cpu_count() : gpus;
    if (o.nproc_per_node > kMaxWorkersPerNode)
      throw UsageError(fmt::format("--nproc_per_node={} gives {} workers: at most {} per node; give a number",
                                   o.nproc_spec, o.nproc_per_node, kMaxWorkersPerNode));
  } else {
    const int n = parse_int(from("--nproc_per_node"), o.nproc_spec, 1);
    if (n > kMaxWorkersPerNode) {
      // A count Slurm gave (SLURM_GPUS_ON_NODE=...) is named as that variable.
      auto src = o.sources.find("nproc_per_node");
      if (o.slurm && src != o.sources.end() && !src->second.starts_with("flag "))
        throw UsageError(fmt::format("inside a Slurm step: {} gives {} workers: at most {} per node; pass "
                                     "--nproc_per_node=N (or --no-slurm)",
                                     src->second, n, kMaxWorkersPerNode));
      throw UsageError(
          fmt::format("bad {} '{}': at most {} workers per node", from("--nproc_per_node"), o.nproc_spec, kMaxWorkersPerNode));
    }
    o.nproc_per_node = n;
  }
  // Overflow-safe: every rank of the job must fit RANK's 32 bits.
  if (static_cast<long long>(o.nnodes.max) * o.nproc_per_node > kMaxRanks)
    throw UsageError(fmt::format("--nnodes={} with {} workers per node makes {} ranks: at most {} (2^31-1); use fewer "
                                 "nodes or workers",
                                 o.nnodes.max, o.nproc_per_node,
                                 static_cast<long long>(o.nnodes.max) * o.nproc_per_node, kMaxRanks));
  o.max_restarts = parse_int(from("--max_restarts"), max_restarts, 0);
}

void AgentParse::check_stop_and_binding() {
  o.monitor_interval = parse_seconds(from("--monitor_interval"), monitor_interval, 0.001, 86400);
  o.grace = std::chrono::milliseconds(static_cast<long>(parse_seconds(from("--grace"), grace, 0, 86400) * 1000));
  // The stop grace: --shutdown-timeout (or PET_SHUTDOWN_TIMEOUT) > --grace >
  // TORCH_ELASTIC_SHUTDOWN_TIMEOUT > 30 s.
  const bool grace_given = app.get_option("--grace")->count() > 0;
  auto to_ms = [](double s) { return std::chrono::milliseconds(static_cast<long>(s * 1000)); };
  if (app.get_option("--shutdown_timeout")->count() > 0) {
    const auto ms = to_ms(parse_seconds(from("--shutdown_timeout"), shutdown_timeout, 0, 86400));
    if (grace_given && ms != o.grace)
      o.warnings.push_back(fmt::format("--grace {} has no effect: {} {} sets the stop grace", grace,
                                       from("--shutdown_timeout"), shutdown_timeout));
    o.grace = ms;
  } else if (auto it = env.find("TORCH_ELASTIC_SHUTDOWN_TIMEOUT"); it != env.end() && !grace_given) {
    o.grace = to_ms(parse_seconds("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", it->second, 0, 86400));
  }
  if (app.get_option("--signals_to_handle")->count() > 0)
    o.signals_to_handle = parse_signal_list(from("--signals_to_handle"), signals);
  else if (auto it = env.find("TORCHELASTIC_SIGNALS_TO_HANDLE"); it != env.end())
    o.signals_to_handle = parse_signal_list("TORCHELASTIC_SIGNALS_TO_HANDLE", it->second);
  if (app.get_option("--numa_binding")->count() > 0) {
    static const std::map<std::string, std::string> kModes = {
        {"node", "numa"}, {"exclusive", "cores"}, {"socket", "socket"}, {"core-complex", "core-complex"}};
    auto mode = kModes.find(numa_binding);
    if (mode == kModes.end())
      throw UsageError(fmt::format("bad --numa-binding '{}': use node, socket, exclusive or core-complex", numa_binding));
    if (app.get_option("--cpu-bind")->count() > 0 && o.cpu_bind != "none" && o.cpu_bind != mode->second)
      throw UsageError(fmt::format("--numa-binding={} binds as --cpu-bind={}, but --cpu-bind is {}: give one of them",
                                   numa_binding, mode->second, o.cpu_bind));
    o.numa_binding = numa_binding;
    o.cpu_bind = mode->second;
  }
  if (o.cpu_bind != "none" && o.cpu_bind != "cores" && o.cpu_bind != "numa" && o.cpu_bind != "socket" &&
      o.cpu_bind != "core-complex")
    throw UsageError(
        fmt::format("bad --cpu-bind '{}': use none, cores, numa, socket or core-complex", o.cpu_bind));
}

void AgentParse::check_streams_and_gpus() {
  for (int s = 0; s < 2; ++s) o.duplicate_filters[s] = parse_filter_list(dup_filters[s]);
  if (o.event_log_handler != "null" && o.event_log_handler != "console")
    throw UsageError(fmt::format("bad {} '{}': use null or console (the handlers torchrun registers)",
                                 from("--event_log_handler"), o.event_log_handler));
  if (app.get_option("--logs_specs")->count() > 0 && logs_specs != "default")
    throw UsageError(fmt::format("--logs-specs '{}': Could not find entrypoint under 'torchrun.logs_specs[{}]' key; "
                                 "mglaunch has only the default (torch's DefaultLogsSpecs): drop --logs-specs",
                                 logs_specs, logs_specs));
  if (o.python.empty()) throw UsageError("bad --python '': give an interpreter (a name on PATH or a path)");
  if (!redirects.empty()) o.redirects = parse_stream_spec(from("--redirects"), redirects);
  if (!tee.empty()) o.tee = parse_stream_spec(from("--tee"), tee);
  if (!filter.empty()) o.local_ranks_filter = parse_int_list(from("--local_ranks_filter"), filter);
  if (!gpu_ids.empty()) {
    o.gpu_ids = parse_int_list("--gpu_ids", gpu_ids);
    if (static_cast<int>(o.gpu_ids.size()) < o.nproc_per_node)
      throw UsageError(fmt::format("--gpu_ids '{}' names {} GPUs but --nproc_per_node is {}: give one id per worker",
                                   gpu_ids, o.gpu_ids.size(), o.nproc_per_node));
  }
  if (o.virtual_local_rank && o.gpu_ids.empty()) {
    // Each worker's one GPU is the local rank's entry of the inherited CUDA_VISIBLE_DEVICES
    // (torch's _set_local_rank_env), so there must be one per worker.
    if (auto it = env.find("CUDA_VISIBLE_DEVICES"); it != env.end()) {
      const auto n = static_cast<int>(std::count(it->second.begin(), it->second.end(), ',')) + 1;
      if (n < o.nproc_per_node)
        throw UsageError(fmt::format("--virtual-local-rank with {} workers, but CUDA_VISIBLE_DEVICES={} names {} "
                                     "GPU(s): give one GPU per worker (or --gpu_ids)",
                                     o.nproc_per_node, it->second, n));
    }
  }
}

void AgentParse::check_monitoring_and_program() {
  if (monitor == "true") monitor = "5";  // a bare --monitor (CLI11 gives a flag's value as "true")
  if (!monitor.empty()) {
    double v = -1;
    auto [p, ec] = std::from_chars(monitor.data(), monitor.data() + monitor.size(), v);
    if (ec != std::errc{} || p != monitor.data() + monitor.size() || !(v >= 0.1) || v > 86400)
      throw UsageError(fmt::format("bad --monitor '{}': use --monitor or --monitor=SECONDS with 0.1..86400 seconds", monitor));
    o.monitor_s = v;
  }
  if (preflight == "true") preflight = "fail";  // a bare --preflight
  if (!preflight.empty()) {
    if (preflight != "fail" && preflight != "warn" && preflight != "off")
      throw UsageError(fmt::format("bad --preflight '{}': use --preflight, --preflight=fail, --preflight=warn or "
                                   "--preflight=off",
                                   preflight.size() > 40 ? preflight.substr(0, 40) + "..." : preflight));
    o.preflight = preflight;
  }
  if (o.metrics_port < -1 || o.metrics_port > 65535 || (o.metrics_port == -1 && app.count("--metrics-port") > 0))
    throw UsageError(fmt::format("bad --metrics-port '{}': use 0..65535 (0 picks a free port)", o.metrics_port));
  if (app.count("--metrics-json") > 0 && o.metrics_json.empty())
    throw UsageError("--metrics-json needs a file name");
  if (app.count("--trace") > 0 && o.trace_file.empty()) throw UsageError("--trace needs a file name");
  if (o.module && o.no_python) throw UsageError("--module and --no_python cannot be used together");
  if (app.get_option("--python")->count() > 0) o.python_source = "--python";
  if (stdin_rank == "none") {
    o.stdin_rank = -1;
  } else {
    o.stdin_rank = parse_int("--stdin-rank", stdin_rank, 0);
    if (o.stdin_rank >= o.nproc_per_node)
      throw UsageError(fmt::format("bad --stdin-rank {}: this node has {} workers (local ranks 0..{}); give one of "
                                   "them or none",
                                   o.stdin_rank, o.nproc_per_node, o.nproc_per_node - 1));
  }
  // The template: the flag, else PET_LOG_LINE_PREFIX_TEMPLATE, else torch 2.x's
  // TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE (empty counts as unset there, as in torch).
  if (app.get_option("--log-line-prefix-template")->count() > 0) {
    o.log_line_prefix_template = prefix_template;
  } else if (auto pet_it = env.find("PET_LOG_LINE_PREFIX_TEMPLATE"); pet_it != env.end()) {
    o.log_line_prefix_template = pet_it->second;
  } else if (auto te = env.find("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"); te != env.end() && !te->second.empty()) {
    o.log_line_prefix_template = te->second;
  }
  if (o.start_method != "spawn" && o.start_method != "fork" && o.start_method != "forkserver")
    throw UsageError(fmt::format("bad --start_method '{}': use spawn, fork or forkserver", o.start_method));
  if (o.start_method != "spawn")
    o.warnings.push_back("--start_method has no effect: mglaunch always starts workers with fork+exec");
}

void AgentParse::check_rendezvous() {
  if (o.standalone) {
    // torchrun 1.13 keeps MIN:MAX and runs the one node it has once its last call ends; no
    // other node can ever join a standalone rendezvous (a free port on localhost, a fresh
    // id), so mglaunch runs that node at once. A MIN above 1 could never be reached.
    if (o.nnodes.min != 1)
      throw UsageError(fmt::format("--standalone runs a single node, so --nnodes={} can never be reached; drop "
                                   "--nnodes, give --nnodes=1 (or 1:N), or drop --standalone",
                                   nnodes));
    o.nnodes = NodeRange{1, 1};
    o.rdzv_backend = "c10d";
    o.rdzv_endpoint = "localhost:0";
  }
  static const std::vector<std::string> kBackends = {"static", "c10d", "mglaunch", "etcd"};
  if (std::find(kBackends.begin(), kBackends.end(), o.rdzv_backend) == kBackends.end())
    throw UsageError(fmt::format("unsupported --rdzv_backend '{}': use static, c10d, mglaunch or etcd", o.rdzv_backend));
  if (o.rdzv_backend == "etcd" && !o.rdzv_endpoint.empty()) {
    try {
      mg::rdzv::etcd::parse_endpoints(o.rdzv_endpoint);
    } catch (const std::invalid_argument& e) {
      throw UsageError(fmt::format("--rdzv_endpoint: {}; use HOST:2379[,HOST2:2379,...]", e.what()));
    }
  }
  if (auto it = env.find("MGLAUNCH_ETCD_PASSWORD"); it != env.end()) o.etcd_password = it->second;
  if (o.rdzv_backend == "static") {
    if (o.nnodes.min != o.nnodes.max)
      throw UsageError(fmt::format("--rdzv_backend=static needs a fixed --nnodes, not '{}'", nnodes));
    if (o.node_rank >= o.nnodes.max)
      throw UsageError(fmt::format("bad --node_rank {}: must be < --nnodes {}", o.node_rank, o.nnodes.max));
  } else if (o.nnodes.max > 1 && o.rdzv_endpoint.empty()) {
    throw UsageError(fmt::format("--nnodes={} with --rdzv_backend={} needs --rdzv_endpoint=HOST[:PORT] (the "
                                 "mglaunch-rdzv daemon, or the node that hosts it)",
                                 nnodes, o.rdzv_backend));
  }
  if (!o.rdzv_conf.empty()) apply_rdzv_conf(o, o.rdzv_conf);
  if (o.rdzv_backend == "etcd" && !o.etcd_cacert.empty() && !o.etcd_https && !o.rdzv_endpoint.empty()) {
    for (const auto& ep : mg::rdzv::etcd::parse_endpoints(o.rdzv_endpoint))
      if (!ep.tls)
        throw UsageError(fmt::format("--rdzv_conf cacert='{}' is for TLS but the etcd endpoint {}:{} is plain http: add "
                                     "protocol=https to --rdzv_conf (or write it https://HOST:PORT)",
                                     o.etcd_cacert, ep.host, ep.port));
  }
}

// Addresses are checked now, not when the run is under way.
void AgentParse::check_addresses() {
  auto check_host = [&](const std::string& flag_name, const std::string& host) {
    if (auto why = rdzv::host_problem(host)) throw UsageError(fmt::format("bad {} '{}': {}", from(flag_name), host, *why));
  };
  check_host("--master_addr", o.master_addr);
  if (!o.local_addr.empty()) check_host("--local_addr", o.local_addr);
  if (app.count("--metrics-host") > 0) check_host("--metrics-host", o.metrics_host);
  if (!o.rdzv_endpoint.empty() && o.rdzv_backend != "etcd") {  // etcd: a list, checked above
    rdzv::Endpoint ep;
    try {
      ep = rdzv::parse_endpoint(o.rdzv_endpoint, -1);
    } catch (const std::invalid_argument& e) {
      throw UsageError(fmt::format("{}: {}", from("--rdzv_endpoint"), e.what()));
    }
    const bool port_given = app.count("--master_port") > 0;
    if (o.rdzv_backend == "static" && ep.port >= 0 && port_given && ep.port != o.master_port)
      throw UsageError(fmt::format("--rdzv_endpoint={} names port {} but --master_port is {}: give the port once",
                                   o.rdzv_endpoint, ep.port, o.master_port));
    // static: HOST without a port takes --master_port (plan.cc). The dynamic backends listen
    // on the endpoint's port, 29400 when it has none, and never on --master_port (torchrun).
    if (o.rdzv_backend != "static" && ep.port < 0 && port_given)
      o.warnings.push_back(fmt::format(
          "--master_port has no effect with --rdzv_backend={}: the rendezvous uses port 29400 of --rdzv_endpoint={}; "
          "write --rdzv_endpoint={}:{} to use port {}",
          o.rdzv_backend, o.rdzv_endpoint, o.rdzv_endpoint, o.master_port, o.master_port));
  }
}

void AgentParse::read_tokens() {
  if (auto it = env.find("MGLAUNCH_RDZV_TOKEN"); it != env.end()) o.rdzv_token = it->second;
  if (auto it = env.find("MGLAUNCH_RDZV_JOB_TOKEN"); it != env.end()) {
    o.rdzv_job_token = it->second;
    if (o.rdzv_job_token.size() != 64 ||
        o.rdzv_job_token.find_first_not_of("0123456789abcdef") != std::string::npos)
      throw UsageError("MGLAUNCH_RDZV_JOB_TOKEN must be the 64 hex digits printed by `mglaunch-rdzv --job-token ID`");
  }
  if (!token_file.empty()) {
    std::ifstream in(token_file);
    if (!in) throw UsageError(fmt::format("--token-file '{}' cannot be read", token_file));
    std::getline(in, o.rdzv_token);
    if (o.rdzv_token.empty()) throw UsageError(fmt::format("--token-file '{}' is empty", token_file));
  }
  if (!o.rdzv_token.empty())
    if (std::string w = rdzv::weak_token_warning(
            o.rdzv_token, token_file.empty() ? std::string("MGLAUNCH_RDZV_TOKEN") : "--token-file " + token_file);
        !w.empty())
      o.usage_warnings.push_back(std::move(w));
}

}  // namespace

ParseOutcome parse_agent_args(const std::vector<std::string>& argv, const std::map<std::string, std::string>& env,
                              const HardwareProbe& probe) {
  AgentParse p(env, probe);
  return p.parse(argv);
}

std::vector<cli::FlagSpec> agent_flag_specs() {
  const std::map<std::string, std::string> no_env;
  AgentParse p(no_env, HardwareProbe::system());
  return cli::specs_of(p.app);
}

}  // namespace mg
