// `mglaunch doctor`: the kernel-format parsers on fixture text, probing a fixture /proc and
// /sys tree, and the suggestions for made-up machines (a fake 8-GPU box with 2 NUMA
// nodes, a CPU box under a cgroup quota).
#include <catch2/catch.hpp>

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <set>

#include "ops/doctor.h"
#include "cli/errors.h"
#include "ops/hwprobe.h"
#include "support/proc.h"
#include "support/skip.h"

using namespace mg;
namespace fs = std::filesystem;

namespace {

constexpr std::uint64_t kGiB = 1024ull * 1024 * 1024;

// An 8-GPU box: GPUs 0-3 on NUMA node 0, 4-7 on node 1.
class FakeGpus : public hw::GpuProbe {
 public:
  explicit FakeGpus(int n, std::uint64_t mem) : n_(n), mem_(mem) {}
  std::vector<hw::GpuInfo> gpus(std::string& error) const override {
    std::vector<hw::GpuInfo> out;
    for (int i = 0; i < n_; ++i) {
      hw::GpuInfo g;
      g.index = i;
      g.name = "Fake H100";
      g.pci_bus_id = "00000000:" + std::to_string(10 + i) + ":00.0";
      g.memory_total = mem_;
      g.memory_used = kGiB / 2;
      g.utilization_pct = 0;
      g.numa_node = i < n_ / 2 ? 0 : 1;
      out.push_back(g);
    }
    if (n_ == 0) error = "no driver";
    return out;
  }

 private:
  int n_;
  std::uint64_t mem_;
};

void put(const std::string& path, const std::string& text) {
  fs::create_directories(fs::path(path).parent_path());
  std::ofstream(path) << text;
}

std::string temp_root() { return mgtest::make_temp_dir(); }

const Suggestion* find(const std::vector<Suggestion>& s, const std::string& name) {
  for (const auto& x : s)
    if (x.name == name) return &x;
  return nullptr;
}

// A 2-socket box seen through a fixture tree: 16 CPUs, 2 NUMA nodes, a cgroup quota.
std::string fixture_box(const std::string& cpu_max) {
  const std::string root = temp_root();
  put(root + "/proc/self/cgroup", "0::/job.slice/job-1.scope\n");
  put(root + "/sys/fs/cgroup/job.slice/job-1.scope/cpu.max", cpu_max);
  put(root + "/sys/fs/cgroup/job.slice/job-1.scope/memory.max", "17179869184\n");
  put(root + "/sys/fs/cgroup/job.slice/memory.max", "max\n");
  put(root + "/proc/meminfo", "MemTotal:       65536000 kB\nMemFree:  100 kB\nMemAvailable:   32768000 kB\n");
  put(root + "/affinity", "0-15\n");
  put(root + "/sys/devices/system/node/node0/cpulist", "0-7\n");
  put(root + "/sys/devices/system/node/node1/cpulist", "8-15\n");
  put(root + "/sys/devices/system/node/possible", "0-1\n");  // not a node directory
  return root;
}

}  // namespace

TEST_CASE("cpu lists parse ranges and singles and print back compactly") {
  CHECK(hw::parse_cpu_list("0-3,8-11\n") == std::vector<int>{0, 1, 2, 3, 8, 9, 10, 11});
  CHECK(hw::parse_cpu_list("5") == std::vector<int>{5});
  CHECK(hw::parse_cpu_list("") == std::vector<int>{});
  CHECK(hw::parse_cpu_list("3,1-2,1") == std::vector<int>{1, 2, 3});
  CHECK(hw::format_cpu_list({0, 1, 2, 3, 8, 9, 10, 11}) == "0-3,8-11");
  CHECK(hw::format_cpu_list({7, 1, 3, 2}) == "1-3,7");
  CHECK_THROWS_WITH(hw::parse_cpu_list("4-2"), Catch::Contains("bad cpu list '4-2'"));
  CHECK_THROWS_WITH(hw::parse_cpu_list("a"), Catch::Contains("not a cpu number"));
  CHECK_THROWS(hw::parse_cpu_list("0-99999999"));
}

TEST_CASE("cgroup v2 files and meminfo parse, with max meaning no limit") {
  CHECK_FALSE(hw::parse_cpu_max("max 100000\n"));
  CHECK(*hw::parse_cpu_max("250000 100000\n") == Approx(2.5));
  CHECK(*hw::parse_cpu_max("50000") == Approx(0.5));
  CHECK_FALSE(hw::parse_cpu_max("garbage 1"));
  CHECK_FALSE(hw::parse_memory_max("max\n"));
  CHECK(*hw::parse_memory_max("8589934592\n") == 8589934592ull);
  const char* meminfo = "MemTotal:       16318260 kB\nMemAvailable:    9000000 kB\nHugePages_Total:       0\n";
  CHECK(*hw::parse_meminfo(meminfo, "MemTotal") == 16318260ull * 1024);
  CHECK(*hw::parse_meminfo(meminfo, "HugePages_Total") == 0);
  CHECK_FALSE(hw::parse_meminfo(meminfo, "MemFree"));
  CHECK(*hw::parse_cgroup_path("12:cpu:/old\n0::/user.slice/x.scope\n") == "/user.slice/x.scope");
  CHECK_FALSE(hw::parse_cgroup_path("4:memory:/only-v1\n"));
}

TEST_CASE("a fixture box with a cgroup quota reports the quota as the usable CPUs") {
  const std::string root = fixture_box("400000 100000\n");
  auto cpu = hw::probe_cpus(root);
  CHECK(cpu.affinity.size() == 16);
  CHECK(*cpu.cgroup_quota == Approx(4.0));
  CHECK(cpu.usable() == 4);
  auto mem = hw::probe_memory(root);
  CHECK(*mem.total == 65536000ull * 1024);
  CHECK(*mem.cgroup_limit == 16 * kGiB);  // the tighter of the scope and its parent
  auto numa = hw::probe_numa(root);
  REQUIRE(numa.size() == 2);
  CHECK(numa[1].cpus.front() == 8);
  fs::remove_all(root);
}

TEST_CASE("a GPU's NUMA node comes from sysfs by its PCI bus id") {
  const std::string root = temp_root();
  put(root + "/bus/pci/devices/0000:65:00.0/numa_node", "1\n");
  put(root + "/bus/pci/devices/0000:66:00.0/numa_node", "-1\n");
  CHECK(*hw::pci_numa_node("00000000:65:00.0", root) == 1);
  CHECK_FALSE(hw::pci_numa_node("00000000:66:00.0", root));  // -1: unknown
  CHECK_FALSE(hw::pci_numa_node("00000000:67:00.0", root));
  fs::remove_all(root);
}

TEST_CASE("the batch table follows the guides for 4 GPUs and rescales accumulation otherwise") {
  auto b = [](double g, int n) {
    auto p = batch_for_memory(g, n);
    return std::to_string(p.micro_batch) + "x" + std::to_string(p.grad_accum);
  };
  CHECK(b(80, 4) == "16x4");
  CHECK(b(20, 4) == "16x4");
  CHECK(b(16, 4) == "12x5");
  CHECK(b(12, 4) == "8x8");
  CHECK(b(8, 4) == "4x16");
  CHECK(b(4, 4) == "2x32");
  CHECK(b(80, 8) == "16x2");  // 16 x 2 x 8 GPUs = 256
  CHECK(b(80, 1) == "16x16");
}

TEST_CASE("an 8-GPU box with 2 NUMA nodes gets 8 workers, its batch plan and a binding hint") {
  const std::string root = fixture_box("max 100000\n");
  FakeGpus gpus(8, 80 * kGiB);
  DoctorProbes probes;
  probes.gpu = &gpus;
  probes.root = root;
  DoctorOptions o;
  o.master_addr = "127.0.0.1";
  o.port = 0;
  o.python = false;
  DoctorInputs in = gather(o, {{"SLURM_JOB_ID", "42"}, {"HOME", "/root"}}, probes);
  auto s = suggest(in);
  REQUIRE(find(s, "--nproc_per_node"));
  CHECK(find(s, "--nproc_per_node")->value == "8");
  CHECK(find(s, "OMP_NUM_THREADS")->value == "2");  // 16 usable CPUs / 8 workers
  CHECK_THAT(find(s, "batch")->value, Catch::StartsWith("16 x 2"));
  REQUIRE(find(s, "binding"));
  CHECK_THAT(find(s, "binding")->reason, Catch::Contains("2 NUMA nodes"));
  CHECK_THAT(find(s, "binding")->value, Catch::StartsWith("local_rank 0: cpus 0-1 (NUMA node 0); local_rank 1: cpus 2-3") &&
                                            Catch::Contains("local_rank 4: cpus 8-9 (NUMA node 1)"));
  REQUIRE(find(s, "NCCL_SOCKET_IFNAME"));
  CHECK(find(s, "NCCL_SOCKET_IFNAME")->value == "lo");  // the interface that reaches 127.0.0.1
  auto j = doctor_json(in, s);
  CHECK(j["gpus"].size() == 8);
  CHECK(j["gpus"][7]["numa_node"] == 1);
  CHECK(j["gpus"][0]["memory_total_mib"] == 80 * 1024);
  CHECK(j["slurm"] == nlohmann::json{{"SLURM_JOB_ID", "42"}});
  CHECK(j["master"]["interface"] == "lo");
  CHECK(j["cpus"]["usable"] == 16);
  for (const auto& x : s) CHECK_FALSE(x.reason.empty());
  CHECK_THAT(doctor_text(in, s), Catch::Contains("GPU 7") && Catch::Contains("Suggestions:"));
  fs::remove_all(root);
}

TEST_CASE("a CPU box under a 4-CPU quota gets one worker per NUMA node and threads from the quota") {
  const std::string root = fixture_box("400000 100000\n");
  FakeGpus none(0, 0);
  DoctorProbes probes;
  probes.gpu = &none;
  probes.root = root;
  DoctorOptions o;
  o.python = false;
  DoctorInputs in = gather(o, {}, probes);
  auto s = suggest(in);
  CHECK(find(s, "--nproc_per_node")->value == "2");
  CHECK(find(s, "OMP_NUM_THREADS")->value == "2");  // 4 usable / 2 workers, not 16 / 2
  REQUIRE(find(s, "cgroup"));
  CHECK_FALSE(find(s, "batch"));
  CHECK(doctor_json(in, s)["gpu_error"] == "no driver");
  fs::remove_all(root);
}

TEST_CASE("a taken port is reported with a suggestion to pick another") {
  DoctorInputs in;
  in.cpu.online = 4;
  in.port = mgtest::free_loopback_port();  // any port: the probe's verdict is given below
  in.port_error = "address already in use";
  auto s = suggest(in);
  REQUIRE(find(s, "--master_port"));
  CHECK_THAT(find(s, "--master_port")->reason,
             Catch::Contains(std::to_string(in.port)) && Catch::Contains("already in use"));
}

TEST_CASE("cores binding gives disjoint CPU sets, from each GPU's NUMA node when known") {
  const std::vector<hw::NumaNode> numa{{0, hw::parse_cpu_list("0-7")}, {1, hw::parse_cpu_list("8-15")}};
  const auto all = hw::parse_cpu_list("0-15");
  // GPUs 0,1 on node 1 and GPU 2 on node 0; rank 3 has no GPU: it gets what is left.
  auto b = hw::plan_binding("cores", 4, all, numa, {1, 1, 0});
  CHECK(hw::format_binding(0, b[0]) == "local_rank 0: cpus 8-11 (NUMA node 1)");
  CHECK(hw::format_binding(1, b[1]) == "local_rank 1: cpus 12-15 (NUMA node 1)");
  CHECK(hw::format_binding(2, b[2]) == "local_rank 2: cpus 0-3 (NUMA node 0)");
  CHECK(hw::format_binding(3, b[3]) == "local_rank 3: cpus 4-7 (NUMA node 0)");
  auto whole = hw::plan_binding("cores", 2, all, numa, {1, 0});  // every rank placed: whole nodes
  CHECK(hw::format_binding(0, whole[0]) == "local_rank 0: cpus 8-15 (NUMA node 1)");
  std::set<int> seen;
  for (const auto& x : b)
    for (int c : x.cpus) CHECK(seen.insert(c).second);  // disjoint
}

TEST_CASE("cores binding stays inside the affinity mask and fails clearly when CPUs run out") {
  const std::vector<hw::NumaNode> numa{{0, hw::parse_cpu_list("0-7")}};
  auto b = hw::plan_binding("cores", 3, hw::parse_cpu_list("2-6"), numa, {});
  CHECK(hw::format_cpu_list(b[0].cpus) == "2-3");
  CHECK(hw::format_cpu_list(b[1].cpus) == "4-5");
  CHECK(hw::format_cpu_list(b[2].cpus) == "6");
  CHECK_THROWS_WITH(hw::plan_binding("cores", 4, hw::parse_cpu_list("0-2"), numa, {}),
                    Catch::Contains("4 workers cannot have disjoint CPUs among the 3 usable (0-2)"));
  CHECK_THROWS_WITH(hw::plan_binding("sockets", 1, {0}, numa, {}), Catch::Contains("use none, cores, numa, socket or core-complex"));
  CHECK(hw::plan_binding("none", 2, {0, 1}, numa, {})[1].cpus.empty());
}

TEST_CASE("numa binding gives each rank its node's usable CPUs, dealing nodes out in rank order") {
  const std::vector<hw::NumaNode> numa{{0, hw::parse_cpu_list("0-3")}, {1, hw::parse_cpu_list("4-7")}};
  auto b = hw::plan_binding("numa", 4, hw::parse_cpu_list("0-6"), numa, {});
  CHECK(hw::format_binding(0, b[0]) == "local_rank 0: cpus 0-3 (NUMA node 0)");
  CHECK(hw::format_binding(1, b[1]) == "local_rank 1: cpus 0-3 (NUMA node 0)");
  CHECK(hw::format_binding(3, b[3]) == "local_rank 3: cpus 4-6 (NUMA node 1)");
  auto g = hw::plan_binding("numa", 2, hw::parse_cpu_list("0-7"), numa, {1, 0});
  CHECK(*g[0].numa_node == 1);
  CHECK(*g[1].numa_node == 0);
}

TEST_CASE("doctor's flags follow the main CLI's rules: nearest name, prefixes, ambiguity, ranges") {
  auto error_of = [](std::vector<std::string> args) {
    args.insert(args.begin(), {"mglaunch", "doctor"});
    try {
      parse_doctor_args(args);
    } catch (const UsageError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  CHECK_THAT(error_of({"--jsn"}), Catch::Contains("unknown flag '--jsn'") && Catch::Contains("did you mean '--json'?"));
  CHECK_THAT(error_of({"--master"}), Catch::Contains("ambiguous") && Catch::Contains("--master_addr"));
  CHECK_THAT(error_of({"--port=70000"}), Catch::Contains("bad --port '70000'") && Catch::Contains("0..65535"));
  CHECK_THAT(error_of({"--port", std::string(400, '9')}), Catch::Contains("..."));
  CHECK(error_of({"--port", std::string(400, '9')}).size() < 200);
  CHECK_THAT(error_of({"--port="}), Catch::Contains("empty value in '--port='"));
  CHECK_THAT(error_of({"--master_addr", "--json"}), Catch::Contains("followed by the flag '--json'"));
  CHECK_THAT(error_of({"--json=yes"}), Catch::Contains("--json takes no value"));
  CHECK_THAT(error_of({"extra"}), Catch::Contains("unexpected argument 'extra'"));
  auto o = parse_doctor_args({"mglaunch", "doctor", "--js", "--no_p", "--master-a=127.0.0.1", "--po", "0"});
  REQUIRE(o);
  CHECK(o->json);
  CHECK_FALSE(o->python);
  CHECK(o->master_addr == "127.0.0.1");
  CHECK(o->port == 0);
  CHECK_FALSE(parse_doctor_args({"mglaunch", "doctor", "-h"}));
}

namespace {

// A stand-in python: a shell script that checks it was asked `-c 'import torch ...'`.
std::string fake_python(const std::string& dir, const std::string& name, const std::string& body) {
  const std::string path = dir + "/" + name;
  std::ofstream(path) << "#!/bin/sh\n"
                         "case \"$2\" in *'import torch'*) ;; *) echo \"asked: $*\"; exit 9;; esac\n"
                      << body;
  fs::permissions(path, fs::perms::owner_all);
  return path;
}

// A 2-socket box, one NUMA node per socket, two L3 caches (core complexes) per socket:
// CPUs 0-3 and 4-7 on package 0, 8-11 and 12-15 on package 1.
std::string topology_box() {
  const std::string root = temp_root();
  for (int c = 0; c < 16; ++c) {
    const std::string cpu = root + "/sys/devices/system/cpu/cpu" + std::to_string(c);
    put(cpu + "/topology/physical_package_id", c < 8 ? "0\n" : "1\n");
    put(cpu + "/cache/index0/level", "1\n");
    put(cpu + "/cache/index0/shared_cpu_list", std::to_string(c) + "\n");
    put(cpu + "/cache/index3/level", "3\n");
    const int lo = c / 4 * 4;
    put(cpu + "/cache/index3/shared_cpu_list", std::to_string(lo) + "-" + std::to_string(lo + 3) + "\n");
  }
  return root;
}

}  // namespace

TEST_CASE("doctor's python probe runs the python and reads torch's version after any warnings") {
  const std::string dir = mgtest::make_temp_dir();
  auto info = probe_python(fake_python(dir, "py", "echo 'UserWarning: something' >&2\n"
                                                  "echo 'torch 2.4.1+cu121 1 0 1'\n"));
  INFO(info.error);
  CHECK(info.has_torch);
  CHECK(info.torch_version == "2.4.1+cu121");
  CHECK(info.cuda);
  CHECK_FALSE(info.nccl);
  CHECK(info.gloo);
  fs::remove_all(dir);
}

TEST_CASE("doctor's python probe reports the last line a python without torch printed on stderr") {
  const std::string dir = mgtest::make_temp_dir();
  auto info = probe_python(fake_python(dir, "py", "echo 'Traceback (most recent call last):' >&2\n"
                                                  "echo \"ModuleNotFoundError: No module named 'torch'\" >&2\n"
                                                  "exit 1\n"));
  CHECK_FALSE(info.has_torch);
  CHECK(info.error == "ModuleNotFoundError: No module named 'torch'");
  // Not a program at all: why it could not run, in one line.
  const std::string junk = dir + "/junk";
  std::ofstream(junk) << "not a program\n";
  fs::permissions(junk, fs::perms::owner_all);
  info = probe_python(junk);
  CHECK_FALSE(info.has_torch);
  CHECK_THAT(info.error, Catch::Contains("Exec format error"));
  fs::remove_all(dir);
}

TEST_CASE("doctor's python probe gives up on a python that hangs, at its deadline, and kills it") {
  const std::string dir = mgtest::make_temp_dir();
  const std::string pid_file = dir + "/pid";
  auto info = probe_python(fake_python(dir, "py", "echo $$ > " + pid_file + "\nexec sleep 600\n"),
                           std::chrono::milliseconds(300));
  CHECK_FALSE(info.has_torch);
  CHECK_THAT(info.error, Catch::Contains("no answer within 0.3 s"));
  const pid_t pid = std::stoi(mgtest::read_file(pid_file));
  CHECK(mgtest::eventually([&] { return !mgtest::pid_alive(pid); }, std::chrono::seconds(10)));
  fs::remove_all(dir);
}

TEST_CASE("doctor's python probe asks a real python whether it has torch") {
  mgtest::require_installed(::access("/usr/bin/python3", X_OK) == 0, "/usr/bin/python3", "python3");
  auto info = probe_python("/usr/bin/python3");
  INFO(info.error);
  CHECK(info.has_torch == mgtest::python_has_torch());
  if (info.has_torch) CHECK_FALSE(info.torch_version.empty());
  else CHECK_THAT(info.error, Catch::Contains("torch"));
}

TEST_CASE("the CPU topology (packages and L3 caches) comes from sysfs") {
  const std::string root = topology_box();
  const auto t = hw::probe_topology(root);
  CHECK(t.package.size() == 16);
  CHECK(t.package.at(3) == 0);
  CHECK(t.package.at(12) == 1);
  REQUIRE(t.l3.size() == 4);
  CHECK(hw::format_cpu_list(t.l3[2]) == "8-11");
  CHECK(hw::probe_topology(root + "/nowhere").l3.empty());
  fs::remove_all(root);
}

TEST_CASE("numa binding socket and core-complex bind to the GPU's package and to one L3 cache of its node") {
  const std::string root = topology_box();
  const auto topo = hw::probe_topology(root);
  const std::vector<hw::NumaNode> numa{{0, hw::parse_cpu_list("0-7")}, {1, hw::parse_cpu_list("8-15")}};
  const auto all = hw::parse_cpu_list("0-15");
  // socket: the package of the GPU's node, whole.
  auto s = hw::plan_binding("socket", 2, all, numa, {1, 0}, topo);
  CHECK(hw::format_binding(0, s[0]) == "local_rank 0: cpus 8-15 (NUMA node 1)");
  CHECK(hw::format_binding(1, s[1]) == "local_rank 1: cpus 0-7 (NUMA node 0)");
  // No GPU: packages dealt out in rank order; only usable CPUs.
  auto s2 = hw::plan_binding("socket", 2, hw::parse_cpu_list("1-15"), numa, {}, topo);
  CHECK(hw::format_cpu_list(s2[0].cpus) == "1-7");
  CHECK(hw::format_cpu_list(s2[1].cpus) == "8-15");
  // core-complex: the ranks of a node take its L3 caches in turn.
  auto c = hw::plan_binding("core-complex", 4, all, numa, {1, 1, 0, 1}, topo);
  CHECK(hw::format_binding(0, c[0]) == "local_rank 0: cpus 8-11 (NUMA node 1)");
  CHECK(hw::format_binding(1, c[1]) == "local_rank 1: cpus 12-15 (NUMA node 1)");
  CHECK(hw::format_binding(2, c[2]) == "local_rank 2: cpus 0-3 (NUMA node 0)");
  CHECK(hw::format_binding(3, c[3]) == "local_rank 3: cpus 8-11 (NUMA node 1)");  // a third rank on node 1 shares
  // Without the topology each says what it misses.
  CHECK_THROWS_WITH(hw::plan_binding("socket", 1, all, numa, {}, {}), Catch::Contains("physical_package_id"));
  CHECK_THROWS_WITH(hw::plan_binding("core-complex", 1, all, numa, {}, {}), Catch::Contains("index3"));
  fs::remove_all(root);
}
