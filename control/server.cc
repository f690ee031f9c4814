#include "control/server.h"

#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <stdexcept>
#include <unordered_map>
#include <utility>

#include <boost/asio/local/stream_protocol.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/write.hpp>
#include <fmt/format.h>

#include <sys/random.h>

#include "proto/accept_backoff.h"

namespace mg::control {

namespace asio = boost::asio;
using local = asio::local::stream_protocol;

namespace {

std::string default_name() {
  unsigned char r[8] = {};
  std::size_t got = 0;
  while (got < sizeof(r)) {
    const ssize_t n = ::getrandom(r + got, sizeof(r) - got, 0);
    if (n <= 0) break;
    got += static_cast<std::size_t>(n);
  }
  std::string hex;
  for (unsigned char c : r) hex += fmt::format("{:02x}", c);
  return fmt::format("mglaunch-{}-{}", ::getpid(), hex);
}

std::size_t default_max_sessions() {
  rlimit lim{};
  if (::getrlimit(RLIMIT_NOFILE, &lim) != 0 || lim.rlim_cur == RLIM_INFINITY) return 4096;
  return std::clamp<std::size_t>(static_cast<std::size_t>(lim.rlim_cur) / 4, 16, 4096);
}

}  // namespace

struct Server::Impl : std::enable_shared_from_this<Server::Impl> {
  struct Session {
    Session(local::socket s, asio::io_context& io) : socket(std::move(s)), hello_deadline(io) {}
    local::socket socket;
    asio::steady_timer hello_deadline;
    bool pending = false;  // counted in pending_by_rank (no hello yet)
    bool is_worker = true;  // the peer is the worker process itself, not a descendant
    std::uint64_t id = 0;
    int local_rank = -1;
    pid_t pid = 0;
    bool said_hello = false;
    bool closing = false;  // an error line goes out, then the socket closes
    LineBuffer in;
    std::array<char, 4096> buf{};
    std::string out, writing;
  };

  Impl(asio::io_context& io, ServerOptions o, Handlers h)
      : io(io), opts(std::move(o)), handlers(std::move(h)), acceptor(io), accept_pause(io) {
    if (opts.max_sessions == 0) opts.max_sessions = default_max_sessions();
  }

  asio::io_context& io;
  ServerOptions opts;
  Handlers handlers;
  local::acceptor acceptor;
  asio::steady_timer accept_pause;  // after an accept error (EMFILE): a pause, not a spin
  std::size_t accept_failures = 0;
  std::unordered_map<int, std::size_t> pending_by_rank;  // connections before their hello
  std::string address;
  std::unordered_map<std::uint64_t, std::shared_ptr<Session>> sessions;
  std::unordered_map<int, std::uint64_t> by_rank;  // local rank -> the session that said hello
  std::unordered_map<int, std::string> ended;  // local rank -> why its last session ended (Server::ended_why)
  std::uint64_t next_id = 1;
  bool stopped = false;

  // At most one line a second (proto/accept_backoff.h): a worker opening connections in a
  // loop must not flood the agent's console. The next line counts the ones left out.
  proto::LogLimiter limiter;
  proto::PauseEpisode pauses;  // accepts paused for want of descriptors: a line when it starts, one when it ends
  void log(const std::string& line) {
    if (!opts.log) return;
    if (auto l = limiter.admit(line, std::chrono::steady_clock::now())) opts.log("control socket: " + *l);
  }

  void accept() {
    acceptor.async_accept([self = shared_from_this()](boost::system::error_code ec, local::socket s) {
      if (self->stopped || ec == asio::error::operation_aborted) return;
      if (!ec) {
        if (auto line = self->pauses.accepted()) self->log(*line);
        self->admit(std::move(s));
        self->accept();
        return;
      }
      // EMFILE, ENFILE and the like: keep serving the sessions we have, pause the accepts
      // (proto/accept_backoff.h, as the store does) instead of spinning.
      ++self->accept_failures;
      if (auto line = self->pauses.paused(ec.message())) self->log(*line);
      proto::pause_accepts(self->accept_pause, [self] {
        if (!self->stopped) self->accept();
      });
    });
  }

  bool is_worker_itself(int local_rank, pid_t pid) const {  // asked once, at accept
    if (!opts.worker_pid) return true;
    const pid_t w = opts.worker_pid(local_rank);
    return w <= 0 || w == pid;
  }

  void unpend(Session& s) {
    if (!s.pending) return;
    s.pending = false;
    auto it = pending_by_rank.find(s.local_rank);
    if (it != pending_by_rank.end() && --it->second == 0) pending_by_rank.erase(it);
    s.hello_deadline.cancel();
  }

  void admit(local::socket s) {
    auto session = std::make_shared<Session>(std::move(s), io);
    session->id = next_id++;
    ucred cred{};
    socklen_t len = sizeof(cred);
    std::string refusal;
    if (::getsockopt(session->socket.native_handle(), SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
      refusal = "cannot read the peer's credentials";
    } else if (cred.uid != ::geteuid()) {
      refusal = fmt::format("uid {} is not this agent's user (uid {})", cred.uid, ::geteuid());
    } else if (sessions.size() >= opts.max_sessions) {
      refusal = fmt::format("{} connections is the limit", opts.max_sessions);
    } else {
      session->pid = cred.pid;
      session->local_rank = opts.worker_of ? opts.worker_of(cred.pid) : -1;
      if (session->local_rank >= 0) session->is_worker = is_worker_itself(session->local_rank, cred.pid);
      if (session->local_rank < 0)
        refusal = fmt::format("pid {} is neither a worker of this agent nor a descendant of one", cred.pid);
      else if (pending_by_rank[session->local_rank] >= opts.max_pending_per_rank)
        refusal = fmt::format("local rank {} already has {} connections that have not said hello", session->local_rank,
                              opts.max_pending_per_rank);
    }
    sessions.emplace(session->id, session);
    if (!refusal.empty()) {
      log("refused a connection: " + refusal);
      refuse(*session, refusal);
      return;
    }
    session->pending = true;
    ++pending_by_rank[session->local_rank];
    session->hello_deadline.expires_after(opts.hello_timeout);
    session->hello_deadline.async_wait([self = shared_from_this(), s = session](boost::system::error_code ec) {
      if (ec || self->stopped || s->said_hello || s->closing || !self->sessions.contains(s->id)) return;
      self->log(fmt::format("dropped a connection of local rank {} (pid {}): no hello within {} ms", s->local_rank,
                            s->pid, self->opts.hello_timeout.count()));
      self->refuse(*s, fmt::format("no hello within {} ms", self->opts.hello_timeout.count()));
    });
    read(session);
  }

  // One error line, then the connection closes.
  void refuse(Session& s, const std::string& message) {
    if (s.closing) return;
    s.closing = true;
    unpend(s);
    if (s.said_hello) release_rank(s, /*notify=*/true, "the agent refused it: " + message);
    s.out += error(message);
    write(s.id);
  }

  // `why`: which side ended the session and how (Handlers::closed).
  void release_rank(Session& s, bool notify, const std::string& why) {
    auto it = by_rank.find(s.local_rank);
    if (it == by_rank.end() || it->second != s.id) return;
    by_rank.erase(it);
    ended[s.local_rank] = why;
    if (notify && handlers.closed) handlers.closed(s.local_rank, why);
  }

  void drop(std::uint64_t id, bool notify, const std::string& why) {
    auto it = sessions.find(id);
    if (it == sessions.end()) return;
    auto s = it->second;
    sessions.erase(it);
    unpend(*s);
    release_rank(*s, notify, why);
    boost::system::error_code ignored;
    s->socket.close(ignored);
  }

  void read(const std::shared_ptr<Session>& s) {
    s->socket.async_read_some(asio::buffer(s->buf),
                              [self = shared_from_this(), s](boost::system::error_code ec, std::size_t n) {
                                if (self->stopped || s->closing || !self->sessions.contains(s->id)) return;
                                if (ec == asio::error::eof)
                                  return self->drop(s->id, /*notify=*/true, "the worker closed it (end of file)");
                                if (ec) return self->drop(s->id, /*notify=*/true, "reading from it failed: " + ec.message());
                                self->on_data(s, std::string_view(s->buf.data(), n));
                              });
  }

  void on_data(const std::shared_ptr<Session>& s, std::string_view data) {
    auto lines = s->in.feed(data);
    for (auto& line : lines.lines) {
      if (!s->socket.is_open() || s->closing) return;
      handle(*s, line);
    }
    if (s->closing || !sessions.contains(s->id)) return;
    if (lines.too_long) {
      log(fmt::format("dropped local rank {}'s connection: a message over {} bytes", s->local_rank, kMaxMessage));
      refuse(*s, fmt::format("a message is longer than {} bytes (one JSON object per line)", kMaxMessage));
      return;
    }
    read(s);
  }

  void handle(Session& s, const std::string& line) {
    FromWorker m = parse_from_worker(line);
    if (auto* bad = std::get_if<Bad>(&m)) {
      log(fmt::format("dropped local rank {}'s connection: {}", s.local_rank, bad->message));
      refuse(s, bad->message);
      return;
    }
    if (auto* h = std::get_if<Hello>(&m)) {
      // The session's local rank is the one its pid belongs to; hello's own (LOCAL_RANK,
      // which --virtual-local-rank sets to 0 for every worker) is informational.
      if (!s.said_hello) {
        // The worker process itself wins over its descendants (a DataLoader worker or a
        // helper that inherited MGLAUNCH_CONTROL_SOCKET must not take the worker's session
        // nor withdraw its opt-in); otherwise the newest hello wins (a worker reconnecting).
        if (auto old = by_rank.find(s.local_rank); old != by_rank.end() && old->second != s.id) {
          auto o = sessions.find(old->second);
          if (o != sessions.end() && o->second->is_worker && !s.is_worker) {
            log(fmt::format("refused the hello of pid {}: local rank {}'s worker (pid {}) holds its session", s.pid,
                            s.local_rank, o->second->pid));
            refuse(s, fmt::format("local rank {}'s worker (pid {}) holds its control session; a descendant "
                                  "cannot replace it",
                                  s.local_rank, o->second->pid));
            return;
          }
          if (o != sessions.end()) {
            Session& replaced = *o->second;
            release_rank(replaced, /*notify=*/false, "replaced by a newer hello");
            refuse(replaced, fmt::format("replaced by a newer hello of local rank {} (pid {})", s.local_rank, s.pid));
          }
        }
        s.said_hello = true;
        unpend(s);
        by_rank[s.local_rank] = s.id;
        ended.erase(s.local_rank);
      }
      s.out += welcome();
      write(s.id);
      if (handlers.hello) handlers.hello(s.local_rank, *h);
      return;
    }
    if (!s.said_hello) {
      refuse(s, "the first message must be hello");
      return;
    }
    if (auto* p = std::get_if<Paused>(&m))
      if (handlers.paused) handlers.paused(s.local_rank, *p);
  }

  void write(std::uint64_t id) {
    auto it = sessions.find(id);
    if (it == sessions.end()) return;
    auto s = it->second;
    if (!s->writing.empty()) return;  // one write in flight; the rest follows it
    if (s->out.empty()) {
      if (s->closing) drop(id, /*notify=*/false, "");  // its rank was released by refuse()
      return;
    }
    s->writing.swap(s->out);
    asio::async_write(s->socket, asio::buffer(s->writing),
                      [self = shared_from_this(), s](boost::system::error_code ec, std::size_t) {
                        if (self->stopped || !self->sessions.contains(s->id)) return;
                        s->writing.clear();
                        if (ec) return self->drop(s->id, /*notify=*/true, "the agent's write to it failed: " + ec.message());
                        self->write(s->id);
                      });
  }
};

Server::Server(asio::io_context& io, ServerOptions opts, Handlers handlers)
    : impl_(std::make_shared<Impl>(io, std::move(opts), std::move(handlers))) {
  Impl& m = *impl_;
  const std::string name = m.opts.name.empty() ? default_name() : m.opts.name;
  m.address = at_notation(name);
  boost::system::error_code ec;
  const std::string raw = abstract_address(m.address);
  m.acceptor.open(local(), ec);
  if (!ec) m.acceptor.bind(local::endpoint(raw), ec);
  if (!ec) m.acceptor.listen(asio::socket_base::max_listen_connections, ec);
  if (ec) throw std::runtime_error(fmt::format("cannot listen on the control socket {}: {}", m.address, ec.message()));
  m.accept();
}

Server::~Server() { stop(); }

const std::string& Server::address() const { return impl_->address; }

bool Server::send(int local_rank, std::string line) {
  Impl& m = *impl_;
  auto it = m.by_rank.find(local_rank);
  if (m.stopped || it == m.by_rank.end()) return false;
  auto s = m.sessions.find(it->second);
  if (s == m.sessions.end() || s->second->closing) return false;
  if (s->second->out.size() + line.size() > m.opts.max_unsent) {
    m.log(fmt::format("dropped local rank {}'s connection: it reads nothing", local_rank));
    m.drop(it->second, /*notify=*/true,
           fmt::format("the agent dropped it: the worker read nothing while {} bytes waited", m.opts.max_unsent));
    return false;
  }
  s->second->out += line;
  m.write(it->second);
  return true;
}

bool Server::connected(int local_rank) const { return impl_->by_rank.contains(local_rank); }

std::string Server::ended_why(int local_rank) const {
  auto it = impl_->ended.find(local_rank);
  return it == impl_->ended.end() || impl_->by_rank.contains(local_rank) ? "" : it->second;
}

void Server::forget(int local_rank) {
  Impl& m = *impl_;
  auto it = m.by_rank.find(local_rank);
  if (it != m.by_rank.end()) m.drop(it->second, /*notify=*/false, "the agent let it go (forget: its worker ended)");
}

void Server::stop() {
  Impl& m = *impl_;
  if (m.stopped) return;
  m.stopped = true;
  boost::system::error_code ignored;
  m.acceptor.close(ignored);
  m.accept_pause.cancel();
  for (auto& [id, s] : m.sessions) {
    s->hello_deadline.cancel();
    s->socket.close(ignored);
  }
  m.pending_by_rank.clear();
  m.sessions.clear();
  m.by_rank.clear();
}

std::size_t Server::sessions() const { return impl_->sessions.size(); }

std::size_t Server::accept_failures() const { return impl_->accept_failures; }

}  // namespace mg::control
