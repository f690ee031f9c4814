// control::Server: the agent's end of the control channel (docs/in-place-recovery.md). One
// Unix stream socket in the abstract namespace (nothing on disk: a SIGKILLed agent leaves
// nothing behind), served on the agent's io_context. A connection is kept only when its
// peer (SO_PEERCRED) runs as the agent's user and `worker_of` maps its pid to a local rank
// (a worker of this agent or one of its descendants); any other gets one error line and is
// closed. Each local rank has at most one session: the last one that said hello.
// Everything runs on the io thread; the handlers are called from it.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <functional>
#include <memory>
#include <string>

#include <boost/asio/io_context.hpp>

#include "control/protocol.h"

namespace mg::control {

struct ServerOptions {
  std::string name;  // the abstract name (without '@'); empty: mglaunch-<pid>-<16 random hex>
  // The local rank of the worker process `pid` is or descends from; -1: none (refused).
  std::function<int(pid_t)> worker_of;
  std::function<void(const std::string&)> log;  // one line per refused or dropped connection; may be empty
  std::size_t max_sessions = 4096;
  std::size_t max_unsent = 1 << 20;  // bytes queued for a peer that does not read: then dropped
};

struct Handlers {
  std::function<void(int local_rank, const Hello&)> hello;  // after the welcome went out
  std::function<void(int local_rank, const Paused&)> paused;
  // The session of a worker that said hello ended (closed by the peer or for breaking the
  // protocol); not called for one replaced by a newer hello, nor after forget().
  std::function<void(int local_rank)> closed;
};

class Server {
 public:
  // Listens at once. Throws std::runtime_error naming the address when it cannot.
  Server(boost::asio::io_context& io, ServerOptions opts, Handlers handlers);
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  // "@name": what MGLAUNCH_CONTROL_SOCKET holds.
  const std::string& address() const;
  // Queues `line` for local rank `local_rank`'s session; false when it has none.
  bool send(int local_rank, std::string line);
  bool connected(int local_rank) const;
  // Closes local rank `local_rank`'s session without calling `closed` (its worker ended).
  void forget(int local_rank);
  // Closes the socket and every session.
  void stop();
  std::size_t sessions() const;

 private:
  struct Impl;
  std::shared_ptr<Impl> impl_;
};

}  // namespace mg::control
