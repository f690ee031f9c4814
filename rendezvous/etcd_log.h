// The pure half of the etcd rendezvous backend: endpoint parsing, the key layout of a job,
// base64 and the JSON stream splitter of etcd's v3 JSON gateway, the job's event log
// (encode/decode) and its replay into the shared rendezvous::Job state machine. No I/O:
// everything here is unit-tested without etcd (tests/etcd_unit_test.cc).
//
// A job lives under PREFIX/JOB/ (PREFIX defaults to /mglaunch; JOB with '/' and '%' escaped,
// keys_for()):
//   log/AGENT/SEQ   one event (JSON), written once; the log's order is etcd's revision order
//   alive/AGENT     attached to AGENT's lease: deleted by etcd when the agent stops renewing
//   lease           the job lease's id; it and every log key are attached to the job lease,
//                   which every live agent renews: etcd deletes them once all agents are gone
// Every agent feeds the same events, in revision order, into its own JobReplay, so every
// agent computes the same decisions (ranks, rounds, restart count, abort and root cause).
// Time-based transitions (last call, join timeout) are "tick" events appended by whichever
// agent's clock says one is due; a vanished alive key becomes a "lost" event. Each event
// carries its appender's wall clock, and the replay runs the Job on that (monotonic) time.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "proto/messages.h"
#include "rendezvous/job.h"

namespace mg::rdzv::etcd {

struct Endpoint {
  bool tls = false;
  std::string host;
  int port = 2379;
  std::string text() const;  // http(s)://host:port
};

// "HOST[:PORT][,HOST2[:PORT]...]", each optionally etcd://, http:// or https:// (TLS).
// Default port 2379. Throws std::invalid_argument saying what is wrong.
std::vector<Endpoint> parse_endpoints(std::string_view text);

std::string base64_encode(std::string_view in);
// Throws std::invalid_argument on a character outside the alphabet.
std::string base64_decode(std::string_view in);
// The end of the key range holding every key that starts with `prefix` (etcd's range_end).
std::string prefix_end(std::string prefix);
// etcd's gateway writes 64-bit numbers as strings; absent fields are 0.
std::int64_t number(const nlohmann::json& j, const char* field);

struct Keys {
  std::string root;  // PREFIX/JOB/
  std::string log() const { return root + "log/"; }
  std::string alive() const { return root + "alive/"; }
  std::string lease() const { return root + "lease"; }  // the job lease's id, on that lease
  std::string log_key(const std::string& agent, std::int64_t seq) const;
  std::string alive_key(const std::string& agent) const { return alive() + agent; }
  // The agent of an alive key; empty when `key` is not one.
  std::string agent_of_alive(const std::string& key) const;
};
// A job id as one key component: '%' and '/' percent-encoded (nothing else), so that it
// holds no '/' and two ids never share a component.
std::string key_component(std::string_view id);
// The one place a job id becomes storage keys: PREFIX/key_component(JOB)/. No job's root is
// a prefix of another's (job "team" cannot reach the keys of job "team/exp1").
Keys keys_for(std::string prefix, const std::string& job);

// Splits the gateway's streamed response (JSON objects one after another, whatever the
// chunking) into whole objects. Throws std::runtime_error on malformed JSON or an object
// larger than max_bytes.
class JsonStream {
 public:
  explicit JsonStream(std::size_t max_bytes = 16u << 20) : max_(max_bytes) {}
  void feed(std::string_view bytes);
  std::optional<nlohmann::json> next();

 private:
  std::string buf_;
  std::size_t scanned_ = 0, start_ = 0;
  int depth_ = 0;
  bool in_string_ = false, escaped_ = false;
  std::size_t max_;
};

struct Event {
  enum class Kind { kJoin, kFailed, kDone, kLost, kTick };
  Kind kind = Kind::kTick;
  std::string agent;     // who the event is about (the appender, but for kLost)
  std::int64_t t_ms = 0; // the appender's wall clock (ms since the Unix epoch)
  proto::Join join;              // kJoin
  proto::WorkerFailed failed;    // kFailed
  int round = 0;                 // kDone
  std::string why;               // kLost
  // The appender's new run (rdzv::new_run()): the job's run is the first record's that has
  // one, the same for every agent that replays the log (#37). Empty: an agent before #37.
  std::string run;
};
nlohmann::json to_json(const Event& e);
// Throws std::invalid_argument on an unknown kind, a missing field or an invalid message.
Event event_from_json(const nlohmann::json& j);

class JobReplay {
 public:
  JobReplay(std::string job_id, std::string self_agent);
  // Applies the next event of the log; returns the messages the job sends to this agent.
  std::vector<proto::Frame> apply(const Event& e);
  // True when a tick at `now_ms` would change the job (a last call or a join timeout due).
  bool tick_due(std::int64_t now_ms) const;
  // True when `agent` joined and was not declared lost since.
  bool live(const std::string& agent) const;
  const Job& job() const { return job_; }
  std::int64_t time_ms() const { return vnow_; }
  // This agent joins again under a new id (its old one was lost): decisions for `agent` now.
  void set_self(std::string agent) { self_ = std::move(agent); }
  // The job's events (JobEvent) of the events applied since the last call, oldest first;
  // the last kMaxEvents are kept when nobody takes them (the backend prints none: every
  // agent replays every node's events).
  std::vector<JobEvent> take_events() { return std::exchange(events_, {}); }
  static constexpr std::size_t kMaxEvents = 1000;

 private:
  void heartbeat_all();
  Clock::time_point at() const;

  std::string self_;
  Job job_;
  std::map<std::string, SessionId> sessions_;
  std::set<std::string> gone_;
  std::int64_t vnow_ = 0;
  std::vector<JobEvent> events_;
};

}  // namespace mg::rdzv::etcd
