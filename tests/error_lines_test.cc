// Every binary's errors on bad input: one line on stderr, `PROGRAM: error: ...`, and the
// documented exit code; never a stack trace, an abort, CLI11's help dump or a bare
// exception text. Each case runs the real binary (mglaunch with doctor and --hostfile,
// mglaunch-rdzv, mglaunch-sbatch, and mgtrain when it is built).
#include <catch2/catch.hpp>

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "support/proc.h"

using namespace mgtest;
using namespace std::chrono_literals;

namespace {

struct Case {
  std::vector<std::string> argv;
  int code;
  std::map<std::string, std::string> env = {};
};

std::string write_temp(const std::string& dir, const std::string& name, const std::string& text) {
  const std::string path = dir + "/" + name;
  std::ofstream(path) << text;
  return path;
}

// Runs each case and checks the one-line form: the only stderr line that is not an agent
// notice ("[mglaunch] ...") is the last one and starts with "PROGRAM: error: ".
void check_cases(const std::string& program, const std::vector<Case>& cases) {
  for (const auto& c : cases) {
    std::string shown;
    for (std::size_t i = 1; i < c.argv.size(); ++i) shown += " " + c.argv[i];
    INFO(program << shown);
    auto r = run(c.argv, c.env, 60s);
    INFO("stderr:\n" << r.err);
    CHECK(r.code == c.code);
    const auto lines = split_lines(r.err);
    REQUIRE_FALSE(lines.empty());
    CHECK_THAT(lines.back(), Catch::StartsWith(program + ": error: "));
    for (std::size_t i = 0; i + 1 < lines.size(); ++i) CHECK_THAT(lines[i], Catch::StartsWith("[mglaunch] "));
    CHECK(lines.back().size() < 2100);
  }
}

// A port on 127.0.0.1 that stays taken while the returned socket is open.
int taken_port(int& fd) {
  fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 || ::listen(fd, 1) != 0) return -1;
  socklen_t len = sizeof(a);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  return ntohs(a.sin_port);
}

}  // namespace

TEST_CASE("every mglaunch error on bad input is one line 'mglaunch: error:' with its documented exit code") {
  const std::string dir = make_temp_dir();
  const std::string bad_key = write_temp(dir, "bad_key.json", R"({"nproc_per_nodes": 2})");
  const std::string bad_json = write_temp(dir, "bad.json", "{not json");
  const std::string hosts = write_temp(dir, "hosts", "127.0.0.2 slots=2\n127.0.0.3 slots = 2\n");
  const std::string good_hosts = write_temp(dir, "good_hosts", "127.0.0.2 slots=2\n");
  const int unused_port = free_loopback_port();
  const std::string t = "/bin/true";
  check_cases("mglaunch",
              {
                  {{kMglaunch, "--bogus", t}, 2},
                  {{kMglaunch, "--nproc=abc", t}, 2},
                  {{kMglaunch, "--n=2", t}, 2},  // ambiguous
                  {{kMglaunch, "--nproc_per_node=0", t}, 2},
                  {{kMglaunch, "--max_restarts=99999999999999999999", t}, 2},
                  {{kMglaunch, "--rdzv_endpoint=a:b:c", t}, 2},
                  {{kMglaunch, "--rdzv_id=", "--nproc_per_node", "--standalone", t}, 2},
                  {{kMglaunch, "--config", dir + "/missing.json", t}, 2},
                  {{kMglaunch, "--config", bad_key, t}, 2},
                  {{kMglaunch, "--config", bad_json, t}, 2},
                  {{kMglaunch}, 2},
                  {{kMglaunch, "--cpu-bind=x\ny", t}, 2},  // a value with a newline stays on one line
                  {{kMglaunch, "--nproc_per_node=1\n2", t}, 2},
                  {{kMglaunch, "--no_python", dir + "/missing-program"}, 127},
                  {{kMglaunch, "--log_dir", "/proc/1/mglaunch-logs", "--no_python", t}, 2},
                  {{kMglaunch, "--trace", dir + "/no/such/dir/trace.json", "--no_python", t}, 2},
                  {{kMglaunch, "--summary-json", dir + "/no/such/dir/s.json", "--no_python", t}, 2},
                  {{kMglaunch, "--metrics-json", dir + "/no/such/dir/m.json", "--no_python", t}, 2},
                  {{kMglaunch, "--no_python", t}, 2, {{"PET_NPROC_PER_NODE", "x"}}},
                  {{kMglaunch, "--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:" + std::to_string(unused_port),
                    "--rdzv_conf=is_host=false,join_timeout=5", "--nnodes=2", "--no_python", t},
                   3},
                  {{kMglaunch, "doctor", "--gpus"}, 2},
                  {{kMglaunch, "doctor", "--jsn"}, 2},
                  {{kMglaunch, "doctor", "--port=70000"}, 2},
                  {{kMglaunch, "doctor", "--port=1\n2"}, 2},
                  {{kMglaunch, "doctor", "stray"}, 2},
                  {{kMglaunch, "--hostfile", dir + "/missing-hosts", t}, 2},
                  {{kMglaunch, "--hostfile", hosts, "--dry-run", t}, 2},
                  {{kMglaunch, "--hostfile", good_hosts, "--include", "127.0.0.9", "--dry-run", t}, 2},
                  {{kMglaunch, "--hostfile", good_hosts, "--nnodes=2", t}, 2},
                  {{kMglaunch, "--hostfile", good_hosts, "--ex=x", t}, 2},
                  {{kMglaunch, "--hostfile", good_hosts, "--max_restars=1", t}, 2},
              });
}

// #22, #23 D9/D10: numbers past the documented limits (4096 workers per node, 2^31-1 ranks)
// are one line and exit 2, never an overflowed rank, std::bad_alloc or a huge plan.
TEST_CASE("worker counts and world sizes past the documented limits are one line and exit 2 (#23)") {
  const std::string t = "/bin/true";
  const std::map<std::string, std::string> step = {
      {"SLURM_JOB_ID", "77"},        {"SLURM_STEP_ID", "2"},         {"SLURM_NODEID", "0"},
      {"SLURM_STEP_NUM_NODES", "1"}, {"SLURM_STEP_NODELIST", "localhost"}, {"SLURMD_NODENAME", "localhost"},
      {"SLURM_STEP_TASKS_PER_NODE", "1"}};
  auto with = [&](std::string k, std::string v) {
    auto e = step;
    e[k] = v;
    return e;
  };
  check_cases("mglaunch",
              {
                  {{kMglaunch, "--nnodes=2147483647", "--node_rank=2147483646", "--nproc_per_node=2", "--dry-run",
                    "--no_python", t},
                   2},
                  {{kMglaunch, "--nproc_per_node=999999999", "--no_python", t}, 2},
                  {{kMglaunch, "--nproc_per_node=4097", "--dry-run", "--no_python", t}, 2},
                  {{kMglaunch, "--dry-run", "--no_python", t}, 2, with("SLURM_GPUS_ON_NODE", "999999999")},
                  {{kMglaunch, "--dry-run", "--no_python", t}, 2, with("SLURM_GPUS_PER_NODE", "gpu:999999")},
              });
  auto r = run({kMglaunch, "--nnodes=2147483647", "--node_rank=2147483646", "--nproc_per_node=2", "--dry-run",
                "--no_python", t});
  CHECK_THAT(r.err, Catch::Contains("at most 2147483647"));
  CHECK(r.out.empty());
  r = run({kMglaunch, "--dry-run", "--no_python", t}, with("SLURM_GPUS_PER_NODE", "gpu:999999"));
  CHECK_THAT(r.err, Catch::Contains("SLURM_GPUS_PER_NODE") && Catch::Contains("at most 4096"));
  CHECK(r.out.empty());
  // At the limit it still works.
  CHECK(run({kMglaunch, "--nproc_per_node=4096", "--dry-run", "--no_python", t}).code == 0);
}

TEST_CASE("every mglaunch-rdzv error on bad input is one line 'mglaunch-rdzv: error:' with its documented exit code") {
  const std::string dir = make_temp_dir();
  int fd = -1;
  const int port = taken_port(fd);
  REQUIRE(port > 0);
  const std::map<std::string, std::string> no_token = {{"MGLAUNCH_RDZV_TOKEN", "\x01unset"}};
  check_cases("mglaunch-rdzv", {
                                   {{kRdzvDaemon, "--bogus"}, 2},
                                   {{kRdzvDaemon, "--max-connections", "0"}, 2},
                                   {{kRdzvDaemon, "--max-connections", std::string(400, '9')}, 2},
                                   {{kRdzvDaemon, "--max-frame=1"}, 2},
                                   {{kRdzvDaemon, "--listen", "a:b:c"}, 2},
                                   {{kRdzvDaemon, "--listen", "127.0.0.1:0\nx"}, 2},
                                   {{kRdzvDaemon, "--http", "a:b:c"}, 2},
                                   {{kRdzvDaemon, "--metrics-port", "99999"}, 2},
                                   {{kRdzvDaemon, "--token-file", dir + "/missing"}, 2},
                                   {{kRdzvDaemon, "--job-token", "job1"}, 2, no_token},
                                   {{kRdzvDaemon, "--listen", "127.0.0.1:" + std::to_string(port)}, 3},
                               });
  ::close(fd);
}

TEST_CASE("every mglaunch-sbatch error on bad input is one line 'mglaunch-sbatch: error:' with its documented exit code") {
  const std::string sbatch = MGLAUNCH_SBATCH_BIN;
  check_cases("mglaunch-sbatch", {
                                     {{sbatch, "--bogus", "--", "train.py"}, 2},
                                     {{sbatch, "--nodes", "0", "--", "train.py"}, 2},
                                     {{sbatch, "--nodes=x", "--", "train.py"}, 2},
                                     {{sbatch, "--dry-run"}, 2},
                                     {{sbatch, "--mglaunch", "relative/mglaunch", "--", "train.py"}, 2},
                                     {{sbatch, "--job-name", "a\nb", "--dry-run", "--", "train.py"}, 2},
                                     // No sbatch on PATH: 127 (mglaunch is found next to mglaunch-sbatch).
                                     {{sbatch, "--", "train.py"}, 127, {{"PATH", "/nonexistent"}}},
                                 });
}

#ifdef MGTRAIN_BIN
TEST_CASE("every mgtrain error on bad input is one line 'mgtrain: error:' with its documented exit code") {
  const std::string mgtrain = MGTRAIN_BIN;
  check_cases("mgtrain", {
                             {{mgtrain, "--bogus"}, 2},
                             {{mgtrain, "--epochs", "0"}, 2},
                             {{mgtrain, "--backend", "mpi"}, 2},
                             {{mgtrain, "--lr", "fast"}, 2},
                             {{mgtrain, "--min-bytes", "1\n2", "--bench", "allreduce"}, 2},
                         });
}
#endif
