#include <catch2/catch.hpp>

#include <nlohmann/json.hpp>

#include "cli/errors.h"
#include "launcher/options.h"
#include "launcher/plan.h"
#include "proto/limits.h"
#include "rendezvous/endpoint.h"
#include "process/command.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

using namespace mg;

namespace {

RunPlan two_node_plan(int node_rank) {
  RunPlan plan;
  plan.run_id = "job7";
  plan.nnodes = 2;
  plan.node_rank = node_rank;
  plan.nproc_per_node = 4;
  plan.world_size = 8;
  plan.rank_offset = node_rank * 4;
  plan.master_addr = "127.0.0.2";
  plan.master_port = 12345;
  plan.executable = "/bin/prog";
  plan.argv = {"prog", "--rank=${local_rank}", "x"};
  return plan;
}

}  // namespace

TEST_CASE("the worker environment follows torchrun's contract") {
  AgentOptions opts;
  opts.max_restarts = 3;
  opts.program_args = {"--rank=${local_rank}", "x"};
  RunPlan plan = two_node_plan(1);
  EnvMap env = build_contract_env(plan, opts, {}, 2, 1, "/logs/error.json");
  CHECK(env.at("RANK") == "6");
  CHECK(env.at("LOCAL_RANK") == "2");
  CHECK(env.at("WORLD_SIZE") == "8");
  CHECK(env.at("LOCAL_WORLD_SIZE") == "4");
  CHECK(env.at("GROUP_RANK") == "1");
  CHECK(env.at("GROUP_WORLD_SIZE") == "2");
  CHECK(env.at("ROLE_NAME") == "default");
  CHECK(env.at("ROLE_RANK") == "6");
  CHECK(env.at("ROLE_WORLD_SIZE") == "8");
  CHECK(env.at("MASTER_ADDR") == "127.0.0.2");
  CHECK(env.at("MASTER_PORT") == "12345");
  CHECK(env.at("TORCHELASTIC_RUN_ID") == "job7");
  CHECK(env.at("TORCHELASTIC_RESTART_COUNT") == "1");
  CHECK(env.at("TORCHELASTIC_MAX_RESTARTS") == "3");
  CHECK(env.at("TORCHELASTIC_ERROR_FILE") == "/logs/error.json");
  CHECK(env.at("TORCHELASTIC_USE_AGENT_STORE") == "False");
  CHECK(env.at("NCCL_ASYNC_ERROR_HANDLING") == "1");
  CHECK(env.at("TORCH_NCCL_ASYNC_ERROR_HANDLING") == "1");
  CHECK_FALSE(env.contains("OMP_NUM_THREADS"));
  CHECK_FALSE(env.contains("CUDA_VISIBLE_DEVICES"));
}

TEST_CASE("workers see the round's epoch as MGLAUNCH_EPOCH and its run as MGLAUNCH_RUN, and no such variables without them (#34, #37)") {
  AgentOptions opts;
  RunPlan plan = two_node_plan(1);
  CHECK_FALSE(build_contract_env(plan, opts, {}, 0, 0, "e").contains("MGLAUNCH_EPOCH"));
  plan.epoch = 12;
  CHECK(build_contract_env(plan, opts, {}, 0, 0, "e").at("MGLAUNCH_EPOCH") == "12");
  // Its run beside it (#37), when the rendezvous told one.
  CHECK_FALSE(build_contract_env(plan, opts, {}, 0, 0, "e").contains("MGLAUNCH_RUN"));
  plan.run = "1700000000000-00000000000000ab";
  CHECK(build_contract_env(plan, opts, {}, 0, 0, "e").at("MGLAUNCH_RUN") == plan.run);
}

TEST_CASE("user settings of NCCL error handling are kept and gpu ids map per local rank") {
  AgentOptions opts;
  opts.gpu_ids = {4, 6, 1, 0};
  RunPlan plan = two_node_plan(0);
  plan.set_omp_threads = true;
  EnvMap env = build_contract_env(plan, opts, {{"NCCL_ASYNC_ERROR_HANDLING", "0"}}, 1, 0, "e");
  CHECK(env.at("NCCL_ASYNC_ERROR_HANDLING") == "0");
  CHECK(env.at("CUDA_VISIBLE_DEVICES") == "6");
  CHECK(env.at("OMP_NUM_THREADS") == "1");
}

TEST_CASE("workers on torch 2.x get no NCCL_ASYNC_ERROR_HANDLING, and the agent store is announced when served") {
  AgentOptions opts;
  RunPlan plan = two_node_plan(0);
  plan.torch_major = 2;
  plan.torch_minor = 6;
  plan.agent_store = true;
  EnvMap env = build_contract_env(plan, opts, {}, 0, 0, "e");
  CHECK_FALSE(env.contains("NCCL_ASYNC_ERROR_HANDLING"));  // torch 2.x warns about the 1.x name
  CHECK(env.at("TORCH_NCCL_ASYNC_ERROR_HANDLING") == "1");
  CHECK(env.at("TORCHELASTIC_USE_AGENT_STORE") == "True");
  CHECK(env.at("USE_LIBUV") == "0");  // the classic client: Debian's torch 2.x has no libuv
  CHECK(build_contract_env(plan, opts, {{"USE_LIBUV", "1"}}, 0, 0, "e").at("USE_LIBUV") == "1");
  plan.agent_store = false;
  CHECK_FALSE(build_contract_env(plan, opts, {}, 0, 0, "e").contains("USE_LIBUV"));
  plan.torch_minor = 1;  // torch 2.0 and 2.1 read only the 1.x name
  CHECK(build_contract_env(plan, opts, {}, 0, 0, "e").at("NCCL_ASYNC_ERROR_HANDLING") == "1");
  plan.torch_major = 1;
  CHECK(build_contract_env(plan, opts, {}, 0, 0, "e").at("NCCL_ASYNC_ERROR_HANDLING") == "1");
}

TEST_CASE("worker argv substitutes local_rank only in the program's arguments") {
  AgentOptions opts;
  opts.program_args = {"--rank=${local_rank}", "x"};
  RunPlan plan = two_node_plan(0);
  CHECK(build_worker_argv(plan, opts, 3) == std::vector<std::string>{"prog", "--rank=3", "x"});
  opts.local_rank_arg = true;
  CHECK(build_worker_argv(plan, opts, 1) == std::vector<std::string>{"prog", "--local_rank=1", "--rank=1", "x"});
}

TEST_CASE("programs are resolved like execvp and missing ones are reported") {
  CHECK(find_executable("sh", "/nonexistent:/bin:/usr/bin") == "/bin/sh");
  CHECK(find_executable("/bin/sh", "") == "/bin/sh");
  CHECK(find_executable("no-such-program-xyz", "/bin:/usr/bin").empty());
  char tmpl[] = "/tmp/mg_noexec_XXXXXX";
  int fd = ::mkstemp(tmpl);  // mode 0600: not executable
  ::close(fd);
  CHECK(find_executable(tmpl, "").empty());
  ::unlink(tmpl);
  AgentOptions opts;
  opts.program = "no-such-program-xyz";
  CHECK_THROWS_AS(make_plan(opts, {{"PATH", "/bin"}}), ProgramNotFound);
  opts.program = "missing_script.py";
  CHECK_THROWS_AS(make_plan(opts, {{"PATH", "/bin:/usr/bin"}}), ProgramNotFound);
  opts.program = "sh";
  opts.python = "no-such-python";
  opts.module = true;
  CHECK_THROWS_AS(make_plan(opts, {{"PATH", "/bin"}}), ProgramNotFound);
}

TEST_CASE("a .py program runs under python -u, -m as a module, others directly") {
  AgentOptions opts;
  opts.python = "sh";  // any interpreter found on PATH
  opts.master_port = 0;
  opts.program = "-c";
  opts.module = true;
  auto plan = make_plan(opts, {{"PATH", "/bin:/usr/bin"}});
  CHECK(plan.argv == std::vector<std::string>{"sh", "-u", "-m", "-c"});
  opts.module = false;
  opts.program = "true";
  plan = make_plan(opts, {{"PATH", "/bin:/usr/bin"}});
  CHECK(plan.argv == std::vector<std::string>{"true"});
  CHECK(plan.master_port > 0);  // --master_port=0 picks a free port
}

TEST_CASE("a dry run of a multi-node c10d job shows what it asked for and leaves the rest to the rendezvous (#22)") {
  auto parsed = parse_agent_args({"mglaunch", "--nnodes=2", "--node_rank=1", "--nproc_per_node=2",
                                  "--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:1", "--dry-run", "/bin/true"},
                                 {}, HardwareProbe{[] { return 0; }, [] { return 2; }});
  REQUIRE(parsed.options);
  const auto& o = *parsed.options;
  const RunPlan plan = make_plan(o, {});
  CHECK(plan.master_port == 0);  // nothing bound for a dry run
  auto j = plan_to_json(plan, o, {});
  INFO(j.dump(2));
  CHECK(j["node_rank"] == 1);
  CHECK(j["master_addr"] == kDecidedAtRendezvous);
  CHECK(j["world_size"] == kDecidedAtRendezvous);
  CHECK(j["workers"][1]["rank"] == kDecidedAtRendezvous);
  CHECK(j["workers"][1]["env"]["RANK"] == kDecidedAtRendezvous);
  CHECK(j["workers"][1]["env"]["MASTER_ADDR"] == kDecidedAtRendezvous);
  CHECK(j["workers"][1]["env"]["LOCAL_RANK"] == "1");
  // Without --node_rank the node's place is the rendezvous's too; an elastic range is shown as given.
  parsed = parse_agent_args({"mglaunch", "--nnodes=1:3", "--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:1",
                             "--dry-run", "/bin/true"},
                            {}, HardwareProbe{[] { return 0; }, [] { return 2; }});
  j = plan_to_json(make_plan(*parsed.options, {}), *parsed.options, {});
  CHECK(j["node_rank"] == kDecidedAtRendezvous);
  CHECK(j["nnodes"] == "1:3");
  CHECK(j["workers"][0]["env"]["GROUP_WORLD_SIZE"] == kDecidedAtRendezvous);
  // A static or single-node plan knows everything.
  parsed = parse_agent_args({"mglaunch", "--nnodes=2", "--node_rank=1", "--nproc_per_node=2", "--master_port=0",
                             "--dry-run", "/bin/true"},
                            {}, HardwareProbe{[] { return 0; }, [] { return 2; }});
  j = plan_to_json(make_plan(*parsed.options, {}), *parsed.options, {});
  CHECK(j["workers"][1]["env"]["RANK"] == "3");
  CHECK(j["node_rank"] == 1);
}

TEST_CASE("a master port already in use is a usage error naming the port") {
  AgentOptions opts;
  opts.program = "true";
  opts.master_addr = "127.0.0.1";
  // Hold a listening socket on a port the kernel picked.
  int port = rdzv::find_free_port("127.0.0.1");
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0);
  REQUIRE(::listen(fd, 1) == 0);
  opts.master_port = port;
  try {
    make_plan(opts, {{"PATH", "/bin:/usr/bin"}});
    FAIL("expected a UsageError");
  } catch (const UsageError& e) {
    CHECK_THAT(e.what(), Catch::Contains(std::to_string(port)));
  }
  ::close(fd);
  CHECK_NOTHROW(make_plan(opts, {{"PATH", "/bin:/usr/bin"}}));
}

TEST_CASE("endpoints parse host, port and IPv6 forms") {
  CHECK(rdzv::parse_endpoint("node1:12345", 1).port == 12345);
  CHECK(rdzv::parse_endpoint("node1", 4321).port == 4321);
  CHECK(rdzv::parse_endpoint("[::1]:80", 1).host == "::1");
  CHECK(rdzv::parse_endpoint("::1", 7).port == 7);
  CHECK_THROWS_AS(rdzv::parse_endpoint("host:", 1), std::invalid_argument);
  CHECK_THROWS_AS(rdzv::parse_endpoint("host:99999", 1), std::invalid_argument);
  CHECK_THROWS_AS(rdzv::parse_endpoint(":80", 1), std::invalid_argument);
  CHECK_THROWS_AS(rdzv::parse_endpoint("", 1), std::invalid_argument);
}

TEST_CASE("a static --rdzv_endpoint without a port uses --master_port") {
  AgentOptions opts;
  opts.program = "true";
  opts.rdzv_endpoint = "127.0.0.1";
  opts.master_port = rdzv::find_free_port("127.0.0.1");
  auto plan = make_plan(opts, {{"PATH", "/bin:/usr/bin"}});
  CHECK(plan.master_addr == "127.0.0.1");
  CHECK(plan.master_port == opts.master_port);
  CHECK(plan.rdzv_endpoint == "127.0.0.1:" + std::to_string(opts.master_port));
}

TEST_CASE("endpoints with more than one ':' must be IPv6 addresses, and hosts must be host names") {
  CHECK_THROWS_WITH(rdzv::parse_endpoint("a:b:c", 1), Catch::Contains("[IPv6]:PORT"));
  CHECK_THROWS_WITH(rdzv::parse_endpoint("::1:41235", 1), Catch::Contains("not an IPv6 address"));
  CHECK_THROWS_WITH(rdzv::parse_endpoint("[fe80::zz]:1", 1), Catch::Contains("not an IPv6 address"));
  CHECK_THROWS_WITH(rdzv::parse_endpoint("bad host:1", 1), Catch::Contains("not a host name"));
  CHECK_THROWS_WITH(rdzv::parse_endpoint("a..b:1", 1), Catch::Contains("not a host name"));
  CHECK(rdzv::parse_endpoint("::1", 7).host == "::1");
  CHECK(rdzv::parse_endpoint("[::1]:41236", 7).port == 41236);
  CHECK(rdzv::parse_endpoint("node-01.cluster_a.example.:5", 7).host == "node-01.cluster_a.example.");
  CHECK(rdzv::parse_endpoint("127.0.0.5:0", 7).port == 0);
  CHECK_FALSE(rdzv::host_problem("localhost"));
  CHECK(rdzv::host_problem(""));
}

TEST_CASE("virtual local rank: --virtual-local-rank makes every worker local rank 0 of its own one GPU") {
  AgentOptions opts;
  opts.nproc_per_node = 4;
  opts.virtual_local_rank = true;
  RunPlan plan = two_node_plan(1);
  // No GPU list anywhere: GPU N for local rank N.
  EnvMap env = build_contract_env(plan, opts, {}, 2, 0, "e");
  CHECK(env.at("LOCAL_RANK") == "0");
  CHECK(env.at("RANK") == std::to_string(plan.rank_offset + 2));  // the global rank stays
  CHECK(env.at("CUDA_VISIBLE_DEVICES") == "2");
  // The local rank's entry of the inherited CUDA_VISIBLE_DEVICES.
  env = build_contract_env(plan, opts, {{"CUDA_VISIBLE_DEVICES", "4,5,GPU-abc,7"}}, 2, 0, "e");
  CHECK(env.at("CUDA_VISIBLE_DEVICES") == "GPU-abc");
  env = build_contract_env(plan, opts, {{"CUDA_VISIBLE_DEVICES", "4,5,6,7"}}, 0, 0, "e");
  CHECK(env.at("CUDA_VISIBLE_DEVICES") == "4");
  // --gpu_ids names it.
  opts.gpu_ids = {3, 1, 0, 2};
  env = build_contract_env(plan, opts, {{"CUDA_VISIBLE_DEVICES", "4,5,6,7"}}, 1, 0, "e");
  CHECK(env.at("CUDA_VISIBLE_DEVICES") == "1");
  CHECK(env.at("LOCAL_RANK") == "0");
  // Off: the real local rank.
  opts.virtual_local_rank = false;
  CHECK(build_contract_env(plan, opts, {}, 1, 0, "e").at("LOCAL_RANK") == "1");
}

// Review s39-late H3: a pod restarted (PID 1, the pod name as host name) or a service started
// again after a reboot has the same host and pid. Its agent id must still be new, or the job
// counts the restarted agent as its former voter.
TEST_CASE("two starts of the agent on the same host with the same pid never present the same agent id, and it names "
          "host and pid") {
  const std::string first = new_agent_id("pod-0", 1);
  const std::string again = new_agent_id("pod-0", 1);
  CHECK(first != again);
  for (const std::string& id : {first, again}) {
    REQUIRE(id.size() == std::string("pod-0:1:").size() + 16);
    CHECK(id.starts_with("pod-0:1:"));
    CHECK(id.find_first_not_of("0123456789abcdef", 8) == std::string::npos);
  }
  // A host name too long for the id is cut, never the part that tells two starts apart.
  const std::string id = new_agent_id(std::string(300, 'h'), 4194304);
  CHECK(id.size() == mg::proto::kMaxIdBytes);
  CHECK(id.substr(id.size() - 25, 9) == ":4194304:");
  CHECK(new_agent_id(std::string(300, 'h'), 4194304) != id);
}
