#include "rendezvous/client.h"

#include <boost/asio/connect.hpp>
#include <boost/asio/post.hpp>
#include <fmt/format.h>

#include "rendezvous/auth.h"
#include "rendezvous/endpoint.h"

namespace mg::rdzv {

namespace asio = boost::asio;
using proto::MsgType;
using std::chrono::milliseconds;

std::chrono::milliseconds connect_retry_delay(int retry) {
  int ms = 5;
  for (int i = 1; i < retry && ms < 500; ++i) ms = ms * 3 / 2;
  return milliseconds(std::min(500, ms));
}

std::vector<TakeoverCandidate> takeover_candidates(const std::vector<std::string>& nodes,
                                                   const std::vector<int>& ports, const std::string& lost_addr,
                                                   int lost_port) {
  std::vector<TakeoverCandidate> out;
  const std::size_t n = std::min(nodes.size(), ports.size());
  for (std::size_t g = 0; g < n; ++g)
    if (ports[g] > 0 && !(nodes[g] == lost_addr && ports[g] == lost_port))
      out.push_back({static_cast<int>(g), nodes[g], ports[g]});
  return out;
}

std::string why_no_takeover(int restarts_spent, int max_restarts, std::size_t candidates, int standbys,
                            int min_nodes) {
  if (restarts_spent >= max_restarts)
    return fmt::format("no restart left for a new round (--max_restarts={})", max_restarts);
  if (candidates == 0) return "no other node can host the rendezvous";
  const auto left = static_cast<long long>(candidates) + std::max(0, standbys);
  if (left < min_nodes)
    return fmt::format("{} node(s) left{}, fewer than the {} that --nnodes asks for", left,
                       standbys > 0 ? fmt::format(" ({} of them standbys)", standbys) : std::string(), min_nodes);
  return {};
}

namespace {
std::string host_port(const std::string& host, int port) {
  return host.find(':') != std::string::npos ? fmt::format("[{}]:{}", host, port) : fmt::format("{}:{}", host, port);
}
}  // namespace

std::string unanswered_endpoint_hint(const std::string& host, int port, bool own_address, bool loopback) {
  if (!own_address || loopback) return {};
  return fmt::format(
      "{} is an address of this machine, yet no agent here hosts the rendezvous at it: an agent hosts only at the "
      "address it advertises (--local_addr, else its host name); give the agent that should host --local_addr={} or "
      "--rdzv_conf is_host=true, or start mglaunch-rdzv --listen {}",
      host, host, host_port(host, port));
}

std::string foreign_server_hint(const std::string& host, int port) {
  return fmt::format(
      "a program that is not a mglaunch rendezvous may hold {} (see `ss -ltnp 'sport = :{}'` there; or a mglaunch-rdzv "
      "there is at its --max-connections): give every node a free port in --rdzv_endpoint, or stop that program",
      host_port(host, port), port);
}

Client::Client(asio::io_context& io, ClientOptions opts, ClientHandlers handlers)
    : io_(io), opts_(std::move(opts)), h_(std::move(handlers)), retry_timer_(io), heartbeat_timer_(io), watchdog_(io),
      takeover_timer_(io) {
  key_ = !opts_.job_token.empty() ? opts_.job_token
         : opts_.token.empty()    ? std::string()
                                  : auth::job_key(opts_.token, opts_.join.job_id);
}

Client::~Client() {
  close();
  alive_.reset();
}

void Client::start() {
  if (auto bad = proto::validate(opts_.join); !bad.empty()) {
    asio::post(io_, [this, bad] { lost("cannot join: " + bad); });
    return;
  }
  deadline_ = Clock::now() + milliseconds(opts_.join.join_timeout_ms);
  wait_for_decision();
  try_connect();
  watch();
}

void Client::wait_for_decision() { waiting_since_ = Clock::now(); }

void Client::try_connect() {
  if (closed_) return;
  boost::system::error_code ec;
  auto addr = asio::ip::make_address(opts_.host, ec);
  asio::ip::tcp::endpoint ep;
  if (!ec) {
    ep = {addr, static_cast<unsigned short>(opts_.port)};
  } else {
    asio::ip::tcp::resolver resolver(io_);
    auto results = resolver.resolve(opts_.host, std::to_string(opts_.port), ec);
    if (ec || results.empty()) {
      if (takeover_) return next_candidate("cannot resolve its address");
      return lost(fmt::format("cannot resolve rendezvous host '{}'", opts_.host));
    }
    ep = *results.begin();
  }
  connecting_ = std::make_unique<asio::ip::tcp::socket>(io_);
  ++connect_attempts_;
  connecting_->async_connect(ep, [this, gen = ++connect_gen_](boost::system::error_code ec) {
    if (closed_ || gen != connect_gen_) return;
    if (ec) {
      // While a takeover is looked for, its timer moves on from a node that does not answer.
      if (!takeover_ && Clock::now() >= deadline_) {
        std::string hint;
        if (ec == asio::error::connection_refused)
          hint = unanswered_endpoint_hint(opts_.host, opts_.port, is_local_host(opts_.host), is_loopback_host(opts_.host));
        return lost(fmt::format("cannot reach the rendezvous server at {}:{}: {}{}", opts_.host, opts_.port,
                                ec.message(), hint.empty() ? "" : "; " + hint));
      }
      retry_timer_.expires_after(connect_retry_delay(++refused_));
      retry_timer_.async_wait([this](boost::system::error_code ec) {
        if (!ec) try_connect();
      });
      return;
    }
    refused_ = 0;
    conn_ = std::make_shared<FramedConnection>(std::move(*connecting_), proto::kHandshakeMaxFrame);
    connecting_.reset();
    connected_at_ = Clock::now();
    challenged_ = welcomed_ = answered_ = false;
    nonce_ = auth::random_hex(32);
    std::weak_ptr<int> alive = alive_;
    const FramedConnection* self = conn_.get();
    conn_->start(
        [this, alive](const proto::Frame& f) {
          if (alive.lock() && !closed_) on_frame(f);
        },
        [this, alive, self](const std::string& why) {
          // Not when this client closed it itself (reconnect_later has moved on to the next try).
          if (!alive.lock() || conn_.get() != self) return;
          // A server that welcomed us and then vanished may come back: keep trying.
          if (ever_welcomed_) reconnect_later(why);
          else if (!welcomed_ && !answered_)  // closed before a word: maybe not our server at all
            lost(fmt::format("the connection to the rendezvous server at {} ended before its welcome ({}); {}",
                             host_port(opts_.host, opts_.port), why, foreign_server_hint(opts_.host, opts_.port)));
          else lost(why);
        });
    conn_->send(proto::to_frame(proto::Hello{opts_.join.agent_id, opts_.join.job_id, nonce_}));
    // Without a token nothing is proven first: the join rides with the hello, saving a
    // round trip (the server reads them in order; one that wants a token answers the hello
    // with its challenge, which this client refuses, before it reads the join).
    joined_early_ = key_.empty();
    if (joined_early_) send_join();
  });
}

namespace {
const char* type_name(MsgType t) {
  switch (t) {
    case MsgType::kAssignment: return "an Assignment";
    case MsgType::kHeartbeat: return "a Heartbeat";
    case MsgType::kRestart: return "a Restart";
    case MsgType::kAbort: return "an Abort";
    case MsgType::kDone: return "a Done";
    case MsgType::kError: return "an Error";
    case MsgType::kStandby: return "a Standby";
    default: return "a message of an unexpected type";
  }
}
}  // namespace

void Client::failed_attempt(const std::string& why) {
  if (ever_welcomed_) reconnect_later(why);  // the real server may come back within join_timeout
  else lost(why);
}

void Client::on_frame(const proto::Frame& f) {
  answered_ = true;
  // The handshake is a state machine: until the Welcome (and with a key, until the server
  // proved it in its Challenge) only Challenge and Welcome are read. Anything else comes
  // from a server that proved nothing: it closes the connection as a failed attempt, and
  // never counts as a decision, whatever it says.
  if (!welcomed_ && proto::type_of(f) != MsgType::kChallenge && proto::type_of(f) != MsgType::kWelcome) {
    std::string said;  // an error's text, shown for what it is: a claim nobody proved
    if (proto::type_of(f) == MsgType::kError) {
      try {
        said = proto::from_frame<proto::Error>(f).message;
      } catch (const proto::ProtocolError& e) {
        return failed_attempt(fmt::format("bad message from the rendezvous server at {}:{}: {}", opts_.host,
                                          opts_.port, e.what()));
      }
      // Without a token nothing can be proved: the refusal is all there is to say.
      if (key_.empty()) return failed_attempt(fmt::format("refused by the rendezvous server: {}", said));
    }
    if (key_.empty())
      return failed_attempt(fmt::format("the server at {}:{} sent {} before its welcome: not a mglaunch rendezvous "
                                        "server; closed the connection and ignored it",
                                        opts_.host, opts_.port, type_name(proto::type_of(f))));
    return failed_attempt(fmt::format(
        "the rendezvous server at {}:{} could not be authenticated: it sent {} before proving this job's key{}; closed "
        "the connection and ignored it (not the server you meant, or one without this job's key)",
        opts_.host, opts_.port, type_name(proto::type_of(f)),
        said.empty() ? std::string() : fmt::format(" (unproven: '{}')", proto::truncate_text(said, 200))));
  }
  try {
    switch (proto::type_of(f)) {
      case MsgType::kChallenge: {
        auto c = proto::from_frame<proto::Challenge>(f);
        if (challenged_ || welcomed_) return failed_attempt("the rendezvous server repeated its challenge");
        if (key_.empty())
          return failed_attempt("the rendezvous server wants a token: set --token-file or MGLAUNCH_RDZV_TOKEN");
        if (!auth::equal_ct(c.proof, auth::server_proof(key_, nonce_, c.nonce)))
          return failed_attempt(fmt::format("the rendezvous server at {}:{} cannot prove this job's key: wrong "
                                            "rendezvous token here or there, or not the server you meant",
                                            opts_.host, opts_.port));
        challenged_ = true;
        conn_->send(proto::to_frame(proto::Auth{auth::client_proof(key_, nonce_, c.nonce)}));
        session_ = auth::session_key(key_, nonce_, c.nonce);
        conn_->sign_sent(session_, 'c');  // the server's frames are signed from its Welcome on
        return;
      }
      case MsgType::kWelcome: {
        auto w = proto::from_frame<proto::Welcome>(f);
        if (welcomed_) return lost("the rendezvous server repeated its welcome");
        if (!key_.empty() && !challenged_)
          return failed_attempt(fmt::format("the rendezvous server at {}:{} asks for no token while this agent has "
                                            "one: refusing an unauthenticated server (give the daemon the same token)",
                                            opts_.host, opts_.port));
        // (The Welcome itself carries no MAC: a forged host_agent can only make this node
        // give up sooner on a server that goes away, never obey one that proved nothing.)
        host_agent_ = w.host_agent;
        return on_welcome();
      }
      case MsgType::kHeartbeat:
        // The echo (conn_->last_frame() moved), or the job's standby count changed.
        standbys_ = proto::from_frame<proto::Heartbeat>(f).standbys;
        return;
      case MsgType::kAssignment: {
        auto a = proto::from_frame<proto::Assignment>(f);
        if (!join_wanted_) {
          pending_ = std::move(a);  // the agent takes it once its workers stopped (rejoin())
          return;
        }
        return take(a);
      }
      case MsgType::kRestart: {
        auto r = proto::from_frame<proto::Restart>(f);
        current_.reset();
        pending_.reset();
        join_wanted_ = false;
        restarts_seen_ = std::max(restarts_seen_, r.restart_count);
        h_.on_restart(r);
        return;
      }
      case MsgType::kAbort:
        waiting_since_.reset();
        decided_ = true;
        h_.on_abort(proto::from_frame<proto::Abort>(f));
        return;
      case MsgType::kDone:
        waiting_since_.reset();
        decided_ = true;
        h_.on_done();
        return;
      case MsgType::kStandby: {
        // A decision: the wait for a place has no deadline (the job's end is told).
        auto m = proto::from_frame<proto::Standby>(f);
        waiting_since_.reset();
        standby_ = true;
        restarts_seen_ = std::max(restarts_seen_, m.restart_count);
        standbys_ = std::max(standbys_, m.position);
        // A node that took a job over lists no round before its own closes: keep the last.
        if (!standby_of_ || !m.nodes.empty()) standby_of_ = m;
        if (h_.on_standby) h_.on_standby(m);
        return;
      }
      case MsgType::kError:
        return lost(fmt::format("refused by the rendezvous server: {}", proto::from_frame<proto::Error>(f).message));
      default:
        return lost(fmt::format("unexpected message type {} from the rendezvous server", f.type));
    }
  } catch (const proto::ProtocolError& e) {
    // Before the welcome nothing is proven: a malformed frame is a failed attempt, not the end.
    const std::string why = fmt::format("bad message from the rendezvous server: {}", e.what());
    if (welcomed_) lost(why);
    else failed_attempt(why);
  }
}

void Client::on_welcome() {
  if (challenged_) conn_->verify_received(session_, 's');
  if (takeover_) {
    takeover_timer_.cancel();
    if (h_.on_notice)
      h_.on_notice(fmt::format("the rendezvous is now hosted by {} at {}:{}; joining the next round",
                               host_agent_.empty() ? std::string("a daemon") : host_agent_, opts_.host, opts_.port));
    takeover_.reset();
  }
  welcomed_ = ever_welcomed_ = true;
  in_outage_ = false;
  backoff_ = milliseconds(100);
  conn_->set_max_frame(proto::kDefaultMaxFrame);
  if (!joined_early_) send_join();
  if (current_ && unsent_failure_) {
    // Reported while the server was away: the rebuilt job must hear it.
    conn_->send(proto::to_frame(*unsent_failure_));
    unsent_failure_.reset();
  }
  // The join itself shows this node alive: the first heartbeat is due one interval later.
  heartbeat_timer_.cancel();
  schedule_heartbeat();
}

void Client::send_join() {
  proto::Join j = opts_.join;
  if (current_) {
    if (h_.on_notice) h_.on_notice(fmt::format("reconnected; re-registered round {}", current_->round));
    j.resume_round = current_->round;
    j.resume_group_rank = current_->group_rank;
    j.resume_group_world_size = current_->group_world_size;
    j.resume_restart_count = current_->restart_count;
    j.resume_done = done_sent_;
  } else if (standby_) {
    if (h_.on_notice) h_.on_notice("reconnected; re-registered as a standby");
    j.resume_standby = true;
  }
  conn_->send(proto::to_frame(j));
}

void Client::heartbeat() {
  if (closed_ || !connected()) return;
  conn_->send(proto::to_wire(proto::Heartbeat{round_}));
  schedule_heartbeat();
}

void Client::schedule_heartbeat() {
  heartbeat_timer_.expires_after(milliseconds(opts_.join.keep_alive_ms));
  heartbeat_timer_.async_wait([this](boost::system::error_code ec) {
    if (!ec) heartbeat();
  });
}

void Client::watch() {
  watchdog_.expires_after(milliseconds(opts_.join.keep_alive_ms));
  watchdog_.async_wait([this](boost::system::error_code ec) {
    if (ec || closed_) return;
    const auto now = Clock::now();
    const auto join_timeout = milliseconds(opts_.join.join_timeout_ms);
    // The server decides on join_timeout itself; this catches a server that cannot.
    if (waiting_since_ && now - *waiting_since_ > join_timeout + std::max(milliseconds(2000), join_timeout / 10))
      return lost(fmt::format("no decision from the rendezvous server at {}:{} within join_timeout ({} s): it is "
                              "unreachable or not answering",
                              opts_.host, opts_.port, opts_.join.join_timeout_ms / 1000.0));
    if (connected()) {
      const auto silent = milliseconds(opts_.join.keep_alive_ms) * (opts_.join.keep_alive_max_attempt + 1);
      if (!welcomed_ && now - connected_at_ > std::min(join_timeout, std::max(silent, milliseconds(10000)))) {
        if (!ever_welcomed_ || now >= deadline_)
          return lost(fmt::format("the rendezvous server at {}:{} accepts connections but does not answer the handshake",
                                  opts_.host, opts_.port));
        reconnect_later("no answer to the handshake");
      } else if (welcomed_ && now - conn_->last_frame() > silent) {
        reconnect_later(fmt::format("no answer for {} ms", std::chrono::duration_cast<milliseconds>(now - conn_->last_frame()).count()));
      }
    }
    watch();
  });
}

void Client::take(const proto::Assignment& a) {
  round_ = a.round;
  current_ = a;
  standby_ = false;
  standby_of_.reset();
  standbys_ = a.standbys;
  opts_.join.last_group_rank = -1;
  last_ = a;
  restarts_seen_ = std::max(restarts_seen_, a.restart_count);
  done_sent_ = false;
  unsent_failure_.reset();
  waiting_since_.reset();
  h_.on_assignment(a);
}

void Client::rejoin() {
  wait_for_decision();
  join_wanted_ = true;
  if (pending_) {
    // Assigned while the workers stopped (the join went with a reconnection): take it now.
    asio::post(io_, [this, alive = std::weak_ptr<int>(alive_)] {
      if (!alive.lock() || closed_ || !pending_) return;
      auto a = std::move(*pending_);
      pending_.reset();
      take(a);
    });
    return;
  }
  // (With the connection between its hello and its welcome, the join goes with the welcome.)
  if (connected() && welcomed_) conn_->send(proto::to_frame(opts_.join));
}

void Client::worker_failed(proto::WorkerFailed f) {
  proto::truncate_to_limits(f);
  if (connected() && welcomed_) conn_->send(proto::to_frame(f));
  else unsent_failure_ = std::move(f);
  wait_for_decision();
}

void Client::node_done(int round) {
  // No decision deadline here: "done" comes when the slowest node finishes, and the
  // heartbeat echo already tells a dead server from a slow job.
  done_sent_ = true;
  if (connected() && welcomed_) conn_->send(proto::to_frame(proto::NodeDone{round}));
}

void Client::reconnect_later(const std::string& why) {
  if (closed_) return;
  if (!host_agent_.empty()) return host_lost(why);
  // Connections that are made but fail (an unauthenticated server) count against the
  // outage's join_timeout like refused ones.
  if (in_outage_ && Clock::now() >= deadline_)
    return lost(fmt::format("no authenticated rendezvous server at {}:{} within join_timeout ({} s): {}", opts_.host,
                            opts_.port, opts_.join.join_timeout_ms / 1000.0, why));
  heartbeat_timer_.cancel();
  welcomed_ = false;
  if (auto c = std::move(conn_)) c->close(true);  // its on_close sees conn_ gone: no second notice
  if (!in_outage_) {  // one join_timeout for the whole outage, however many tries
    in_outage_ = true;
    deadline_ = Clock::now() + milliseconds(opts_.join.join_timeout_ms);
  }
  retry_timer_.expires_after(backoff_);
  backoff_ = std::min(backoff_ * 2, milliseconds(2000));
  retry_timer_.async_wait([this](boost::system::error_code ec) {
    if (!ec) try_connect();
  });
  if (h_.on_notice) h_.on_notice(fmt::format("lost the rendezvous server ({}); workers keep running, reconnecting", why));
}

void Client::drop_connection() {
  heartbeat_timer_.cancel();
  retry_timer_.cancel();
  welcomed_ = false;
  ++connect_gen_;  // a connect in flight is stale now
  boost::system::error_code ec;
  if (connecting_) connecting_->close(ec);
  connecting_.reset();
  if (auto c = std::move(conn_)) c->close(true);  // its on_close sees conn_ gone: no notice
}

void Client::host_lost(const std::string& why) {
  // The job ended (Abort, Done) and its host closes: nothing was lost, nothing to take over.
  if (decided_) return drop_connection();
  if (takeover_) return next_candidate(why);  // a candidate's connection failed before its welcome
  const std::string lost = fmt::format("rendezvous host {} ({}:{}) lost: {}", host_agent_, opts_.host, opts_.port, why);
  // A standby follows the round it was last told of; an active node the round it ran.
  const bool standby = standby_;
  if (standby && (!standby_of_ || standby_of_->nodes.empty()))
    return end_host_lost(lost + "; this standby was told no round to follow");
  if (!standby && !last_) return end_host_lost(lost + "; no round had started, so no node can take over");
  auto candidates = standby ? takeover_candidates(standby_of_->nodes, standby_of_->takeover_ports, opts_.host, opts_.port)
                            : takeover_candidates(*last_, opts_.host, opts_.port);
  if (auto no = why_no_takeover(restarts_seen_, opts_.join.max_restarts, candidates.size(), standbys_,
                                opts_.join.min_nodes);
      !no.empty())
    return end_host_lost(lost + "; no survivor can take over: " + no);
  drop_connection();
  Takeover t;
  t.candidates = std::move(candidates);
  t.deadline = Clock::now() + milliseconds(opts_.join.keep_alive_ms) * opts_.join.keep_alive_max_attempt;
  t.lost = lost;
  t.lost_host = host_agent_;
  t.restart_count = restarts_seen_ = restarts_seen_ + 1;
  t.round = standby ? standby_of_->round : last_->round;
  t.self_rank = standby ? -1 : last_->group_rank;
  t.listed = static_cast<int>(standby ? standby_of_->nodes.size() : last_->nodes.size());
  takeover_ = std::move(t);
  if (standby) {
    // No workers to stop, no restart to take: it re-registers as a standby with the new host.
    if (h_.on_notice) h_.on_notice(lost + "; this standby follows the node that takes over");
    wait_for_decision();
    return next_candidate({});
  }
  opts_.join.last_group_rank = last_->group_rank;  // the new host keeps it (until the next assignment)
  // The round is over, as for any lost node: a restart, then a fresh join with whoever hosts.
  current_.reset();
  pending_.reset();
  unsent_failure_.reset();
  done_sent_ = false;
  join_wanted_ = false;
  wait_for_decision();
  h_.on_restart(proto::Restart{takeover_->restart_count,
                               lost + "; the survivors go on with the lowest live node as rendezvous host"});
  if (!closed_ && takeover_) next_candidate({});
}

void Client::next_candidate(const std::string& why_previous) {
  Takeover& t = *takeover_;
  if (!why_previous.empty() && t.next > 0) {
    const auto& c = t.candidates[t.next - 1];
    t.tried += fmt::format("{}node {} at {}:{}: {}", t.tried.empty() ? "" : "; ", c.group_rank, opts_.host,
                           opts_.port, why_previous);
  }
  drop_connection();
  takeover_timer_.cancel();
  const auto now = Clock::now();
  while (t.next < t.candidates.size() && now < t.deadline) {
    const TakeoverCandidate c = t.candidates[t.next++];
    int port = c.port;
    std::string host = c.addr;
    if (c.group_rank == t.self_rank) {
      // Every node below this one is gone or silent: this one hosts. The last round's
      // nodes but the lost host and those below this one are expected to re-join.
      const int survivors = std::max(1, t.listed - 1 - static_cast<int>(t.next - 1));
      const TakeoverHost hosted =
          h_.on_take_over
              ? h_.on_take_over({t.round, t.restart_count, t.lost, t.lost_host, t.deadline, survivors, t.listed})
              : TakeoverHost{};
      port = hosted.port;
      if (!hosted.host.empty()) host = hosted.host;
      if (port <= 0) {
        t.tried += fmt::format("{}node {} (this one): cannot host", t.tried.empty() ? "" : "; ", c.group_rank);
        continue;
      }
      opts_.join.takeover_port = 0;  // it hosts from now on
    }
    opts_.host = host;
    opts_.port = port;
    // One keep-alive interval for each node below this one (bounded by the whole search's).
    takeover_timer_.expires_at(std::min(t.deadline, now + milliseconds(opts_.join.keep_alive_ms)));
    takeover_timer_.async_wait([this](boost::system::error_code ec) {
      if (!ec && !closed_ && takeover_) next_candidate("no answer");
    });
    refused_ = 0;
    try_connect();
    return;
  }
  std::string reason = t.lost + "; no survivor could take over";
  if (!t.tried.empty()) reason += " (" + t.tried + ")";
  takeover_.reset();
  end_host_lost(reason);
}

void Client::end_host_lost(const std::string& reason) {
  if (!last_) return lost(reason);
  if (!shut(/*flush=*/false)) return;
  // As the job's own decision would: every worker of this node stops, the root cause names
  // the node that is gone.
  proto::Abort a;
  a.root_cause.round = round_;
  a.root_cause.host = host_agent_;
  a.root_cause.rank = -1;
  a.root_cause.exit_code = kHostLostExitCode;
  a.reason = a.root_cause.message = reason;
  waiting_since_.reset();
  h_.on_abort(a);
}

void Client::lost(const std::string& why) {
  if (!shut(/*flush=*/false)) return;
  if (h_.on_lost) h_.on_lost(why);
}

void Client::close() { shut(/*flush=*/true); }  // flush what is queued (e.g. NodeDone) first

bool Client::shut(bool flush) {
  if (closed_) return false;
  closed_ = true;
  retry_timer_.cancel();
  heartbeat_timer_.cancel();
  watchdog_.cancel();
  takeover_timer_.cancel();
  takeover_.reset();
  boost::system::error_code ec;
  if (connecting_) connecting_->close(ec);
  if (conn_) conn_->close(!flush);
  return true;
}

}  // namespace mg::rdzv
