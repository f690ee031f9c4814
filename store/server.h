// StoreServer: c10d's TCPStore protocol (store/wire.h) served on the agent's io_context,
// so that workers connect to the agent's store as clients (TORCHELASTIC_USE_AGENT_STORE)
// and no worker binds MASTER_PORT. One acceptor, one small session per client; reads go
// into one shared scratch buffer and only an unfinished query stays with its session, so
// an idle client costs a socket and a few hundred bytes. Replies carry stored values
// shared, not copied (Engine's Value), and go out as one scatter/gather write: 64 clients
// reading one 3 MiB value hold it once. A client's next queries are not read while its
// replies are unwritten (back-pressure), so one that does not read holds one reply.
// Bounded: clients, key and value sizes, keys per query, bytes stored, and the bytes held
// for all clients together (their unfinished queries, their replies not yet written at the
// memory they hold, each shared value the store no longer holds once: max_buffered, over
// which the client charged the most, such values whole, is disconnected); a client that breaks a bound or the protocol is disconnected with one
// log line (at most one a second), and nothing a client sends ends the server. Its memory
// is thus at most max_bytes + max_buffered + a query being served.
#pragma once

#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <string>

#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>

#include "store/engine.h"
#include "store/wire.h"

namespace mg::store {

struct ServerOptions {
  // Clients at once, parked ones included (the agent's share of its descriptors). At the
  // limit a newcomer displaces a silent client (one that never sent a whole query, the
  // oldest first; else one whose query has not been whole for query_deadline), or is
  // refused. A silent client paired with a served one of its address, as torch 1.13's
  // callback connection is with its first, is not displaced while that one is connected
  // (closed, torch 1.13's client busy-loops a core).
  std::size_t max_clients = 100000;
  // Clients at once from one address, parked ones included; at it, a newcomer displaces a
  // silent client of that address, or is refused. Every local worker connects from
  // 127.0.0.1: torch's c10d opens about 2 connections a worker, so 64 workers with the
  // parked clients of an ended attempt come to about 256; twice that keeps them all.
  std::size_t max_per_address = 512;
  std::chrono::milliseconds query_deadline{10000};
  std::size_t max_bytes = std::size_t{1} << 30;  // keys and values stored
  // One reply, at most (a GET or MULTI_GET over it closes its client): one GET of the
  // largest value (limits.max_value and its 8-byte length) fits. A client that does not
  // read holds at most one reply and 64 KiB of small ones (its queries wait meanwhile).
  std::size_t max_unread = (std::size_t{64} << 20) + 8;
  // Unfinished queries and unwritten replies of all clients together, a value shared by
  // several replies counted once and only once the store no longer holds it: one largest query (limits.max_query, lowered to this
  // when larger) and some room for the others.
  std::size_t max_buffered = std::size_t{160} << 20;
  Limits limits;
  std::function<void(const std::string&)> log;  // one line per dropped client; may be empty
};

class StoreServer {
 public:
  // Serves on `acceptor`, already bound and listening (the agent's held MASTER_PORT).
  StoreServer(boost::asio::io_context& io, boost::asio::ip::tcp::acceptor acceptor, ServerOptions opts = {});
  // Binds `host`:`port` (0: any free port) itself. Throws std::runtime_error naming the
  // address when it cannot.
  StoreServer(boost::asio::io_context& io, const std::string& host, int port, ServerOptions opts = {});
  ~StoreServer();
  StoreServer(const StoreServer&) = delete;
  StoreServer& operator=(const StoreServer&) = delete;

  int port() const;
  // Closes the acceptor and every client.
  void stop();
  // A new attempt of the job: the store is emptied and every client (of the ended attempt)
  // is parked: never served again, disconnected as soon as it sends anything, kept until it
  // closes. The listening socket stays. (A worker that lives through the attempt, in-place
  // recovery, keeps its old c10d client: torch 1.13's busy-loops a core for ever once its
  // server closes the connection.)
  void reset();
  // The job's store moved to another port: closes the acceptor, empties the store and
  // parks every client, as reset() does.
  void retire();
  std::size_t parked() const;  // clients parked by reset() or retire(), still connected

  std::size_t clients() const;
  // `f` runs once, from the io_context, as soon as no client is connected (soon, when none
  // is now); a later call replaces it; stop() forgets it.
  void when_idle(std::function<void()> f);
  std::size_t dropped() const;  // clients disconnected for breaking a bound or the protocol
  std::size_t buffered() const;  // bytes held for clients now (max_buffered's count)
  std::size_t queries() const;   // queries served, in total
  std::size_t accept_failures() const;  // accepts that failed (EMFILE and the like), each followed by a pause
  // Bytes of replies not yet written, all clients together (a shared value in each reply
  // that carries it: what the clients are owed, not what the server holds).
  std::size_t unwritten() const;
  // Length fields the parser read, in total (Parsed::fields): linear in the bytes received,
  // however a query trickles in.
  std::size_t parse_fields() const;
  const Engine& engine() const;

 private:
  struct Impl;
  std::shared_ptr<Impl> impl_;
};

}  // namespace mg::store
