#include "ops/doctor.h"

#include <stdio.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <filesystem>
#include <set>

#include <fmt/format.h>

#include "cli/args.h"
#include "ops/preflight.h"
#include "logs/console.h"
#include "cli/errors.h"
#include "proto/text.h"
#include "rendezvous/endpoint.h"
#include "process/command.h"
#include "process/run.h"

namespace mg {

namespace fs = std::filesystem;

namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

std::string gib(std::uint64_t bytes) { return fmt::format("{:.1f} GiB", static_cast<double>(bytes) / kGiB); }

}  // namespace

std::string python_identity(const std::string& python) {
  std::error_code ec;
  // A virtual environment's python is a link to the base interpreter with search paths of its own.
  if (fs::exists(fs::path(python).parent_path().parent_path() / "pyvenv.cfg", ec))
    return fs::absolute(python, ec).lexically_normal().string();
  const std::string real = fs::canonical(python, ec).string();
  return ec ? python : real;
}

std::vector<std::string> python_candidates(const std::map<std::string, std::string>& env) {
  std::vector<std::string> names;
  if (auto it = env.find("MGLAUNCH_PYTHON"); it != env.end() && !it->second.empty()) names.push_back(it->second);
  names.push_back("python3");
  names.push_back("/usr/bin/python3");
  const auto path = env.count("PATH") ? env.at("PATH") : std::string("/usr/bin:/bin");
  std::vector<std::string> out;
  std::set<std::string> seen;
  for (const auto& n : names) {
    std::string p = find_executable(n, path);
    if (p.empty()) continue;
    if (seen.insert(python_identity(p)).second) out.push_back(p);
  }
  return out;
}

PythonInfo probe_python(const std::string& python, std::chrono::milliseconds timeout) {
  PythonInfo info;
  info.path = python;
  const std::string code =
      "import torch, torch.distributed as d; print('torch', torch.__version__, int(torch.cuda.is_available()), "
      "int(d.is_available() and d.is_nccl_available()), int(d.is_available() and d.is_gloo_available()))";
  RunOptions ro;
  ro.timeout = timeout;
  ro.merge_stderr = true;
  ro.max_output = 1 << 16;
  RunResult run = run_capture({python, "-c", code}, ro);
  if (!run.started) {
    info.error = run.error;
    return info;
  }
  if (run.timed_out) {
    info.error = fmt::format("no answer within {} s (importing torch hangs?)", std::chrono::duration<double>(timeout).count());
    return info;
  }
  const std::string& out = run.out;
  // The answer is the last line starting with "torch " (imports may print warnings first).
  std::string last;
  std::size_t pos = 0;
  while (pos < out.size()) {
    auto nl = out.find('\n', pos);
    std::string line = out.substr(pos, nl == std::string::npos ? std::string::npos : nl - pos);
    if (line.starts_with("torch ")) last = line;
    if (nl == std::string::npos) break;
    pos = nl + 1;
  }
  char ver[128] = {};
  int cuda = 0, nccl = 0, gloo = 0;
  if (!last.empty() && std::sscanf(last.c_str(), "torch %127s %d %d %d", ver, &cuda, &nccl, &gloo) == 4) {
    info.has_torch = true;
    info.torch_version = ver;
    info.cuda = cuda, info.nccl = nccl, info.gloo = gloo;
  } else {
    auto lines = out.empty() ? std::string("no output") : out.substr(0, out.find_last_not_of('\n') + 1);
    auto cut = lines.rfind('\n');
    info.error = cut == std::string::npos ? lines : lines.substr(cut + 1);
  }
  return info;
}

namespace {

bool virtual_interface(const std::string& name) {
  return name.starts_with("docker") || name.starts_with("veth") || name.starts_with("virbr") ||
         name.starts_with("br-") || name.starts_with("cni") || name.starts_with("flannel");
}

}  // namespace

std::vector<hw::Binding> binding_for(const DoctorInputs& in, int nproc) {
  std::vector<std::optional<int>> gpu_numa;
  for (int r = 0; r < nproc && r < static_cast<int>(in.gpus.size()); ++r) gpu_numa.push_back(in.gpus[r].numa_node);
  std::vector<int> usable = in.cpu.affinity;
  if (usable.empty())
    for (int c = 0; c < in.cpu.online; ++c) usable.push_back(c);
  return hw::plan_binding("cores", nproc, usable, in.numa, gpu_numa);
}

BatchPlan batch_for_memory(double g, int gpus) {
  BatchPlan b;
  if (g >= 20) b = {16, 4};
  else if (g >= 14) b = {12, 5};
  else if (g >= 10) b = {8, 8};
  else if (g >= 6) b = {4, 16};
  else b = {2, 32};
  if (gpus > 0 && gpus != 4)
    b.grad_accum = std::max(1, static_cast<int>(std::lround(256.0 / (b.micro_batch * gpus))));
  return b;
}

DoctorProbes real_doctor_probes() {
  static const auto nvml = hw::make_nvml_probe();
  DoctorProbes p;
  p.gpu = nvml.get();
  p.python = [](const std::string& python) { return probe_python(python); };
  return p;
}

DoctorInputs gather(const DoctorOptions& o, const std::map<std::string, std::string>& env, const DoctorProbes& probes) {
  DoctorInputs in;
  in.cpu = hw::probe_cpus(probes.root);
  in.mem = hw::probe_memory(probes.root);
  in.numa = hw::probe_numa(probes.root);
  if (probes.gpu) in.gpus = probes.gpu->gpus(in.gpu_error);
  in.interfaces = hw::probe_interfaces();
  in.master_addr = o.master_addr;
  if (!o.master_addr.empty()) in.master_route = hw::route_source_address(o.master_addr, in.route_error);
  in.port = o.port;
  in.port_error = rdzv::probe_listen("0.0.0.0", o.port);
  for (const auto& [k, v] : env)
    if (k.starts_with("SLURM_")) in.slurm[k] = v;
  if (o.python && probes.python)
    for (const auto& p : python_candidates(env)) in.pythons.push_back(probes.python(p));
  return in;
}

std::vector<Suggestion> suggest(const DoctorInputs& in) {
  std::vector<Suggestion> s;
  const int usable = in.cpu.usable();
  std::string cpu_why = fmt::format("{} usable CPUs ({} online, {} in the affinity mask{})", usable, in.cpu.online,
                                    in.cpu.affinity.size(),
                                    in.cpu.cgroup_quota ? fmt::format(", cgroup quota {:.2f}", *in.cpu.cgroup_quota)
                                                        : std::string(", no cgroup quota"));
  int nproc = 1;
  if (!in.gpus.empty()) {
    nproc = static_cast<int>(in.gpus.size());
    s.push_back({"--nproc_per_node", std::to_string(nproc),
                 fmt::format("one worker per GPU: {} GPU{} visible ({})", nproc, nproc == 1 ? "" : "s", in.gpus.front().name)});
  } else {
    nproc = std::max<int>(1, static_cast<int>(in.numa.size()));
    nproc = std::min(nproc, usable);
    s.push_back({"--nproc_per_node", std::to_string(nproc),
                 in.numa.size() > 1
                     ? fmt::format("no GPU: one worker per NUMA node ({} nodes), each with its node's cores as threads",
                                   in.numa.size())
                     : "no GPU and one NUMA node: one worker using every usable CPU as threads"});
  }
  const int threads = std::max(1, usable / nproc);
  s.push_back({"OMP_NUM_THREADS", std::to_string(threads),
               fmt::format("{} / {} worker{} = {} threads each, so workers do not oversubscribe the CPUs", cpu_why,
                           nproc, nproc == 1 ? "" : "s", threads)});
  if (in.cpu.cgroup_quota && *in.cpu.cgroup_quota + 0.5 < static_cast<double>(in.cpu.affinity.size()))
    s.push_back({"cgroup", fmt::format("{:.2f} CPUs", *in.cpu.cgroup_quota),
                 fmt::format("the cgroup quota allows fewer CPUs than the {} in the affinity mask: threads beyond "
                             "{} are throttled, not parallel",
                             in.cpu.affinity.size(), usable)});

  // NCCL_SOCKET_IFNAME: the interface that reaches the master, else the first real one.
  std::string ifname, ifwhy;
  if (in.master_route) {
    for (const auto& i : in.interfaces)
      if (i.address == *in.master_route) {
        ifname = i.name;
        ifwhy = fmt::format("{} reaches --master_addr {} from {}", i.name, in.master_addr, i.address);
        if (i.loopback) ifwhy += " (loopback: a single-machine job)";
      }
  }
  if (ifname.empty()) {
    for (const auto& i : in.interfaces)
      if (!i.loopback && i.up && !virtual_interface(i.name) && i.address.find(':') == std::string::npos) {
        ifname = i.name;
        ifwhy = fmt::format("first non-loopback IPv4 interface ({}){}", i.address,
                            in.master_addr.empty() ? "; pass --master_addr to pick the one that reaches the master"
                                                   : "");
        break;
      }
  }
  if (!ifname.empty()) s.push_back({"NCCL_SOCKET_IFNAME", ifname, ifwhy});

  if (!in.gpus.empty()) {
    auto smallest = std::min_element(in.gpus.begin(), in.gpus.end(),
                                     [](const auto& a, const auto& b) { return a.memory_total < b.memory_total; });
    const double g = static_cast<double>(smallest->memory_total) / kGiB;
    const int n = static_cast<int>(in.gpus.size());
    BatchPlan b = batch_for_memory(g, n);
    s.push_back({"batch", fmt::format("{} x {} (micro-batch x gradient accumulation)", b.micro_batch, b.grad_accum),
                 fmt::format("smallest GPU has {:.1f} GiB; the guides' table for an effective batch of 256 on 4 GPUs "
                             "(>=20: 16x4, 14-20: 12x5, 10-14: 8x8, 6-10: 4x16, <6: 2x32){}; effective {} x {} x {} "
                             "GPUs = {}",
                             g, n == 4 ? "" : fmt::format(", accumulation rescaled for {} GPU{}", n, n == 1 ? "" : "s"), b.micro_batch,
                             b.grad_accum, n, b.micro_batch * b.grad_accum * n)});
  }
  if (nproc > 1 || in.numa.size() > 1) {
    std::set<int> nodes;
    for (const auto& gpu : in.gpus)
      if (gpu.numa_node) nodes.insert(*gpu.numa_node);
    std::string value;
    try {
      auto plan = binding_for(in, nproc);
      for (std::size_t r = 0; r < plan.size(); ++r)
        value += (value.empty() ? "" : "; ") + hw::format_binding(static_cast<int>(r), plan[r]);
    } catch (const std::invalid_argument& e) {
      value = e.what();
    }
    s.push_back({"binding", value,
                 nodes.size() > 1
                     ? fmt::format("the GPUs sit on {} NUMA nodes: a worker on the far node pays for every host-device "
                                   "copy across the interconnect, so each gets disjoint cores on its GPU's node (apply "
                                   "with taskset/numactl; the agent's --cpu-bind is not wired yet)",
                                   nodes.size())
                     : "disjoint cores per worker keep workers from migrating onto each other's caches (apply with "
                       "taskset/numactl; the agent's --cpu-bind is not wired yet)"});
  }
  if (in.port_error)
    s.push_back({"--master_port", "another port",
                 fmt::format("port {} cannot be bound here: {}", in.port, *in.port_error)});
  return s;
}

nlohmann::json doctor_json(const DoctorInputs& in, const std::vector<Suggestion>& s) {
  using nlohmann::json;
  auto opt = [](const auto& o) { return o ? json(*o) : json(nullptr); };
  json numa = json::array();
  for (const auto& n : in.numa) numa.push_back({{"id", n.id}, {"cpus", hw::format_cpu_list(n.cpus)}});
  json gpus = json::array();
  for (const auto& g : in.gpus)
    gpus.push_back({{"index", g.index},
                    {"name", g.name},
                    {"pci_bus_id", g.pci_bus_id},
                    {"memory_total_mib", g.memory_total / (1024 * 1024)},
                    {"memory_used_mib", g.memory_used / (1024 * 1024)},
                    {"utilization_pct", opt(g.utilization_pct)},
                    {"temperature_c", opt(g.temperature_c)},
                    {"power_w", opt(g.power_w)},
                    {"numa_node", opt(g.numa_node)}});
  json ifs = json::array();
  for (const auto& i : in.interfaces)
    ifs.push_back({{"name", i.name}, {"address", i.address}, {"loopback", i.loopback}, {"up", i.up}});
  json pys = json::array();
  for (const auto& p : in.pythons)
    pys.push_back({{"path", p.path},
                   {"torch", p.has_torch ? json(p.torch_version) : json(nullptr)},
                   {"cuda", p.cuda},
                   {"nccl", p.nccl},
                   {"gloo", p.gloo},
                   {"error", p.error.empty() ? json(nullptr) : json(p.error)}});
  json sug = json::array();
  for (const auto& x : s) sug.push_back({{"name", x.name}, {"value", x.value}, {"reason", x.reason}});
  std::string iface;
  if (in.master_route)
    for (const auto& i : in.interfaces)
      if (i.address == *in.master_route) iface = i.name;
  return {{"cpus",
           {{"online", in.cpu.online},
            {"affinity", hw::format_cpu_list(in.cpu.affinity)},
            {"affinity_count", in.cpu.affinity.size()},
            {"cgroup_quota", opt(in.cpu.cgroup_quota)},
            {"usable", in.cpu.usable()}}},
          {"memory",
           {{"total_bytes", opt(in.mem.total)},
            {"available_bytes", opt(in.mem.available)},
            {"cgroup_limit_bytes", opt(in.mem.cgroup_limit)}}},
          {"numa", numa},
          {"gpus", gpus},
          {"gpu_error", in.gpu_error.empty() ? json(nullptr) : json(in.gpu_error)},
          {"interfaces", ifs},
          {"master",
           in.master_addr.empty()
               ? json(nullptr)
               : json{{"addr", in.master_addr},
                      {"source_address", opt(in.master_route)},
                      {"interface", iface.empty() ? json(nullptr) : json(iface)},
                      {"error", in.master_route ? json(nullptr) : json(in.route_error)}}},
          {"port", {{"port", in.port}, {"free", !in.port_error}, {"error", opt(in.port_error)}}},
          {"slurm", in.slurm},
          {"pythons", pys},
          {"preflight", in.preflight_line.empty() ? json(nullptr)
                                                  : json{{"nodes", in.preflight_nodes},
                                                         {"address", in.preflight_address},
                                                         {"ok", in.preflight_ok},
                                                         {"line", in.preflight_line}}},
          {"suggestions", sug}};
}

std::string doctor_text(const DoctorInputs& in, const std::vector<Suggestion>& s) {
  std::string out = "mglaunch doctor: what this machine offers\n";
  out += fmt::format("CPUs       : {} online, {} in the affinity mask ({}), cgroup quota {} -> {} usable\n",
                     in.cpu.online, in.cpu.affinity.size(), hw::format_cpu_list(in.cpu.affinity),
                     in.cpu.cgroup_quota ? fmt::format("{:.2f}", *in.cpu.cgroup_quota) : "none", in.cpu.usable());
  out += fmt::format("Memory     : {} total, {} available, cgroup limit {}\n", in.mem.total ? gib(*in.mem.total) : "?",
                     in.mem.available ? gib(*in.mem.available) : "?",
                     in.mem.cgroup_limit ? gib(*in.mem.cgroup_limit) : "none");
  out += fmt::format("NUMA       : {} node{}", in.numa.size(), in.numa.size() == 1 ? "" : "s");
  for (const auto& n : in.numa) out += fmt::format(", node{} cpus {}", n.id, hw::format_cpu_list(n.cpus));
  out += "\n";
  if (in.gpus.empty()) out += fmt::format("GPUs       : none ({})\n", in.gpu_error.empty() ? "NVML sees no GPU" : in.gpu_error);
  for (const auto& g : in.gpus)
    out += fmt::format("GPU {:<6} : {}, {} ({} used), {}% util, {} C, {} W, NUMA node {}, PCI {}\n", g.index, g.name,
                       gib(g.memory_total), gib(g.memory_used),
                       g.utilization_pct ? std::to_string(*g.utilization_pct) : "?",
                       g.temperature_c ? std::to_string(*g.temperature_c) : "?",
                       g.power_w ? fmt::format("{:.0f}", *g.power_w) : "?",
                       g.numa_node ? std::to_string(*g.numa_node) : "?", g.pci_bus_id);
  out += "Network    :";
  for (const auto& i : in.interfaces)
    out += fmt::format(" {} {}{};", i.name, i.address, i.up ? "" : " (down)");
  out += "\n";
  if (!in.master_addr.empty())
    out += in.master_route ? fmt::format("Master     : {} is reached from {}\n", in.master_addr, *in.master_route)
                           : fmt::format("Master     : {} cannot be reached: {}\n", in.master_addr, in.route_error);
  out += in.port_error ? fmt::format("Port       : {} is NOT free: {}\n", in.port, *in.port_error)
                       : fmt::format("Port       : {} is free\n", in.port);
  if (in.slurm.empty()) {
    out += "Slurm      : not inside a Slurm job\n";
  } else {
    out += "Slurm      :";
    for (const auto& [k, v] : in.slurm) out += fmt::format(" {}={}", k, v);
    out += "\n";
  }
  for (const auto& p : in.pythons)
    out += p.has_torch ? fmt::format("Python     : {}: torch {} (cuda {}, nccl {}, gloo {})\n", p.path, p.torch_version,
                                     p.cuda ? "yes" : "no", p.nccl ? "yes" : "no", p.gloo ? "yes" : "no")
                       : fmt::format("Python     : {}: no torch ({})\n", p.path, p.error);
  if (!in.preflight_line.empty())
    out += fmt::format("Preflight  : {} (nodes on {})\n", in.preflight_line, in.preflight_address);
  out += "Suggestions:\n";
  for (const auto& x : s) out += fmt::format("  {}={}\n      because {}\n", x.name, x.value, x.reason);
  return out;
}

std::string doctor_help() {
  return "Usage: mglaunch doctor [--json] [--master_addr ADDR] [--port PORT] [--no-python] [--preflight[=N]]\n"
         "Shows what this machine offers (CPUs, cgroup limits, memory, NUMA, GPUs via NVML, interfaces,\n"
         "the route to ADDR, whether PORT is free, Slurm, which python has torch) and suggested settings.\n"
         "--preflight[=N]: the network check of mglaunch --preflight between N nodes (default 4, 2..64)\n"
         "on this machine (on the address that reaches ADDR, else 127.0.0.1).\n"
         "Exit codes: 0 the report was printed; 2 bad flags; 5 --preflight found a slow or broken node.\n";
}

std::optional<DoctorOptions> parse_doctor_args(const std::vector<std::string>& argv) {
  enum { kJson, kNoPython, kMasterAddr, kPort, kHelp, kPreflight };
  cli::FlagSpec preflight = cli::strict_flag({"preflight"}, false);
  preflight.optional_value = true;
  const std::vector<cli::FlagSpec> specs = {
      cli::strict_flag({"json"}, false), cli::strict_flag({"no-python", "no_python"}, false),
      cli::strict_flag({"master_addr", "master-addr"}, true),
      cli::strict_flag({"port", "master_port", "master-port"}, true), cli::strict_flag({"help"}, false, {"h"}),
      preflight};
  cli::Normalized norm;
  try {
    norm = cli::normalize_args(std::vector<std::string>(argv.begin() + std::min<std::size_t>(2, argv.size()), argv.end()),
                               specs, /*stop_at_positional=*/true);
  } catch (const cli::ArgsError& e) {
    throw UsageError(fmt::format("doctor: {} (see mglaunch doctor --help)", e.what()));
  }
  if (norm.rest < norm.args.size())
    throw UsageError(fmt::format("doctor: unexpected argument '{}': doctor takes only flags (see mglaunch "
                                 "doctor --help)",
                                 norm.args[norm.rest]));
  DoctorOptions o;
  for (std::size_t n = 0; n < norm.given.size(); ++n) {
    const std::size_t k = norm.given[n];
    const std::string v = norm.values[n].value_or("");
    switch (k) {
      case kHelp:
        return std::nullopt;
      case kJson:
      case kNoPython:
        if (norm.values[n])  // `--json=1`: a switch takes no value
          throw UsageError(fmt::format("doctor: {} takes no value: write {} alone", specs[k].display(),
                                       specs[k].display()));
        if (k == kJson) o.json = true;
        else o.python = false;
        break;
      case kMasterAddr:
        o.master_addr = v;
        break;
      case kPreflight: {
        int nodes = 4;
        if (norm.values[n]) {
          auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), nodes);
          if (ec != std::errc{} || end != v.data() + v.size() || nodes < 2 || nodes > 64)
            throw UsageError(fmt::format("doctor: bad --preflight '{}': use --preflight or --preflight=N with 2..64 "
                                         "nodes",
                                         v.size() > 40 ? v.substr(0, 40) + "..." : v));
        }
        o.preflight_nodes = nodes;
        break;
      }
      case kPort: {
        int p = -1;
        auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), p);
        if (ec != std::errc{} || end != v.data() + v.size() || p < 0 || p > 65535)
          throw UsageError(fmt::format("doctor: bad --port '{}': use a whole number in 0..65535",
                                       v.size() > 40 ? v.substr(0, 40) + "..." : v));
        o.port = p;
        break;
      }
    }
  }
  return o;
}

int doctor_main(const std::vector<std::string>& argv, const std::map<std::string, std::string>& env) {
  const std::optional<DoctorOptions> parsed = parse_doctor_args(argv);
  if (!parsed) {
    write_all(STDOUT_FILENO, doctor_help());
    return exit_code::kOk;
  }
  const DoctorOptions& o = *parsed;
  DoctorInputs in = gather(o, env, real_doctor_probes());
  if (o.preflight_nodes > 0) {
    in.preflight_nodes = o.preflight_nodes;
    in.preflight_address = in.master_route ? *in.master_route : "127.0.0.1";
    const preflight::Result r = preflight::run_local(o.preflight_nodes, {in.preflight_address});
    in.preflight_ok = r.ok;
    in.preflight_line = r.line;
  }
  auto s = suggest(in);
  write_all(STDOUT_FILENO, o.json ? mg::proto::dump_json(doctor_json(in, s), 2) + "\n" : doctor_text(in, s));
  return in.preflight_nodes > 0 && !in.preflight_ok ? exit_code::kPreflight : exit_code::kOk;
}

}  // namespace mg
