// TORCHELASTIC_HEALTH_CHECK_PORT (ops/health.h): a real agent answers real HTTP requests on
// the port while its event loop runs, does not answer while it is stopped, and closes the
// port at exit; a bad value is exit 2 before any worker starts.
#include <catch2/catch.hpp>

#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <fstream>

#include <nlohmann/json.hpp>

#include "support/proc.h"

using namespace mgtest;
using namespace std::chrono_literals;

namespace {

// Whether a GET /health sent now is answered within `within` (the connection is accepted
// by the kernel whether or not the agent runs).
bool answers_within(int port, std::chrono::milliseconds within) {
  const int fd = connect_loopback(port);
  if (fd < 0) return false;
  const std::string req = "GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
  bool answered = ::send(fd, req.data(), req.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(req.size());
  if (answered) {
    pollfd p{fd, POLLIN, 0};
    answered = ::poll(&p, 1, static_cast<int>(within.count())) == 1;
  }
  ::close(fd);
  return answered;
}

}  // namespace

TEST_CASE("TORCHELASTIC_HEALTH_CHECK_PORT: the agent answers GET /health from its event loop, not while it is "
          "stopped, and closes the port at exit") {
  const std::string dir = make_temp_dir();
  Proc p = spawn(launch({"--nproc_per_node=2"}, {"pidfile", dir + "/pids", "wait-file", dir + "/go"}),
                 {{"TORCHELASTIC_HEALTH_CHECK_PORT", "0"}});
  REQUIRE(eventually([&] { return health_port_of(p) > 0 && split_lines(read_file(dir + "/pids")).size() >= 2; }, 30s));
  const int port = health_port_of(p);

  const std::string r = http_request(port, "/health");
  INFO(r);
  REQUIRE(r.rfind("HTTP/1.1 200", 0) == 0);
  const auto body = nlohmann::json::parse(body_of(r));
  CHECK(body["alive"] == true);
  CHECK(body["timeout_s"] == 60);
  CHECK(body["workers"]["running"] == 2);
  CHECK(body["restarts"] == 0);
  CHECK(body["last_progress_time"].get<std::int64_t>() > 1700000000);
  CHECK(http_request(port, "/nothing").rfind("HTTP/1.1 404", 0) == 0);
  CHECK(http_request(port, "/health", "", "POST").rfind("HTTP/1.1 405", 0) == 0);

  // A stopped agent does not answer: the prober's timeout sees it; continued, it answers.
  REQUIRE(::kill(p.pid, SIGSTOP) == 0);
  CHECK_FALSE(answers_within(port, 1500ms));
  REQUIRE(::kill(p.pid, SIGCONT) == 0);
  CHECK(eventually([&] { return http_request(port, "/health").rfind("HTTP/1.1 200", 0) == 0; }, 20s));

  std::ofstream(dir + "/go").put('\n');
  REQUIRE(p.wait(60s));
  CHECK(p.exit_code() == 0);
  CHECK(connect_loopback(port) < 0);  // gone with the agent
  run({"/bin/rm", "-rf", dir});
}

TEST_CASE("TORCHELASTIC_HEALTH_CHECK_PORT: a value that is not a port is exit 2 naming it, and a port in use is one "
          "warning and the run goes on") {
  auto r = run(launch({"--nproc_per_node=1"}, {"exit", "0"}), {{"TORCHELASTIC_HEALTH_CHECK_PORT", "health"}});
  CHECK(r.code == 2);
  CHECK_THAT(r.err, Catch::Contains("TORCHELASTIC_HEALTH_CHECK_PORT='health' is not a port"));
  CHECK(split_lines(r.err).size() == 1);

  // Another program serves the port (as a cluster's own checker may): torchrun runs, so do we.
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  REQUIRE(fd >= 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0);
  REQUIRE(::listen(fd, 1) == 0);
  socklen_t len = sizeof(a);
  REQUIRE(::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0);
  auto busy = run(launch({"--nproc_per_node=1"}, {"print", "hi"}),
                  {{"TORCHELASTIC_HEALTH_CHECK_PORT", std::to_string(ntohs(a.sin_port))}});
  ::close(fd);
  INFO(busy.err);
  CHECK(busy.code == 0);
  CHECK(busy.out == "[rank0]:hi\n");
  CHECK(count_of(busy.err, "[mglaunch] warning: no health check: TORCHELASTIC_HEALTH_CHECK_PORT=") == 1);
}
