// mgtrain's end of the agent's control channel (worker/control.h) against a scripted agent
// on a real abstract Unix socket: hello and welcome, a pause that fires the interrupt
// before any assign, paused, the assign's environment, refusals.
#include <catch2/catch.hpp>

#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstddef>
#include <cstring>
#include <optional>
#include <random>
#include <thread>

#include <nlohmann/json.hpp>

#include "worker/control.h"

using namespace mg::train;
using namespace std::chrono_literals;

namespace {

// A listening abstract socket with a unique name; accept() gives one connection.
struct FakeAgent {
  int lfd = -1, fd = -1;
  std::string name;
  FakeAgent() {
    name = "@mgtest-control-" + std::to_string(::getpid()) + "-" + std::to_string(std::random_device{}());
    sockaddr_un a{};
    a.sun_family = AF_UNIX;
    std::memcpy(a.sun_path + 1, name.data() + 1, name.size() - 1);
    lfd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    REQUIRE(::bind(lfd, reinterpret_cast<sockaddr*>(&a), static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + name.size())) == 0);
    REQUIRE(::listen(lfd, 4) == 0);
  }
  ~FakeAgent() {
    if (fd >= 0) ::close(fd);
    ::close(lfd);
  }
  void accept() { fd = ::accept(lfd, nullptr, nullptr); }
  std::string read_line() {  // bounded by the 5 s receive timeout
    timeval tv{5, 0};
    ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    std::string line;
    char c;
    while (::recv(fd, &c, 1, 0) == 1 && c != '\n') line += c;
    return line;
  }
  void send(const nlohmann::json& j) {
    const std::string s = j.dump() + "\n";
    REQUIRE(::send(fd, s.data(), s.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(s.size()));
  }
};

}  // namespace

TEST_CASE("control channel: hello, welcome, a pause fires the interrupt, paused, then the assign's environment") {
  FakeAgent agent;
  nlohmann::json hello;
  std::thread server([&] {
    agent.accept();
    hello = nlohmann::json::parse(agent.read_line(), nullptr, false);
    agent.send({{"type", "welcome"}, {"version", 1}});
  });
  auto interrupt = std::make_shared<Interrupt>();
  auto channel = std::make_unique<ControlChannel>(agent.name, 3, interrupt);
  server.join();
  CHECK(hello["type"] == "hello");
  CHECK(hello["in_place"] == true);
  CHECK(hello["local_rank"] == 3);
  CHECK(hello["pid"] == ::getpid());
  CHECK_FALSE(interrupt->fired);
  CHECK_FALSE(channel->wait_assign(50ms));  // nothing yet: a bounded wait

  agent.send({{"type", "pause"}, {"round", 0}, {"reason", "node n1 lost"}, {"lost", "host"}, {"x", 1}});
  auto pause = channel->wait_pause(5s);
  REQUIRE(pause);
  CHECK(pause->reason == "node n1 lost");
  CHECK(pause->lost == "host");
  CHECK(interrupt->fired);
  channel->send_paused(12);
  const auto paused = nlohmann::json::parse(agent.read_line(), nullptr, false);
  CHECK(paused["type"] == "paused");
  CHECK(paused["step"] == 12);

  agent.send({{"type", "assign"}, {"round", 1}, {"restart_count", 1}, {"env", {{"RANK", "2"}, {"MASTER_PORT", "4242"}}}});
  auto assign = channel->wait_assign(5s);
  REQUIRE(assign);
  CHECK(assign->restart_count == 1);
  CHECK(assign->env.at("RANK") == "2");
  CHECK(assign->env.at("MASTER_PORT") == "4242");
  CHECK_FALSE(interrupt->fired);  // cleared with the assignment

  SECTION("a second pause keeps the first one's detection time; an assign before a pause is dropped") {
    agent.send({{"type", "pause"}, {"round", 1}, {"reason", "first"}});
    auto first = channel->wait_pause(5s);
    REQUIRE(first);
    agent.send({{"type", "assign"}, {"round", 2}, {"restart_count", 2}, {"env", nlohmann::json::object()}});
    agent.send({{"type", "pause"}, {"round", 2}, {"reason", "second"}});
    std::optional<Pause> second;
    for (int i = 0; i < 500 && !(second && second->reason == "second"); ++i) {  // messages are handled in order
      second = channel->wait_pause(5s);
      std::this_thread::sleep_for(10ms);
    }
    REQUIRE(second->reason == "second");
    CHECK(second->at == first->at);
    CHECK_FALSE(channel->wait_assign(50ms));  // round 2's assign came before the last pause
    agent.send({{"type", "assign"}, {"round", 3}, {"restart_count", 3}, {"env", nlohmann::json::object()}});
    auto third = channel->wait_assign(5s);
    REQUIRE(third);
    CHECK(third->round == 3);
  }
  SECTION("the agent closing the channel ends the waits at once") {
    ::shutdown(agent.fd, SHUT_RDWR);
    const auto t0 = std::chrono::steady_clock::now();
    CHECK_FALSE(channel->wait_pause(30s));
    CHECK(std::chrono::steady_clock::now() - t0 < 20s);
    CHECK_THAT(channel->closed_reason(), Catch::Contains("closed"));
  }
}

TEST_CASE("control channel: no agent, an agent that refuses, and a bad name are one-line errors") {
  auto interrupt = std::make_shared<Interrupt>();
  CHECK_THROWS_WITH(ControlChannel("@mgtest-nobody-" + std::to_string(::getpid()), 0, interrupt),
                    Catch::Contains("cannot connect to the agent's control socket"));
  CHECK_THROWS_WITH(ControlChannel("/not/abstract", 0, interrupt), Catch::Contains("is not an abstract socket name"));
  FakeAgent agent;
  std::thread server([&] {
    agent.accept();
    agent.read_line();
    agent.send({{"type", "error"}, {"message", "not one of my workers"}});
  });
  CHECK_THROWS_WITH(ControlChannel(agent.name, 0, interrupt), Catch::Contains("not one of my workers"));
  server.join();
}
