// torch 2.x's flags and variables (#25, docs/flags.md) on the real mglaunch binary
// with real fake_worker processes: what a user sees on the console and finds in the files.
#include <catch2/catch.hpp>

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <set>

#include <nlohmann/json.hpp>

#include "support/proc.h"
#include "support/skip.h"

using namespace mgtest;
using namespace std::chrono_literals;
namespace fs = std::filesystem;

namespace {

std::multiset<std::string> line_set(const std::string& text) {
  auto lines = split_lines(text);
  return {lines.begin(), lines.end()};
}

}  // namespace

TEST_CASE("torch 2.x: --rdzv_conf takes torchrun's keys, warns once about an unknown one and reads a quoted value") {
  // The Done-when line: accepted, no warning.
  auto ok = run(launch({"--standalone", "--rdzv_conf=use_libuv=0,read_timeout=60"}, {"print", "hi"}));
  CHECK(ok.code == 0);
  CHECK(ok.out == "[rank0]:hi\n");
  CHECK(count_of(ok.err, "warning") == 0);
  // A typo: one warning line on stderr naming the nearest key, and the run goes on.
  auto typo = run(launch({"--standalone", "--rdzv-conf=join_timout=5"}, {"print", "hi"}));
  INFO(typo.err);
  CHECK(typo.code == 0);
  CHECK(typo.out == "[rank0]:hi\n");
  CHECK(count_of(typo.err, "mglaunch: warning: --rdzv_conf key 'join_timout' is not one mglaunch or torchrun knows "
                           "(did you mean 'join_timeout'?); ignored\n") == 1);
  CHECK(count_of(typo.err, "warning") == 1);
  // As PyTorch's test_run.py passes it: the quotes are inside the value.
  auto quoted = run(launch({"--standalone", "--rdzv-conf='join_timeout=5,last_call_timeout=1,timeout=5'"},
                           {"print", "hi"}));
  CHECK(quoted.code == 0);
  CHECK(count_of(quoted.err, "warning") == 0);
  // The same through torchrun's environment variable.
  auto pet = run(launch({"--standalone"}, {"print", "hi"}), {{"PET_RDZV_CONF", "keep_alive_intervall=5"}});
  CHECK(pet.code == 0);
  CHECK(count_of(pet.err, "(did you mean 'keep_alive_interval'?)") == 1);
}

TEST_CASE("torch 2.x: TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE sets the line prefix, with ${hostname} and ${pid}") {
  auto r = run(launch({"--standalone"}, {"print", "hi"}), {{"TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", "[rank${rank}]: "}});
  CHECK(r.code == 0);
  CHECK(r.out == "[rank0]: hi\n");
  const std::string pidfile = make_temp_dir() + "/pids";
  char host[256] = {};
  REQUIRE(::gethostname(host, sizeof(host) - 1) == 0);
  auto p = run(launch({"--standalone", "--log-line-prefix-template=[${hostname}:${pid}] "}, {"pidfile", pidfile, "print", "hi"}));
  CHECK(p.code == 0);
  const auto pids = read_pids(pidfile);
  REQUIRE(pids.size() == 1);
  CHECK(p.out == "[" + std::string(host) + ":" + std::to_string(pids[0]) + "] hi\n");
}

TEST_CASE("torch 2.x: --redirects with --tee sends the tee'd streams to the console and the files") {
  const std::string dir = make_temp_dir();
  auto r = run(launch({"--nproc_per_node=2", "--master_port=0", "--rdzv_id=rt", "--log_dir", dir, "-r", "3", "-t", "1"},
                      {"print", "out${local_rank}", "eprint", "err${local_rank}"}));
  CHECK(r.code == 0);
  CHECK(line_set(r.out) == std::multiset<std::string>{"[rank0]:out0", "[rank1]:out1"});
  CHECK(count_of(r.err, "err") == 0);  // stderr is redirected and not tee'd: the files only
  for (int lr = 0; lr < 2; ++lr) {
    const std::string base = dir + "/rt/attempt_0/" + std::to_string(lr) + "/";
    CHECK(read_file(base + "stdout.log") == "out" + std::to_string(lr) + "\n");
    CHECK(read_file(base + "stderr.log") == "err" + std::to_string(lr) + "\n");
  }
}

TEST_CASE("torch 2.x: duplicate filters copy the matching lines of tee'd ranks to the attempt's filtered logs") {
  const std::string dir = make_temp_dir();
  auto r = run(launch({"--nproc_per_node=2", "--master_port=0", "--rdzv_id=dup", "--log_dir", dir, "--tee=3",
                       "--duplicate-stdout-filters=apple,orange,,pear", "--duplicate_stderr_filters=loss"},
                      {"print", "apple ${local_rank}", "print", "kiwi", "print", "orange,pear ${local_rank}", "eprint",
                       "loss=${local_rank}", "eprint", "orange"}));
  CHECK(r.code == 0);
  CHECK(count_of(r.out, "kiwi") == 2);  // the console still gets every line
  const std::string attempt = dir + "/dup/attempt_0/";
  CHECK(line_set(read_file(attempt + "filtered_stdout.log")) ==
        std::multiset<std::string>{"[rank0]:apple 0", "[rank1]:apple 1", "[rank0]:orange,pear 0",
                                   "[rank1]:orange,pear 1"});
  CHECK(line_set(read_file(attempt + "filtered_stderr.log")) ==
        std::multiset<std::string>{"[rank0]:loss=0", "[rank1]:loss=1"});
}

TEST_CASE("torch 2.x: --virtual-local-rank gives every worker LOCAL_RANK=0 and its own GPU") {
  auto r = run(launch({"--standalone", "--nproc_per_node=2", "--virtual-local-rank"}, {"env"}),
               {{"CUDA_VISIBLE_DEVICES", "5,7"}});
  REQUIRE(r.code == 0);
  std::set<std::string> devices;
  for (const auto& line : split_lines(r.out)) {
    const auto j = nlohmann::json::parse(line.substr(line.find(':') + 1));
    CHECK(j["LOCAL_RANK"] == "0");
    devices.insert(j["CUDA_VISIBLE_DEVICES"].get<std::string>());
  }
  CHECK(devices == std::set<std::string>{"5", "7"});
}

TEST_CASE("torch 2.x: --shutdown-timeout and TORCH_ELASTIC_SHUTDOWN_TIMEOUT set the time from SIGTERM to SIGKILL") {
  auto stop = [](const std::vector<std::string>& flags, const std::map<std::string, std::string>& env) {
    const std::string pidfile = make_temp_dir() + "/pids";
    std::vector<std::string> all = {"--standalone", "--nproc_per_node=1"};
    all.insert(all.end(), flags.begin(), flags.end());
    Proc agent = spawn(launch(all, {"ignore-term", "pidfile", pidfile, "hang", "60"}), env);
    REQUIRE(eventually([&] { return read_pids(pidfile).size() == 1; }, 30s));
    ::kill(agent.pid, SIGTERM);
    REQUIRE(agent.wait(50s));  // well under the 60 s of --grace
    CHECK(agent.exit_code() == 128 + SIGTERM);
    for (pid_t p : read_pids(pidfile)) CHECK_FALSE(pid_alive(p));
    return agent.err();
  };
  CHECK_THAT(stop({"--grace=60", "--shutdown-timeout=0.2"}, {}), Catch::Contains("still running 0.2s after"));
  CHECK_THAT(stop({}, {{"TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "0.2"}}), Catch::Contains("still running 0.2s after"));
}

TEST_CASE("torch 2.x: --signals-to-handle, --event-log-handler, --logs-specs and --numa-binding take torchrun's values") {
  auto check_usage = [](std::vector<std::string> flags, const std::string& needle) {
    auto r = run(launch(flags, {"print", "hi"}));
    INFO(r.err);
    CHECK(r.code == 2);
    CHECK(count_of(r.err, "\n") == 1);
    CHECK_THAT(r.err, Catch::StartsWith("mglaunch: error: ") && Catch::Contains(needle));
  };
  check_usage({"--standalone", "--signals-to-handle=SIGTERM,SIGBOGUS"}, "'SIGBOGUS' is no signal name");
  check_usage({"--standalone", "--event-log-handler=scuba"}, "use null or console");
  check_usage({"--standalone", "--logs-specs=mine"}, "Could not find entrypoint under 'torchrun.logs_specs[mine]' key");
  check_usage({"--standalone", "--numa-binding=rack"}, "use node, socket, exclusive or core-complex");
  for (std::vector<std::string> flags : {std::vector<std::string>{"--signals-to-handle=SIGTERM,SIGUSR1"},
                                         {"--event-log-handler=console"},
                                         {"--logs-specs=default"}}) {
    flags.insert(flags.begin(), "--standalone");
    auto r = run(launch(flags, {"print", "hi"}));
    CHECK(r.code == 0);
    CHECK(r.out == "[rank0]:hi\n");
  }
  if (fs::exists("/sys/devices/system/cpu/cpu0/topology/physical_package_id")) {
    auto r = run(launch({"--standalone", "--numa-binding=socket", "--dry-run"}, {"print", "hi"}));
    REQUIRE(r.code == 0);
    CHECK_THAT(nlohmann::json::parse(r.out)["workers"][0]["binding"].get<std::string>(),
               Catch::StartsWith("local_rank 0: cpus "));
  }
}

namespace {
// The event lines of `err` (JSON objects starting with {"name": ), parsed.
std::vector<nlohmann::json> events_of(const std::string& err) {
  std::vector<nlohmann::json> out;
  for (const auto& l : split_lines(err))
    if (l.rfind("{\"name\": ", 0) == 0) out.push_back(nlohmann::json::parse(l));
  return out;
}
}  // namespace

TEST_CASE("torch 2.x: --event-log-handler console prints the agent's elastic events as torch's Event lines, null "
          "prints none") {
  const std::string dir = make_temp_dir();
  // Attempt 0: rank 1 fails; attempt 1 succeeds.
  auto r = run(launch({"--standalone", "--nproc_per_node=2", "--max_restarts=1", "--event-log-handler=console"},
                      {"fail-first-attempt", "1", "3"}));
  INFO(r.err);
  REQUIRE(r.code == 0);
  const auto ev = events_of(r.err);
  REQUIRE(ev.size() == 5);
  std::vector<std::string> names;
  for (const auto& e : ev) names.push_back(e["source"].get<std::string>() + " " + e["name"].get<std::string>());
  CHECK(names == std::vector<std::string>{"AGENT torchelastic.worker.status.RENDEZVOUS",
                                          "AGENT torchelastic.worker.status.RENDEZVOUS",
                                          "WORKER torchelastic.worker.status.SUCCEEDED",
                                          "WORKER torchelastic.worker.status.SUCCEEDED",
                                          "AGENT torchelastic.worker.status.SUCCEEDED"});
  CHECK(ev[1]["metadata"]["agent_restarts"] == 1);
  CHECK(ev[2]["metadata"]["global_rank"] == 0);
  CHECK(ev[3]["metadata"]["global_rank"] == 1);
  CHECK(nlohmann::json::parse(ev[3]["metadata"]["metadata"].get<std::string>())["local_rank"] ==
        nlohmann::json::array({1}));
  CHECK(ev[4]["metadata"]["global_rank"].is_null());
  for (const auto& e : ev) {
    for (const char* key : {"run_id", "global_rank", "group_rank", "worker_id", "role", "hostname", "state",
                            "total_run_time", "rdzv_backend", "raw_error", "metadata", "agent_restarts", "duration_ms"})
      CHECK(e["metadata"].contains(key));
    CHECK(e["timestamp"].get<std::int64_t>() > 0);
  }

  // A failure with no restart left: the failed rank FAILED, the one the agent stopped
  // TERMINATED, the agent's run itself SUCCEEDED (torchrun's meaning: run() returned).
  auto f = run(launch({"--standalone", "--nproc_per_node=2", "--event-log-handler=console"},
                      {"when-rank", "1", "exit", "3"}));
  INFO(f.err);
  CHECK(f.code == 3);
  const auto fe = events_of(f.err);
  REQUIRE(fe.size() == 4);
  CHECK(fe[1]["metadata"]["state"] == "TERMINATED");
  CHECK(fe[2]["metadata"]["state"] == "FAILED");
  CHECK(fe[3]["metadata"]["state"] == "SUCCEEDED");

  // torch's own Event.deserialize takes every line.
  if (python_has_torch()) {
    std::string lines;
    for (const auto& l : split_lines(r.err))
      if (l.rfind("{\"name\": ", 0) == 0) lines += l + "\n";
    std::ofstream(dir + "/events.jsonl") << lines;
    auto py = run({"/usr/bin/python3", "-c",
                   "import sys\nfrom torch.distributed.elastic.events.api import Event\n"
                   "for l in open(sys.argv[1]):\n    e = Event.deserialize(l)\n    print(e.source.value, e.name)\n",
                   dir + "/events.jsonl"});
    INFO(py.err);
    CHECK(py.code == 0);
    CHECK(count_of(py.out, "\n") == 5);
  }

  // null (the default): nothing of the kind.
  auto quiet = run(launch({"--standalone", "--nproc_per_node=2", "--max_restarts=1"}, {"fail-first-attempt", "1", "3"}));
  CHECK(quiet.code == 0);
  CHECK(events_of(quiet.err).empty());
  CHECK(count_of(quiet.err, "torchelastic.worker.status") == 0);
  run({"/bin/rm", "-rf", dir});
}
