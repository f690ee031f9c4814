#include "ops/hwprobe.h"

#include <arpa/inet.h>
#include <dlfcn.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sched.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <set>
#include <sstream>
#include <stdexcept>

#include <fmt/format.h>

#include "rendezvous/lookup.h"

namespace mg::hw {

namespace fs = std::filesystem;

namespace {

std::string_view trim(std::string_view s) {
  const auto b = s.find_first_not_of(" \t\r\n");
  if (b == std::string_view::npos) return {};
  return s.substr(b, s.find_last_not_of(" \t\r\n") - b + 1);
}

template <typename T>
bool to_num(std::string_view s, T& v) {
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  return !s.empty() && ec == std::errc{} && p == s.data() + s.size();
}

std::optional<std::string> read_text(const std::string& path) {
  std::ifstream in(path);
  if (!in) return std::nullopt;
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

std::vector<int> parse_cpu_list(std::string_view text) {
  std::set<int> cpus;
  std::string_view rest = trim(text);
  auto bad = [&](std::string_view why) {
    return std::invalid_argument(fmt::format("bad cpu list '{}': {}", trim(text), why));
  };
  while (!rest.empty()) {
    const auto comma = rest.find(',');
    std::string_view item = trim(rest.substr(0, comma));
    rest = comma == std::string_view::npos ? std::string_view{} : rest.substr(comma + 1);
    if (item.empty()) continue;
    const auto dash = item.find('-');
    int lo = 0, hi = 0;
    if (!to_num(item.substr(0, dash), lo) || lo < 0) throw bad(fmt::format("'{}' is not a cpu number", item));
    hi = lo;
    if (dash != std::string_view::npos && (!to_num(item.substr(dash + 1), hi) || hi < lo))
      throw bad(fmt::format("'{}' is not a range LOW-HIGH", item));
    if (hi >= 1 << 16) throw bad("cpu numbers above 65535");
    for (int c = lo; c <= hi; ++c) cpus.insert(c);
  }
  return {cpus.begin(), cpus.end()};
}

std::string format_cpu_list(const std::vector<int>& cpus_in) {
  std::vector<int> cpus = cpus_in;
  std::sort(cpus.begin(), cpus.end());
  std::string out;
  for (std::size_t i = 0; i < cpus.size();) {
    std::size_t j = i;
    while (j + 1 < cpus.size() && cpus[j + 1] == cpus[j] + 1) ++j;
    if (!out.empty()) out += ',';
    out += j == i ? std::to_string(cpus[i]) : fmt::format("{}-{}", cpus[i], cpus[j]);
    i = j + 1;
  }
  return out;
}

std::optional<double> parse_cpu_max(std::string_view text) {
  text = trim(text);
  const auto sp = text.find(' ');
  std::string_view quota = text.substr(0, sp);
  if (quota == "max" || quota.empty()) return std::nullopt;
  long q = 0, period = 100000;
  if (!to_num(quota, q) || q <= 0) return std::nullopt;
  if (sp != std::string_view::npos && (!to_num(trim(text.substr(sp + 1)), period) || period <= 0)) return std::nullopt;
  return static_cast<double>(q) / static_cast<double>(period);
}

std::optional<std::uint64_t> parse_memory_max(std::string_view text) {
  text = trim(text);
  std::uint64_t v = 0;
  if (text == "max" || !to_num(text, v)) return std::nullopt;
  return v;
}

std::optional<std::uint64_t> parse_meminfo(std::string_view text, std::string_view field) {
  while (!text.empty()) {
    const auto nl = text.find('\n');
    std::string_view line = text.substr(0, nl);
    text = nl == std::string_view::npos ? std::string_view{} : text.substr(nl + 1);
    const auto colon = line.find(':');
    if (colon == std::string_view::npos || line.substr(0, colon) != field) continue;
    std::string_view v = trim(line.substr(colon + 1));
    std::uint64_t mult = 1;
    if (v.ends_with(" kB")) {
      mult = 1024;
      v.remove_suffix(3);
    }
    std::uint64_t n = 0;
    if (!to_num(trim(v), n)) return std::nullopt;
    return n * mult;
  }
  return std::nullopt;
}

std::optional<std::string> parse_cgroup_path(std::string_view text) {
  while (!text.empty()) {
    const auto nl = text.find('\n');
    std::string_view line = text.substr(0, nl);
    text = nl == std::string_view::npos ? std::string_view{} : text.substr(nl + 1);
    if (line.starts_with("0::")) return std::string(trim(line.substr(3)));
  }
  return std::nullopt;
}

int CpuInfo::usable() const {
  int n = affinity.empty() ? online : static_cast<int>(affinity.size());
  if (cgroup_quota) n = std::min(n, std::max(1, static_cast<int>(std::ceil(*cgroup_quota))));
  return std::max(1, n);
}

namespace {

// Reads `file` in the process's cgroup and every parent; `pick` keeps the tightest value.
template <typename T, typename Parse>
std::optional<T> cgroup_min(const std::string& root, const std::string& file, Parse parse) {
  auto self = read_text(root + "/proc/self/cgroup");
  if (!self) return std::nullopt;
  auto path = parse_cgroup_path(*self);
  if (!path) return std::nullopt;
  std::optional<T> best;
  fs::path p = *path;
  for (int depth = 0; depth < 64; ++depth) {
    if (auto text = read_text(root + "/sys/fs/cgroup" + (p.string() == "/" ? "" : p.string()) + "/" + file))
      if (auto v = parse(*text); v && (!best || *v < *best)) best = v;
    if (p == p.parent_path() || p.empty()) break;
    p = p.parent_path();
  }
  return best;
}

}  // namespace

CpuInfo probe_cpus(const std::string& root) {
  CpuInfo c;
  c.online = static_cast<int>(std::max(1L, ::sysconf(_SC_NPROCESSORS_ONLN)));
  if (root.empty()) {
    cpu_set_t set;
    CPU_ZERO(&set);
    if (::sched_getaffinity(0, sizeof(set), &set) == 0)
      for (int i = 0; i < CPU_SETSIZE; ++i)
        if (CPU_ISSET(i, &set)) c.affinity.push_back(i);
  } else if (auto t = read_text(root + "/affinity")) {
    c.affinity = parse_cpu_list(*t);
  }
  c.cgroup_quota = cgroup_min<double>(root, "cpu.max", parse_cpu_max);
  return c;
}

MemInfo probe_memory(const std::string& root) {
  MemInfo m;
  if (auto t = read_text(root + "/proc/meminfo")) {
    m.total = parse_meminfo(*t, "MemTotal");
    m.available = parse_meminfo(*t, "MemAvailable");
  }
  m.cgroup_limit = cgroup_min<std::uint64_t>(root, "memory.max", parse_memory_max);
  return m;
}

std::vector<NumaNode> probe_numa(const std::string& root) {
  std::vector<NumaNode> nodes;
  std::error_code ec;
  for (auto it = fs::directory_iterator(root + "/sys/devices/system/node", ec); !ec && it != fs::directory_iterator();
       it.increment(ec)) {
    const std::string name = it->path().filename().string();
    int id = 0;
    if (!name.starts_with("node") || !to_num(std::string_view(name).substr(4), id)) continue;
    NumaNode n;
    n.id = id;
    if (auto t = read_text(it->path().string() + "/cpulist")) {
      try {
        n.cpus = parse_cpu_list(*t);
      } catch (const std::invalid_argument&) {
      }
    }
    nodes.push_back(std::move(n));
  }
  std::sort(nodes.begin(), nodes.end(), [](const auto& a, const auto& b) { return a.id < b.id; });
  return nodes;
}

std::optional<int> pci_numa_node(const std::string& pci_bus_id, const std::string& sysfs_root) {
  // NVML: "00000000:65:00.0" (8-digit domain); sysfs: "0000:65:00.0", lower case.
  const auto colon = pci_bus_id.find(':');
  if (colon == std::string::npos) return std::nullopt;
  std::string domain = pci_bus_id.substr(0, colon);
  if (domain.size() > 4) domain = domain.substr(domain.size() - 4);
  std::string id = domain + pci_bus_id.substr(colon);
  std::transform(id.begin(), id.end(), id.begin(), [](unsigned char c) { return std::tolower(c); });
  auto t = read_text(sysfs_root + "/bus/pci/devices/" + id + "/numa_node");
  int n = -1;
  if (!t || !to_num(trim(*t), n) || n < 0) return std::nullopt;
  return n;
}

namespace {

std::vector<int> intersect(const std::vector<int>& a, const std::vector<int>& b) {
  std::vector<int> out;
  std::set_intersection(a.begin(), a.end(), b.begin(), b.end(), std::back_inserter(out));
  return out;
}

// Splits `cpus` into `n` contiguous, disjoint, near-equal parts (the first get the extra).
std::vector<std::vector<int>> split_even(const std::vector<int>& cpus, int n) {
  std::vector<std::vector<int>> parts(static_cast<std::size_t>(n));
  const std::size_t base = cpus.size() / static_cast<std::size_t>(n), extra = cpus.size() % static_cast<std::size_t>(n);
  std::size_t at = 0;
  for (std::size_t i = 0; i < parts.size(); ++i) {
    const std::size_t take = base + (i < extra ? 1 : 0);
    parts[i].assign(cpus.begin() + static_cast<long>(at), cpus.begin() + static_cast<long>(at + take));
    at += take;
  }
  return parts;
}

}  // namespace

std::vector<Binding> bind_this_machine(const std::string& policy, int nproc, const std::vector<int>& gpu_ids) {
  if (policy == "none") return std::vector<Binding>(static_cast<std::size_t>(std::max(nproc, 0)));
  std::string error;
  const auto gpus = make_nvml_probe()->gpus(error);
  std::vector<std::optional<int>> gpu_numa;
  for (int lr = 0; lr < nproc; ++lr) {
    const int id = lr < static_cast<int>(gpu_ids.size()) ? gpu_ids[static_cast<std::size_t>(lr)] : lr;
    gpu_numa.push_back(id >= 0 && id < static_cast<int>(gpus.size()) ? gpus[static_cast<std::size_t>(id)].numa_node
                                                                     : std::nullopt);
  }
  const bool topology = policy == "socket" || policy == "core-complex";
  return plan_binding(policy, nproc, probe_cpus().affinity, probe_numa(), gpu_numa,
                      topology ? probe_topology() : CpuTopology{});
}

CpuTopology probe_topology(const std::string& root) {
  CpuTopology t;
  std::set<std::vector<int>> l3;
  std::error_code ec;
  const std::string base = root + "/sys/devices/system/cpu";
  for (auto it = fs::directory_iterator(base, ec); !ec && it != fs::directory_iterator(); it.increment(ec)) {
    const std::string name = it->path().filename().string();
    int cpu = 0;
    if (!name.starts_with("cpu") || !to_num(std::string_view(name).substr(3), cpu)) continue;
    int pkg = -1;
    if (auto text = read_text(it->path().string() + "/topology/physical_package_id"); text && to_num(trim(*text), pkg))
      t.package[cpu] = pkg;
    for (int k = 0; k < 16; ++k) {
      const std::string index = fmt::format("{}/cache/index{}", it->path().string(), k);
      auto level = read_text(index + "/level");
      if (!level) continue;
      int lv = 0;
      if (!to_num(trim(*level), lv) || lv != 3) continue;
      if (auto shared = read_text(index + "/shared_cpu_list")) {
        try {
          l3.insert(parse_cpu_list(*shared));
        } catch (const std::invalid_argument&) {
        }
      }
      break;
    }
  }
  t.l3.assign(l3.begin(), l3.end());
  return t;
}

std::vector<Binding> plan_binding(const std::string& policy, int nproc, const std::vector<int>& usable_in,
                                  const std::vector<NumaNode>& numa, const std::vector<std::optional<int>>& gpu_numa,
                                  const CpuTopology& topology) {
  if (policy != "none" && policy != "cores" && policy != "numa" && policy != "socket" && policy != "core-complex")
    throw std::invalid_argument(
        fmt::format("bad --cpu-bind '{}': use none, cores, numa, socket or core-complex", policy));
  std::vector<Binding> out(static_cast<std::size_t>(std::max(0, nproc)));
  if (policy == "none" || nproc <= 0) return out;
  std::vector<int> usable = usable_in;
  std::sort(usable.begin(), usable.end());
  // Nodes with usable CPUs, by id.
  std::map<int, std::vector<int>> node_cpus;
  for (const auto& n : numa) {
    std::vector<int> c = n.cpus;
    std::sort(c.begin(), c.end());
    if (auto u = intersect(c, usable); !u.empty()) node_cpus[n.id] = std::move(u);
  }
  auto gpu_node = [&](int r) -> std::optional<int> {
    if (static_cast<std::size_t>(r) < gpu_numa.size() && gpu_numa[r] && node_cpus.count(*gpu_numa[r])) return gpu_numa[r];
    return std::nullopt;
  };
  if (policy == "numa") {
    if (node_cpus.empty()) throw std::invalid_argument("--cpu-bind=numa: no NUMA node with usable CPUs is known");
    std::vector<int> ids;
    for (const auto& [id, c] : node_cpus) ids.push_back(id);
    for (int r = 0; r < nproc; ++r) {
      const int node = gpu_node(r).value_or(ids[static_cast<std::size_t>(r) * ids.size() / static_cast<std::size_t>(nproc)]);
      out[r] = {node_cpus[node], node};
    }
    return out;
  }
  if (policy == "socket") {
    // Packages with usable CPUs, by id.
    std::map<int, std::vector<int>> package_cpus;
    for (int c : usable)
      if (auto p = topology.package.find(c); p != topology.package.end()) package_cpus[p->second].push_back(c);
    if (package_cpus.empty())
      throw std::invalid_argument("--numa-binding=socket: no CPU's package is known (sysfs topology/physical_package_id)");
    std::vector<int> ids;
    for (const auto& [id, c] : package_cpus) ids.push_back(id);
    for (int r = 0; r < nproc; ++r) {
      int pkg = ids[static_cast<std::size_t>(r) * ids.size() / static_cast<std::size_t>(nproc)];
      const auto node = gpu_node(r);
      if (node)
        if (auto p = topology.package.find(node_cpus[*node].front()); p != topology.package.end()) pkg = p->second;
      out[r] = {package_cpus[pkg], node};
    }
    return out;
  }
  if (policy == "core-complex") {
    // The L3 groups (usable CPUs only), and which of them lie in each node.
    std::vector<std::vector<int>> groups;
    for (const auto& g : topology.l3)
      if (auto u = intersect(g, usable); !u.empty()) groups.push_back(std::move(u));
    if (groups.empty())
      throw std::invalid_argument("--numa-binding=core-complex: no L3 cache's CPUs are known (sysfs cache/index3)");
    std::map<int, int> dealt;  // node (or -1: no GPU node) -> ranks placed so far
    for (int r = 0; r < nproc; ++r) {
      const auto node = gpu_node(r);
      std::vector<std::size_t> in_node;
      for (std::size_t g = 0; g < groups.size(); ++g)
        if (!node || !intersect(groups[g], node_cpus[*node]).empty()) in_node.push_back(g);
      if (in_node.empty())  // the node's CPUs share no known cache: the whole node
        for (std::size_t g = 0; g < groups.size(); ++g) in_node.push_back(g);
      const int k = dealt[node.value_or(-1)]++;
      auto cpus = groups[in_node[static_cast<std::size_t>(k) % in_node.size()]];
      if (node) {
        auto within = intersect(cpus, node_cpus[*node]);
        if (!within.empty()) cpus = std::move(within);
      }
      out[r] = {std::move(cpus), node};
    }
    return out;
  }
  // cores: ranks whose GPU's node is known share that node's CPUs; the others share the rest.
  std::map<int, std::vector<int>> ranks_on_node;
  std::vector<int> unplaced;
  for (int r = 0; r < nproc; ++r) {
    if (auto n = gpu_node(r)) ranks_on_node[*n].push_back(r);
    else unplaced.push_back(r);
  }
  std::vector<int> rest = usable;
  // With unplaced ranks left, placed ones take a fair share from their node, not all of it.
  const std::size_t share = std::max<std::size_t>(1, usable.size() / static_cast<std::size_t>(nproc));
  for (const auto& [node, ranks] : ranks_on_node) {
    std::vector<int> pool = node_cpus[node];
    if (!unplaced.empty() && pool.size() > share * ranks.size()) pool.resize(share * ranks.size());
    auto parts = split_even(pool, static_cast<int>(ranks.size()));
    for (std::size_t i = 0; i < ranks.size(); ++i) out[ranks[i]] = {parts[i], node};
    std::vector<int> left;
    std::set_difference(rest.begin(), rest.end(), pool.begin(), pool.end(), std::back_inserter(left));
    rest = std::move(left);
  }
  if (!unplaced.empty()) {
    auto parts = split_even(rest, static_cast<int>(unplaced.size()));
    for (std::size_t i = 0; i < unplaced.size(); ++i) {
      out[unplaced[i]].cpus = parts[i];
      for (const auto& [id, c] : node_cpus)  // the node, when the set lies within one
        if (!parts[i].empty() && intersect(parts[i], c).size() == parts[i].size()) out[unplaced[i]].numa_node = id;
    }
  }
  for (int r = 0; r < nproc; ++r)
    if (out[r].cpus.empty())
      throw std::invalid_argument(fmt::format("--cpu-bind=cores: {} workers cannot have disjoint CPUs among the {} "
                                              "usable ({}); use fewer workers or --cpu-bind=numa",
                                              nproc, usable.size(), format_cpu_list(usable)));
  return out;
}

std::string format_binding(int local_rank, const Binding& b) {
  if (b.cpus.empty()) return fmt::format("local_rank {}: not bound", local_rank);
  return fmt::format("local_rank {}: cpus {}{}", local_rank, format_cpu_list(b.cpus),
                     b.numa_node ? fmt::format(" (NUMA node {})", *b.numa_node) : "");
}

namespace {

// The few NVML entry points and structs used, declared here (no build dependency).
using nvmlReturn_t = int;
using nvmlDevice_t = void*;
struct NvmlMemory {
  unsigned long long total, free, used;
};
// nvmlMemory_v2_t: `used` without the driver's reserved memory, as nvidia-smi shows it.
struct NvmlMemoryV2 {
  unsigned int version;
  unsigned long long total, reserved, free, used;
};
constexpr unsigned int kNvmlMemoryV2Version = static_cast<unsigned int>(sizeof(NvmlMemoryV2)) | (2u << 24);
struct NvmlUtilization {
  unsigned int gpu, memory;
};
struct NvmlPciInfo {
  char bus_id_legacy[16];
  unsigned int domain, bus, device, pci_device_id, pci_subsystem_id;
  char bus_id[32];
  char reserved[64];  // room should a later NVML grow the struct
};

// nvmlProcessInfo_t of the _v2/_v3 entry points.
struct NvmlProcessInfo {
  unsigned int pid;
  unsigned long long used_gpu_memory;
  unsigned int gpu_instance_id, compute_instance_id;
};
constexpr unsigned long long kNvmlValueNotAvailable = ~0ull;

// Opens NVML at the first gpus() and keeps it open and initialised until destroyed, so
// that a monitor sampling every few seconds does not pay nvmlInit each time. One thread
// at a time.
class NvmlProbe : public GpuProbe {
 public:
  ~NvmlProbe() override {
    if (shutdown_) shutdown_();
    if (lib_) ::dlclose(lib_);
  }
  std::vector<GpuInfo> gpus(std::string& error) const override {
    if (!lib_) lib_ = ::dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    void* lib = lib_;
    if (!lib) {
      error = "libnvidia-ml.so.1 not found (no NVIDIA driver)";
      return {};
    }
    auto sym = [&](const char* name) { return ::dlsym(lib, name); };
    auto init = reinterpret_cast<nvmlReturn_t (*)()>(sym("nvmlInit_v2"));
    auto shutdown = reinterpret_cast<nvmlReturn_t (*)()>(sym("nvmlShutdown"));
    auto count = reinterpret_cast<nvmlReturn_t (*)(unsigned*)>(sym("nvmlDeviceGetCount_v2"));
    auto by_index = reinterpret_cast<nvmlReturn_t (*)(unsigned, nvmlDevice_t*)>(sym("nvmlDeviceGetHandleByIndex_v2"));
    auto name = reinterpret_cast<nvmlReturn_t (*)(nvmlDevice_t, char*, unsigned)>(sym("nvmlDeviceGetName"));
    auto mem = reinterpret_cast<nvmlReturn_t (*)(nvmlDevice_t, NvmlMemory*)>(sym("nvmlDeviceGetMemoryInfo"));
    auto mem2 = reinterpret_cast<nvmlReturn_t (*)(nvmlDevice_t, NvmlMemoryV2*)>(sym("nvmlDeviceGetMemoryInfo_v2"));
    auto util = reinterpret_cast<nvmlReturn_t (*)(nvmlDevice_t, NvmlUtilization*)>(sym("nvmlDeviceGetUtilizationRates"));
    auto temp = reinterpret_cast<nvmlReturn_t (*)(nvmlDevice_t, int, unsigned*)>(sym("nvmlDeviceGetTemperature"));
    auto power = reinterpret_cast<nvmlReturn_t (*)(nvmlDevice_t, unsigned*)>(sym("nvmlDeviceGetPowerUsage"));
    auto pci = reinterpret_cast<nvmlReturn_t (*)(nvmlDevice_t, NvmlPciInfo*)>(sym("nvmlDeviceGetPciInfo_v3"));
    using ProcsFn = nvmlReturn_t (*)(nvmlDevice_t, unsigned*, NvmlProcessInfo*);
    auto procs = reinterpret_cast<ProcsFn>(sym("nvmlDeviceGetComputeRunningProcesses_v3"));
    if (!procs) procs = reinterpret_cast<ProcsFn>(sym("nvmlDeviceGetComputeRunningProcesses_v2"));
    std::vector<GpuInfo> out;
    if (!init || !shutdown || !count || !by_index) {
      error = "libnvidia-ml.so.1 lacks nvmlInit_v2/nvmlDeviceGetCount_v2 (driver too old)";
    } else if (int rc = shutdown_ ? 0 : init(); rc != 0) {
      error = fmt::format("nvmlInit failed (NVML error {})", rc);
    } else {
      shutdown_ = shutdown;  // initialised: shut down by the destructor
      unsigned n = 0;
      if (count(&n) != 0) n = 0;
      for (unsigned i = 0; i < n && i < 1024; ++i) {
        nvmlDevice_t d = nullptr;
        if (by_index(i, &d) != 0) continue;
        GpuInfo g;
        g.index = static_cast<int>(i);
        char buf[256] = {};
        if (name && name(d, buf, sizeof(buf) - 1) == 0) g.name = buf;
        NvmlMemoryV2 m2{};
        m2.version = kNvmlMemoryV2Version;
        NvmlMemory m{};
        if (mem2 && mem2(d, &m2) == 0) {
          g.memory_total = m2.total;
          g.memory_used = m2.used;
        } else if (mem && mem(d, &m) == 0) {
          g.memory_total = m.total;
          g.memory_used = m.used;
        }
        NvmlUtilization u{};
        if (util && util(d, &u) == 0) g.utilization_pct = static_cast<int>(u.gpu);
        unsigned t = 0;
        if (temp && temp(d, 0, &t) == 0) g.temperature_c = static_cast<int>(t);
        unsigned mw = 0;
        if (power && power(d, &mw) == 0) g.power_w = mw / 1000.0;
        NvmlPciInfo p{};
        if (pci && pci(d, &p) == 0) {
          p.bus_id[sizeof(p.bus_id) - 1] = 0;
          g.pci_bus_id = p.bus_id;
          g.numa_node = pci_numa_node(g.pci_bus_id);
        }
        if (procs) {
          NvmlProcessInfo infos[256] = {};
          unsigned n_procs = 256;
          if (procs(d, &n_procs, infos) == 0)
            for (unsigned k = 0; k < n_procs && k < 256; ++k)
              g.processes.push_back({infos[k].pid, infos[k].used_gpu_memory == kNvmlValueNotAvailable
                                                       ? std::nullopt
                                                       : std::optional<std::uint64_t>(infos[k].used_gpu_memory)});
        }
        out.push_back(std::move(g));
      }
    }
    return out;
  }

 private:
  mutable void* lib_ = nullptr;
  mutable nvmlReturn_t (*shutdown_)() = nullptr;  // set once nvmlInit succeeded
};

}  // namespace

std::unique_ptr<GpuProbe> make_nvml_probe() { return std::make_unique<NvmlProbe>(); }

std::vector<NetIf> probe_interfaces() {
  std::vector<NetIf> out;
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return out;
  for (ifaddrs* i = list; i; i = i->ifa_next) {
    if (!i->ifa_addr || (i->ifa_addr->sa_family != AF_INET && i->ifa_addr->sa_family != AF_INET6)) continue;
    char host[NI_MAXHOST] = {};
    const socklen_t len = i->ifa_addr->sa_family == AF_INET ? sizeof(sockaddr_in) : sizeof(sockaddr_in6);
    if (::getnameinfo(i->ifa_addr, len, host, sizeof(host), nullptr, 0, NI_NUMERICHOST) != 0) continue;
    NetIf n;
    n.name = i->ifa_name;
    n.address = host;
    if (auto pct = n.address.find('%'); pct != std::string::npos) n.address.resize(pct);
    n.loopback = (i->ifa_flags & IFF_LOOPBACK) != 0;
    n.up = (i->ifa_flags & IFF_UP) != 0;
    out.push_back(std::move(n));
  }
  ::freeifaddrs(list);
  return out;
}

std::optional<std::string> route_source_address(const std::string& host, std::string& error) {
  // Bounded (rdzv::lookup_within, kLookupBound): a DNS server that does not answer held
  // doctor and `--hostfile` for glibc's attempts x timeout (90 s with timeout:30 attempts:3) (#35).
  const rdzv::Addresses found = rdzv::lookup_within(host, 9);
  if (found.found.empty()) {
    error = fmt::format("cannot resolve {}: {}", host, found.error);
    return std::nullopt;
  }
  std::optional<std::string> out;
  error = "no route";
  for (auto it = found.found.begin(); it != found.found.end() && !out; ++it) {
    int fd = ::socket(it->data()->sa_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0) continue;
    sockaddr_storage local{};
    socklen_t len = sizeof(local);
    if (::connect(fd, it->data(), static_cast<socklen_t>(it->size())) == 0 &&
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0) {
      char buf[NI_MAXHOST] = {};
      if (::getnameinfo(reinterpret_cast<sockaddr*>(&local), len, buf, sizeof(buf), nullptr, 0, NI_NUMERICHOST) == 0)
        out = buf;
    } else {
      error = fmt::format("no route to {}: {}", host, std::strerror(errno));
    }
    ::close(fd);
  }
  return out;
}

}  // namespace mg::hw
