// The agent under stress (issue #11): what a worker inherits, what is left running after
// the agent stops, master ports under load, a stalled console. Real mglaunch agents,
// real fake_worker processes, rendezvous on 127.0.0.x with ports picked at run time.
#include <catch2/catch.hpp>

#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <map>
#include <set>

#include <nlohmann/json.hpp>

#include "support/proc.h"

using namespace mgtest;
using namespace std::chrono_literals;

namespace {

int free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  socklen_t len = sizeof(a);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  return ntohs(a.sin_port);
}

std::vector<std::string> standalone(std::vector<std::string> flags, std::vector<std::string> worker) {
  std::vector<std::string> argv{kMglaunch, "--standalone"};
  argv.insert(argv.end(), flags.begin(), flags.end());
  argv.push_back(kFakeWorker);
  argv.insert(argv.end(), worker.begin(), worker.end());
  return argv;
}

// One agent of an n-node job on 127.0.0.<index> against the rendezvous at `endpoint`
// (the first agent to come hosts it).
std::vector<std::string> node_argv(const std::string& endpoint, const std::string& job, int index, int nnodes,
                                   std::vector<std::string> flags, std::vector<std::string> worker) {
  std::vector<std::string> argv{kMglaunch,
                                "--nnodes=" + std::to_string(nnodes),
                                "--nproc_per_node=1",
                                "--rdzv_backend=c10d",
                                "--rdzv_endpoint=" + endpoint,
                                "--rdzv_id=" + job,
                                "--local_addr=127.0.0." + std::to_string(index)};
  argv.insert(argv.end(), flags.begin(), flags.end());
  argv.push_back(kFakeWorker);
  argv.insert(argv.end(), worker.begin(), worker.end());
  return argv;
}

// The JSON objects printed by the workers ("[rankN]:{...}" lines).
std::vector<nlohmann::json> json_lines(const std::string& out) {
  std::vector<nlohmann::json> v;
  for (const auto& l : split_lines(out))
    if (auto b = l.find(":{"); b != std::string::npos) v.push_back(nlohmann::json::parse(l.substr(b + 1)));
  return v;
}

std::set<std::string> fd_numbers(const nlohmann::json& j) {
  std::set<std::string> s;
  for (const auto& [k, v] : j["fds"].items()) s.insert(k);
  return s;
}

}  // namespace

TEST_CASE("a worker inherits no descriptor of the agent: only stdin, stdout and stderr") {
  SECTION("in a 2-node job, where the agent holds rendezvous sockets") {
    const std::string ep = "127.0.0.1:" + std::to_string(free_port());
    Proc a = spawn(node_argv(ep, "fds", 1, 2, {}, {"fds"}));
    Proc b = spawn(node_argv(ep, "fds", 2, 2, {}, {"fds"}));
    for (auto* p : {&a, &b}) {
      REQUIRE(p->wait(30s));
      INFO(p->out() << p->err());
      CHECK(p->exit_code() == 0);
      auto lines = json_lines(p->out());
      REQUIRE(lines.size() == 1);
      INFO(lines[0].dump());
      CHECK(fd_numbers(lines[0]) == std::set<std::string>{"0", "1", "2"});
    }
  }
  SECTION("in a standalone run with redirected logs and two workers") {
    std::string dir = make_temp_dir();
    auto r = run(standalone({"--nproc_per_node=2", "--log_dir", dir, "--tee", "3"}, {"fds"}));
    INFO(r.out << r.err);
    CHECK(r.code == 0);
    auto lines = json_lines(r.out);
    REQUIRE(lines.size() == 2);
    for (const auto& l : lines) {
      INFO(l.dump());
      CHECK(fd_numbers(l) == std::set<std::string>{"0", "1", "2"});
    }
  }
}

TEST_CASE("the rendezvous token never reaches a worker's environment") {
  const std::string token = "s3cret-token-" + std::to_string(::getpid());
  const std::string ep = "127.0.0.1:" + std::to_string(free_port());
  const std::map<std::string, std::string> env{{"MGLAUNCH_RDZV_TOKEN", token}};
  Proc a = spawn(node_argv(ep, "token", 1, 2, {}, {"env"}), env);
  Proc b = spawn(node_argv(ep, "token", 2, 2, {}, {"env"}), env);
  for (auto* p : {&a, &b}) {
    REQUIRE(p->wait(30s));
    INFO(p->err());
    CHECK(p->exit_code() == 0);
    auto lines = json_lines(p->out());
    REQUIRE(lines.size() == 1);
    CHECK(lines[0].contains("RANK"));  // the dump is the worker's environment
    CHECK_FALSE(lines[0].contains("MGLAUNCH_RDZV_TOKEN"));
    CHECK(p->out().find(token) == std::string::npos);
  }
}
