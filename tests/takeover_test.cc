// The agent that hosts the rendezvous (c10d-style: the agent at --rdzv_endpoint) SIGKILLed
// mid-run, with real agents on 127.0.0.2-127.0.0.4 and fake_worker as the workload
// (#26, "the hosting agent's death is survivable").
#include <catch2/catch.hpp>

#include <signal.h>

#include <algorithm>
#include <chrono>
#include <string>
#include <vector>

#include "support/proc.h"
#include "support/rdzv_fixture.h"

using namespace mgtest;
using namespace std::chrono_literals;

namespace {

// Starts the hosting agent on 127.0.0.2 first (so that it is the one listening at the
// endpoint), then the agents on 127.0.0.3 and 127.0.0.4; returns once every worker printed
// "up". agents[0] hosts.
std::vector<Proc> start_job(const std::string& ep, const std::string& job, const std::string& nnodes,
                            const std::vector<std::string>& flags, const std::vector<std::string>& worker) {
  std::vector<Proc> agents;
  agents.push_back(spawn(agent_argv(ep, job, 2, nnodes, 1, flags, worker)));
  REQUIRE(eventually([&] { return agents[0].err().find("hosting the rendezvous") != std::string::npos; }, 20s));
  for (int i : {3, 4}) agents.push_back(spawn(agent_argv(ep, job, i, nnodes, 1, flags, worker)));
  REQUIRE(eventually([&] {
    return std::all_of(agents.begin(), agents.end(), [](Proc& p) { return p.out().find("up") != std::string::npos; });
  }, 30s));
  return agents;
}

}  // namespace

TEST_CASE("the hosting agent SIGKILLed with no restart left: every survivor ends with the lost host as root cause, "
          "exit 3, never after join_timeout") {
  const std::string ep = "127.0.0.2:" + std::to_string(free_loopback_port());
  // join_timeout is left at 600 s: a survivor that waited it out fails the wait below.
  const std::vector<std::string> flags{"--rdzv_conf=keep_alive_interval=1,keep_alive_max_attempt=3"};
  std::vector<Proc> agents = start_job(ep, "hostlost", "3", flags, {"print", "up", "hang", "300"});
  ::kill(agents[0].pid, SIGKILL);
  for (int i : {1, 2}) {
    REQUIRE(agents[i].wait(60s));
    INFO(agents[i].err());
    CHECK(agents[i].exit_code() == 3);
    CHECK_THAT(agents[i].out() + agents[i].err(),
               Catch::Contains("rendezvous host ") && Catch::Contains("(" + ep + ") lost: ") &&
                   !Catch::Contains("join_timeout"));
  }
  agents[0].wait(5s);
}
