// mglaunch on a real Slurm: one single-machine cluster (slurmctld + 3 slurmd, started by
// the tests, shared by every case of this process) runs srun, sbatch and mglaunch-sbatch.
// Skips with one line when Slurm is not installed (fails then under CI=true).
#include <catch2/catch.hpp>

#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <regex>
#include <set>

#include <nlohmann/json.hpp>

#include "slurm/hostlist.h"
#include "support/proc.h"
#include "support/slurm_cluster.h"

using namespace mgtest;
using namespace std::chrono_literals;
namespace fs = std::filesystem;

namespace {

const std::string kSbatchTool = MGLAUNCH_SBATCH_BIN;

// A temporary directory removed at the end of the test case.
struct TempDir {
  std::string path = make_temp_dir();
  ~TempDir() {
    std::error_code ec;
    if (!std::getenv("MGTEST_KEEP_SLURM")) fs::remove_all(path, ec);
  }
  operator const std::string&() const { return path; }
};

// Without Slurm every case skips (exit 77; the whole binary is one ctest entry), and fails
// under CI=true (support/skip.h).
#define NEED_SLURM(c)                                               \
  SlurmCluster* c = SlurmCluster::shared();                         \
  if (!c) FAIL(SlurmCluster::start_error());

// The env dumps ("[rankN]:{json}") of fake_worker in the per-task output files.
std::vector<nlohmann::json> env_dumps(const std::string& dir, const std::string& prefix, int tasks) {
  std::vector<nlohmann::json> out;
  for (int t = 0; t < tasks; ++t) {
    for (const auto& line : split_lines(read_file(dir + "/" + prefix + std::to_string(t) + ".out"))) {
      if (!line.starts_with("[rank")) continue;
      auto colon = line.find("]:");
      if (colon == std::string::npos || line.compare(colon + 2, 1, "{") != 0) continue;
      out.push_back(nlohmann::json::parse(line.substr(colon + 2)));
    }
  }
  return out;
}

std::string all_task_output(const std::string& dir, const std::string& prefix, int tasks) {
  std::string out;
  for (int t = 0; t < tasks; ++t) out += read_file(dir + "/" + prefix + std::to_string(t) + ".out");
  return out;
}

// A 3-node, 2-workers-per-node job's dumps: world 6, ranks 0..5, one master, node order kept.
void check_world_of_six(const std::vector<nlohmann::json>& dumps) {
  REQUIRE(dumps.size() == 6);
  std::set<std::string> ranks, masters, run_ids;
  for (const auto& d : dumps) {
    ranks.insert(d["RANK"].get<std::string>());
    masters.insert(d["MASTER_ADDR"].get<std::string>() + ":" + d["MASTER_PORT"].get<std::string>());
    run_ids.insert(d["TORCHELASTIC_RUN_ID"].get<std::string>());
    CHECK(d["WORLD_SIZE"] == "6");
    CHECK(d["LOCAL_WORLD_SIZE"] == "2");
    CHECK(d["GROUP_RANK"] == d["SLURM_NODEID"]);  // mglaunch keeps Slurm's node order
  }
  CHECK(ranks == std::set<std::string>{"0", "1", "2", "3", "4", "5"});
  CHECK(masters.size() == 1);
  CHECK(run_ids.size() == 1);
}

std::string write_script(const std::string& path, const std::string& text) {
  std::ofstream(path) << text;
  fs::permissions(path, fs::perms::owner_all);
  return path;
}

std::string job_id_of(const std::string& sbatch_out) {
  std::smatch m;
  if (std::regex_search(sbatch_out, m, std::regex("Submitted batch job ([0-9]+)"))) return m[1];
  return {};
}

}  // namespace

TEST_CASE("hostlist expansion and compression agree with scontrol on generated lists") {
  NEED_SLURM(c);
  std::mt19937 rng(2024);
  auto num = [&](int width) {
    std::string s = std::to_string(rng() % 40);
    while (static_cast<int>(s.size()) < width) s.insert(0, "0");
    return s;
  };
  for (int i = 0; i < 25; ++i) {
    std::string expr;
    const int terms = 1 + static_cast<int>(rng() % 3);
    for (int t = 0; t < terms; ++t) {
      if (t) expr += ",";
      const int groups = static_cast<int>(rng() % 3);
      expr += std::vector<std::string>{"n", "node", "rack", "gpu-"}[rng() % 4];
      for (int g = 0; g < groups; ++g) {
        if (g) expr += std::vector<std::string>{"-n", "x", "-"}[rng() % 3];
        expr += "[";
        const int items = 1 + static_cast<int>(rng() % 2);
        for (int k = 0; k < items; ++k) {
          if (k) expr += ",";
          const int width = 1 + static_cast<int>(rng() % 3);
          std::string lo = num(width);
          expr += lo;
          if (rng() % 2) expr += "-" + std::to_string(std::stoi(lo) + static_cast<int>(rng() % 12));
        }
        expr += "]";
      }
      if (groups == 0) expr += num(1);
    }
    INFO(expr);
    auto r = c->run({"scontrol", "show", "hostnames", expr});
    REQUIRE(r.code == 0);
    const auto ours = mg::slurm::expand_hostlist(expr);
    auto theirs = split_lines(r.out);
    while (!theirs.empty() && theirs.back().empty()) theirs.pop_back();
    CHECK(ours == theirs);
    // And back: the hosts (in scontrol's order) compress like `scontrol show hostlist`.
    std::string joined;
    for (const auto& h : theirs) joined += (joined.empty() ? "" : ",") + h;
    auto back = c->run({"scontrol", "show", "hostlist", joined});
    REQUIRE(back.code == 0);
    CHECK(mg::slurm::compress_hostlist(theirs) + "\n" == back.out);
  }
}

TEST_CASE("srun -N3 mglaunch --nproc_per_node=2 forms one world of 6 ranks with one master") {
  NEED_SLURM(c);
  const TempDir tmp;
  const std::string& dir = tmp.path;
  auto r = c->run({"srun", "-N3", "--kill-on-bad-exit=1", "-o", dir + "/task%t.out", kMglaunch, "--nproc_per_node=2",
                   kFakeWorker, "env"},
                  120s);
  INFO(r.err << all_task_output(dir, "task", 3) << c->log_tail());
  REQUIRE(r.code == 0);
  const auto dumps = env_dumps(dir, "task", 3);
  check_world_of_six(dumps);
  CHECK_THAT(dumps.at(0)["TORCHELASTIC_RUN_ID"].get<std::string>(), Catch::Matches("slurm-[0-9]+\\.0"));
  // Each agent said once that it runs inside a Slurm step.
  for (int t = 0; t < 3; ++t) {
    const std::string out = read_file(dir + "/task" + std::to_string(t) + ".out");
    CHECK_THAT(out, Catch::Contains("mglaunch: Slurm step") && Catch::Contains("node " + std::to_string(t) + " of 3"));
  }
}

TEST_CASE("the --dry-run plan inside srun names the nodes, Slurm's NodeAddr and the source of each value") {
  NEED_SLURM(c);
  const TempDir tmp;
  const std::string& dir = tmp.path;
  auto r = c->run({"srun", "-N3", "-o", dir + "/plan%t.json", "-e", dir + "/err%t.txt", kMglaunch, "--dry-run",
                   "--max_restarts=1", kFakeWorker, "env"},
                  120s);
  INFO(r.err << read_file(dir + "/err0.txt"));
  REQUIRE(r.code == 0);
  for (int t = 0; t < 3; ++t) {
    INFO("task " << t);
    const auto j = nlohmann::json::parse(read_file(dir + "/plan" + std::to_string(t) + ".json"));
    CHECK(j["nodes"] == nlohmann::json({"n1", "n2", "n3"}));
    CHECK(j["node_rank"] == t);
    CHECK(j["nnodes"] == 3);
    CHECK(j["max_restarts"] == 1);  // a flag, untouched
    CHECK(j["slurm"]["node_name"] == "n" + std::to_string(t + 1));
    // The node names do not resolve here: NodeAddr (127.0.0.1) from scontrol show node.
    CHECK(j["local_addr"] == "127.0.0.1");
    CHECK_THAT(j["source"]["local_addr"].get<std::string>(), Catch::Contains("NodeAddr from scontrol show node"));
    CHECK_THAT(j["source"]["rdzv_endpoint"].get<std::string>(), Catch::Contains("SLURM_STEP_NODELIST"));
    CHECK(j["source"]["nnodes"] == "SLURM_STEP_NUM_NODES=3");
    CHECK_THAT(j["rdzv_id"].get<std::string>(), Catch::Matches("slurm-[0-9]+\\.0"));
  }
}

TEST_CASE("two mglaunch steps at once on the same nodes both succeed on different rendezvous ports") {
  NEED_SLURM(c);
  const TempDir tmp;
  const std::string& dir = tmp.path;
  std::string steps;
  for (const char* name : {"a", "b"})
    steps += "srun --overlap -N3 --ntasks-per-node=1 --kill-on-bad-exit=1 -o " + dir + "/" + name + "%t.out " +
             kMglaunch + " --nproc_per_node=2 " + kFakeWorker + " env sleep-ms 3000 &\n" + name + "=$!\n";
  const std::string script = write_script(dir + "/job.sh", "#!/bin/bash\n" + steps +
                                                               "wait $a; ra=$?\nwait $b; rb=$?\n"
                                                               "echo \"$ra $rb\" > " + dir + "/codes\n"
                                                               "exit $((ra + rb))\n");
  auto r = c->run({"sbatch", "--wait", "-N3", "-o", dir + "/job.out", script}, 180s);
  INFO(r.out << r.err << read_file(dir + "/job.out") << all_task_output(dir, "a", 3) << all_task_output(dir, "b", 3));
  REQUIRE(r.code == 0);
  CHECK(read_file(dir + "/codes") == "0 0\n");
  const auto a = env_dumps(dir, "a", 3), b = env_dumps(dir, "b", 3);
  check_world_of_six(a);
  check_world_of_six(b);
  CHECK(a.at(0)["TORCHELASTIC_RUN_ID"] != b.at(0)["TORCHELASTIC_RUN_ID"]);
  std::smatch ma, mb;
  const std::string oa = read_file(dir + "/a0.out"), ob = read_file(dir + "/b0.out");
  REQUIRE(std::regex_search(oa, ma, std::regex("rendezvous (\\S+) on n1")));
  REQUIRE(std::regex_search(ob, mb, std::regex("rendezvous (\\S+) on n1")));
  CHECK(ma[1] != mb[1]);
}

TEST_CASE("mglaunch-sbatch --wait runs the job and returns its exit code, arguments intact") {
  NEED_SLURM(c);
  const TempDir tmp;
  const std::string& dir = tmp.path;
  auto ok = c->run({kSbatchTool, "--nodes", "3", "--wait", "--output", dir + "/ok-%j.out", "--", "--nproc_per_node=2",
                    kFakeWorker, "print", "it's a \"quoted\" $HOME arg"},
                   180s);
  INFO(ok.out << ok.err);
  REQUIRE(ok.code == 0);
  const std::string id = job_id_of(ok.out);
  REQUIRE_FALSE(id.empty());
  const std::string out = read_file(dir + "/ok-" + id + ".out");
  INFO(out);
  for (int rank = 0; rank < 6; ++rank)
    CHECK_THAT(out, Catch::Contains("[rank" + std::to_string(rank) + "]:it's a \"quoted\" $HOME arg\n"));
  auto job = c->job(id);
  INFO("JobState=" << job["JobState"] << " ExitCode=" << job["ExitCode"]);
  CHECK(job["ExitCode"] == "0:0");

  auto bad = c->run({kSbatchTool, "--nodes", "2", "--wait", "--output", dir + "/bad-%j.out", "--", kFakeWorker,
                     "exit", "7"},
                    180s);
  INFO(bad.out << bad.err << read_file(dir + "/bad-" + job_id_of(bad.out) + ".out"));
  CHECK(bad.code == 7);
}

TEST_CASE("a failing rank ends the whole Slurm job with its exit code") {
  NEED_SLURM(c);
  const TempDir tmp;
  const std::string& dir = tmp.path;
  // Rank 4 exits 9; the other five would hang for 60 s if nobody stopped them.
  auto p = c->spawn({kSbatchTool, "--nodes", "3", "--wait", "--output", dir + "/job.out", "--", "--nproc_per_node=2",
                     kFakeWorker, "when-rank", "4", "exit", "9"});
  const bool ended = p.wait(50s);
  INFO(p.out() << p.err() << read_file(dir + "/job.out"));
  REQUIRE(ended);
  CHECK(p.exit_code() == 9);
  const std::string out = read_file(dir + "/job.out");
  CHECK_THAT(out, Catch::Contains("rank       : 4") && Catch::Contains("exitcode   : 9"));
  CHECK(c->job(job_id_of(p.out()))["ExitCode"] == "9:0");
}

TEST_CASE("sbatch's own errors reach the user unchanged") {
  NEED_SLURM(c);
  auto r = c->run({kSbatchTool, "--nodes", "2", "--partition", "nosuchpartition", "--", kFakeWorker, "exit", "0"}, 60s);
  CHECK(r.code != 0);
  CHECK_THAT(r.err, Catch::Contains("sbatch: error") && Catch::Contains("partition"));
}

#ifdef MGTRAIN_BIN
TEST_CASE("pre-emption drill: USR1, checkpoint, requeue, resume, same final weights as without it") {
  NEED_SLURM(c);
  const TempDir tmp;
  const std::string& dir = tmp.path;
  // 1,024 synthetic samples (8 steps an epoch at world 2): the 200 steps span 25 epochs, a
  // checkpoint every 20; 8,192 took 1.2 CPU-s more to make in each of the 6 mgtrain processes (#36).
  auto train_args = [&](const std::string& tag) {
    return std::vector<std::string>{MGTRAIN_BIN,       "--model",       "mlp",  "--dataset",   "synthetic",
                                    "--synthetic-size", "1024", "--epochs", "100", "--batch-size", "64", "--max-steps",
                                    "200",             "--seed",        "5",    "--log-every", "20",
                                    "--checkpoint-every", "20",         "--checkpoint-dir", dir + "/" + tag + "-ckpt",
                                    "--summary-json",  dir + "/" + tag + "-{rank}.json", "--threads", "1"};
  };
  // The reference: the same training without interruption (2 ranks, one node).
  std::vector<std::string> ref{kMglaunch, "--standalone", "--nproc_per_node=2"};
  for (auto& a : train_args("ref")) ref.push_back(a);
  auto t0 = std::chrono::steady_clock::now();
  auto rr = run(ref, {}, 300s);
  const double ref_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  INFO(rr.out << rr.err);
  REQUIRE(rr.code == 0);
  const auto ref_sum = nlohmann::json::parse(read_file(dir + "/ref-0.json"));

  // The drill: 2 nodes x 1 worker, requeue on 75.
  std::vector<std::string> submit{kSbatchTool, "--nodes", "2", "--requeue", "--output", dir + "/job.out", "--",
                                  "--nproc_per_node=1"};
  for (auto& a : train_args("drill")) submit.push_back(a);
  const auto start = std::chrono::steady_clock::now();
  auto since = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(); };
  auto s = c->run(submit, 60s);
  INFO(s.out << s.err);
  REQUIRE(s.code == 0);
  const std::string id = job_id_of(s.out);
  REQUIRE_FALSE(id.empty());
  auto job_out = [&] { return read_file(dir + "/job.out"); };
  // Training is under way once a step line is out.
  auto ended = [&] {
    const auto state = c->job(id)["JobState"];
    return state == "COMPLETED" || state == "FAILED" || state == "CANCELLED";
  };
  REQUIRE(eventually([&] { return job_out().find("step 40/200") != std::string::npos || ended(); }, 180s));
  INFO(job_out());
  REQUIRE_FALSE(ended());
  const double t_usr1 = since();
  REQUIRE(c->run({"scancel", "--signal=USR1", "--batch", id}).code == 0);
  // The script requeues the job after the step stopped with 75.
  std::map<std::string, std::string> j;
  const bool requeued = eventually(
      [&] {
        j = c->job(id);
        return j["Restarts"] == "1";
      },
      180s);
  INFO(job_out() << c->log_tail());
  REQUIRE(requeued);
  const double t_requeued = since();
  // A requeued job waits ~2 minutes before it may start again: let it start now, but only
  // once its first run has completed on every node and a later second has begun (slurmd
  // revokes the old run's credential with a time stamp in whole seconds, and refuses a new
  // run of the same job id stamped in that second: "Job credential revoked").
  const auto requeued_at = std::chrono::steady_clock::now();
  const bool restarted = eventually(
      [&] {
        j = c->job(id);
        if (j["JobState"] == "PENDING" && std::chrono::steady_clock::now() - requeued_at > 2s && c->all_nodes_idle())
          c->run({"scontrol", "update", "JobId=" + id, "StartTime=now"});
        return j["JobState"] == "RUNNING" || j["JobState"] == "COMPLETED";
      },
      180s);
  if (!restarted) {
    std::string fields;
    for (const auto& [k, v] : j) fields += k + "=" + v + " ";
    FAIL("the requeued job did not start again: " << fields << "\n" << c->log_tail());
  }
  const double t_restarted = since();
  REQUIRE(eventually(
      [&] {
        j = c->job(id);
        return j["JobState"] == "COMPLETED" || j["JobState"] == "FAILED";
      },
      300s));
  const double t_done = since();
  INFO(job_out());
  CHECK(j["JobState"] == "COMPLETED");
  CHECK(j["ExitCode"] == "0:0");
  CHECK_THAT(job_out(), Catch::Contains("run 1 on") && Catch::Contains("resumed from"));
  const auto drill_sum = nlohmann::json::parse(read_file(dir + "/drill-0.json"));
  CHECK(drill_sum["weights_sha256"] == ref_sum["weights_sha256"]);
  std::smatch resumed;
  const std::string rerun = job_out();
  std::regex_search(rerun, resumed, std::regex("resumed from \\S+ at step ([0-9]+)"));
  CHECK(nlohmann::json::parse(read_file(dir + "/drill-1.json"))["weights_sha256"] == ref_sum["weights_sha256"]);
  std::printf(
      "drill timings: uninterrupted run %.1f s; submit -> USR1 %.1f s; USR1 -> requeued (Restarts=1) %.1f s; "
      "requeued -> running again after StartTime=now %.1f s; running -> completed %.1f s (resumed at step %s of 200); "
      "total %.1f s\n",
      ref_s, t_usr1, t_requeued - t_usr1, t_restarted - t_requeued, t_done - t_restarted,
      resumed.size() > 1 ? resumed[1].str().c_str() : "?", t_done);
}
#endif
