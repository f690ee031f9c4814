#include "baremetal/multihost.h"

#include <fcntl.h>
#include <fnmatch.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <charconv>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>

#include <boost/asio/readable_pipe.hpp>
#include <boost/asio/signal_set.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/writable_pipe.hpp>
#include <boost/asio/write.hpp>
#include <fmt/format.h>

#include "cli/args.h"
#include "logs/console.h"
#include "cli/errors.h"
#include "ops/hwprobe.h"
#include "logs/line_splitter.h"
#include "process/reap.h"
#include "launcher/options.h"
#include "launcher/plan.h"
#include "process/spawn.h"
#include "proto/text.h"
#include "rendezvous/auth.h"
#include "rendezvous/endpoint.h"
#include "rendezvous/server.h"
#include "process/command.h"

extern char** environ;

namespace mg {

namespace asio = boost::asio;

namespace {

// Flags of the agent that take no value (everything else starting with '-' takes one,
// as `--flag VALUE` or `--flag=VALUE`). Used only to find where PROGRAM starts.
bool is_agent_bool_flag(std::string_view name) {
  static const char* kBool[] = {"--standalone", "-m",        "--module",    "--no_python",     "--no-python",
                                "--run_path",   "--run-path", "--use_env",  "--use-env",       "--local-rank-arg",
                                "--local_rank_arg", "--timestamps", "--version"};
  for (const char* b : kBool)
    if (name == b) return true;
  return false;
}

// The remote wrapper: reads the token from stdin, runs the agent in the background with
// stdin from /dev/null, and a watcher that sends it SIGTERM when stdin reaches EOF (the
// launcher closed the pipe, died, or the connection dropped). Exits with the agent's code.
// The wait's own stderr is /dev/null: sh (dash) reports an agent that died of that SIGTERM
// (one stopped before it handles signals) as a line "Terminated", which is not the agent's.
// With a working directory it is run as `sh -c WRAPPER mglaunch-host -C DIR AGENT...` and
// first changes to DIR (a directory that is missing there is one error line and exit 2).
constexpr const char* kWrapper =
    "if [ \"$1\" = -C ]; then cd -- \"$2\" 2>/dev/null || { printf 'mglaunch: error: the working directory %s does not "
    "exist on this host (or cannot be entered): mglaunch --hostfile starts every agent in the directory it was started "
    "in; create it there or start mglaunch from a directory every host has\\n' \"$2\" >&2; exit 2; }; shift 2; fi; "
    "IFS= read -r MGLAUNCH_RDZV_TOKEN || exit 1; export MGLAUNCH_RDZV_TOKEN; unset MGLAUNCH_RDZV_JOB_TOKEN; "
    "exec 3<&0; "
    "\"$@\" </dev/null 3<&- & pid=$!; "
    "{ while IFS= read -r _l; do :; done; kill -TERM \"$pid\"; } <&3 >/dev/null 2>&1 & w=$!; "
    "exec 3<&-; wait \"$pid\" 2>/dev/null; rc=$?; kill \"$w\" 2>/dev/null; exit \"$rc\"";

std::string self_exe() {
  std::error_code ec;
  auto p = std::filesystem::read_symlink("/proc/self/exe", ec);
  return ec ? std::string("mglaunch") : p.string();
}

std::string random_token() { return rdzv::auth::random_hex(32); }

void notice_to(int fd, const std::string& text) { write_all(fd, "[mglaunch] " + text + "\n"); }

// A pipe whose two ends are closed on exec (the child gets its end through dup2); -1s on failure.
std::array<int, 2> cloexec_pipe() {
  int fds[2] = {-1, -1};
  if (::pipe2(fds, O_CLOEXEC) != 0) return {-1, -1};
  return {fds[0], fds[1]};
}

}  // namespace

namespace {

// The fan-out's own flags first, then every agent flag it does not take itself: one table,
// so prefixes, typos and empty values are judged as mglaunch judges them (cli/args.h).
enum MultiHostFlag : std::size_t {
  kHostfile, kInclude, kExclude, kSshOpts, kExport, kRdzvHost, kRemoteMglaunch, kNproc, kDryRun, kHelp, kOwnFlags
};

const std::vector<cli::FlagSpec>& multihost_specs() {
  static const std::vector<cli::FlagSpec> specs = [] {
    std::vector<cli::FlagSpec> out = {cli::strict_flag({"hostfile"}, true),
                                      cli::strict_flag({"include"}, true),
                                      cli::strict_flag({"exclude"}, true),
                                      cli::strict_flag({"ssh-opts", "ssh_opts"}, true),
                                      cli::strict_flag({"export"}, true),
                                      cli::strict_flag({"rdzv-host", "rdzv_host"}, true),
                                      cli::strict_flag({"remote-mglaunch", "remote_mglaunch"}, true),
                                      cli::strict_flag({"nproc_per_node", "nproc-per-node"}, true),
                                      cli::strict_flag({"dry-run", "dry_run"}, false),
                                      cli::strict_flag({"help"}, false, {"h"})};
    auto taken = [&](const cli::FlagSpec& f) {
      for (std::size_t k = 0; k < kOwnFlags; ++k) {
        for (const auto& l : f.long_names)
          if (std::find(out[k].long_names.begin(), out[k].long_names.end(), l) != out[k].long_names.end()) return true;
        for (const auto& c : f.short_names)
          if (std::find(out[k].short_names.begin(), out[k].short_names.end(), c) != out[k].short_names.end()) return true;
      }
      return false;
    };
    for (auto& f : agent_flag_specs())
      if (!taken(f)) out.push_back(std::move(f));
    return out;
  }();
  return specs;
}

// Flags the fan-out sets for every agent itself (by any of their names).
bool is_reserved(const cli::FlagSpec& f) {
  static const char* kReserved[] = {"nnodes",  "node_rank",   "rdzv_backend", "rdzv_endpoint",
                                    "rdzv_id", "master_addr", "master_port",  "token-file"};
  for (const char* r : kReserved)
    if (std::find(f.long_names.begin(), f.long_names.end(), r) != f.long_names.end()) return true;
  return false;
}

}  // namespace

bool wants_multihost(const std::vector<std::string>& argv) {
  // Only a token that starts with "--ho" can name --hostfile (in full or as a unique
  // prefix): without one, the plain path skips building every agent flag's spec, which
  // cost as many instructions as parsing the command line itself (1.5 M of 4.5 M, callgrind).
  if (std::none_of(argv.begin() + std::min<std::size_t>(1, argv.size()), argv.end(),
                   [](const std::string& a) { return a.starts_with("--ho"); }))
    return false;
  const std::vector<std::string> args(argv.begin() + std::min<std::size_t>(1, argv.size()), argv.end());
  try {
    const auto norm = cli::normalize_args(args, multihost_specs(), /*stop_at_positional=*/true);
    return std::find(norm.given.begin(), norm.given.end(), std::size_t{kHostfile}) != norm.given.end();
  } catch (const cli::ArgsError&) {
    // A bad command line: the fan-out reports it when it names --hostfile before the program.
  }
  for (std::size_t i = 1; i < argv.size(); ++i) {
    const std::string& a = argv[i];
    if (a == "--" || !a.starts_with("-")) return false;
    if (a == "--hostfile" || a.starts_with("--hostfile=")) return true;
    if (a.find('=') == std::string::npos && !is_agent_bool_flag(a) && a != "--dry-run" && a != "--dry_run" &&
        a != "-h" && a != "--help")
      ++i;  // skip the flag's value
  }
  return false;
}

std::string multihost_help() {
  return "Usage: mglaunch --hostfile FILE [--include SEL | --exclude SEL] [--ssh-opts \"...\"] [--export VAR]...\n"
         "                [--dry-run] [AGENT FLAGS] PROGRAM [ARGS...]\n"
         "Starts one agent per host over ssh and hosts their rendezvous here.\n"
         "  --hostfile FILE        lines 'HOST slots=N' or 'HOST' (the host detects its workers); # comments\n"
         "  --include SEL          only these hosts/slots, DeepSpeed syntax: h1@h2:0,2\n"
         "  --exclude SEL          all but these hosts/slots\n"
         "  --ssh-opts \"OPTS\"      extra ssh options, e.g. \"-p 2222 -i ~/.ssh/id_ed25519\"\n"
         "  --export VAR           pass VAR (or VAR=VALUE, or a glob like 'NCCL_*') to every host; repeatable\n"
         "  --rdzv-host ADDR       address the hosts reach this machine at (default: the route to the first host)\n"
         "  --remote-mglaunch PATH mglaunch on the hosts (default: this binary's absolute path)\n"
         "  --nproc_per_node SPEC  workers on hosts without slots=N (default auto)\n"
         "  --dry-run              print the plan (nodes, ssh command per host) as JSON; start nothing\n"
         "Every other flag goes to the agents unchanged (see mglaunch --help). Exit codes: 0 success; the first\n"
         "failing host's code (the root cause's); 255 a host could not be reached over ssh; 2 bad flags;\n"
         "128+S stopped by signal S.\n";
}

std::optional<MultiHostOptions> parse_multihost_args(const std::vector<std::string>& argv) {
  const auto& specs = multihost_specs();
  cli::Normalized norm;
  try {
    norm = cli::normalize_args(std::vector<std::string>(argv.begin() + std::min<std::size_t>(1, argv.size()), argv.end()),
                               specs, /*stop_at_positional=*/true);
  } catch (const cli::ArgsError& e) {
    throw UsageError(fmt::format("{} (see mglaunch --hostfile F --help)", e.what()));
  }
  MultiHostOptions o;
  for (std::size_t n = 0; n < norm.given.size(); ++n) {
    const std::size_t k = norm.given[n];
    const cli::FlagSpec& f = specs[k];
    const std::optional<std::string>& value = norm.values[n];
    const std::string v = value.value_or("");
    switch (k) {
      case kHelp: return std::nullopt;
      case kHostfile: o.hostfile = v; break;
      case kInclude: o.include = v; break;
      case kExclude: o.exclude = v; break;
      case kSshOpts: {
        auto words = split_shell_words(v);
        o.ssh_opts.insert(o.ssh_opts.end(), words.begin(), words.end());
        break;
      }
      case kExport: o.exports.push_back(v); break;
      case kRdzvHost: o.rdzv_host = v; break;
      case kRemoteMglaunch: o.remote_mglaunch = v; break;
      case kNproc: o.nproc_spec = v; break;
      case kDryRun:
        if (value) throw UsageError(fmt::format("--dry-run takes no value: write --dry-run alone"));
        o.dry_run = true;
        break;
      default:
        if (is_reserved(f))
          throw UsageError(fmt::format("{} is set by mglaunch for every host with --hostfile; drop it", f.display()));
        if (std::find(f.long_names.begin(), f.long_names.end(), "standalone") != f.long_names.end())
          throw UsageError("--standalone runs a single node; drop it when using --hostfile");
        // By its canonical name, so the agents see exactly what was checked here.
        o.forwarded.push_back(value ? f.display() + "=" + *value : f.display());
        if (std::find(f.long_names.begin(), f.long_names.end(), "grace") != f.long_names.end()) {
          double s = -1;
          auto [p, ec] = std::from_chars(v.data(), v.data() + v.size(), s);
          if (ec != std::errc{} || p != v.data() + v.size() || !(s >= 0) || s > 86400)
            throw UsageError(fmt::format("bad --grace '{}': use 0..86400 seconds", v));
          if (s > 0) o.grace = std::chrono::milliseconds(static_cast<long>(s * 1000));
        }
    }
  }
  o.program.assign(norm.args.begin() + static_cast<std::ptrdiff_t>(norm.rest), norm.args.end());
  if (!o.program.empty() && o.program.front() == "--") o.program.erase(o.program.begin());
  if (o.hostfile.empty()) throw UsageError("--hostfile is empty: give the path of a file with lines 'HOST slots=N'");
  if (o.program.empty())
    throw UsageError("no training program given: usage is mglaunch --hostfile FILE [FLAGS] PROGRAM [ARGS...]");
  return o;
}

std::vector<std::string> split_shell_words(const std::string& text) {
  std::vector<std::string> out;
  std::string cur;
  bool have = false;
  for (std::size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (c == '\'') {
      const auto end = text.find('\'', i + 1);
      if (end == std::string::npos) throw UsageError(fmt::format("--ssh-opts '{}': unterminated ' quote", text));
      cur.append(text, i + 1, end - i - 1);
      i = end;
      have = true;
    } else if (c == '"') {
      std::size_t j = i + 1;
      for (; j < text.size() && text[j] != '"'; ++j) {
        if (text[j] == '\\' && j + 1 < text.size() && std::string_view("\"\\$`").find(text[j + 1]) != std::string::npos)
          ++j;
        cur += text[j];
      }
      if (j >= text.size()) throw UsageError(fmt::format("--ssh-opts '{}': unterminated \" quote", text));
      i = j;
      have = true;
    } else if (c == '\\' && i + 1 < text.size()) {
      cur += text[++i];
      have = true;
    } else if (c == ' ' || c == '\t' || c == '\n') {
      if (have) out.push_back(std::move(cur));
      cur.clear();
      have = false;
    } else {
      cur += c;
      have = true;
    }
  }
  if (have) out.push_back(std::move(cur));
  return out;
}


bool is_rdzv_secret(std::string_view name) {
  return name.starts_with("MGLAUNCH_RDZV_") || name == "MGLAUNCH_ETCD_PASSWORD";
}

EnvMap resolve_exports(const std::vector<std::string>& patterns, const EnvMap& env, std::vector<std::string>* left_out) {
  auto valid_name = [](std::string_view n) {
    return !n.empty() && !std::isdigit(static_cast<unsigned char>(n[0])) &&
           std::all_of(n.begin(), n.end(), [](char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; });
  };
  EnvMap out;
  for (const auto& p : patterns) {
    if (auto eq = p.find('='); eq != std::string::npos) {
      if (!valid_name(std::string_view(p).substr(0, eq)))
        throw UsageError(fmt::format("bad --export '{}': '{}' is not a variable name", p, p.substr(0, eq)));
      out[p.substr(0, eq)] = p.substr(eq + 1);
    } else if (p.find_first_of("*?[") != std::string::npos) {
      for (const auto& [k, v] : env)
        if (::fnmatch(p.c_str(), k.c_str(), 0) == 0) out[k] = v;
    } else {
      if (!valid_name(p)) throw UsageError(fmt::format("bad --export '{}': not a variable name or a glob", p));
      auto it = env.find(p);
      if (it == env.end())
        throw UsageError(fmt::format("--export {}: {} is not set here; set it or use --export {}=VALUE", p, p, p));
      out[p] = it->second;
    }
  }
  // The launcher's own token travels over ssh's stdin; a secret on the command line would
  // show in `ps` on both ends (and a job key there would override that token).
  for (auto it = out.begin(); it != out.end();) {
    if (!is_rdzv_secret(it->first)) {
      ++it;
      continue;
    }
    if (left_out) left_out->push_back(it->first);
    it = out.erase(it);
  }
  return out;
}

std::vector<std::string> OpenSshRunner::argv(const std::string& host, const std::string& remote_command) const {
  std::vector<std::string> a{ssh_, "-T", "-o", "BatchMode=yes"};
  a.insert(a.end(), opts_.begin(), opts_.end());
  // After the user's options: ssh takes an option's first value, so theirs wins (#35).
  a.insert(a.end(), {"-o", fmt::format("ConnectTimeout={}", kSshConnectTimeout.count())});
  a.push_back(host);
  a.push_back("--");
  a.push_back(remote_command);
  return a;
}

std::vector<std::string> LocalShellRunner::argv(const std::string& host, const std::string& remote_command) const {
  if (std::find(unreachable_.begin(), unreachable_.end(), host) != unreachable_.end())
    // As OpenSSH writes it (CRLF), but the line reaches the pipe after ssh's exit is
    // reaped (a child writes it 0.2 s later): the race a loaded machine makes, made certain.
    return {"/bin/sh", "-c",
            fmt::format("(sleep 0.2; printf 'ssh: connect to host {} port 22: Connection refused\\r\\n' >&2) & exit 255",
                        host)};
  return {"/bin/sh", "-c", remote_command};
}

MultiHostPlan make_multihost_plan(const MultiHostOptions& o, const std::vector<HostEntry>& hosts, const EnvMap& exports,
                                  const std::string& rdzv_endpoint, const std::string& rdzv_id,
                                  const SshRunner& runner) {
  MultiHostPlan plan;
  plan.rdzv_id = rdzv_id;
  plan.rdzv_endpoint = rdzv_endpoint;
  plan.exports = exports;
  plan.workdir = o.workdir;
  const std::string mglaunch = o.remote_mglaunch.empty() ? self_exe() : o.remote_mglaunch;
  for (std::size_t i = 0; i < hosts.size(); ++i) {
    HostCommand hc;
    hc.host = hosts[i];
    hc.node_rank = static_cast<int>(i);
    const int workers = hc.host.workers();
    hc.agent_argv = {mglaunch,
                     fmt::format("--nnodes={}", hosts.size()),
                     "--nproc_per_node=" + (workers > 0 ? std::to_string(workers) : o.nproc_spec)};
    if (!hc.host.slot_ids.empty()) {
      std::string ids;
      for (int s : hc.host.slot_ids) ids += (ids.empty() ? "" : ",") + std::to_string(s);
      hc.agent_argv.push_back("--gpu_ids=" + ids);
    }
    hc.agent_argv.push_back(fmt::format("--node_rank={}", i));
    hc.agent_argv.push_back("--rdzv_backend=c10d");
    hc.agent_argv.push_back("--rdzv_endpoint=" + rdzv_endpoint);
    hc.agent_argv.push_back("--rdzv_id=" + rdzv_id);
    hc.agent_argv.insert(hc.agent_argv.end(), o.forwarded.begin(), o.forwarded.end());
    hc.agent_argv.insert(hc.agent_argv.end(), o.program.begin(), o.program.end());

    std::string cmd = "exec sh -c " + shell_quote(kWrapper) + " mglaunch-host";
    if (!o.workdir.empty()) cmd += " -C " + shell_quote(o.workdir);
    if (!exports.empty()) {
      cmd += " env";
      for (const auto& [k, v] : exports) cmd += " " + shell_quote(k + "=" + v);
    }
    for (const auto& a : hc.agent_argv) cmd += " " + shell_quote(a);
    hc.remote_command = std::move(cmd);
    hc.argv = runner.argv(hc.host.host, hc.remote_command);
    plan.hosts.push_back(std::move(hc));
  }
  return plan;
}

nlohmann::json multihost_plan_json(const MultiHostPlan& plan) {
  nlohmann::json nodes = nlohmann::json::array();
  for (const auto& h : plan.hosts) {
    nodes.push_back({{"host", h.host.host},
                     {"slots", h.host.slots > 0 ? nlohmann::json(h.host.slots) : nlohmann::json("auto")},
                     {"gpu_ids", h.host.slot_ids},
                     {"node_rank", h.node_rank},
                     {"nproc_per_node", h.agent_argv.at(2).substr(std::string("--nproc_per_node=").size())},
                     {"agent", h.agent_argv},
                     {"ssh", h.argv}});
  }
  nlohmann::json exported = nlohmann::json::array();
  for (const auto& [k, v] : plan.exports) exported.push_back(k);
  return {{"nnodes", plan.hosts.size()},
          {"workdir", plan.workdir},
          {"rdzv_endpoint", plan.rdzv_endpoint},
          {"rdzv_id", plan.rdzv_id},
          {"exports", exported},
          {"token", "sent on each ssh's stdin"},
          {"nodes", nodes}};
}

std::string relay_prefix(const std::string& host, std::string_view& line) {
  if (line.starts_with("[rank")) {
    const auto close = line.find("]:");
    if (close != std::string_view::npos && close > 5 &&
        std::all_of(line.begin() + 5, line.begin() + static_cast<long>(close),
                    [](char c) { return std::isdigit(static_cast<unsigned char>(c)); })) {
      std::string prefix = fmt::format("[{}:{}]:", host, line.substr(1, close - 1));
      line.remove_prefix(close + 2);
      return prefix;
    }
  }
  return "[" + host + "]:";
}

std::vector<std::string> RootCauseFilter::feed(const std::string& host, std::string_view line) {
  static const std::string kRule(60, '=');
  auto it = open_.find(host);
  if (it == open_.end()) {
    if (line != kRule) return {std::string(line)};
    open_[host].lines.emplace_back(line);
    return {};
  }
  auto& lines = it->second.lines;
  lines.emplace_back(line);
  if (line != kRule && lines.size() < 200) return {};
  // The block is complete (or too long to be one): compare it, time line aside.
  std::vector<std::string> block = std::move(lines);
  open_.erase(it);
  if (block.back() != kRule) return block;
  if (drop_) return {};
  std::string key;
  for (const auto& l : block)
    if (!l.starts_with("  time ")) key += l + "\n";
  if (!shown_) {
    shown_ = key;
    shown_host_ = host;
    return block;
  }
  if (key == *shown_) return {fmt::format("[mglaunch] the same root cause as {} reported above", shown_host_)};
  return block;
}

std::vector<std::string> RootCauseFilter::finish(const std::string& host) {
  auto it = open_.find(host);
  if (it == open_.end()) return {};
  std::vector<std::string> lines = std::move(it->second.lines);
  open_.erase(it);
  if (drop_) return {};
  return lines;
}

// ---------------------------------------------------------------------------------------
// Fanout

namespace {
constexpr std::chrono::seconds kReapAfterKill{2};  // the end reaps SIGKILLed ssh processes within this
}  // namespace

struct Fanout::Host {
  explicit Host(asio::io_context& io)
      : in(io), pipes{asio::readable_pipe(io), asio::readable_pipe(io)}, stderr_end(io) {}
  HostCommand cmd;
  asio::writable_pipe in;
  std::array<asio::readable_pipe, 2> pipes;
  std::array<std::array<char, 16 * 1024>, 2> bufs;
  // An agent's line is its prefix and up to kDefaultMaxLine bytes: relayed whole here too.
  static constexpr std::size_t kMaxLine = kDefaultMaxLine + 1024;
  std::array<LineSplitter, 2> splitters{LineSplitter(kMaxLine), LineSplitter(kMaxLine)};
  std::array<bool, 2> open{false, false};
  pid_t pid = -1;  // ours to reap (Timers::children), its own process group
  bool exited = false;
  // ssh's exit status once reaped; its end is handled when its stderr ends (or stderr_end fires).
  std::optional<int> reaped;
  asio::steady_timer stderr_end;
  bool done = false;
  bool saw_output = false;  // the agent printed something: ssh got through
  int code = 0;
  std::string last_err;
};

struct Fanout::Timers {
  explicit Timers(asio::io_context& io) : agree(io), kill(io), drain(io), signals(io), children(io) {}
  asio::steady_timer agree, kill, drain;
  asio::signal_set signals;
  // SIGCHLD: each host's ssh is reaped by its own pid (waitpid(pid, WNOHANG)), never with
  // waitpid(-1): a program embedding the fan-out may have children of its own.
  asio::signal_set children;
  std::unique_ptr<Console> console;
  RootCauseFilter root_causes;
};

Fanout::Fanout(asio::io_context& io, MultiHostPlan plan, std::string token, const MultiHostOptions& opts, FanoutIo fio)
    : io_(io),
      plan_(std::move(plan)),
      token_(std::move(token)),
      opts_(opts),
      fio_(fio),
      timers_(std::make_unique<Timers>(io)) {
  timers_->console = std::make_unique<Console>(fio_.out_fd, fio_.err_fd, false);
}

Fanout::~Fanout() {
  // Bounded: a SIGKILLed ssh in state D, or one another process traces (its exit goes to the
  // tracer first), cannot be reaped yet; it is left behind, named, after 2 s for them all (#36).
  const auto deadline = std::chrono::steady_clock::now() + kReapAfterKill;
  for (auto& h : hosts_)
    if (h->pid > 0 && !h->exited && !h->reaped) ::killpg(h->pid, SIGKILL);
  for (auto& h : hosts_) {
    int status = 0;
    if (h->pid > 0 && !h->exited && !h->reaped && !reap_by(h->pid, deadline, status))
      notice(fmt::format("the ssh of host {} (pid {}) could not be reaped within {} s of SIGKILL (state D, or traced "
                         "by another process): left behind",
                         h->cmd.host.host, h->pid, kReapAfterKill.count()));
  }
}

void Fanout::notice(const std::string& text) { notice_to(fio_.err_fd, text); }

void Fanout::start() {
  // A host that exits before reading its token must not kill us with SIGPIPE (mglaunch's
  // main ignores it already; this covers library users such as the tests).
  ::signal(SIGPIPE, SIG_IGN);
  if (fio_.handle_signals) {
    for (int sig : {SIGINT, SIGTERM, SIGHUP}) timers_->signals.add(sig);
    wait_signal();
  }
  // Before the first child starts: its SIGCHLD is then never missed.
  timers_->children.add(SIGCHLD);
  std::vector<std::string> envs;
  for (char** e = environ; *e; ++e)
    if (std::string_view kv(*e); !is_rdzv_secret(kv.substr(0, kv.find('=')))) envs.emplace_back(*e);
  std::vector<const char*> envp;
  for (const auto& e : envs) envp.push_back(e.c_str());
  envp.push_back(nullptr);

  for (auto& hc : plan_.hosts) {
    auto h = std::make_unique<Host>(io_);
    h->cmd = hc;
    Host* hp = h.get();
    hosts_.push_back(std::move(h));
    std::string exe = hc.argv.front();
    if (exe.find('/') == std::string::npos) {
      const char* path = std::getenv("PATH");
      exe = find_executable(exe, path ? path : "/usr/bin:/bin");
      if (exe.empty())
        throw UsageError(fmt::format("cannot find '{}' on PATH; install OpenSSH's client or set MGLAUNCH_SSH",
                                     hc.argv.front()));
    }
    spawn_host(*hp, exe, envp.data());
    // The token and its newline fit in the pipe buffer: this write does not block.
    boost::system::error_code wec;
    asio::write(hp->in, asio::buffer(token_ + "\n"), wec);
    for (int s = 0; s < 2; ++s) {
      hp->open[s] = true;
      read_more(hp, s);
    }
  }
  // Reaps what has already ended and waits for the next SIGCHLD.
  reap();
}

// Starts one host's ssh (its own process group: a terminal's Ctrl-C reaches only the
// launcher, which stops the hosts in order; default signal handling; none of the
// launcher's other descriptors) with pipes on its stdin, stdout and stderr.
void Fanout::spawn_host(Host& h, const std::string& exe, const char* const* envp) {
  std::array<std::array<int, 2>, 3> p{cloexec_pipe(), cloexec_pipe(), cloexec_pipe()};
  auto close_all = [&] {
    for (auto& fds : p)
      for (int& fd : fds)
        if (fd >= 0) ::close(std::exchange(fd, -1));
  };
  for (const auto& fds : p)
    if (fds[0] < 0) {
      const int e = errno;
      close_all();
      throw std::runtime_error(fmt::format("cannot start {} for host {}: pipe: {}", exe, h.cmd.host.host,
                                           std::strerror(e)));
    }
  std::vector<const char*> argv;
  for (const auto& a : h.cmd.argv) argv.push_back(a.c_str());
  argv.push_back(nullptr);
  SpawnRequest req;
  req.path = exe.c_str();
  req.argv = argv.data();
  req.envp = envp;
  req.fds[0] = p[0][0];
  req.fds[1] = p[1][1];
  req.fds[2] = p[2][1];
  SpawnError error;  // an exec error comes back here: nothing ran
  h.pid = spawn_process(req, error);
  ::close(std::exchange(p[0][0], -1));
  ::close(std::exchange(p[1][1], -1));
  ::close(std::exchange(p[2][1], -1));
  if (h.pid < 0) {
    close_all();
    throw std::runtime_error(fmt::format("cannot start {} for host {}: {}", exe, h.cmd.host.host, error.message()));
  }
  h.in.assign(std::exchange(p[0][1], -1));
  h.pipes[0].assign(std::exchange(p[1][0], -1));
  h.pipes[1].assign(std::exchange(p[2][0], -1));
}

// Reaps every host's ssh that has ended (by pid) and waits for the next SIGCHLD while any runs.
void Fanout::reap() {
  bool running = false;
  for (auto& h : hosts_) {
    if (h->pid <= 0 || h->exited || h->reaped) continue;
    int status = 0;
    pid_t r;
    while ((r = ::waitpid(h->pid, &status, WNOHANG)) < 0 && errno == EINTR) {
    }
    if (r == h->pid) ssh_ended(*h, status);
    else if (r < 0) ssh_ended(*h, 255 << 8);  // not ours to reap after all (ECHILD): count it as lost
    else running = true;
  }
  if (running && !waiting_children_) {
    waiting_children_ = true;
    timers_->children.async_wait([this](boost::system::error_code ec, int) {
      waiting_children_ = false;
      if (!ec) reap();
    });
  }
}

// ssh says why it could not connect on its stderr, which may still hold that line when its
// exit is reaped: the exit is handled when that pipe ends, so the error line names the
// reason (#38), or after a second (a grandchild may hold the pipe open).
void Fanout::ssh_ended(Host& h, int status) {
  h.reaped = status;
  if (!h.open[1]) return on_host_exit(h, status);
  h.stderr_end.expires_after(std::chrono::seconds(1));
  h.stderr_end.async_wait([this, hp = &h](boost::system::error_code ec) {
    if (!ec && !hp->exited) on_host_exit(*hp, *hp->reaped);
  });
}

void Fanout::read_more(Host* hp, int s) {
  hp->pipes[s].async_read_some(asio::buffer(hp->bufs[s]), [this, hp, s](boost::system::error_code ec, std::size_t n) {
    auto emit = [&](std::string_view line, bool cut) { relay(*hp, s, line, cut); };
    if (n > 0) {
      hp->splitters[s].feed(std::string_view(hp->bufs[s].data(), n), emit);
      timers_->console->flush();
    }
    if (!ec) return read_more(hp, s);
    hp->splitters[s].finish(emit);
    if (s == 1)
      for (const auto& l : timers_->root_causes.finish(hp->cmd.host.host)) relay(*hp, 0, "\x01" + l, false);
    timers_->console->flush();
    hp->open[s] = false;
    boost::system::error_code ignored;
    hp->pipes[s].close(ignored);
    if (s == 1 && hp->reaped && !hp->exited) {
      hp->stderr_end.cancel();
      return on_host_exit(*hp, *hp->reaped);
    }
    if (hp->exited && !hp->open[0] && !hp->open[1]) maybe_done();
  });
}

// Shows one line of a host's stream s with its [host:rankN] or [host] prefix. Stderr goes
// through the root-cause filter first; a leading \x01 marks a line that already did.
void Fanout::relay(Host& h, int s, std::string_view line, bool cut) {
  // The agent spoke (not only ssh): the connection was made.
  if (line.starts_with("[mglaunch]") || line.starts_with("[rank")) h.saw_output = true;
  if (line.starts_with('\x01')) {
    line.remove_prefix(1);
    s = 1;
  } else if (s == 1) {
    // ssh ends its own messages with "\r\n" (OpenSSH's log writes CRLF): the line ends before
    // the '\r', which must not reach an error line (as a literal \r) or the terminal.
    while (line.ends_with('\r')) line.remove_suffix(1);
    if (!line.empty()) h.last_err = std::string(line.substr(0, 512));
    for (const auto& l : timers_->root_causes.feed(h.cmd.host.host, line)) relay(h, 1, "\x01" + l, cut);
    return;
  }
  std::string prefix = relay_prefix(h.cmd.host.host, line);
  timers_->console->line(s, prefix, line, cut);
}

void Fanout::on_host_exit(Host& h, int status) {
  h.exited = true;
  h.code = shell_exit_code(status);
  // A host whose connection was lost makes its agent leave the job, and the other hosts
  // may end first with 128+SIGTERM because of that: the lost connection is still the cause.
  const bool consequence = first_failure_ > exit_code::kSignalBase && first_failure_ < exit_code::kSignalBase + 32;
  if (h.code != 0 && signal_ == 0 && (first_failure_ == 0 || (h.code == kExitSshFailed && consequence))) {
    first_failure_ = h.code;
    if (h.code == kExitSshFailed) {
      const std::string why = h.last_err.empty() ? "" : ": " + h.last_err;
      // The launcher's own failure: an error line (the first one decides the exit code, 255).
      auto error = [this](const std::string& text) {
        write_all(fio_.err_fd, "mglaunch: error: " + cli::one_line(text) + "\n");
      };
      if (h.saw_output)
        error(fmt::format("lost the connection to host {} (ssh exit 255{}); stopping the other hosts",
                           h.cmd.host.host, why));
      else
        error(fmt::format("cannot reach host {} over ssh (ssh exit 255{}); check the name, that sshd runs there "
                           "and that 'ssh -o BatchMode=yes {} true' works; stopping the other hosts",
                           h.cmd.host.host, why, h.cmd.host.host));
      stop_all("");
    } else if (h.code == exit_code::kUsage && !h.saw_output) {
      // The host refused before its agent started (no working directory there, a flag its
      // mglaunch refuses): the others would only wait in the rendezvous.
      stop_all("");
    } else {
      // The rendezvous normally stops the other agents with the same root cause at once;
      // if one does not, its stdin is closed after the agreement window.
      timers_->agree.expires_after(opts_.agree_window);
      timers_->agree.async_wait([this](boost::system::error_code ec) {
        if (!ec) stop_all("the other hosts did not stop after the failure");
      });
    }
  }
  if (h.open[0] || h.open[1]) {
    // A grandchild may hold the pipes: read them a little longer, then stop reading.
    timers_->drain.expires_after(std::chrono::seconds(5));
    timers_->drain.async_wait([this](boost::system::error_code ec) {
      if (ec) return;
      for (auto& hp : hosts_)
        if (hp->exited)
          for (auto& p : hp->pipes) {
            boost::system::error_code ignored;
            p.cancel(ignored);
          }
    });
  }
  maybe_done();
}

void Fanout::stop_all(const std::string& why) {
  if (stopping_) return;
  stopping_ = true;
  if (!why.empty()) notice(why + "; stopping every host");
  for (auto& h : hosts_) {
    boost::system::error_code ec;
    h->in.close(ec);  // EOF: the host's wrapper sends SIGTERM to its agent
  }
  // The agents need up to --grace to stop their workers; past that, drop the connections.
  timers_->kill.expires_after(opts_.grace + std::chrono::seconds(30));
  timers_->kill.async_wait([this](boost::system::error_code ec) {
    if (ec) return;
    notice("hosts still running after the grace period: closing their ssh connections");
    for (auto& h : hosts_)
      if (!h->exited && !h->reaped) ::killpg(h->pid, SIGKILL);
  });
}

void Fanout::maybe_done() {
  if (done_) return;
  for (auto& h : hosts_)
    if (!h->exited || h->open[0] || h->open[1]) return;
  done_ = true;
  timers_->agree.cancel();
  timers_->kill.cancel();
  timers_->drain.cancel();
  boost::system::error_code ec;
  timers_->signals.cancel(ec);
  timers_->children.cancel(ec);
  for (auto& h : hosts_) h->in.close(ec);
  exit_code_ = signal_ ? exit_code::kSignalBase + signal_ : first_failure_;
  if (signal_) notice(fmt::format("stopped by signal {}", signal_));
  if (on_done) on_done();
}

void Fanout::wait_signal() {
  timers_->signals.async_wait([this](boost::system::error_code ec, int sig) {
    if (ec) return;
    if (signal_ == 0) signal_ = sig;
    timers_->root_causes.drop_blocks();
    if (sig == SIGINT && ++interrupts_ >= 2) {
      notice("second interrupt: closing every ssh connection now");
      for (auto& h : hosts_)
        if (!h->exited && !h->reaped) ::killpg(h->pid, SIGKILL);
    } else {
      notice(fmt::format("got signal {}: stopping the agents on every host", sig));
      stop_all("");
    }
    if (!done_) wait_signal();
  });
}

// ---------------------------------------------------------------------------------------

int run_multihost(const MultiHostOptions& opts, const EnvMap& env, const SshRunner& runner, FanoutIo fio) {
  MultiHostOptions o = opts;
  if (o.workdir.empty()) {
    // As DeepSpeed's launcher: every agent starts where mglaunch was started, so a relative
    // PROGRAM (and --log_dir) means the same on every host.
    std::error_code ec;
    auto cwd = std::filesystem::current_path(ec);
    if (ec)
      throw UsageError(fmt::format("cannot tell the current directory ({}): mglaunch --hostfile starts every agent in "
                                   "it; cd to a directory every host has",
                                   ec.message()));
    o.workdir = cwd.string();
  }
  std::ifstream in(o.hostfile);
  if (!in) throw UsageError(fmt::format("--hostfile {} cannot be read; give a file with lines 'HOST slots=N'", o.hostfile));
  std::stringstream ss;
  ss << in.rdbuf();
  auto hosts = select_hosts(parse_hostfile(ss.str(), o.hostfile), o.include, o.exclude);
  std::vector<std::string> secrets;
  const EnvMap exports = resolve_exports(o.exports, env, &secrets);
  if (!secrets.empty()) {
    std::string names;
    for (const auto& n : secrets) names += (names.empty() ? "" : ", ") + n;
    write_all(fio.err_fd, fmt::format("mglaunch: warning: --export: left out {}: rendezvous secrets never go on an ssh "
                                      "command line (the hosts get this run's own token over ssh's stdin)\n",
                                      names));
  }

  std::string addr = o.rdzv_host;
  if (addr.empty()) {
    std::string err;
    auto a = hw::route_source_address(hosts.front().host, err);
    if (!a)
      throw UsageError(fmt::format("cannot tell which local address host {} can reach ({}); pass --rdzv-host ADDR",
                                   hosts.front().host, err));
    addr = *a;
  }
  const std::string id = random_uuid();
  auto endpoint = [&](int port) {
    return addr.find(':') != std::string::npos ? fmt::format("[{}]:{}", addr, port) : fmt::format("{}:{}", addr, port);
  };
  // The agents' own flag check, once here instead of N times over ssh.
  {
    MultiHostPlan probe = make_multihost_plan(o, hosts, exports, endpoint(1), id, runner);
    HardwareProbe none{[] { return 1; }, [] { return 1; }};
    parse_agent_args(probe.hosts.front().agent_argv, {}, none);
  }
  if (o.dry_run) {
    // A dry run binds nothing: the port is the one the run will pick (a free one of ADDR).
    const std::string where = addr.find(':') != std::string::npos ? "[" + addr + "]" : addr;
    auto plan = make_multihost_plan(o, hosts, exports, where + ":PORT", id, runner);
    auto doc = multihost_plan_json(plan);
    doc["rdzv_port"] = fmt::format("PORT: a free port of {}, picked when the run starts", addr);
    write_all(fio.out_fd, proto::dump_json(doc, 2) + "\n");
    return exit_code::kOk;
  }
  asio::io_context io(1);
  rdzv::ServerOptions so;
  so.host = addr;
  so.port = 0;
  so.token = random_token();
  std::unique_ptr<rdzv::Server> server;
  try {
    server = std::make_unique<rdzv::Server>(io, so);
  } catch (const std::exception& e) {
    throw UsageError(fmt::format("cannot host the rendezvous on {} ({}): {}; give --rdzv-host an address of this "
                                 "machine that every host can reach",
                                 addr, o.rdzv_host.empty() ? "the address that routes to " + hosts.front().host
                                                           : "--rdzv-host",
                                 e.what()));
  }
  auto plan = make_multihost_plan(o, hosts, exports, endpoint(server->port()), id, runner);
  notice_to(fio.err_fd, fmt::format("{} hosts, rendezvous {} (job {})", plan.hosts.size(), plan.rdzv_endpoint, id));
  Fanout fan(io, std::move(plan), so.token, o, fio);
  fan.on_done = [&] { server->stop(); };
  fan.start();
  io.run();
  return fan.exit_code();
}

int multihost_main(const std::vector<std::string>& argv, const EnvMap& env) {
  auto o = parse_multihost_args(argv);
  if (!o) {
    write_all(STDOUT_FILENO, multihost_help());
    return exit_code::kOk;
  }
  std::string ssh = "ssh";
  if (auto it = env.find("MGLAUNCH_SSH"); it != env.end() && !it->second.empty()) ssh = it->second;
  OpenSshRunner runner(o->ssh_opts, ssh);
  return run_multihost(*o, env, runner);
}

}  // namespace mg
