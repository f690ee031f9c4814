// End to end: a plain PyTorch DDP script (examples/ddp_train.py) under mglaunch.
#include <catch2/catch.hpp>

#include "support/proc.h"
#include "support/skip.h"

using namespace mgtest;
using namespace std::chrono_literals;

TEST_CASE("examples/ddp_train.py trains with gloo under mglaunch --nproc_per_node=2") {
  require_installed(python_has_torch(), "torch for /usr/bin/python3", "python3-torch");
  auto r = run({kMglaunch, "--standalone", "--nproc_per_node=2", "--python", "/usr/bin/python3",
                kSourceDir + "/examples/ddp_train.py", "--epochs", "2"},
               {}, 240s);
  INFO(r.err);
  REQUIRE(r.code == 0);
  // Rank-0-only logging: every progress line comes from rank 0.
  CHECK_THAT(r.out, Catch::Contains("[rank0]:epoch 1"));
  CHECK_THAT(r.out, Catch::Contains("world_size=2"));
  CHECK_THAT(r.out, !Catch::Contains("[rank1]:epoch"));
  CHECK_THAT(r.out, Catch::Contains("[rank0]:done"));
}
