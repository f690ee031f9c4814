// Wire frames for the rendezvous protocol: a 4-byte big-endian length (of what follows),
// a 1-byte protocol version, a 1-byte message type, a CBOR payload and, once a session is
// authenticated, a trailer (the 32-byte frame MAC, see rendezvous/auth.h). encode() and
// decode() are pure: bytes in, frame or "need more" or error out; no I/O, no allocation
// before the length has been checked against the bound, and the CBOR structure (nesting
// depth, declared lengths) is checked iteratively before nlohmann parses it, so no input
// can make the parser recurse deeply or reserve more than the frame holds.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace mg::proto {

// 2: mutual authentication, per-job keys, frame MACs, heartbeat echo.
inline constexpr std::uint8_t kProtocolVersion = 2;
inline constexpr std::size_t kHeaderSize = 6;
inline constexpr std::size_t kDefaultMaxFrame = 1 << 20;  // 1 MiB
inline constexpr std::size_t kHandshakeMaxFrame = 4096;   // until the handshake is done
inline constexpr std::size_t kMaxDepth = 16;              // CBOR nesting (our messages use 3)

struct Frame {
  std::uint8_t type = 0;
  nlohmann::json payload;
};

// Serialises a frame with room for `trailer` bytes (written by the caller after the CBOR);
// throws std::length_error when the frame exceeds max_frame.
std::vector<std::uint8_t> encode(const Frame& frame, std::size_t max_frame = kDefaultMaxFrame,
                                 std::size_t trailer = 0);

struct DecodeResult {
  enum class Status { kNeedMore, kOk, kError } status = Status::kNeedMore;
  Frame frame;               // valid when kOk
  std::size_t consumed = 0;  // bytes of the input that made up the frame (kOk)
  std::string error;         // one line (kError)
};

// The total size (4 + length) of the frame that starts `bytes`, once its 4-byte length
// and version are known and valid; kNeedMore/kError otherwise (consumed holds the size).
DecodeResult peek(std::span<const std::uint8_t> bytes, std::size_t max_frame = kDefaultMaxFrame);

// Decodes the first frame in `bytes`, whose last `trailer` bytes are not CBOR. kNeedMore
// when the input is a valid prefix.
DecodeResult decode(std::span<const std::uint8_t> bytes, std::size_t max_frame = kDefaultMaxFrame,
                    std::size_t trailer = 0);

// Checks that `cbor` is exactly one well-formed CBOR item of definite lengths, no tags,
// nested at most max_depth deep, whose declared lengths fit in the input. Iterative.
std::optional<std::string> check_cbor(std::span<const std::uint8_t> cbor, std::size_t max_depth = kMaxDepth);

}  // namespace mg::proto
