// The agent's store (TORCHELASTIC_USE_AGENT_STORE): real torch workers do an env:// gloo
// all-reduce through mglaunch, with torch 1.13 here and torch 2.6 inside
// ../shared/peers/torch2's root (skipped when it is not set up). Each worker says whether it
// listens on MASTER_PORT itself: with the agent's store none may.
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>

#include <catch2/catch.hpp>

#include "support/proc.h"
#include "support/skip.h"
#include "support/torch2.h"

using namespace mgtest;
using namespace std::chrono_literals;

namespace {

std::string worker_script() {
  static const TmpCopy copy("tests/agent_store_worker.py");
  return copy.path();
}

// The "store ... sum ... bound ..." lines of a run that must have ended with 0, one per
// worker, sorted.
std::vector<std::string> results(const Result& run) {
  INFO(run.out << run.err);
  CHECK(run.code == 0);
  std::vector<std::string> r;
  for (const auto& l : split_lines(run.out))
    if (auto at = l.find("store "); at != std::string::npos) r.push_back(l.substr(at));
  std::sort(r.begin(), r.end());
  return r;
}

}  // namespace

TEST_CASE("torch 1.13 workers in the static --master_addr form get the agent's store, as from torchrun 1.13, and "
          "none binds MASTER_PORT") {
  require_installed(python_has_torch(), "torch for /usr/bin/python3", "python3-torch");
  auto r = run({kMglaunch, "--nnodes=1", "--node_rank=0", "--master_addr=127.0.0.1", "--master_port=0",
                "--nproc_per_node=3", "--python=/usr/bin/python3", worker_script()},
               {}, 240s);
  auto lines = results(r);
  CHECK(lines.size() == 3);
  for (const auto& l : lines) CHECK(l == "store True sum 6 bound False");
}

TEST_CASE("torch 1.13 workers under --standalone host the store in rank 0, as from torchrun 1.13") {
  require_installed(python_has_torch(), "torch for /usr/bin/python3", "python3-torch");
  auto r = run({kMglaunch, "--standalone", "--nproc_per_node=2", "--python=/usr/bin/python3", worker_script()}, {},
               240s);
  auto lines = results(r);
  REQUIRE(lines.size() == 2);
  CHECK(lines[0] == "store False sum 3 bound False");
  CHECK(lines[1] == "store False sum 3 bound True");  // rank 0's own TCPStore server
}

TEST_CASE("three torch 2.6 gloo workers run through the agent's store, and TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 "
          "turns it off as in torchrun 2.6") {
  const std::string t2 = torch2_or_skip();
  auto lines = results(run({t2, "run", kMglaunch, "--standalone", "--nproc_per_node=3", worker_script()}, {}, 300s));
  CHECK(lines.size() == 3);
  for (const auto& l : lines) CHECK(l == "store True sum 6 bound False");

  auto offl = results(run({t2, "run", kMglaunch, "--standalone", "--nproc_per_node=2", worker_script()},
                          {{"TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1"}}, 300s));
  REQUIRE(offl.size() == 2);
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
  // A port given, as the static form's default is: the same port, so the same store, serves both attempts.
  auto r = run({kMglaunch, "--master_addr=127.0.0.1", "--master_port=" + std::to_string(free_loopback_port()),
                "--max_restarts=1", "--nproc_per_node=1",
                "--no_python", "/usr/bin/python3", "-c", code},
               {}, 240s);
  INFO(r.out << r.err);
  CHECK(r.code == 0);
  CHECK_THAT(r.out, Catch::Contains("stale key gone"));
}

TEST_CASE("static form, two nodes: node 0's store serves node 1's workers after node 0's own are done, as "
          "torchrun's exit barrier keeps it") {
  require_installed(python_has_torch(), "torch for /usr/bin/python3", "python3-torch");
  const std::string port = std::to_string(free_loopback_port());
  auto node = [&](int rank) {
    return spawn({kMglaunch, "--nnodes=2", "--node_rank=" + std::to_string(rank), "--master_addr=127.0.0.1",
                  "--master_port=" + port, "--nproc_per_node=1", "--python=/usr/bin/python3", worker_script()},
                 {{"AGENT_STORE_TEST_LATE", "5"}});
  };
  Proc n0 = node(0), n1 = node(1);
  REQUIRE(n0.wait(240s));
  REQUIRE(n1.wait(240s));
  INFO("node 0: " << n0.out() << n0.err() << "\nnode 1: " << n1.out() << n1.err());
  CHECK(n0.exit_code() == 0);
  CHECK(n1.exit_code() == 0);
  CHECK_THAT(n1.out(), Catch::Contains("late store use ok"));
  CHECK_THAT(n0.err(), Catch::Contains("serving the store on port " + port + " until the other nodes' workers leave it"));
}

TEST_CASE("the real agent's store that cannot listen on the master port stops the run before any worker, exit 4") {
  // Something listens on the port on another loopback address: the plan's check (127.0.0.1)
  // passes, the store's wildcard bind does not. Workers must not reach that other server.
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  REQUIRE(fd >= 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(0x7f000002);
  REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0);
  REQUIRE(::listen(fd, 1) == 0);
  socklen_t len = sizeof(a);
  REQUIRE(::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0);
  const std::string port = std::to_string(ntohs(a.sin_port));
  auto r = run(launch({"--nproc_per_node=1", "--master_port=" + port}, {"print", "ran"}));
  ::close(fd);
  INFO(r.err);
  CHECK(r.code == 4);
  CHECK(r.out.empty());
  CHECK_THAT(r.err, Catch::Contains("cannot serve the agent's store on port " + port) &&
                        Catch::Contains("TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"));
}
