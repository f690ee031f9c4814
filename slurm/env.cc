#include "slurm/env.h"

#include <algorithm>
#include <charconv>
#include <cstdint>
#include <stdexcept>

#include <fmt/format.h>

#include "slurm/hostlist.h"

namespace mg::slurm {
namespace {

[[noreturn]] void bad(std::string_view name, std::string_view text, std::string_view why) {
  throw std::invalid_argument(fmt::format("bad {} '{}': {}", name, text, why));
}

// A non-negative integer that is the whole of `t`, or nullopt.
std::optional<long long> whole_number(std::string_view t) {
  if (t.empty() || t.size() > 9) return std::nullopt;
  long long v = 0;
  auto [p, ec] = std::from_chars(t.data(), t.data() + t.size(), v);
  if (ec != std::errc{} || p != t.data() + t.size() || v < 0) return std::nullopt;
  return v;
}

std::vector<std::string_view> split(std::string_view text, char sep) {
  std::vector<std::string_view> out;
  std::size_t pos = 0;
  while (true) {
    auto at = text.find(sep, pos);
    out.push_back(text.substr(pos, at == std::string_view::npos ? std::string_view::npos : at - pos));
    if (at == std::string_view::npos) return out;
    pos = at + 1;
  }
}

const std::string* find(const Env& env, std::string_view name) {
  auto it = env.find(std::string(name));
  return it == env.end() || it->second.empty() ? nullptr : &it->second;
}

// The first of `names` that is set: its name and value.
std::optional<std::pair<std::string, std::string>> first_of(const Env& env, std::initializer_list<std::string_view> names) {
  for (auto n : names)
    if (const std::string* v = find(env, n)) return std::make_pair(std::string(n), *v);
  return std::nullopt;
}

std::string with_value(const std::pair<std::string, std::string>& kv) { return kv.first + "=" + kv.second; }

std::uint64_t fnv1a(std::string_view s) {
  std::uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

}  // namespace

std::vector<int> parse_tasks_per_node(std::string_view text) {
  constexpr std::string_view kName = "SLURM_TASKS_PER_NODE";
  std::vector<int> out;
  for (auto item : split(text, ',')) {
    auto paren = item.find('(');
    auto count = whole_number(item.substr(0, paren));
    if (!count) bad(kName, text, "expected N or N(xM), comma separated, e.g. 2(x3),1");
    long long repeat = 1;
    if (paren != std::string_view::npos) {
      auto inner = item.substr(paren + 1);
      if (!inner.starts_with("x") || !inner.ends_with(")")) bad(kName, text, "expected N(xM), e.g. 2(x3)");
      auto r = whole_number(inner.substr(1, inner.size() - 2));
      if (!r || *r < 1) bad(kName, text, "the repeat count in N(xM) must be a positive number");
      repeat = *r;
    }
    if (static_cast<long long>(out.size()) + repeat > static_cast<long long>(kMaxHosts))
      bad(kName, text, fmt::format("more than {} nodes", kMaxHosts));
    out.insert(out.end(), static_cast<std::size_t>(repeat), static_cast<int>(*count));
  }
  return out;
}

int parse_gpus_per_node(std::string_view text) {
  constexpr std::string_view kName = "SLURM_GPUS_PER_NODE";
  long long total = 0;
  for (auto item : split(text, ',')) {
    item = item.substr(0, item.find('('));  // "(S:0-1)" socket binding
    auto colon = item.rfind(':');
    auto count = whole_number(colon == std::string_view::npos ? item : item.substr(colon + 1));
    if (!count) bad(kName, text, "expected N, TYPE:N or gpu:TYPE:N, comma separated");
    total += *count;
    if (total > 1'000'000) bad(kName, text, "implausibly many GPUs");
  }
  return static_cast<int>(total);
}

int count_gpu_list(std::string_view text) {
  long long n = 0;
  for (auto item : split(text, ',')) {
    auto dash = item.find('-');
    auto lo = whole_number(item.substr(0, dash));
    auto hi = dash == std::string_view::npos ? lo : whole_number(item.substr(dash + 1));
    if (!lo || !hi || *hi < *lo) bad("GPU list", text, "expected indices like 0,1,2,3 or 0-3");
    n += *hi - *lo + 1;
    if (n > 1'000'000) bad("GPU list", text, "implausibly many GPUs");
  }
  return static_cast<int>(n);
}

int parse_count(std::string_view name, std::string_view text, int min_value) {
  auto v = whole_number(text);
  if (!v) bad(name, text, "expected a whole number");
  if (*v < min_value) bad(name, text, fmt::format("must be >= {}", min_value));
  return static_cast<int>(*v);
}

std::vector<int> parse_port_list(std::string_view text) {
  constexpr std::string_view kName = "SLURM_STEP_RESV_PORTS";
  std::vector<int> out;
  for (auto item : split(text, ',')) {
    auto dash = item.find('-');
    auto lo = whole_number(item.substr(0, dash));
    auto hi = dash == std::string_view::npos ? lo : whole_number(item.substr(dash + 1));
    if (!lo || !hi || *hi < *lo || *lo < 1 || *hi > 65535) bad(kName, text, "expected ports like 12000-12003 or 12000,12005");
    if (out.size() + (*hi - *lo + 1) > 65535) bad(kName, text, "too many ports");
    for (long long p = *lo; p <= *hi; ++p) out.push_back(static_cast<int>(p));
  }
  return out;
}

std::string parse_node_addr(std::string_view out) {
  constexpr std::string_view kKey = "NodeAddr=";
  for (std::size_t pos = out.find(kKey); pos != std::string_view::npos; pos = out.find(kKey, pos + 1)) {
    if (pos > 0 && out[pos - 1] != ' ' && out[pos - 1] != '\n' && out[pos - 1] != '\t') continue;
    auto value = out.substr(pos + kKey.size());
    value = value.substr(0, value.find_first_of(" \t\n"));
    return std::string(value);
  }
  return {};
}

bool in_slurm_step(const Env& env) {
  // The batch script and salloc shells have a job id but no step; srun tasks have both,
  // and a node id.
  return first_of(env, {"SLURM_JOB_ID", "SLURM_JOBID"}) && first_of(env, {"SLURM_STEP_ID", "SLURM_STEPID"}) &&
         find(env, "SLURM_NODEID");
}

PortRange rendezvous_port_range(PortRange eph) {
  PortRange below{kLowestPort, eph.lo - 1}, above{eph.hi + 1, 65535};
  if (eph.lo > eph.hi) below = above = {kLowestPort, 65535};  // nonsense input: everything is free
  const int below_n = below.hi - below.lo + 1, above_n = above.hi - above.lo + 1;
  PortRange best = below_n >= above_n ? below : above;
  if (best.hi - best.lo + 1 < 1000) return {kLowestPort, kLowestPort + 9999};
  return best;
}

Sourced<int> rendezvous_port(const Env& env, const std::string& job_id, const std::string& step_id, PortRange eph) {
  if (const std::string* resv = find(env, "SLURM_STEP_RESV_PORTS")) {
    auto ports = parse_port_list(*resv);
    return {ports.front(), "SLURM_STEP_RESV_PORTS=" + *resv};
  }
  const PortRange r = rendezvous_port_range(eph);
  const auto span = static_cast<std::uint64_t>(r.hi - r.lo + 1);
  const int port = r.lo + static_cast<int>(fnv1a(job_id + "." + step_id) % span);
  return {port, fmt::format("hash of job {} step {} into {}-{} (outside the ephemeral ports {}-{})", job_id, step_id,
                            r.lo, r.hi, eph.lo, eph.hi)};
}

SlurmPlan plan_from_env(const Env& env, PortRange ephemeral) {
  SlurmPlan p;
  auto require = [&](std::initializer_list<std::string_view> names) {
    auto kv = first_of(env, names);
    if (!kv)
      throw std::invalid_argument(fmt::format("{} is not set: this does not look like a Slurm job step; run "
                                              "mglaunch under srun, or pass --no-slurm",
                                              *names.begin()));
    return *kv;
  };
  const auto job = require({"SLURM_JOB_ID", "SLURM_JOBID"});
  const auto step = require({"SLURM_STEP_ID", "SLURM_STEPID"});
  p.job_id = job.second;
  p.step_id = step.second;

  const auto nn = require({"SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES"});
  p.nnodes = {parse_count(nn.first, nn.second, 1), with_value(nn)};
  const auto nodeid = require({"SLURM_NODEID"});
  p.node_rank = {parse_count(nodeid.first, nodeid.second, 0), with_value(nodeid)};
  if (p.node_rank.value >= p.nnodes.value)
    throw std::invalid_argument(fmt::format("{} is not below {}: the Slurm environment is inconsistent", with_value(nodeid),
                                            with_value(nn)));

  const auto list = require({"SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"});
  p.nodes = {expand_hostlist(list.second), with_value(list)};
  if (p.nodes.value.empty()) throw std::invalid_argument(fmt::format("{} names no node", with_value(list)));
  if (static_cast<int>(p.nodes.value.size()) != p.nnodes.value) {
    // SLURM_JOB_NODELIST may hold more nodes than the step uses: the step's first nodes.
    if (static_cast<int>(p.nodes.value.size()) < p.nnodes.value)
      throw std::invalid_argument(fmt::format("{} names {} nodes but {}: the Slurm environment is inconsistent",
                                              list.first, p.nodes.value.size(), with_value(nn)));
    p.nodes.value.resize(static_cast<std::size_t>(p.nnodes.value));
    p.warnings.push_back(fmt::format("{} has more nodes than {}; using its first {}", list.first, with_value(nn),
                                     p.nnodes.value));
  }
  p.rdzv_host = {p.nodes.value.front(), fmt::format("first node of {}", list.first)};
  if (auto name = first_of(env, {"SLURMD_NODENAME"})) {
    p.node_name = {name->second, with_value(*name)};
  } else {
    p.node_name = {p.nodes.value[static_cast<std::size_t>(p.node_rank.value)],
                   fmt::format("node {} of {}", p.node_rank.value, list.first)};
  }
  p.rdzv_id = {fmt::format("slurm-{}.{}", p.job_id, p.step_id), fmt::format("{} and {}", with_value(job), with_value(step))};
  p.rdzv_port = rendezvous_port(env, p.job_id, p.step_id, ephemeral);

  // One agent per node: several tasks of this step on one node would each start workers.
  if (auto tpn = first_of(env, {"SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"})) {
    auto counts = parse_tasks_per_node(tpn->second);
    const auto i = static_cast<std::size_t>(p.node_rank.value);
    if (i < counts.size() && counts[i] > 1)
      throw std::invalid_argument(fmt::format(
          "{}: this step runs {} tasks on node {}, but mglaunch starts the workers itself; run one task per node "
          "(srun --ntasks=$SLURM_NNODES --ntasks-per-node=1 mglaunch ...) or pass --no-slurm",
          with_value(*tpn), counts[i], p.node_name.value));
  }

  // Workers: one per GPU of this node when Slurm allocated GPUs.
  if (auto v = first_of(env, {"SLURM_GPUS_ON_NODE"}); v && parse_count(v->first, v->second, 0) > 0) {
    p.nproc_per_node = {parse_count(v->first, v->second, 0), with_value(*v)};
  } else if (auto v = first_of(env, {"SLURM_STEP_GPUS", "SLURM_JOB_GPUS"})) {
    p.nproc_per_node = {count_gpu_list(v->second), with_value(*v)};
  } else if (auto v = first_of(env, {"SLURM_GPUS_PER_NODE"}); v && parse_gpus_per_node(v->second) > 0) {
    p.nproc_per_node = {parse_gpus_per_node(v->second), with_value(*v)};
  } else if (auto cpt = first_of(env, {"SLURM_CPUS_PER_TASK"}), con = first_of(env, {"SLURM_CPUS_ON_NODE"});
             cpt && con) {
    // No GPUs: as many workers as tasks of --cpus-per-task fit in this node's allocation
    // (sbatch --ntasks-per-node=4 --cpus-per-task=8 gives 32 CPUs: 4 workers of 8).
    const int per = parse_count(cpt->first, cpt->second, 1), on = parse_count(con->first, con->second, 1);
    p.nproc_per_node = {std::max(1, on / per), fmt::format("{} / {}", with_value(*con), with_value(*cpt))};
  } else {
    p.nproc_per_node = {1, "default: no GPUs allocated to this step (pass --nproc_per_node for CPU workers)"};
  }
  if (auto v = first_of(env, {"SLURM_CPUS_PER_TASK"})) p.cpus_per_task = parse_count(v->first, v->second, 1);
  if (auto v = first_of(env, {"SLURM_RESTART_COUNT"})) p.restart_count = parse_count(v->first, v->second, 0);
  return p;
}

}  // namespace mg::slurm
