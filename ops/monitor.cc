#include "ops/monitor.h"

#include <dirent.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <charconv>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <fstream>
#include <mutex>
#include <set>
#include <sstream>
#include <stdexcept>
#include <thread>
#include <unordered_set>

#include <boost/asio/post.hpp>
#include <fmt/format.h>

#include "process/thread.h"
#include "rendezvous/http.h"

namespace mg::mon {

std::vector<const ProcEntry*> process_tree(const ProcTable& table, pid_t root, bool root_reaped) {
  std::vector<const ProcEntry*> out;
  std::unordered_set<pid_t> in;
  // The root and its group first, then breadth-first over parent links from every member.
  for (const auto& e : table) {
    if (e.stat.state == 'Z') continue;
    if ((e.stat.pid == root && !root_reaped) || e.stat.pgrp == root) {
      if (in.insert(e.stat.pid).second) out.push_back(&e);
    }
  }
  std::unordered_set<pid_t> frontier(in.begin(), in.end());
  if (!root_reaped) frontier.insert(root);  // a zombie root's children still belong to it
  for (int depth = 0; !frontier.empty() && depth < 4096; ++depth) {
    std::unordered_set<pid_t> next;
    for (const auto& e : table) {
      if (e.stat.state == 'Z' || in.count(e.stat.pid) || !frontier.count(e.stat.ppid)) continue;
      in.insert(e.stat.pid);
      out.push_back(&e);
      next.insert(e.stat.pid);
    }
    frontier = std::move(next);
  }
  return out;
}

TickMap ticks_of(const std::vector<const ProcEntry*>& tree) {
  TickMap m;
  for (const auto* e : tree) m[{e->stat.pid, e->stat.starttime}] = e->stat.cpu_ticks;
  return m;
}

std::optional<double> cpu_percent(const TickMap& before, const TickMap& after, double seconds, long hz) {
  if (!(seconds > 0) || hz <= 0) return std::nullopt;
  std::uint64_t gained = 0;
  for (const auto& [key, ticks] : after) {
    auto it = before.find(key);
    const std::uint64_t base = it == before.end() ? 0 : it->second;
    if (ticks > base) gained += ticks - base;
  }
  return 100.0 * static_cast<double>(gained) / (static_cast<double>(hz) * seconds);
}

std::vector<RankUsage> measure_ranks(const ProcTable& table, const std::vector<RankTarget>& ranks,
                                     std::map<pid_t, std::pair<double, TickMap>>& previous, double now, long hz) {
  std::vector<RankUsage> out;
  std::map<pid_t, std::pair<double, TickMap>> next;
  for (const auto& t : ranks) {
    RankUsage u;
    u.target = t;
    if (t.pid > 0) {
      const auto tree = process_tree(table, t.pid, t.reaped);
      u.processes = static_cast<int>(tree.size());
      for (const auto* e : tree) u.rss_bytes += e->rss_bytes;
      TickMap ticks = ticks_of(tree);
      if (auto it = previous.find(t.pid); it != previous.end()) u.cpu_pct = cpu_percent(it->second.second, ticks, now - it->second.first, hz);
      next[t.pid] = {now, std::move(ticks)};
    }
    out.push_back(std::move(u));
  }
  previous = std::move(next);
  return out;
}

void attribute_gpus(std::vector<RankUsage>& ranks, const ProcTable& table, const std::vector<hw::GpuInfo>& gpus) {
  for (auto& r : ranks) {
    r.gpu_memory.clear();
    if (r.target.pid <= 0) continue;
    std::set<pid_t> tree;
    for (const auto* e : process_tree(table, r.target.pid, r.target.reaped)) tree.insert(e->stat.pid);
    for (const auto& g : gpus)
      for (const auto& p : g.processes) {
        if (!tree.count(static_cast<pid_t>(p.pid))) continue;
        auto [it, fresh] = r.gpu_memory.try_emplace(g.index, std::uint64_t{0});
        if (!p.memory_used || !it->second) it->second.reset();  // one unknown makes the sum unknown
        else *it->second += *p.memory_used;
      }
  }
}

std::string human_bytes(std::uint64_t b) {
  constexpr double kK = 1024.0, kM = kK * 1024, kG = kM * 1024, kT = kG * 1024;
  const double v = static_cast<double>(b);
  if (v >= kT) return fmt::format("{:.1f}T", v / kT);
  if (v >= kG) return fmt::format("{:.1f}G", v / kG);
  if (v >= kM) return fmt::format("{:.0f}M", v / kM);
  if (v >= kK) return fmt::format("{:.0f}K", v / kK);
  return fmt::format("{}B", b);
}

nlohmann::json sample_json(const Sample& s) {
  nlohmann::json ranks = nlohmann::json::array();
  for (const auto& r : s.ranks) {
    nlohmann::json j = {{"rank", r.target.rank},        {"local_rank", r.target.local_rank}, {"pid", r.target.pid},
                        {"state", r.target.state},      {"processes", r.processes},          {"rss_bytes", r.rss_bytes},
                        {"cpu_pct", nullptr}};
    if (r.cpu_pct) j["cpu_pct"] = std::round(*r.cpu_pct * 10) / 10;
    j["gpus"] = nlohmann::json::array();
    for (const auto& [index, bytes] : r.gpu_memory)
      j["gpus"].push_back({{"index", index}, {"memory_used_bytes", bytes ? nlohmann::json(*bytes) : nlohmann::json()}});
    ranks.push_back(std::move(j));
  }
  nlohmann::json gpus = nlohmann::json::array();
  for (const auto& g : s.gpus) {
    nlohmann::json j = {{"index", g.index}, {"name", g.name}, {"memory_used_bytes", g.memory_used},
                        {"memory_total_bytes", g.memory_total}};
    j["utilization_pct"] = g.utilization_pct ? nlohmann::json(*g.utilization_pct) : nlohmann::json();
    j["temperature_c"] = g.temperature_c ? nlohmann::json(*g.temperature_c) : nlohmann::json();
    j["power_w"] = g.power_w ? nlohmann::json(*g.power_w) : nlohmann::json();
    gpus.push_back(std::move(j));
  }
  nlohmann::json out = {{"time", s.unix_time}, {"host", s.host},         {"run_id", s.run_id}, {"node_rank", s.node_rank},
                        {"round", s.round},    {"restarts", s.restarts}, {"ranks", ranks},     {"gpus", gpus}};
  if (!s.gpu_error.empty()) out["gpu_error"] = s.gpu_error;
  return out;
}

std::string status_line(const Sample& s) {
  std::string out = "monitor:";
  const char* sep = " ";
  for (const auto& r : s.ranks) {
    out += fmt::format("{}rank{}", sep, r.target.rank);
    if (r.target.state != "running") out += " " + r.target.state;
    if (r.processes > 0) {
      out += r.cpu_pct ? fmt::format(" {:.0f}%", *r.cpu_pct) : std::string(" --%");
      out += " " + human_bytes(r.rss_bytes);
      if (r.processes > 1) out += fmt::format(" ({} procs)", r.processes);
      for (const auto& [index, bytes] : r.gpu_memory)
        out += fmt::format(" gpu{}:{}", index, bytes ? human_bytes(*bytes) : std::string("?"));
    }
    sep = " | ";
  }
  for (const auto& g : s.gpus) {
    out += fmt::format("{}gpu{}", sep, g.index);
    if (g.utilization_pct) out += fmt::format(" {}%", *g.utilization_pct);
    constexpr double kG = 1024.0 * 1024 * 1024;
    out += fmt::format(" {:.1f}/{:.1f}G", static_cast<double>(g.memory_used) / kG, static_cast<double>(g.memory_total) / kG);
    if (g.temperature_c) out += fmt::format(" {}C", *g.temperature_c);
    if (g.power_w) out += fmt::format(" {:.0f}W", *g.power_w);
    sep = " | ";
  }
  if (s.ranks.empty() && s.gpus.empty()) out += " no workers";
  return out;
}

std::string prometheus_text(const AgentFacts& f, const Sample* last) {
  std::string out;
  auto family = [&](const char* name, const char* type, const char* help) {
    out += fmt::format("# HELP {} {}\n# TYPE {} {}\n", name, help, name, type);
  };
  auto num = [](double v) { return fmt::format("{}", v); };
  using rdzv::prometheus_label;
  family("mglaunch_agent_info", "gauge", "This agent: its run id, host and node rank (always 1).");
  out += fmt::format("mglaunch_agent_info{{run_id=\"{}\",host=\"{}\",node_rank=\"{}\"}} 1\n", prometheus_label(f.run_id),
                     prometheus_label(f.host), f.node_rank);
  family("mglaunch_agent_restarts_total", "counter", "Restarts of the worker group so far in this run.");
  out += fmt::format("mglaunch_agent_restarts_total {}\n", f.restarts);
  family("mglaunch_agent_max_restarts", "gauge", "Restarts allowed (--max_restarts).");
  out += fmt::format("mglaunch_agent_max_restarts {}\n", f.max_restarts);
  family("mglaunch_agent_round", "gauge", "Rendezvous round of the current worker group (0: static or none yet).");
  out += fmt::format("mglaunch_agent_round {}\n", f.round);
  static const char* kStates[] = {"running", "stopping", "exited", "failed"};
  family("mglaunch_agent_workers", "gauge", "Workers of the current group by state.");
  for (const char* st : kStates) {
    const auto n = std::count_if(f.ranks.begin(), f.ranks.end(), [&](const RankTarget& r) { return r.state == st; });
    out += fmt::format("mglaunch_agent_workers{{state=\"{}\"}} {}\n", st, n);
  }
  family("mglaunch_worker_state", "gauge", "1 for the state each rank is in.");
  for (const auto& r : f.ranks)
    out += fmt::format("mglaunch_worker_state{{rank=\"{}\",local_rank=\"{}\",state=\"{}\"}} 1\n", r.rank, r.local_rank,
                       prometheus_label(r.state));
  if (!last) return out;
  auto rank_labels = [](const RankUsage& r) {
    return fmt::format("rank=\"{}\",local_rank=\"{}\"", r.target.rank, r.target.local_rank);
  };
  family("mglaunch_worker_cpu_percent", "gauge", "CPU used by the rank's process tree, percent of one CPU, last sample.");
  for (const auto& r : last->ranks)
    if (r.cpu_pct && r.processes > 0) out += fmt::format("mglaunch_worker_cpu_percent{{{}}} {}\n", rank_labels(r), num(*r.cpu_pct));
  family("mglaunch_worker_resident_memory_bytes", "gauge", "Resident memory (RSS) of the rank's process tree, last sample.");
  for (const auto& r : last->ranks)
    if (r.processes > 0) out += fmt::format("mglaunch_worker_resident_memory_bytes{{{}}} {}\n", rank_labels(r), r.rss_bytes);
  family("mglaunch_worker_processes", "gauge", "Processes in the rank's process tree, last sample.");
  for (const auto& r : last->ranks) out += fmt::format("mglaunch_worker_processes{{{}}} {}\n", rank_labels(r), r.processes);
  family("mglaunch_worker_gpu_memory_used_bytes", "gauge",
         "GPU memory held by the rank's process tree on each GPU it computes on (NVML), last sample.");
  for (const auto& r : last->ranks)
    for (const auto& [index, bytes] : r.gpu_memory)
      if (bytes) out += fmt::format("mglaunch_worker_gpu_memory_used_bytes{{{},gpu=\"{}\"}} {}\n", rank_labels(r), index, *bytes);
  auto gpu_labels = [](const hw::GpuInfo& g) {
    return fmt::format("gpu=\"{}\",name=\"{}\"", g.index, rdzv::prometheus_label(g.name));
  };
  family("mglaunch_gpu_memory_used_bytes", "gauge", "GPU memory in use, last sample.");
  for (const auto& g : last->gpus) out += fmt::format("mglaunch_gpu_memory_used_bytes{{{}}} {}\n", gpu_labels(g), g.memory_used);
  family("mglaunch_gpu_memory_total_bytes", "gauge", "GPU memory in all.");
  for (const auto& g : last->gpus) out += fmt::format("mglaunch_gpu_memory_total_bytes{{{}}} {}\n", gpu_labels(g), g.memory_total);
  family("mglaunch_gpu_utilization_percent", "gauge", "GPU utilisation (NVML), last sample.");
  for (const auto& g : last->gpus)
    if (g.utilization_pct) out += fmt::format("mglaunch_gpu_utilization_percent{{{}}} {}\n", gpu_labels(g), *g.utilization_pct);
  family("mglaunch_gpu_temperature_celsius", "gauge", "GPU temperature, last sample.");
  for (const auto& g : last->gpus)
    if (g.temperature_c) out += fmt::format("mglaunch_gpu_temperature_celsius{{{}}} {}\n", gpu_labels(g), *g.temperature_c);
  family("mglaunch_gpu_power_watts", "gauge", "GPU power draw, last sample.");
  for (const auto& g : last->gpus)
    if (g.power_w) out += fmt::format("mglaunch_gpu_power_watts{{{}}} {}\n", gpu_labels(g), num(*g.power_w));
  family("mglaunch_monitor_last_sample_timestamp_seconds", "gauge", "When the last sample was taken (unix time).");
  out += fmt::format("mglaunch_monitor_last_sample_timestamp_seconds {}\n", num(last->unix_time));
  return out;
}

ProcTable read_proc_table(const std::string& root) {
  ProcTable out;
  for (const auto& st : scan_processes(root)) out.push_back({st, 0});
  return out;
}

void read_tree_rss(ProcTable& table, const std::vector<RankTarget>& ranks, const std::string& root) {
  std::set<pid_t> wanted;
  for (const auto& r : ranks)
    if (r.pid > 0)
      for (const auto* e : process_tree(table, r.pid, r.reaped)) wanted.insert(e->stat.pid);
  for (auto& e : table)
    if (wanted.count(e.stat.pid))
      e.rss_bytes = proc_status_bytes(read_proc_file(e.stat.pid, "status", 16384, root), "VmRSS").value_or(0);
}

namespace {

class FileGpuProbe : public hw::GpuProbe {
 public:
  explicit FileGpuProbe(std::string path) : path_(std::move(path)) {}
  std::vector<hw::GpuInfo> gpus(std::string& error) const override {
    std::ifstream in(path_);
    if (!in) {
      error = fmt::format("cannot read the GPU file {} (MGLAUNCH_TEST_GPU_JSON)", path_);
      return {};
    }
    std::stringstream ss;
    ss << in.rdbuf();
    try {
      return parse_gpu_json(ss.str());
    } catch (const std::invalid_argument& e) {
      error = fmt::format("{} (MGLAUNCH_TEST_GPU_JSON {})", e.what(), path_);
      return {};
    }
  }

 private:
  std::string path_;
};

}  // namespace

std::vector<hw::GpuInfo> parse_gpu_json(std::string_view text) {
  const auto j = nlohmann::json::parse(text, nullptr, false);
  if (j.is_discarded() || !j.is_array()) throw std::invalid_argument("GPU JSON: expected an array of objects");
  std::vector<hw::GpuInfo> out;
  for (const auto& g : j) {
    if (!g.is_object()) throw std::invalid_argument("GPU JSON: expected an array of objects");
    hw::GpuInfo info;
    try {
      info.index = g.value("index", static_cast<int>(out.size()));
      info.name = g.value("name", std::string());
      info.memory_total = g.value("memory_total", std::uint64_t{0});
      info.memory_used = g.value("memory_used", std::uint64_t{0});
      if (g.contains("utilization_pct")) info.utilization_pct = g.at("utilization_pct").get<int>();
      if (g.contains("temperature_c")) info.temperature_c = g.at("temperature_c").get<int>();
      if (g.contains("power_w")) info.power_w = g.at("power_w").get<double>();
      if (g.contains("processes"))
        for (const auto& p : g.at("processes")) {
          hw::GpuInfo::Process proc;
          proc.pid = p.at("pid").get<unsigned>();
          if (p.contains("memory_used")) proc.memory_used = p.at("memory_used").get<std::uint64_t>();
          info.processes.push_back(proc);
        }
    } catch (const nlohmann::json::exception& e) {
      throw std::invalid_argument(fmt::format("GPU JSON: GPU {}: {}", out.size(), e.what()));
    }
    out.push_back(std::move(info));
  }
  return out;
}

std::unique_ptr<hw::GpuProbe> make_gpu_probe(const std::string& fake_file) {
  if (!fake_file.empty()) return std::make_unique<FileGpuProbe>(fake_file);
  return hw::make_nvml_probe();
}

struct Sampler::Impl {
  boost::asio::io_context& io;
  Options opts;
  std::function<void(Sample)> on_sample;
  long hz = ::sysconf(_SC_CLK_TCK);
  // io thread only
  bool busy = false;
  bool alive = true;
  // shared with the sampling thread
  std::mutex mu;
  std::condition_variable cv;
  bool stop = false;
  std::optional<Sample> request;  // ranks and facts to measure
  std::thread thread;
  // sampling thread only
  std::map<pid_t, std::pair<double, TickMap>> previous;

  Impl(boost::asio::io_context& io, Options o, std::function<void(Sample)> cb)
      : io(io), opts(std::move(o)), on_sample(std::move(cb)) {}

  void run(std::shared_ptr<Impl> self) {
    while (true) {
      Sample s;
      {
        std::unique_lock lock(mu);
        cv.wait(lock, [&] { return stop || request; });
        if (stop) return;
        s = std::move(*request);
        request.reset();
      }
      std::vector<RankTarget> targets;
      for (const auto& r : s.ranks) targets.push_back(r.target);
      ProcTable table = opts.read_table();
      if (opts.read_rss) opts.read_rss(table, targets);
      s.ranks = measure_ranks(table, targets, previous, opts.clock(), hz);
      if (opts.gpu_probe) {
        s.gpus = opts.gpu_probe->gpus(s.gpu_error);
        attribute_gpus(s.ranks, table, s.gpus);
        if (s.gpus.empty() && s.gpu_error.empty()) s.gpu_error = "no GPU";
      }
      s.unix_time = opts.wall();
      boost::asio::post(io, [self, s = std::move(s)]() mutable {
        self->busy = false;
        if (self->alive) self->on_sample(std::move(s));
      });
    }
  }
};

Sampler::Sampler(boost::asio::io_context& io, Options opts, std::function<void(Sample)> on_sample) {
  if (!opts.clock)
    opts.clock = [] { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); };
  if (!opts.wall)
    opts.wall = [] { return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count(); };
  impl_ = std::make_shared<Impl>(io, std::move(opts), std::move(on_sample));
  // The agent's signals are for its io_context, never for this thread.
  impl_->thread = signal_free_thread([impl = impl_.get(), self = impl_] { impl->run(self); });
}

Sampler::~Sampler() {
  impl_->alive = false;
  {
    std::lock_guard lock(impl_->mu);
    impl_->stop = true;
  }
  impl_->cv.notify_all();
  impl_->thread.join();
}

bool Sampler::request(std::vector<RankTarget> ranks, int node_rank, int round, int restarts) {
  if (impl_->busy) return false;
  impl_->busy = true;
  Sample s;
  s.host = impl_->opts.host;
  s.run_id = impl_->opts.run_id;
  s.node_rank = node_rank;
  s.round = round;
  s.restarts = restarts;
  for (auto& r : ranks) {
    RankUsage u;
    u.target = std::move(r);
    s.ranks.push_back(std::move(u));
  }
  {
    std::lock_guard lock(impl_->mu);
    impl_->request = std::move(s);
  }
  impl_->cv.notify_all();
  return true;
}

AgentMonitor::AgentMonitor(boost::asio::io_context& io, Console& console, MonitorOptions opts, Facts facts, Notice notice)
    : console_(console), opts_(std::move(opts)), facts_(std::move(facts)), notice_(std::move(notice)), timer_(io) {
  if (!opts_.json_file.empty()) {
    json_fd_ = open_output_file(opts_.json_file, O_APPEND);
    if (json_fd_ < 0)
      throw std::runtime_error(fmt::format("--metrics-json '{}' cannot be opened for appending: {}; pick a file you can write",
                                           opts_.json_file, errno == ENXIO ? "a FIFO that no process reads" : std::strerror(errno)));
  }
  if (opts_.metrics_port >= 0) {
    try {
      http_ = std::make_unique<rdzv::HttpServer>(io, opts_.metrics_host, opts_.metrics_port, [this](const rdzv::HttpRequest& req) {
        const std::string path = req.target.substr(0, req.target.find('?'));
        if (req.method != "GET" && req.method != "HEAD")
          return rdzv::HttpResponse{405, "text/plain; charset=utf-8", "only GET\n"};
        if (path == "/metrics")
          return rdzv::HttpResponse{200, "text/plain; version=0.0.4; charset=utf-8",
                                    prometheus_text(facts_(), last_ ? &*last_ : nullptr)};
        if (path == "/") return rdzv::HttpResponse{200, "text/plain; charset=utf-8", "mglaunch agent: see /metrics\n"};
        return rdzv::HttpResponse{404, "text/plain; charset=utf-8", "not found: try /metrics\n"};
      }, opts_.metrics_max_connections);
    } catch (const std::exception& e) {
      if (json_fd_ >= 0) ::close(json_fd_);
      throw std::runtime_error(fmt::format("--metrics-port {}: {}; pick a free port or 0", opts_.metrics_port, e.what()));
    }
  }
  Sampler::Options so;
  so.host = opts_.host;
  so.run_id = opts_.run_id;
  so.gpu_probe = std::move(opts_.gpu_probe);
  sampler_ = std::make_unique<Sampler>(io, std::move(so), [this](Sample s) { on_sample(std::move(s)); });
}

AgentMonitor::~AgentMonitor() { stop(); }

int AgentMonitor::metrics_port() const { return http_ ? http_->port() : -1; }

std::string AgentMonitor::metrics_url() const { return http_ ? fmt::format("http://{}/metrics", http_->address()) : ""; }

void AgentMonitor::start() {
  // A first sample at once: the baseline of CPU%, and RSS/GPU figures straight away.
  const AgentFacts f = facts_();
  sampler_->request(f.ranks, f.node_rank, f.round, f.restarts);
  arm();
}

void AgentMonitor::arm() {
  timer_.expires_after(std::chrono::microseconds(static_cast<long>(opts_.interval_s * 1e6)));
  timer_.async_wait([this](boost::system::error_code ec) {
    if (ec || stopped_) return;
    const AgentFacts f = facts_();
    sampler_->request(f.ranks, f.node_rank, f.round, f.restarts);  // skipped while one is in flight
    arm();
  });
}

void AgentMonitor::on_sample(Sample s) {
  if (stopped_) return;
  // The first sample is the baseline of CPU%: written to the JSON file, not printed.
  if (opts_.console_line && !first_) notice_(status_line(s));
  first_ = false;
  if (json_fd_ >= 0) console_.write_file(json_fd_, sample_json(s).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n");
  last_ = std::move(s);
}

void AgentMonitor::stop() {
  if (stopped_) return;
  stopped_ = true;
  timer_.cancel();
  if (http_) http_->stop();
  if (json_fd_ >= 0) console_.close_file(json_fd_);
  json_fd_ = -1;
}

}  // namespace mg::mon
