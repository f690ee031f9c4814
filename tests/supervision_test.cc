// The agent's supervision rules (launcher/supervision.h), one case per branch.
#include <catch2/catch.hpp>

#include <signal.h>

#include "launcher/supervision.h"

using namespace mg;

TEST_CASE("after a stop a decided abort wins over a late signal, and the signal over every other rule") {
  StopFacts f;
  f.agent_signal = SIGTERM;
  f.rdzv = true;
  f.abort = true;
  f.rejoin = true;
  f.root_cause = true;
  f.max_restarts = 3;
  CHECK(after_stop(f) == AfterStop::kAbort);
  f.abort = false;
  CHECK(after_stop(f) == AfterStop::kStoppedBySignal);
  f.rdzv = false;
  CHECK(after_stop(f) == AfterStop::kStoppedBySignal);
}

TEST_CASE("after a stop in a multi-node job the rendezvous decides: abort, then rejoin, then our report") {
  StopFacts f;
  f.rdzv = true;
  f.max_restarts = 3;  // local restarts never apply under a rendezvous
  CHECK(after_stop(f) == AfterStop::kWait);
  f.root_cause = true;
  CHECK(after_stop(f) == AfterStop::kReportFailure);
  f.rejoin = true;
  CHECK(after_stop(f) == AfterStop::kRejoin);
  f.abort = true;
  CHECK(after_stop(f) == AfterStop::kAbort);
}

TEST_CASE("after a stop on a single node the group restarts while restarts remain, then gives up") {
  StopFacts f;
  f.root_cause = true;
  f.max_restarts = 2;
  f.restart_count = 0;
  CHECK(after_stop(f) == AfterStop::kRestart);
  f.restart_count = 1;
  CHECK(after_stop(f) == AfterStop::kRestart);
  f.restart_count = 2;
  CHECK(after_stop(f) == AfterStop::kGiveUp);
  f.max_restarts = 0;
  f.restart_count = 0;
  CHECK(after_stop(f) == AfterStop::kGiveUp);
  f.root_cause = false;  // stopped for a rendezvous that is gone
  CHECK(after_stop(f) == AfterStop::kEndWithoutCause);
}

TEST_CASE("a node without a decision exits with its own workers' code and never 0 after they were stopped") {
  auto attempt = [](std::vector<WorkerOutcome> ws) {
    AttemptRecord a;
    a.workers = std::move(ws);
    return std::vector<AttemptRecord>{a};
  };
  WorkerOutcome ok{0, 0, 10, 0, 0, 1.0, false};
  WorkerOutcome stopped_143{1, 1, 11, 143, SIGTERM, 1.0, true};
  WorkerOutcome stopped_0{1, 1, 11, 0, 0, 1.0, true};  // handled SIGTERM and exited 0
  WorkerOutcome failed_7{1, 1, 11, 7, 0, 1.0, false};

  CHECK(node_exit_code(std::nullopt, {}) == exit_code::kRendezvous);  // nothing ran
  CHECK(node_exit_code(std::nullopt, attempt({})) == exit_code::kRendezvous);
  CHECK(node_exit_code(std::nullopt, attempt({ok, ok})) == exit_code::kOk);
  CHECK(node_exit_code(std::nullopt, attempt({ok, stopped_143})) == 143);
  CHECK(node_exit_code(std::nullopt, attempt({ok, stopped_0})) == exit_code::kRendezvous);
  CHECK(node_exit_code(std::nullopt, attempt({failed_7, stopped_143})) == 7);  // the first to end
  RootCause rc;
  rc.worker = failed_7;
  CHECK(node_exit_code(rc, attempt({ok, stopped_143})) == 7);  // the root cause wins
  // Only the last attempt counts.
  auto two = attempt({stopped_143});
  AttemptRecord last;
  last.workers = {ok};
  two.push_back(last);
  CHECK(node_exit_code(std::nullopt, two) == exit_code::kOk);
}

TEST_CASE("a signal to the agent: USR1/USR2 forwarded, a second Ctrl-C kills, waiting ends, a stop is graded") {
  auto with = [](int sig, int interrupts, bool waiting, bool stopping) {
    return on_agent_signal(SignalFacts{sig, interrupts, waiting, stopping});
  };
  CHECK(with(SIGUSR1, 0, false, false) == OnSignal::kForward);
  CHECK(with(SIGUSR2, 0, true, true) == OnSignal::kForward);
  CHECK(with(SIGINT, 1, false, false) == OnSignal::kStop);
  CHECK(with(SIGINT, 2, false, true) == OnSignal::kKillNow);
  CHECK(with(SIGINT, 2, true, false) == OnSignal::kKillNow);
  CHECK(with(SIGTERM, 0, true, false) == OnSignal::kEndWhileWaiting);
  CHECK(with(SIGHUP, 0, false, true) == OnSignal::kForwardWhileStopping);
  CHECK(with(SIGTERM, 5, false, false) == OnSignal::kStop);  // only SIGINTs count as interrupts
}

TEST_CASE("a worker whose torch has no libuv gets a root cause saying to set USE_LIBUV=0") {
  const std::vector<std::string> tail = {
      "  File \"/usr/lib/python3/dist-packages/torch/distributed/rendezvous.py\", line 189, in _create_c10d_store",
      "RuntimeError: use_libuv was requested but PyTorch was build without libuv support, run with USE_LIBUV=0 to "
      "disable it."};
  CHECK_THAT(mg::libuv_hint(tail), Catch::Contains("set USE_LIBUV=0"));
  CHECK(mg::libuv_hint({"RuntimeError: something else"}).empty());
}

TEST_CASE("after a stop a node whose rendezvous is gone gives up instead of restarting its share alone") {
  StopFacts f;
  f.root_cause = true;
  f.max_restarts = 1000;
  f.rdzv_lost = true;  // the server refused this node, or stayed away: the other nodes would not restart with it
  CHECK(after_stop(f) == AfterStop::kGiveUp);
  f.root_cause = false;
  CHECK(after_stop(f) == AfterStop::kEndWithoutCause);
}
