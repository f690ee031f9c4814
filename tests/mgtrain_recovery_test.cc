// mgtrain --in-place-recovery with real processes, against tests/inplace_agent.py, a
// stand-in agent speaking the worker side of docs/in-place-recovery.md: a worker SIGKILLed
// or hung (SIGSTOP) at step 10 or later is replaced, the survivor rebuilds its group
// without exiting, and the final weights equal an undisturbed run's.
#include <catch2/catch.hpp>

#include <nlohmann/json.hpp>

#include "support/proc.h"
#include "support/skip.h"

using namespace mgtest;
using namespace std::chrono_literals;

namespace {

const std::string kMgtrain = MGTRAIN_BIN;
const std::string kAgent = kSourceDir + "/tests/inplace_agent.py";

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

// The stand-in agent with 2 workers; `agent_flags` pick the fault.
Run train(std::vector<std::string> agent_flags, std::vector<std::string> extra = {}) {
  Run run_;
  run_.dir = make_temp_dir();
  std::vector<std::string> argv{"/usr/bin/python3", kAgent, "--mgtrain", kMgtrain, "--out", run_.dir, "--deadline", "200"};
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

TEST_CASE("in-place recovery: a worker lost at step 10 is replaced, the survivor goes on and the weights equal an undisturbed run's") {
  if (!python_has_torch()) SKIP_TEST("/usr/bin/python3 has no torch (the stand-in agent serves torch's TCPStore)");
  auto calm = train({"--fault", "none"});
  REQUIRE(calm.r.code == 0);
  const std::string digest = calm.summary(0)["weights_sha256"];
  CHECK(calm.summary(1)["weights_sha256"] == digest);
  CHECK(calm.summary(0)["recoveries"].empty());
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

TEST_CASE("--in-place-recovery without a control socket says recovery is off and trains; impossible combinations are exit 2") {
  if (!python_has_torch()) SKIP_TEST("/usr/bin/python3 has no torch (the stand-in agent serves torch's TCPStore)");
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
