#include "rendezvous/server.h"

#include <fmt/format.h>

namespace mg::rdzv {

namespace asio = boost::asio;
using proto::MsgType;

struct Server::Session {
  SessionId id = 0;
  std::shared_ptr<FramedConnection> conn;
  enum class Phase { kHello, kAuth, kReady } phase = Phase::kHello;
  std::string nonce;
  std::string job;  // set by the first Join
  std::string agent_id;
  std::unique_ptr<asio::steady_timer> handshake_timer;
};

Server::Server(asio::io_context& io, ServerOptions opts)
    : io_(io), opts_(std::move(opts)), acceptor_(io), ticker_(io) {
  boost::system::error_code ec;
  auto addr = asio::ip::make_address(opts_.host, ec);
  if (ec) {
    asio::ip::tcp::resolver resolver(io);
    auto results = resolver.resolve(opts_.host, "", ec);
    if (ec || results.empty())
      throw std::runtime_error(fmt::format("cannot resolve listen address '{}': {}", opts_.host, ec.message()));
    addr = results.begin()->endpoint().address();
  }
  asio::ip::tcp::endpoint ep(addr, static_cast<unsigned short>(opts_.port));
  acceptor_.open(ep.protocol(), ec);
  if (!ec) acceptor_.set_option(asio::ip::tcp::acceptor::reuse_address(true), ec);
  if (!ec) acceptor_.bind(ep, ec);
  if (!ec) acceptor_.listen(asio::socket_base::max_listen_connections, ec);
  if (ec) throw std::runtime_error(fmt::format("cannot listen on {}:{}: {}", opts_.host, opts_.port, ec.message()));
  port_ = acceptor_.local_endpoint().port();
  accept();
  tick();
}

Server::~Server() { stop(); }

std::string Server::address() const { return fmt::format("{}:{}", opts_.host, port_); }

void Server::log(const std::string& line) const {
  if (opts_.log) opts_.log(line);
}

void Server::stop(bool flush) {
  if (stopped_) return;
  stopped_ = true;
  boost::system::error_code ec;
  acceptor_.close(ec);
  ticker_.cancel();
  auto sessions = std::move(sessions_);
  for (auto& [id, s] : sessions) {
    if (s->handshake_timer) s->handshake_timer->cancel();
    s->conn->close(!flush);
  }
}

void Server::accept() {
  acceptor_.async_accept([this](boost::system::error_code ec, asio::ip::tcp::socket socket) {
    if (stopped_) return;
    if (!ec) {
      if (sessions_.size() >= opts_.max_connections) {
        log(fmt::format("refused a connection: {} connections open (max)", sessions_.size()));
        boost::system::error_code ignored;
        socket.close(ignored);
      } else {
        auto s = std::make_shared<Session>();
        s->id = next_id_++;
        s->conn = std::make_shared<FramedConnection>(std::move(socket), opts_.max_frame);
        s->handshake_timer = std::make_unique<asio::steady_timer>(io_, opts_.handshake_timeout);
        std::weak_ptr<Session> weak = s;
        s->handshake_timer->async_wait([this, weak](boost::system::error_code ec) {
          auto s = weak.lock();
          if (ec || !s || s->phase == Session::Phase::kReady) return;
          log(fmt::format("{}: no handshake within {} ms; closing", s->conn->peer(), opts_.handshake_timeout.count()));
          s->conn->close(true);
        });
        sessions_[s->id] = s;
        s->conn->start([this, weak](const proto::Frame& f) { if (auto s = weak.lock()) on_frame(s, f); },
                       [this, weak](const std::string& why) { if (auto s = weak.lock()) on_close(s, why); });
      }
    }
    accept();
  });
}

void Server::on_frame(const std::shared_ptr<Session>& s, const proto::Frame& f) {
  auto refuse = [&](const std::string& why) {
    log(fmt::format("{}: {}", s->conn->peer(), why));
    s->conn->send(proto::to_frame(proto::Error{why}));
    s->conn->close();
  };
  try {
    switch (s->phase) {
      case Session::Phase::kHello: {
        auto hello = proto::from_frame<proto::Hello>(f);
        s->agent_id = hello.agent_id;
        if (opts_.token.empty()) {
          s->phase = Session::Phase::kReady;
          s->handshake_timer->cancel();
          s->conn->send(proto::to_frame(proto::Welcome{"mglaunch-rdzv"}));
        } else {
          s->phase = Session::Phase::kAuth;
          s->nonce = random_hex(32);
          s->conn->send(proto::to_frame(proto::Challenge{s->nonce}));
        }
        return;
      }
      case Session::Phase::kAuth: {
        auto auth = proto::from_frame<proto::Auth>(f);
        if (!equal_ct(auth.mac, hmac_sha256_hex(opts_.token, s->nonce))) {
          refuse("authentication failed: wrong rendezvous token");
          return;
        }
        s->phase = Session::Phase::kReady;
        s->handshake_timer->cancel();
        s->conn->send(proto::to_frame(proto::Welcome{"mglaunch-rdzv"}));
        return;
      }
      case Session::Phase::kReady:
        break;
    }
    const auto now = Clock::now();
    if (proto::type_of(f) == MsgType::kJoin) {
      auto join = proto::from_frame<proto::Join>(f);
      if (join.job_id.empty()) return refuse("join without a job id (--rdzv_id)");
      if (join.max_nodes > opts_.max_nodes_per_job)
        return refuse(fmt::format("--nnodes max {} exceeds this daemon's limit of {} nodes per job", join.max_nodes,
                                  opts_.max_nodes_per_job));
      if (!s->job.empty() && s->job != join.job_id) return refuse("one connection serves one job");
      s->job = join.job_id;
      auto [it, inserted] = jobs_.try_emplace(join.job_id, join.job_id);
      if (inserted) log(fmt::format("job '{}' created by {} ({})", join.job_id, join.host, s->conn->peer()));
      apply(it->second.join(s->id, join, now));
      return;
    }
    auto job = jobs_.find(s->job);
    if (job == jobs_.end()) return refuse("message before join");
    switch (proto::type_of(f)) {
      case MsgType::kHeartbeat:
        apply(job->second.heartbeat(s->id, now));
        break;
      case MsgType::kWorkerFailed: {
        auto wf = proto::from_frame<proto::WorkerFailed>(f);
        log(fmt::format("job '{}': rank {} on {} failed with exit code {}", s->job, wf.rank, wf.host, wf.exit_code));
        apply(job->second.worker_failed(s->id, wf, now));
        break;
      }
      case MsgType::kNodeDone:
        apply(job->second.node_done(s->id, now));
        break;
      default:
        refuse(fmt::format("unexpected message type {}", f.type));
    }
  } catch (const proto::ProtocolError& e) {
    refuse(e.what());
  }
}

void Server::on_close(const std::shared_ptr<Session>& s, const std::string& why) {
  if (s->handshake_timer) s->handshake_timer->cancel();
  sessions_.erase(s->id);
  if (stopped_) return;
  if (why != "closed" && why != "connection closed by peer")
    log(fmt::format("{}: connection dropped: {}", s->conn->peer(), why));
  if (auto job = jobs_.find(s->job); job != jobs_.end()) {
    if (!job->second.finished()) log(fmt::format("job '{}': {} disconnected ({})", s->job, s->conn->peer(), why));
    apply(job->second.disconnected(s->id, Clock::now()));
  }
}

void Server::apply(const Actions& actions) {
  for (const auto& a : actions) {
    auto it = sessions_.find(a.session);
    if (it == sessions_.end()) continue;
    it->second->conn->send(a.frame);
    if (proto::type_of(a.frame) == MsgType::kError) it->second->conn->close();
  }
}

void Server::tick() {
  ticker_.expires_after(opts_.tick);
  ticker_.async_wait([this](boost::system::error_code ec) {
    if (ec || stopped_) return;
    const auto now = Clock::now();
    for (auto it = jobs_.begin(); it != jobs_.end();) {
      const auto before = it->second.state();
      apply(it->second.tick(now));
      if (it->second.state() != before && it->second.state() == Job::State::kFailed)
        log(fmt::format("job '{}' failed", it->first));
      if (it->second.finished() && now - it->second.last_activity() > std::chrono::seconds(60)) {
        it = jobs_.erase(it);  // keep finished jobs a minute for late re-joins to be told
      } else if (now - it->second.last_activity() > opts_.idle_job_expiry) {
        log(fmt::format("job '{}' expired after {} s idle", it->first, opts_.idle_job_expiry.count() / 1000));
        it = jobs_.erase(it);
      } else {
        ++it;
      }
    }
    tick();
  });
}

}  // namespace mg::rdzv
