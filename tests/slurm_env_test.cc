// The Slurm environment -> launch plan, and the variable parsers, without a Slurm.
#include <catch2/catch.hpp>

#include <random>
#include <set>

#include "slurm/env.h"

using namespace mg::slurm;

namespace {

// What srun gives task 1 of `srun -N3` in job 42 on n[1-3] (checked on slurm-wlm 22.05).
Env step_env() {
  return {{"SLURM_JOB_ID", "42"},           {"SLURM_STEP_ID", "0"},           {"SLURM_NODEID", "1"},
          {"SLURM_PROCID", "1"},            {"SLURM_STEP_NUM_NODES", "3"},    {"SLURM_NNODES", "3"},
          {"SLURM_STEP_NODELIST", "n[1-3]"}, {"SLURM_JOB_NODELIST", "n[1-3]"}, {"SLURMD_NODENAME", "n2"},
          {"SLURM_STEP_TASKS_PER_NODE", "1(x3)"}, {"SLURM_TASKS_PER_NODE", "1(x3)"}};
}

}  // namespace

TEST_CASE("SLURM_TASKS_PER_NODE expands repeat counts") {
  CHECK(parse_tasks_per_node("2(x3),1") == std::vector<int>{2, 2, 2, 1});
  CHECK(parse_tasks_per_node("4") == std::vector<int>{4});
  CHECK(parse_tasks_per_node("1(x2),3(x1)") == std::vector<int>{1, 1, 3});
  for (const char* bad : {"", "x", "2(x)", "2(3)", "2(x0)", "2(x3", "-1", "2,,1", "2(x99999999)"}) {
    INFO(bad);
    CHECK_THROWS_AS(parse_tasks_per_node(bad), std::invalid_argument);
  }
}

TEST_CASE("GPU counts come from SLURM_GPUS_PER_NODE in every spelling and from GPU index lists") {
  CHECK(parse_gpus_per_node("4") == 4);
  CHECK(parse_gpus_per_node("gpu:4") == 4);
  CHECK(parse_gpus_per_node("a100:4") == 4);
  CHECK(parse_gpus_per_node("gpu:a100:2(S:0-1)") == 2);
  CHECK(parse_gpus_per_node("gpu:a100:2,gpu:v100:1") == 3);
  CHECK_THROWS_AS(parse_gpus_per_node("gpu:"), std::invalid_argument);
  CHECK_THROWS_AS(parse_gpus_per_node("a100"), std::invalid_argument);
  CHECK(count_gpu_list("0,1,2,3") == 4);
  CHECK(count_gpu_list("0-3,6") == 5);
  CHECK_THROWS_AS(count_gpu_list("3-1"), std::invalid_argument);
  CHECK_THROWS_AS(count_gpu_list("0,,1"), std::invalid_argument);
  CHECK(parse_count("SLURM_CPUS_PER_TASK", "8", 1) == 8);
  CHECK_THROWS_WITH(parse_count("SLURM_CPUS_PER_TASK", "0", 1), Catch::Contains("SLURM_CPUS_PER_TASK"));
  CHECK_THROWS_AS(parse_count("SLURM_CPUS_PER_TASK", "8x", 1), std::invalid_argument);
}

TEST_CASE("reserved ports and scontrol's NodeAddr are read") {
  CHECK(parse_port_list("12000-12002") == std::vector<int>{12000, 12001, 12002});
  CHECK(parse_port_list("12000,12005") == std::vector<int>{12000, 12005});
  CHECK_THROWS_AS(parse_port_list("0-3"), std::invalid_argument);
  CHECK_THROWS_AS(parse_port_list("70000"), std::invalid_argument);
  CHECK(parse_node_addr("NodeName=n1 Arch=x86_64 CoresPerSocket=1\n   NodeAddr=127.0.0.1 NodeHostName=vm Version=22.05\n") ==
        "127.0.0.1");
  CHECK(parse_node_addr("NodeName=n1 XNodeAddr=9\n").empty());
  CHECK(parse_node_addr("").empty());
}

TEST_CASE("a Slurm step is told apart from the batch script and plain shells") {
  CHECK(in_slurm_step(step_env()));
  Env batch = step_env();
  batch.erase("SLURM_STEP_ID");  // the batch shell has a job and a node id but no step
  CHECK_FALSE(in_slurm_step(batch));
  CHECK_FALSE(in_slurm_step({}));
  CHECK_FALSE(in_slurm_step({{"SLURM_JOB_ID", "1"}, {"SLURM_STEP_ID", "0"}}));
}

TEST_CASE("the plan of a 3-node step says where each value came from") {
  const SlurmPlan p = plan_from_env(step_env());
  CHECK(p.nnodes.value == 3);
  CHECK(p.nnodes.source == "SLURM_STEP_NUM_NODES=3");
  CHECK(p.node_rank.value == 1);
  CHECK(p.node_rank.source == "SLURM_NODEID=1");
  CHECK(p.nodes.value == std::vector<std::string>{"n1", "n2", "n3"});
  CHECK(p.nodes.source == "SLURM_STEP_NODELIST=n[1-3]");
  CHECK(p.rdzv_host.value == "n1");
  CHECK(p.node_name.value == "n2");
  CHECK(p.node_name.source == "SLURMD_NODENAME=n2");
  CHECK(p.rdzv_id.value == "slurm-42.0");
  CHECK(p.nproc_per_node.value == 1);
  CHECK_THAT(p.nproc_per_node.source, Catch::Contains("no GPUs"));
  CHECK(p.restart_count == 0);
}

TEST_CASE("the step's own variables win over the job's") {
  Env env = step_env();
  env["SLURM_NNODES"] = "4";
  env["SLURM_JOB_NODELIST"] = "n[1-4]";
  env["SLURM_STEP_NUM_NODES"] = "2";
  env["SLURM_STEP_NODELIST"] = "n[3-4]";
  env["SLURM_STEP_TASKS_PER_NODE"] = "1(x2)";
  env.erase("SLURMD_NODENAME");
  const SlurmPlan p = plan_from_env(env);
  CHECK(p.nnodes.value == 2);
  CHECK(p.rdzv_host.value == "n3");
  CHECK(p.node_name.value == "n4");  // node 1 of the step's list when SLURMD_NODENAME is absent
  env.erase("SLURM_STEP_NUM_NODES");
  env.erase("SLURM_STEP_NODELIST");
  CHECK(plan_from_env(env).nnodes.source == "SLURM_NNODES=4");
  CHECK(plan_from_env(env).rdzv_host.source == "first node of SLURM_JOB_NODELIST");
}

TEST_CASE("workers per node follow the GPUs Slurm gave the node") {
  Env env = step_env();
  env["SLURM_GPUS_PER_NODE"] = "a100:4";
  CHECK(plan_from_env(env).nproc_per_node.value == 4);
  CHECK(plan_from_env(env).nproc_per_node.source == "SLURM_GPUS_PER_NODE=a100:4");
  env["SLURM_JOB_GPUS"] = "0,1";
  CHECK(plan_from_env(env).nproc_per_node.value == 2);
  env["SLURM_STEP_GPUS"] = "0,1,2";
  CHECK(plan_from_env(env).nproc_per_node.source == "SLURM_STEP_GPUS=0,1,2");
  env["SLURM_GPUS_ON_NODE"] = "8";
  CHECK(plan_from_env(env).nproc_per_node.value == 8);
  CHECK(plan_from_env(env).nproc_per_node.source == "SLURM_GPUS_ON_NODE=8");
  env["SLURM_CPUS_PER_TASK"] = "16";
  CHECK(plan_from_env(env).cpus_per_task == 16);
}

TEST_CASE("without GPUs, workers per node are the node's CPUs divided by the CPUs per task") {
  Env env = step_env();
  env["SLURM_CPUS_ON_NODE"] = "32";
  CHECK(plan_from_env(env).nproc_per_node.value == 1);  // no --cpus-per-task: the default
  env["SLURM_CPUS_PER_TASK"] = "8";
  CHECK(plan_from_env(env).nproc_per_node.value == 4);
  CHECK(plan_from_env(env).nproc_per_node.source == "SLURM_CPUS_ON_NODE=32 / SLURM_CPUS_PER_TASK=8");
  env["SLURM_CPUS_PER_TASK"] = "64";
  CHECK(plan_from_env(env).nproc_per_node.value == 1);  // never 0
  env["SLURM_GPUS_ON_NODE"] = "2";
  CHECK(plan_from_env(env).nproc_per_node.value == 2);  // GPUs first
}

TEST_CASE("several tasks of the step on one node are refused with the fix") {
  Env env = step_env();
  env["SLURM_STEP_TASKS_PER_NODE"] = "1,4,1";
  CHECK_THROWS_WITH(plan_from_env(env), Catch::Contains("--ntasks-per-node=1") && Catch::Contains("--no-slurm"));
}

TEST_CASE("an inconsistent or incomplete Slurm environment is a clear error") {
  Env env = step_env();
  env["SLURM_NODEID"] = "3";
  CHECK_THROWS_WITH(plan_from_env(env), Catch::Contains("SLURM_NODEID=3"));
  env = step_env();
  env["SLURM_STEP_NODELIST"] = "n[1-2]";
  CHECK_THROWS_WITH(plan_from_env(env), Catch::Contains("names 2 nodes"));
  env = step_env();
  env.erase("SLURM_NODEID");
  CHECK_THROWS_WITH(plan_from_env(env), Catch::Contains("SLURM_NODEID is not set"));
  env = step_env();
  env["SLURM_STEP_NODELIST"] = "n[1-";
  CHECK_THROWS_WITH(plan_from_env(env), Catch::Contains("n[1-"));
}

TEST_CASE("the rendezvous port is the same on every node, differs between steps, and avoids ephemeral ports") {
  const PortRange eph{32768, 60999};
  const PortRange r = rendezvous_port_range(eph);
  CHECK(r.lo == kLowestPort);
  CHECK(r.hi == 32767);
  std::set<int> ports;
  for (int step = 0; step < 50; ++step) {
    auto p = rendezvous_port({}, "1234", std::to_string(step), eph);
    CHECK(p.value >= r.lo);
    CHECK(p.value <= r.hi);
    CHECK(p.value == rendezvous_port({}, "1234", std::to_string(step), eph).value);
    CHECK_THAT(p.source, Catch::Contains("hash of job 1234 step"));
    ports.insert(p.value);
  }
  CHECK(ports.size() >= 45);  // a hash, not a constant
  // Reserved ports win.
  auto resv = rendezvous_port({{"SLURM_STEP_RESV_PORTS", "15000-15003"}}, "1", "0", eph);
  CHECK(resv.value == 15000);
  CHECK(resv.source == "SLURM_STEP_RESV_PORTS=15000-15003");
  // Other ephemeral ranges move the window.
  CHECK(rendezvous_port_range({1024, 50000}).lo == 50001);
  CHECK(rendezvous_port_range({1024, 65000}).lo == kLowestPort);  // no room: fixed fallback
}

TEST_CASE("random garbage in every Slurm variable never crashes the planner") {
  std::mt19937 rng(3);
  const std::string alphabet = "0123456789n[]-,(x):gpu ";
  const std::vector<std::string> keys = {"SLURM_STEP_NUM_NODES", "SLURM_NODEID", "SLURM_STEP_NODELIST",
                                         "SLURM_STEP_TASKS_PER_NODE", "SLURM_GPUS_ON_NODE", "SLURM_STEP_GPUS",
                                         "SLURM_GPUS_PER_NODE", "SLURM_CPUS_PER_TASK", "SLURM_CPUS_ON_NODE", "SLURM_RESTART_COUNT",
                                         "SLURM_STEP_RESV_PORTS", "SLURM_JOB_ID", "SLURM_STEP_ID"};
  int planned = 0;
  for (int i = 0; i < 20000; ++i) {
    Env env = step_env();
    const int changes = 1 + static_cast<int>(rng() % 3);
    for (int c = 0; c < changes; ++c) {
      std::string v;
      const int len = static_cast<int>(rng() % 12);
      for (int k = 0; k < len; ++k) v += alphabet[rng() % alphabet.size()];
      env[keys[rng() % keys.size()]] = v;
    }
    try {
      SlurmPlan p = plan_from_env(env);
      CHECK(p.node_rank.value < p.nnodes.value);
      CHECK(static_cast<int>(p.nodes.value.size()) == p.nnodes.value);
      CHECK(p.nproc_per_node.value >= 1);
      ++planned;
    } catch (const std::invalid_argument&) {
    }
  }
  CHECK(planned > 0);
}
