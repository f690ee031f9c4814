// End to end: a plain PyTorch DDP script (examples/ddp_train.py) under mglaunch, run by the
// command line the README's front door gives, word for word.
#include <catch2/catch.hpp>

#include <sstream>

#include "support/proc.h"
#include "support/skip.h"

using namespace mgtest;
using namespace std::chrono_literals;

namespace {

// The README's command line that runs examples/ddp_train.py (its comment dropped), as words.
std::vector<std::string> readme_example() {
  std::istringstream lines(read_file(kSourceDir + "/README.md"));
  for (std::string line; std::getline(lines, line);) {
    if (!line.starts_with("build/bin/mglaunch ") || line.find("examples/ddp_train.py") == std::string::npos) continue;
    std::istringstream words(line.substr(0, line.find(" #")));
    std::vector<std::string> argv;
    for (std::string w; words >> w;) argv.push_back(w);
    return argv;
  }
  return {};
}

}  // namespace

TEST_CASE("the README's example, build/bin/mglaunch ... examples/ddp_train.py, trains with gloo word for word") {
  require_installed(python_has_torch(), "torch for /usr/bin/python3", "python3-torch");
  std::vector<std::string> argv = readme_example();
  INFO("README.md must give a line 'build/bin/mglaunch ... examples/ddp_train.py'");
  REQUIRE(argv.size() >= 2);
  // Run from the source directory, as a user who just ran `make run` there; the binary is
  // this build's (the same one when the build directory is build/).
  argv.front() = kMglaunch;
  std::vector<std::string> cmd{"/bin/sh", "-c", "cd \"$0\" && exec \"$@\"", kSourceDir};
  cmd.insert(cmd.end(), argv.begin(), argv.end());
  auto r = run(cmd, {}, 240s);
  INFO(r.err);
  REQUIRE(r.code == 0);
  // Rank-0-only logging: every progress line comes from rank 0.
  CHECK_THAT(r.out, Catch::Contains("[rank0]:epoch 1"));
  CHECK_THAT(r.out, Catch::Contains("world_size="));
  CHECK_THAT(r.out, !Catch::Contains("[rank1]:epoch"));
  CHECK_THAT(r.out, Catch::Contains("[rank0]:done"));
}
