// The environment contract compared with the reference peer: ../shared/peers/torchrun
// (Debian's torch 1.13) and mglaunch each run fake_worker, which prints its environment.
#include <catch2/catch.hpp>

#include <filesystem>
#include <map>
#include <set>

#include <nlohmann/json.hpp>

#include "support/proc.h"
#include "support/skip.h"
#include "support/torch2.h"

using namespace mgtest;
using namespace std::chrono_literals;

namespace {

// local rank -> environment, from "[rankN]:{json}" or bare "{json}" lines.
std::map<int, nlohmann::json> envs_by_local_rank(const std::string& out) {
  std::map<int, nlohmann::json> m;
  for (const auto& l : split_lines(out)) {
    auto brace = l.find('{');
    if (brace == std::string::npos) continue;
    auto j = nlohmann::json::parse(l.substr(brace));
    m[std::stoi(j["LOCAL_RANK"].get<std::string>())] = j;
  }
  return m;
}

// Compares the environments mglaunch gave (`ours`) with the reference's (`ref`), two workers each.
void compare_envs(const std::string& ref_out, const std::string& ours_out, const std::set<std::string>& extra_ok) {
  auto want = envs_by_local_rank(ref_out);
  auto got = envs_by_local_rank(ours_out);
  REQUIRE(want.size() == 2);
  REQUIRE(got.size() == 2);
  // Values that differ from run to run: compare presence only.
  // TMPDIR: each process a test starts has its own (support/proc.cc).
  const std::set<std::string> run_specific = {"MASTER_PORT", "TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_RUN_ID", "TMPDIR"};
  for (int lr = 0; lr < 2; ++lr) {
    for (auto& [key, value] : want[lr].items()) {
      INFO("local rank " << lr << " variable " << key);
      REQUIRE(got[lr].contains(key));
      if (!run_specific.contains(key)) CHECK(got[lr][key] == value);
    }
    for (auto& [key, value] : got[lr].items()) {
      INFO("mglaunch sets " << key << " which torchrun does not");
      CHECK((want[lr].contains(key) || extra_ok.contains(key)));
    }
    CHECK(got[lr]["TORCHELASTIC_RUN_ID"] == got[0]["TORCHELASTIC_RUN_ID"]);
    CHECK(got[lr]["MASTER_PORT"] == got[0]["MASTER_PORT"]);
  }
  CHECK(got[0]["TORCHELASTIC_ERROR_FILE"] != got[1]["TORCHELASTIC_ERROR_FILE"]);
}

}  // namespace

TEST_CASE("worker environment matches torchrun's for --standalone --nproc_per_node=2") {
  const std::string torchrun = kSourceDir + "/../shared/peers/torchrun";
  // A peer outside the repository: skipped when absent, under CI too (support/skip.h).
  if (!std::filesystem::exists(torchrun))
    SKIP_TEST("the reference torchrun is not at ../shared/peers/torchrun (../shared is absent beside this checkout)");
  require_installed(python_has_torch(), "torch for /usr/bin/python3", "python3-torch");
  std::vector<std::string> argv{"/usr/bin/python3", torchrun,  "--standalone", "--nproc_per_node=2",
                                "--monitor_interval=0.1", "--no_python", kFakeWorker, "env"};
  // torch 1.13's --standalone always takes the same fixed port: in a network namespace of its own
  // (loopback only) two suites running side by side cannot collide on it.
  if (run({"/usr/bin/unshare", "-n", "/bin/true"}).code == 0 && std::filesystem::exists("/usr/sbin/ip"))
    argv.insert(argv.begin(), {"/usr/bin/unshare", "-n", "/bin/sh", "-c", "/usr/sbin/ip link set lo up && exec \"$@\"", "sh"});
  // The same PWD for both (the sh above would otherwise correct a stale inherited one).
  const std::map<std::string, std::string> pwd{{"PWD", std::filesystem::current_path().string()}};
  auto ref = run(argv, pwd, 120s);
  INFO(ref.err);
  REQUIRE(ref.code == 0);
  // The program is not Python: mglaunch follows the torch of its Python, which torchrun runs under.
  auto ours = run({kMglaunch, "--standalone", "--nproc_per_node=2", "--python=/usr/bin/python3", "--no_python",
                   kFakeWorker, "env"},
                  pwd);
  REQUIRE(ours.code == 0);
  // Set by mglaunch on purpose beyond torch 1.13 (torch 2.x's name for the same setting).
  // MGLAUNCH_RUN_MARK: the token of the agent's watchdog (process/watchdog.h).
  // MGLAUNCH_CONTROL_SOCKET: the agent's control channel (docs/in-place-recovery.md).
  compare_envs(ref.out, ours.out, {"TORCH_NCCL_ASYNC_ERROR_HANDLING", "MGLAUNCH_RUN_MARK", "MGLAUNCH_CONTROL_SOCKET", "PYTHONPATH"});
}

TEST_CASE("inside the torch 2.6 root, the worker environment matches torchrun 2.6's, agent store included") {
  const std::string t2 = torch2_or_skip();
  // The root shares /tmp, not the build directory: torchrun 2.6 runs a copy of fake_worker.
  const std::string dir = make_temp_dir();
  const std::string fake = dir + "/fake_worker";
  REQUIRE(run({"/bin/cp", kFakeWorker, fake}).code == 0);
  // torchrun 2.6's --standalone takes a free port: runs beside another suite are fine.
  auto ref = run({t2, "torchrun", "--standalone", "--nproc_per_node=2", "--no_python", fake, "env"}, {}, 180s);
  run({"/bin/rm", "-rf", dir});
  INFO(ref.err);
  REQUIRE(ref.code == 0);
  auto ours = run({t2, "run", kMglaunch, "--standalone", "--nproc_per_node=2", "--no_python", kFakeWorker, "env"}, {},
                  180s);
  INFO(ours.err);
  REQUIRE(ours.code == 0);
  // USE_LIBUV=0: the classic store client, which Debian's libuv-less torch 2.6 needs.
  compare_envs(ref.out, ours.out, {"MGLAUNCH_RUN_MARK", "MGLAUNCH_CONTROL_SOCKET", "USE_LIBUV", "PYTHONPATH"});
  CHECK(envs_by_local_rank(ours.out)[0]["TORCHELASTIC_USE_AGENT_STORE"] == "True");
}
