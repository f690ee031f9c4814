// control::Server: the agent's end of the control channel (docs/in-place-recovery.md). One
// Unix stream socket in the abstract namespace (nothing on disk: a SIGKILLed agent leaves
// nothing behind), served on the agent's io_context. A connection is kept only when its
// peer (SO_PEERCRED) runs as the agent's user and `worker_of` maps its pid to a local rank
// (a worker of this agent or one of its descendants); any other gets one error line and is
// closed. Each local rank has at most one session: the worker process itself wins over its
// descendants, otherwise the last one that said hello; a replaced session (or a descendant's
// hello refused because the worker holds the session) gets one error line, then closes.
// A connection must say hello within `hello_timeout`; each local rank may hold at most
// `max_pending_per_rank` connections that have not said hello yet.
// Everything runs on the io thread; the handlers are called from it.
#pragma once

#include <sys/types.h>

#include <chrono>
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
  // The pid of local rank `local_rank`'s worker process (0: unknown). Its own session wins
  // over its descendants'. Empty: every peer counts as the worker itself.
  std::function<pid_t(int)> worker_pid;
  // A line per refused or dropped connection, at most one a second (the next one counts
  // those left out); may be empty.
  std::function<void(const std::string&)> log;
  // Connections at once; 0: a quarter of the soft descriptor limit (RLIMIT_NOFILE), at
  // most 4096 and at least 16, so that sessions never take the agent's last descriptors.
  // The agent gives its share instead (sup::descriptor_shares).
  std::size_t max_sessions = 0;
  std::size_t max_pending_per_rank = 16;  // connections of one local rank before their hello
  std::chrono::milliseconds hello_timeout{10000};  // a connection silent for longer is closed
  std::size_t max_unsent = 1 << 20;  // bytes queued for a peer that does not read: then dropped
};

struct Handlers {
  std::function<void(int local_rank, const Hello&)> hello;  // after the welcome went out
  std::function<void(int local_rank, const Paused&)> paused;
  // The session of a worker that said hello ended (closed by the peer or for breaking the
  // protocol); not called for one replaced by a newer hello, nor after forget(). `why`: which
  // side ended it and how, one phrase ("the worker closed it (end of file)", "the agent
  // refused it: ...", "the agent's write to it failed: ...").
  std::function<void(int local_rank, const std::string& why)> closed;
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
  // Why local rank `local_rank`'s last session ended, one phrase ("" while it has one, or
  // never had one): what a failed send() is explained with.
  std::string ended_why(int local_rank) const;
  // Closes local rank `local_rank`'s session without calling `closed` (its worker ended).
  void forget(int local_rank);
  // Closes the socket and every session.
  void stop();
  std::size_t sessions() const;
  // accept() calls that failed (EMFILE and the like); after each the server pauses 100 ms.
  std::size_t accept_failures() const;

 private:
  struct Impl;
  std::shared_ptr<Impl> impl_;
};

}  // namespace mg::control
