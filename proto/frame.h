// Wire frames for the rendezvous protocol: a 4-byte big-endian length (of what follows),
// a 1-byte protocol version, a 1-byte message type, then a CBOR payload. encode() and
// decode() are pure: bytes in, frame or "need more" or error out; no I/O, no allocation
// before the length has been checked against the bound.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace mg::proto {

inline constexpr std::uint8_t kProtocolVersion = 1;
inline constexpr std::size_t kHeaderSize = 6;
inline constexpr std::size_t kDefaultMaxFrame = 1 << 20;  // 1 MiB

struct Frame {
  std::uint8_t type = 0;
  nlohmann::json payload;
};

// Serialises a frame; throws std::length_error when the payload exceeds max_frame.
std::vector<std::uint8_t> encode(const Frame& frame, std::size_t max_frame = kDefaultMaxFrame);

struct DecodeResult {
  enum class Status { kNeedMore, kOk, kError } status = Status::kNeedMore;
  Frame frame;               // valid when kOk
  std::size_t consumed = 0;  // bytes of the input that made up the frame (kOk)
  std::string error;         // one line (kError)
};

// Decodes the first frame in `bytes`. kNeedMore when the input is a valid prefix.
DecodeResult decode(std::span<const std::uint8_t> bytes, std::size_t max_frame = kDefaultMaxFrame);

}  // namespace mg::proto
