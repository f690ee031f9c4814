// The spec of one local rank (launcher/worker_spec.h): argv, environment, console and log files.
#include <catch2/catch.hpp>

#include <algorithm>

#include "launcher/worker_spec.h"

using namespace mg;

namespace {

RunPlan plan_of_two() {
  RunPlan plan;
  plan.run_id = "job7";
  plan.nnodes = 2;
  plan.node_rank = 1;
  plan.nproc_per_node = 2;
  plan.world_size = 4;
  plan.rank_offset = 2;
  plan.master_addr = "127.0.0.2";
  plan.master_port = 12345;
  plan.executable = "/bin/prog";
  plan.argv = {"prog", "--rank=${local_rank}"};
  return plan;
}

bool has_env(const WorkerSpec& s, const std::string& entry) {
  return std::find(s.env.begin(), s.env.end(), entry) != s.env.end();
}

SpecInputs inputs(int local_rank) {
  SpecInputs in;
  in.local_rank = local_rank;
  in.attempt = 2;
  in.dir = "/logs/job7/attempt_2/" + std::to_string(local_rank);
  return in;
}

}  // namespace

TEST_CASE("a worker's spec carries its rank and torchrun's environment with the error file in its attempt directory") {
  AgentOptions opts;
  opts.program_args = {"--rank=${local_rank}"};
  const auto s = make_worker_spec(plan_of_two(), opts, {{"HOME", "/root"}}, inputs(1));
  CHECK(s.local_rank == 1);
  CHECK(s.rank == 3);
  CHECK(s.executable == "/bin/prog");
  CHECK(s.prefix == "[rank3]:");
  CHECK(has_env(s, "HOME=/root"));
  CHECK(has_env(s, "RANK=3"));
  CHECK(has_env(s, "LOCAL_RANK=1"));
  CHECK(has_env(s, "TORCHELASTIC_RESTART_COUNT=2"));
  CHECK(has_env(s, "TORCHELASTIC_ERROR_FILE=/logs/job7/attempt_2/1/error.json"));
  CHECK(std::none_of(s.env.begin(), s.env.end(), [](const std::string& e) { return e.starts_with("MGLAUNCH_RUN_MARK="); }));
  CHECK(s.console[0]);
  CHECK(s.console[1]);
  CHECK(s.log_file[0].empty());
  CHECK(s.log_file[1].empty());
}

TEST_CASE("the watchdog's run mark is given to the worker when there is one") {
  AgentOptions opts;
  auto in = inputs(0);
  in.run_mark = "outer,inner";
  const auto s = make_worker_spec(plan_of_two(), opts, {}, in);
  CHECK(has_env(s, "MGLAUNCH_RUN_MARK=outer,inner"));
}

TEST_CASE("redirects take a stream off the console into its log file and tee copies it there") {
  AgentOptions opts;
  opts.redirects = parse_stream_spec("--redirects", "0:1");  // rank 0's stdout
  opts.tee = parse_stream_spec("--tee", "2");                // everyone's stderr
  const auto s0 = make_worker_spec(plan_of_two(), opts, {}, inputs(0));
  CHECK_FALSE(s0.console[0]);
  CHECK(s0.log_file[0] == "/logs/job7/attempt_2/0/stdout.log");
  CHECK(s0.console[1]);
  CHECK(s0.log_file[1] == "/logs/job7/attempt_2/0/stderr.log");
  const auto s1 = make_worker_spec(plan_of_two(), opts, {}, inputs(1));
  CHECK(s1.console[0]);
  CHECK(s1.log_file[0].empty());
  CHECK(s1.log_file[1] == "/logs/job7/attempt_2/1/stderr.log");
}

TEST_CASE("a rank outside the local ranks filter shows nothing on the console") {
  AgentOptions opts;
  opts.local_ranks_filter = {0};
  CHECK(make_worker_spec(plan_of_two(), opts, {}, inputs(0)).console[0]);
  const auto s = make_worker_spec(plan_of_two(), opts, {}, inputs(1));
  CHECK_FALSE(s.console[0]);
  CHECK_FALSE(s.console[1]);
}

TEST_CASE("one pipe serves both streams only when both go to the one console and to no file") {
  AgentOptions opts;
  auto in = inputs(0);
  in.merge_streams = true;
  CHECK(make_worker_spec(plan_of_two(), opts, {}, in).merge_streams);
  opts.tee = parse_stream_spec("--tee", "1");
  CHECK_FALSE(make_worker_spec(plan_of_two(), opts, {}, in).merge_streams);
  in.merge_streams = false;
  opts.tee = {};
  CHECK_FALSE(make_worker_spec(plan_of_two(), opts, {}, in).merge_streams);
}

TEST_CASE("the line prefix template names the role and ranks and an empty one relays raw lines") {
  AgentOptions opts;
  opts.role = "trainer";
  opts.log_line_prefix_template = "${role_name}-${rank}-${local_rank}|";
  CHECK(make_worker_spec(plan_of_two(), opts, {}, inputs(1)).prefix == "trainer-3-1|");
  opts.log_line_prefix_template = "";
  CHECK(make_worker_spec(plan_of_two(), opts, {}, inputs(1)).prefix.empty());
}

TEST_CASE("the line prefix template takes ${hostname} now and ${pid} once the worker runs") {
  AgentOptions opts;
  opts.log_line_prefix_template = "[${hostname}:${rank}:${pid}] ";
  const auto prefix = make_worker_spec(plan_of_two(), opts, {}, inputs(1)).prefix;
  CHECK(prefix == "[" + local_hostname() + ":3:" + std::string(kPrefixPidMark) + "] ");
  CHECK(replace_prefix_pid(prefix, 4242) == "[" + local_hostname() + ":3:4242] ");
  // $$ stays an escaped '$' (no pid there).
  opts.log_line_prefix_template = "$${pid}";
  CHECK(make_worker_spec(plan_of_two(), opts, {}, inputs(0)).prefix == "${pid}");
}

TEST_CASE("a stream both redirected and tee'd reaches the console and its file, as torchrun adds tee on top") {
  AgentOptions opts;
  opts.redirects = parse_stream_spec("--redirects", "3");
  opts.tee = parse_stream_spec("--tee", "1");  // stdout only
  const auto s = make_worker_spec(plan_of_two(), opts, {}, inputs(0));
  CHECK(s.console[0]);
  CHECK(s.log_file[0] == "/logs/job7/attempt_2/0/stdout.log");
  CHECK_FALSE(s.console[1]);  // redirected, not tee'd: the file only
  CHECK(s.log_file[1] == "/logs/job7/attempt_2/0/stderr.log");
  opts.local_ranks_filter = {1};  // the filter still hides a tee'd rank from the console
  CHECK_FALSE(make_worker_spec(plan_of_two(), opts, {}, inputs(0)).console[0]);
}

TEST_CASE("duplicate filters tap the stdout and stderr of tee'd, shown ranks into the attempt's filtered logs") {
  AgentOptions opts;
  opts.duplicate_filters[0] = {"apple"};
  CHECK_FALSE(make_worker_spec(plan_of_two(), opts, {}, inputs(0)).tap[0]);  // nothing tee'd: no copy
  opts.tee = parse_stream_spec("--tee", "0:1");
  CHECK(make_worker_spec(plan_of_two(), opts, {}, inputs(0)).tap[0]);
  CHECK_FALSE(make_worker_spec(plan_of_two(), opts, {}, inputs(0)).tap[1]);  // no stderr filters
  CHECK_FALSE(make_worker_spec(plan_of_two(), opts, {}, inputs(1)).tap[0]);  // rank 1 is not tee'd
  opts.local_ranks_filter = {1};
  CHECK_FALSE(make_worker_spec(plan_of_two(), opts, {}, inputs(0)).tap[0]);  // not shown: not copied (torch)
}
