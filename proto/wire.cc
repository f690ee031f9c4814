#include "proto/wire.h"

#include <stdexcept>

#include <fmt/format.h>

namespace mg::proto {

namespace {

// Writes into a Wire's inline tail (bounds-checked).
struct TailOut {
  Wire& w;
  void push_back(std::uint8_t b) {
    if (w.tail_size >= w.tail.size()) throw std::length_error("wire tail overflow");
    w.tail[w.tail_size++] = b;
  }
  void append(const char* p, std::size_t n) {
    for (std::size_t i = 0; i < n; ++i) push_back(static_cast<std::uint8_t>(p[i]));
  }
};
struct VecOut {
  std::vector<std::uint8_t>& v;
  void push_back(std::uint8_t b) { v.push_back(b); }
  void append(const char* p, std::size_t n) { v.insert(v.end(), p, p + n); }
};

template <class Out>
void head(Out out, int major, std::uint64_t v) {
  const auto m = static_cast<std::uint8_t>(major << 5);
  auto be = [&](int bytes) {
    for (int shift = 8 * (bytes - 1); shift >= 0; shift -= 8) out.push_back(static_cast<std::uint8_t>(v >> shift));
  };
  if (v < 24) {
    out.push_back(static_cast<std::uint8_t>(m | v));
  } else if (v <= 0xff) {
    out.push_back(m | 24);
    be(1);
  } else if (v <= 0xffff) {
    out.push_back(m | 25);
    be(2);
  } else if (v <= 0xffffffffULL) {
    out.push_back(m | 26);
    be(4);
  } else {
    out.push_back(m | 27);
    be(8);
  }
}

template <class Out>
void integer(Out out, std::int64_t v) {
  if (v >= 0) head(out, 0, static_cast<std::uint64_t>(v));
  else head(out, 1, static_cast<std::uint64_t>(-1 - v));
}

template <class Out>
void text(Out out, std::string_view s) {
  head(out, 3, s.size());
  out.append(s.data(), s.size());
}

}  // namespace

namespace cbor {
void put_head(std::vector<std::uint8_t>& out, int major, std::uint64_t value) { head(VecOut{out}, major, value); }
void put_int(std::vector<std::uint8_t>& out, std::int64_t value) { integer(VecOut{out}, value); }
void put_text(std::vector<std::uint8_t>& out, std::string_view s) { text(VecOut{out}, s); }
}  // namespace cbor

void append_frame(const Wire& w, std::vector<std::uint8_t>& out, std::size_t max_frame, std::size_t trailer) {
  const std::size_t length = w.payload_size() + 2 + trailer;
  if (length > max_frame)
    throw std::length_error(fmt::format("frame of {} bytes exceeds the limit of {} bytes", length, max_frame));
  out.reserve(out.size() + 4 + length - trailer);
  for (int shift = 24; shift >= 0; shift -= 8) out.push_back(static_cast<std::uint8_t>(length >> shift));
  out.push_back(kProtocolVersion);
  out.push_back(w.type);
  if (w.body) out.insert(out.end(), w.body->begin(), w.body->end());
  out.insert(out.end(), w.tail.begin(), w.tail.begin() + w.tail_size);
}

Wire wire_of(const Frame& f) {
  Wire w;
  w.type = f.type;
  w.body = std::make_shared<const std::vector<std::uint8_t>>(nlohmann::json::to_cbor(f.payload));
  return w;
}

Frame frame_of(const Wire& w) {
  std::vector<std::uint8_t> payload;
  payload.reserve(w.payload_size());
  if (w.body) payload.insert(payload.end(), w.body->begin(), w.body->end());
  payload.insert(payload.end(), w.tail.begin(), w.tail.begin() + w.tail_size);
  if (auto bad = check_cbor(payload)) throw ProtocolError("message payload is not valid CBOR: " + *bad);
  Frame f;
  f.type = w.type;
  try {
    f.payload = nlohmann::json::from_cbor(payload);
  } catch (const nlohmann::json::exception& e) {
    throw ProtocolError(std::string("message payload is not valid CBOR: ") + e.what());
  }
  return f;
}

namespace {
void put_texts(std::vector<std::uint8_t>& out, const std::vector<std::string>& texts) {
  cbor::put_head(out, 4, texts.size());
  for (const auto& t : texts) cbor::put_text(out, t);
}
// The voters' standbys' addresses and takeover ports and the host's vote address
// (Assignment, Standby): four entries.
std::size_t standby_bytes(const std::vector<std::string>& nodes, const std::vector<int>& ports,
                          const std::string& host_vote_addr) {
  std::size_t bytes = 90 + 3 * ports.size() + host_vote_addr.size();
  for (const auto& n : nodes) bytes += 2 + n.size();
  return bytes;
}
void put_standbys(std::vector<std::uint8_t>& out, const std::vector<std::string>& nodes, const std::vector<int>& ports,
                  const std::string& host_vote_addr, int host_vote_port) {
  cbor::put_text(out, "host_vote_addr");
  cbor::put_text(out, host_vote_addr);
  cbor::put_text(out, "host_vote_port");
  cbor::put_int(out, host_vote_port);
  cbor::put_text(out, "standby_nodes");
  put_texts(out, nodes);
  cbor::put_text(out, "standby_takeover_ports");
  cbor::put_head(out, 4, ports.size());
  for (int p : ports) cbor::put_int(out, p);
}
}  // namespace

AssignmentEncoder::AssignmentEncoder(const Assignment& a) {
  // The shared fields first; operator() appends group_rank and rank_offset (the map's 17th
  // and 18th entries). Key order is free in CBOR maps: any decoder of ours reads them.
  auto body = std::make_shared<std::vector<std::uint8_t>>();
  auto& out = *body;
  std::size_t bytes = 104 + a.master_addr.size() + a.run.size();
  for (const auto& n : a.nodes) bytes += 2 + n.size();
  bytes += 20 + 3 * a.takeover_ports.size();
  for (const auto& v : a.voters) bytes += 2 + v.size();
  bytes += standby_bytes(a.standby_nodes, a.standby_takeover_ports, a.host_vote_addr);
  out.reserve(bytes);
  cbor::put_head(out, 5, 18);
  cbor::put_text(out, "epoch");
  cbor::put_int(out, a.epoch);
  cbor::put_text(out, "group_world_size");
  cbor::put_int(out, a.group_world_size);
  cbor::put_text(out, "master_addr");
  cbor::put_text(out, a.master_addr);
  cbor::put_text(out, "master_port");
  cbor::put_int(out, a.master_port);
  cbor::put_text(out, "nodes");
  put_texts(out, a.nodes);
  cbor::put_text(out, "restart_count");
  cbor::put_int(out, a.restart_count);
  cbor::put_text(out, "round");
  cbor::put_int(out, a.round);
  cbor::put_text(out, "run");
  cbor::put_text(out, a.run);
  put_standbys(out, a.standby_nodes, a.standby_takeover_ports, a.host_vote_addr, a.host_vote_port);
  cbor::put_text(out, "standbys");
  cbor::put_int(out, a.standbys);
  cbor::put_text(out, "takeover_ports");
  cbor::put_head(out, 4, a.takeover_ports.size());
  for (int p : a.takeover_ports) cbor::put_int(out, p);
  cbor::put_text(out, "voters");
  put_texts(out, a.voters);
  cbor::put_text(out, "world_size");
  cbor::put_int(out, a.world_size);
  body_ = std::move(body);
}

Wire AssignmentEncoder::operator()(int group_rank, int rank_offset) const {
  Wire w;
  w.type = static_cast<std::uint8_t>(MsgType::kAssignment);
  w.body = body_;
  TailOut out{w};  // at most 2 * (12 + 5) bytes
  text(out, "group_rank");
  integer(out, group_rank);
  text(out, "rank_offset");
  integer(out, rank_offset);
  return w;
}

StandbyEncoder::StandbyEncoder(const Standby& m) {
  // operator() appends position, the map's 13th entry.
  auto body = std::make_shared<std::vector<std::uint8_t>>();
  auto& out = *body;
  std::size_t bytes = 104 + m.run.size();
  for (const auto& n : m.nodes) bytes += 2 + n.size();
  bytes += 3 * m.takeover_ports.size();
  for (const auto& v : m.voters) bytes += 2 + v.size();
  bytes += standby_bytes(m.standby_nodes, m.standby_takeover_ports, m.host_vote_addr);
  out.reserve(bytes);
  cbor::put_head(out, 5, 13);
  cbor::put_text(out, "active_nodes");
  cbor::put_int(out, m.active_nodes);
  cbor::put_text(out, "epoch");
  cbor::put_int(out, m.epoch);
  cbor::put_text(out, "nodes");
  put_texts(out, m.nodes);
  cbor::put_text(out, "restart_count");
  cbor::put_int(out, m.restart_count);
  cbor::put_text(out, "round");
  cbor::put_int(out, m.round);
  cbor::put_text(out, "run");
  cbor::put_text(out, m.run);
  put_standbys(out, m.standby_nodes, m.standby_takeover_ports, m.host_vote_addr, m.host_vote_port);
  cbor::put_text(out, "takeover_ports");
  cbor::put_head(out, 4, m.takeover_ports.size());
  for (int p : m.takeover_ports) cbor::put_int(out, p);
  cbor::put_text(out, "voters");
  put_texts(out, m.voters);
  body_ = std::move(body);
}

Wire StandbyEncoder::operator()(int position) const {
  Wire w;
  w.type = static_cast<std::uint8_t>(MsgType::kStandby);
  w.body = body_;
  TailOut out{w};  // at most 9 + 5 bytes
  text(out, "position");
  integer(out, position);
  return w;
}

Wire to_wire(const Assignment& a) { return AssignmentEncoder(a)(a.group_rank, a.rank_offset); }

Wire to_wire(const Heartbeat& h) {
  Wire w;
  w.type = static_cast<std::uint8_t>(MsgType::kHeartbeat);
  TailOut out{w};
  head(out, 5, 2);  // at most 1 + 6 + 5 + 9 + 5 bytes
  text(out, "round");
  integer(out, h.round);
  text(out, "standbys");
  integer(out, h.standbys);
  return w;
}

}  // namespace mg::proto
