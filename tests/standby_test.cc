// Standby nodes (#26) with real processes: a real mglaunch-rdzv on 127.0.0.1, agents on
// 127.0.0.2-4 (--local_addr), fake_worker as the workload. The etcd counterparts are in
// etcd_test.cc.
#include <catch2/catch.hpp>

#include <signal.h>

#include <fstream>

#include <nlohmann/json.hpp>

#include "support/proc.h"
#include "support/rdzv_fixture.h"

using namespace mgtest;
using namespace std::chrono_literals;

namespace {

const std::string kStandbyLine = "[mglaunch] standby for job ";

int count_of_up(const std::string& out) {
  int n = 0;
  for (const auto& l : split_lines(out)) n += l.find("up") != std::string::npos;
  return n;
}

}  // namespace

TEST_CASE("standby: the master node's agent SIGKILLed, the standby takes its place at once and the job ends with 0") {
  Daemon d = start_daemon({}, {"--metrics-port", "0", "--http", "127.0.0.1:0"});
  const int metrics_port = port_on_line(d, 1), http_port = port_on_line(d, 2);
  // 1:2 with a last call of 120 s: without the standby the survivor would wait it out,
  // beyond every wait below. One restart: the lost node spends it.
  const std::vector<std::string> flags{"--max_restarts=1",
                                       "--rdzv_conf=last_call_timeout=120,keep_alive_interval=1,keep_alive_max_attempt=3"};
  const std::vector<std::string> worker{"env", "when-restart-below", "1", "print", "up", "hang", "120"};
  Proc a = spawn(agent_argv(d.endpoint, "spare", 2, "1:2", 1, flags, worker));
  Proc b = spawn(agent_argv(d.endpoint, "spare", 3, "1:2", 1, flags, worker));
  REQUIRE(eventually([&] { return a.out().find("up") != std::string::npos && b.out().find("up") != std::string::npos; },
                     60s));
  Proc s = spawn(agent_argv(d.endpoint, "spare", 4, "1:2", 1, flags, worker));
  REQUIRE(eventually([&] { return s.err().find(kStandbyLine) != std::string::npos || !pid_alive(s.pid); }, 30s));
  INFO(s.err());
  CHECK_THAT(s.err(), Catch::Contains(kStandbyLine + "spare"));
  CHECK(envs(s.out()).empty());  // no worker runs on a standby
  // The daemon shows it: the gauges and the status page's node list.
  const std::string metrics = body_of(http_request(metrics_port, "/metrics"));
  CHECK_THAT(metrics, Catch::Contains("mglaunch_rdzv_standby_nodes 1\n"));
  CHECK_THAT(metrics, Catch::Contains("mglaunch_rdzv_job_standby_nodes{job=\"spare\"} 1\n"));
  const auto jobs = nlohmann::json::parse(body_of(http_request(http_port, "/api/jobs")));
  REQUIRE(jobs.size() == 1);
  CHECK(jobs[0]["standby_nodes"] == 1);
  std::multiset<std::string> statuses;
  for (const auto& n : jobs[0]["nodes"]) statuses.insert(n["status"].get<std::string>() + "@" + n["addr"].get<std::string>());
  CHECK(statuses == std::multiset<std::string>{"running@127.0.0.2", "running@127.0.0.3", "standby@127.0.0.4"});

  ::kill(a.pid, SIGKILL);  // 127.0.0.2: group rank 0, the master
  for (auto* p : {&b, &s}) {
    REQUIRE(p->wait(90s));
    INFO(p->err());
    CHECK(p->exit_code() == 0);
  }
  a.wait(10s);
  CHECK_THAT(b.err(), Catch::Contains("restart 1 decided by the rendezvous: node ") &&
                          Catch::Contains("(127.0.0.2) lost: its connection closed"));
  // The node that stays keeps its group rank (1); the standby takes the freed place, 0.
  const auto b_env = envs(b.out()), s_env = envs(s.out());
  REQUIRE(b_env.size() == 2);
  REQUIRE(s_env.size() == 1);
  CHECK(b_env[0]["GROUP_RANK"] == "1");
  CHECK(b_env[1]["GROUP_RANK"] == "1");
  CHECK(b_env[1]["RANK"] == "1");
  CHECK(s_env[0]["GROUP_RANK"] == "0");
  CHECK(s_env[0]["RANK"] == "0");
  CHECK(s_env[0]["WORLD_SIZE"] == "2");
  CHECK(s_env[0]["TORCHELASTIC_RESTART_COUNT"] == "1");
  CHECK(s_env[0]["MASTER_ADDR"] == "127.0.0.4");
  CHECK(b_env[1]["MASTER_ADDR"] == "127.0.0.4");
  CHECK(body_of(http_request(metrics_port, "/metrics")).find("mglaunch_rdzv_standby_nodes 0\n") != std::string::npos);
  ::kill(d.proc.pid, SIGTERM);
  REQUIRE(d.proc.wait(10s));
}

TEST_CASE("standby: a job that ends while the standby waits ends it too: exit 0 after success, the job's code after failure") {
  Daemon d = start_daemon();
  for (const bool fail : {false, true}) {
    INFO("job fails: " << fail);
    const std::string job = fail ? "spare-fails" : "spare-ends";
    const std::string go = make_temp_dir() + "/go";
    std::vector<std::string> worker{"print", "up", "wait-file", go};
    if (fail) worker.insert(worker.end(), {"when-rank", "1", "eprint", "bad input", "exit", "9"});
    Proc a = spawn(agent_argv(d.endpoint, job, 2, "2", 1, {}, worker));
    Proc b = spawn(agent_argv(d.endpoint, job, 3, "2", 1, {}, worker));
    REQUIRE(eventually([&] { return a.out().find("up") != std::string::npos && b.out().find("up") != std::string::npos; },
                       60s));
    Proc s = spawn(agent_argv(d.endpoint, job, 4, "2", 1, {}, worker));
    REQUIRE(eventually([&] { return s.err().find(kStandbyLine) != std::string::npos || !pid_alive(s.pid); }, 30s));
    std::ofstream(go) << "go\n";
    for (auto* p : {&a, &b, &s}) {
      REQUIRE(p->wait(60s));
      INFO(p->err());
      CHECK(p->exit_code() == (fail ? 9 : 0));
    }
    INFO(s.err());
    CHECK_THAT(s.err(), Catch::Contains(kStandbyLine + job));
    CHECK(s.out().find("up") == std::string::npos);  // it never ran a worker
    if (fail) {
      // The same root-cause block as every node's.
      CHECK_THAT(s.err(), Catch::Contains("rank       : 1 (local_rank: 0)") && Catch::Contains("    bad input"));
    } else {
      CHECK_THAT(s.err(), !Catch::Contains("error"));
    }
  }
  ::kill(d.proc.pid, SIGTERM);
  REQUIRE(d.proc.wait(10s));
}

TEST_CASE("standby: the daemon killed and restarted: the standby re-registers as one, the round is rebuilt, all exit 0") {
  Daemon first = first_listening_at("127.0.0.1");
  const std::string endpoint = first.endpoint;
  const std::string go = make_temp_dir() + "/go";
  const std::vector<std::string> worker{"print", "up", "wait-file", go};
  Proc a = spawn(agent_argv(endpoint, "spare-restart", 2, "2", 1, {}, worker));
  Proc b = spawn(agent_argv(endpoint, "spare-restart", 3, "2", 1, {}, worker));
  REQUIRE(eventually([&] { return a.out().find("up") != std::string::npos && b.out().find("up") != std::string::npos; },
                     60s));
  Proc s = spawn(agent_argv(endpoint, "spare-restart", 4, "2", 1, {}, worker));
  REQUIRE(eventually([&] { return s.err().find(kStandbyLine) != std::string::npos || !pid_alive(s.pid); }, 30s));
  // The standby reaches the new daemon first: the two running nodes' agents are stopped
  // until it re-registered (their workers run on).
  ::kill(a.pid, SIGSTOP);
  ::kill(b.pid, SIGSTOP);
  ::kill(first.proc.pid, SIGKILL);
  REQUIRE(first.proc.wait(5s));
  Daemon second = listening_at(endpoint);
  REQUIRE(eventually([&] { return s.err().find("re-registered as a standby") != std::string::npos || !pid_alive(s.pid); },
                     30s));
  ::kill(a.pid, SIGCONT);
  ::kill(b.pid, SIGCONT);
  REQUIRE(eventually([&] {
    return a.err().find("re-registered round 1") != std::string::npos &&
           b.err().find("re-registered round 1") != std::string::npos;
  }, 30s));
  std::ofstream(go) << "go\n";
  for (auto* p : {&a, &b, &s}) {
    REQUIRE(p->wait(60s));
    INFO(p->err() << second.proc.err());
    CHECK(p->exit_code() == 0);
  }
  CHECK(s.out().find("up") == std::string::npos);
  CHECK(count_of_up(a.out()) == 1);
  ::kill(second.proc.pid, SIGTERM);
  second.proc.wait(5s);
}
