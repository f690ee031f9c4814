// mgtrain on LibTorch 2.6 (Debian 13's libtorch-dev) as well as on the LibTorch this build
// found: tests/support/torch2_mgtrain.sh builds it inside the torch 2.6 peer's root
// (../shared/peers/torch2; skipped when absent) into MGTRAIN_TORCH26_DIR, kept between runs,
// with the reducer's own tests (tests/mgtrain_reducer_test.cc); it trains there under our
// mglaunch. Needs no LibTorch on the host.
#include <catch2/catch.hpp>

#include "support/mgtrain_run.h"
#include "support/proc.h"
#include "support/skip.h"
#include "support/torch2.h"

using namespace mgtest;
using namespace std::chrono_literals;

namespace {

// BUILD_DIR/bin/mgtrain built against LibTorch 2.6 in the root, or a skip saying why not.
std::string mgtrain_26() {
  torch2_or_skip();
  const std::string dir = MGTRAIN_TORCH26_DIR;
  // The script bounds its apt (600 s, after at most 600 s waiting for another's) and its
  // build (1500 s) itself.
  auto b = run({kSourceDir + "/tests/support/torch2_mgtrain.sh", dir}, {}, 2800s);
  if (b.code == 77) {
    const std::string line = b.out.substr(0, b.out.find('\n'));
    SKIP_TEST(line.substr(line.rfind("skipped: ", 0) == 0 ? 9 : 0));
  }
  INFO(b.out << b.err);
  REQUIRE(b.code == 0);
  return dir + "/bin/mgtrain";
}

}  // namespace

TEST_CASE("on LibTorch 2.6 our reducer and c10d::Reducer give bit-identical weights, through our mglaunch in the torch 2.6 root") {
  const std::string mgtrain = mgtrain_26();
  // torch2 run shares /tmp, the directory it runs in and mglaunch's: it runs in mgtrain's.
  const std::string bin_dir = mgtrain.substr(0, mgtrain.rfind('/'));
  check_reducers_agree({"/usr/bin/env", "-C", bin_dir, torch2_or_skip(), "run"}, mgtrain, false);
}

TEST_CASE("on Debian's libuv-less LibTorch 2.6 mgtrain uses the classic store unless USE_LIBUV=1 asks for libuv") {
  const std::string mgtrain = mgtrain_26();
  const std::string bin_dir = mgtrain.substr(0, mgtrain.rfind('/'));
  const std::string t2 = torch2_or_skip();
  const std::vector<std::string> args{"--model", "mlp", "--max-steps", "2"};
  auto classic = train_with({"/usr/bin/env", "-C", bin_dir, "USE_LIBUV=0", t2, "run"}, mgtrain, 2, args);
  CHECK(classic.code == 0);
  auto asked = train_with({"/usr/bin/env", "-C", bin_dir, "USE_LIBUV=1", t2, "run"}, mgtrain, 2, args);
  CHECK(asked.code != 0);
  CHECK_THAT(asked.err, Catch::Contains("mgtrain: error: cannot reach the c10d store") && Catch::Contains("libuv"));
}

TEST_CASE("on LibTorch 2.6 the reducer's own tests pass (ranks as threads over a HashStore and Gloo)") {
  const std::string mgtrain = mgtrain_26();
  const std::string bin_dir = mgtrain.substr(0, mgtrain.rfind('/'));
  auto r = run({"/usr/bin/env", "-C", bin_dir, torch2_or_skip(), "run", bin_dir + "/mgtrain_reducer_tests"}, {}, 300s);
  INFO(r.out << r.err);
  CHECK(r.code == 0);
  CHECK_THAT(r.out, Catch::Contains("All tests passed"));
}
