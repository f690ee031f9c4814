// Shared by the rendezvous tests: a real mglaunch-rdzv started on 127.0.0.1:0 (its port
// read from its first line) and the argv of an agent joining it as node 127.0.0.N.
#pragma once

#include <chrono>
#include <map>
#include <regex>
#include <set>
#include <string>
#include <vector>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include "support/proc.h"

namespace mgtest {

struct Daemon {
  Proc proc;
  std::string endpoint;
  int port() const { return std::stoi(endpoint.substr(endpoint.rfind(':') + 1)); }
};

inline Daemon start_daemon(std::map<std::string, std::string> env = {}, std::vector<std::string> flags = {}) {
  using namespace std::chrono_literals;
  std::vector<std::string> argv{kRdzvDaemon, "--listen", "127.0.0.1:0"};
  argv.insert(argv.end(), flags.begin(), flags.end());
  Daemon d{spawn(argv, env), ""};
  REQUIRE(eventually([&] { return d.proc.out().find('\n') != std::string::npos; }, 10s));
  auto line = split_lines(d.proc.out()).at(0);
  REQUIRE(line.rfind("listening on ", 0) == 0);
  d.endpoint = line.substr(13);
  return d;
}

// A daemon on a given endpoint (to restart one where agents expect it). Returns once it
// printed its first line or died; the caller checks for "listening on".
inline Daemon listen_at(const std::string& endpoint) {
  using namespace std::chrono_literals;
  Daemon d{spawn({kRdzvDaemon, "--listen", endpoint}), endpoint};
  REQUIRE(eventually([&] { return d.proc.out().find('\n') != std::string::npos || !pid_alive(d.proc.pid); }, 10s));
  return d;
}

// A daemon listening on `host` at a port of free_loopback_port(), for a test that starts it
// again on the same endpoint later (listening_at(d.endpoint)). Started again on another
// port, 5 tries at most, when it exits 3 saying it cannot listen there, the address in use
// (the port was taken meanwhile by a process outside the tests' reservation, support/net.h).
inline Daemon first_listening_at(const std::string& host) {
  using namespace std::chrono_literals;
  for (int attempt = 1;; ++attempt) {
    Daemon d = listen_at(host + ":" + std::to_string(free_loopback_port()));
    if (d.proc.out().find("listening on") != std::string::npos) return d;
    // (Exit 3 is any exception at start: only the port-in-use line is retried, review s39 L12.)
    const bool in_use = d.proc.wait(5s) && d.proc.exit_code() == 3 &&
                        d.proc.err().find("cannot listen on") != std::string::npos &&
                        d.proc.err().find("in use") != std::string::npos;
    if (!in_use || attempt == 5) {
      INFO(d.proc.err());
      REQUIRE_THAT(d.proc.out(), Catch::Contains("listening on"));
    }
  }
}

// listen_at() that must succeed.
inline Daemon listening_at(const std::string& endpoint) {
  Daemon d = listen_at(endpoint);
  REQUIRE_THAT(d.proc.out(), Catch::Contains("listening on"));
  return d;
}

// The port of a URL the daemon printed on line `index` ("metrics on http://H:P/metrics").
inline int port_on_line(const Daemon& d, std::size_t index) {
  using namespace std::chrono_literals;
  REQUIRE(eventually([&] { return split_lines(d.proc.out()).size() > index; }, 10s));
  const auto line = split_lines(d.proc.out()).at(index);
  std::smatch m;
  REQUIRE(std::regex_search(line, m, std::regex(R"(http://[0-9.]+:([0-9]+)/)")));
  return std::stoi(m[1]);
}

inline std::vector<std::string> agent_argv(const std::string& endpoint, const std::string& job, int index,
                                           std::string nnodes, int nproc, std::vector<std::string> flags,
                                           std::vector<std::string> worker, const std::string& backend = "c10d") {
  std::vector<std::string> argv{kMglaunch,
                                "--nnodes=" + nnodes,
                                "--nproc_per_node=" + std::to_string(nproc),
                                "--rdzv_backend=" + backend,
                                "--rdzv_endpoint=" + endpoint,
                                "--rdzv_id=" + job,
                                "--local_addr=127.0.0." + std::to_string(index)};
  argv.insert(argv.end(), flags.begin(), flags.end());
  argv.push_back(kFakeWorker);
  argv.insert(argv.end(), worker.begin(), worker.end());
  return argv;
}

// The environments fake_worker's `env` printed, one JSON object per line of `out`.
inline std::vector<nlohmann::json> envs(const std::string& out) {
  std::vector<nlohmann::json> v;
  for (const auto& l : split_lines(out))
    if (auto b = l.find('{'); b != std::string::npos) v.push_back(nlohmann::json::parse(l.substr(b)));
  return v;
}

// What the workers of a job saw, over every agent (each waited for, exit 0 checked).
struct WorldSeen {
  std::multiset<std::string> ranks;
  std::set<std::string> masters, ports, worlds;  // worlds: "WORLD_SIZE/GROUP_WORLD_SIZE"
};
inline WorldSeen world_seen(std::vector<Proc>& agents, std::chrono::milliseconds timeout) {
  WorldSeen w;
  for (auto& a : agents) {
    REQUIRE(a.wait(timeout));
    INFO(a.err());
    CHECK(a.exit_code() == 0);
    for (const auto& e : envs(a.out())) {
      w.ranks.insert(e["RANK"].get<std::string>());
      w.masters.insert(e["MASTER_ADDR"].get<std::string>());
      w.ports.insert(e["MASTER_PORT"].get<std::string>());
      w.worlds.insert(e["WORLD_SIZE"].get<std::string>() + "/" + e["GROUP_WORLD_SIZE"].get<std::string>());
    }
  }
  return w;
}

}  // namespace mgtest
