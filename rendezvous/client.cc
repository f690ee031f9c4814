#include "rendezvous/client.h"

#include <boost/asio/connect.hpp>
#include <boost/asio/post.hpp>

#include "rendezvous/auth.h"
#include "rendezvous/endpoint.h"
#include "rendezvous/lookup.h"

namespace mg::rdzv {

namespace asio = boost::asio;

void tell(const ClientHandlers& h, const Decision& d) {
  std::visit(
      [&h](const auto& m) {
        using M = std::decay_t<decltype(m)>;
        if constexpr (std::is_same_v<M, proto::Assignment>) h.on_assignment(m);
        else if constexpr (std::is_same_v<M, proto::Restart>) h.on_restart(m);
        else if constexpr (std::is_same_v<M, proto::Abort>) h.on_abort(m);
        else if constexpr (std::is_same_v<M, proto::Done>) h.on_done();
        else if (h.on_standby) h.on_standby(m);
      },
      d);
}

Client::Client(asio::io_context& io, ClientOptions opts, ClientHandlers handlers)
    : io_(io), m_(std::move(opts)), h_(std::move(handlers)), retry_timer_(io), heartbeat_timer_(io), watchdog_(io),
      takeover_timer_(io), fence_timer_(io), majority_timer_(io), lookups_(io) {}

Client::~Client() {
  close();
  alive_.reset();
}

void Client::start() {
  auto cmds = m_.start(Clock::now());
  // A join that cannot be sent ends the link after start() returned, as a refusal would.
  if (m_.closed())
    asio::post(io_, [this, alive = std::weak_ptr<int>(alive_), cmds = std::move(cmds)]() mutable {
      if (alive.lock() && !agent_closed_) run(std::move(cmds));  // not after the agent's close()
    });
  else run(std::move(cmds));
}

void Client::rejoin() { run(m_.rejoin(Clock::now())); }
void Client::worker_failed(proto::WorkerFailed f) { run(m_.worker_failed(std::move(f), Clock::now())); }
void Client::node_done(int round) { run(m_.node_done(round)); }
void Client::host_short_of_majority() { run(m_.host_short_of_majority(Clock::now())); }
void Client::close() {
  agent_closed_ = true;
  run(m_.close());
}

void Client::run(ClientCommands cmds) {
  ++running_;
  for (auto& c : cmds) {
    // A handler told earlier in this list may have closed the link (the agent's close()):
    // nothing new is started then.
    if (m_.closed() && (std::holds_alternative<cmd::Connect>(c) || std::holds_alternative<cmd::Arm>(c) ||
                        std::holds_alternative<cmd::HostTakeover>(c) ||
                        std::holds_alternative<cmd::RecallEnded>(c)))
      continue;
    perform(c);
  }
  --running_;
}

asio::steady_timer& Client::timer(ClientTimer t) {
  switch (t) {
    case ClientTimer::kRetry: return retry_timer_;
    case ClientTimer::kHeartbeat: return heartbeat_timer_;
    case ClientTimer::kWatchdog: return watchdog_;
    case ClientTimer::kFence: return fence_timer_;
    case ClientTimer::kMajority: return majority_timer_;
    case ClientTimer::kTakeover: break;
  }
  return takeover_timer_;
}

void Client::perform(ClientCommand& c) {
  std::visit(
      [this](auto& x) {
        using T = std::decay_t<decltype(x)>;
        if constexpr (std::is_same_v<T, cmd::Connect>) {
          connect(x.host, x.port);
        } else if constexpr (std::is_same_v<T, cmd::Drop>) {
          ++connect_gen_;  // a connect in flight is stale now
          boost::system::error_code ec;
          if (connecting_) connecting_->close(ec);
          connecting_.reset();
          if (auto c = std::move(conn_)) c->close(true);  // its on_close sees conn_ gone: no report
        } else if constexpr (std::is_same_v<T, cmd::Send>) {
          if (conn_) conn_->send(x.frame);
        } else if constexpr (std::is_same_v<T, cmd::SignSent>) {
          if (conn_) conn_->sign_sent(x.session, 'c');
        } else if constexpr (std::is_same_v<T, cmd::Welcomed>) {
          if (!conn_) return;
          if (!x.session.empty()) conn_->verify_received(x.session, 's');
          conn_->set_max_frame(proto::kDefaultMaxFrame);
        } else if constexpr (std::is_same_v<T, cmd::Arm>) {
          auto& t = timer(x.timer);
          t.expires_at(x.at);
          t.async_wait([this, which = x.timer, gen = x.generation](boost::system::error_code ec) {
            if (!ec) run(m_.timer_fired(which, gen, Clock::now()));
          });
        } else if constexpr (std::is_same_v<T, cmd::Cancel>) {
          timer(x.timer).cancel();
        } else if constexpr (std::is_same_v<T, cmd::Shut>) {
          for (auto t : {ClientTimer::kRetry, ClientTimer::kHeartbeat, ClientTimer::kWatchdog, ClientTimer::kTakeover,
                         ClientTimer::kFence, ClientTimer::kMajority})
            timer(t).cancel();
          // A lookup of the server's name under way is abandoned: its bound's timer would
          // otherwise keep the event loop, and so the agent's end, waiting up to 20 s (#35).
          lookups_.cancel();
          boost::system::error_code ec;
          if (connecting_) connecting_->close(ec);
          if (conn_) conn_->close(!x.flush);
        } else if constexpr (std::is_same_v<T, cmd::Tell>) {
          tell(h_, x.d);
        } else if constexpr (std::is_same_v<T, cmd::Lost>) {
          std::string why = x.why;
          // From the addresses the refused connects went to, not a new lookup: one that hangs
          // would hold the event loop (#35).
          if (x.unanswered && x.host == dialled_.host)
            if (auto hint = unanswered_endpoint_hint(x.host, x.port, is_local_address(dialled_.found),
                                                     x.host == "localhost" || is_loopback_address(dialled_.found));
                !hint.empty())
              why += "; " + hint;
          if (h_.on_lost) h_.on_lost(why);
        } else if constexpr (std::is_same_v<T, cmd::Notice>) {
          if (h_.on_notice) h_.on_notice(x.text);
        } else if constexpr (std::is_same_v<T, cmd::HostTakeover>) {
          const TakeoverHost where = h_.on_take_over ? h_.on_take_over(x.seed) : TakeoverHost{};
          run(m_.hosted(where, Clock::now()));
        } else if constexpr (std::is_same_v<T, cmd::AskMajority>) {
          if (h_.hears_majority && !h_.hears_majority()) run(m_.host_short_of_majority(Clock::now()));
        } else if constexpr (std::is_same_v<T, cmd::StopHosting>) {
          if (h_.on_stop_hosting) h_.on_stop_hosting(x.why);
        } else if constexpr (std::is_same_v<T, cmd::RecallEnded>) {
          const bool hosting = h_.on_recall_ended && h_.on_recall_ended();
          run(m_.recall_ended(hosting, Clock::now()));
        } else if constexpr (std::is_same_v<T, cmd::RecallWelcomed>) {
          if (h_.on_recall_welcomed) h_.on_recall_welcomed(x.run);
        } else if constexpr (std::is_same_v<T, cmd::TakePending>) {
          // Not from within the agent's call (rejoin()): it takes the assignment once that returned.
          asio::post(io_, [this, alive = std::weak_ptr<int>(alive_)] {
            if (alive.lock()) run(m_.take_pending(Clock::now()));
          });
        }
      },
      c);
}

void Client::connect(const std::string& host, int port) {
  boost::system::error_code ec;
  auto addr = asio::ip::make_address(host, ec);
  asio::ip::tcp::endpoint ep;
  dialled_ = {host, {}};
  if (!ec) {
    ep = {addr, static_cast<unsigned short>(port)};
    dialled_.found = {ep};
  } else {
    // Off the io thread (rendezvous/lookup.h): a DNS server that does not answer cannot keep
    // signals and timers waiting (#35); a lookup that outlives the client is abandoned.
    lookups_.start(host, port, kLookupBound, [this, gen = ++connect_gen_](Addresses a) {
      if (m_.closed() || gen != connect_gen_) return;
      if (a.found.empty()) return run(m_.unresolvable(Clock::now()));
      dialled_.found = a.found;
      connect_to(a.found.front());
    });
    return;
  }
  connect_to(ep);
}

void Client::connect_to(const asio::ip::tcp::endpoint& ep) {
  connecting_ = std::make_unique<asio::ip::tcp::socket>(io_);
  ++connect_attempts_;
  connecting_->async_connect(ep, [this, gen = ++connect_gen_](boost::system::error_code ec) {
    if (m_.closed() || gen != connect_gen_) return;
    if (ec) return run(m_.connect_failed(ec == asio::error::connection_refused, ec.message(), Clock::now()));
    on_connected();
  });
}

void Client::on_connected() {
  conn_ = std::make_shared<FramedConnection>(std::move(*connecting_), proto::kHandshakeMaxFrame);
  connecting_.reset();
  std::weak_ptr<int> alive = alive_;
  const FramedConnection* self = conn_.get();
  conn_->start(
      [this, alive](const proto::Frame& f) {
        if (alive.lock()) run(m_.frame(f, Clock::now()));
      },
      [this, alive, self](const std::string& why) {
        // Not when this client dropped it itself (the machine has moved on).
        if (!alive.lock() || conn_.get() != self) return;
        const bool reset = self->reset();
        if (running_ == 0) return run(m_.connection_closed(why, Clock::now(), reset));
        asio::post(io_, [this, alive, self, why, reset] {
          if (alive.lock() && conn_.get() == self) run(m_.connection_closed(why, Clock::now(), reset));
        });
      });
  run(m_.connected(auth::random_hex(32), Clock::now()));
}

}  // namespace mg::rdzv
