#include "rendezvous/client_machine.h"
#include "rendezvous/link.h"

#include <fmt/format.h>

#include "proto/frame.h"
#include "rendezvous/auth.h"

namespace mg::rdzv {

using proto::MsgType;
using std::chrono::milliseconds;

std::chrono::milliseconds connect_retry_delay(int retry) {
  int ms = 5;
  for (int i = 1; i < retry && ms < 500; ++i) ms = ms * 3 / 2;
  return milliseconds(std::min(500, ms));
}

std::chrono::milliseconds fence_after(int keep_alive_ms, int keep_alive_max_attempt) {
  if (keep_alive_max_attempt < kMinFenceAttempts) return milliseconds(0);
  return milliseconds(keep_alive_ms) * keep_alive_max_attempt - milliseconds(keep_alive_ms) / 2;
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

std::string host_port(const std::string& host, int port) {
  return host.find(':') != std::string::npos ? fmt::format("[{}]:{}", host, port) : fmt::format("{}:{}", host, port);
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

std::optional<Decision> decision_of(const proto::Frame& f) {
  switch (proto::type_of(f)) {
    case MsgType::kAssignment: return proto::from_frame<proto::Assignment>(f);
    case MsgType::kRestart: return proto::from_frame<proto::Restart>(f);
    case MsgType::kAbort: return proto::from_frame<proto::Abort>(f);
    case MsgType::kDone: return proto::Done{};
    case MsgType::kStandby: return proto::from_frame<proto::Standby>(f);
    default: return std::nullopt;
  }
}

ClientMachine::ClientMachine(ClientOptions opts) : opts_(std::move(opts)) {
  key_ = !opts_.job_token.empty() ? opts_.job_token
         : opts_.token.empty()    ? std::string()
                                  : auth::job_key(opts_.token, opts_.join.job_id);
  job_hosts_.emplace_back(opts_.host, opts_.port);
}

// ---- the agent's calls ----

ClientCommands ClientMachine::start(Clock::time_point now) {
  if (auto bad = proto::validate(opts_.join); !bad.empty()) return give_up("cannot join: " + bad);
  deadline_ = now + milliseconds(opts_.join.join_timeout_ms);
  waiting_since_ = now;
  if (recall_) start_recall(now);  // the record's hosts first (Recall)
  else try_connect();
  watch(now);
  return take_out();
}

ClientCommands ClientMachine::rejoin(Clock::time_point now) {
  waiting_since_ = now;
  join_wanted_ = true;
  // Assigned while the workers stopped (the join went with a reconnection): take it soon.
  if (pending_) out_.push_back(cmd::TakePending{});
  // (With the connection between its hello and its welcome, the join goes with the welcome.)
  // A node that fenced itself waits for the decision its failure report brings (a Restart),
  // or re-registers its round on the next welcome: no fresh join on this session.
  else if (connected_ && welcomed_ && !fenced_) send(proto::to_wire(opts_.join));
  // Waiting for a next round after one of this node's: if it hosts, its server's shortfall
  // is asked for on this clock too (cmd::AskMajority), not only on the server's events.
  if (last_ && !decided_) arm(ClientTimer::kMajority, now + milliseconds(opts_.join.keep_alive_ms));
  return take_out();
}

ClientCommands ClientMachine::take_pending(Clock::time_point now) {
  if (closed_ || !pending_) return {};
  auto a = std::move(*pending_);
  pending_.reset();
  take(a, now);
  return take_out();
}

ClientCommands ClientMachine::host_short_of_majority(Clock::time_point now) {
  // Only while this node waits for its own server's next round (its Restart taken, no
  // decision since): a running node, a search or a seek already under way ignores it.
  if (closed_ || decided_ || takeover_ || seek_ || !welcomed_ || current_ || standby_ || !last_) return {};
  Seek sk;
  sk.home_host = opts_.host;
  sk.home_port = opts_.port;
  sk.home_epoch = std::max(welcome_epoch_, opts_.join.epoch);
  sk.home_last = std::max(welcome_last_round_, opts_.join.epoch);
  sk.targets = seek_targets(sk.home_host, sk.home_port);
  if (sk.targets.empty()) return {};  // no other node could host: nowhere to look
  sk.deadline = now + milliseconds(opts_.join.join_timeout_ms);
  seek_ = std::move(sk);
  waiting_since_ = now;  // the watchdog's bound falls after the seek's
  // The grace: a node cut off only for a moment may come back (as a server drops a silent one).
  arm(ClientTimer::kTakeover, now + milliseconds(opts_.join.keep_alive_ms) * opts_.join.keep_alive_max_attempt);
  return take_out();
}

ClientCommands ClientMachine::worker_failed(proto::WorkerFailed f, Clock::time_point now) {
  proto::truncate_to_limits(f);
  if (connected_ && welcomed_) send(proto::to_wire(f));
  unanswered_failure_ = std::move(f);
  waiting_since_ = now;
  return take_out();
}

ClientCommands ClientMachine::node_done(int round) {
  // No decision deadline here: "done" comes when the slowest node finishes, and the
  // heartbeat echo already tells a dead server from a slow job.
  done_sent_ = true;
  // A connection without a token sent its join with the hello (joined_early_): that join
  // said "not done", and the welcome sends none again, so the done follows it now (the
  // server reads them in order); else the rebuilt job waited for this node for ever.
  if (connected_ && (welcomed_ || joined_early_)) send(proto::to_wire(proto::NodeDone{round}));
  return take_out();
}

ClientCommands ClientMachine::close() {
  shut(/*flush=*/true);
  return take_out();
}

ClientCommands ClientMachine::give_up(const std::string& why) {
  lost(why);
  return take_out();
}

// ---- the effect layer's reports ----

ClientCommands ClientMachine::connected(const std::string& nonce, Clock::time_point now) {
  if (closed_) return {};
  refused_ = 0;
  connected_ = true;
  connected_at_ = last_frame_ = now;
  challenged_ = welcomed_ = answered_ = false;
  beats_.clear();
  heard(now);  // the server's machine accepted the connection (a REJECT firewall never does)
  nonce_ = nonce;
  send(proto::to_wire(proto::Hello{opts_.join.agent_id, opts_.join.job_id, nonce_, /*reads_not_hosting=*/true}));
  // Without a token nothing is proven first: the join rides with the hello, saving a
  // round trip (the server reads them in order; one that wants a token answers the hello
  // with its challenge, which this client refuses, before it reads the join).
  // (Seeking, a server elsewhere joins only once its Welcome was weighed.)
  // (Recalling, a server joins only once its Welcome named the record's run; taking over or
  // rejoining with a run, once it named that run: takeover_welcomed().)
  joined_early_ = key_.empty() && !(seeking() && !seek_->at_home) && !recall_ && !(takeover_ && !opts_.join.run.empty());
  if (joined_early_) send_join();
  return take_out();
}

ClientCommands ClientMachine::connect_failed(bool refused, const std::string& error, Clock::time_point now) {
  if (closed_) return {};
  refused_connect(refused, error, now);
  return take_out();
}

void ClientMachine::refused_connect(bool refused, const std::string& error, Clock::time_point now) {
  if (recall_) return next_recall_target(now, refused ? "refused" : error);  // the next of the record's hosts at once
  // A refused connect: that machine (or a firewall that REJECTs) answers. A takeover
  // candidate that refuses has not noticed the loss yet (waited for, #34). It never moves
  // the fence: a firewall's reset is no word from the rendezvous (#34).
  if (refused && takeover_ && !takeover_->asking) takeover_->refused = takeover_->refused_any = true;
  // While a takeover is looked for, its timer moves on from a node that does not answer.
  if (!takeover_ && !seek_ && now >= deadline_)
    return lost(fmt::format("cannot reach the rendezvous server at {}:{}: {}", opts_.host, opts_.port, error), refused);
  arm(ClientTimer::kRetry, now + connect_retry_delay(++refused_));
}

ClientCommands ClientMachine::unresolvable(Clock::time_point now) {
  if (closed_) return {};
  if (recall_) next_recall_target(now, "cannot resolve its address");
  else if (takeover_) next_candidate("cannot resolve its address", now);
  else if (seeking()) next_seek_target(now);
  else lost(fmt::format("cannot resolve rendezvous host '{}'", opts_.host));
  return take_out();
}

ClientCommands ClientMachine::frame(const proto::Frame& f, Clock::time_point now) {
  last_frame_ = now;
  if (closed_ || !connected_) return {};
  on_frame(f, now);
  return take_out();
}

ClientCommands ClientMachine::connection_closed(const std::string& why, Clock::time_point now, bool reset) {
  const bool was = connected_;
  connected_ = false;
  if (closed_ || !was) return {};
  if (recall_) {  // (no welcome yet: one would have ended the recall)
    next_recall_target(now, "closed the connection: " + why);
    return take_out();
  }
  // A takeover candidate that closes before any frame (its socket did not admit us: its
  // connections, per address, memory; an EMFILE pause) is alive: waited for as a refused
  // connect, never passed over (review s39-listen L1).
  if (takeover_ && !takeover_->asking && !answered_) {
    drop_connection();
    refused_connect(/*refused=*/true, "closed before any answer: " + why, now);
    return take_out();
  }
  // A server that welcomed us and then vanished may come back: keep trying. A closed (or
  // reset) connection does not move the fence: a firewall resets too.
  if (ever_welcomed_) reconnect_later(why, now, /*silent=*/false, reset);
  else if (!welcomed_ && !answered_)  // closed before a word: maybe not our server at all
    lost(fmt::format("the connection to the rendezvous server at {} ended before its welcome ({}); {}",
                     host_port(opts_.host, opts_.port), why, foreign_server_hint(opts_.host, opts_.port)));
  else lost(why);
  return take_out();
}

ClientCommands ClientMachine::timer_fired(ClientTimer t, std::uint64_t generation, Clock::time_point now) {
  if (closed_ || generation != this->generation(t)) return {};
  switch (t) {
    case ClientTimer::kRetry: try_connect(); break;
    case ClientTimer::kHeartbeat:
      if (connected_) {
        send(proto::to_wire(proto::Heartbeat{round_}));
        if (beats_.size() < kMaxBeats) beats_.push_back(now);
        schedule_heartbeat(now);
      }
      break;
    case ClientTimer::kTakeover:
      if (recall_) {
        next_recall_target(now, recall_->pausing ? std::string() : "no answer");
        break;
      }
      if (seek_) {
        if (!seek_->started) {
          seek_->started = true;
          std::string where;
          for (const auto& [h, p] : seek_->targets) where += (where.empty() ? "" : ", ") + host_port(h, p);
          out_.push_back(cmd::Notice{fmt::format(
              "this node hosts the job and its next round has had no majority of the voters for {} s: a partition may "
              "have cut this side off; it looks for the job at its other hosts ({}), one keep-alive interval each, "
              "until join_timeout ({} s), and leaves for one that runs a newer round",
              opts_.join.keep_alive_ms * opts_.join.keep_alive_max_attempt / 1000.0, where,
              opts_.join.join_timeout_ms / 1000.0)});
        }
        next_seek_target(now);
        break;
      }
      if (!takeover_ || takeover_->asking) break;
      // A candidate that refuses is alive and will host once it notices: waited for, to the
      // search's deadline; one that is silent is cut off (or gone): the next is tried.
      if (takeover_->refused && !takeover_->rejoining && now < takeover_->deadline) {
        arm(ClientTimer::kTakeover, std::min(takeover_->deadline, now + milliseconds(opts_.join.keep_alive_ms)));
        break;
      }
      next_candidate(takeover_->refused ? "refused until the search's deadline" : "no answer", now);
      break;
    case ClientTimer::kFence: fence(now); break;
    case ClientTimer::kMajority:
      // Until a round runs again (or the job is decided); a seek under way asks no more. A
      // takeover search in flight (the agent's rejoin() may come before it ends) asks not yet
      // but goes on asking after it: this node may host when it ends.
      if (decided_ || current_ || standby_ || seek_) break;
      if (!takeover_) out_.push_back(cmd::AskMajority{});
      arm(ClientTimer::kMajority, now + milliseconds(opts_.join.keep_alive_ms));
      break;
    case ClientTimer::kWatchdog: {
      const auto join_timeout = milliseconds(opts_.join.join_timeout_ms);
      // The server decides on join_timeout itself; this catches a server that cannot.
      if (waiting_since_ && now - *waiting_since_ > join_timeout + std::max(milliseconds(2000), join_timeout / 10)) {
        lost(fmt::format("no decision from the rendezvous server at {}:{} within join_timeout ({} s): it is "
                         "unreachable or not answering",
                         opts_.host, opts_.port, opts_.join.join_timeout_ms / 1000.0));
        break;
      }
      if (connected_) {
        const auto silent = milliseconds(opts_.join.keep_alive_ms) * (opts_.join.keep_alive_max_attempt + 1);
        if (!welcomed_ && now - connected_at_ > std::min(join_timeout, std::max(silent, milliseconds(10000)))) {
          if (!ever_welcomed_ || now >= deadline_) {
            lost(fmt::format("the rendezvous server at {}:{} accepts connections but does not answer the handshake",
                             opts_.host, opts_.port));
            break;
          }
          reconnect_later("no answer to the handshake", now);
        } else if (welcomed_ && now - last_frame_ > silent) {
          reconnect_later(
              fmt::format("no answer for {} ms", std::chrono::duration_cast<milliseconds>(now - last_frame_).count()),
              now, /*silent=*/true);
        }
      }
      if (!closed_) watch(now);
      break;
    }
  }
  return take_out();
}

ClientCommands ClientMachine::hosted(const TakeoverHost& where, Clock::time_point now) {
  if (closed_ || !takeover_ || !takeover_->asking) return {};
  Takeover& t = *takeover_;
  t.asking = false;
  const TakeoverCandidate& c = t.candidates[t.next - 1];
  if (where.port <= 0) {
    t.tried += fmt::format("{}node {} (this one): cannot host", t.tried.empty() ? "" : "; ", c.group_rank);
    next_candidate({}, now);
  } else {
    opts_.join.vote_port = std::exchange(opts_.join.takeover_port, 0);  // it hosts from now on (its vote socket)
    connect_candidate(where.host.empty() ? c.addr : where.host, where.port, now);
  }
  return take_out();
}

// ---- the policy ----

void ClientMachine::try_connect() {
  if (closed_) return;
  out_.push_back(cmd::Connect{opts_.host, opts_.port});
}

void ClientMachine::failed_attempt(const std::string& why, Clock::time_point now) {
  if (recall_) return next_recall_target(now, why);  // not the job's server: the next
  if (ever_welcomed_) reconnect_later(why, now);  // the real server may come back within join_timeout
  else lost(why);
}

void ClientMachine::on_frame(const proto::Frame& f, Clock::time_point now) {
  answered_ = true;
  if (!welcomed_ && proto::type_of(f) == MsgType::kNotHosting) return not_hosting(f, now);
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
                                          opts_.port, e.what()),
                              now);
      }
      // Without a token nothing can be proved: the refusal is all there is to say.
      if (key_.empty()) return failed_attempt(fmt::format("refused by the rendezvous server: {}", said), now);
    }
    if (key_.empty())
      return failed_attempt(fmt::format("the server at {}:{} sent {} before its welcome: not a mglaunch rendezvous "
                                        "server; closed the connection and ignored it",
                                        opts_.host, opts_.port, type_name(proto::type_of(f))),
                            now);
    return failed_attempt(
        fmt::format("the rendezvous server at {}:{} could not be authenticated: it sent {} before proving this job's "
                    "key{}; closed the connection and ignored it (not the server you meant, or one without this "
                    "job's key)",
                    opts_.host, opts_.port, type_name(proto::type_of(f)),
                    said.empty() ? std::string() : fmt::format(" (unproven: '{}')", proto::truncate_text(said, 200))),
        now);
  }
  try {
    switch (proto::type_of(f)) {
      case MsgType::kChallenge: {
        auto c = proto::from_frame<proto::Challenge>(f);
        if (challenged_ || welcomed_) return failed_attempt("the rendezvous server repeated its challenge", now);
        if (key_.empty())
          return failed_attempt("the rendezvous server wants a token: set --token-file or MGLAUNCH_RDZV_TOKEN", now);
        if (!auth::equal_ct(c.proof, auth::server_proof(key_, nonce_, c.nonce)))
          return failed_attempt(fmt::format("the rendezvous server at {}:{} cannot prove this job's key: wrong "
                                            "rendezvous token here or there, or not the server you meant",
                                            opts_.host, opts_.port),
                                now);
        challenged_ = true;
        heard(now);  // the server proved the job's key: it answers
        send(proto::to_wire(proto::Auth{auth::client_proof(key_, nonce_, c.nonce)}));
        session_ = auth::session_key(key_, nonce_, c.nonce);
        out_.push_back(cmd::SignSent{session_});  // the server's frames are signed from its Welcome on
        return;
      }
      case MsgType::kWelcome: {
        auto w = proto::from_frame<proto::Welcome>(f);
        if (welcomed_) return lost("the rendezvous server repeated its welcome");
        if (!key_.empty() && !challenged_)
          return failed_attempt(fmt::format("the rendezvous server at {}:{} asks for no token while this agent has "
                                            "one: refusing an unauthenticated server (give the daemon the same token)",
                                            opts_.host, opts_.port),
                                now);
        // (The Welcome itself carries no MAC: a forged host_agent can only make this node
        // give up sooner on a server that goes away, never obey one that proved nothing.)
        host_agent_ = w.host_agent;
        heard(now);
        welcome_epoch_ = w.epoch;
        welcome_last_round_ = w.last_round_epoch;
        if (seeking() && !seek_welcomed(w, now)) return;
        if (recall_ && !recall_welcomed(w, now)) return;
        if (takeover_ && !takeover_welcomed(w, now)) return;
        return on_welcome(now);
      }
      case MsgType::kHeartbeat:
        // The echo (last_frame_ moved), or the job's standby count changed.
        standbys_ = proto::from_frame<proto::Heartbeat>(f).standbys;
        // The server drops a member on its heartbeats, not on its own frames: the fence moves
        // to when the oldest heartbeat not echoed yet was sent (the server has heard this
        // node since), never to now (a one-way cut lets the server's frames through, #34).
        if (!beats_.empty()) {
          heard(beats_.front());
          beats_.pop_front();
        }
        return;
      case MsgType::kAssignment: {
        auto a = proto::from_frame<proto::Assignment>(f);
        if (!f.payload.contains("epoch") && !old_server_told_) {
          // A server before #34: no epoch, no voters, no majority. Said once.
          old_server_told_ = true;
          out_.push_back(cmd::Notice{fmt::format(
              "the rendezvous at {} is older than this agent (its assignment carries no epoch): no MGLAUNCH_EPOCH "
              "for the workers and no partition rules (voters, majority) there; upgrade it",
              host_port(opts_.host, opts_.port))});
        }
        if (!join_wanted_) {
          pending_ = std::move(a);  // the agent takes it once its workers stopped (rejoin())
          return;
        }
        return take(a, now);
      }
      case MsgType::kRestart: {
        auto r = proto::from_frame<proto::Restart>(f);
        current_.reset();
        pending_.reset();
        unanswered_failure_.reset();
        join_wanted_ = false;
        fenced_ = false;
        cancel(ClientTimer::kFence);  // the workers stop on this Restart
        restarts_seen_ = std::max(restarts_seen_, r.restart_count);
        out_.push_back(cmd::Tell{std::move(r)});
        return;
      }
      case MsgType::kAbort: {
        auto a = proto::from_frame<proto::Abort>(f);
        waiting_since_.reset();
        decided_ = true;
        over_ = over_ || a.final;
        cancel(ClientTimer::kFence);
        end_seek();
        out_.push_back(cmd::Tell{std::move(a)});
        return;
      }
      case MsgType::kDone:
        waiting_since_.reset();
        decided_ = over_ = true;
        cancel(ClientTimer::kFence);
        end_seek();
        out_.push_back(cmd::Tell{proto::Done{}});
        return;
      case MsgType::kStandby:
        // A decision: the wait for a place has no deadline (the job's end is told).
        take_standby(proto::from_frame<proto::Standby>(f));
        return;
      case MsgType::kError: {
        const std::string said = proto::from_frame<proto::Error>(f).message;
        // Its own server ended the job while this node looked elsewhere (no majority within
        // its join_timeout): that is the root cause, not a refusal.
        if (seek_ && seek_->at_home) return end_seek_no_majority(fmt::format("its own server: {}", said));
        return lost(fmt::format("refused by the rendezvous server: {}", said));
      }
      default:
        return lost(fmt::format("unexpected message type {} from the rendezvous server", f.type));
    }
  } catch (const proto::ProtocolError& e) {
    // Before the welcome nothing is proven: a malformed frame is a failed attempt, not the end.
    const std::string why = fmt::format("bad message from the rendezvous server: {}", e.what());
    if (welcomed_) lost(why);
    else failed_attempt(why, now);
  }
}

void ClientMachine::on_welcome(Clock::time_point now) {
  out_.push_back(cmd::Welcomed{challenged_ ? session_ : std::string()});
  if (takeover_) {
    cancel(ClientTimer::kTakeover);
    const std::string who = host_agent_.empty() ? std::string("a daemon") : host_agent_;
    if (!takeover_->fresh)  // (a fresh join said so: join_fresh())
      out_.push_back(cmd::Notice{
        takeover_->rejoining
            ? fmt::format("reached the job again: its rendezvous is hosted by {} at {}; joining its next round as a "
                          "new member",
                          who, host_port(opts_.host, opts_.port))
            : fmt::format("the rendezvous is now hosted by {} at {}:{}; joining the next round", who, opts_.host,
                          opts_.port)});
    takeover_.reset();
  }
  welcomed_ = ever_welcomed_ = true;
  in_outage_ = false;
  backoff_ = milliseconds(100);
  if (!joined_early_) send_join();
  // Reported while the server was away, or sent on a connection that closed before a
  // decision came: the rebuilt job must hear it.
  if (current_ && unanswered_failure_) send(proto::to_wire(*unanswered_failure_));
  // The join itself shows this node alive: the first heartbeat is due one interval later.
  cancel(ClientTimer::kHeartbeat);
  schedule_heartbeat(now);
}

void ClientMachine::send_join() {
  proto::Join j = opts_.join;
  if (current_) {
    out_.push_back(cmd::Notice{fmt::format("reconnected; re-registered round {}", current_->round)});
    j.resume_round = current_->round;
    j.resume_group_rank = current_->group_rank;
    j.resume_group_world_size = current_->group_world_size;
    j.resume_restart_count = current_->restart_count;
    j.resume_done = done_sent_;
  } else if (standby_) {
    out_.push_back(cmd::Notice{"reconnected; re-registered as a standby"});
    j.resume_standby = true;
  }
  // The voters of this node's epoch ride along to an agent's server (the job's last host was
  // one): a host whose last round is older counts a majority of them too (Job::adopt_voters,
  // review s36 H1); a daemon counts none. Before the welcome the server reads frames of at
  // most kHandshakeMaxFrame bytes: a list too long for that stays out.
  if (voters_epoch_ == j.epoch && !host_agent_.empty()) j.voters = voters_;
  proto::Wire w = proto::to_wire(j);
  constexpr std::size_t kHeaderRoom = 64;  // the frame's header (the signature comes after the welcome)
  if (!welcomed_ && !j.voters.empty() && w.payload_size() + kHeaderRoom > proto::kHandshakeMaxFrame) {
    j.voters.clear();
    w = proto::to_wire(j);
  }
  send(std::move(w));
}

void ClientMachine::schedule_heartbeat(Clock::time_point now) {
  arm(ClientTimer::kHeartbeat, now + milliseconds(opts_.join.keep_alive_ms));
}

void ClientMachine::watch(Clock::time_point now) {
  arm(ClientTimer::kWatchdog, now + milliseconds(opts_.join.keep_alive_ms));
}

void ClientMachine::forget_voters() {
  voters_.clear();
  prev_voters_.clear();
  voters_epoch_ = 0;
}

void ClientMachine::learn_voters(int epoch, const std::vector<std::string>& voters) {
  if (epoch != voters_epoch_) {
    prev_voters_ = std::move(voters_);
    voters_epoch_ = epoch;
  }
  voters_ = voters;
}

void ClientMachine::take_standby(proto::Standby m) {
  waiting_since_.reset();
  standby_ = true;
  restarts_seen_ = std::max(restarts_seen_, m.restart_count);
  standbys_ = std::max(standbys_, m.position);
  // Voters of an epoch older than the one this node knows (a node that took the job over
  // and missed the last round) are not learnt over the newer ones, within one run (review
  // s38 L3); another run's epochs count from 1 again. Nor are its nodes (review s40 L1: the
  // record's count and addresses of one epoch). A taker lists no round before its own closes.
  const bool other_run = !m.run.empty() && m.run != opts_.join.run;
  if (other_run) forget_voters();
  const bool newer = m.epoch >= voters_epoch_ || other_run;
  if (!standby_of_ || other_run || (!m.nodes.empty() && newer)) standby_of_ = m;
  opts_.join.epoch = other_run ? m.epoch : std::max(opts_.join.epoch, m.epoch);
  if (!m.run.empty()) opts_.join.run = m.run;  // (#37)
  if (!m.voters.empty() && newer) learn_voters(m.epoch, m.voters);
  cancel(ClientTimer::kFence);  // no workers of a round to stop
  end_seek();
  out_.push_back(cmd::Tell{std::move(m)});
}

void ClientMachine::take(const proto::Assignment& a, Clock::time_point now) {
  end_seek();  // a round opened: at home (with a majority now), or where this node went
  round_ = a.round;
  current_ = a;
  standby_ = false;
  standby_of_.reset();
  standbys_ = a.standbys;
  opts_.join.last_group_rank = -1;
  last_ = a;
  restarts_seen_ = std::max(restarts_seen_, a.restart_count);
  done_sent_ = false;
  unanswered_failure_.reset();
  waiting_since_.reset();
  fenced_ = false;
  const bool other_run = !a.run.empty() && a.run != opts_.join.run;
  if (other_run) forget_voters();
  opts_.join.epoch = other_run ? a.epoch : std::max(opts_.join.epoch, a.epoch);
  if (!a.run.empty()) opts_.join.run = a.run;  // the job's run, for a takeover and a daemon restart (#37)
  learn_voters(a.epoch, a.voters);
  if (voters_.size() == 2 && !host_agent_.empty() && !two_voters_told_) {
    two_voters_told_ = true;
    out_.push_back(cmd::Notice{
        "this job has two voters (two nodes, no standby): if a network partition cuts them apart, no side has a "
        "majority; the side of the rendezvous host goes on and the other stops its workers and waits (a third node "
        "or a standby rules a split out; docs/multinode.md, \"Network partitions\")"});
  }
  if (fence_after(opts_.join.keep_alive_ms, opts_.join.keep_alive_max_attempt).count() == 0 && !unfenced_told_) {
    unfenced_told_ = true;
    out_.push_back(cmd::Notice{fmt::format(
        "keep_alive_max_attempt={} (below {}): this node does not fence itself when cut off from the rendezvous (one "
        "late echo would stop it); a network partition may let its workers run beside their replacement until it "
        "hears the job's decision (docs/multinode.md, \"Network partitions\")",
        opts_.join.keep_alive_max_attempt, kMinFenceAttempts)});
  }
  // The server set this node's last heartbeat to when it closed the round: the fence starts
  // here, also for an assignment taken later (take_pending()).
  heard(now);
  out_.push_back(cmd::Tell{a});
}

void ClientMachine::reconnect_later(const std::string& why, Clock::time_point now, bool silent, bool reset) {
  if (closed_) return;
  if (seeking()) return next_seek_target(now);  // that server is no place for the job: the next
  end_seek();  // its own server lost before the seek began: the takeover's rules
  if (!host_agent_.empty()) return host_lost(why, now, silent, reset);
  // Connections that are made but fail (an unauthenticated server) count against the
  // outage's join_timeout like refused ones.
  if (in_outage_ && now >= deadline_)
    return lost(fmt::format("no authenticated rendezvous server at {}:{} within join_timeout ({} s): {}", opts_.host,
                            opts_.port, opts_.join.join_timeout_ms / 1000.0, why));
  cancel(ClientTimer::kHeartbeat);
  welcomed_ = connected_ = false;
  out_.push_back(cmd::Drop{});
  if (!in_outage_) {  // one join_timeout for the whole outage, however many tries
    in_outage_ = true;
    deadline_ = now + milliseconds(opts_.join.join_timeout_ms);
  }
  arm(ClientTimer::kRetry, now + backoff_);
  backoff_ = std::min(backoff_ * 2, milliseconds(2000));
  out_.push_back(
      cmd::Notice{fmt::format("lost the rendezvous server ({}); workers keep running, reconnecting", why)});
}

void ClientMachine::drop_connection() {
  cancel(ClientTimer::kHeartbeat);
  cancel(ClientTimer::kRetry);
  welcomed_ = connected_ = false;
  out_.push_back(cmd::Drop{});
}

void ClientMachine::host_lost(const std::string& why, Clock::time_point now, bool silent, bool reset) {
  // The job ended (Abort, Done) and its host closes: nothing was lost, nothing to take over.
  if (decided_) return drop_connection();
  if (takeover_) return next_candidate(why, now);  // a candidate's connection failed before its welcome
  if (job_hosts_.size() < kMaxHosts &&
      std::find(job_hosts_.begin(), job_hosts_.end(), std::pair{opts_.host, opts_.port}) == job_hosts_.end())
    job_hosts_.emplace_back(opts_.host, opts_.port);  // a host cut off may host on: a seek looks there
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
      !no.empty()) {
    over_ = true;  // (this node's record goes: the job cannot go on)
    return end_host_lost(lost + "; no survivor can take over: " + no);
  }
  drop_connection();
  Takeover t;
  t.candidates = std::move(candidates);
  t.deadline = now + milliseconds(opts_.join.keep_alive_ms) * opts_.join.keep_alive_max_attempt;
  t.lost = lost;
  t.lost_host = host_agent_;
  t.restart_count = restarts_seen_ = restarts_seen_ + 1;
  t.round = standby ? standby_of_->round : last_->round;
  t.self_rank = standby ? -1 : last_->group_rank;
  t.listed = static_cast<int>(standby ? standby_of_->nodes.size() : last_->nodes.size());
  t.epoch = opts_.join.epoch;
  t.voters = voters_;
  t.prev_voters = prev_voters_;
  t.host_closed = !silent;
  t.host_reset = !silent && reset;
  t.host_followed = job_hosts_.front() != std::pair{opts_.host, opts_.port};
  t.lost_addr = opts_.host;
  t.lost_port = opts_.port;
  t.rejoin_deadline = now + milliseconds(opts_.join.join_timeout_ms);
  cancel(ClientTimer::kFence);  // the round is over: the takeover's Restart stops the workers
  fenced_ = false;
  takeover_ = std::move(t);
  if (standby) {
    // No workers to stop, no restart to take: it re-registers as a standby with the new host.
    out_.push_back(cmd::Notice{lost + "; this standby follows the node that takes over"});
    waiting_since_ = now;
    return next_candidate({}, now);
  }
  opts_.join.last_group_rank = last_->group_rank;  // the new host keeps it (until the next assignment)
  // The round is over, as for any lost node: a restart, then a fresh join with whoever hosts.
  current_.reset();
  pending_.reset();
  unanswered_failure_.reset();
  done_sent_ = false;
  join_wanted_ = false;
  waiting_since_ = now;
  out_.push_back(cmd::Tell{proto::Restart{
      takeover_->restart_count, lost + "; the survivors go on with the lowest live node as rendezvous host"}});
  next_candidate({}, now);
}

void ClientMachine::next_candidate(const std::string& why_previous, Clock::time_point now) {
  Takeover& t = *takeover_;
  if (t.rejoining) {
    t.pass_unsure = t.pass_unsure || !t.positive;
    if (t.fresh) t.other_host.clear();  // not joined there either: not tried again unless it answers again
    t.positive = t.fresh = false;
    drop_connection();
    cancel(ClientTimer::kTakeover);
    return next_rejoin_target(now);
  }
  if (!why_previous.empty() && t.next > 0) {
    const auto& c = t.candidates[t.next - 1];
    t.tried += fmt::format("{}node {} at {}:{}: {}", t.tried.empty() ? "" : "; ", c.group_rank, opts_.host,
                           opts_.port, why_previous);
  }
  drop_connection();
  cancel(ClientTimer::kTakeover);
  if (t.next < t.candidates.size() && now < t.deadline) {
    const TakeoverCandidate c = t.candidates[t.next++];
    if (c.group_rank != t.self_rank) return connect_candidate(c.addr, c.port, now);
    // Every node below this one is gone or silent: this one hosts. The last round's
    // nodes but the lost host and those below this one are expected to re-join.
    const int survivors = std::max(1, t.listed - 1 - static_cast<int>(t.next - 1));
    t.asking = true;
    TakeoverSeed seed{t.round, t.restart_count, t.lost, t.lost_host, t.deadline, survivors, t.listed};
    seed.epoch = t.epoch;
    seed.voters = t.voters;
    seed.prev_voters = t.prev_voters;
    seed.host_closed = t.host_closed;
    seed.host_rank = t.self_rank;
    seed.run = opts_.join.run;
    out_.push_back(cmd::HostTakeover{std::move(seed)});
    return;
  }
  // The host's connection was reset and a candidate refused: the machines answer, yet no
  // node took over for this one. The job may well go on (the host only cut off from this
  // node: a REJECT firewall resets its connections and refuses its connects, #34); this
  // node's workers stopped on the takeover's Restart, and it waits to rejoin after the heal
  // instead of ending.
  // So too when the lost host was one this node followed (not the endpoint): it may have left
  // for the job's host elsewhere (Seeking), which only the job's former hosts lead to.
  if ((t.host_reset || t.host_followed) && t.refused_any && now < t.rejoin_deadline) {
    t.rejoining = true;
    out_.push_back(cmd::Notice{fmt::format(
        "{}; no survivor took over for this node ({}), yet a node refused its connection, so its machine answers: "
        "{}. Its workers stay stopped; it waits to rejoin the job, trying its last host, the nodes that could host "
        "and the job's former hosts in turn, until join_timeout ({} s)",
        t.lost, t.tried,
        t.host_reset ? "this node may be the one cut off (a firewall that resets)"
                     : "its host, which took the job over, may have left for the job's host elsewhere",
        opts_.join.join_timeout_ms / 1000.0)});
    return next_rejoin_target(now);
  }
  std::string reason = t.lost + "; no survivor could take over";
  if (!t.tried.empty()) reason += " (" + t.tried + ")";
  takeover_.reset();
  end_host_lost(reason);
}

void ClientMachine::connect_candidate(const std::string& host, int port, Clock::time_point now) {
  const Takeover& t = *takeover_;
  opts_.host = host;
  opts_.port = port;
  takeover_->refused = false;
  // One keep-alive interval for each node below this one (bounded by the whole search's, or
  // while waiting to rejoin by the rejoin's).
  arm(ClientTimer::kTakeover,
      std::min(t.rejoining ? t.rejoin_deadline : t.deadline, now + milliseconds(opts_.join.keep_alive_ms)));
  refused_ = 0;
  try_connect();
}

std::vector<std::pair<std::string, int>> ClientMachine::seek_targets(const std::string& home_host, int home_port) const {
  std::vector<std::pair<std::string, int>> out;
  auto add = [&](const std::string& h, int p) {
    const std::pair<std::string, int> t{h, p};
    if (p > 0 && !(h == home_host && p == home_port) && std::find(out.begin(), out.end(), t) == out.end())
      out.push_back(t);
  };
  for (const auto& [h, p] : job_hosts_) add(h, p);
  if (last_)
    for (const auto& c : takeover_candidates(*last_, {}, 0))
      if (c.group_rank != last_->group_rank) add(c.addr, c.port);
  return out;
}

void ClientMachine::end_seek() {
  if (!seek_) return;
  seek_.reset();
  cancel(ClientTimer::kTakeover);
}

void ClientMachine::next_seek_target(Clock::time_point now) {
  Seek& sk = *seek_;
  drop_connection();
  cancel(ClientTimer::kTakeover);
  if (now >= sk.deadline) return end_seek_no_majority(sk.tried);
  const std::size_t slot = sk.turn++ % (sk.targets.size() + 1);
  if (slot == 0) sk.tried.clear();  // what the last round of tries said
  sk.at_home = slot == sk.targets.size();
  opts_.host = sk.at_home ? sk.home_host : sk.targets[slot].first;
  opts_.port = sk.at_home ? sk.home_port : sk.targets[slot].second;
  // Home for a keep-alive interval past the last call, so that a round a minority host that
  // left for this one completes opens while this node is there.
  auto stay = milliseconds(opts_.join.keep_alive_ms);
  if (sk.at_home) stay += milliseconds(opts_.join.last_call_ms);
  arm(ClientTimer::kTakeover, std::min(sk.deadline, now + stay));
  refused_ = 0;
  try_connect();
}

void ClientMachine::end_seek_no_majority(const std::string& detail) {
  const std::string reason = fmt::format(
      "no majority of the job's voters on this side within join_timeout ({} s), and no other host of the job "
      "answered with a newer round{}",
      opts_.join.join_timeout_ms / 1000.0, detail.empty() ? std::string() : " (" + detail + ")");
  end_seek();
  end_host_lost(reason);
}

bool ClientMachine::seek_welcomed(const proto::Welcome& w, Clock::time_point now) {
  Seek& sk = *seek_;
  if (sk.at_home) {
    sk.home_epoch = std::max(sk.home_epoch, w.epoch);
    sk.home_last = std::max(sk.home_last, w.last_round_epoch);
    return true;  // joins its own round again
  }
  const std::string where = host_port(opts_.host, opts_.port);
  // A round newer than this node's runs there (a majority opened it), or no round runs
  // there either and that host leads a last round not older than home's: a newer one (it
  // opened or took over a round after this node's, e.g. a takeover on the majority's side
  // that lost a node since: this node is among that round's previous voters, which it
  // counts too), or the same one with its job's epoch below home's (it precedes this one:
  // the job's host before a cut precedes a node that took over, and of two that took the
  // same round over the lower group rank). Of two minority hosts exactly one leaves (by
  // last round, then by job's epoch). A host whose last round is older is no peer: one cut
  // off epochs ago counts its own stale voters, and this node's vote there could open a
  // second round of the job (review s36 H1).
  // Epochs compare only within one run (#34, "Runs"): a server of another run of the job id
  // (its Welcome names it) runs no newer round of this one (review s38 L4).
  const bool other_run = !w.run.empty() && !opts_.join.run.empty() && w.run != opts_.join.run;
  const bool newer = !other_run && w.round_epoch > opts_.join.epoch;
  const bool newer_last = w.last_round_epoch > sk.home_last;
  const bool same_last = w.last_round_epoch == sk.home_last;
  const bool precedes = !other_run && w.round_epoch == 0 && w.epoch > 0 && w.last_round_epoch > 0 &&
                        (newer_last || (same_last && w.epoch < sk.home_epoch));
  if (!newer && !precedes) {
    std::string said;
    if (other_run) said = fmt::format("serves another run of the job id ({}, this node's {})", w.run, opts_.join.run);
    else if (w.round_epoch > 0) said = fmt::format("runs epoch {}, not newer than {}", w.round_epoch, opts_.join.epoch);
    else if (!same_last)
      said = fmt::format("runs no round either, its last round's epoch {} is older than this node's {}",
                         w.last_round_epoch, sk.home_last);
    else said = fmt::format("runs no round either, epoch {} after this host's {}", w.epoch, sk.home_epoch);
    sk.tried += fmt::format("{}{}: {}", sk.tried.empty() ? "" : "; ", where, said);
    next_seek_target(now);
    return false;
  }
  const std::string why = fmt::format(
      "this node stops hosting the job: {} at {} {}; joining it there as a new member", w.host_agent.empty() ? "a daemon" : w.host_agent,
      where,
      newer ? fmt::format("runs a newer round (epoch {}, this node's {}), which a majority opened", w.round_epoch,
                          opts_.join.epoch)
      : newer_last
          ? fmt::format("hosts the job without a majority too and leads a newer last round (epoch {}, this node's {})",
                        w.last_round_epoch, sk.home_last)
          : fmt::format("hosts the job without a majority too and precedes this node (epoch {} below {})", w.epoch,
                        sk.home_epoch));
  out_.push_back(cmd::StopHosting{why});
  out_.push_back(cmd::Notice{why});
  opts_.join.vote_port = 0;  // a taker's is its server's port, closed now (review s41-b M1)
  end_seek();
  return true;
}

void ClientMachine::heard(Clock::time_point at) {
  if (closed_ || !current_ || takeover_ || fenced_ || decided_) return;
  const auto bound = fence_after(opts_.join.keep_alive_ms, opts_.join.keep_alive_max_attempt);
  if (bound.count() == 0) return;  // keep_alive_max_attempt < kMinFenceAttempts: no fence (take())
  // Never earlier than an arm already made (an echo of an older heartbeat after a connect).
  if (fence_at_ && at + bound <= *fence_at_) return;
  fence_at_ = at + bound;
  arm(ClientTimer::kFence, *fence_at_);
}

void ClientMachine::fence(Clock::time_point now) {
  fence_at_.reset();
  if (closed_ || !current_ || takeover_ || fenced_ || decided_) return;
  fenced_ = true;
  const auto bound = fence_after(opts_.join.keep_alive_ms, opts_.join.keep_alive_max_attempt);
  const auto drop = milliseconds(opts_.join.keep_alive_ms) * opts_.join.keep_alive_max_attempt;
  const std::string why = fmt::format(
      "this node fenced itself: no word from the rendezvous at {} for {} s (it may give this node's place away after "
      "{} s of silence); its workers stop so that a cut-off node never trains beside the majority; waiting to rejoin",
      host_port(opts_.host, opts_.port), bound.count() / 1000.0, drop.count() / 1000.0);
  // The round is over for this node: re-registered with the rendezvous, it reports the
  // fence as a node failure (the job restarts, or has gone on already and says so).
  proto::WorkerFailed f = fence_failure(current_->round, opts_.join,
                                        fmt::format("no word from the rendezvous for {} s", bound.count() / 1000.0));
  proto::truncate_to_limits(f);
  // The server may still hear this node (a one-way cut): it hears the fence now.
  if (connected_ && welcomed_) send(proto::to_wire(f));
  unanswered_failure_ = std::move(f);
  join_wanted_ = false;
  pending_.reset();
  waiting_since_ = now;
  out_.push_back(cmd::Tell{proto::Restart{restarts_seen_, why}});
}

void ClientMachine::end_host_lost(const std::string& reason) {
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
  out_.push_back(cmd::Tell{std::move(a)});
}

void ClientMachine::lost(const std::string& why, bool unanswered) {
  if (!shut(/*flush=*/false)) return;
  out_.push_back(cmd::Lost{why, unanswered, opts_.host, opts_.port});
}

bool ClientMachine::shut(bool flush) {
  if (closed_) return false;
  closed_ = true;
  takeover_.reset();
  if (!flush) connected_ = false;
  out_.push_back(cmd::Shut{flush});
  return true;
}

}  // namespace mg::rdzv
