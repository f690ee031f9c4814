// mgtrain --in-place-recovery with real processes, against tests/inplace_agent.py, a
// stand-in agent speaking the worker side of docs/in-place-recovery.md: a worker SIGKILLed
// or hung (SIGSTOP) at step 10 or later is replaced, the survivor rebuilds its group
// without exiting, and the final weights equal an undisturbed run's.
#include <catch2/catch.hpp>

#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "support/proc.h"
#include "support/rdzv_fixture.h"

using namespace mgtest;
using namespace std::chrono_literals;

// The file's own names (mgtrain_tests is one unity unit of its four files: tests/CMakeLists.txt).
namespace mgtrain_recovery_test {

namespace {

const std::string kMgtrain = MGTRAIN_BIN;
const std::string kAgent = kSourceDir + "/tests/inplace_agent.py";
const std::string kStoreServe = STORE_SERVE_BIN;  // the stand-in agent's store (store/), no torch imported

struct Run {
  Result r;
  std::string dir;
  nlohmann::json summary(int rank) const {
    return nlohmann::json::parse(read_file(dir + "/s" + std::to_string(rank) + ".json"));
  }
  std::string logs() const {
    std::string all;
    for (const char* f : {"/worker0.0.log", "/worker1.0.log", "/worker0.1.log", "/worker1.1.log"}) all += read_file(dir + f);
    return all;
  }
};

// The weights of an undisturbed run, trained once per ctest run and shared by the cases that
// compare with it (#36: six cases each trained the same world-2 or world-3 job first). `name`
// names the run (its job and world); the first case to need it trains it with `calm` (which
// returns its rank 0's summary, or fails that case), holding an flock, and leaves the summary
// in the build's tests/mgtrain_references for the others. The file is keyed by the
// mgtrain binary (size and mtime) and by the process that started the case (its pid and
// start time: one ctest run), so a rebuilt mgtrain or the next ctest run trains it again, and
// a failed training leaves nothing behind: the next case trains it itself.
nlohmann::json undisturbed(const std::string& name, const std::function<nlohmann::json()>& calm) {
  const std::filesystem::path dir = std::filesystem::path(kMgtrain).parent_path().parent_path() / "tests" / "mgtrain_references";
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  struct stat st {};
  if (ec || ::stat(kMgtrain.c_str(), &st) != 0) return calm();
  // /proc/PPID/stat: the 22nd field, the start time, counts from the last ')' (field 2's end).
  const std::string stat = read_file("/proc/" + std::to_string(::getppid()) + "/stat");
  std::istringstream rest(stat.substr(std::min(stat.size(), stat.rfind(')') + 1)));
  std::string field, started;
  for (int i = 3; i <= 22 && rest >> field; ++i) started = field;
  const std::string key = name + "-" + std::to_string(st.st_size) + "-" + std::to_string(st.st_mtim.tv_sec) + "." +
                          std::to_string(st.st_mtim.tv_nsec) + "-" + std::to_string(::getppid()) + "-" + started;
  const int lock = ::open((dir / (name + ".lock")).c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (lock < 0) return calm();
  struct Unlock {
    int fd;
    ~Unlock() { ::close(fd); }  // releases the flock, also when `calm` fails the case
  } unlock{lock};
  ::flock(lock, LOCK_EX);
  const std::filesystem::path done = dir / (key + ".json");
  if (std::string known = read_file(done); !known.empty()) return nlohmann::json::parse(known);
  const nlohmann::json summary = calm();
  const std::filesystem::path part = dir / (key + ".part");
  std::ofstream(part) << summary.dump();
  std::filesystem::rename(part, done, ec);
  std::cout << "trained the undisturbed run " << name << " (shared with this ctest run's other cases)\n";
  return summary;
}

// The stand-in agent with 2 workers; `agent_flags` pick the fault.
Run train(std::vector<std::string> agent_flags, std::vector<std::string> extra = {});

// The stand-in's undisturbed run (train's job, no fault): rank 0's summary, both ranks' weights equal.
nlohmann::json calm_standin() {
  return undisturbed("standin-2", [] {
    auto calm = train({"--fault", "none"});
    REQUIRE(calm.r.code == 0);
    CHECK(calm.summary(1)["weights_sha256"] == calm.summary(0)["weights_sha256"]);
    CHECK(calm.summary(0)["recoveries"].empty());
    return calm.summary(0);
  });
}

Run train(std::vector<std::string> agent_flags, std::vector<std::string> extra) {
  Run run_;
  run_.dir = make_temp_dir();
  std::vector<std::string> argv{"/usr/bin/python3", kAgent, "--mgtrain", kMgtrain, "--store-serve", kStoreServe,
                                "--out", run_.dir, "--deadline", "200"};
  argv.insert(argv.end(), agent_flags.begin(), agent_flags.end());
  argv.insert(argv.end(), {"--", "--dataset", "synthetic", "--synthetic-size", "1024", "--batch-size", "16", "--model",
                           "mlp", "--max-steps", "30", "--seed", "7", "--log-every", "1", "--timeout", "60",
                           "--in-place-recovery", "--summary-json", run_.dir + "/s{rank}.json"});
  argv.insert(argv.end(), extra.begin(), extra.end());
  run_.r = run(argv, {}, 240s);
  INFO(run_.r.out << run_.r.err << run_.logs());
  return run_;
}

}  // namespace

TEST_CASE("in-place recovery: a worker lost at step 10 is replaced, the survivor goes on and the weights equal an undisturbed run's", "[long]") {
  const std::string digest = calm_standin()["weights_sha256"];
  struct Fault {
    std::string kind, victim;
  };
  for (const Fault& f : {Fault{"kill", "1"}, Fault{"stop", "1"}, Fault{"kill", "0"}}) {
    INFO("fault " << f.kind << " of rank " << f.victim);
    auto hit = train({"--fault", f.kind, "--victim", f.victim, "--at-step", "10"});
    INFO(hit.r.out << hit.r.err << hit.logs());
    REQUIRE(hit.r.code == 0);
    const auto report = nlohmann::json::parse(hit.r.out);
    CHECK(report["fault"]["injected_at_step"].get<int>() >= 10);
    CHECK(report["restart_count"] == 1);
    // The survivor did not exit: one process per rank of attempt 0, except the victim.
    const std::string survivor = f.victim == "1" ? "0/0" : "1/0";
    CHECK(report["codes"][survivor] == 0);
    CHECK(report["codes"].size() == 3);
    for (int rank : {0, 1}) {
      INFO("rank " << rank);
      CHECK(hit.summary(rank)["steps"] == 30);
      CHECK(hit.summary(rank)["weights_sha256"] == digest);
    }
    const auto recoveries = hit.summary(f.victim == "1" ? 0 : 1)["recoveries"];
    REQUIRE(recoveries.size() == 1);
    CHECK(recoveries[0]["step"].get<int>() >= 11);
    CHECK(recoveries[0]["lost"] == "worker");
    CHECK(recoveries[0]["seconds"].get<double>() > 0);
    // The newcomer took the survivor's state (no checkpoint was read).
    CHECK_THAT(hit.logs(), Catch::Contains("took step") && Catch::Contains("from rank " + std::string(f.victim == "1" ? "0" : "1")));
  }
}

TEST_CASE("in-place recovery: a peer lost again while the new group forms, twice, sends the survivor back to the agent's next round instead of ending it, and the weights equal an undisturbed run's") {
  const auto calm = calm_standin();
  // Each replacement is SIGKILLed at its hello, while the survivor builds the new group
  // (it waits for the replacement's address): the survivor must leave that round on the
  // next pause. --timeout 600 is longer than the stand-in's deadline (200 s): a survivor
  // that waited out the dead round's group would end the stand-in with 3.
  auto hit = train({"--fault", "kill", "--victim", "1", "--at-step", "10", "--again", "2"}, {"--timeout", "600"});
  INFO(hit.r.out << hit.r.err << hit.logs());
  REQUIRE(hit.r.code == 0);
  const auto report = nlohmann::json::parse(hit.r.out);
  CHECK(report["fault"]["again"] == 2);
  CHECK(report["restart_count"] == 3);
  CHECK(report["codes"]["0/0"] == 0);  // the survivor never exited
  CHECK(report["codes"]["1/3"] == 0);
  for (int rank : {0, 1}) {
    INFO("rank " << rank);
    CHECK(hit.summary(rank)["steps"] == 30);
    CHECK(hit.summary(rank)["weights_sha256"] == calm["weights_sha256"]);
  }
  const auto recoveries = hit.summary(0)["recoveries"];
  REQUIRE(recoveries.size() == 1);  // one recovery, from the first detection to the first step after it
  CHECK(recoveries[0]["step"].get<int>() >= 11);
}

TEST_CASE("in-place recovery gives up after 8 failed attempts in a row from one step: the survivor exits 1 saying so, not after the agent runs out of rounds") {
  // 12 replacements in a row lost at their hello: more rounds than mgtrain's bound.
  auto hit = train({"--fault", "kill", "--victim", "1", "--at-step", "10", "--again", "12"}, {"--timeout", "600"});
  INFO(hit.r.out << hit.r.err << hit.logs());
  const auto report = nlohmann::json::parse(hit.r.out);
  CHECK(report["codes"]["0/0"] == 1);
  CHECK_FALSE(report["codes"].contains("deadline"));
  CHECK(report["fault"]["again"].get<int>() < 12);  // the survivor gave up before the rounds ran out
  CHECK_THAT(hit.logs(), Catch::Contains("(in-place recovery: 8 attempts in a row at step"));
}

TEST_CASE("in-place recovery: a survivor whose store host was SIGKILLed with its peer lets go of the store client quietly: well under a core while it waits for the next round, which forms on a new store") {
  // The stand-in SIGKILLs rank 1 and the store together (an agent hosting the store lost
  // with its worker), holds the next round back for 5 s once rank 0 said paused, and
  // measures rank 0's CPU time meanwhile: it only waits for its assignment then. Torch
  // 1.13's store client thread spins a core on a connection whose server is gone (the
  // chaos soak's 1,403 s for a 720 s plan) unless mgtrain made it quiet when it let go of
  // the group: 1.8-2.1 CPU-s in 5 s before (load 11-12 on 2 cores), 0.05 s after.
  auto hit = train({"--fault", "kill", "--victim", "1", "--at-step", "10", "--kill-store", "5"});
  INFO(hit.r.out << hit.r.err << hit.logs());
  REQUIRE(hit.r.code == 0);
  const auto report = nlohmann::json::parse(hit.r.out);
  REQUIRE(report["fault"].contains("paused_cpu_s"));
  const double cpu = report["fault"]["paused_cpu_s"]["0"].get<double>();
  std::cout << "the survivor's CPU while paused after its store host's SIGKILL: " << cpu << " s in "
            << report["fault"]["paused_window_s"] << " s\n";
  CHECK(cpu < 0.5);
  for (int rank : {0, 1}) {
    INFO("rank " << rank);
    CHECK(hit.summary(rank)["steps"] == 30);
  }
  CHECK(hit.summary(1)["weights_sha256"] == hit.summary(0)["weights_sha256"]);
  CHECK(hit.summary(0)["recoveries"].size() == 1);
}

TEST_CASE("in-place recovery with no rank left holding the state (every worker SIGKILLed at once) falls back to the newest checkpoint, not to step 0") {
  // The etcd soak's one loss (#34): both holders lost before a standby took the state.
  // Every worker of the new round is fresh (step 0), so no rank sends its state and rank 0
  // reads --checkpoint-dir's checkpoint, as a restarted job does.
  const std::string ckpt = make_temp_dir();
  auto hit = train({"--fault", "kill-all", "--at-step", "10"}, {"--checkpoint-dir", ckpt, "--checkpoint-every", "5"});
  INFO(hit.r.out << hit.r.err << hit.logs());
  REQUIRE(hit.r.code == 0);
  const auto report = nlohmann::json::parse(hit.r.out);
  CHECK(report["restart_count"] == 1);
  CHECK(report["fault"]["respawned"] == true);
  const std::string log = read_file(hit.dir + "/worker0.1.log");
  const auto at = log.find("resumed from " + ckpt + "/checkpoint.pt at step ");
  REQUIRE(at != std::string::npos);
  const int step = std::stoi(log.substr(at + ("resumed from " + ckpt + "/checkpoint.pt at step ").size()));
  CHECK(step >= 5);  // a checkpoint of step 5 or later: written before the kill at step 10 or later
  CHECK(step % 5 == 0);
  for (int rank : {0, 1}) {
    INFO("rank " << rank);
    CHECK(hit.summary(rank)["steps"] == 30);
  }
  CHECK(hit.summary(1)["weights_sha256"] == hit.summary(0)["weights_sha256"]);
}

TEST_CASE("in-place recovery: a checkpoint newer than every surviving rank's state wins over it, and is not overwritten by an older state") {
  // Review s36 M3: a rank back from a cut-off side with an old state (here: rank 1 at step
  // 10 or so) meets a fresh rank 0 whose --checkpoint-dir holds a later step (20, written
  // by the part of the job that trained on). Before the fix the old state won and the next
  // checkpoint replaced the newer one with a lower step.
  const std::string seed = make_temp_dir(), base = make_temp_dir();
  auto first = run({kMgtrain, "--dataset", "synthetic", "--synthetic-size", "1024", "--batch-size", "16", "--model", "mlp",
                    "--max-steps", "20", "--seed", "7", "--checkpoint-dir", seed, "--checkpoint-every", "20"},
                   {}, 120s);
  INFO(first.out << first.err);
  REQUIRE(first.code == 0);
  auto hit = train({"--fault", "kill", "--victim", "0", "--at-step", "8", "--plant",
                    seed + "/checkpoint.pt:" + base + "/0/checkpoint.pt"},
                   {"--checkpoint-dir", base + "/{rank}", "--checkpoint-every", "5"});
  INFO(hit.r.out << hit.r.err << hit.logs());
  REQUIRE(hit.r.code == 0);
  const std::string log = read_file(hit.dir + "/worker0.1.log");
  CHECK(log.find("holds step 20, later than every rank's state") != std::string::npos);
  CHECK(log.find("resumed from " + base + "/0/checkpoint.pt at step 20") != std::string::npos);
  CHECK(log.find("took step") == std::string::npos);  // no rank's older state was taken
  for (int rank : {0, 1}) {
    INFO("rank " << rank);
    CHECK(hit.summary(rank)["steps"] == 30);
  }
  CHECK(hit.summary(1)["weights_sha256"] == hit.summary(0)["weights_sha256"]);
}

// Review s38 M3: the newest checkpoint beat the live states by step alone, and it is the
// newest among every rank's directory: a cut-off side of epoch 6 that trained on to step 20
// and wrote it (here planted in rank 0's node-local directory when rank 0 is lost) beat the
// epoch-7 majority's live states (step 8 or so), against the fence. The states now carry the
// run and epoch of the round that held them and compare in the census's order (run, epoch,
// step). On main (154ccb1) the round resumed from the epoch-6 checkpoint ("holds step 20").
TEST_CASE("in-place recovery under epochs: a cut-off side's checkpoint of an older epoch at a later step does not beat the newer epoch's live states") {
  const std::string run_id = "1700000000000-0000000000000a01";
  const std::string seed = make_temp_dir(), base = make_temp_dir();
  auto first = run({kMgtrain, "--dataset", "synthetic", "--synthetic-size", "1024", "--batch-size", "16", "--model", "mlp",
                    "--max-steps", "20", "--seed", "7", "--checkpoint-dir", seed, "--checkpoint-every", "20"},
                   {{"MGLAUNCH_EPOCH", "6"}, {"MGLAUNCH_RUN", run_id}}, 120s);
  INFO(first.out << first.err);
  REQUIRE(first.code == 0);
  const std::string digest = calm_standin()["weights_sha256"];
  auto hit = train({"--fault", "kill", "--victim", "0", "--at-step", "8", "--epoch", "7", "--run", run_id, "--plant",
                    seed + "/checkpoint.pt:" + base + "/0/checkpoint.pt"},
                   {"--checkpoint-dir", base + "/{rank}", "--checkpoint-every", "5"});
  INFO(hit.r.out << hit.r.err << hit.logs());
  REQUIRE(hit.r.code == 0);
  const std::string log = read_file(hit.dir + "/worker0.1.log");
  CHECK(log.find("holds step 20") == std::string::npos);
  CHECK(log.find("resumed from") == std::string::npos);
  CHECK(log.find("mgtrain: rank 0 took step ") != std::string::npos);
  CHECK(log.find("from rank 1 (it was at step 0)") != std::string::npos);
  for (int rank : {0, 1}) {
    INFO("rank " << rank);
    CHECK(hit.summary(rank)["steps"] == 30);
    CHECK(hit.summary(rank)["mglaunch_epoch"] == 8);
  }
  CHECK(hit.summary(0)["weights_sha256"] == digest);
  CHECK(hit.summary(1)["weights_sha256"] == digest);
}

// Review s38 M4: a checkpoint that a rank cannot read stopped every rank with exit 3, in-place
// recovery included, though the ranks' live states were there to go on from; and its peers'
// line did not name the file. Rank 0 is lost at step 8 and, before the next round, a file of
// zeros takes the place of a checkpoint: rank 1's without a key (the census cannot parse it),
// then rank 0's with a key that says step 1000 (the newest, which resume cannot parse; review
// s39 L5: 1000, not 20, which the survivor could reach before the kill on a loaded machine).
// Each time the round goes on from rank 1's live state, and the rank that holds the file says
// so in one line naming it. On main (154ccb1's mgtrain) both rounds ended with exit 3 on every rank.
TEST_CASE("in-place recovery goes on from the live states when a rank's checkpoint does not parse, keyless or under a key that says it is the newest, and that rank names the file in one line") {
  const std::string digest = calm_standin()["weights_sha256"];
  for (const auto& [rank, step] : {std::pair{1, ""}, std::pair{0, ":1000"}}) {
    const std::string base = make_temp_dir(), path = base + "/" + std::to_string(rank) + "/checkpoint.pt";
    INFO("rank " << rank << "'s checkpoint unreadable" << (*step ? ", its key at step 1000" : ", no key"));
    auto hit = train({"--fault", "kill", "--victim", "0", "--at-step", "8", "--garbage", path + step},
                     {"--checkpoint-dir", base + "/{rank}", "--checkpoint-every", "5"});
    INFO(hit.r.out << hit.r.err << hit.logs());
    REQUIRE(hit.r.code == 0);
    const std::string log = read_file(hit.dir + "/worker" + std::to_string(rank) + (rank == 0 ? ".1" : ".0") + ".log");
    CHECK(count_of(log, "mgtrain: warning: rank " + std::to_string(rank) + ": cannot load checkpoint " + path + ": ") == 1);
    CHECK(count_of(log, ": it does not parse: in-place recovery goes on from the ranks' live states, no checkpoint is "
                        "resumed this round; restore rank " + std::to_string(rank) + "'s " + path + ", or remove it") == 1);
    const std::string fresh = read_file(hit.dir + "/worker0.1.log");
    CHECK(fresh.find("mgtrain: rank 0 took step ") != std::string::npos);
    CHECK(fresh.find("resumed from") == std::string::npos);
    for (int r : {0, 1}) {
      INFO("rank " << r);
      CHECK(hit.summary(r)["steps"] == 30);
      CHECK(hit.summary(r)["weights_sha256"] == digest);
    }
  }
}

// Review s39 M2: the fallback above took any checkpoint that could not be read, an I/O error
// too (a transient EIO or ESTALE on a shared D): the round went on from older live states and
// the next checkpoint wrote over the newer one. A directory in place of the checkpoint (read()
// fails with EISDIR) stands in for the I/O error: keyless (the census) and under a key at step
// 1000 (resume). Every rank of the round after the kill stops with exit 3, and the holder's
// line names the file and the way on, as before 8bfd4ff. On main (cd9407a's mgtrain) both
// rounds went on (the agent exited 0).
TEST_CASE("in-place recovery stops with exit 3 where a rank's checkpoint cannot be read (an I/O error), keyless or under a key that says it is the newest") {
  for (const auto& [rank, step] : {std::pair{1, ""}, std::pair{0, ":1000"}}) {
    const std::string base = make_temp_dir(), path = base + "/" + std::to_string(rank) + "/checkpoint.pt";
    INFO("rank " << rank << "'s checkpoint a directory" << (*step ? ", its key at step 1000" : ", no key"));
    auto hit = train({"--fault", "kill", "--victim", "0", "--at-step", "8", "--garbage", path + step, "--unreadable"},
                     {"--checkpoint-dir", base + "/{rank}", "--checkpoint-every", "5"});
    INFO(hit.r.out << hit.r.err << hit.logs());
    REQUIRE(hit.r.code != 0);
    const auto codes = nlohmann::json::parse(hit.r.out)["codes"];
    CHECK(codes["0/1"] == 3);
    CHECK(codes["1/0"] == 3);
    const std::string log = read_file(hit.dir + "/worker" + std::to_string(rank) + (rank == 0 ? ".1" : ".0") + ".log");
    CHECK(count_of(log, "cannot read " + path + ": Is a directory; remove rank " + std::to_string(rank) + "'s " + path +
                            " (the next newest is then used), or restore it") == 1);
    CHECK(log.find("does not parse") == std::string::npos);
  }
}

TEST_CASE("in-place recovery into a smaller world: rank 1 lost mid-epoch and not replaced, rank 0 alone trains the epoch's samples that world 2 had not, once, then whole epochs at world 1") {
  // 1024 samples, batch 16: 32 steps an epoch at world 2, 64 at world 1; two epochs.
  auto hit = train({"--fault", "kill", "--victim", "1", "--at-step", "10", "--shrink"}, {"--epochs", "2", "--max-steps", "1000"});
  INFO(hit.r.out << hit.r.err << hit.logs());
  REQUIRE(hit.r.code == 0);
  const auto s0 = hit.summary(0);
  CHECK(s0["world_size"] == 1);
  REQUIRE(s0["recoveries"].size() == 1);
  const int k = s0["recoveries"][0]["step"].get<int>() - 1;  // the steps world 2 applied
  REQUIRE(k >= 10);
  REQUIRE(k < 32);
  // World 2 consumed 2 x 16 x k samples of epoch 1; the other 1024 - 32 k take (1024 - 32 k) / 16
  // steps at world 1 (a world-1 shard read from the old position would take 64 - k, and
  // see some samples twice and others never); epoch 2 is world 1's usual 64 steps.
  CHECK(s0["steps"] == k + (1024 - 32 * k) / 16 + 64);
  CHECK_THAT(hit.logs(), Catch::Contains("world 2 -> 1 in epoch 1: " + std::to_string(32 * k) + " of its 1024 samples done"));
}

TEST_CASE("in-place recovery: SIGTERM while waiting for the agent's new round ends the worker with 75, not after --timeout") {
  // --timeout 600 is longer than the stand-in's deadline (200 s): a worker that waited it
  // out would end the stand-in with 3.
  auto hit = train({"--fault", "term", "--victim", "1", "--at-step", "10"}, {"--timeout", "600"});
  INFO(hit.r.out << hit.r.err << hit.logs());
  const auto report = nlohmann::json::parse(hit.r.out);
  CHECK(report["fault"]["terminated"] == true);
  CHECK(report["codes"]["0/0"] == 75);
  CHECK_FALSE(report["codes"].contains("deadline"));
  CHECK(hit.summary(0)["stopped_by_signal"] == true);
  CHECK_THAT(hit.logs(), Catch::Contains("stopped by a signal while waiting for the agent's new round"));
}

TEST_CASE("in-place recovery off: without a control socket mgtrain says so in one line and trains, and impossible combinations are exit 2") {
  auto plain = train({"--fault", "none", "--no-control"});
  REQUIRE(plain.r.code == 0);
  CHECK_THAT(plain.logs(), Catch::Contains("--in-place-recovery: no MGLAUNCH_CONTROL_SOCKET") &&
                               Catch::Contains("recovery is off"));
  CHECK(plain.summary(1)["steps"] == 30);
  for (std::vector<std::string> bad : {std::vector<std::string>{"--cuda-graphs"}, {"--reducer", "c10d"}, {"--sync-batchnorm"},
                                       {"--bench", "allreduce"}}) {
    std::vector<std::string> argv{kMgtrain, "--in-place-recovery"};
    argv.insert(argv.end(), bad.begin(), bad.end());
    auto r = run(argv, {}, 60s);
    INFO(bad[0] << ": " << r.err);
    CHECK(r.code == 2);
    CHECK_THAT(r.err, Catch::StartsWith("mgtrain: error: --in-place-recovery"));
    CHECK(count_of(r.err, "\n") == 1);
  }
}

// Under the real mglaunch (the agent side of docs/in-place-recovery.md).
namespace {

// The job's size: the CNN at batch 16 on `samples` synthetic samples, `steps` steps at most.
// Each rank's training is most of a case's CPU (#36: 4,096 samples at batch 32 and 60 steps
// cost twice as much for the same checks).
struct Size {
  std::string name;
  int samples, steps;
};
// 32 steps an epoch at world 2 (the job stops at 30, mid-epoch), 22 at world 3 (one whole
// epoch): a fault at step 10 leaves 12-20 steps after it.
const Size kShort{"", 1024, 30};
// 64 steps an epoch at world 2, stopped at 60: a pre-started standby's mgtrain loads while
// the job trains, before the kill at step 10 or later; in kShort's 30 steps it was ready
// only after the last one, 1 run in 5. The standby joins once the round is decided (its
// pre-started worker, placed at once, once found node 0's held master port closed under its
// queued store connections: reset, exit 134, 2 runs in 5; fixed in the agent, #36).
const Size kLong{"-long", 2048, 60};
const std::vector<std::string> kJob = {"--dataset", "synthetic", "--batch-size", "16", "--model", "cnn", "--seed", "3",
                                       "--log-every", "1", "--timeout", "60", "--in-place-recovery"};

std::vector<std::string> job(const std::string& summary, std::vector<std::string> extra = {}, const Size& size = kShort) {
  auto v = kJob;
  v.insert(v.end(), {"--synthetic-size", std::to_string(size.samples), "--max-steps", std::to_string(size.steps),
                     "--summary-json", summary});
  v.insert(v.end(), extra.begin(), extra.end());
  return v;
}

nlohmann::json summary_of(const std::string& path) { return nlohmann::json::parse(read_file(path)); }

// kJob's undisturbed run at `world` ranks (one mglaunch --standalone, `world` workers): rank
// 0's summary, every rank's weights equal. A job's ranks train the same whether they share a
// node or not (the 2- and 3-node cases compare with it; each trained its own before, #36).
nlohmann::json calm_job(int world, const Size& size = kShort) {
  return undisturbed("job-" + std::to_string(world) + size.name, [world, size] {
    const std::string dir = make_temp_dir();
    std::vector<std::string> argv{kMglaunch, "--standalone", "--nproc_per_node=" + std::to_string(world), kMgtrain};
    for (const std::string& a : job(dir + "/c{rank}.json", {}, size)) argv.push_back(a);
    auto r = run(argv, {}, 240s);
    INFO(r.out << r.err);
    REQUIRE(r.code == 0);
    const auto s0 = summary_of(dir + "/c0.json");
    for (int rank = 1; rank < world; ++rank) CHECK(summary_of(dir + "/c" + std::to_string(rank) + ".json")["weights_sha256"] == s0["weights_sha256"]);
    CHECK(s0["recoveries"].empty());
    std::filesystem::remove_all(dir);
    return s0;
  });
}

}  // namespace

TEST_CASE("in-place recovery under mglaunch: a worker that fails at step 10 is restarted, its peer keeps going, the weights equal an undisturbed run's", "[long]") {
  const std::string dir = make_temp_dir();
  auto standalone = [&](std::vector<std::string> args) {
    std::vector<std::string> argv{kMglaunch, "--standalone", "--nproc_per_node=2", "--max_restarts=1", kMgtrain};
    argv.insert(argv.end(), args.begin(), args.end());
    auto r = run(argv, {}, 240s);
    INFO(r.out << r.err);
    return r;
  };
  const auto calm = calm_job(2);
  auto hit = standalone(job(dir + "/s{rank}.json", {"--fail-at-step", "10", "--fail-rank", "1", "--fail-signal", "9"}));
  INFO(hit.out << hit.err);
  REQUIRE(hit.code == 0);
  const auto s0 = summary_of(dir + "/s0.json");
  CHECK(s0["weights_sha256"] == calm["weights_sha256"]);
  CHECK(summary_of(dir + "/s1.json")["weights_sha256"] == s0["weights_sha256"]);
  REQUIRE(s0["recoveries"].size() == 1);  // rank 0 went through the restart in place
  CHECK(s0["recoveries"][0]["step"] == 11);
  CHECK(s0["recoveries"][0]["lost"] == "worker");
  CHECK(s0["restart_count"] == 1);
  CHECK_THAT(hit.out, Catch::Contains("rank 1 took step 10's state from rank 0"));
  std::cout << "in-place recovery, one node, a worker SIGKILLed: " << s0["recoveries"][0]["seconds"].get<double>()
            << " s from detection to the first step after it\n";
}

TEST_CASE("in-place recovery under mglaunch: when another rank has no control channel, a worker withdraws its opt-in: at a failure the agent stops it as any worker instead of pausing it and losing it") {
  // Local rank 1 starts without MGLAUNCH_CONTROL_SOCKET: recovery is off on every rank.
  std::vector<std::string> argv{kMglaunch, "--standalone", "--nproc_per_node=2", "--max_restarts=1", "/bin/sh", "-c",
                                "if [ \"$LOCAL_RANK\" = 1 ]; then unset MGLAUNCH_CONTROL_SOCKET; fi; exec \"$0\" \"$@\"",
                                kMgtrain};
  const std::string dir = make_temp_dir();
  auto args = job(dir + "/s{rank}.json", {"--fail-at-step", "10", "--fail-rank", "1", "--fail-signal", "9"});
  argv.insert(argv.end(), args.begin(), args.end());
  auto hit = run(argv, {}, 240s);
  INFO(hit.out << hit.err);
  REQUIRE(hit.code == 0);
  CHECK_THAT(hit.err, Catch::Contains("rank 0: another rank has no control channel: recovery is off on every rank"));
  // Before: rank 0 was paused, left with an error and was stopped for its closed connection.
  CHECK_THAT(hit.err, !Catch::Contains("paused, kept for the next attempt"));
  CHECK_THAT(hit.err, !Catch::Contains("control connection closed while paused"));
  CHECK(summary_of(dir + "/s0.json")["restart_count"] == 1);
  std::filesystem::remove_all(dir);
}

TEST_CASE("in-place recovery under mglaunch: step 10 applied on some ranks only (rank 1 left it unapplied, rank 2 lost after it) recovers from the most advanced state, says so, and the weights equal an undisturbed run's", "[long]") {
  const std::string dir = make_temp_dir();
  auto standalone = [&](std::vector<std::string> args, std::map<std::string, std::string> env) {
    std::vector<std::string> argv{kMglaunch, "--standalone", "--nproc_per_node=3", "--max_restarts=1", kMgtrain};
    argv.insert(argv.end(), args.begin(), args.end());
    auto r = run(argv, env, 240s);
    INFO(r.out << r.err);
    return r;
  };
  const auto calm = calm_job(3);
  // Rank 0 applies step 10; rank 1 does not (its all-reduce "failed" after its peers'
  // completed: the documented test hook); rank 2 applies it and is SIGKILLed.
  auto hit = standalone(job(dir + "/s{rank}.json", {"--fail-at-step", "10", "--fail-rank", "2", "--fail-signal", "9"}),
                        {{"MGTRAIN_TEST_UNAPPLIED_STEP", "10:1"}});
  INFO(hit.out << hit.err);
  REQUIRE(hit.code == 0);
  CHECK_THAT(hit.out, Catch::Contains("step 10 was applied on some ranks only: recovering from it, the most advanced state (rank 0's)"));
  CHECK(count_of(hit.out, "applied on some ranks only") == 1);
  CHECK_THAT(hit.out, Catch::Contains("rank 1 took step 10's state from rank 0 (it was at step 9)"));
  CHECK_THAT(hit.out, Catch::Contains("rank 2 took step 10's state from rank 0 (it was at step 0)"));
  const auto s0 = summary_of(dir + "/s0.json");
  CHECK(s0["steps"] == calm["steps"]);  // one epoch of 22 steps at world 3
  CHECK(s0["weights_sha256"] == calm["weights_sha256"]);
  for (int rank : {1, 2}) CHECK(summary_of(dir + "/s" + std::to_string(rank) + ".json")["weights_sha256"] == s0["weights_sha256"]);
  REQUIRE(s0["recoveries"].size() == 1);
  CHECK(s0["recoveries"][0]["step"] == 11);
  std::filesystem::remove_all(dir);
}

TEST_CASE("in-place recovery under mglaunch-rdzv: node 1's agent SIGKILLed at step 10 or later, node 1 back, rank 0 goes on and the weights equal an undisturbed 2-node run's", "[long]") {
  const std::string dir = make_temp_dir();
  Daemon d = start_daemon();
  auto node = [&](const std::string& id, int node_rank, const std::string& summary) {
    std::vector<std::string> argv{kMglaunch, "--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d",
                                  "--rdzv_endpoint=" + d.endpoint, "--rdzv_id=" + id, "--max_restarts=2",
                                  "--node_rank=" + std::to_string(node_rank),
                                  "--local_addr=127.0.0." + std::to_string(node_rank + 2), kMgtrain};
    auto args = job(summary);
    argv.insert(argv.end(), args.begin(), args.end());
    return spawn(argv);
  };
  const auto calm = calm_job(2);
  Proc n0 = node("hit", 0, dir + "/s{rank}.json"), n1 = node("hit", 1, dir + "/s{rank}.json");
  REQUIRE(eventually([&] { return n0.out().find(" step 10/") != std::string::npos; }, 120s));
  ::kill(n1.pid, SIGKILL);
  REQUIRE(n1.wait(10s));
  Proc n1b = node("hit", 1, dir + "/s{rank}.json");  // node 1 comes back (no standby here)
  REQUIRE(n0.wait(240s));
  REQUIRE(n1b.wait(60s));
  INFO(n0.out() << n0.err() << n1b.err());
  CHECK(n0.exit_code() == 0);
  CHECK(n1b.exit_code() == 0);
  const auto s0 = summary_of(dir + "/s0.json");
  CHECK(s0["steps"] == kShort.steps);
  CHECK(s0["weights_sha256"] == calm["weights_sha256"]);
  CHECK(summary_of(dir + "/s1.json")["weights_sha256"] == s0["weights_sha256"]);
  REQUIRE(s0["recoveries"].size() == 1);
  CHECK(s0["recoveries"][0]["step"].get<int>() >= 11);
  CHECK(s0["recoveries"][0]["lost"] == "host");
  std::cout << "in-place recovery, node 1's agent SIGKILLed and restarted: " << s0["recoveries"][0]["seconds"].get<double>()
            << " s from detection to the first step after it\n";
  ::kill(d.proc.pid, SIGTERM);
  CHECK(d.proc.wait(10s));
}

namespace {

// #26's done-when: two active nodes and one standby (`standby_flags`: its own mglaunch
// flags), node 1's agent SIGKILLed at step 10 or later; the job exits 0 and the weights
// equal an undisturbed 2-node run's. Returns the standby's stderr; prints rank 0's recovery.
std::string standby_done_when(const std::vector<std::string>& standby_flags, const std::string& what, const Size& size) {
  const std::string dir = make_temp_dir();
  Daemon d = start_daemon();
  auto node = [&](const std::string& id, int index, const std::string& summary, std::vector<std::string> flags = {}) {
    std::vector<std::string> argv{kMglaunch, "--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d",
                                  "--rdzv_endpoint=" + d.endpoint, "--rdzv_id=" + id, "--max_restarts=2",
                                  "--local_addr=127.0.0." + std::to_string(index)};
    argv.insert(argv.end(), flags.begin(), flags.end());
    argv.push_back(kMgtrain);
    auto args = job(summary, {}, size);
    argv.insert(argv.end(), args.begin(), args.end());
    return spawn(argv);
  };
  const auto calm = calm_job(2, size);
  std::vector<Proc> nodes;
  nodes.push_back(node("hit", 2, dir + "/s{rank}.json"));
  nodes.push_back(node("hit", 3, dir + "/s{rank}.json"));
  auto join_standby = [&] { nodes.push_back(node("hit", 4, dir + "/s{rank}.json", standby_flags)); };
  // A pre-started standby joins once the round is decided, so that its mgtrain is loaded
  // while the job trains (the order that showed #36's reset); a plain one once it trains.
  if (!standby_flags.empty()) {
    REQUIRE(eventually([&] {
      return nodes[0].err().find("round 1: node") != std::string::npos &&
             nodes[1].err().find("round 1: node") != std::string::npos;
    }, 120s));
    join_standby();  // the round is full: a standby
  }
  // Rank 0's progress lines tell which agent hosts it: the other active one is "node 1".
  int lead = -1;
  REQUIRE(eventually([&] {
    for (int i = 0; i < 2; ++i)
      if (nodes[i].out().find(" step 1/") != std::string::npos) lead = i;
    return lead >= 0;
  }, 120s));
  if (standby_flags.empty()) join_standby();
  REQUIRE(eventually([&] { return nodes[2].err().find("standby for job") != std::string::npos; }, 60s));
  if (!standby_flags.empty())  // --prestart-standby: its mgtrain loaded and waiting before the kill
    REQUIRE(eventually([&] { return nodes[2].out().find("standby worker ready") != std::string::npos; }, 120s));
  REQUIRE(eventually([&] { return nodes[lead].out().find(" step 10/") != std::string::npos; }, 120s));
  Proc& victim = nodes[1 - lead];
  ::kill(victim.pid, SIGKILL);
  REQUIRE(victim.wait(10s));
  REQUIRE(nodes[lead].wait(240s));
  REQUIRE(nodes[2].wait(60s));
  INFO(nodes[lead].out() << nodes[lead].err() << nodes[2].out() << nodes[2].err());
  CHECK(nodes[lead].exit_code() == 0);
  CHECK(nodes[2].exit_code() == 0);
  const auto s0 = summary_of(dir + "/s0.json");
  CHECK(s0["steps"] == size.steps);
  CHECK(s0["weights_sha256"] == calm["weights_sha256"]);
  CHECK(summary_of(dir + "/s1.json")["weights_sha256"] == s0["weights_sha256"]);
  REQUIRE(s0["recoveries"].size() == 1);
  CHECK(s0["recoveries"][0]["step"].get<int>() >= 11);
  CHECK(s0["recoveries"][0]["lost"] == "host");
  // Benchmark material, not asserted: #26's goal is at most 1 s.
  std::cout << "in-place recovery with a standby" << what << ", node 1's agent SIGKILLed: "
            << s0["recoveries"][0]["seconds"].get<double>() << " s from detection to the first step after it\n";
  ::kill(d.proc.pid, SIGTERM);
  CHECK(d.proc.wait(10s));
  std::filesystem::remove_all(dir);
  return nodes[2].out() + nodes[2].err();
}

}  // namespace

TEST_CASE("in-place recovery with a standby (#26's done-when): two active nodes and one standby, node 1's agent SIGKILLed at step 10 or later, the job exits 0 and the weights equal an undisturbed 2-node run's", "[long]") {
  const std::string standby = standby_done_when({}, "", kShort);
  CHECK_THAT(standby, !Catch::Contains("pre-started"));
}

TEST_CASE("in-place recovery with a pre-started standby (--prestart-standby): the standby's mgtrain is loaded before the kill and takes node 1's place with its pid, the job exits 0 and the weights equal an undisturbed 2-node run's", "[long]") {
  const std::string standby = standby_done_when({"--prestart-standby"}, " (--prestart-standby)", kLong);
  CHECK_THAT(standby, Catch::Contains("worker(s) started ahead with MGLAUNCH_STANDBY=1"));
  CHECK_THAT(standby, Catch::Contains("[standby0]:mgtrain: standby worker ready"));
  CHECK_THAT(standby, Catch::Contains("local rank 0: the pre-started worker (pid ") && Catch::Contains(") takes rank "));
  CHECK_THAT(standby, !Catch::Contains("--prestart-standby: local rank"));  // no fallback
}

TEST_CASE("in-place recovery when the hosting agent is lost (#26's done-when): three nodes hosted by node 0's agent "
          "and one standby, node 0's agent SIGKILLed at step 10 or later, the standby follows the takeover, every node "
          "exits 0 and the weights equal an undisturbed 3-node run's", "[long]") {
  const std::string dir = make_temp_dir();
  const std::string token = "inplace-takeover-token";
  auto node = [&](const std::string& ep, const std::string& id, int index, const std::string& summary) {
    std::vector<std::string> argv{kMglaunch, "--nnodes=3", "--nproc_per_node=1", "--rdzv_backend=c10d",
                                  "--rdzv_endpoint=" + ep, "--rdzv_id=" + id, "--max_restarts=2",
                                  "--rdzv_conf=keep_alive_interval=1,keep_alive_max_attempt=3",
                                  "--local_addr=127.0.0." + std::to_string(index), kMgtrain};
    auto args = job(summary);
    argv.insert(argv.end(), args.begin(), args.end());
    return spawn(argv, {{"MGLAUNCH_RDZV_TOKEN", token}});
  };
  // Node 0 (127.0.0.2) hosts the rendezvous at the endpoint: it starts first.
  auto start = [&](const std::string& id, const std::string& summary) {
    const std::string ep = "127.0.0.2:" + std::to_string(free_loopback_port());
    std::vector<Proc> nodes;
    nodes.push_back(node(ep, id, 2, summary));
    REQUIRE(eventually([&] { return nodes[0].err().find("hosting the rendezvous") != std::string::npos; }, 60s));
    for (int i : {3, 4}) nodes.push_back(node(ep, id, i, summary));
    // The round is decided before a standby comes.
    REQUIRE(eventually([&] {
      return std::all_of(nodes.begin(), nodes.end(), [](Proc& p) { return p.err().find("round 1: node") != std::string::npos; });
    }, 60s));
    return std::pair(ep, std::move(nodes));
  };
  const auto calm = calm_job(3);
  auto hit = start("hit", dir + "/s{rank}.json");
  const std::string ep = hit.first;
  std::vector<Proc>& nodes = hit.second;
  Proc standby = node(ep, "hit", 5, dir + "/s{rank}.json");
  if (!eventually([&] { return standby.err().find("standby for job") != std::string::npos; }, 60s))
    FAIL("no standby line: " << standby.err() << nodes[0].err());
  REQUIRE(eventually([&] { return nodes[0].out().find(" step 10/") != std::string::npos; }, 120s));
  ::kill(nodes[0].pid, SIGKILL);
  REQUIRE(nodes[0].wait(10s));
  for (Proc* p : {&nodes[1], &nodes[2], &standby}) {
    REQUIRE(p->wait(240s));
    INFO(p->err());
    CHECK(p->exit_code() == 0);
  }
  INFO(standby.err());
  CHECK_THAT(standby.err(), Catch::Contains("re-registered as a standby") && Catch::Contains("round 2: node 0 of 3"));
  for (int rank : {0, 1, 2}) CHECK(summary_of(dir + "/s" + std::to_string(rank) + ".json")["weights_sha256"] == calm["weights_sha256"]);
  const auto s1 = summary_of(dir + "/s1.json");
  CHECK(s1["steps"] == calm["steps"]);  // one epoch at world 3
  REQUIRE(s1["recoveries"].size() == 1);
  CHECK(s1["recoveries"][0]["step"].get<int>() >= 11);
  CHECK(s1["recoveries"][0]["lost"] == "host");
  std::cout << "in-place recovery with a standby, the hosting agent SIGKILLed: "
            << s1["recoveries"][0]["seconds"].get<double>() << " s from detection to the first step after it\n";
  std::filesystem::remove_all(dir);
}

TEST_CASE("in-place recovery is on for every rank or none: one rank without its control channel turns it off "
          "everywhere, and training ends instead of hanging on mismatched collectives") {
  const std::string dir = make_temp_dir();
  // Rank 1 loses MGLAUNCH_CONTROL_SOCKET on its way (a wrapper that cleans the environment).
  const std::string wrap = dir + "/wrap.sh";
  std::ofstream(wrap) << "#!/bin/sh\n[ \"$RANK\" = 1 ] && unset MGLAUNCH_CONTROL_SOCKET\nexec \"$@\"\n";
  std::filesystem::permissions(wrap, std::filesystem::perms::owner_all);
  std::vector<std::string> argv{kMglaunch, "--standalone", "--nproc_per_node=2", "--no_python", wrap, kMgtrain};
  for (const auto& a : job(dir + "/s{rank}.json")) argv.push_back(a);
  auto r = run(argv, {}, 240s);
  INFO(r.out << r.err);
  CHECK(r.code == 0);
  CHECK_THAT(r.out + r.err, Catch::Contains("another rank has no control channel: recovery is off on every rank"));
  CHECK(summary_of(dir + "/s0.json")["weights_sha256"] == summary_of(dir + "/s1.json")["weights_sha256"]);
  std::filesystem::remove_all(dir);
}

TEST_CASE("a pre-started mgtrain (MGLAUNCH_STANDBY=1) without --in-place-recovery, or without its control channel, "
          "ends at once with one line (exit 2, exit 3) instead of training alone") {
  auto alone = run({kMgtrain, "--dataset", "synthetic", "--max-steps", "2"},
                   {{"MGLAUNCH_STANDBY", "1"}, {"MGLAUNCH_CONTROL_SOCKET", "\x01unset"}}, 60s);
  INFO(alone.out << alone.err);
  CHECK(alone.code == 2);
  CHECK_THAT(alone.err, Catch::StartsWith("mgtrain: error: MGLAUNCH_STANDBY=1") && Catch::Contains("--in-place-recovery"));
  CHECK(count_of(alone.err, "\n") == 1);
  auto no_channel = run({kMgtrain, "--dataset", "synthetic", "--max-steps", "2", "--in-place-recovery"},
                        {{"MGLAUNCH_STANDBY", "1"}, {"MGLAUNCH_CONTROL_SOCKET", "\x01unset"}}, 60s);
  INFO(no_channel.out << no_channel.err);
  CHECK(no_channel.code == 3);
  CHECK_THAT(no_channel.err, Catch::Contains("pre-started worker (MGLAUNCH_STANDBY=1) needs the control channel"));
  CHECK(count_of(no_channel.err, "\n") == 1);
  CHECK_THAT(no_channel.out, !Catch::Contains("done:"));
}

TEST_CASE("a pre-started mgtrain waits for its place past --timeout (the node may stay a standby for the whole job): "
          "with --timeout 2 it still waits 4 s later, and SIGTERM then ends the wait with exit 75") {
  // A stand-in agent of its own: welcomes the standby's hello, never assigns, SIGTERMs
  // mgtrain 4 s after its "standby worker ready" line.
  const std::string dir = make_temp_dir();
  const std::string script = dir + "/agent.py";
  std::ofstream(script) << R"PY(
import json, os, signal, socket, subprocess, sys, time
name = "mgtest-standby-%d" % os.getpid()
srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
srv.bind("\0" + name)
srv.listen(4)
srv.settimeout(120)
env = dict(os.environ, MGLAUNCH_STANDBY="1", MGLAUNCH_CONTROL_SOCKET="@" + name, LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
p = subprocess.Popen(sys.argv[1:], env=env, stdout=subprocess.PIPE, text=True)
c, _ = srv.accept()
c.settimeout(120)
hello = c.makefile().readline()
c.sendall(b'{"type":"welcome","version":1}\n')
out = ""
while "standby worker ready" not in out:
    line = p.stdout.readline()
    if not line:
        break
    out += line
waited = "standby worker ready" in out and p.poll() is None
if waited:
    time.sleep(4)  # twice its --timeout
    waited = p.poll() is None
    p.send_signal(signal.SIGTERM)
out += p.stdout.read()
print(json.dumps({"hello": hello, "waited": waited, "code": p.wait(60), "out": out}))
)PY";
  auto r = run({"/usr/bin/python3", script, kMgtrain, "--dataset", "synthetic", "--synthetic-size", "64", "--model",
                "mlp", "--max-steps", "2", "--in-place-recovery", "--timeout", "2"},
               {}, 180s);
  INFO(r.out << r.err);
  REQUIRE(r.code == 0);
  const auto got = nlohmann::json::parse(r.out);
  CHECK_THAT(got["hello"].get<std::string>(), Catch::Contains("\"standby\": true") || Catch::Contains("\"standby\":true"));
  CHECK(got["waited"] == true);  // still waiting 4 s after --timeout 2 began
  CHECK(got["code"] == 75);
  CHECK_THAT(got["out"].get<std::string>(), Catch::Contains("stopped by a signal while this standby worker waited"));
  CHECK_THAT(r.err, !Catch::Contains("within --timeout"));
  std::filesystem::remove_all(dir);
}

}  // namespace mgtrain_recovery_test
