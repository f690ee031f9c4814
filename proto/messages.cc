#include "proto/messages.h"

#include <algorithm>
#include <limits>
#include <string_view>

#include <fmt/format.h>

#include "proto/text.h"

namespace mg::proto {

namespace {

// Each helper returns an error text, or "" when the value is fine.
std::string text(const char* field, const std::string& v, std::size_t max, bool required = false) {
  if (required && v.empty()) return fmt::format("{} is empty", field);
  if (v.size() > max) return fmt::format("{} is {} bytes long (limit {})", field, v.size(), max);
  if (auto bad = text_problem(v); !bad.empty()) return fmt::format("{} {}", field, bad);
  return {};
}

std::string hex(const char* field, const std::string& v, std::size_t len) {
  if (v.size() != len) return fmt::format("{} must be {} hex digits", field, len);
  for (char c : v)
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return fmt::format("{} must be lower-case hex", field);
  return {};
}

std::string range(const char* field, long long v, long long lo, long long hi) {
  if (v < lo || v > hi) return fmt::format("{} = {} is outside {}..{}", field, v, lo, hi);
  return {};
}

template <typename... S>
std::string first(S&&... errors) {
  std::string out;
  ((out.empty() && !errors.empty() ? (out = errors, 0) : 0), ...);
  return out;
}

std::string lines(const std::vector<std::string>& v) {
  if (v.size() > kMaxLines) return fmt::format("last_lines has {} lines (limit {})", v.size(), kMaxLines);
  for (const auto& l : v)
    if (auto e = text("a last line", l, kMaxLineBytes); !e.empty()) return e;
  return {};
}

// A round's node list and takeover ports (Assignment, Standby), or its standbys' (`of`
// "standby_").
std::string node_list(const std::vector<std::string>& nodes, const std::vector<int>& ports, const char* of = "") {
  if (nodes.size() > kMaxListedNodes)
    return fmt::format("{}nodes lists {} entries (limit {})", of, nodes.size(), kMaxListedNodes);
  for (const auto& n : nodes)
    if (auto bad = text("a node address", n, kMaxHostBytes); !bad.empty()) return bad;
  if (!ports.empty() && ports.size() != nodes.size())
    return fmt::format("{}takeover_ports lists {} entries for {} nodes", of, ports.size(), nodes.size());
  for (int p : ports)
    if (auto bad = range("a takeover port", p, 0, 65535); !bad.empty()) return bad;
  return {};
}

// The host's vote address (Assignment, Standby).
std::string host_vote(const std::string& addr, int port) {
  return first(text("host_vote_addr", addr, kMaxHostBytes), range("host_vote_port", port, 0, 65535));
}

// The voters of an epoch (Assignment, Standby): agent ids, at most kMaxListedNodes.
std::string voter_list(int epoch, const std::vector<std::string>& voters) {
  if (auto bad = range("epoch", epoch, 0, INT32_MAX); !bad.empty()) return bad;
  if (voters.size() > kMaxListedNodes)
    return fmt::format("voters lists {} entries (limit {})", voters.size(), kMaxListedNodes);
  for (const auto& v : voters)
    if (auto bad = text("a voter", v, kMaxIdBytes, true); !bad.empty()) return bad;
  return {};
}

}  // namespace

std::string run_problem(const std::string& run) {
  if (run.empty()) return {};
  const auto dash = run.find('-');
  const auto digits = [](std::string_view v, bool hex) {
    return !v.empty() && std::all_of(v.begin(), v.end(), [hex](char c) {
      return (c >= '0' && c <= '9') || (hex && c >= 'a' && c <= 'f');
    });
  };
  if (run.size() > kMaxRunBytes || dash == std::string::npos || dash > 19 ||
      !digits(std::string_view(run).substr(0, dash), false) || !digits(std::string_view(run).substr(dash + 1), true))
    return fmt::format("run '{}' is not MS-HEX (ms since the Unix epoch, a dash, lowercase hex; at most {} bytes)",
                       printable(run.substr(0, kMaxRunBytes)), kMaxRunBytes);
  return {};
}

std::string validate(const Hello& m) {
  return first(text("agent_id", m.agent_id, kMaxIdBytes), text("job_id", m.job_id, kMaxIdBytes, true),
               hex("nonce", m.nonce, kNonceHexBytes));
}
std::string validate(const Challenge& m) {
  return first(hex("nonce", m.nonce, kNonceHexBytes), hex("proof", m.proof, kMacHexBytes));
}
std::string validate(const Auth& m) { return hex("mac", m.mac, kMacHexBytes); }
std::string validate(const NotHosting& m) {
  return first(text("job_id", m.job_id, kMaxIdBytes, true), run_problem(m.run),
               text("host_agent", m.host_agent, kMaxHostBytes),
               m.proof.empty() ? std::string() : hex("proof", m.proof, kMacHexBytes));
}
std::string validate(const Welcome& m) {
  return first(text("server", m.server, kMaxIdBytes), text("host_agent", m.host_agent, kMaxHostBytes),
               range("round_epoch", m.round_epoch, 0, INT32_MAX), range("epoch", m.epoch, 0, INT32_MAX),
               range("last_round_epoch", m.last_round_epoch, 0, INT32_MAX), run_problem(m.run));
}

std::string validate(const Join& m) {
  auto e = first(text("job_id", m.job_id, kMaxIdBytes, true), text("agent_id", m.agent_id, kMaxIdBytes, true),
                 text("host", m.host, kMaxHostBytes), text("addr", m.addr, kMaxHostBytes, true),
                 range("nproc", m.nproc, 1, kMaxNproc), range("min_nodes", m.min_nodes, 1, kMaxNodes),
                 range("max_nodes", m.max_nodes, 1, kMaxNodes), range("max_restarts", m.max_restarts, 0, kMaxRestarts),
                 range("master_port", m.master_port, 0, 65535), range("last_call_ms", m.last_call_ms, 0, kMaxTimeoutMs),
                 range("join_timeout_ms", m.join_timeout_ms, 1, kMaxTimeoutMs),
                 range("keep_alive_ms", m.keep_alive_ms, kMinKeepAliveMs, kMaxKeepAliveMs),
                 range("keep_alive_max_attempt", m.keep_alive_max_attempt, 1, kMaxKeepAliveAttempts));
  if (!e.empty()) return e;
  if (m.min_nodes > m.max_nodes) return fmt::format("min_nodes {} > max_nodes {}", m.min_nodes, m.max_nodes);
  return first(range("node_rank", m.node_rank, -1, m.max_nodes - 1), range("resume_round", m.resume_round, 0, INT32_MAX),
               range("resume_group_world_size", m.resume_group_world_size, 0, m.max_nodes),
               range("resume_group_rank", m.resume_group_rank, -1, m.max_nodes - 1),
               range("resume_restart_count", m.resume_restart_count, 0, m.max_restarts),
               range("takeover_port", m.takeover_port, 0, 65535), range("vote_port", m.vote_port, 0, 65535),
               range("last_group_rank", m.last_group_rank, -1, m.max_nodes - 1), voter_list(m.epoch, m.voters),
               run_problem(m.run));
}

std::string validate(const Assignment& m) {
  auto e = first(range("round", m.round, 1, INT32_MAX), range("group_world_size", m.group_world_size, 1, kMaxNodes),
                 range("world_size", m.world_size, 1, INT32_MAX), range("master_port", m.master_port, 0, 65535),
                 range("restart_count", m.restart_count, 0, kMaxRestarts),
                 text("master_addr", m.master_addr, kMaxHostBytes, true));
  if (!e.empty()) return e;
  e = first(range("group_rank", m.group_rank, 0, m.group_world_size - 1),
            range("rank_offset", m.rank_offset, 0, m.world_size - 1));
  if (!e.empty()) return e;
  if (auto bad = range("standbys", m.standbys, 0, kMaxNodes); !bad.empty()) return bad;
  return first(node_list(m.nodes, m.takeover_ports), voter_list(m.epoch, m.voters), run_problem(m.run),
               node_list(m.standby_nodes, m.standby_takeover_ports, "standby_"),
               host_vote(m.host_vote_addr, m.host_vote_port));
}

std::string validate(const Heartbeat& m) {
  return first(range("round", m.round, 0, INT32_MAX), range("standbys", m.standbys, 0, kMaxNodes));
}

std::string validate(const WorkerFailed& m) {
  return first(range("round", m.round, 0, INT32_MAX), text("host", m.host, kMaxHostBytes),
               range("rank", m.rank, -1, INT32_MAX), range("local_rank", m.local_rank, -1, kMaxNproc),
               range("exit_code", m.exit_code, 0, 255), range("signal", m.signal, 0, 127),
               text("message", m.message, kMaxTextBytes), lines(m.last_lines));
}

std::string validate(const NodeDone& m) { return range("round", m.round, 0, INT32_MAX); }
std::string validate(const Restart& m) {
  return first(range("restart_count", m.restart_count, 0, kMaxRestarts), text("reason", m.reason, kMaxTextBytes));
}
std::string validate(const Abort& m) { return first(validate(m.root_cause), text("reason", m.reason, kMaxTextBytes)); }
std::string validate(const Done&) { return {}; }
std::string validate(const Error& m) { return text("message", m.message, kMaxTextBytes); }
std::string validate(const Standby& m) {
  auto e = first(range("active_nodes", m.active_nodes, 0, kMaxNodes), range("position", m.position, 1, kMaxNodes),
                 range("round", m.round, 0, INT32_MAX), range("restart_count", m.restart_count, 0, kMaxRestarts));
  return e.empty() ? first(node_list(m.nodes, m.takeover_ports), voter_list(m.epoch, m.voters), run_problem(m.run),
                           node_list(m.standby_nodes, m.standby_takeover_ports, "standby_"),
                           host_vote(m.host_vote_addr, m.host_vote_port))
                   : e;
}

std::string truncate_text(std::string t, std::size_t max_bytes) {
  if (t.size() <= max_bytes) return t;
  t.resize(max_bytes - 3);
  // Do not leave half a UTF-8 sequence before the ellipsis.
  while (!t.empty() && (static_cast<unsigned char>(t.back()) & 0xC0) == 0x80) t.pop_back();
  if (!t.empty() && (static_cast<unsigned char>(t.back()) & 0x80)) t.pop_back();
  return t + "...";
}

void truncate_to_limits(WorkerFailed& m) {
  m.host = truncate_text(printable(m.host), kMaxHostBytes);
  m.message = truncate_text(printable(m.message), kMaxTextBytes);
  if (m.last_lines.size() > kMaxLines)
    m.last_lines.erase(m.last_lines.begin(), m.last_lines.end() - static_cast<std::ptrdiff_t>(kMaxLines));
  for (auto& l : m.last_lines) l = truncate_text(printable(l), kMaxLineBytes);
}

void check_numbers(const nlohmann::json& j) {
  // Iterative: check_cbor bounds the depth, but this must not rely on it.
  std::vector<const nlohmann::json*> todo{&j};
  while (!todo.empty()) {
    const nlohmann::json* v = todo.back();
    todo.pop_back();
    if (v->is_structured()) {
      for (const auto& child : *v) todo.push_back(&child);
    } else if (v->is_number_float()) {
      throw ProtocolError("malformed message: a number is not an integer");
    } else if (v->is_number_unsigned()) {
      if (v->get<std::uint64_t>() > static_cast<std::uint64_t>(std::numeric_limits<std::int32_t>::max()))
        throw ProtocolError("malformed message: a number does not fit in 32 bits");
    } else if (v->is_number_integer()) {
      const auto x = v->get<std::int64_t>();
      if (x < std::numeric_limits<std::int32_t>::min() || x > std::numeric_limits<std::int32_t>::max())
        throw ProtocolError("malformed message: a number does not fit in 32 bits");
    }
  }
}

}  // namespace mg::proto
