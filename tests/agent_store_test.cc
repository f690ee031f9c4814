// The agent's store (TORCHELASTIC_USE_AGENT_STORE): real torch workers do an env:// gloo
// all-reduce through mglaunch, with torch 1.13 here and torch 2.6 inside
// ../shared/peers/torch2's root (skipped when it is not set up). Each worker says whether it
// listens on MASTER_PORT itself: with the agent's store none may.
#include <sys/stat.h>

#include <catch2/catch.hpp>

#include "support/proc.h"
#include "support/skip.h"

using namespace mgtest;
using namespace std::chrono_literals;

namespace {

// The worker script, copied under /tmp (the torch 2.6 root shares /tmp, not the checkout);
// removed with its directory when the test binary exits.
std::string worker_script() {
  static const struct Copy {
    std::string dir = make_temp_dir();
    std::string path = dir + "/agent_store_worker.py";
    Copy() {
      auto r = run({"/bin/cp", kSourceDir + "/tests/agent_store_worker.py", path});
      if (r.code != 0) throw std::runtime_error("cannot copy agent_store_worker.py: " + r.err);
    }
    ~Copy() { run({"/bin/rm", "-rf", dir}); }
  } copy;
  return copy.path;
}

std::string torch2_or_skip() {
  const std::string t2 = kSourceDir + "/../shared/peers/torch2";
  struct stat st{};
  if (::stat(t2.c_str(), &st) != 0) SKIP_TEST("torch 2.6 is not at ../shared/peers/torch2 (../shared is absent beside this checkout)");
  const char* root = std::getenv("TORCH2_ROOT");
  const std::string ready = std::string(root ? root : "/var/cache/mglaunch-peers/torch2-root") + "/.ready";
  if (::stat(ready.c_str(), &st) != 0) SKIP_TEST("the torch 2.6 root is not set up: run ../shared/peers/torch2 setup once (~2 min)");
  return t2;
}

// The "store ... sum ... bound ..." lines of a run, one per worker.
std::vector<std::string> results(const std::string& out) {
  std::vector<std::string> r;
  for (const auto& l : split_lines(out))
    if (auto at = l.find("store "); at != std::string::npos) r.push_back(l.substr(at));
  return r;
}

}  // namespace

TEST_CASE("torch 1.13 workers in the static --master_addr form get the agent's store, as from torchrun 1.13, and "
          "none binds MASTER_PORT") {
  require_installed(python_has_torch(), "torch for /usr/bin/python3", "python3-torch");
  auto r = run({kMglaunch, "--nnodes=1", "--node_rank=0", "--master_addr=127.0.0.1", "--master_port=0",
                "--nproc_per_node=3", "--python=/usr/bin/python3", worker_script()},
               {}, 240s);
  INFO(r.out << r.err);
  CHECK(r.code == 0);
  auto lines = results(r.out);
  CHECK(lines.size() == 3);
  for (const auto& l : lines) CHECK(l == "store True sum 6 bound False");
}

TEST_CASE("torch 1.13 workers under --standalone host the store in rank 0, as from torchrun 1.13") {
  require_installed(python_has_torch(), "torch for /usr/bin/python3", "python3-torch");
  auto r = run({kMglaunch, "--standalone", "--nproc_per_node=2", "--python=/usr/bin/python3", worker_script()}, {},
               240s);
  INFO(r.out << r.err);
  CHECK(r.code == 0);
  auto lines = results(r.out);
  REQUIRE(lines.size() == 2);
  std::sort(lines.begin(), lines.end());
  CHECK(lines[0] == "store False sum 3 bound False");
  CHECK(lines[1] == "store False sum 3 bound True");  // rank 0's own TCPStore server
}

TEST_CASE("three torch 2.6 gloo workers run through the agent's store, and TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 "
          "turns it off as in torchrun 2.6") {
  const std::string t2 = torch2_or_skip();
  auto r = run({t2, "run", kMglaunch, "--standalone", "--nproc_per_node=3", worker_script()}, {}, 300s);
  INFO(r.out << r.err);
  CHECK(r.code == 0);
  auto lines = results(r.out);
  CHECK(lines.size() == 3);
  for (const auto& l : lines) CHECK(l == "store True sum 6 bound False");

  auto off = run({t2, "run", kMglaunch, "--standalone", "--nproc_per_node=2", worker_script()},
                 {{"TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1"}}, 300s);
  INFO(off.out << off.err);
  CHECK(off.code == 0);
  auto offl = results(off.out);
  REQUIRE(offl.size() == 2);
  std::sort(offl.begin(), offl.end());
  CHECK(offl[1] == "store False sum 3 bound True");
}

TEST_CASE("a restart starts from an empty agent store: keys of the failed attempt are gone") {
  require_installed(python_has_torch(), "torch for /usr/bin/python3", "python3-torch");
  // Attempt 0 leaves a key and fails; attempt 1 counts the keys it finds.
  const std::string code =
      "import os, sys, datetime, torch.distributed as d\n"
      "s = d.TCPStore(os.environ['MASTER_ADDR'], int(os.environ['MASTER_PORT']), 1, False, "
      "timeout=datetime.timedelta(seconds=30))\n"
      "if os.environ['TORCHELASTIC_RESTART_COUNT'] == '0':\n"
      "    s.set('default_pg/0', 'stale'); sys.exit(1)\n"
      "try:\n"
      "    s.wait(['default_pg/0'], datetime.timedelta(milliseconds=500)); print('stale key found')\n"
      "except Exception:\n"
      "    print('stale key gone')\n";
  // A port given, as the static form's default 29500 is: the same port, so the same store, serves both attempts.
  auto r = run({kMglaunch, "--master_addr=127.0.0.1", "--master_port=" + std::to_string(free_loopback_port()),
                "--max_restarts=1", "--nproc_per_node=1",
                "--no_python", "/usr/bin/python3", "-c", code},
               {}, 240s);
  INFO(r.out << r.err);
  CHECK(r.code == 0);
  CHECK_THAT(r.out, Catch::Contains("stale key gone"));
}
