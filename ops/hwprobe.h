// Hardware and environment probes for `mglaunch doctor` and the fan-out: pure parsers of
// the kernel's text formats (cpu lists, cgroup v2 files, /proc/meminfo) with unit tests,
// and the probes that read the real files, sockets and NVML behind small seams.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace mg::hw {

// "0-3,8-11" -> {0,1,2,3,8,9,10,11}. Throws std::invalid_argument naming the text.
std::vector<int> parse_cpu_list(std::string_view text);
// {0,1,2,3,8} -> "0-3,8".
std::string format_cpu_list(const std::vector<int>& cpus);

// cgroup v2 cpu.max: "max 100000" -> nullopt (no limit); "200000 100000" -> 2.0 CPUs.
std::optional<double> parse_cpu_max(std::string_view text);
// cgroup v2 memory.max: "max" -> nullopt; "8589934592" -> bytes.
std::optional<std::uint64_t> parse_memory_max(std::string_view text);
// /proc/meminfo: field (e.g. "MemTotal", "MemAvailable") in bytes, nullopt when absent.
std::optional<std::uint64_t> parse_meminfo(std::string_view text, std::string_view field);
// /proc/self/cgroup (v2 line "0::/path") -> "/path"; nullopt when there is no v2 line.
std::optional<std::string> parse_cgroup_path(std::string_view text);

struct CpuInfo {
  int online = 0;                   // sysconf(_SC_NPROCESSORS_ONLN)
  std::vector<int> affinity;        // sched_getaffinity
  std::optional<double> cgroup_quota;  // CPUs from cpu.max
  // What a job can really use: min(affinity size, ceil(quota)).
  int usable() const;
};

struct MemInfo {
  std::optional<std::uint64_t> total, available;  // /proc/meminfo
  std::optional<std::uint64_t> cgroup_limit;      // memory.max
};

struct NumaNode {
  int id = 0;
  std::vector<int> cpus;
};

struct GpuInfo {
  int index = 0;
  std::string name;
  std::string pci_bus_id;  // "00000000:65:00.0"
  std::uint64_t memory_total = 0, memory_used = 0;  // bytes
  std::optional<int> utilization_pct, temperature_c;
  std::optional<double> power_w;
  std::optional<int> numa_node;
  // Compute processes on this GPU and the memory each holds (NVML; host pids), for the
  // monitor's per-rank GPU figures. memory_used is nullopt where NVML cannot tell.
  struct Process {
    unsigned pid = 0;
    std::optional<std::uint64_t> memory_used;
  };
  std::vector<Process> processes;
};

// GPU probing seam. NvmlGpuProbe loads libnvidia-ml.so.1 with dlopen at run time.
class GpuProbe {
 public:
  virtual ~GpuProbe() = default;
  // Empty when there is no driver or no GPU; `error` says why when something failed.
  virtual std::vector<GpuInfo> gpus(std::string& error) const = 0;
};
std::unique_ptr<GpuProbe> make_nvml_probe();

// The sysfs NUMA node of a PCI device ("00000000:65:00.0"), nullopt when unknown or -1.
std::optional<int> pci_numa_node(const std::string& pci_bus_id, const std::string& sysfs_root = "/sys");

CpuInfo probe_cpus(const std::string& root = "");  // root: prefix for /proc and /sys/fs/cgroup (tests)
MemInfo probe_memory(const std::string& root = "");
std::vector<NumaNode> probe_numa(const std::string& root = "");

// Which CPUs share a package (socket) and which share an L3 cache (a core complex).
struct CpuTopology {
  std::map<int, int> package;            // cpu -> topology/physical_package_id
  std::vector<std::vector<int>> l3;      // the CPU sets sharing one L3 cache (sorted, each once)
};
// From {root}/sys/devices/system/cpu/cpuN/topology/physical_package_id and
// cpuN/cache/indexK/{level,shared_cpu_list} (the index whose level is 3).
CpuTopology probe_topology(const std::string& root = "");

// CPU binding for `--cpu-bind` (policy "none", "cores", "numa", "socket" or "core-complex";
// torchrun's --numa-binding exclusive, node, socket, core-complex), pure: which CPUs each
// local rank gets. cores: disjoint sets within `usable`, taken from the rank's GPU NUMA
// node when known (gpu_numa[local_rank]), the rest split evenly; numa: every usable CPU
// of the rank's node (its GPU's, else nodes dealt out in rank order); socket: every usable
// CPU of the package that holds the rank's node (packages dealt out in rank order when the
// GPU's node is unknown); core-complex: the usable CPUs of one L3 cache within the rank's
// node, the ranks of a node dealt over its caches in rank order. none: empty sets.
// Throws std::invalid_argument naming the policy when it cannot be satisfied.
struct Binding {
  std::vector<int> cpus;
  std::optional<int> numa_node;
};
std::vector<Binding> plan_binding(const std::string& policy, int nproc, const std::vector<int>& usable,
                                  const std::vector<NumaNode>& numa, const std::vector<std::optional<int>>& gpu_numa,
                                  const CpuTopology& topology = {});
// The bindings of `nproc` local ranks on this machine: its usable CPUs (affinity), NUMA
// nodes and, for ranks with a GPU (gpu_ids[local_rank], else the rank's index), that GPU's
// NUMA node from NVML when a driver is there. Throws std::invalid_argument like plan_binding.
std::vector<Binding> bind_this_machine(const std::string& policy, int nproc, const std::vector<int>& gpu_ids);
// One line per rank: "local_rank 0: cpus 0-3 (NUMA node 0)".
std::string format_binding(int local_rank, const Binding& b);

struct NetIf {
  std::string name;
  std::string address;  // IPv4 or IPv6 text
  bool loopback = false;
  bool up = false;
};
std::vector<NetIf> probe_interfaces();

// The local address the kernel would use to reach `host` (UDP connect + getsockname; no
// packet is sent). nullopt when `host` does not resolve or has no route; `error` says why.
std::optional<std::string> route_source_address(const std::string& host, std::string& error);

}  // namespace mg::hw
