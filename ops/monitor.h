// Live monitoring of a node's workers (--monitor, --metrics-json, --metrics-port): each
// worker's CPU% and RSS summed over its whole process tree (from /proc) and each GPU's
// memory, utilisation, temperature and power (hw::GpuProbe). The parsers, the tree, the
// CPU% arithmetic and every output format (status line, JSON line, Prometheus text) are
// pure functions; the reads of /proc and the GPU probe run on the Sampler's own thread so
// that the agent's event loop never waits for them. Nothing here is constructed unless
// one of the flags is given.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <boost/asio/io_context.hpp>
#include <boost/asio/steady_timer.hpp>
#include <nlohmann/json.hpp>

#include "logs/console.h"
#include "ops/hwprobe.h"
#include "process/proc.h"

namespace mg::rdzv {
class HttpServer;
}

namespace mg::mon {

// ---- the process table (process/proc.h reads and parses /proc) ----

using ProcStatTimes = ProcStat;  // pid, ppid, pgrp, state, cpu_ticks, starttime

struct ProcEntry {
  ProcStatTimes stat;
  std::uint64_t rss_bytes = 0;
};
using ProcTable = std::vector<ProcEntry>;

// The process tree of a worker: `root`, its living descendants and the living members of
// its process group (a daemonised grandchild is re-parented to the agent but keeps the
// group unless it called setsid). Zombies are left out. Pure; each pid at most once.
// Once the worker was reaped (`root_reaped`), its pid may belong to an unrelated new
// process: only the members of its process group are its tree then (the kernel does not
// reuse a pid while a group still carries it).
std::vector<const ProcEntry*> process_tree(const ProcTable& table, pid_t root, bool root_reaped = false);

// CPU ticks by process (pid, start time), for CPU% between two samples.
using TickMap = std::map<std::pair<pid_t, std::uint64_t>, std::uint64_t>;
TickMap ticks_of(const std::vector<const ProcEntry*>& tree);
// Percent of one CPU used between `before` and `after`, `seconds` apart: the ticks each
// process in `after` gained (all of them for a process born meanwhile), over hz·seconds.
// A process that ended meanwhile is not counted (its last ticks are lost with it).
// nullopt when seconds <= 0 or hz <= 0.
std::optional<double> cpu_percent(const TickMap& before, const TickMap& after, double seconds, long hz);

// ---- samples and their formats (pure) ----

// What the agent knows about a rank when it asks for a sample.
struct RankTarget {
  int rank = 0, local_rank = 0;
  pid_t pid = -1;
  std::string state;  // "running", "exited", "failed", "stopping"
  bool reaped = false;  // the worker itself exited and was reaped: its pid may be reused
};

struct RankUsage {
  RankTarget target;
  int processes = 0;              // in its tree now
  std::optional<double> cpu_pct;  // nullopt on the first sample of a process tree
  std::uint64_t rss_bytes = 0;
  // The GPUs its tree's processes compute on and the memory they hold there (nullopt
  // where NVML cannot tell), by GPU index.
  std::map<int, std::optional<std::uint64_t>> gpu_memory;
};

// Fills each rank's gpu_memory from the GPUs' compute processes that belong to its
// process tree in `table` (pure).
void attribute_gpus(std::vector<RankUsage>& ranks, const ProcTable& table, const std::vector<hw::GpuInfo>& gpus);

struct Sample {
  double unix_time = 0;  // seconds since the epoch
  std::string host, run_id;
  int node_rank = 0, round = 0, restarts = 0;
  std::vector<RankUsage> ranks;
  std::vector<hw::GpuInfo> gpus;
  std::string gpu_error;  // why there are no GPU figures ("" when there are, or none asked)
};

// One JSON object (one line of --metrics-json).
nlohmann::json sample_json(const Sample& s);
// The compact console line, without "[mglaunch] " and newline, e.g.
// "monitor: rank0 99% 1.2G | rank1 12% 300M (3 procs) | gpu0 87% 31.2/80.0G 64C 312W".
std::string status_line(const Sample& s);
// "1.2G", "300M", "12K", "512B" (binary units).
std::string human_bytes(std::uint64_t bytes);

// What the agent reports at scrape time besides the last sample.
struct AgentFacts {
  std::string host, run_id;
  int node_rank = 0, round = 0, restarts = 0, max_restarts = 0;
  std::vector<RankTarget> ranks;  // the current worker group and its states
};
// Prometheus text exposition (version 0.0.4) of `facts` and, when there is one, the last
// sample's per-rank and per-GPU figures.
std::string prometheus_text(const AgentFacts& facts, const Sample* last);

// ---- side effects ----

// Reads /proc/PID/stat and /proc/PID/status of every process now (vanished ones skipped).
// `root` replaces "/proc" in tests.
ProcTable read_proc_table(const std::string& root = "/proc");
// Fills rss_bytes (from PID/status) of the members of the ranks' trees only.
void read_tree_rss(ProcTable& table, const std::vector<RankTarget>& ranks, const std::string& root = "/proc");

// The GPU probe the monitor uses: NVML, or, when `fake_file` is not empty (the test seam
// MGLAUNCH_TEST_GPU_JSON), a probe that reads the GPUs from that JSON file at every sample:
// [{"index":0,"name":"...","memory_total":N,"memory_used":N,"utilization_pct":N,
//   "temperature_c":N,"power_w":X,"processes":[{"pid":N,"memory_used":N}]}, ...].
std::unique_ptr<hw::GpuProbe> make_gpu_probe(const std::string& fake_file);
// Parses that JSON text (pure). Throws std::invalid_argument naming what is wrong.
std::vector<hw::GpuInfo> parse_gpu_json(std::string_view text);

// Takes samples on its own thread. request() hands over the ranks to measure; the sample
// is delivered by `on_sample` on the io_context's thread. A request while one is in
// flight is dropped (the loop never queues up behind a slow probe). The sampler keeps
// the ticks of the last sample of each rank's tree for CPU%. The destructor waits for a
// sample in flight and joins the thread. Constructed and used on the io_context's thread.
class Sampler {
 public:
  struct Options {
    std::string host, run_id;
    std::unique_ptr<hw::GpuProbe> gpu_probe;  // null: no GPU figures
    std::function<ProcTable()> read_table = [] { return read_proc_table(); };
    std::function<void(ProcTable&, const std::vector<RankTarget>&)> read_rss = [](ProcTable& t, const auto& r) {
      read_tree_rss(t, r);
    };
    std::function<double()> clock;  // seconds, monotonic; default steady_clock
    std::function<double()> wall;   // unix seconds; default system_clock
  };
  Sampler(boost::asio::io_context& io, Options opts, std::function<void(Sample)> on_sample);
  ~Sampler();
  Sampler(const Sampler&) = delete;
  Sampler& operator=(const Sampler&) = delete;

  // False (and nothing happens) while a sample is in flight.
  bool request(std::vector<RankTarget> ranks, int node_rank, int round, int restarts);

 private:
  struct Impl;
  std::shared_ptr<Impl> impl_;
};

// The pure step of a sample: usage of each rank from `table` at monotonic time `now`
// (seconds), CPU% against `previous` (by the rank's root pid: the time and ticks of its
// tree at the last sample), which it replaces with this sample's (ranks gone are dropped).
std::vector<RankUsage> measure_ranks(const ProcTable& table, const std::vector<RankTarget>& ranks,
                                     std::map<pid_t, std::pair<double, TickMap>>& previous, double now, long hz);

// The agent's side of it: a timer at `interval_s` asks the Sampler for a sample of the
// ranks `facts()` names; each sample becomes a console line (`console_line`), a line of
// `json_file` (queued to the console's file writer thread) and the figures /metrics
// serves (`metrics_port` >= 0, on `metrics_host`). Lives on the agent's io_context.
struct MonitorOptions {
  double interval_s = 5;
  bool console_line = false;             // --monitor
  std::string json_file;                 // --metrics-json
  int metrics_port = -1;                 // --metrics-port (0: any free port; -1: none)
  std::string metrics_host = "127.0.0.1";  // --metrics-host
  std::size_t metrics_max_connections = 64;  // connections at once (the agent's share for them)
  std::string host, run_id;
  std::unique_ptr<hw::GpuProbe> gpu_probe;  // the GPUs sampled (make_gpu_probe()); null: no GPU figures
};

class AgentMonitor {
 public:
  using Facts = std::function<AgentFacts()>;
  using Notice = std::function<void(const std::string&)>;
  // Opens the JSON file and listens for /metrics at once; throws std::runtime_error
  // naming the flag when either fails. Sampling starts with start().
  AgentMonitor(boost::asio::io_context& io, Console& console, MonitorOptions opts, Facts facts, Notice notice);
  ~AgentMonitor();
  void start();
  // Stops the timer and the HTTP server and closes the JSON file (after what is queued).
  void stop();
  int metrics_port() const;
  std::string metrics_url() const;

 private:
  void arm();
  void on_sample(Sample s);

  Console& console_;
  MonitorOptions opts_;
  Facts facts_;
  Notice notice_;
  boost::asio::steady_timer timer_;
  int json_fd_ = -1;
  std::unique_ptr<rdzv::HttpServer> http_;
  std::optional<Sample> last_;
  std::unique_ptr<Sampler> sampler_;
  bool stopped_ = false;
  bool first_ = true;
};

}  // namespace mg::mon
