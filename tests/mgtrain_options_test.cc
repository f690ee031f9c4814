// mgtrain's pure option, environment and mode rules (no torch, no process).
#include <catch2/catch.hpp>

#include "worker/options.h"

using namespace mg::train;

namespace {
Options parse(std::vector<const char*> args) {
  args.insert(args.begin(), "mgtrain");
  return parse_options(static_cast<int>(args.size()), args.data()).options;
}
}  // namespace

TEST_CASE("mgtrain's DDP flags parse with DDP's defaults") {
  auto d = parse({});
  CHECK(d.broadcast_buffers);
  CHECK_FALSE(d.find_unused_parameters);
  CHECK_FALSE(d.static_graph);
  CHECK_FALSE(d.sync_batchnorm);
  CHECK(d.mode == "auto");
  auto o = parse({"--find-unused-parameters", "--static-graph", "--no-broadcast-buffers", "--sync-batchnorm", "--model",
                  "resnet", "--mode", "data-parallel"});
  CHECK(o.find_unused_parameters);
  CHECK(o.static_graph);
  CHECK_FALSE(o.broadcast_buffers);
  CHECK(o.sync_batchnorm);
  CHECK(o.model == "resnet");
  CHECK(o.mode == "ddp");  // the guides' DataParallel maps to DDP
}

TEST_CASE("mgtrain --step-ms sets a sleep after each step, off by default, never negative") {
  CHECK(parse({}).step_ms == 0);
  CHECK(parse({"--step-ms", "50"}).step_ms == 50);
  CHECK_THROWS_AS(parse({"--step-ms", "-1"}), UsageError);
}

TEST_CASE("mgtrain's bad flags are usage errors that point at --help") {
  CHECK_THROWS_AS(parse({"--model", "resnet50"}), UsageError);
  CHECK_THROWS_WITH(parse({"--mode", "threads"}), Catch::Contains("--help"));
  CHECK_THROWS_WITH(parse({"--reducer", "c10d", "--comm-dtype", "bf16"}), Catch::Contains("--reducer mgtrain"));
  CHECK_THROWS_WITH(parse({"--max-bytes", "12X"}), Catch::Contains("bad byte size '12X'"));
  CHECK(parse_bytes("64K") == 64 * 1024);
  CHECK(parse_bytes("1.5M") == 3 * 512 * 1024);
}

TEST_CASE("the training mode is single without a launcher and ddp under one") {
  Options o;
  auto bare = read_env({});
  CHECK_FALSE(bare.launched);
  CHECK(resolve_mode(o, bare) == Mode::single);
  auto one = read_env({{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "41234"}});
  CHECK(resolve_mode(o, one) == Mode::ddp);
  CHECK_FALSE(read_env({}).agent_store);
  CHECK(read_env({{"TORCHELASTIC_USE_AGENT_STORE", "True"}}).agent_store);
  CHECK_FALSE(read_env({{"TORCHELASTIC_USE_AGENT_STORE", "False"}}).agent_store);
  // USE_LIBUV as torch 2.x's env:// reads it: "1" is libuv, anything else the classic store.
  CHECK_FALSE(read_env({}).use_libuv.has_value());
  CHECK(read_env({{"USE_LIBUV", "1"}}).use_libuv == true);
  CHECK(read_env({{"USE_LIBUV", "0"}}).use_libuv == false);
  auto two = read_env({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "41234"}});
  CHECK(two.rank == 1);
  CHECK(resolve_mode(o, two) == Mode::ddp);
  o.mode = "ddp";
  CHECK(resolve_mode(o, bare) == Mode::ddp);
  o.mode = "single";
  CHECK(resolve_mode(o, one) == Mode::single);
  CHECK_THROWS_WITH(resolve_mode(o, two), Catch::Contains("--mode single with WORLD_SIZE=2"));
  o.mode = "auto";
  o.bench = "allreduce";  // the benchmark needs a process group even alone
  CHECK(resolve_mode(o, bare) == Mode::ddp);
}

TEST_CASE("a torchrun environment that does not add up is a usage error") {
  CHECK_THROWS_WITH(read_env({{"RANK", "2"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "1"}}), Catch::Contains("RANK=2 WORLD_SIZE=2"));
  CHECK_THROWS_WITH(read_env({{"RANK", "0"}, {"WORLD_SIZE", "2"}}), Catch::Contains("MASTER_PORT is not set"));
  CHECK_THROWS_WITH(read_env({{"WORLD_SIZE", "two"}}), Catch::Contains("WORLD_SIZE='two' is not an integer"));
}

TEST_CASE("mgtrain's range errors read like the other errors, without a 300-digit bound") {
  for (const char* flag : {"--epochs", "--batch-size", "--timeout", "--grad-accum", "--bucket-cap-mb", "--synthetic-size"}) {
    INFO(flag);
    try {
      parse({flag, "0"});
      FAIL("expected a UsageError");
    } catch (const UsageError& e) {
      const std::string what = e.what();
      CHECK_THAT(what, Catch::Contains(flag) && Catch::Contains("'0' must be greater than 0"));
      CHECK(what.size() < 200);
    }
  }
  CHECK_THROWS_WITH(parse({"--epochs", "x"}), Catch::Contains("'x' is not a number"));
  CHECK(parse({"--epochs", "3"}).epochs == 3);
}

TEST_CASE("mgtrain refuses, with --cuda-graphs and before training, what a captured step cannot hold") {
  CHECK(parse({"--cuda-graphs"}).cuda_graphs);
  CHECK(parse({"--cuda-graphs", "--static-graph", "--amp"}).cuda_graphs);
  CHECK_THROWS_WITH(parse({"--cuda-graphs", "--find-unused-parameters"}), Catch::Contains("--static-graph"));
  CHECK_THROWS_WITH(parse({"--cuda-graphs", "--grad-accum", "2"}), Catch::Contains("--grad-accum"));
  CHECK_THROWS_WITH(parse({"--cuda-graphs", "--clip-grad-norm", "1"}), Catch::Contains("--clip-grad-norm"));
  CHECK_THROWS_WITH(parse({"--cuda-graphs", "--sync-batchnorm"}), Catch::Contains("--sync-batchnorm"));
  CHECK_THROWS_WITH(parse({"--cuda-graphs", "--reducer", "c10d"}), Catch::Contains("--reducer mgtrain"));
  CHECK_THROWS_AS(parse({"--cuda-graphs", "--bench", "allreduce"}), UsageError);
  CHECK_THROWS_WITH(parse({"--cuda-graphs", "--backend", "gloo"}), Catch::Contains("needs a GPU"));
}

TEST_CASE("MGLAUNCH_EPOCH is read as the round's epoch, unset or empty is none, anything but a non-negative integer a usage error") {
  CHECK_FALSE(read_env({}).epoch.has_value());
  CHECK_FALSE(read_env({{"MGLAUNCH_EPOCH", ""}}).epoch.has_value());
  CHECK(read_env({{"MGLAUNCH_EPOCH", "0"}}).epoch == 0);
  CHECK(read_env({{"MGLAUNCH_EPOCH", "9000000000"}}).epoch == 9000000000LL);
  for (const char* bad : {"x", "-1", "7.5", "7 ", "99999999999999999999"}) {
    INFO(bad);
    CHECK_THROWS_WITH(read_env({{"MGLAUNCH_EPOCH", bad}}),
                      Catch::StartsWith(std::string("MGLAUNCH_EPOCH='") + bad + "' is not a non-negative integer"));
  }
}

TEST_CASE("MGLAUNCH_RUN is read as the round's rendezvous run (MS-HEX), unset or empty is none, anything else a usage error, and runs order by their time, then their hex") {
  CHECK(read_env({}).run.empty());
  CHECK(read_env({{"MGLAUNCH_RUN", ""}}).run.empty());
  CHECK(read_env({{"MGLAUNCH_RUN", "1700000000000-00ab"}}).run == "1700000000000-00ab");
  for (const char* bad : {"x", "1700000000000", "-ab", "17-", "17-AB", "17-ab ", "17-ab-cd", "123456789012345678901-ab"}) {
    INFO(bad);
    CHECK_THROWS_WITH(read_env({{"MGLAUNCH_RUN", bad}}),
                      Catch::StartsWith(std::string("MGLAUNCH_RUN='") + bad + "' is not MS-HEX"));
  }
  CHECK(run_before("1700000000000-ff", "1700000000001-00"));
  CHECK(run_before("999-ff", "1000-00"));  // by the number, not the text
  CHECK(run_before("0999-ff", "1000-00"));
  CHECK(run_before("1000-0a", "1000-0b"));
  CHECK_FALSE(run_before("1000-0b", "1000-0b"));
  CHECK_FALSE(run_before("1700000000001-00", "1700000000000-ff"));
}

TEST_CASE("checkpoints order by run (none recorded first, then by the run's time), then epoch, then step, and --checkpoint-take-over places the named run just below this run") {
  const std::string r1 = "1700000000000-01", r2 = "1700000000005-02", ahead = "4102444800000-ff";  // ahead: 2100
  const CheckpointKey none_e9{"", 9, 500, ""}, r1_e1{r1, 1, 4, ""}, r1_e1_s8{r1, 1, 8, ""}, r1_e2_s2{r1, 2, 2, ""},
      r2_e1{r2, 1, 2, ""}, ahead_e3{ahead, 3, 40, ""};
  // An older run's checkpoint is older than any of a newer run's, whatever its epoch and step.
  CHECK(older_checkpoint(none_e9, r1_e1));
  CHECK(older_checkpoint(r1_e2_s2, r2_e1));
  CHECK_FALSE(older_checkpoint(r2_e1, r1_e2_s2));
  // Within a run: the epoch first (a newer round with fewer steps wins), then the step.
  CHECK(older_checkpoint(r1_e1_s8, r1_e2_s2));
  CHECK(older_checkpoint(r1_e1, r1_e1_s8));
  CHECK_FALSE(older_checkpoint(r1_e1_s8, r1_e1_s8));
  CHECK(older_checkpoint(CheckpointKey{"", -1, 3, ""}, CheckpointKey{"", -1, 4, ""}));  // unfenced: by step
  // A run minted ahead is the newest ...
  CHECK(older_checkpoint(r2_e1, ahead_e3, r2));
  // ... unless this run takes it over: then it stands just below this run, above the rest.
  CHECK(older_checkpoint(ahead_e3, r2_e1, r2, ahead));
  CHECK_FALSE(older_checkpoint(r2_e1, ahead_e3, r2, ahead));
  CHECK(older_checkpoint(r1_e2_s2, ahead_e3, r2, ahead));
  CHECK(older_checkpoint(none_e9, ahead_e3, r2, ahead));
  CHECK(older_checkpoint(ahead_e3, CheckpointKey{ahead, 3, 41, ""}, r2, ahead));
  CHECK(older_checkpoint(r2_e1, ahead_e3, "", ahead));  // no run of its own: nothing to place it under
}

// Review s38 H1, L3, M1: a take-over a checkpoint records (supersedes=T) places T just below
// the run that took it over for every later run too, not above every run; a job with no run
// of its own orders by step. On main (7218327) there was no such order: T, dated 2100, was
// the newest for every later run without the flag, and a run-stamped checkpoint beat a
// later one recorded without a run.
TEST_CASE("a run a checkpoint records as taken over ranks just below the run that took it over, for later runs too, and a job without a run orders checkpoints by step") {
  const std::string q = "1700000000000-01", r = "1700000000005-02", r2 = "1700000000009-03", t = "4102444800000-ff";
  const Supersessions taken{{t, r}};
  const CheckpointKey t_e3{t, 3, 900, ""}, r_e1{r, 1, 906, t}, r_e1_s2{r, 1, 2, t}, q_e9{q, 9, 950, ""}, r2_e1{r2, 1, 4, ""};
  CHECK(older_checkpoint(t_e3, r_e1, taken, CheckpointOrder::kByRun));   // T's step 900 below R's step 906 (L3)
  CHECK(older_checkpoint(t_e3, r_e1_s2, taken, CheckpointOrder::kByRun));  // and below any of R's
  CHECK_FALSE(older_checkpoint(r_e1_s2, t_e3, taken, CheckpointOrder::kByRun));
  CHECK(older_checkpoint(q_e9, t_e3, taken, CheckpointOrder::kByRun));   // above a run older than R
  CHECK(older_checkpoint(t_e3, r2_e1, taken, CheckpointOrder::kByRun));  // below a later run without the flag (H1)
  CHECK(older_checkpoint(r2_e1, t_e3, Supersessions{}, CheckpointOrder::kByRun));  // unrecorded: T is the newest
  // No run of its own (torchrun, an agent before #37): by step alone (M1).
  const CheckpointKey none_s500{"", -1, 500, ""}, r_e4_s100{r, 4, 100, ""};
  CHECK(older_checkpoint(r_e4_s100, none_s500, Supersessions{}, CheckpointOrder::kByStep));
  CHECK_FALSE(older_checkpoint(none_s500, r_e4_s100, Supersessions{}, CheckpointOrder::kByStep));
}

// Review s38 M5: a job with MGLAUNCH_EPOCH but no MGLAUNCH_RUN (an agent after #34, before
// #37) ordered by step alone (b3002f8), so on node-local directories a cut-off side's epoch-6
// checkpoint at step 150 beat the majority's epoch-7 one at step 120 and stale training was
// resumed. On main (787f061) the census passed by_step = no run, whatever the epoch.
TEST_CASE("a job with an epoch but no run orders checkpoints by epoch, then step, and by step alone only with neither") {
  CHECK(checkpoint_order(true, true) == CheckpointOrder::kByRun);
  CHECK(checkpoint_order(false, true) == CheckpointOrder::kByEpoch);
  CHECK(checkpoint_order(false, false) == CheckpointOrder::kByStep);
  const CheckpointKey cut_off{"", 6, 150, ""}, majority{"", 7, 120, ""}, majority_s130{"", 7, 130, ""};
  const auto epoch_only = checkpoint_order(false, true);
  CHECK(older_checkpoint(cut_off, majority, Supersessions{}, epoch_only));
  CHECK_FALSE(older_checkpoint(majority, cut_off, Supersessions{}, epoch_only));
  CHECK(older_checkpoint(majority, majority_s130, Supersessions{}, epoch_only));
  // Epoch first whatever the run (the lock, refuses(), compares epochs alone without a run too).
  CHECK(older_checkpoint(CheckpointKey{"1700000000005-02", 3, 400, ""}, majority, Supersessions{}, epoch_only));
  CHECK(older_checkpoint(CheckpointKey{"", -1, 900, ""}, majority, Supersessions{}, epoch_only));  // torchrun's: none
}

TEST_CASE("a run's time against this host's clock, and --checkpoint-take-over takes a run (MS-HEX) or is exit 2") {
  CHECK(run_ahead_ms("1700000060000-ab", 1700000000000) == 60000);
  CHECK(run_ahead_ms("1700000000000-ab", 1700000060000) == -60000);
  CHECK(run_ahead_ms("99999999999999999999-ab", 0) == 0);  // past int64: no claim
  CHECK(parse({}).checkpoint_take_over.empty());
  CHECK(parse({"--checkpoint-take-over", "4102444800000-ff"}).checkpoint_take_over == "4102444800000-ff");
  for (const char* bad : {"x", "4102444800000", "41-FF"}) {
    INFO(bad);
    CHECK_THROWS_WITH(parse({"--checkpoint-take-over", bad}),
                      Catch::StartsWith(std::string("--checkpoint-take-over '") + bad + "' is not MS-HEX"));
  }
}

TEST_CASE("mgtrain --in-place-recovery on an NCCL build starts mgtrain again with TORCH_NCCL_ASYNC_ERROR_HANDLING=2, never a setenv") {
  const std::map<std::string, std::string> vars{{"RANK", "1"}, {"TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"}};
  Options o = parse({"--in-place-recovery"});
  auto env = environment_to_reexec(o, vars, true);
  REQUIRE(env.has_value());
  CHECK(env->at("TORCH_NCCL_ASYNC_ERROR_HANDLING") == "2");
  CHECK(env->at("RANK") == "1");  // everything else as it was
  CHECK(env->size() == vars.size());
  CHECK(environment_to_reexec(o, {}, true)->at("TORCH_NCCL_ASYNC_ERROR_HANDLING") == "2");
  // Already there (the second start), a CPU build, Gloo, or no recovery: no new start.
  CHECK_FALSE(environment_to_reexec(o, *env, true).has_value());
  CHECK_FALSE(environment_to_reexec(o, vars, false).has_value());
  CHECK_FALSE(environment_to_reexec(parse({"--in-place-recovery", "--backend", "gloo"}), vars, true).has_value());
  CHECK_FALSE(environment_to_reexec(parse({}), vars, true).has_value());
}
