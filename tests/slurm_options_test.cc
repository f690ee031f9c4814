// mglaunch inside a Slurm step: flags filled from SLURM_* (explicit flags win, --no-slurm
// turns it off), node names resolved through the probe seam, and the --dry-run document.
#include <catch2/catch.hpp>

#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>

#include <nlohmann/json.hpp>

#include "cli/errors.h"
#include "launcher/options.h"
#include "launcher/plan.h"
#include "support/proc.h"

using namespace mg;

namespace {

// Node names do not resolve here; "scontrol" says nN lives at 127.0.0.N.
HardwareProbe fake_probe() {
  HardwareProbe p{[] { return 0; }, [] { return 6; }};
  p.node_address = [](const std::string& name) {
    return HardwareProbe::NodeAddress{"127.0.0." + name.substr(1), "NodeAddr from the fake scontrol"};
  };
  p.ephemeral_ports = [] { return std::pair{32768, 60999}; };
  p.listen_error = [](const std::string&, int) { return std::optional<std::string>(); };
  return p;
}

std::map<std::string, std::string> step_env(int node) {
  return {{"SLURM_JOB_ID", "77"},
          {"SLURM_STEP_ID", "2"},
          {"SLURM_NODEID", std::to_string(node)},
          {"SLURM_STEP_NUM_NODES", "3"},
          {"SLURM_STEP_NODELIST", "n[1-3]"},
          {"SLURMD_NODENAME", "n" + std::to_string(node + 1)},
          {"SLURM_STEP_TASKS_PER_NODE", "1(x3)"},
          {"SLURM_GPUS_ON_NODE", "4"},
          {"PATH", "/usr/bin:/bin"}};
}

AgentOptions parse(std::vector<std::string> args, const std::map<std::string, std::string>& env) {
  args.insert(args.begin(), "mglaunch");
  auto out = parse_agent_args(args, env, fake_probe());
  REQUIRE(out.options);
  return *out.options;
}

}  // namespace

TEST_CASE("inside a Slurm step mglaunch needs no flags") {
  const AgentOptions o = parse({"prog"}, step_env(1));
  REQUIRE(o.slurm);
  CHECK(o.nnodes.min == 3);
  CHECK(o.nnodes.max == 3);
  CHECK(o.node_rank == 1);
  CHECK(o.node_rank_given);
  CHECK(o.nproc_per_node == 4);
  CHECK(o.rdzv_backend == "c10d");
  CHECK(o.rdzv_id == "slurm-77.2");
  CHECK(o.local_addr == "127.0.0.2");
  CHECK(o.rdzv_endpoint.starts_with("127.0.0.1:"));
  CHECK(uses_rendezvous_server(o));
  CHECK(o.slurm->nodes == std::vector<std::string>{"n1", "n2", "n3"});
  CHECK_THAT(o.slurm->summary, Catch::Contains("Slurm step 77.2") && Catch::Contains("node 1 of 3 (n2)") &&
                                   Catch::Contains("--no-slurm"));
  CHECK(o.slurm->summary.find('\n') == std::string::npos);
  CHECK(o.sources.at("nproc_per_node") == "SLURM_GPUS_ON_NODE=4");
  CHECK_THAT(o.sources.at("rdzv_endpoint"), Catch::Contains("n1") && Catch::Contains("hash of job 77 step 2"));
}

TEST_CASE("every node of a Slurm step computes the same rendezvous endpoint and id") {
  const AgentOptions a = parse({"prog"}, step_env(0)), b = parse({"prog"}, step_env(2));
  CHECK(a.rdzv_endpoint == b.rdzv_endpoint);
  CHECK(a.rdzv_id == b.rdzv_id);
  auto other_step = step_env(0);
  other_step["SLURM_STEP_ID"] = "3";
  CHECK(parse({"prog"}, other_step).rdzv_endpoint != a.rdzv_endpoint);
}

TEST_CASE("explicit flags and PET_ variables win over Slurm's values") {
  const AgentOptions o = parse({"--nproc_per_node=2", "--rdzv_endpoint=127.0.0.9:1234", "--rdzv_id=mine", "prog"},
                               step_env(0));
  CHECK(o.nproc_per_node == 2);
  CHECK(o.rdzv_endpoint == "127.0.0.9:1234");
  CHECK(o.rdzv_id == "mine");
  CHECK(o.nnodes.max == 3);  // the rest still from Slurm
  CHECK(o.sources.at("nproc_per_node") == "flag --nproc_per_node");
  auto env = step_env(0);
  env["PET_NNODES"] = "2";
  CHECK(parse({"prog"}, env).nnodes.max == 2);
}

TEST_CASE("an explicit static rendezvous under Slurm gets node 0 as master on the step's port") {
  const AgentOptions o = parse({"--rdzv_backend=static", "prog"}, step_env(2));
  CHECK(o.rdzv_backend == "static");
  CHECK(o.node_rank == 2);
  CHECK(o.master_addr == "127.0.0.1");
  CHECK(o.master_port >= 20000);
  CHECK(o.master_port < 32768);
}

TEST_CASE("the --no-slurm flag and plain shells leave the flags alone") {
  const AgentOptions o = parse({"--no-slurm", "prog"}, step_env(1));
  CHECK_FALSE(o.slurm);
  CHECK(o.nnodes.max == 1);
  CHECK(o.rdzv_backend == "static");
  auto batch = step_env(0);
  batch.erase("SLURM_STEP_ID");  // the batch script itself
  CHECK_FALSE(parse({"prog"}, batch).slurm);
}

TEST_CASE("a --standalone run under Slurm stays one node and takes only the worker count") {
  const AgentOptions o = parse({"--standalone", "prog"}, step_env(1));
  CHECK(o.nnodes.max == 1);
  CHECK(o.nproc_per_node == 4);
}

TEST_CASE("a broken Slurm environment is a usage error that names the variable") {
  auto env = step_env(1);
  env["SLURM_STEP_TASKS_PER_NODE"] = "2(x3)";
  try {
    parse_agent_args({"mglaunch", "prog"}, env, fake_probe());
    FAIL("expected a UsageError");
  } catch (const UsageError& e) {
    CHECK_THAT(e.what(), Catch::Contains("SLURM_STEP_TASKS_PER_NODE") && Catch::Contains("--no-slurm"));
  }
}

TEST_CASE("the --dry-run plan under Slurm shows the expanded nodes and the source of each value") {
  const AgentOptions o = parse({"--dry-run", "/bin/true"}, step_env(1));
  const RunPlan plan = make_plan(o, step_env(1));
  const nlohmann::json j = plan_to_json(plan, o, step_env(1));
  CHECK(j["nodes"] == nlohmann::json({"n1", "n2", "n3"}));
  CHECK(j["nnodes"] == 3);
  CHECK(j["node_rank"] == 1);
  CHECK(j["nproc_per_node"] == 4);
  CHECK(j["rdzv_id"] == "slurm-77.2");
  CHECK(j["slurm"]["job_id"] == "77");
  CHECK(j["source"]["nnodes"] == "SLURM_STEP_NUM_NODES=3");
  CHECK(j["source"]["node_rank"] == "SLURM_NODEID=1");
  CHECK(j["source"]["nodes"] == "SLURM_STEP_NODELIST=n[1-3]");
  CHECK_THAT(j["source"]["local_addr"].get<std::string>(), Catch::Contains("SLURMD_NODENAME=n2"));
}

TEST_CASE("the --dry-run plan of node 2 of a Slurm step leaves the ranks and the master to the rendezvous (#22)") {
  const AgentOptions o = parse({"--dry-run", "/bin/true"}, step_env(2));
  const nlohmann::json j = plan_to_json(make_plan(o, step_env(2)), o, step_env(2));
  INFO(j.dump(2));
  CHECK(j["node_rank"] == 2);  // what this node asks for (SLURM_NODEID); the rendezvous keeps that order
  CHECK(j["world_size"] == kDecidedAtRendezvous);
  CHECK(j["master_addr"] == kDecidedAtRendezvous);
  CHECK(j["master_port"] == kDecidedAtRendezvous);
  REQUIRE(j["workers"].size() == 4);
  for (const auto& w : j["workers"]) {
    CHECK(w["rank"] == kDecidedAtRendezvous);
    for (const char* k : {"RANK", "GROUP_RANK", "ROLE_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"})
      CHECK(w["env"][k] == kDecidedAtRendezvous);
    CHECK(w["env"]["GROUP_WORLD_SIZE"] == "3");  // a fixed --nnodes: known
    CHECK(w["env"]["LOCAL_WORLD_SIZE"] == "4");
  }
  CHECK(j["workers"][3]["env"]["LOCAL_RANK"] == "3");
}

TEST_CASE("node 0 hosts the Slurm step's rendezvous and the other nodes only join") {
  CHECK(parse({"prog"}, step_env(0)).rdzv_is_host == true);
  CHECK(parse({"prog"}, step_env(2)).rdzv_is_host == false);
  CHECK(parse({"--rdzv_conf=is_host=false", "prog"}, step_env(0)).rdzv_is_host == false);
}

TEST_CASE("a taken rendezvous port on node 0 is an error that names it and the way out") {
  HardwareProbe probe = fake_probe();
  probe.listen_error = [](const std::string&, int) { return std::optional<std::string>("address already in use"); };
  try {
    parse_agent_args({"mglaunch", "prog"}, step_env(0), probe);
    FAIL("expected a UsageError");
  } catch (const UsageError& e) {
    CHECK_THAT(e.what(), Catch::Contains("127.0.0.1:") && Catch::Contains("address already in use") &&
                             Catch::Contains("--resv-ports") && Catch::Contains("--rdzv_endpoint"));
  }
  // Only node 0 binds it: the others do not look.
  CHECK(parse_agent_args({"mglaunch", "prog"}, step_env(1), probe).options);
}

TEST_CASE("a Slurm node name that does not resolve is looked up with scontrol show node (its NodeAddr)") {
  const std::string dir = mgtest::make_temp_dir();
  const std::string args_file = dir + "/args";
  {  // a fake scontrol: records its arguments, answers like Slurm's, noise on stderr
    std::ofstream(dir + "/scontrol") << "#!/bin/sh\necho \"$@\" > " << args_file
                                     << "\necho 'NodeName=gpu-7 Arch=x86_64 CoresPerSocket=4'\n"
                                        "echo '   NodeAddr=127.0.0.7 NodeHostName=gpu-7 Version=23.02'\n"
                                        "echo 'scontrol: note' >&2\n";
    REQUIRE(::chmod((dir + "/scontrol").c_str(), 0755) == 0);
  }
  const char* old = std::getenv("PATH");
  const std::string saved = old ? old : "";
  ::setenv("PATH", (dir + ":/usr/bin:/bin").c_str(), 1);
  const auto found = mg::HardwareProbe::system().node_address("mg-no-such-node.invalid");
  std::ofstream(dir + "/scontrol") << "#!/bin/sh\necho 'slurm_load_node error: Unable to contact slurm controller' >&2\nexit 1\n";
  const auto failed = mg::HardwareProbe::system().node_address("mg-no-such-node.invalid");
  ::setenv("PATH", saved.c_str(), 1);
  CHECK(found.address == "127.0.0.7");
  CHECK_THAT(found.how, Catch::Contains("NodeAddr from scontrol show node"));
  std::ifstream args(args_file);
  std::string a((std::istreambuf_iterator<char>(args)), std::istreambuf_iterator<char>());
  CHECK(a == "show node mg-no-such-node.invalid\n");
  CHECK(failed.address == "mg-no-such-node.invalid");
  CHECK_THAT(failed.how, Catch::Contains("gave no NodeAddr"));
  std::filesystem::remove_all(dir);
}
