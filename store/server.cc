#include "store/server.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <map>
#include <set>
#include <span>
#include <stdexcept>
#include <unordered_map>
#include <utility>

#include <boost/asio/steady_timer.hpp>
#include <boost/asio/write.hpp>
#include <boost/asio/post.hpp>
#include <fmt/format.h>

#include "proto/accept_backoff.h"

namespace mg::store {

namespace asio = boost::asio;
using tcp = asio::ip::tcp;

struct StoreServer::Impl : std::enable_shared_from_this<StoreServer::Impl> {
  struct Client {
    explicit Client(tcp::socket s) : socket(std::move(s)) {}
    tcp::socket socket;
    Dialect dialect = Dialect::kUnknown;
    std::string pending;  // the start of a query still arriving
    std::size_t need = 0;  // pending cannot hold a whole query below this size (Parsed::need)
    Progress progress;     // how far pending's query has been checked (wire.h)
    std::vector<Reply> out;      // replies not yet handed to a write
    std::vector<Reply> writing;  // the replies of the one write in flight (empty: none)
    std::vector<asio::const_buffer> iov;  // writing's bytes, its values shared (scatter/gather)
    std::size_t unwritten = 0;   // out + writing, all their bytes
    std::size_t reply_own = 0;   // out + writing, the memory of their own (cost(): not the shared values)
    // The shared values its replies carry, each with how many of their entries carry it.
    std::unordered_map<const std::string*, std::size_t> carries;
    // Those of them no longer in the store, their bytes (each once): what it is charged for
    // them when the budget must drop a client (within_budget).
    std::size_t unstored = 0;
    // Its next queries wait until its replies are out (back-pressure, as any server does):
    // a client that does not read holds one reply, however many queries it sends.
    bool paused = false;
    std::size_t held = 0;  // pending + its replies' own bytes + its wait, as counted in Impl::buffered
    // Bytes at the front of `pending` that serve() has used already: they leave it when that
    // call returns (on_readable, resume), so they are not counted meanwhile. Else a client was
    // charged for a finished query while the budget was checked inside serve() (a value its
    // SET replaced let go, a reply of the queries after it): a largest SET got its setter
    // dropped for bytes about to be freed, its SET applied.
    std::size_t used = 0;
    // When it connected, its last query was whole, or its unfinished query began: a client
    // whose query is not whole long after this is silent (displace_silent), however many
    // bytes of it came; one idle between queries is not.
    std::chrono::steady_clock::time_point since = std::chrono::steady_clock::now();
    bool served = false;  // a query of its was whole (torch's clients send one at once)
    asio::ip::address from;  // its address (ServerOptions::max_per_address)
  };
  // Unwritten reply bytes at which a client's queries are no longer read: small answers
  // (pipelined PINGs, ADDs) go out together, a value's reply goes out before the next query.
  static constexpr std::size_t kPauseAt = 64 * 1024;

  Impl(asio::io_context& io, tcp::acceptor a, ServerOptions o)
      : io(io), acceptor(std::move(a)), opts(std::move(o)), engine(opts.max_bytes, opts.max_unread) {
    opts.limits.max_query = std::min(opts.limits.max_query, opts.max_buffered);
  }

  asio::io_context& io;
  tcp::acceptor acceptor;
  ServerOptions opts;
  Engine engine;
  std::unordered_map<ClientId, std::shared_ptr<Client>> clients;
  // Clients of an ended attempt (reset, retire): not served, not counted; a read that
  // returns anything ends them (their data, or their close).
  struct Parked {
    std::shared_ptr<tcp::socket> socket;
    asio::ip::address from;
  };
  std::unordered_map<ClientId, Parked> parked;
  // Clients and parked ones from each address (ServerOptions::max_per_address).
  std::map<asio::ip::address, std::size_t> per_address;
  void forget_address(const asio::ip::address& from) {
    if (auto n = per_address.find(from); n != per_address.end() && --n->second == 0) per_address.erase(n);
  }
  ClientId next_id = 1;
  std::size_t dropped = 0;
  // Every client's held bytes, and each value its replies share that is no longer in the
  // store counted once (ServerOptions::max_buffered); a value the store still holds is in
  // its max_bytes, and its readers cost only their own bytes.
  std::size_t buffered = 0;
  // Replies' shared values: how many clients carry each, and whether the store still holds
  // it (its bytes are in `buffered` while a client carries it and the store does not).
  struct Share {
    std::size_t clients = 0;
    bool stored = true;  // a reply is built from the store's values
  };
  std::unordered_map<const std::string*, Share> shares;
  std::size_t parse_fields = 0;  // Parsed::fields, summed
  std::size_t queries = 0;       // served
  bool stopped = false;
  asio::steady_timer accept_pause{io};  // after an accept error (EMFILE): a pause, not a spin
  std::array<char, 64 * 1024> scratch{};
  std::vector<Reply> replies;

  // At most one line a second (proto/accept_backoff.h): many clients breaking the rules at
  // once (a port scan, a hostile peer) must not flood the agent's console. The next line
  // counts the ones left out.
  proto::LogLimiter limiter;
  // Accepts paused for want of descriptors: a line when the episode starts, one when it ends
  // (as the rendezvous daemon and the control socket say it), not one per pause.
  proto::PauseEpisode pauses;
  std::size_t accept_failures = 0;
  // An episode's two lines are not rate-limited: the end must follow its start, which is
  // often less than a second before.
  void log_episode(const std::string& line) {
    if (opts.log) opts.log("agent store: " + line);
  }
  void log(const std::string& line) {
    if (!opts.log) return;
    if (auto l = limiter.admit(line, std::chrono::steady_clock::now())) opts.log(*l);
  }

  void accept() {
    acceptor.async_accept([self = shared_from_this()](boost::system::error_code ec, tcp::socket s) {
      if (self->stopped) return;
      if (!ec) {
        if (auto line = self->pauses.accepted()) self->log_episode(*line);
        boost::system::error_code ignored;
        const auto from = s.remote_endpoint(ignored).address();
        const auto mine = self->per_address.find(from);
        if (mine != self->per_address.end() && mine->second >= self->opts.max_per_address && !self->displace_silent(from)) {
          ++self->dropped;
          self->log(fmt::format("agent store: refused a client from {}: {} clients from one address is the limit",
                                from.to_string(), self->opts.max_per_address));
        } else if (self->clients.size() + self->parked.size() >= self->opts.max_clients && !self->displace_silent({})) {
          ++self->dropped;
          self->log(fmt::format("agent store: refused a client: {} clients is the limit", self->opts.max_clients));
        } else {
          s.set_option(tcp::no_delay(true), ignored);
          s.non_blocking(true, ignored);
          const ClientId id = self->next_id++;
          auto c = std::make_shared<Client>(std::move(s));
          c->from = from;
          ++self->per_address[from];
          self->clients.emplace(id, std::move(c));
          self->read(id);
        }
      } else if (ec == asio::error::operation_aborted) {
        return;
      } else {
        // EMFILE and the like: keep serving the clients we have, pause the accepts
        // (proto/accept_backoff.h, as the control socket does) instead of spinning.
        ++self->accept_failures;
        if (auto line = self->pauses.paused(ec.message())) self->log_episode(*line);
        proto::pause_accepts(self->accept_pause, [self] {
          if (!self->stopped) self->accept();
        });
        return;
      }
      self->accept();
    });
  }

  // torch 1.13's TCPStore opens a second connection beside its first, for watchKey's
  // callbacks, and never sends on it unless a key is watched; its worker thread busy-loops a
  // core for ever once the server closes it (it peeks 0 bytes and polls again). It comes
  // right after the first connected or was served, so each served client of an address
  // covers the first silent client of that address that connected after it and is not
  // covered yet; those are never displaced. Worked out at a limit from the clients connected
  // now, so no pair outlives either side. A cover costs whoever opens it a served connection,
  // which holds its place anyway.
  std::set<ClientId> callback_connections() const {
    std::vector<ClientId> ids;
    for (const auto& [id, c] : clients) ids.push_back(id);
    std::sort(ids.begin(), ids.end());  // ids grow as clients connect
    std::map<asio::ip::address, int> uncovering;  // served clients not covering one yet
    std::set<ClientId> covered;
    for (const ClientId id : ids) {
      const Client& c = *clients.at(id);
      if (c.served) {
        ++uncovering[c.from];
      } else if (auto u = uncovering.find(c.from); u != uncovering.end() && u->second > 0) {
        --u->second;
        covered.insert(id);
      }
    }
    return covered;
  }

  // At a client limit: disconnects a silent client (of address `from`, when not
  // unspecified: the per-address limit), so that connections opened and left silent cannot
  // keep the job's workers out. Silent: it never sent a whole query (a worker's client sends
  // one at once: torch 2.x's VALIDATE, 1.x's first query), however many bytes of one came;
  // the oldest of those first. Then a client whose query has not been whole for
  // query_deadline: one byte now and then does not keep a connection. False when there is
  // none.
  bool displace_silent(const asio::ip::address& from) {
    const auto now = std::chrono::steady_clock::now();
    auto oldest = clients.end(), stalled = clients.end();
    const std::set<ClientId> callbacks = callback_connections();
    for (auto it = clients.begin(); it != clients.end(); ++it) {
      const Client& c = *it->second;
      if (!from.is_unspecified() && c.from != from) continue;
      if (!c.served) {
        if (callbacks.contains(it->first)) continue;  // a torch 1.13 callback connection
        if (oldest == clients.end() || it->first < oldest->first) oldest = it;
      } else if (!c.pending.empty() && !c.paused && now - c.since >= opts.query_deadline) {
        if (stalled == clients.end() || c.since < stalled->second->since) stalled = it;
      }
    }
    const auto limit = from.is_unspecified() ? fmt::format("the limit of {} clients", opts.max_clients)
                                             : fmt::format("the limit of {} clients from {}", opts.max_per_address,
                                                           from.to_string());
    if (oldest != clients.end()) {
      drop(oldest->first, fmt::format("it had sent no whole query when a new client came at {}", limit));
    } else if (stalled != clients.end()) {
      drop(stalled->first, fmt::format("its query was not whole after {} ms when a new client came at {}",
                                       opts.query_deadline.count(), limit));
    } else {
      return false;
    }
    return true;
  }

  void read(ClientId id) {
    auto it = clients.find(id);
    if (it == clients.end()) return;
    it->second->socket.async_wait(tcp::socket::wait_read, [self = shared_from_this(), id](boost::system::error_code ec) {
      if (self->stopped || ec == asio::error::operation_aborted) return;
      self->on_readable(id, ec);
    });
  }

  void drop(ClientId id, const std::string& why) {
    auto it = clients.find(id);
    if (it == clients.end()) return;
    if (!why.empty()) {
      ++dropped;
      log(fmt::format("agent store: disconnected a client: {}", why));
    }
    boost::system::error_code ignored;
    it->second->socket.close(ignored);
    buffered -= it->second->held;
    forget_address(it->second->from);
    release(*it->second, it->second->out);
    release(*it->second, it->second->writing);
    clients.erase(it);
    engine.disconnected(id);
    idle_check();
  }

  // Room in `pending` for `add` more bytes: doubled when short (copies linear in the bytes
  // received), never past the query's claimed size `need` when that is still ahead. Not
  // reserved at once from a length read: a 26-byte header claiming a 64 MiB value would
  // hold 64 MiB; grown with what arrives, a query holds at most twice its bytes received.
  static void grow(std::string& pending, std::size_t add, std::size_t need) {
    const std::size_t want = pending.size() + add;
    if (want <= pending.capacity()) return;
    // Past `need` (the query is whole, the rest starts the next one; or `need` was only the
    // next length field of a multi-key query) it grows by an eighth: still geometric, but a
    // largest SET followed by a GET does not hold twice the SET beside the GET's reply.
    const std::size_t doubled = 2 * pending.capacity();
    // (A new string: reserve() on libstdc++'s would double the capacity whatever is asked.)
    std::string grown;
    grown.reserve(std::max(want, std::min(doubled, need > want ? need : need + need / 8)));
    grown.append(pending);
    pending.swap(grown);
  }

  // `c`'s buffers changed: counts them again in `buffered` (pending's capacity, the
  // memory it holds, not just its bytes).
  void recount(ClientId id, Client& c) {
    const std::size_t now =
        c.pending.capacity() - std::min(c.used, c.pending.capacity()) + c.reply_own + engine.wait_bytes(id);
    buffered = buffered - c.held + now;
    c.held = now;
  }

  // The memory a reply holds of its own: its bytes, and per shared value its entry and the
  // write's iovecs (two: the bytes before it, and it), as allocated (capacities).
  static constexpr std::size_t kEntryCost = sizeof(std::pair<std::size_t, Value>) + 2 * sizeof(asio::const_buffer);
  static std::size_t cost(const Reply& r) { return r.bytes.capacity() + r.values.capacity() * kEntryCost; }

  // Replies queued for a client: their own memory is its, their values shared (a value
  // counted in `buffered` once, however many clients carry it, and only once the store no
  // longer holds it).
  void hold(Client& c, const Reply& r) {
    c.unwritten += r.size();
    c.reply_own += cost(r);
    for (const auto& [at, v] : r.values) {
      if (c.carries[v.get()]++ > 0) continue;
      Share& s = shares[v.get()];
      ++s.clients;
      if (!s.stored) c.unstored += v->size();
    }
  }
  // Replies written or dropped: their values' shares go (the client's own bytes are
  // counted again by the caller, or gone with the client).
  void release(Client& c, std::vector<Reply>& rs) {
    for (const auto& r : rs) {
      c.unwritten -= r.size();
      c.reply_own -= cost(r);
      for (const auto& [at, v] : r.values) {
        auto mine = c.carries.find(v.get());
        if (--mine->second > 0) continue;
        c.carries.erase(mine);
        auto it = shares.find(v.get());
        if (!it->second.stored) c.unstored -= v->size();
        if (--it->second.clients > 0) continue;
        if (!it->second.stored) buffered -= v->size();
        shares.erase(it);
      }
    }
    rs.clear();
  }
  // Values the store let go (Engine::take_unstored) that replies carry: from now on their
  // readers hold them, counted once in `buffered` and charged to each reader.
  bool unstore_values() {
    bool any = false;
    for (const std::string* v : engine.take_unstored()) {
      auto it = shares.find(v);
      if (it == shares.end() || !it->second.stored) continue;
      it->second.stored = false;
      buffered += v->size();
      any = true;
      for (auto& [id, c] : clients)
        if (c->carries.count(v)) c->unstored += v->size();
    }
    return any;
  }

  // Over the budget of all clients' buffers: disconnects the client charged the most until
  // under it again; the newest bytes' owner when it is charged as much as any. A client is
  // charged its own bytes (queries, replies, wait) and each value its replies carry that
  // the store no longer holds, whole, however many others carry it too: clients hoarding
  // replies in pairs are charged each for the pair's value, not nothing, and a value still
  // in the store costs its readers nothing (dropping them would give back nothing). Clients
  // hoarding replies or half-sent queries thus cannot starve one that holds little. False
  // when `current` (the client being served) was among them and must not be touched.
  bool within_budget(ClientId current) {
    while (buffered > opts.max_buffered) {
      auto worst = clients.end();
      std::size_t most = 0;
      auto consider = [&](auto it) {
        const std::size_t charged = it->second->held + it->second->unstored;
        if (worst == clients.end() || charged > most) {
          worst = it;
          most = charged;
        }
      };
      if (auto cur = clients.find(current); cur != clients.end()) consider(cur);
      for (auto it = clients.begin(); it != clients.end(); ++it) consider(it);
      if (worst == clients.end()) break;
      const ClientId id = worst->first;
      drop(id, fmt::format("it held {} bytes of queries and replies when all clients' came to {}, over the store's "
                           "limit of {}",
                           most, buffered, opts.max_buffered));
    }
    return clients.count(current) > 0;
  }

  std::function<void()> idle;  // when_idle()'s
  void idle_check() {
    if (!idle || stopped || !clients.empty()) return;
    asio::post(io, [f = std::exchange(idle, nullptr)] { f(); });
  }

  void on_readable(ClientId id, boost::system::error_code ec) {
    auto it = clients.find(id);
    if (it == clients.end()) return;
    Client& c = *it->second;
    if (ec) return drop(id, {});
    for (int round = 0; round < 16; ++round) {  // bounded: other clients get their turn
      boost::system::error_code rec;
      const std::size_t n = c.socket.read_some(asio::buffer(scratch), rec);
      if (rec == asio::error::would_block) break;
      if (rec || n == 0) return drop(id, {});  // the client went away (normal at its exit)
      std::string_view data(scratch.data(), n);
      if (!c.pending.empty()) {
        grow(c.pending, data.size(), c.need);
        c.pending.append(data);
        recount(id, c);
        if (!within_budget(id)) return;
        data = c.pending;
        if (c.pending.size() < c.need) {  // the query cannot be whole yet: no parse
          if (n < scratch.size()) break;
          continue;
        }
      }
      const std::size_t used = serve(id, c, data);
      if (used == std::string::npos) return;  // dropped
      c.used = 0;
      if (!c.pending.empty()) {
        c.pending.erase(0, used);
      } else if (used < data.size()) {
        c.pending.assign(data.substr(used));
        c.since = std::chrono::steady_clock::now();  // its query starts now (query_deadline)
      }
      // Served queries leave their room: the rest (the start of the next query) is kept in
      // a buffer its size, not in the one a large query grew.
      if (c.pending.empty() && c.pending.capacity() > 4096) std::string().swap(c.pending);
      if (c.pending.capacity() > 4096 && c.pending.capacity() > 2 * c.pending.size()) std::string(c.pending).swap(c.pending);
      recount(id, c);
      if (!within_budget(id)) return;
      if (c.paused) return;  // read again once its replies are out (resume)
      if (n < scratch.size()) break;
    }
    read(id);
  }

  // `id`'s replies are out: the queries it sent meanwhile (in `pending`) are served, then
  // its socket is read again, unless those replies paused it again.
  void resume(ClientId id) {
    auto it = clients.find(id);
    if (it == clients.end()) return;
    Client& c = *it->second;
    c.paused = false;
    if (!c.pending.empty() && c.pending.size() >= c.need) {
      const std::size_t used = serve(id, c, c.pending);
      if (used == std::string::npos) return;  // dropped
      c.used = 0;
      c.pending.erase(0, used);
      if (c.pending.empty()) std::string().swap(c.pending);
      recount(id, c);
      if (!within_budget(id) || c.paused) return;
    }
    read(id);
  }

  // Serves every whole query at the front of `data`; returns the bytes used, npos when the
  // client was dropped.
  std::size_t serve(ClientId id, Client& c, std::string_view data) {
    std::size_t used = 0;
    while (used < data.size() && !c.paused) {
      Parsed p = parse_query(data.substr(used), c.dialect, opts.limits, &c.progress);
      parse_fields += p.fields;
      c.need = 0;
      if (p.status == Parsed::kNeedMore) {
        c.need = p.need;
        break;
      }
      if (p.status == Parsed::kBad) {
        drop(id, p.error);
        return std::string::npos;
      }
      used += p.consumed;
      if (data.data() == c.pending.data()) {  // its bytes leave `pending` at the caller
        c.used = used;
        recount(id, c);
      }
      ++queries;
      c.served = true;
      c.since = std::chrono::steady_clock::now();
      replies.clear();
      auto err = engine.apply(id, std::move(p.query), replies);
      if (unstore_values() && !within_budget(id)) return std::string::npos;
      if (!err.empty()) {
        if (!send_all(id)) drop(id, err);
        return std::string::npos;
      }
      if (send_all(id)) return std::string::npos;
      if (c.unwritten >= kPauseAt) c.paused = true;
    }
    return used;
  }

  // Queues the replies; true when `current` (the client being served) was dropped over the
  // budget of all clients, and must not be touched any more. (A client's replies are bounded
  // without a limit of their own: one reply is at most max_unread (Engine's max_reply), and a
  // client with kPauseAt bytes unwritten is not read from, so it never has more than that
  // and one reply, and a wait's answer.)
  bool send_all(ClientId current) {
    for (auto& r : replies) {
      const ClientId to = r.to;
      auto it = clients.find(to);
      if (it == clients.end()) continue;
      Client& c = *it->second;
      if (!c.out.empty() && r.values.empty()) {  // small answers go out together
        c.unwritten += r.bytes.size();
        c.reply_own -= cost(c.out.back());
        c.out.back().bytes += r.bytes;
        c.reply_own += cost(c.out.back());
      } else {
        hold(c, r);
        c.out.push_back(std::move(r));
      }
      recount(to, c);
      if (!within_budget(to)) continue;
      if (c.writing.empty()) write(to);
    }
    replies.clear();
    return clients.count(current) == 0;
  }

  // One write in flight per client, of every reply queued: their own bytes and their values
  // as one scatter/gather list (a value read by many clients is never copied for them);
  // replies queued meanwhile go out with the next one.
  void write(ClientId id) {
    auto it = clients.find(id);
    if (it == clients.end() || it->second->out.empty()) return;
    auto c = it->second;
    c->writing.swap(c->out);
    c->iov.clear();
    for (const auto& r : c->writing) {
      std::size_t from = 0;
      for (const auto& [at, v] : r.values) {
        if (at > from) c->iov.emplace_back(r.bytes.data() + from, at - from);
        if (!v->empty()) c->iov.emplace_back(v->data(), v->size());
        from = at;
      }
      if (from < r.bytes.size()) c->iov.emplace_back(r.bytes.data() + from, r.bytes.size() - from);
    }
    // A view of the list, not the list: the write keeps a copy of what it is given (before:
    // a second iovec list per reply, 16 bytes a value).
    asio::async_write(c->socket, std::span<const asio::const_buffer>(c->iov),
                      [self = shared_from_this(), id, c](boost::system::error_code ec, std::size_t) {
                        if (self->stopped || ec == asio::error::operation_aborted) return;
                        if (ec) return self->drop(id, {});
                        if (!self->clients.count(id)) return;  // dropped meanwhile: released then
                        self->release(*c, c->writing);
                        // Their room goes too: an idle client holds no buffers.
                        std::vector<Reply>().swap(c->writing);
                        std::vector<asio::const_buffer>().swap(c->iov);
                        self->recount(id, *c);
                        if (!c->out.empty()) self->write(id);
                        if (c->paused && c->unwritten < kPauseAt) self->resume(id);
                      });
  }

  void park_all() {
    for (auto& [id, c] : clients) {
      boost::system::error_code ignored;
      c->socket.cancel(ignored);  // its pending wait ends (operation_aborted) and is ignored
      auto sock = std::make_shared<tcp::socket>(std::move(c->socket));
      parked.emplace(id, Parked{sock, c->from});
      sock->async_wait(tcp::socket::wait_read, [self = shared_from_this(), id = id](boost::system::error_code) {
        // Data from an ended attempt, its close, or an error: it goes (whatever it sent is
        // never served).
        if (auto it = self->parked.find(id); it != self->parked.end()) {
          boost::system::error_code ignored;
          it->second.socket->close(ignored);
          self->forget_address(it->second.from);
          self->parked.erase(it);
        }
      });
    }
    clients.clear();
    buffered = 0;
    shares.clear();
    engine.clear();
    idle_check();
  }

  void reset() { park_all(); }

  void retire() {
    boost::system::error_code ignored;
    acceptor.close(ignored);
    accept_pause.cancel();
    park_all();
  }

  void stop() {
    if (stopped) return;
    stopped = true;
    boost::system::error_code ignored;
    acceptor.close(ignored);
    for (auto& [id, c] : clients) c->socket.close(ignored);
    clients.clear();
    buffered = 0;
    shares.clear();
    for (auto& [id, p] : parked) p.socket->close(ignored);
    parked.clear();
    per_address.clear();
    idle = nullptr;
  }
};

namespace {

tcp::acceptor bind_acceptor(asio::io_context& io, const std::string& host, int port) {
  boost::system::error_code ec;
  const auto addr = asio::ip::make_address(host, ec);
  if (ec) throw std::runtime_error(fmt::format("agent store: '{}' is not an IP address", host));
  tcp::acceptor a(io);
  const tcp::endpoint ep(addr, static_cast<unsigned short>(port));
  a.open(ep.protocol(), ec);
  if (!ec) a.set_option(tcp::acceptor::reuse_address(true), ec);
  if (!ec) a.bind(ep, ec);
  if (!ec) a.listen(asio::socket_base::max_listen_connections, ec);
  if (ec) throw std::runtime_error(fmt::format("agent store: cannot listen on {}:{}: {}", host, port, ec.message()));
  return a;
}

}  // namespace

StoreServer::StoreServer(asio::io_context& io, tcp::acceptor acceptor, ServerOptions opts)
    : impl_(std::make_shared<Impl>(io, std::move(acceptor), std::move(opts))) {
  impl_->accept();
}

StoreServer::StoreServer(asio::io_context& io, const std::string& host, int port, ServerOptions opts)
    : StoreServer(io, bind_acceptor(io, host, port), std::move(opts)) {}

StoreServer::~StoreServer() { impl_->stop(); }

int StoreServer::port() const {
  boost::system::error_code ec;
  auto ep = impl_->acceptor.local_endpoint(ec);
  return ec ? 0 : ep.port();
}
void StoreServer::stop() { impl_->stop(); }
void StoreServer::reset() { impl_->reset(); }
void StoreServer::retire() { impl_->retire(); }
std::size_t StoreServer::parked() const { return impl_->parked.size(); }
std::size_t StoreServer::clients() const { return impl_->clients.size(); }
void StoreServer::when_idle(std::function<void()> f) {
  impl_->idle = std::move(f);
  impl_->idle_check();
}
std::size_t StoreServer::dropped() const { return impl_->dropped; }
std::size_t StoreServer::buffered() const { return impl_->buffered; }
std::size_t StoreServer::queries() const { return impl_->queries; }
std::size_t StoreServer::accept_failures() const { return impl_->accept_failures; }
std::size_t StoreServer::unwritten() const {
  std::size_t n = 0;
  for (const auto& [id, c] : impl_->clients) n += c->unwritten;
  return n;
}
std::size_t StoreServer::parse_fields() const { return impl_->parse_fields; }
const Engine& StoreServer::engine() const { return impl_->engine; }

}  // namespace mg::store
