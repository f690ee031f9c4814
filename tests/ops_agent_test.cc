// The agent's monitoring and operations flags with the real mglaunch and fake_worker:
// --monitor's console line, --metrics-json, /metrics (checked by promtool) and the
// --trace timeline of a run with a restart. GPU figures come from the fake GPU probe of
// the test seam MGLAUNCH_TEST_GPU_JSON.
#include <catch2/catch.hpp>

#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <regex>

#include <nlohmann/json.hpp>

#include "support/proc.h"
#include "support/rdzv_fixture.h"
#include "support/skip.h"

using namespace mgtest;
using namespace std::chrono_literals;

namespace {

// Two fake GPUs for the agent's GPU probe (MGLAUNCH_TEST_GPU_JSON).
std::string write_fake_gpus(const std::string& dir) {
  const std::string path = dir + "/gpus.json";
  std::ofstream(path) << R"([{"index":0,"name":"Fake H100","memory_total":85899345920,"memory_used":33554432000,
    "utilization_pct":87,"temperature_c":64,"power_w":312.5},
   {"index":1,"name":"Fake H100","memory_total":85899345920,"memory_used":1073741824,
    "utilization_pct":3,"temperature_c":41,"power_w":71.0}])";
  return path;
}

// GET http://127.0.0.1:port/path: the body of a 200 response, "" otherwise.
std::string http_get(int port, const std::string& path) {
  const std::string r = http_request(port, path);
  return r.rfind("HTTP/1.1 200", 0) == 0 ? body_of(r) : "";
}

// The value of the first series whose line starts with `series` ("name{labels}"), or -1.
double metric(const std::string& text, const std::string& series) {
  for (const auto& l : split_lines(text))
    if (l.rfind(series + " ", 0) == 0) return std::stod(l.substr(series.size() + 1));
  return -1;
}

// The port of "[mglaunch] metrics on http://127.0.0.1:PORT/metrics", 0 until printed.
int metrics_port_of(const Proc& p) {
  static const std::regex re(R"(\[mglaunch\] metrics on http://127\.0\.0\.1:([0-9]+)/metrics)");
  std::smatch m;
  const std::string err = p.err();
  return std::regex_search(err, m, re) ? std::stoi(m[1]) : 0;
}

}  // namespace

TEST_CASE("agent --monitor prints each rank's CPU, memory and process count and the GPUs, and --metrics-json keeps every sample") {
  const std::string dir = make_temp_dir();
  const std::string json = dir + "/metrics.jsonl";
  // Each worker holds 64 MiB, forks a child that shares them (a tree of 2), then keeps a CPU busy.
  auto r = run(launch({"--nproc_per_node=2", "--monitor=0.2", "--metrics-json", json},
                      {"alloc", "64", "spawn-child", "group", dir + "/children", "burn", "2"}),
               {{"MGLAUNCH_TEST_GPU_JSON", write_fake_gpus(dir)}});
  INFO(r.err);
  REQUIRE(r.code == 0);
  std::vector<std::string> lines;
  for (const auto& l : split_lines(r.err))
    if (l.rfind("[mglaunch] monitor: ", 0) == 0) lines.push_back(l);
  REQUIRE(lines.size() >= 2);
  static const std::regex busy_line(
      R"(\[mglaunch\] monitor: rank0 [0-9]+% [0-9.]+[MG] \(2 procs\) \| rank1 [0-9]+% [0-9.]+[MG] \(2 procs\) \| )"
      R"(gpu0 87% 31\.2/80\.0G 64C 312W \| gpu1 3% 1\.0/80\.0G 41C 71W)");
  CHECK(std::any_of(lines.begin(), lines.end(), [](const std::string& l) { return std::regex_match(l, busy_line); }));

  std::vector<nlohmann::json> samples;
  for (const auto& l : split_lines(read_file(json)))
    if (!l.empty()) samples.push_back(nlohmann::json::parse(l));
  REQUIRE(samples.size() >= lines.size());  // the JSON file also has the first (baseline) sample
  bool tree_seen = false;
  for (const auto& s : samples) {
    REQUIRE(s["gpus"].size() == 2);
    CHECK(s["gpus"][0]["power_w"] == 312.5);
    CHECK(s["gpus"][1]["utilization_pct"] == 3);
    REQUIRE(s["ranks"].size() == 2);
    for (const auto& rk : s["ranks"]) {
      // Both processes of the tree count: each holds the 64 MiB (shared after the fork).
      if (rk["processes"] == 2 && rk["rss_bytes"].get<std::uint64_t>() >= 2 * (64ull << 20) &&
          rk["cpu_pct"].is_number() && rk["cpu_pct"].get<double>() > 0)
        tree_seen = true;
    }
  }
  CHECK(tree_seen);
  CHECK(samples.back()["time"].get<double>() > samples.front()["time"].get<double>());
}

TEST_CASE("without the monitoring flags the agent starts no sampler thread and prints no monitor line") {
  const std::string dir = make_temp_dir();
  // The number of threads of a running agent, its stderr once it ended.
  auto threads_of = [&](const std::vector<std::string>& flags, const std::string& tag) {
    Proc p = spawn(launch(flags, {"pidfile", dir + "/" + tag, "wait-file", dir + "/go_" + tag}));
    REQUIRE(eventually([&] { return !read_file(dir + "/" + tag).empty(); }, 20s));
    std::size_t n = 0;
    for ([[maybe_unused]] const auto& t : std::filesystem::directory_iterator("/proc/" + std::to_string(p.pid) + "/task"))
      ++n;
    std::ofstream(dir + "/go_" + tag).put('\n');
    REQUIRE(p.wait(30s));
    CHECK(p.exit_code() == 0);
    return std::make_pair(n, p.err());
  };
  const auto [plain, plain_err] = threads_of({}, "plain");
  const auto [monitored, monitored_err] = threads_of({"--monitor=60"}, "monitored");
  CHECK(monitored == plain + 1);  // the sampler's thread, and only when asked for
  CHECK_THAT(plain_err, !Catch::Contains("monitor:"));
  CHECK_THAT(plain_err, !Catch::Contains("metrics on"));
}

TEST_CASE("agent --metrics-port serves per-rank, GPU and restart figures that promtool accepts, on loopback") {
  require_program("/usr/bin/promtool", "prometheus");
  const std::string dir = make_temp_dir();
  // Attempt 0: rank 0 fails and the group restarts; attempt 1: both hold 32 MiB until released.
  Proc agent = spawn(launch({"--nproc_per_node=2", "--max_restarts=1", "--grace=5", "--metrics-port", "0",
                             "--monitor=0.2"},
                            {"fail-first-attempt", "0", "3", "alloc", "32", "pidfile", dir + "/pid_${local_rank}",
                             "wait-file", dir + "/release"}),
                     {{"MGLAUNCH_TEST_GPU_JSON", write_fake_gpus(dir)}});
  REQUIRE(eventually([&] { return metrics_port_of(agent) > 0; }, 20s));
  const int port = metrics_port_of(agent);
  std::string text;
  // After the restart, per-rank figures appear once a sample of the new workers has CPU%.
  REQUIRE(eventually(
      [&] {
        text = http_get(port, "/metrics");
        return metric(text, "mglaunch_agent_restarts_total") == 1 &&
               metric(text, "mglaunch_worker_cpu_percent{rank=\"1\",local_rank=\"1\"}") >= 0 &&
               metric(text, "mglaunch_worker_resident_memory_bytes{rank=\"0\",local_rank=\"0\"}") >= 32 << 20;
      },
      30s));
  // Per-rank GPU memory: the fake NVML now shows each worker of attempt 1 computing on "its" GPU.
  // The workers of attempt 1: the last pid each local rank wrote, once it is a living one
  // (attempt 0's were reaped before the restart was counted).
  auto last_pid = [&](int local_rank) -> std::string {
    auto l = split_lines(read_file(dir + "/pid_" + std::to_string(local_rank)));
    while (!l.empty() && l.back().empty()) l.pop_back();
    return !l.empty() && pid_alive(std::stoi(l.back())) ? l.back() : "";
  };
  REQUIRE(eventually([&] { return !last_pid(0).empty() && !last_pid(1).empty(); }, 20s));
  std::ofstream(dir + "/gpus.tmp") << R"([{"index":0,"name":"Fake H100","memory_total":85899345920,"memory_used":33554432000,
      "utilization_pct":87,"temperature_c":64,"power_w":312.5,"processes":[{"pid":)" << last_pid(0) << R"(,"memory_used":32212254720}]},
    {"index":1,"name":"Fake H100","memory_total":85899345920,"memory_used":1073741824,
      "utilization_pct":3,"temperature_c":41,"power_w":71.0,"processes":[{"pid":)" << last_pid(1) << R"(,"memory_used":1048576000},{"pid":1,"memory_used":5}]}])";
  std::filesystem::rename(dir + "/gpus.tmp", dir + "/gpus.json");
  REQUIRE(eventually(
      [&] {
        text = http_get(port, "/metrics");
        return metric(text, "mglaunch_worker_gpu_memory_used_bytes{rank=\"1\",local_rank=\"1\",gpu=\"1\"}") >= 0;
      },
      30s));
  INFO(text);
  CHECK(metric(text, "mglaunch_worker_gpu_memory_used_bytes{rank=\"0\",local_rank=\"0\",gpu=\"0\"}") == 32212254720.0);
  CHECK(metric(text, "mglaunch_worker_gpu_memory_used_bytes{rank=\"1\",local_rank=\"1\",gpu=\"1\"}") == 1048576000.0);
  CHECK(metric(text, "mglaunch_worker_gpu_memory_used_bytes{rank=\"0\",local_rank=\"0\",gpu=\"1\"}") == -1);
  CHECK(metric(text, "mglaunch_agent_max_restarts") == 1);
  CHECK(metric(text, "mglaunch_agent_workers{state=\"running\"}") == 2);
  CHECK(metric(text, "mglaunch_worker_state{rank=\"0\",local_rank=\"0\",state=\"running\"}") == 1);
  CHECK(metric(text, "mglaunch_worker_processes{rank=\"1\",local_rank=\"1\"}") == 1);
  CHECK(metric(text, "mglaunch_gpu_power_watts{gpu=\"0\",name=\"Fake H100\"}") == 312.5);
  CHECK(metric(text, "mglaunch_gpu_temperature_celsius{gpu=\"1\",name=\"Fake H100\"}") == 41);
  CHECK(metric(text, "mglaunch_gpu_memory_used_bytes{gpu=\"1\",name=\"Fake H100\"}") == 1073741824);
  CHECK(http_get(port, "/nothing").empty());
  {
    const std::string file = dir + "/metrics.txt";
    std::ofstream(file) << text;
    auto check = run({"/bin/sh", "-c", "/usr/bin/promtool check metrics < \"$0\"", file});
    INFO(check.out << check.err);
    CHECK(check.code == 0);
  }
  std::ofstream(dir + "/release").put('\n');
  REQUIRE(agent.wait(30s));
  CHECK(agent.exit_code() == 0);
  CHECK(connect_loopback(port) < 0);  // the endpoint ends with the run
}

TEST_CASE("agent --metrics-port on a port already taken is a usage error that names the flag, before any worker runs") {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  REQUIRE(::listen(fd, 1) == 0);
  socklen_t len = sizeof a;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  const int port = ntohs(a.sin_port);
  const std::string dir = make_temp_dir();
  auto r = run(launch({"--metrics-port", std::to_string(port)}, {"pidfile", dir + "/ran"}));
  ::close(fd);
  CHECK(r.code == 2);
  CHECK_THAT(r.err, Catch::StartsWith("mglaunch: error: --metrics-port " + std::to_string(port) + ":"));
  CHECK(split_lines(r.err).size() == 1);
  CHECK_FALSE(std::filesystem::exists(dir + "/ran"));
}

TEST_CASE("agent --trace writes a Chrome trace of spawns, exits, the stop signal, the restart and the exit in order") {
  const std::string dir = make_temp_dir();
  const std::string trace = dir + "/trace.json";
  // Attempt 0: rank 0 exits 3, rank 1 hangs until the agent's SIGTERM; attempt 1: both exit 0.
  auto r = run(launch({"--nproc_per_node=2", "--max_restarts=1", "--grace=10", "--trace", trace},
                      {"when-restart-below", "1", "when-rank", "0", "exit", "3"}));
  INFO(r.err);
  REQUIRE(r.code == 0);
  const auto events = nlohmann::json::parse(read_file(trace));  // the whole file is one JSON array
  REQUIRE(events.is_array());
  int agent_pid = -1;
  std::vector<nlohmann::json> timed;
  for (const auto& e : events) {
    REQUIRE(e.contains("ph"));
    REQUIRE(e.contains("pid"));
    if (e["ph"] == "M" && e["name"] == "process_name") agent_pid = e["pid"];
    if (e["ph"] != "M") timed.push_back(e);
  }
  REQUIRE(agent_pid > 0);
  // Order by time; an instant and a span's end at the same microsecond keep the file's order.
  auto end_of = [](const nlohmann::json& e) {
    return e["ts"].get<std::int64_t>() + (e["ph"] == "X" ? e["dur"].get<std::int64_t>() : 0);
  };
  std::stable_sort(timed.begin(), timed.end(), [&](const auto& a, const auto& b) { return end_of(a) < end_of(b); });
  std::vector<std::string> names;
  for (const auto& e : timed) names.push_back(e["name"].get<std::string>() + (e["ph"] == "X" ? " end" : ""));
  auto find = [&](const std::string& name, std::size_t from = 0) {
    auto it = std::find(names.begin() + static_cast<long>(from), names.end(), name);
    return static_cast<std::size_t>(it - names.begin());
  };
  INFO(nlohmann::json(names).dump());
  const std::size_t spawn0 = find("spawn rank 0"), spawn1 = find("spawn rank 1");
  const std::size_t fail0 = find("rank 0 end");
  const std::size_t term = find("send SIGTERM to the workers");
  const std::size_t stopped1 = find("rank 1 end");
  const std::size_t attempt0 = find("attempt 0 end");
  const std::size_t restart = find("restart");
  const std::size_t respawn0 = find("spawn rank 0", spawn0 + 1), respawn1 = find("spawn rank 1", spawn1 + 1);
  const std::size_t attempt1 = find("attempt 1 end");
  const std::size_t exit = find("exit");
  REQUIRE(exit < names.size());
  CHECK(spawn0 < fail0);
  CHECK(spawn1 < fail0);
  CHECK(fail0 < term);
  CHECK(term < stopped1);
  CHECK(stopped1 < attempt0);
  CHECK(attempt0 < restart);
  CHECK(restart < respawn0);
  CHECK(restart < respawn1);
  CHECK(respawn0 < attempt1);
  CHECK(attempt1 < exit);
  CHECK(exit == names.size() - 1);
  // The figures in the events: who failed how, who was stopped by which signal.
  for (const auto& e : timed) {
    if (e["name"] == "rank 0" && e["args"]["attempt"] == 0) CHECK(e["args"]["exit_code"] == 3);
    if (e["name"] == "rank 1" && e["args"]["attempt"] == 0) {
      CHECK(e["args"]["signal"] == 15);
      CHECK(e["args"]["stopped_by_agent"] == true);
      CHECK(e["tid"] == 2);  // local rank 1's track
    }
    if (e["name"] == "restart") CHECK(e["args"]["restart_count"] == 1);
    if (e["name"] == "exit") CHECK(e["args"]["exit_code"] == 0);
    CHECK(e["pid"] == agent_pid);
  }
}

TEST_CASE("agent --trace of a 2-node job with a restart shows each rendezvous round, the restart and the rounds' workers in order") {
  Daemon d = start_daemon();
  const std::string dir = make_temp_dir();
  // Global rank 0 fails in the first attempt; the rendezvous restarts both nodes into round 2.
  const std::vector<std::string> worker = {"fail-first-attempt", "0", "3", "print", "ok"};
  Proc a = spawn(agent_argv(d.endpoint, "traced", 2, "2", 1, {"--max_restarts=1", "--trace", dir + "/a.json"}, worker));
  Proc b = spawn(agent_argv(d.endpoint, "traced", 3, "2", 1, {"--max_restarts=1", "--trace", dir + "/b.json"}, worker));
  REQUIRE(a.wait(60s));
  REQUIRE(b.wait(60s));
  INFO(a.err() << b.err());
  REQUIRE(a.exit_code() == 0);
  REQUIRE(b.exit_code() == 0);
  for (const char* f : {"/a.json", "/b.json"}) {
    INFO(f);
    const auto events = nlohmann::json::parse(read_file(dir + f));
    std::int64_t round1_end = -1, round2_start = -1, round2_end = -1, restart = -1, exit = -1;
    std::vector<std::int64_t> spawns;
    for (const auto& e : events) {
      const std::string name = e["name"];
      if (name == "rendezvous round 1" || name == "rendezvous round 2") {
        CHECK(e["cat"] == "rendezvous");
        CHECK(e["args"]["nnodes"] == 2);
        CHECK(e["args"]["world_size"] == 2);
        CHECK(e["args"]["restart_count"] == (name == "rendezvous round 1" ? 0 : 1));
        const std::int64_t ts = e["ts"], end = ts + e["dur"].get<std::int64_t>();
        if (name == "rendezvous round 1") round1_end = end;
        else round2_start = ts, round2_end = end;
      }
      if (name == "restart") {
        CHECK(e["args"]["by"] == "rendezvous");
        CHECK(e["args"]["restart_count"] == 1);
        restart = e["ts"];
      }
      if (name.rfind("spawn rank", 0) == 0) spawns.push_back(e["ts"]);
      if (name == "exit") exit = e["ts"];
    }
    REQUIRE(spawns.size() == 2);  // one worker per round
    CHECK(round1_end >= 0);
    CHECK(round1_end <= spawns[0]);
    CHECK(spawns[0] <= restart);
    CHECK(restart <= round2_start);
    CHECK(round2_end <= spawns[1]);
    CHECK(spawns[1] <= exit);
  }
  ::kill(d.proc.pid, SIGTERM);
  CHECK(d.proc.wait(10s));
}

TEST_CASE("agent --trace records the signal the agent got, the one it sent and the exit code it ended with") {
  const std::string dir = make_temp_dir();
  const std::string trace = dir + "/trace.json";
  Proc agent = spawn(launch({"--nproc_per_node=1", "--trace", trace}, {"pidfile", dir + "/pid", "hang", "60"}));
  REQUIRE(eventually([&] { return !read_file(dir + "/pid").empty(); }, 20s));
  ::kill(agent.pid, SIGTERM);
  REQUIRE(agent.wait(30s));
  CHECK(agent.exit_code() == 143);
  std::vector<std::string> names;
  std::int64_t last_ts = -1;
  for (const auto& e : nlohmann::json::parse(read_file(trace))) {
    if (e["ph"] != "i") continue;  // the instants, in the order they happened
    CHECK(e["ts"].get<std::int64_t>() >= last_ts);
    last_ts = e["ts"];
    names.push_back(e["name"]);
    if (e["name"] == "exit") CHECK(e["args"]["exit_code"] == 143);
    if (e["name"] == "got SIGTERM") CHECK(e["args"]["signal"] == 15);
  }
  CHECK(names == std::vector<std::string>{"spawn rank 0", "got SIGTERM", "send SIGTERM to the workers", "exit"});
}

TEST_CASE("a real Prometheus scrapes the agent and reads back a rank's memory and a GPU's power") {
  require_program("/usr/bin/prometheus", "prometheus");
  const std::string dir = make_temp_dir();
  Proc agent = spawn(launch({"--nproc_per_node=2", "--metrics-port", "0", "--monitor=0.5"},
                            {"alloc", "32", "hang", "300"}),  // however long Prometheus takes to start
                     {{"MGLAUNCH_TEST_GPU_JSON", write_fake_gpus(dir)}});
  REQUIRE(eventually([&] { return metrics_port_of(agent) > 0; }, 20s));
  std::ofstream(dir + "/prometheus.yml") << "global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: agent\n"
                                          << "    static_configs:\n      - targets: ['127.0.0.1:" << metrics_port_of(agent)
                                          << "']\n";
  Proc prom = spawn({"/usr/bin/prometheus", "--config.file=" + dir + "/prometheus.yml",
                     "--storage.tsdb.path=" + dir + "/data", "--web.listen-address=127.0.0.1:0"});
  int port = 0;
  REQUIRE(eventually(
      [&] {
        std::smatch match;
        const std::string err = prom.err();
        static const std::regex listening("msg=\"Listening on\" address=127\\.0\\.0\\.1:([0-9]+)");
        if (!std::regex_search(err, match, listening)) return false;
        port = std::stoi(match[1]);
        return true;
      },
      60s));
  // The value of `query`'s series whose label `label` is `value`, "" until Prometheus has it.
  auto query = [&](const std::string& q, const std::string& label, const std::string& want) -> std::string {
    auto j = nlohmann::json::parse(http_get(port, "/api/v1/query?query=" + q), nullptr, false);
    if (j.is_discarded() || j["status"] != "success") return "";
    for (const auto& r : j["data"]["result"])
      if (r["metric"].value(label, "") == want) return r["value"][1].get<std::string>();
    return "";
  };
  std::string rss, power;
  CHECK(eventually([&] { return !(rss = query("mglaunch_worker_resident_memory_bytes", "rank", "1")).empty(); }, 60s));
  CHECK(eventually([&] { return !(power = query("mglaunch_gpu_power_watts", "gpu", "0")).empty(); }, 60s));
  CHECK(!rss.empty());
  if (!rss.empty()) CHECK(std::stod(rss) >= 32 << 20);
  CHECK(power == "312.5");
  ::kill(prom.pid, SIGTERM);
  prom.wait(20s);
  ::kill(agent.pid, SIGTERM);
  REQUIRE(agent.wait(30s));
  CHECK(agent.exit_code() == 143);
}

TEST_CASE("agent --trace and --metrics-json files that cannot be written are usage errors before any worker runs") {
  const std::string dir = make_temp_dir();
  for (const std::string flag : {"--trace", "--metrics-json"}) {
    auto r = run(launch({flag, dir + "/no/such/dir/file"}, {"pidfile", dir + "/ran"}));
    CHECK(r.code == 2);
    CHECK_THAT(r.err, Catch::StartsWith("mglaunch: error: " + flag + " '" + dir + "/no/such/dir/file'"));
    CHECK(split_lines(r.err).size() == 1);
  }
  // A FIFO that no process reads would block open(2) for ever: refused at once instead.
  const std::string fifo = dir + "/fifo";
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  for (const std::string flag : {"--trace", "--metrics-json"}) {
    auto r = run(launch({flag, fifo}, {"pidfile", dir + "/ran"}), {}, 60s);
    CHECK(r.code == 2);
    CHECK_THAT(r.err, Catch::Contains("a FIFO that no process reads"));
  }
  CHECK_FALSE(std::filesystem::exists(dir + "/ran"));
}
