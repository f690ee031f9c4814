// Wire: messages encoded once, ready to be framed for any number of connections. A
// broadcast (an abort, a restart, "done") is encoded once and its bytes shared by every
// recipient; the assignments of a round share one encoding of the fields every node gets
// (the node list included) and differ only in a small inline tail (group rank, rank
// offset), so closing a round of N nodes costs O(N) bytes, not O(N * nodes listed).
// Assignments and heartbeats are written straight as CBOR (no nlohmann tree); the other
// messages go through nlohmann once. Pure: bytes in, bytes out, no I/O.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <string_view>
#include <vector>

#include "proto/frame.h"
#include "proto/messages.h"

namespace mg::proto {

struct Wire {
  std::uint8_t type = 0;
  // CBOR; the map header at its start counts the entries of `tail` too.
  std::shared_ptr<const std::vector<std::uint8_t>> body;
  std::array<std::uint8_t, 40> tail{};
  std::uint8_t tail_size = 0;
  std::size_t payload_size() const { return (body ? body->size() : 0) + tail_size; }
};

inline MsgType type_of(const Wire& w) { return static_cast<MsgType>(w.type); }

// Appends the frame of `w` (header and payload; the length counts `trailer` more bytes,
// written by the caller) to `out`. Throws std::length_error, leaving `out` as it was, when
// the frame would exceed max_frame.
void append_frame(const Wire& w, std::vector<std::uint8_t>& out, std::size_t max_frame = kDefaultMaxFrame,
                  std::size_t trailer = 0);

// Any frame, through nlohmann's CBOR writer.
Wire wire_of(const Frame& f);
template <typename T>
Wire to_wire(const T& msg) {
  return wire_of(to_frame(msg));
}
Wire to_wire(const Assignment& a);  // direct
Wire to_wire(const Heartbeat& h);   // direct

// The frame a Wire decodes to (tests, in-process consumers such as the etcd backend).
// Throws ProtocolError when the payload is not one valid CBOR item.
Frame frame_of(const Wire& w);
template <typename T>
T from_frame(const Wire& w) {
  return from_frame<T>(frame_of(w));
}

// The assignments of one round: constructed from the fields every node shares (its
// group_rank and rank_offset are ignored), then one Wire per node.
class AssignmentEncoder {
 public:
  explicit AssignmentEncoder(const Assignment& shared);
  Wire operator()(int group_rank, int rank_offset) const;

 private:
  std::shared_ptr<const std::vector<std::uint8_t>> body_;
};

// The Standby messages of a job's standbys: the fields they share (the round's node list
// included) encoded once, then one Wire per standby with its position.
class StandbyEncoder {
 public:
  explicit StandbyEncoder(const Standby& shared);
  Wire operator()(int position) const;

 private:
  std::shared_ptr<const std::vector<std::uint8_t>> body_;
};

// The CBOR items our messages use, in their shortest form (as nlohmann writes them).
namespace cbor {
void put_head(std::vector<std::uint8_t>& out, int major, std::uint64_t value);
void put_int(std::vector<std::uint8_t>& out, std::int64_t value);
void put_text(std::vector<std::uint8_t>& out, std::string_view text);
}  // namespace cbor

}  // namespace mg::proto
