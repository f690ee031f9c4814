#include "rendezvous/etcd_log.h"

#include <algorithm>
#include <climits>

#include <fmt/format.h>

#include "proto/text.h"
#include "rendezvous/endpoint.h"

namespace mg::rdzv::etcd {

std::string Endpoint::text() const {
  const bool v6 = host.find(':') != std::string::npos;
  return fmt::format("{}://{}{}{}:{}", tls ? "https" : "http", v6 ? "[" : "", host, v6 ? "]" : "", port);
}

std::vector<Endpoint> parse_endpoints(std::string_view text) {
  std::vector<Endpoint> out;
  if (text.empty()) throw std::invalid_argument("no etcd endpoint given: use HOST:2379[,HOST2:2379,...]");
  std::string_view rest = text;
  while (true) {
    const auto comma = rest.find(',');
    std::string_view item = rest.substr(0, comma);
    while (!item.empty() && item.front() == ' ') item.remove_prefix(1);
    while (!item.empty() && item.back() == ' ') item.remove_suffix(1);
    Endpoint ep;
    for (auto [scheme, tls] : {std::pair{"etcd://", false}, {"http://", false}, {"https://", true}}) {
      if (item.starts_with(scheme)) {
        item.remove_prefix(std::string_view(scheme).size());
        ep.tls = tls;
        break;
      }
    }
    if (item.find("://") != std::string_view::npos)
      throw std::invalid_argument(fmt::format("etcd endpoint '{}': use etcd://, http:// or https://", item));
    if (!item.empty() && item.back() == '/') item.remove_suffix(1);
    if (item.empty()) throw std::invalid_argument(fmt::format("empty etcd endpoint in '{}'", text));
    auto parsed = parse_endpoint(item, 2379);  // throws invalid_argument naming the item
    ep.host = parsed.host;
    ep.port = parsed.port;
    if (ep.port == 0)
      throw std::invalid_argument(fmt::format("etcd endpoint '{}': port 0 is not a port etcd listens on", item));
    out.push_back(ep);
    if (comma == std::string_view::npos) break;
    rest = rest.substr(comma + 1);
  }
  return out;
}

namespace {
constexpr char kAlphabet[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
}

std::string base64_encode(std::string_view in) {
  std::string out;
  out.reserve((in.size() + 2) / 3 * 4);
  std::size_t i = 0;
  for (; i + 2 < in.size(); i += 3) {
    const unsigned v = (static_cast<unsigned char>(in[i]) << 16) | (static_cast<unsigned char>(in[i + 1]) << 8) |
                       static_cast<unsigned char>(in[i + 2]);
    out += kAlphabet[(v >> 18) & 63];
    out += kAlphabet[(v >> 12) & 63];
    out += kAlphabet[(v >> 6) & 63];
    out += kAlphabet[v & 63];
  }
  if (i + 1 == in.size()) {
    const unsigned v = static_cast<unsigned char>(in[i]) << 16;
    out += kAlphabet[(v >> 18) & 63];
    out += kAlphabet[(v >> 12) & 63];
    out += "==";
  } else if (i + 2 == in.size()) {
    const unsigned v = (static_cast<unsigned char>(in[i]) << 16) | (static_cast<unsigned char>(in[i + 1]) << 8);
    out += kAlphabet[(v >> 18) & 63];
    out += kAlphabet[(v >> 12) & 63];
    out += kAlphabet[(v >> 6) & 63];
    out += '=';
  }
  return out;
}

std::string base64_decode(std::string_view in) {
  std::string out;
  unsigned acc = 0;
  int bits = 0;
  for (char c : in) {
    if (c == '=') break;
    const char* p = std::find(kAlphabet, kAlphabet + 64, c);
    if (p == kAlphabet + 64) throw std::invalid_argument(fmt::format("bad base64 character '{}'", c));
    acc = (acc << 6) | static_cast<unsigned>(p - kAlphabet);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out += static_cast<char>((acc >> bits) & 0xff);
    }
  }
  return out;
}

std::string prefix_end(std::string prefix) {
  while (!prefix.empty()) {
    auto& c = prefix.back();
    if (static_cast<unsigned char>(c) < 0xff) {
      ++c;
      return prefix;
    }
    prefix.pop_back();
  }
  return std::string(1, '\0');  // every key
}

std::int64_t number(const nlohmann::json& j, const char* field) {
  if (!j.is_object()) return 0;
  auto it = j.find(field);
  if (it == j.end() || it->is_null()) return 0;
  if (it->is_number_integer()) return it->get<std::int64_t>();
  if (it->is_string()) {
    try {
      return std::stoll(it->get<std::string>());
    } catch (const std::exception&) {
      return 0;
    }
  }
  return 0;
}

std::string Keys::log_key(const std::string& agent, std::int64_t seq) const {
  return fmt::format("{}{}/{:010}", log(), agent, seq);
}

std::string Keys::agent_of_alive(const std::string& key) const {
  const std::string p = alive();
  return key.starts_with(p) ? key.substr(p.size()) : std::string();
}

std::string key_component(std::string_view id) {
  // A job's own subkeys (log/, alive/, lease) are names no job component may take: a job
  // whose prefix is another job's root must not land inside that job's ranges. Their first
  // letter is escaped; '%' is always escaped, so the mapping stays injective.
  if (id == "log" || id == "alive" || id == "lease")
    return fmt::format("%{:02X}{}", static_cast<unsigned char>(id[0]), id.substr(1));
  std::string out;
  out.reserve(id.size());
  for (char c : id) {
    if (c == '%') out += "%25";
    else if (c == '/') out += "%2F";
    else out += c;
  }
  return out;
}

Keys keys_for(std::string prefix, const std::string& job) {
  while (!prefix.empty() && prefix.back() == '/') prefix.pop_back();
  return Keys{prefix + "/" + key_component(job) + "/"};
}

void JsonStream::feed(std::string_view bytes) {
  buf_.append(bytes);
  if (buf_.size() - start_ > max_) throw std::runtime_error("etcd sent a message larger than the limit");
}

std::optional<nlohmann::json> JsonStream::next() {
  for (; scanned_ < buf_.size(); ++scanned_) {
    const char c = buf_[scanned_];
    if (in_string_) {
      if (escaped_) escaped_ = false;
      else if (c == '\\') escaped_ = true;
      else if (c == '"') in_string_ = false;
      continue;
    }
    if (depth_ == 0) {
      if (c == ' ' || c == '\n' || c == '\r' || c == '\t') continue;
      if (c != '{') throw std::runtime_error(fmt::format("etcd sent something that is not a JSON object ('{}')", c));
      start_ = scanned_;
    }
    if (c == '"') in_string_ = true;
    else if (c == '{' || c == '[') ++depth_;
    else if (c == '}' || c == ']') {
      if (--depth_ == 0) {
        auto j = nlohmann::json::parse(buf_.begin() + static_cast<std::ptrdiff_t>(start_),
                                       buf_.begin() + static_cast<std::ptrdiff_t>(scanned_ + 1), nullptr, false);
        if (j.is_discarded()) throw std::runtime_error("etcd sent malformed JSON");
        buf_.erase(0, scanned_ + 1);
        scanned_ = start_ = 0;
        return j;
      }
    }
  }
  if (depth_ == 0) {
    buf_.clear();
    scanned_ = start_ = 0;
  }
  return std::nullopt;
}

namespace {
constexpr const char* kKinds[] = {"join", "failed", "done", "lost", "tick"};
constexpr std::int64_t kMaxEventTimeMs = 4'000'000'000'000;  // year 2096
}

nlohmann::json to_json(const Event& e) {
  nlohmann::json j = {{"kind", kKinds[static_cast<int>(e.kind)]}, {"agent", e.agent}, {"t", e.t_ms}};
  switch (e.kind) {
    case Event::Kind::kJoin: j["join"] = e.join; break;
    case Event::Kind::kFailed: j["failed"] = e.failed; break;
    case Event::Kind::kDone: j["round"] = e.round; break;
    case Event::Kind::kLost: j["why"] = e.why; break;
    case Event::Kind::kTick: break;
  }
  if (!e.run.empty()) j["run"] = e.run;
  return j;
}

Event event_from_json(const nlohmann::json& j) {
  if (!j.is_object()) throw std::invalid_argument("an event is not a JSON object");
  Event e;
  try {
    const auto kind = j.at("kind").get<std::string>();
    const auto* k = std::find(std::begin(kKinds), std::end(kKinds), kind);
    if (k == std::end(kKinds)) throw std::invalid_argument(fmt::format("unknown event kind '{}'", kind));
    e.kind = static_cast<Event::Kind>(k - std::begin(kKinds));
    e.agent = j.at("agent").get<std::string>();
    if (e.agent.empty() || e.agent.size() > proto::kMaxTextBytes || !proto::text_problem(e.agent).empty()) throw std::invalid_argument("bad event agent");
    // The writer's wall clock in ms: an integer, and one a steady_clock time_point can hold.
    const auto& t = j.at("t");
    if (!t.is_number_integer() || t.get<std::int64_t>() < 0 || t.get<std::int64_t>() > kMaxEventTimeMs)
      throw std::invalid_argument("bad event time");
    e.t_ms = t.get<std::int64_t>();
    std::string bad;
    switch (e.kind) {
      case Event::Kind::kJoin:
        proto::check_numbers(j.at("join"));
        e.join = j.at("join").get<proto::Join>();
        bad = proto::validate(e.join);
        break;
      case Event::Kind::kFailed:
        proto::check_numbers(j.at("failed"));
        e.failed = j.at("failed").get<proto::WorkerFailed>();
        bad = proto::validate(e.failed);
        break;
      case Event::Kind::kDone: {
        const auto& r = j.at("round");
        if (!r.is_number_integer() || r.get<std::int64_t>() < 0 || r.get<std::int64_t>() > INT32_MAX)
          throw std::invalid_argument("bad event round");
        e.round = r.get<int>();
        break;
      }
      case Event::Kind::kLost:
        e.why = proto::truncate_text(proto::printable(j.at("why").get<std::string>()), proto::kMaxTextBytes);
        break;
      case Event::Kind::kTick: break;
    }
    if (const auto run = j.find("run"); run != j.end()) {
      e.run = run->get<std::string>();
      if (bad.empty()) bad = proto::run_problem(e.run);
    }
    if (!bad.empty()) throw std::invalid_argument("invalid event: " + bad);
  } catch (const nlohmann::json::exception& e) {
    throw std::invalid_argument(std::string("malformed event: ") + e.what());
  } catch (const proto::ProtocolError& e) {
    throw std::invalid_argument(std::string("malformed event: ") + e.what());
  }
  return e;
}

JobReplay::JobReplay(std::string job_id, std::string self_agent) : self_(std::move(self_agent)), job_(std::move(job_id)) {}

Clock::time_point JobReplay::at() const { return Clock::time_point(std::chrono::milliseconds(vnow_)); }

bool JobReplay::live(const std::string& agent) const { return sessions_.contains(agent) && !gone_.contains(agent); }

void JobReplay::heartbeat_all() {
  // Liveness is the lease's business: every agent not declared lost is alive now.
  for (const auto& [agent, s] : sessions_)
    if (!gone_.contains(agent)) job_.heartbeat(s, at());
}

std::vector<proto::Frame> JobReplay::apply(const Event& e) {
  vnow_ = std::max(vnow_, e.t_ms);
  if (!e.run.empty()) job_.set_run(e.run);  // the first record's (one that has one) (#37)
  heartbeat_all();
  Actions actions;
  auto session = sessions_.find(e.agent);
  switch (e.kind) {
    case Event::Kind::kJoin:
      if (gone_.contains(e.agent)) return {};  // a lost agent stays lost
      if (session == sessions_.end())
        session = sessions_.emplace(e.agent, static_cast<SessionId>(sessions_.size() + 1)).first;
      actions = job_.join(session->second, e.join, at());
      break;
    case Event::Kind::kFailed:
      if (session == sessions_.end() || gone_.contains(e.agent)) return {};
      actions = job_.worker_failed(session->second, e.failed, at());
      break;
    case Event::Kind::kDone:
      if (session == sessions_.end() || gone_.contains(e.agent)) return {};
      actions = job_.node_done(session->second, e.round, at());
      break;
    case Event::Kind::kLost: {
      if (session == sessions_.end() || gone_.contains(e.agent)) return {};
      gone_.insert(e.agent);
      const auto before = job_.state();
      actions = job_.disconnected(session->second, at(), e.why);
      // The others go on without this node: it must stop its workers and join again (the job
      // keeps this identity lost: EtcdLink joins as a newcomer), as a silent node the daemon or
      // an agent host drops is told Restart; Abort only when the job failed (#34).
      if (e.agent == self_)
        for (auto& a : job_.tell_lost(session->second, before)) actions.push_back(std::move(a));
      break;
    }
    case Event::Kind::kTick:
      actions = job_.tick(at());
      break;
  }
  for (auto& ev : job_.take_events()) events_.push_back(std::move(ev));
  if (events_.size() > kMaxEvents)
    events_.erase(events_.begin(), events_.begin() + static_cast<std::ptrdiff_t>(events_.size() - kMaxEvents));
  std::vector<proto::Frame> mine;
  auto self = sessions_.find(self_);
  if (self == sessions_.end()) return mine;
  for (auto& a : actions)
    if (a.session == self->second) mine.push_back(proto::frame_of(a.frame));
  return mine;
}

bool JobReplay::tick_due(std::int64_t now_ms) const {
  if (job_.finished()) return false;
  JobReplay probe = *this;
  const auto before = probe.job_.state();
  const int round = probe.job_.round();
  probe.vnow_ = std::max(probe.vnow_, now_ms);
  probe.heartbeat_all();
  const auto actions = probe.job_.tick(probe.at());
  return !actions.empty() || probe.job_.state() != before || probe.job_.round() != round;
}

}  // namespace mg::rdzv::etcd
