#include "rendezvous/etcd_backend.h"

#include <boost/asio/post.hpp>
#include <fmt/format.h>

#include "process/thread.h"
#include "proto/text.h"

namespace mg::rdzv {

namespace asio = boost::asio;
using etcd::base64_decode;
using etcd::base64_encode;
using etcd::Event;
using etcd::number;
using std::chrono::milliseconds;
using nlohmann::json;

namespace {

constexpr milliseconds kRequestTimeout{2000};
constexpr milliseconds kCloseTimeout{1000};
// How long close() waits for the request thread's last requests (the queue, the lease's
// revocation) before it stops them: an endpoint that accepts and never answers would
// otherwise hold the agent's end for each request's time-out in turn, on every endpoint.
constexpr milliseconds kFlushBound{3000};
constexpr milliseconds kWatchIdle{15000};  // a silent watch is reopened (on the next endpoint)
constexpr milliseconds kStartWindow{5000};  // etcd must answer within this at start

std::int64_t steady_ms() {
  return std::chrono::duration_cast<milliseconds>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

json range_of(const std::string& prefix) {
  return {{"key", base64_encode(prefix)}, {"range_end", base64_encode(etcd::prefix_end(prefix))}};
}

// Deletes the job's own keys (log/, alive/, lease) and nothing else under its root.
json delete_job_ops(const etcd::Keys& k) {
  return json::array({{{"request_delete_range", range_of(k.log())}},
                      {{"request_delete_range", range_of(k.alive())}},
                      {{"request_delete_range", {{"key", base64_encode(k.lease())}}}}});
}

json put_op(const std::string& key, const std::string& value, std::int64_t lease = 0) {
  json p = {{"key", base64_encode(key)}, {"value", base64_encode(value)}};
  if (lease) p["lease"] = std::to_string(lease);
  return {{"request_put", p}};
}

std::string endpoints_text(const std::vector<etcd::Endpoint>& eps) {
  std::string out;
  for (const auto& e : eps) out += (out.empty() ? "" : ", ") + e.text();
  return out;
}

// The TTL etcd's answer to a grant or a keep-alive gives (the gateway wraps a streamed
// answer, as keep-alive's, in "result"); 0: the lease is gone.
std::int64_t ttl_of(const json& r) { return number(r.contains("result") ? r["result"] : r, "TTL"); }

}  // namespace

EtcdLink::EtcdLink(asio::io_context& io, EtcdOptions opts, ClientHandlers handlers)
    : io_(io),
      opts_(std::move(opts)),
      h_(std::move(handlers)),
      keys_(etcd::keys_for(opts_.prefix, opts_.join.job_id)),
      agent_(opts_.join.agent_id),
      self_(opts_.join.agent_id),
      guard_(opts_.join.keep_alive_ms, endpoints_text(opts_.endpoints)),
      replay_(opts_.join.job_id, opts_.join.agent_id),
      ticker_(io) {}

EtcdLink::~EtcdLink() {
  close();
  alive_token_.reset();
}

std::int64_t EtcdLink::now_ms() const {
  return std::chrono::duration_cast<milliseconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

void EtcdLink::post(std::function<void()> f) {
  std::weak_ptr<int> alive = alive_token_;
  asio::post(io_, [alive, f = std::move(f)] {
    if (alive.lock()) f();
  });
}

void EtcdLink::start() {
  work_.emplace(io_.get_executor());
  if (auto bad = proto::validate(opts_.join); !bad.empty()) {
    post([this, bad] { lost("cannot join: " + bad); });
    return;
  }
  try {
    http_ = std::make_unique<etcd::Http>(opts_.endpoints, opts_.credentials);
    watch_http_ = std::make_unique<etcd::Http>(opts_.endpoints, opts_.credentials);
    keep_http_ = std::make_unique<etcd::Http>(opts_.endpoints, opts_.credentials);
  } catch (const etcd::Error& e) {
    post([this, why = std::string(e.what())] { lost(why); });
    return;
  }
  last_ok_ms_ = steady_ms();
  requests_ = signal_free_thread([this] { request_loop(); });
  check();
}

// ---- io thread ----

void EtcdLink::on_changes(const std::vector<Change>& changes) {
  for (const auto& c : changes) {
    if (closed_ || lost_) return;
    if (c.key.starts_with(keys_.log())) {
      // Deleted: the job's keys at its end. Already seen: a re-read after a compaction.
      if (!c.put || c.revision <= seen_revision_) continue;
      seen_revision_ = std::max(seen_revision_, c.revision);
      Event e;
      try {
        e = etcd::event_from_json(json::parse(c.value));
      } catch (const std::exception& ex) {
        if (h_.on_notice) h_.on_notice(proto::printable(fmt::format("ignoring a bad event in etcd at {}: {}", c.key, ex.what())));
        continue;
      }
      if (e.kind == Event::Kind::kJoin) joined_agents_.insert(e.agent);
      const bool self_lost = e.kind == Event::Kind::kLost && e.agent == self_ && replay_.live(self_);
      const auto frames = replay_.apply(e);
      if (self_lost) {
        // The job went on without this identity (its lease expired). Not this node's end:
        // the lease guard stops its workers if they still run, and it joins again as a
        // newcomer, unless the job ended meanwhile.
        if (replay_.job().finished())
          return lost(fmt::format("this agent was declared lost by the job, which has ended since: {}", e.why));
        carry_out(guard_.gone(fmt::format("declared lost by the job: {}", e.why)));
        continue;
      }
      for (const auto& f : frames) {
        deliver(f);
        if (closed_ || lost_) return;
      }
    } else if (auto agent = keys_.agent_of_alive(c.key); !agent.empty()) {
      if (c.put) {
        alive_.insert(agent);
      } else {
        alive_.erase(agent);
        pending_lost_.insert(agent);
        if (agent == self_) carry_out(guard_.gone("etcd deleted its alive key"));
        if (closed_ || lost_) return;
      }
    }
  }
}

void EtcdLink::deliver(const proto::Frame& f) {
  try {
    if (proto::type_of(f) == proto::MsgType::kError)
      return lost(fmt::format("refused by the rendezvous: {}", proto::from_frame<proto::Error>(f).message));
    auto d = decision_of(f);
    if (!d) return;
    if (auto* a = std::get_if<proto::Assignment>(&*d)) {
      assigned_ = true;
      guard_.assigned(a->round);
    } else if (std::holds_alternative<proto::Restart>(*d)) {
      guard_.restarted();
    } else if (std::holds_alternative<proto::Standby>(*d)) {
      guard_.waiting();
    } else {
      guard_.ended();
    }
    tell(h_, *d);
  } catch (const proto::ProtocolError& e) {
    lost(fmt::format("bad decision from the job's log: {}", e.what()));
  }
}

std::string EtcdLink::record(Event e) const {
  e.run = run_;
  return proto::dump_json(to_json(e));
}

void EtcdLink::append(Event e, bool conditional) {
  e.t_ms = now_ms();
  const std::int64_t cond_rev = seen_revision_;
  if (conditional) conditional_in_flight_ = true;
  auto task = [this, e = std::move(e), conditional, cond_rev](etcd::Http& http) {
    const std::string key = keys_.log_key(agent_, next_seq_++);
    json compare;
    if (conditional) {  // only if the log did not move since this agent decided
      compare = range_of(keys_.log());
      compare["target"] = "MOD";
      compare["result"] = "LESS";
      compare["mod_revision"] = std::to_string(cond_rev + 1);
    } else {  // put-if-absent: a retried put cannot log the event twice
      compare = {{"key", base64_encode(key)}, {"target", "CREATE"}, {"result", "EQUAL"}, {"create_revision", "0"}};
    }
    const json body = {{"compare", json::array({compare})},
                       {"success", json::array({put_op(key, record(e), job_lease_)})}};
    for (int attempt = 0;; ++attempt) {
      try {
        http.call("/v3/kv/txn", body, kRequestTimeout);
        last_ok_ms_ = steady_ms();
        break;
      } catch (const etcd::Error& err) {
        if (err.status) {  // refused (permission, a bad request, a lease gone): retrying cannot help
          post([this, why = std::string(err.what())] { lost("etcd refused this agent's event: " + why); });
          break;
        }
        std::unique_lock lk(mutex_);
        if (conditional || stopping_ || http.stopped()) break;
        // etcd is away: try again until it is back (check() gives up after join_timeout).
        cv_.wait_for(lk, milliseconds(std::min(100 << std::min(attempt, 4), 1000)), [&] { return stopping_; });
      }
    }
    if (conditional) post([this] { conditional_in_flight_ = false; });
  };
  {
    std::lock_guard lk(mutex_);
    queue_.push_back(std::move(task));
  }
  cv_.notify_all();
}

void EtcdLink::check() {
  if (closed_ || lost_) return;
  carry_out(guard_.tick(Clock::now()));
  if (closed_ || lost_) return;
  if (started_ && !conditional_in_flight_ && !replay_.job().finished()) {
    bool appended = false;
    for (auto it = pending_lost_.begin(); it != pending_lost_.end();) {
      if (!replay_.live(*it) || alive_.contains(*it)) {
        it = pending_lost_.erase(it);
        continue;
      }
      Event e;
      e.kind = Event::Kind::kLost;
      e.agent = *it;
      e.why = fmt::format("its etcd lease expired (agent {} stopped renewing it: hung, dead or cut off)", *it);
      append(std::move(e), /*conditional=*/true);
      appended = true;
      break;
    }
    if (!appended && replay_.tick_due(now_ms())) {
      Event e;
      e.kind = Event::Kind::kTick;
      e.agent = self_;
      append(std::move(e), /*conditional=*/true);
    }
  }
  if (started_ && !assigned_ && !fresh_in_flight_ && alive_.size() == 1 && alive_.contains(self_)) {
    // A log whose agents are all gone (a run killed, its leases expired since this agent
    // joined): nobody will ever decide for this agent there. Start a fresh one.
    bool others = false, live_other = false;
    for (const auto& a : joined_agents_) {
      if (a == self_) continue;
      others = true;
      live_other = live_other || replay_.live(a);
    }
    if (others && !live_other) {
      fresh_in_flight_ = true;
      Event join;
      join.kind = Event::Kind::kJoin;
      join.agent = self_;
      join.join = opts_.join;
      {
        std::lock_guard lk(mutex_);
        queue_.push_back([this, join = std::move(join)](etcd::Http& http) mutable { fresh_start(http, std::move(join)); });
      }
      cv_.notify_all();
    }
  }
  const auto silent = steady_ms() - last_ok_ms_;
  if (started_ && silent > opts_.join.join_timeout_ms)
    return lost(fmt::format("no answer from etcd ({}) for {} s (join_timeout)", http_->all(), silent / 1000));
  ticker_.expires_after(milliseconds(100));
  ticker_.async_wait([this](boost::system::error_code ec) {
    if (!ec) check();
  });
}

void EtcdLink::lost(const std::string& why) {
  if (closed_ || lost_) return;
  lost_ = true;
  if (h_.on_lost) h_.on_lost(why);
}

void EtcdLink::rejoin() { carry_out(guard_.rejoin()); }

void EtcdLink::append_join() {
  Event e;
  e.kind = Event::Kind::kJoin;
  e.agent = self_;
  e.join = opts_.join;
  append(std::move(e), false);
}

void EtcdLink::carry_out(const etcd::LeaseCommands& cmds) {
  for (const auto& c : cmds) {
    if (closed_ || lost_) return;
    if (const auto* stop = std::get_if<etcd::lease_cmd::Stop>(&c)) {
      if (stop->report_round > 0) {
        // As a fenced node of a daemon: if etcd hears it before the lease is gone, the job
        // restarts the round (the others stop waiting for this node's workers).
        worker_failed(fence_failure(stop->report_round, opts_.join, "its etcd lease went unrenewed"));
      }
      tell(h_, proto::Restart{replay_.job().restart_count(), stop->why});
    } else if (std::holds_alternative<etcd::lease_cmd::Join>(c)) {
      append_join();
    } else {
      // The job's log keeps a lost agent lost: this node comes back as a new one.
      self_ = fmt::format("{}~{}", agent_, ++reentries_);
      opts_.join.agent_id = self_;
      replay_.set_self(self_);
      assigned_ = false;
      Event e;
      e.kind = Event::Kind::kJoin;
      e.agent = self_;
      e.join = opts_.join;
      if (h_.on_notice)
        h_.on_notice(fmt::format("this node's etcd lease is gone: joining job '{}' again as agent {}", opts_.join.job_id,
                                 self_));
      {
        std::lock_guard lk(mutex_);
        queue_.push_back([this, id = self_, e = std::move(e)](etcd::Http& http) { reenter(http, id, e); });
      }
      cv_.notify_all();
    }
  }
}

void EtcdLink::worker_failed(proto::WorkerFailed f) {
  proto::truncate_to_limits(f);
  Event e;
  e.kind = Event::Kind::kFailed;
  e.agent = self_;
  e.failed = std::move(f);
  append(std::move(e), false);
}

void EtcdLink::node_done(int round) {
  Event e;
  e.kind = Event::Kind::kDone;
  e.agent = self_;
  e.round = round;
  append(std::move(e), false);
}

void EtcdLink::close() {
  if (closed_) return;
  closed_ = true;
  ticker_.cancel();
  {
    std::lock_guard lk(mutex_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (requests_.joinable()) {  // it flushes the queue (a "done") and revokes the lease, for kFlushBound at most
    bool ended = false;
    {
      std::unique_lock lk(mutex_);
      ended = cv_.wait_for(lk, kFlushBound, [&] { return requests_ended_; });
    }
    if (!ended) http_->stop();  // what is left is given up: the request under way ends at once
    requests_.join();
  }
  {
    std::lock_guard lk(mutex_);
    keeper_stop_ = true;
  }
  cv_.notify_all();
  if (keep_http_) keep_http_->stop();
  if (keeper_.joinable()) keeper_.join();
  {
    std::lock_guard lk(mutex_);
    watch_stop_ = true;
  }
  cv_.notify_all();
  if (watch_http_) watch_http_->stop();
  if (watcher_.joinable()) watcher_.join();
  work_.reset();
}

// ---- request thread ----

bool EtcdLink::start_sequence(etcd::Http& http) {
  const auto deadline = std::chrono::steady_clock::now() +
                        std::min<milliseconds>(kStartWindow, milliseconds(opts_.join.join_timeout_ms));
  Event join;
  join.kind = Event::Kind::kJoin;
  join.agent = agent_;
  join.join = opts_.join;
  bool joined = false, cleared = false;
  for (int attempt = 0;; ++attempt) {
    try {
      if (!lease_) grant_lease(http);
      if (!joined) {
        join.t_ms = now_ms();
        const std::string key = keys_.log_key(agent_, next_seq_);
        if (!cleared) {
          json alive_empty = range_of(keys_.alive());
          alive_empty["target"] = "CREATE";
          alive_empty["result"] = "EQUAL";
          alive_empty["create_revision"] = "0";
          // No agent alive: whatever the job's keys hold is a dead run's; start afresh.
          // (etcd allows no put beside a delete of the same range in one txn: the join
          // below holds only if the job lease it read is still the job's.)
          http.call("/v3/kv/txn",
                    {{"compare", json::array({alive_empty})},
                     {"success", delete_job_ops(keys_)}},
                    kRequestTimeout);
          cleared = true;
        }
        ensure_job_lease(http);
        // Another agent starting at once may have cleared the job (no alive key yet) after
        // this one read or made the job lease, and made a new one: a join on the old lease
        // would be renewed by this agent alone, and etcd would delete its log keys (and
        // refuse its next events) whenever it stops renewing, cut off for a TTL say (#34).
        // So the alive key and the join go in only while the lease key names this job
        // lease; else the lease is read again (each agent clears at most once: no livelock).
        json same_lease = {{"key", base64_encode(keys_.lease())},
                           {"target", "VALUE"},
                           {"result", "EQUAL"},
                           {"value", base64_encode(std::to_string(job_lease_))}};
        auto r = http.call("/v3/kv/txn",
                           {{"compare", json::array({same_lease})},
                            {"success", json::array({put_op(keys_.alive_key(agent_), agent_, lease_),
                                                     put_op(key, record(join), job_lease_)})}},
                           kRequestTimeout);
        if (!r.value("succeeded", false)) {
          {
            std::lock_guard lk(mutex_);
            job_lease_ = 0;
          }
          // Answered: the catch below waits a little and tries again until the start window ends.
          throw etcd::Error(fmt::format("the job lease under {} changed while this agent joined (another agent "
                                        "cleared the job)", keys_.lease()), /*answered=*/true);
        }
        ++next_seq_;
        joined = true;
      }
      const std::int64_t revision = read_job(http);
      watcher_ = signal_free_thread([this, revision] { watch_loop(revision + 1); });
      return true;
    } catch (const std::exception& e) {
      if (http.stopped()) return false;
      std::unique_lock lk(mutex_);
      if (stopping_) return false;
      const auto* etcd_error = dynamic_cast<const etcd::Error*>(&e);
      if (std::chrono::steady_clock::now() >= deadline) {
        const std::string why = fmt::format("{}: {}", etcd_error && etcd_error->answered ? "etcd refused this agent"
                                                                                          : "cannot reach etcd",
                                            e.what());
        post([this, why] { lost(why); });
        return false;
      }
      cv_.wait_for(lk, milliseconds(std::min(50 << std::min(attempt, 4), 500)), [&] { return stopping_; });
    }
  }
}

std::int64_t EtcdLink::grant_lease(etcd::Http& http) {
  const std::int64_t want_ttl =
      std::max<std::int64_t>(2, (static_cast<std::int64_t>(opts_.join.keep_alive_ms) * opts_.join.keep_alive_max_attempt + 999) / 1000);
  const auto sent = Clock::now();
  auto g = http.call("/v3/lease/grant", {{"TTL", std::to_string(want_ttl)}}, kRequestTimeout);
  const std::int64_t id = number(g, "ID"), ttl = std::max<std::int64_t>(1, ttl_of(g));
  if (!id) throw etcd::Error(fmt::format("no lease granted: {}", g.dump()));
  last_ok_ms_ = steady_ms();
  {
    std::lock_guard lk(mutex_);
    lease_ = id;
    ttl_s_ = ttl;
  }
  post([this, id, ttl, sent] { carry_out(guard_.granted(id, ttl, sent)); });
  return id;
}

void EtcdLink::reenter(etcd::Http& http, const std::string& id, const Event& join) {
  for (int attempt = 0;; ++attempt) {
    try {
      const std::int64_t lease = grant_lease(http);
      Event e = join;
      e.t_ms = now_ms();
      http.call("/v3/kv/txn",
                {{"success", json::array({put_op(keys_.alive_key(id), id, lease),
                                          put_op(keys_.log_key(agent_, next_seq_), record(e), job_lease_)})}},
                kRequestTimeout);
      ++next_seq_;
      last_ok_ms_ = steady_ms();
      return;
    } catch (const etcd::Error& err) {
      if (err.status) {  // refused (the job's lease gone with the job, permission): no retry helps
        post([this, why = std::string(err.what())] { lost("etcd refused this agent's new join: " + why); });
        return;
      }
      std::unique_lock lk(mutex_);
      if (stopping_ || http.stopped()) return;
      // etcd is away: try again until it is back (check() gives up after join_timeout).
      cv_.wait_for(lk, milliseconds(std::min(100 << std::min(attempt, 4), 1000)), [&] { return stopping_; });
    }
  }
}

void EtcdLink::ensure_job_lease(etcd::Http& http) {
  if (job_lease_) return;
  auto g = http.call("/v3/lease/grant", {{"TTL", std::to_string(ttl_s_)}}, kRequestTimeout);
  const std::int64_t mine = number(g, "ID");
  if (!mine) throw etcd::Error(fmt::format("no lease granted: {}", g.dump()));
  json absent = {{"key", base64_encode(keys_.lease())}, {"target", "CREATE"}, {"result", "EQUAL"}, {"create_revision", "0"}};
  json get = {{"key", base64_encode(keys_.lease())}};
  auto r = http.call("/v3/kv/txn",
                     {{"compare", json::array({absent})},
                      {"success", json::array({put_op(keys_.lease(), std::to_string(mine), mine)})},
                      {"failure", json::array({{{"request_range", get}}})}},
                     kRequestTimeout);
  std::int64_t id = mine;
  if (!r.value("succeeded", false)) {  // another agent's: renew that one, drop ours
    try {
      const auto& kvs = r.at("responses").at(0).at("response_range").at("kvs");
      id = std::stoll(base64_decode(kvs.at(0).value("value", "")));
    } catch (const std::exception& e) {
      throw etcd::Error(fmt::format("bad job lease under {}: {}", keys_.lease(), e.what()));
    }
    try {
      http.call("/v3/lease/revoke", {{"ID", std::to_string(mine)}}, kRequestTimeout);
    } catch (const etcd::Error&) {  // it expires by itself
    }
  }
  std::lock_guard lk(mutex_);
  job_lease_ = id;
}

void EtcdLink::fresh_start(etcd::Http& http, Event join) {
  try {
    // Only this agent's alive key: no key before it and none after it under alive/.
    const std::string mine = keys_.alive_key(join.agent);
    json before = {{"key", base64_encode(keys_.alive())}, {"range_end", base64_encode(mine)}};
    json after = {{"key", base64_encode(mine + std::string(1, '\0'))},
                  {"range_end", base64_encode(etcd::prefix_end(keys_.alive()))}};
    for (auto* c : {&before, &after}) {
      (*c)["target"] = "CREATE";
      (*c)["result"] = "EQUAL";
      (*c)["create_revision"] = "0";
    }
    auto r = http.call("/v3/kv/txn",
                       {{"compare", json::array({before, after})},
                        {"success", json::array({{{"request_delete_range", range_of(keys_.log())}},
                                                 {{"request_delete_range", {{"key", base64_encode(keys_.lease())}}}}})}},
                       kRequestTimeout);
    last_ok_ms_ = steady_ms();
    if (!r.value("succeeded", false)) {  // another agent came: its job it is
      post([this] { fresh_in_flight_ = false; });
      return;
    }
    const std::int64_t revision = number(r.value("header", json::object()), "revision");
    const std::int64_t old = job_lease_;
    {
      std::lock_guard lk(mutex_);
      job_lease_ = 0;
    }
    try {
      http.call("/v3/lease/revoke", {{"ID", std::to_string(old)}}, kRequestTimeout);
    } catch (const etcd::Error&) {  // it expires by itself
    }
    ensure_job_lease(http);
    post([this, revision] { reset_replay(revision); });
    join.t_ms = now_ms();
    http.call("/v3/kv/txn",
              {{"success", json::array({put_op(keys_.log_key(agent_, next_seq_++), record(join), job_lease_)})}},
              kRequestTimeout);
  } catch (const etcd::Error& e) {
    post([this, why = std::string(e.what())] { lost("cannot start a fresh log for this job: " + why); });
  }
}

void EtcdLink::reset_replay(std::int64_t revision) {
  if (h_.on_notice) h_.on_notice("every agent of this job's previous run is gone: starting the job afresh");
  replay_ = etcd::JobReplay(opts_.join.job_id, self_);
  joined_agents_.clear();
  pending_lost_.clear();
  seen_revision_ = std::max(seen_revision_, revision);
  assigned_ = false;
  fresh_in_flight_ = false;
}

void EtcdLink::keep_alive_loop() {
  const auto period = milliseconds(std::max<std::int64_t>(100, ttl_s_ * 1000 / 3));
  while (true) {
    std::int64_t leases[2];
    {
      std::unique_lock lk(mutex_);
      if (cv_.wait_for(lk, period, [&] { return keeper_stop_; })) return;
      leases[0] = lease_;
      leases[1] = job_lease_;
    }
    for (int i = 0; i < 2; ++i) {
      const auto id = leases[i];
      if (!id) continue;
      try {
        const auto sent = Clock::now();
        auto r = keep_http_->call("/v3/lease/keepalive", {{"ID", std::to_string(id)}}, kRequestTimeout);
        last_ok_ms_ = steady_ms();
        // The agent's own lease: its guard fences on the last renewal (TTL 0: it is gone).
        if (i == 0) post([this, id, ttl = ttl_of(r), sent] { carry_out(guard_.renewed(id, ttl, sent)); });
      } catch (const etcd::Error&) {
        // An outage: check() gives up after join_timeout; the others see the lease expire.
        if (keep_http_->stopped()) return;
      }
    }
  }
}

void EtcdLink::finish_job(etcd::Http& http) {
  if (!lease_) return;
  try {
    http.call("/v3/lease/revoke", {{"ID", std::to_string(lease_)}}, kCloseTimeout);
    json count = range_of(keys_.alive());
    count["count_only"] = true;
    auto r = http.call("/v3/kv/range", count, kCloseTimeout);
    if (number(r, "count") == 0) {  // the last agent out deletes the job's keys
      json del = range_of(keys_.alive());
      del["target"] = "CREATE";
      del["result"] = "EQUAL";
      del["create_revision"] = "0";
      auto d = http.call("/v3/kv/txn",
                         {{"compare", json::array({del})},
                          {"success", delete_job_ops(keys_)}},
                         kCloseTimeout);
      if (d.value("succeeded", false) && job_lease_)
        http.call("/v3/lease/revoke", {{"ID", std::to_string(job_lease_)}}, kCloseTimeout);
    }
  } catch (const etcd::Error&) {
    // etcd is away: the lease expires by itself, and the next run of this id clears the log.
  }
}

void EtcdLink::request_loop() {
  request_steps();
  std::lock_guard lk(mutex_);
  requests_ended_ = true;
  cv_.notify_all();
}

void EtcdLink::request_steps() {
  if (!start_sequence(*http_)) return;
  keeper_ = signal_free_thread([this] { keep_alive_loop(); });
  while (true) {
    std::function<void(etcd::Http&)> task;
    {
      std::unique_lock lk(mutex_);
      cv_.wait(lk, [&] { return !queue_.empty() || stopping_; });
      if (!queue_.empty()) {
        task = std::move(queue_.front());
        queue_.pop_front();
      } else if (stopping_) {
        break;
      }
    }
    if (task) task(*http_);
    if (http_->stopped()) return;
  }
  finish_job(*http_);
}

std::int64_t EtcdLink::read_job(etcd::Http& http) {
  json range = range_of(keys_.root);
  range["sort_order"] = "ASCEND";
  range["sort_target"] = "CREATE";
  auto r = http.call("/v3/kv/range", range, kRequestTimeout);
  last_ok_ms_ = steady_ms();
  std::vector<Change> kvs;
  for (const auto& kv : r.value("kvs", json::array()))
    kvs.push_back({true, base64_decode(kv.value("key", "")), base64_decode(kv.value("value", "")),
                   number(kv, "mod_revision")});
  post([this, kvs = std::move(kvs)] { resync(kvs); });
  return number(r.value("header", json::object()), "revision");
}

void EtcdLink::resync(const std::vector<Change>& kvs) {
  alive_.clear();
  on_changes(kvs);  // log events already applied are skipped
  for (const auto& a : joined_agents_)
    if (!alive_.contains(a)) pending_lost_.insert(a);  // gone while this agent did not look
  started_ = true;
}

// ---- watch thread ----

void EtcdLink::watch_loop(std::int64_t from_revision) {
  std::int64_t next = from_revision;
  bool reread = false;
  for (int failures = 0;; ++failures) {
    json create = range_of(keys_.root);
    create["start_revision"] = std::to_string(next);
    try {
      watch_http_->stream("/v3/watch", {{"create_request", create}}, kRequestTimeout, kWatchIdle, [&](const json& m) {
        if (m.contains("error")) throw etcd::Error(m["error"].dump());
        const auto& r = m.value("result", json::object());
        last_ok_ms_ = steady_ms();
        failures = 0;
        if (r.value("canceled", false)) {
          // History this agent missed was compacted away: read the job's keys instead
          // (log keys are written once, so the log itself is all there).
          if (number(r, "compact_revision")) reread = true;
          throw etcd::Error("watch canceled: " + r.value("cancel_reason", std::string()));
        }
        std::vector<Change> changes;
        for (const auto& ev : r.value("events", json::array())) {
          const auto& kv = ev.value("kv", json::object());
          Change c;
          c.put = ev.value("type", std::string("PUT")) != "DELETE";
          c.key = base64_decode(kv.value("key", ""));
          c.value = base64_decode(kv.value("value", ""));
          c.revision = number(kv, "mod_revision");
          next = std::max(next, c.revision + 1);
          changes.push_back(std::move(c));
        }
        if (!changes.empty()) post([this, changes = std::move(changes)] { on_changes(changes); });
        return true;
      });
    } catch (const std::exception&) {
    }
    if (watch_http_->stopped()) return;
    if (reread) {
      try {
        next = read_job(*watch_http_) + 1;
        reread = false;
        continue;
      } catch (const std::exception&) {
      }
    }
    watch_http_->fail_over();
    std::unique_lock lk(mutex_);
    if (cv_.wait_for(lk, milliseconds(std::min(50 << std::min(failures, 4), 1000)), [&] { return watch_stop_; })) return;
  }
}

}  // namespace mg::rdzv
