// ops/monitor.h: the /proc parsers, the process tree, CPU% from two samples, the
// output formats, and the Sampler against the real /proc with a child of this test.
#include <catch2/catch.hpp>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>

#include <boost/asio/io_context.hpp>
#include <boost/asio/steady_timer.hpp>

#include "cli/errors.h"
#include "ops/monitor.h"
#include "launcher/options.h"

using namespace mg;
using namespace mg::mon;

namespace {

ProcEntry entry(pid_t pid, pid_t ppid, pid_t pgrp, std::uint64_t ticks = 0, std::uint64_t rss = 0, char state = 'S',
                std::uint64_t start = 1) {
  ProcEntry e;
  e.stat.pid = pid;
  e.stat.ppid = ppid;
  e.stat.pgrp = pgrp;
  e.stat.state = state;
  e.stat.cpu_ticks = ticks;
  e.stat.starttime = start;
  e.rss_bytes = rss;
  return e;
}

std::set<pid_t> pids_of(const std::vector<const ProcEntry*>& tree) {
  std::set<pid_t> out;
  for (const auto* e : tree) out.insert(e->stat.pid);
  return out;
}

hw::GpuInfo gpu0() {
  hw::GpuInfo g;
  g.index = 0;
  g.name = "Fake H100";
  g.memory_total = 80ull << 30;
  g.memory_used = static_cast<std::uint64_t>(31.25 * (1ull << 30));
  g.utilization_pct = 87;
  g.temperature_c = 64;
  g.power_w = 312.5;
  return g;
}

Sample two_rank_sample() {
  Sample s;
  s.unix_time = 1700000000.5;
  s.host = "node1";
  s.run_id = "job\"7";
  s.restarts = 1;
  RankUsage a;
  a.target = {0, 0, 100, "running"};
  a.processes = 2;
  a.cpu_pct = 150.04;
  a.rss_bytes = 3ull << 29;  // 1.5 GiB
  RankUsage b;
  b.target = {1, 1, 101, "exited"};
  s.ranks = {a, b};
  s.gpus = {gpu0()};
  return s;
}

}  // namespace

TEST_CASE("the /proc reader's parse_proc_stat reads times, flags, parent, group and start of a process whose name holds spaces and parentheses") {
  const std::string text =
      "1234 (my (odd) name) S 1 1200 1200 0 -1 4194560 100 0 0 0 250 50 7 9 20 0 3 0 98765 123456789 300 "
      "18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 0 17 3 0 0 0 0 0\n";
  auto st = mg::parse_proc_stat(text);
  REQUIRE(st);
  CHECK(st->pid == 1234);
  CHECK(st->ppid == 1);
  CHECK(st->pgrp == 1200);
  CHECK(st->state == 'S');
  CHECK(st->flags == 4194560);
  CHECK(st->cpu_ticks == 300);  // utime + stime, not the children's
  CHECK(st->starttime == 98765);
}

TEST_CASE("parse_proc_stat refuses truncated or garbled text") {
  CHECK_FALSE(mg::parse_proc_stat(""));
  CHECK_FALSE(mg::parse_proc_stat("12 (x S 1 2"));
  CHECK_FALSE(mg::parse_proc_stat("12 (x) S 1 2 3"));  // ends before utime
  CHECK_FALSE(mg::parse_proc_stat("abc (x) S 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19"));
}

TEST_CASE("parse_proc_stat reads this process's own /proc/self/stat") {
  std::ifstream in("/proc/self/stat");
  std::stringstream ss;
  ss << in.rdbuf();
  auto st = mg::parse_proc_stat(ss.str());
  REQUIRE(st);
  CHECK(st->pid == ::getpid());
  CHECK(st->ppid == ::getppid());
  CHECK(st->starttime > 0);
}

TEST_CASE("a /proc/PID/status field is found by its whole name, and a size in kB only") {
  constexpr std::string_view status = "Name:\tx\nVmPeak:\t  900 kB\nVmRSS:\t  123456 kB\nRssAnon:\t 5 kB\nVm:\t1 kB\n";
  CHECK(mg::proc_status_bytes(status, "VmRSS") == 123456ull * 1024);
  CHECK(mg::proc_status_bytes(status, "Vm") == 1024);  // not VmPeak's
  CHECK(mg::proc_status_field(status, "Name") == "x");
  CHECK_FALSE(mg::proc_status_bytes("Name:\tkthreadd\nState:\tS (sleeping)\n", "VmRSS"));
  CHECK_FALSE(mg::proc_status_bytes("VmRSS:\t  12 MB\n", "VmRSS"));
}

TEST_CASE("the kernel's ephemeral port range parses from its text, and garbage does not") {
  CHECK(mg::parse_port_range_text("32768\t60999\n") == std::pair{32768, 60999});
  CHECK_FALSE(mg::parse_port_range_text("60999\t32768\n"));
  CHECK_FALSE(mg::parse_port_range_text("1 2 3"));
  CHECK_FALSE(mg::parse_port_range_text(""));
  CHECK(mg::ephemeral_port_range_of_kernel().has_value());
}

TEST_CASE("a worker's tree holds its descendants and its process group, not zombies or strangers") {
  const ProcTable table = {
      entry(50, 1, 50),          // the agent
      entry(100, 50, 100),       // the worker
      entry(101, 100, 100),      // its child
      entry(102, 101, 102),      // a grandchild in a group of its own
      entry(103, 50, 100),       // daemonised (re-parented to the agent) but still in the group
      entry(104, 100, 100, 0, 0, 'Z'),  // a zombie child
      entry(105, 104, 105),      // an orphan of the zombie is not counted either (its parent is dead)
      entry(200, 50, 200),       // another worker
      entry(201, 200, 200),
  };
  CHECK(pids_of(process_tree(table, 100)) == std::set<pid_t>{100, 101, 102, 103});
  CHECK(pids_of(process_tree(table, 200)) == std::set<pid_t>{200, 201});
  CHECK(process_tree(table, 999).empty());
}

TEST_CASE("a reaped worker's pid taken by a stranger is not counted: only its group is its tree") {
  const ProcTable table = {
      entry(50, 1, 50),     // the agent
      entry(100, 1, 100),   // a stranger that got the reaped worker's pid 100 (a group of its own)
      entry(101, 100, 100), // the stranger's child
      entry(103, 50, 300),  // the reaped worker 300's daemon, re-parented to the agent, still in its group
      entry(104, 103, 300),
  };
  CHECK(pids_of(process_tree(table, 300, true)) == std::set<pid_t>{103, 104});
  // The process that has a reaped worker's pid (in another group) is a stranger; while
  // the worker is not reaped, that pid is the worker.
  CHECK(pids_of(process_tree({entry(100, 1, 77), entry(101, 100, 77)}, 100, true)).empty());
  CHECK(pids_of(process_tree({entry(100, 1, 77), entry(101, 100, 77)}, 100, false)) == std::set<pid_t>{100, 101});
}

TEST_CASE("CPU percent counts the ticks each process gained, and all ticks of one born meanwhile") {
  TickMap before = {{{100, 5}, 100}, {{101, 6}, 40}};
  TickMap after = {{{100, 5}, 150}, {{102, 9}, 50}};  // 101 ended, 102 is new
  CHECK(cpu_percent(before, after, 1.0, 100) == Approx(100.0));
  CHECK(cpu_percent(before, after, 2.0, 100) == Approx(50.0));
  // A reused pid with another start time is another process: all its ticks are new.
  TickMap reused = {{{100, 77}, 30}};
  CHECK(cpu_percent(before, reused, 1.0, 100) == Approx(30.0));
  CHECK_FALSE(cpu_percent(before, after, 0.0, 100));
  CHECK_FALSE(cpu_percent(before, after, 1.0, 0));
}

TEST_CASE("measure_ranks sums RSS over the tree and has CPU percent from the second sample on") {
  std::map<pid_t, std::pair<double, TickMap>> previous;
  std::vector<RankTarget> ranks = {{0, 0, 100, "running"}, {1, 1, 200, "running"}};
  ProcTable t1 = {entry(100, 1, 100, 100, 1000), entry(101, 100, 100, 20, 500), entry(200, 1, 200, 0, 10)};
  auto u1 = measure_ranks(t1, ranks, previous, 10.0, 100);
  REQUIRE(u1.size() == 2);
  CHECK(u1[0].processes == 2);
  CHECK(u1[0].rss_bytes == 1500);
  CHECK_FALSE(u1[0].cpu_pct);
  ProcTable t2 = {entry(100, 1, 100, 150, 2000), entry(101, 100, 100, 70, 500), entry(200, 1, 200, 0, 10)};
  auto u2 = measure_ranks(t2, ranks, previous, 10.5, 100);
  REQUIRE(u2[0].cpu_pct);
  CHECK(*u2[0].cpu_pct == Approx(200.0));  // 100 ticks in 0.5 s at 100 Hz
  CHECK(u2[0].rss_bytes == 2500);
  CHECK(*u2[1].cpu_pct == Approx(0.0));
  // A rank that went away is forgotten; its next worker starts without CPU% again.
  auto u3 = measure_ranks(t2, {{0, 0, 300, "running"}}, previous, 11.0, 100);
  CHECK(u3[0].processes == 0);
  CHECK(previous.count(100) == 0);
}

TEST_CASE("GPU memory is attributed to the rank whose process tree computes on that GPU") {
  const ProcTable table = {entry(100, 1, 100), entry(101, 100, 100), entry(200, 1, 200), entry(300, 1, 300)};
  hw::GpuInfo g0 = gpu0(), g1 = gpu0();
  g1.index = 1;
  g0.processes = {{101, 1000}, {200, 500}, {999, 7}};  // 999: someone else's
  g1.processes = {{100, 10}, {101, 20}, {300, std::nullopt}};
  std::vector<RankUsage> ranks(3);
  ranks[0].target = {0, 0, 100, "running"};
  ranks[1].target = {1, 1, 200, "running"};
  ranks[2].target = {2, 2, 300, "running"};
  attribute_gpus(ranks, table, {g0, g1});
  CHECK(ranks[0].gpu_memory == std::map<int, std::optional<std::uint64_t>>{{0, 1000}, {1, 30}});
  CHECK(ranks[1].gpu_memory == std::map<int, std::optional<std::uint64_t>>{{0, 500}});
  CHECK(ranks[2].gpu_memory == std::map<int, std::optional<std::uint64_t>>{{1, std::nullopt}});
  ranks[1].processes = 1;
  CHECK(status_line(Sample{0, "", "", 0, 0, 0, {ranks[1]}, {}, ""}) == "monitor: rank1 --% 0B gpu0:500B");
  CHECK(sample_json(Sample{0, "", "", 0, 0, 0, {ranks[0]}, {}, ""})["ranks"][0]["gpus"] ==
        nlohmann::json::parse(R"([{"index":0,"memory_used_bytes":1000},{"index":1,"memory_used_bytes":30}])"));
  Sample s;
  s.ranks = ranks;
  CHECK_THAT(prometheus_text({}, &s),
             Catch::Contains("mglaunch_worker_gpu_memory_used_bytes{rank=\"0\",local_rank=\"0\",gpu=\"1\"} 30\n"));
  CHECK_THAT(prometheus_text({}, &s), !Catch::Contains("rank=\"2\",local_rank=\"2\",gpu="));  // unknown: no series
}

TEST_CASE("the status line shows each rank's CPU, memory and tree size and each GPU's figures") {
  CHECK(status_line(two_rank_sample()) ==
        "monitor: rank0 150% 1.5G (2 procs) | rank1 exited | gpu0 87% 31.2/80.0G 64C 312W");
  Sample first;
  RankUsage r;
  r.target = {3, 0, 10, "running"};
  r.processes = 1;
  r.rss_bytes = 300 << 20;
  first.ranks = {r};
  CHECK(status_line(first) == "monitor: rank3 --% 300M");
  CHECK(status_line(Sample{}) == "monitor: no workers");
  CHECK(human_bytes(512) == "512B");
  CHECK(human_bytes(12 * 1024) == "12K");
}

TEST_CASE("a sample as JSON has every rank and GPU figure, null where unknown") {
  auto j = sample_json(two_rank_sample());
  CHECK(j["host"] == "node1");
  CHECK(j["restarts"] == 1);
  REQUIRE(j["ranks"].size() == 2);
  CHECK(j["ranks"][0]["cpu_pct"] == 150.0);
  CHECK(j["ranks"][0]["rss_bytes"] == 3ull << 29);
  CHECK(j["ranks"][0]["processes"] == 2);
  CHECK(j["ranks"][1]["cpu_pct"].is_null());
  CHECK(j["ranks"][1]["state"] == "exited");
  REQUIRE(j["gpus"].size() == 1);
  CHECK(j["gpus"][0]["power_w"] == 312.5);
  CHECK(j["gpus"][0]["temperature_c"] == 64);
  CHECK(j["gpus"][0]["memory_total_bytes"] == 80ull << 30);
  CHECK_FALSE(j.contains("gpu_error"));
}

TEST_CASE("the Prometheus text has one family per figure with escaped labels") {
  AgentFacts f;
  f.host = "node1";
  f.run_id = "job\"7";
  f.restarts = 1;
  f.max_restarts = 3;
  f.ranks = {{0, 0, 100, "running"}, {1, 1, 101, "failed"}};
  const Sample s = two_rank_sample();
  const std::string text = prometheus_text(f, &s);
  CHECK_THAT(text, Catch::Contains("mglaunch_agent_info{run_id=\"job\\\"7\",host=\"node1\",node_rank=\"0\"} 1\n"));
  CHECK_THAT(text, Catch::Contains("# TYPE mglaunch_agent_restarts_total counter\nmglaunch_agent_restarts_total 1\n"));
  CHECK_THAT(text, Catch::Contains("mglaunch_agent_workers{state=\"running\"} 1\n"));
  CHECK_THAT(text, Catch::Contains("mglaunch_agent_workers{state=\"failed\"} 1\n"));
  CHECK_THAT(text, Catch::Contains("mglaunch_worker_state{rank=\"1\",local_rank=\"1\",state=\"failed\"} 1\n"));
  CHECK_THAT(text, Catch::Contains("mglaunch_worker_cpu_percent{rank=\"0\",local_rank=\"0\"} 150.04\n"));
  CHECK_THAT(text, Catch::Contains("mglaunch_worker_resident_memory_bytes{rank=\"0\",local_rank=\"0\"} 1610612736\n"));
  CHECK_THAT(text, Catch::Contains("mglaunch_gpu_power_watts{gpu=\"0\",name=\"Fake H100\"} 312.5\n"));
  CHECK_THAT(text, Catch::Contains("mglaunch_gpu_temperature_celsius{gpu=\"0\",name=\"Fake H100\"} 64\n"));
  // Rank 1 has no process left: no usage series for it.
  CHECK_THAT(text, !Catch::Contains("mglaunch_worker_resident_memory_bytes{rank=\"1\""));
  // Before the first sample: the agent's own facts only.
  const std::string early = prometheus_text(f, nullptr);
  CHECK_THAT(early, Catch::Contains("mglaunch_agent_restarts_total 1\n"));
  CHECK_THAT(early, !Catch::Contains("mglaunch_worker_cpu_percent"));
}

TEST_CASE("the fake GPU file of the test seam is parsed, and a bad one is refused with the reason") {
  auto g = parse_gpu_json(R"([{"index":1,"name":"A","memory_total":100,"memory_used":40,"utilization_pct":5,
                             "temperature_c":30,"power_w":70.5,"processes":[{"pid":42,"memory_used":30},{"pid":43}]},
                            {"name":"B"}])");
  REQUIRE(g.size() == 2);
  CHECK(g[0].index == 1);
  CHECK(g[0].memory_used == 40);
  CHECK(*g[0].power_w == 70.5);
  REQUIRE(g[0].processes.size() == 2);
  CHECK(g[0].processes[0].pid == 42);
  CHECK(g[0].processes[0].memory_used == 30u);
  CHECK_FALSE(g[0].processes[1].memory_used);
  CHECK(g[1].index == 1);  // defaults to its position
  CHECK_FALSE(g[1].utilization_pct);
  CHECK_THROWS_WITH(parse_gpu_json("{}"), Catch::Contains("array"));
  CHECK_THROWS_WITH(parse_gpu_json(R"([{"power_w":"hot"}])"), Catch::Contains("GPU 0"));
}

TEST_CASE("the monitoring flags parse, and bad values are usage errors that name the flag") {
  HardwareProbe probe{[] { return 0; }, [] { return 4; }};
  auto parse = [&](std::vector<std::string> args) {
    args.insert(args.begin(), "mglaunch");
    args.push_back("train.py");
    return *parse_agent_args(args, {}, probe).options;
  };
  auto plain = parse({});
  CHECK(plain.monitor_s == 0);
  CHECK(plain.metrics_port == -1);
  CHECK(plain.trace_file.empty());
  CHECK(parse({"--monitor"}).monitor_s == 5);
  CHECK(parse({"--monitor=0.5"}).monitor_s == 0.5);
  // A bare --monitor never takes the program for its value.
  auto bare = parse({"--monitor"});
  CHECK(bare.program == "train.py");
  auto all = parse({"--metrics-port", "0", "--metrics-json", "m.jsonl", "--trace", "t.json"});
  CHECK(all.metrics_port == 0);
  CHECK(all.metrics_host == "127.0.0.1");
  CHECK(all.metrics_json == "m.jsonl");
  CHECK(all.trace_file == "t.json");
  CHECK_THROWS_AS(parse({"--monitor=0"}), UsageError);
  CHECK_THROWS_WITH(parse({"--monitor=fast"}), Catch::Contains("--monitor"));
  CHECK_THROWS_WITH(parse({"--metrics-port", "70000"}), Catch::Contains("--metrics-port"));
}

TEST_CASE("the sampler measures a real child's CPU and memory off the event loop") {
  constexpr std::size_t kBytes = 48u << 20;
  int ready[2];
  REQUIRE(::pipe(ready) == 0);
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    char* p = static_cast<char*>(std::malloc(kBytes));
    for (std::size_t at = 0; at < kBytes; at += 4096) p[at] = 1;
    char c = 1;
    if (::write(ready[1], &c, 1) != 1) ::_exit(1);
    volatile unsigned long spin = 0;
    for (;;) spin = spin + 1;  // until killed
  }
  struct Reap {
    pid_t pid;
    ~Reap() {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
    }
  } reap{child};
  ::close(ready[1]);
  char c = 0;
  REQUIRE(::read(ready[0], &c, 1) == 1);
  ::close(ready[0]);

  boost::asio::io_context io;
  std::vector<Sample> samples;
  Sampler::Options so;
  so.host = "here";
  so.gpu_probe = make_gpu_probe("");  // NVML, or an error saying there is none
  Sampler sampler(io, std::move(so), [&](Sample s) {
    samples.push_back(std::move(s));
    io.stop();
  });
  auto take = [&] {
    REQUIRE(sampler.request({{0, 0, child, "running"}}, 0, 0, 0));
    CHECK_FALSE(sampler.request({{0, 0, child, "running"}}, 0, 0, 0));  // one in flight at a time
    boost::asio::steady_timer guard(io, std::chrono::seconds(30));
    guard.async_wait([&](boost::system::error_code ec) {
      if (!ec) io.stop();
    });
    io.restart();
    io.run();
  };
  take();
  boost::asio::steady_timer pause(io, std::chrono::milliseconds(300));
  pause.wait();
  take();
  REQUIRE(samples.size() == 2);
  REQUIRE(samples[1].ranks.size() == 1);
  const auto& r = samples[1].ranks[0];
  CHECK(r.processes == 1);
  CHECK(r.rss_bytes >= kBytes);
  CHECK_FALSE(samples[0].ranks[0].cpu_pct);
  REQUIRE(r.cpu_pct);
  CHECK(*r.cpu_pct > 0);  // it spins; how much depends on the machine's load
  CHECK(samples[1].host == "here");
  CHECK((!samples[1].gpus.empty() || !samples[1].gpu_error.empty()));
}
