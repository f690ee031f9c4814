// Shared by the tests of the rendezvous' pure machines (job_test, client_machine_test,
// quorum_test), which drive them with a fake clock: the clock's start, a node's join, the
// frames of one type among a Job's actions, the ClientMachine's commands by kind, and a Link
// (a machine and its clock, with the steps of a handshake without a token).
#pragma once

#include <optional>
#include <random>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include <catch2/catch.hpp>

#include "rendezvous/client_machine.h"
#include "rendezvous/job.h"

namespace mgtest::rdzv {

using mg::rdzv::Clock;

inline const Clock::time_point T0{};
inline const std::string kNonce(64, 'a');
// Port numbers are data here (the machines open no socket), picked at run time all the same,
// outside the well-known range.
inline const int kRdzvPort = 30000 + static_cast<int>(std::random_device{}() % 10000);

// Node `addr`'s join: agent "agent-ADDR" on host "host-ADDR", keep-alive 100 ms x 3, last
// call 1 s, join_timeout 5 s.
inline mg::proto::Join node(const std::string& addr, int min_nodes, int max_nodes, int nproc = 2,
                            int max_restarts = 0) {
  mg::proto::Join j;
  j.job_id = "job";
  j.agent_id = "agent-" + addr;
  j.host = "host-" + addr;
  j.addr = addr;
  j.nproc = nproc;
  j.min_nodes = min_nodes;
  j.max_nodes = max_nodes;
  j.max_restarts = max_restarts;
  j.master_port = 1000;
  j.last_call_ms = 1000;
  j.keep_alive_ms = 100;
  j.keep_alive_max_attempt = 3;
  j.join_timeout_ms = 5000;
  return j;
}

// The frames of type `t` among a Job's actions.
inline std::vector<mg::rdzv::Outgoing> of_type(const mg::rdzv::Actions& a, mg::proto::MsgType t) {
  std::vector<mg::rdzv::Outgoing> out;
  for (const auto& o : a)
    if (mg::proto::type_of(o.frame) == t) out.push_back(o);
  return out;
}

template <class T>
T decoded(const mg::rdzv::Outgoing& o) {
  return mg::proto::from_frame<T>(mg::proto::frame_of(o.frame));
}

// The ClientMachine's commands of kind T.
template <class T>
std::vector<T> all(const mg::rdzv::ClientCommands& cs) {
  std::vector<T> out;
  for (const auto& c : cs)
    if (auto* x = std::get_if<T>(&c)) out.push_back(*x);
  return out;
}
template <class T>
bool has(const mg::rdzv::ClientCommands& cs) {
  return !all<T>(cs).empty();
}
// The decisions told to the agent, of type T.
template <class T>
std::vector<T> told(const mg::rdzv::ClientCommands& cs) {
  std::vector<T> out;
  for (const auto& t : all<mg::rdzv::cmd::Tell>(cs))
    if (auto* x = std::get_if<T>(&t.d)) out.push_back(*x);
  return out;
}
// When timer `t` was last armed in `cs` (nullopt: not armed there).
inline std::optional<Clock::time_point> armed(const mg::rdzv::ClientCommands& cs, mg::rdzv::ClientTimer t) {
  std::optional<Clock::time_point> at;
  for (const auto& a : all<mg::rdzv::cmd::Arm>(cs))
    if (a.timer == t) at = a.at;
  return at;
}

// A machine and its fake clock, with the steps of a handshake without a token.
struct Link {
  mg::rdzv::ClientMachine m;
  Clock::time_point now = T0;
  explicit Link(mg::rdzv::ClientOptions o) : m(std::move(o)) {}

  mg::rdzv::ClientCommands welcome(const std::string& host_agent = {}) {
    auto c = m.connected(kNonce, now);
    auto w = m.frame(mg::proto::to_frame(mg::proto::Welcome{"srv", host_agent}), now);
    c.insert(c.end(), w.begin(), w.end());
    return c;
  }
  mg::rdzv::ClientCommands receive(const auto& msg) { return m.frame(mg::proto::to_frame(msg), now); }
  mg::rdzv::ClientCommands fire(mg::rdzv::ClientTimer t) { return m.timer_fired(t, m.generation(t), now); }  // its current arm
  mg::rdzv::ClientCommands after(Clock::duration d, mg::rdzv::ClientTimer t) {
    now += d;
    return fire(t);
  }
};

}  // namespace mgtest::rdzv
