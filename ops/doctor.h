// `mglaunch doctor [--json] [--master_addr A] [--port P] [--no-python] [--preflight[=N]]`: what this machine
// really offers (CPUs with affinity and cgroup quota, memory, NUMA, GPUs through NVML,
// interfaces, the route to the master, a free port, Slurm, which python has torch) and
// settings derived from it, each with its reason; with --preflight, the network check of
// `mglaunch --preflight` (ops/preflight.h) between N nodes on this machine. gather() does the probing through
// seams; suggest() and the renderers are pure and unit-tested on made-up machines.
#pragma once

#include <chrono>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "ops/hwprobe.h"

namespace mg {

struct DoctorOptions {
  bool json = false;
  std::string master_addr;  // empty: not asked
  int port = 29500;
  bool python = true;       // probe pythons for torch (imports torch: seconds)
  int preflight_nodes = 0;  // --preflight[=N]: N nodes (default 4) on this machine; 0: no check
};

struct PythonInfo {
  std::string path;
  bool has_torch = false;
  std::string torch_version;
  bool cuda = false, nccl = false, gloo = false;
  std::string error;
};

struct DoctorInputs {
  hw::CpuInfo cpu;
  hw::MemInfo mem;
  std::vector<hw::NumaNode> numa;
  std::vector<hw::GpuInfo> gpus;
  std::string gpu_error;
  std::vector<hw::NetIf> interfaces;
  std::string master_addr;
  std::optional<std::string> master_route;  // local address that reaches master_addr
  std::string route_error;
  int port = 29500;
  std::optional<std::string> port_error;  // nullopt: free
  std::map<std::string, std::string> slurm;  // SLURM_* variables
  std::vector<PythonInfo> pythons;
  // --preflight: N nodes, threads of this process, on `preflight_address` (the address that
  // reaches --master_addr, else 127.0.0.1); empty line: not run.
  int preflight_nodes = 0;
  std::string preflight_address;
  bool preflight_ok = false;
  std::string preflight_line;
};

struct Suggestion {
  std::string name;   // "--nproc_per_node", "OMP_NUM_THREADS", ...
  std::string value;
  std::string reason;
};

struct BatchPlan {
  int micro_batch = 0;
  int grad_accum = 0;
};
// The guides' table for an effective batch of 256 on 4 GPUs, by the smallest GPU's memory
// in GiB: >= 20 -> 16x4, 14-20 -> 12x5, 10-14 -> 8x8, 6-10 -> 4x16, < 6 -> 2x32. With
// `gpus` other than 4 the accumulation is scaled to keep micro x accum x gpus near 256.
BatchPlan batch_for_memory(double gib, int gpus);

// The "cores" binding for `nproc` workers on this machine (GPU i's NUMA node for local rank
// i). Throws std::invalid_argument when the workers cannot get disjoint CPUs.
std::vector<hw::Binding> binding_for(const DoctorInputs& in, int nproc);

// The Pythons doctor asks, each found on PATH once (by python_identity()): $MGLAUNCH_PYTHON,
// python3 on PATH, /usr/bin/python3; the paths as found.
std::vector<std::string> python_candidates(const std::map<std::string, std::string>& env);
// What tells two Pythons apart: the real file, except for a virtual environment's (a link
// to its base interpreter, with its own pyvenv.cfg and site-packages), which is its own path.
std::string python_identity(const std::string& python);

// Asks `python` for torch's version and whether CUDA, NCCL and gloo are there (`python -c
// 'import torch ...'`, stdout and stderr read together). The answer is the last line
// "torch VERSION CUDA NCCL GLOO"; without one, `error` is the last line it printed (the
// ImportError), why it could not run, or that it gave no answer within `timeout` (then it
// and its process group were killed).
PythonInfo probe_python(const std::string& python, std::chrono::milliseconds timeout = std::chrono::seconds(60));

// Seams for gather(): the Python probe runs `python -c 'import torch ...'`.
struct DoctorProbes {
  const hw::GpuProbe* gpu = nullptr;
  std::function<PythonInfo(const std::string& python)> python;
  std::string root;  // prefix for /proc and /sys (tests); empty: the real files
};
DoctorProbes real_doctor_probes();

DoctorInputs gather(const DoctorOptions& o, const std::map<std::string, std::string>& env, const DoctorProbes& probes);
std::vector<Suggestion> suggest(const DoctorInputs& in);
nlohmann::json doctor_json(const DoctorInputs& in, const std::vector<Suggestion>& s);
std::string doctor_text(const DoctorInputs& in, const std::vector<Suggestion>& s);

// argv: {"mglaunch", "doctor", flags...}, with the main CLI's rules (cli/args.h): unknown
// flags name the nearest valid one, unique prefixes are accepted, ambiguous ones listed,
// `--flag=` is an empty value. Pure. Throws UsageError; nullopt: --help was asked.
std::optional<DoctorOptions> parse_doctor_args(const std::vector<std::string>& argv);
std::string doctor_help();

// argv: {"mglaunch", "doctor", flags...}. Throws UsageError. Returns 0, or 5 when
// --preflight found a slow or broken node.
int doctor_main(const std::vector<std::string>& argv, const std::map<std::string, std::string>& env);

}  // namespace mg
