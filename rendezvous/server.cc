#include "rendezvous/server.h"

#include <malloc.h>
#include <sys/resource.h>

#include <set>
#include <utility>

#include <fmt/format.h>

#include "proto/text.h"
#include "rendezvous/auth.h"
#include "rendezvous/http.h"
#include "rendezvous/lookup.h"

namespace mg::rdzv {

namespace asio = boost::asio;
using proto::MsgType;

namespace {
constexpr std::size_t kReservedDescriptors = 64;  // logs, the acceptor, the agent's own pipes
constexpr std::size_t kMaxTrackedAddresses = 4096;
// Challenges one address may have unanswered at once; its further hellos wait their turn.
// How many it may have at all is rate_'s (ChallengeRate: 4, then one per 5 s, a correct
// proof given back), so parallel connections check no more guesses than one would.
constexpr std::size_t kMaxChallengesPerAddress = 4;
constexpr auto kForgetFailures = std::chrono::minutes(1);  // an address's failure count, for the log
constexpr std::size_t kAcceptBatch = 4096;  // connections taken per wake-up at most (a full backlog)

// A journal summary's state of a job that ended: done, failed, or forgotten (job_of()).
bool ended_state(const std::string& state) { return state == "done" || state == "failed" || state == "forgotten"; }
}  // namespace

struct Server::Session {
  SessionId id = 0;
  std::shared_ptr<FramedConnection> conn;
  std::string address;  // peer address, for the per-address cap
  enum class Phase { kHello, kAuth, kReady } phase = Phase::kHello;
  Clock::time_point since;  // connected, or welcomed
  std::string client_nonce, server_nonce, key;
  std::string job;  // from Hello: the only job this session may touch
  bool joined = false;
  bool challenged = false;  // its challenge is out and unanswered (it holds one of its address's turns)
  std::string closing_why;  // why this server closed it (a deadline, a refusal), for the job's event
  std::chrono::milliseconds idle_limit{0};  // from the job's keep-alive, once joined
  // An older client's Hello (no Hello::reads_not_hosting) to a server that does not host
  // yet, and the Join that rode with it: read again once it hosts (resume_held()). Kept as
  // bytes (the Hello's validated fields, the Join as received: 4 KiB at most), charged to
  // the memory budget until then, not as parsed trees (review s40 L2).
  std::vector<std::vector<std::uint8_t>> held;
  std::size_t held_bytes = 0;
  std::shared_ptr<MemoryBudget> budget;  // held_bytes' (set when it holds)
  ~Session() {
    if (budget) budget->release(held_bytes);
  }
};

Server::Server(asio::io_context& io, ServerOptions opts)
    : io_(io), opts_(std::move(opts)), acceptor_(io), ticker_(io), accept_pause_(io) {
  boost::system::error_code ec;
  asio::ip::address addr;
  if (opts_.adopt_fd >= 0) {
    acceptor_.assign(asio::ip::tcp::v4(), opts_.adopt_fd, ec);
    if (ec) ::close(opts_.adopt_fd);
    if (!ec) {
      auto bound = acceptor_.local_endpoint(ec);
      addr = bound.address();
      opts_.port = bound.port();
    }
  } else {
    addr = asio::ip::make_address(opts_.host, ec);
    if (ec) {  // a name: looked up within a bound (rendezvous/lookup.h)
      const Addresses found = lookup_within(opts_.host, 0);
      if (found.found.empty())
        throw std::runtime_error(fmt::format("cannot resolve listen address '{}': {}", opts_.host, found.error));
      addr = found.found.front().address();
      ec.clear();
    }
    asio::ip::tcp::endpoint ep(addr, static_cast<unsigned short>(opts_.port));
    acceptor_.open(ep.protocol(), ec);
    if (!ec) acceptor_.set_option(asio::ip::tcp::acceptor::reuse_address(true), ec);
    if (!ec) acceptor_.bind(ep, ec);
  }
  if (!ec) acceptor_.listen(asio::socket_base::max_listen_connections, ec);
  if (!ec) acceptor_.non_blocking(true, ec);  // accept() below drains the backlog
  if (ec) throw std::runtime_error(fmt::format("cannot listen on {}:{}: {}", opts_.host, opts_.port, ec.message()));
  port_ = acceptor_.local_endpoint().port();
  // Connections must run out before descriptors do, or accept() fails with EMFILE.
  rlimit rl{};
  auto usable_under = [](rlim_t soft) {
    return soft > kReservedDescriptors * 2 ? static_cast<std::size_t>(soft) - kReservedDescriptors : std::size_t{16};
  };
  if (::getrlimit(RLIMIT_NOFILE, &rl) == 0) {
    // Raised only when the connections asked for (all the limit allows: 0) do not fit: an
    // agent that hosts the rendezvous gives its server a share that fits its own budget.
    const bool short_of =
        opts_.max_connections == 0 || (rl.rlim_cur != RLIM_INFINITY && opts_.max_connections > usable_under(rl.rlim_cur));
    if (short_of && rl.rlim_cur < rl.rlim_max) {
      rl.rlim_cur = rl.rlim_max;
      ::setrlimit(RLIMIT_NOFILE, &rl);
      ::getrlimit(RLIMIT_NOFILE, &rl);
    }
    const std::size_t usable = usable_under(rl.rlim_cur);
    if (opts_.max_connections == 0) {
      opts_.max_connections = rl.rlim_cur == RLIM_INFINITY ? 1 << 20 : usable;
    } else if (rl.rlim_cur != RLIM_INFINITY && opts_.max_connections > usable) {
      log(fmt::format("max connections lowered from {} to {}: the descriptor limit is {} (raise it with ulimit -n)",
                      opts_.max_connections, usable, rl.rlim_cur));
      opts_.max_connections = usable;
    }
  }
  if (opts_.max_connections == 0) opts_.max_connections = 1024;  // getrlimit failed
  if (!opts_.not_hosting) warn_if_open();  // (a takeover socket: once it hosts)
  budget_->limit = opts_.max_memory;
  if (opts_.journal) {
    // The status page's events go on from where the journal left them.
    for (const auto& e : opts_.journal->last_events(1000))
      events_.push_back({next_event_++, e.value("unix_ms", std::int64_t{0}), e.value("text", std::string()),
                         e.value("event", std::string()), e.value("job", std::string())});
  }
  accept();
  tick();
}

Server::~Server() { stop(); }

void Server::warn_if_open() const {
  boost::system::error_code ec;
  const auto at = acceptor_.local_endpoint(ec);
  if (opts_.token.empty() && opts_.job_tokens.empty() && !ec && !at.address().is_loopback())
    log(fmt::format("warning: listening on {} without a token: anyone who can reach it can join and disturb jobs; "
                    "give it a token (--token-file or MGLAUNCH_RDZV_TOKEN)", address()));
}

void Server::host() {
  if (!std::exchange(opts_.not_hosting, false)) return;
  warn_if_open();
  resume_held();
}

void Server::answer_older_hellos() {
  answer_older_ = true;
  // (A copy: an answer whose send fails at once closes its session, erased from sessions_
  // under the loop; review s41-d L1.)
  std::vector<std::shared_ptr<Session>> held;
  for (const auto& [id, s] : sessions_)
    if (!s->held.empty()) held.push_back(s);
  for (const auto& s : held) {
    budget_->release(std::exchange(s->held_bytes, 0));
    s->held.clear();
    if (sessions_.contains(s->id)) answer_not_hosting(*s);
  }
}

void Server::resume_held() {
  std::vector<std::shared_ptr<Session>> held;
  for (const auto& [id, s] : sessions_)
    if (!s->held.empty()) held.push_back(s);
  for (const auto& s : held) {
    budget_->release(std::exchange(s->held_bytes, 0));
    for (const auto& bytes : std::exchange(s->held, {})) {
      if (!sessions_.contains(s->id) || !s->conn->open() || !s->closing_why.empty()) break;  // (refused)
      s->since = Clock::now();  // its handshake starts now: the hold must not eat its deadline (review s40 L1)
      auto r = proto::decode(bytes, proto::kHandshakeMaxFrame);
      if (r.status != proto::DecodeResult::Status::kOk) {  // (it was encoded here: not expected)
        refuse(*s, fmt::format("a held frame could not be read again: {}", r.error));
        break;
      }
      on_frame(s, r.frame);
    }
  }
}

void Server::hold(Session& s, const proto::Frame& f) {
  std::vector<std::uint8_t> bytes;
  try {
    bytes = proto::encode(f, proto::kHandshakeMaxFrame);
  } catch (const std::length_error&) {  // (a frame of 4 KiB whose numbers encode wider)
    return refuse(s, fmt::format("a frame of more than {} bytes before this rendezvous host's answer",
                                 proto::kHandshakeMaxFrame));
  }
  if (!budget_->charge(bytes.size()))
    return refuse(s, fmt::format("the rendezvous server is at its memory limit ({} MiB) and holds no more hellos "
                                 "until it hosts; retry later", opts_.max_memory >> 20));
  s.budget = budget_;
  s.held_bytes += bytes.size();
  s.held.push_back(std::move(bytes));
}

void Server::answer_not_hosting(Session& s) {
  // One small frame and the close (a lingering close: the client reads it before the end).
  // The proof is made with this job's key, whatever job the Hello named: a client of
  // another job cannot check it, and learns only that this node is no host of its own.
  std::string key;
  if (!opts_.token.empty()) key = auth::job_key(opts_.token, opts_.only_job);
  else if (auto it = opts_.job_tokens.find(opts_.only_job); it != opts_.job_tokens.end()) key = it->second;
  proto::NotHosting n{opts_.only_job, not_hosting_run_, opts_.host_agent,
                      key.empty() ? std::string()
                                  : auth::not_hosting_proof(key, s.client_nonce, not_hosting_run_, recalling_epoch_)};
  n.recalling = recalling_epoch_ >= 0;
  n.epoch = std::max(0, recalling_epoch_);
  s.conn->send(proto::to_frame(n));
  s.conn->close();
  s.closing_why = "answered: not hosting";  // (a Join that rode with an older Hello is not read)
}

void Server::take_over(const std::string& job_id, const TakeoverSeed& seed) {
  Job& job = job_of(job_id);
  job.take_over(seed, Clock::now());
  drive(job, {});
  host();  // (after the job: a Hello held until now is welcomed into it)
}

Job& Server::job_of(const std::string& job_id) {
  auto it = jobs_.find(job_id);
  if (it != jobs_.end()) return it->second;
  ++jobs_created_;
  // The run is minted here, once per Job (#37): a takeover's seed and a rebuild's joins
  // replace it with the run the job ran. A daemon keeps a job's run across its restart: the
  // --state-dir journal's, for a job it holds that has not ended; else the run is open
  // (Job::open_run(): the first round takes its nodes', review s38 M1), at the journal's
  // epoch. An id used again after its job ended (done, failed, forgotten) is a new run; a
  // forgotten run's re-registering agents still rebuild it (a long outage or a restart the
  // agents rode out: Job::seed_forgotten(), review s39 M2).
  // Its agents that re-register the run of a job that ended (done, failed) hear that end
  // (the daemon died before they did: Job::seed_ended(), review s38-late L1).
  std::string run = new_run();
  bool known = false;
  int epoch = 0;
  std::string ended, forgotten;
  std::optional<proto::Abort> abort;
  if (opts_.journal)
    if (const auto h = opts_.journal->jobs().find(job_id); h != opts_.journal->jobs().end()) {
      const auto state = h->second.summary.value("state", "");
      known = ended_state(state);
      const auto was = h->second.summary.value("run", "");
      const bool valid = !was.empty() && proto::run_problem(was).empty();
      if (!known && valid) {
        run = was;
        known = true;
        epoch = h->second.summary.value("epoch", 0);
      } else if (valid && state == "forgotten") {
        forgotten = was;  // its re-registering agents rebuild it (review s39 M2)
      } else if (valid) {
        ended = was;
        if (state == "failed") abort = journaled_abort(h->second);
      }
      // A new run created since the last one ended (a requeue's first join), before its first
      // round: that ended run's stragglers still hear its end (review s39 L1).
      const auto before = h->second.summary.value("ended_run", "");
      if (ended.empty() && !before.empty() && before != was && proto::run_problem(before).empty()) {
        ended = before;
        if (h->second.summary.value("ended_state", "") == "failed") abort = journaled_abort(h->second);
      }
    }
  Job& job = jobs_.try_emplace(job_id, job_id, !opts_.host_agent.empty(), std::move(run)).first->second;
  job.set_host_agent_id(opts_.host_agent_id);
  if (!known) job.open_run();
  if (!ended.empty()) job.seed_ended(std::move(ended), std::move(abort));
  if (!forgotten.empty()) job.seed_forgotten(std::move(forgotten));
  job.seed_epoch(epoch);  // its next round is one on (review s38-late H1)
  return job;
}

bool Server::ended_in_journal(const std::string& job_id) const {
  if (!opts_.journal) return false;
  const auto h = opts_.journal->jobs().find(job_id);
  if (h == opts_.journal->jobs().end()) return false;
  return ended_state(h->second.summary.value("state", ""));
}

proto::Abort Server::journaled_abort(const JobHistory& h) {
  proto::Abort a;
  a.reason = h.summary.value("root_cause", "");
  a.root_cause.rank = -1;
  a.root_cause.message = a.reason;
  for (auto e = h.events.rbegin(); e != h.events.rend(); ++e) {
    if (!e->is_object() || e->value("event", "") != "failed") continue;
    try {
      a.reason = a.root_cause.message = e->value("why", a.reason);
      a.root_cause.round = e->value("round", 0);
      a.root_cause.host = e->value("host", "");
      if (const auto r = e->find("rank"); r != e->end() && r->is_number_integer()) a.root_cause.rank = r->get<int>();
      a.root_cause.exit_code = e->value("exit_code", 1);
    } catch (const nlohmann::json::exception&) {  // an edited journal: what was read so far
    }
    break;
  }
  a.root_cause.host = proto::printable(a.root_cause.host);
  a.root_cause.message = proto::printable(a.root_cause.message);
  proto::truncate_to_limits(a.root_cause);
  a.reason = proto::truncate_text(proto::printable(a.reason), proto::kMaxTextBytes);
  return a;
}

std::string Server::address() const { return fmt::format("{}:{}", opts_.host, port_); }

void Server::log(const std::string& raw, nlohmann::json fields) const {
  // Peer strings are checked on receipt (validate()); this also covers whatever else a line
  // quotes (an exception's text), so no line can break a JSON writer or a terminal.
  const std::string line = proto::printable(raw);
  const auto unix_ms =
      std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch()).count();
  if (!fields.is_object()) fields = {{"event", "log"}};
  const auto job = fields.find("job");
  events_.push_back({next_event_++, unix_ms, line, fields["event"].get<std::string>(),
                     job != fields.end() && job->is_string() ? job->get<std::string>() : std::string()});
  if (events_.size() > 1000) events_.pop_front();
  if (opts_.log_json) {
    fields["text"] = line;
    opts_.log_json(fields);
  } else if (opts_.log) {
    opts_.log(line);
  }
}

void Server::drive(Job& job, const Actions& actions) {
  // The events are journaled before the frames go out (write-ahead): a node that heard a
  // decision (Done above all) finds it in a restarted daemon's --state-dir (review s38-late L1).
  // A call's events are appended, then flushed once (review s39 L3: one tick that drops K
  // nodes made K fdatasyncs before its frames).
  for (const auto& e : job.take_events()) {
    if (opts_.on_event) opts_.on_event(e);
    auto fields = json_of(e);
    const std::string text = proto::printable(text_of(e));
    log(text, fields);
    if (!opts_.journal) continue;
    fields["text"] = text;
    fields["unix_ms"] = events_.back().unix_ms;
    opts_.journal->record(fields, /*sync=*/false);
  }
  if (opts_.journal) {
    opts_.journal->sync();
    if (opts_.journal->last_error != journal_error_) {
      journal_error_ = opts_.journal->last_error;
      if (!journal_error_.empty()) log(fmt::format("warning: --state-dir: {}; the job history is incomplete", journal_error_));
    }
  }
  if (opts_.before_send && !actions.empty()) opts_.before_send(actions, job.host_agent_session());
  apply(actions);
}

nlohmann::json Server::jobs_json() const {
  const auto now = Clock::now();
  nlohmann::json jobs = nlohmann::json::array();
  for (const auto& [id, job] : jobs_) jobs.push_back(job.describe(now));
  if (opts_.journal)
    for (const auto& [id, h] : opts_.journal->jobs())
      if (!jobs_.contains(id) && h.summary.is_object()) {
        jobs.push_back(h.summary);
        jobs.back()["journal"] = true;
      }
  return jobs;
}

nlohmann::json Server::history_json(const std::string& job) const {
  if (!opts_.journal) return nullptr;
  auto it = opts_.journal->jobs().find(job);
  if (it == opts_.journal->jobs().end()) return nullptr;
  return nlohmann::json(it->second.events);
}

nlohmann::json Server::events_json(std::uint64_t since) const {
  nlohmann::json out = nlohmann::json::array();
  for (const auto& e : events_)
    if (e.seq > since) {
      out.push_back({{"seq", e.seq}, {"unix_ms", e.unix_ms}, {"text", e.text}, {"event", e.kind}});
      if (!e.job.empty()) out.back()["job"] = e.job;
    }
  return out;
}

void Server::stop(bool flush) {
  if (stopped_) return;
  stopped_ = true;
  boost::system::error_code ec;
  acceptor_.close(ec);
  ticker_.cancel();
  accept_pause_.cancel();
  for (auto& [address, gate] : gates_)
    if (gate.timer) gate.timer->cancel();
  auto sessions = std::move(sessions_);
  for (auto& [id, s] : sessions) s->conn->close(!flush);
}

bool Server::admit(const std::string& address) {
  if (sessions_.size() >= opts_.max_connections) {
    refused("connections");
    log(fmt::format("refused a connection from {}: {} connections open (max)", address, sessions_.size()));
    return false;
  }
  if (auto it = per_address_.find(address); it != per_address_.end() && it->second >= opts_.max_connections_per_address) {
    refused("per_address");
    log(fmt::format("refused a connection from {}: it has {} connections open (max per address)", address,
                    opts_.max_connections_per_address));
    return false;
  }
  if (budget_->used >= budget_->limit) {
    refused("memory");
    log(fmt::format("refused a connection from {}: the memory limit of {} MiB is reached", address,
                    opts_.max_memory >> 20));
    return false;
  }
  return true;
}

void Server::accept() {
  acceptor_.async_accept(accept_peer_, [this](boost::system::error_code ec, asio::ip::tcp::socket socket) {
    if (stopped_) return;
    if (!ec) {
      if (auto line = pauses_.accepted()) log(*line);
      admit_socket(std::move(socket), accept_peer_);
      // Take every connection already waiting, not one per turn of the event loop: under a
      // burst (10,000 agents at once) the listen backlog fills while the loop serves other
      // sockets, and the kernel then drops connection requests, which the clients resend
      // only a second later. The acceptor is non-blocking: this stops at "would block".
      for (std::size_t i = 0; i < kAcceptBatch && !stopped_; ++i) {
        asio::ip::tcp::endpoint peer;
        asio::ip::tcp::socket next = acceptor_.accept(peer, ec);
        if (ec) break;
        admit_socket(std::move(next), peer);
      }
      if (ec == asio::error::would_block || ec == asio::error::try_again) ec = {};
    }
    if (ec == asio::error::no_descriptors || ec == asio::error::no_buffer_space || ec == asio::error::no_memory) {
      // Out of descriptors: pause instead of spinning on the pending connection (one log
      // line when the episode starts, one when it ends).
      refused("descriptors");
      if (auto line = pauses_.paused(ec.message())) log(*line);
      proto::pause_accepts(accept_pause_, [this] {
        if (!stopped_) accept();
      });
      return;
    }
    if (stopped_) return;
    accept();
  });
}

void Server::admit_socket(asio::ip::tcp::socket socket, const asio::ip::tcp::endpoint& peer) {
  boost::system::error_code ignored;
  const std::string address = peer.address().to_string();
  if (!admit(address)) {
    socket.close(ignored);
    return;
  }
  ++accepted_;
  auto s = std::make_shared<Session>();
  s->id = next_id_++;
  s->address = address;
  s->since = Clock::now();
  ++per_address_[address];
  s->conn = std::make_shared<FramedConnection>(std::move(socket), proto::kHandshakeMaxFrame, budget_, traffic_, peer);
  sessions_[s->id] = s;
  // Captures of 16 bytes fit in std::function without an allocation of their own.
  const SessionId id = s->id;
  s->conn->start(
      [this, id](const proto::Frame& f) {
        if (auto it = sessions_.find(id); it != sessions_.end()) on_frame(std::shared_ptr<Session>(it->second), f);
      },
      [this, id](const std::string& why) {
        if (auto it = sessions_.find(id); it != sessions_.end()) on_close(std::shared_ptr<Session>(it->second), why);
      });
}

void Server::auth_failed(const std::string& address) {
  if (failures_.size() >= kMaxTrackedAddresses && !failures_.contains(address)) {
    // Forget the address that failed longest ago.
    auto oldest = std::min_element(failures_.begin(), failures_.end(), [](const auto& a, const auto& b) {
      return a.second.last < b.second.last;
    });
    failures_.erase(oldest);
  }
  ++auth_failures_;
  auto& f = failures_[address];
  ++f.count;
  f.last = Clock::now();
  // The wrong proof kept its challenge's token (rate_): guessing stays slow however many
  // connections the address opens, and an agent sharing the address is delayed, not refused.
  if (f.count >= 3)
    log(fmt::format("{}: {} authentication failures; its challenges are rationed to one every {} s", address, f.count,
                    std::chrono::duration_cast<std::chrono::seconds>(rate_.options().refill).count()));
}

void Server::next_challenges(const std::string& address) {
  auto g = gates_.find(address);
  if (g == gates_.end()) return;
  AuthGate& gate = g->second;
  if (gate.busy) return;  // a send below closed a session, which came back here: the loop goes on
  gate.busy = true;
  while (gate.outstanding < kMaxChallengesPerAddress && !gate.waiting.empty()) {
    auto s = gate.waiting.front().lock();
    if (!s || !sessions_.contains(s->id) || s->phase != Session::Phase::kAuth || s->challenged) {
      gate.waiting.pop_front();
      continue;
    }
    // No token left (wrong proofs took them): the queue waits for the next one, in order of
    // arrival, whatever the address's number of connections.
    if (const auto now = Clock::now(); !rate_.take(address, now)) {
      if (!gate.timer) {
        gate.timer = std::make_unique<asio::steady_timer>(io_, rate_.next(address, now));
        gate.timer->async_wait([this, address](boost::system::error_code ec) {
          if (ec || stopped_) return;
          if (auto g = gates_.find(address); g != gates_.end()) g->second.timer.reset();
          next_challenges(address);
        });
      }
      break;
    }
    gate.waiting.pop_front();
    s->challenged = true;
    ++gate.outstanding;
    s->conn->send(proto::to_frame(
        proto::Challenge{s->server_nonce, auth::server_proof(s->key, s->client_nonce, s->server_nonce)}));
  }
  gate.busy = false;
  if (gate.outstanding == 0 && gate.waiting.empty() && !gate.timer) gates_.erase(g);
}

void Server::answered(Session& s) {
  if (!s.challenged) return;
  s.challenged = false;
  if (auto g = gates_.find(s.address); g != gates_.end() && g->second.outstanding > 0) --g->second.outstanding;
  next_challenges(s.address);
}

std::string Server::no_proof(const Session& s, const proto::Frame& join) const {
  std::string who = fmt::format("agent at {}", s.conn->peer());
  try {  // the join it sent names the node (its text is checked by validate())
    const auto j = proto::from_frame<proto::Join>(join);
    who = fmt::format("agent {} ({}, connected from {})", j.host, j.addr, s.conn->peer());
  } catch (const proto::ProtocolError&) {
  }
  return fmt::format("{} sent no proof for job '{}': this {} requires a token; give the agent the same one "
                     "(MGLAUNCH_RDZV_TOKEN, or the job's key from --job-token as MGLAUNCH_RDZV_JOB_TOKEN)",
                     who, s.job, opts_.host_agent.empty() ? "daemon" : "rendezvous host");
}

void Server::handshake(const std::shared_ptr<Session>& s, const proto::Frame& f) {
  auto welcome = [&] {
    s->phase = Session::Phase::kReady;
    s->since = Clock::now();
    // The handshake's nonces and key are spent: an idle session holds none of them.
    std::string().swap(s->client_nonce);
    std::string().swap(s->server_nonce);
    proto::Welcome w{"mglaunch-rdzv", opts_.host_agent};
    if (const auto job = jobs_.find(s->job); job != jobs_.end()) {  // #34: for a host that looks for the job
      w.round_epoch = job->second.running_epoch();
      w.epoch = job->second.epoch();
      w.last_round_epoch = job->second.last_round_epoch();
      w.run = job->second.run();  // for an agent restarted with a record of the job (#34 H1)
    }
    s->conn->send(proto::to_frame(w));
    s->conn->set_max_frame(opts_.max_frame);
  };
  if (s->phase == Session::Phase::kHello) {
    auto hello = proto::from_frame<proto::Hello>(f);
    s->job = hello.job_id;
    s->client_nonce = hello.nonce;
    if (opts_.not_hosting) {
      if (hello.reads_not_hosting || answer_older_) return answer_not_hosting(*s);
      // An older client reads NotHosting as a failed try and passes this node over, where
      // its refused connect was waited for (review s39-listen M3; a reset would be passed
      // over too): its Hello waits unanswered until this server hosts, or until the
      // handshake timeout from its connect (then closed), as a silent node (its own
      // search's interval bounds the wait too); served, it has a whole handshake timeout.
      return hold(*s, proto::to_frame(hello));  // (its fields only: no key the Hello does not define)
    }
    if (!opts_.only_job.empty() && s->job != opts_.only_job)
      throw proto::ProtocolError(fmt::format("this rendezvous is hosted by an agent of another job and serves only "
                                             "that job; is --rdzv_endpoint right, and is the mglaunch-rdzv daemon up?"));
    if (opts_.token.empty() && opts_.job_tokens.empty()) return welcome();
    s->phase = Session::Phase::kAuth;
    if (!opts_.token.empty()) {
      s->key = auth::job_key(opts_.token, s->job);
    } else if (auto it = opts_.job_tokens.find(s->job); it != opts_.job_tokens.end()) {
      s->key = it->second;
    } else {
      s->key = auth::random_hex(32);  // a job not served here: the proofs fail, nothing is revealed
    }
    s->server_nonce = auth::random_hex(32);
    gates_[s->address].waiting.push_back(s);
    return next_challenges(s->address);
  }
  if (proto::type_of(f) == MsgType::kJoin)  // the agent holds no token: it joins without a proof
    return refuse(*s, no_proof(*s, f), /*name_peer=*/false);
  auto a = proto::from_frame<proto::Auth>(f);
  // An Auth before its challenge cannot be a guess (the client never saw the nonce): the
  // session is closed, and the address's back-off is not extended, or one host could keep
  // every agent sharing its address from ever getting a challenge.
  if (!s->challenged) throw proto::ProtocolError("an Auth before the server's challenge");
  answered(*s);
  if (!auth::equal_ct(a.mac, auth::client_proof(s->key, s->client_nonce, s->server_nonce))) {
    auth_failed(s->address);
    throw proto::ProtocolError(fmt::format("authentication failed for job '{}': wrong rendezvous token", s->job));
  }
  failures_.erase(s->address);
  rate_.give_back(s->address, Clock::now());
  const std::string session = auth::session_key(s->key, s->client_nonce, s->server_nonce);
  std::string().swap(s->key);
  welcome();
  s->conn->sign_sent(session, 's');
  s->conn->verify_received(session, 'c');
}

void Server::refuse(Session& s, const std::string& why, bool name_peer) {
  ++refusals_;
  s.closing_why = why;
  log(name_peer ? fmt::format("{}: {}", s.conn->peer(), why) : why,
      s.job.empty() ? nlohmann::json(nullptr) : nlohmann::json{{"event", "log"}, {"job", s.job}});
  s.conn->send(proto::to_frame(proto::Error{proto::truncate_text(proto::printable(why), proto::kMaxTextBytes)}));
  s.conn->close();
}

void Server::on_frame(const std::shared_ptr<Session>& s, const proto::Frame& f) {
  // Refused (or closed for a deadline): the frames that came with the refused one are not
  // handled (a graceful close lingers, and its buffer is still decoded): no second refusal,
  // Error frame or log line for one peer (review s41-a L5).
  if (!s->closing_why.empty()) return;
  auto refuse = [&](const std::string& why) { this->refuse(*s, why); };
  try {
    if (!s->held.empty()) {  // an older client's, while this server does not host yet
      if (s->held.size() > 1) return refuse("a third frame before this rendezvous host's answer");
      if (proto::type_of(f) != MsgType::kJoin)  // (replayed, it would be refused: before the Welcome, or no Join)
        return refuse(fmt::format("message type {} before this rendezvous host's answer", f.type));
      return hold(*s, f);  // (the Join that rides with the Hello without a token)
    }
    if (s->phase != Session::Phase::kReady) return handshake(s, f);
    const auto now = Clock::now();
    if (proto::type_of(f) == MsgType::kJoin) {
      auto join = proto::from_frame<proto::Join>(f);
      if (join.job_id != s->job)
        return refuse(fmt::format("this connection was opened for job '{}', not '{}'", s->job, join.job_id));
      if (join.max_nodes > opts_.max_nodes_per_job)
        return refuse(fmt::format("--nnodes max {} exceeds this daemon's limit of {} nodes per job", join.max_nodes,
                                  opts_.max_nodes_per_job));
      if (budget_->used >= budget_->limit)
        return refuse(fmt::format("the rendezvous daemon is at its memory limit ({} MiB); retry later or raise "
                                  "--max-memory", opts_.max_memory >> 20));
      // An agent before #34 sends no epoch: it never fences itself when cut off, so the
      // partition rules do not hold for its node. Said once per agent.
      if (!f.payload.contains("epoch") && old_peers_.size() < kMaxOldPeersNamed &&
          old_peers_.emplace(join.job_id, join.agent_id).second)
        log(fmt::format("job '{}': agent {} on {} ({}) is older than this rendezvous (its join carries no epoch): it "
                        "does not fence itself when cut off, so a network partition may split the job at that node; "
                        "upgrade its mglaunch",
                        join.job_id, join.agent_id, join.host, join.addr),
            nlohmann::json{{"event", "log"}, {"job", join.job_id}});
      Job& job = job_of(join.job_id);
      s->joined = true;
      s->idle_limit = std::max<std::chrono::milliseconds>(
          opts_.frame_timeout, std::chrono::milliseconds(join.keep_alive_ms) * (join.keep_alive_max_attempt + 1));
      drive(job, job.join(s->id, join, now));
      return;
    }
    auto job = jobs_.find(s->job);
    if (!s->joined || job == jobs_.end()) return refuse("message before join");
    switch (proto::type_of(f)) {
      case MsgType::kHeartbeat: {
        auto hb = proto::from_frame<proto::Heartbeat>(f);
        drive(job->second, job->second.heartbeat(s->id, now));
        // The echo lets the client see a hung server; it carries the job's standby count.
        s->conn->send(proto::to_wire(proto::Heartbeat{hb.round, static_cast<int>(job->second.standbys())}));
        break;
      }
      case MsgType::kWorkerFailed: {
        auto wf = proto::from_frame<proto::WorkerFailed>(f);
        drive(job->second, job->second.worker_failed(s->id, wf, now));
        break;
      }
      case MsgType::kNodeDone:
        drive(job->second, job->second.node_done(s->id, proto::from_frame<proto::NodeDone>(f).round, now));
        break;
      default:
        refuse(fmt::format("unexpected message type {}", f.type));
    }
  } catch (const proto::ProtocolError& e) {
    refuse(e.what());
  } catch (const std::exception& e) {
    // Whatever went wrong, it ends this connection only.
    refuse(fmt::format("internal error: {}", e.what()));
  }
}

void Server::on_close(const std::shared_ptr<Session>& s, const std::string& why) {
  sessions_.erase(s->id);
  if (auto it = per_address_.find(s->address); it != per_address_.end() && --it->second == 0) per_address_.erase(it);
  if (stopped_) return;
  // A client that leaves with its challenge unanswered could not prove the key (a wrong or
  // missing token, or it found the server's proof wrong): a failed authentication too.
  if (s->challenged) ++auth_failures_;
  if (s->phase == Session::Phase::kAuth && !s->challenged) {
    // Still queued: drop it (and the entries of sessions already gone) from the queue, so a
    // blocked address that keeps connecting and leaving holds no memory for them.
    if (auto g = gates_.find(s->address); g != gates_.end() && !g->second.busy) {
      std::erase_if(g->second.waiting, [&](const std::weak_ptr<Session>& w) {
        auto p = w.lock();
        return !p || p == s;
      });
      if (g->second.waiting.empty() && g->second.outstanding == 0 && !g->second.timer) gates_.erase(g);
    }
  }
  answered(*s);
  if (s->phase == Session::Phase::kAuth && why == "connection closed by peer")
    log(fmt::format("{}: closed during authentication for job '{}' (the client may hold another token)",
                    s->conn->peer(), s->job));
  else if (why != "closed" && why != "connection closed by peer" && !s->joined)  // a node's: in its job's event
    log(fmt::format("{}: connection dropped: {}", s->conn->peer(), why));
  if (!s->joined) return;
  if (auto job = jobs_.find(s->job); job != jobs_.end()) {
    // The job's event names the node by its advertised address; how its connection ended:
    std::string how = "its connection closed";
    if (!s->closing_why.empty()) how = fmt::format("its connection closed by the rendezvous server: {}", s->closing_why);
    else if (why != "closed" && why != "connection closed by peer") how = fmt::format("its connection closed ({})", why);
    drive(job->second, job->second.disconnected(s->id, Clock::now(), how));
  }
}

void Server::apply(const Actions& actions) {
  for (const auto& a : actions) {
    auto it = sessions_.find(a.session);
    if (it == sessions_.end()) continue;
    auto conn = it->second->conn;  // send() may close and erase the session
    if (opts_.on_send) opts_.on_send(a.frame);
    conn->send(a.frame);
    if (proto::type_of(a.frame) == MsgType::kError) conn->close();
  }
}

void Server::check_deadlines(Clock::time_point now) {
  std::vector<std::pair<std::shared_ptr<Session>, std::string>> expired;
  for (const auto& [id, s] : sessions_) {
    const auto age = now - s->since;
    if (!s->held.empty() && age > std::max(opts_.handshake_timeout, opts_.held_timeout))
      expired.emplace_back(s, fmt::format("an older client's hello held {} ms without this node hosting; closing",
                                          std::max(opts_.handshake_timeout, opts_.held_timeout).count()));
    else if (s->held.empty() && s->phase != Session::Phase::kReady && age > opts_.handshake_timeout)
      expired.emplace_back(s, fmt::format("no handshake within {} ms; closing", opts_.handshake_timeout.count()));
    else if (s->phase == Session::Phase::kReady && !s->joined && age > opts_.handshake_timeout)
      expired.emplace_back(s, fmt::format("no join within {} ms of the handshake; closing", opts_.handshake_timeout.count()));
    else if (auto p = s->conn->partial_since(); p && now - *p > opts_.frame_timeout)
      expired.emplace_back(s, fmt::format("a frame was not completed within {} ms; closing", opts_.frame_timeout.count()));
    else if (s->joined && now - s->conn->last_frame() > s->idle_limit)
      expired.emplace_back(s, fmt::format("no message for {} ms; closing",
                                          std::chrono::duration_cast<std::chrono::milliseconds>(now - s->conn->last_frame()).count()));
  }
  for (auto& [s, why] : expired) {
    log(fmt::format("{}: {}", s->conn->peer(), why));
    s->closing_why = why;
    s->conn->close(true);
  }
}

void Server::forget(std::map<std::string, Job>::iterator job, const std::string& why) {
  if (!why.empty()) log(why, {{"event", "log"}, {"job", job->first}});
  // A job that never ended (all its agents killed, scancel, preemption) ends here, in the
  // journal too: its id used again (a Slurm requeue) is a new run, not this one at epoch 1
  // (review s38-late H1; job_of()).
  // (Not a job the journal says ended already: a Job made only to tell its agents that end.)
  if (opts_.journal && !job->second.finished() && !ended_in_journal(job->first))
    opts_.journal->record({{"event", "forgotten"}, {"job", job->first}, {"text", proto::printable(why)},
                           {"unix_ms", events_.empty() ? 0 : events_.back().unix_ms}});
  forgotten_disconnects_ += static_cast<std::uint64_t>(job->second.disconnects());
  forgotten_missed_heartbeats_ += static_cast<std::uint64_t>(job->second.missed_heartbeats());
  jobs_.erase(job);
}

std::string Server::metrics(bool job_ids) const {
  std::string out;
  auto metric = [&](const char* name, const char* type, const char* help) {
    out += fmt::format("# HELP mglaunch_rdzv_{} {}\n# TYPE mglaunch_rdzv_{} {}\n", name, help, name, type);
  };
  auto value = [&](const char* name, const std::string& labels, auto v) {
    out += labels.empty() ? fmt::format("mglaunch_rdzv_{} {}\n", name, v)
                          : fmt::format("mglaunch_rdzv_{}{{{}}} {}\n", name, labels, v);
  };
  struct Single {
    const char* name;
    const char* type;
    const char* help;
    std::uint64_t v;
  };
  const Single head[] = {
      {"connections", "gauge", "Open connections.", sessions_.size()},
      {"connections_limit", "gauge", "Connections accepted at most (after the descriptor limit).", opts_.max_connections},
      {"connections_accepted_total", "counter", "Connections accepted.", accepted_}};
  const Single tail[] = {
      {"auth_failures_total", "counter", "Failed authentications (wrong token or job key).", auth_failures_},
      {"refusals_total", "counter", "Messages refused with an error (the connection is then closed).", refusals_},
      {"frames_received_total", "counter", "Frames received.", traffic_->frames_in},
      {"frames_sent_total", "counter", "Frames sent.", traffic_->frames_out},
      {"received_bytes_total", "counter", "Bytes received.", traffic_->bytes_in},
      {"sent_bytes_total", "counter", "Bytes sent.", traffic_->bytes_out},
      {"memory_bytes", "gauge", "Bytes held by connection buffers and job state.", budget_->used},
      {"memory_limit_bytes", "gauge", "--max-memory.", budget_->limit},
      {"jobs_created_total", "counter", "Jobs created.", jobs_created_}};
  for (const auto& m : head) {
    metric(m.name, m.type, m.help);
    value(m.name, "", m.v);
  }
  metric("connections_refused_total", "counter", "Connections refused at accept, by reason.");
  for (const char* reason : {"connections", "per_address", "memory", "descriptors"}) {
    auto it = refused_.find(reason);
    value("connections_refused_total", fmt::format("reason=\"{}\"", reason), it == refused_.end() ? 0 : it->second);
  }
  for (const auto& m : tail) {
    metric(m.name, m.type, m.help);
    value(m.name, "", m.v);
  }
  std::map<std::string, int> by_state{{"joining", 0}, {"running", 0}, {"restarting", 0}, {"done", 0}, {"failed", 0}};
  std::uint64_t disconnects = forgotten_disconnects_, missed = forgotten_missed_heartbeats_;
  static constexpr const char* kStateNames[] = {"joining", "running", "restarting", "done", "failed"};
  for (const auto& [id, job] : jobs_) {
    ++by_state[kStateNames[static_cast<int>(job.state())]];
    disconnects += static_cast<std::uint64_t>(job.disconnects());
    missed += static_cast<std::uint64_t>(job.missed_heartbeats());
  }
  metric("jobs", "gauge", "Jobs held, by state.");
  for (const auto& [state, n] : by_state) value("jobs", fmt::format("state=\"{}\"", state), n);
  std::uint64_t standbys = 0;
  for (const auto& [id, job] : jobs_) standbys += job.standbys();
  metric("standby_nodes", "gauge", "Standby nodes: registered, waiting for a place in a full round.");
  value("standby_nodes", "", standbys);
  metric("nodes_lost_total", "counter", "Nodes lost from a running round, by cause.");
  value("nodes_lost_total", "cause=\"disconnect\"", disconnects);
  value("nodes_lost_total", "cause=\"missed_heartbeats\"", missed);
  if (!job_ids) return out;
  metric("job_nodes", "gauge", "Nodes in a job's round or waiting for the next one.");
  for (const auto& [id, job] : jobs_) value("job_nodes", fmt::format("job=\"{}\"", prometheus_label(id)), job.nodes());
  metric("job_standby_nodes", "gauge", "A job's standby nodes.");
  for (const auto& [id, job] : jobs_)
    value("job_standby_nodes", fmt::format("job=\"{}\"", prometheus_label(id)), job.standbys());
  metric("job_round", "gauge", "A job's current round.");
  for (const auto& [id, job] : jobs_) value("job_round", fmt::format("job=\"{}\"", prometheus_label(id)), job.round());
  metric("job_restarts", "gauge", "Restarts a job has spent.");
  for (const auto& [id, job] : jobs_)
    value("job_restarts", fmt::format("job=\"{}\"", prometheus_label(id)), job.restart_count());
  return out;
}

void Server::account_jobs() {
  std::size_t bytes = 0;
  for (const auto& [id, job] : jobs_) bytes += job.approx_bytes();
  budget_->release(jobs_bytes_);
  budget_->used += bytes;
  jobs_bytes_ = bytes;
  // Give memory back to the system once a burst of clients has gone (glibc keeps freed
  // heap otherwise, and RSS would stay at its peak).
  if (budget_->used + (std::size_t{32} << 20) < peak_used_) {
    ::malloc_trim(0);
    peak_used_ = budget_->used;
  }
  peak_used_ = std::max(peak_used_, budget_->used);
}

void Server::tick() {
  ticker_.expires_after(opts_.tick);
  ticker_.async_wait([this](boost::system::error_code ec) {
    if (ec || stopped_) return;
    const auto now = Clock::now();
    check_deadlines(now);
    std::set<std::string_view> attended;  // views of the sessions' strings, alive during the tick
    const std::string* last = nullptr;
    for (const auto& [id, s] : sessions_)
      if (s->joined && (!last || *last != s->job)) attended.insert(*(last = &s->job));
    for (auto it = jobs_.begin(); it != jobs_.end();) {
      drive(it->second, it->second.tick(now));
      const auto idle = now - it->second.last_activity();
      if (it->second.finished() && idle > std::chrono::seconds(60)) {
        forget(it++);  // keep finished jobs a minute for late re-joins to be told
      } else if (!attended.contains(it->first) && idle > opts_.orphan_job_expiry) {
        auto why = fmt::format("job '{}' forgotten: nobody connected for {} s", it->first,
                               opts_.orphan_job_expiry.count() / 1000);
        forget(it++, why);
      } else if (idle > opts_.idle_job_expiry) {
        auto why = fmt::format("job '{}' expired after {} s idle", it->first, opts_.idle_job_expiry.count() / 1000);
        forget(it++, why);
      } else {
        ++it;
      }
    }
    for (auto it = failures_.begin(); it != failures_.end();)
      it = now - it->second.last > kForgetFailures ? failures_.erase(it) : std::next(it);
    rate_.prune(now);
    account_jobs();
    tick();
  });
}

}  // namespace mg::rdzv
