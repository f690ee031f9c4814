// Bounds on every field of the rendezvous messages, enforced by validate() on receipt and
// by truncate_to_limits() at the sender. They keep a daemon's memory per node and per
// reply bounded: an assignment listing kMaxListedNodes addresses of kMaxHostBytes each
// still fits in a default frame.
#pragma once

#include <cstddef>

namespace mg::proto {

inline constexpr std::size_t kMaxIdBytes = 256;        // job id, agent id
inline constexpr std::size_t kMaxHostBytes = 255;      // host names and addresses (DNS limit)
inline constexpr std::size_t kMaxTextBytes = 4096;     // messages, reasons
inline constexpr std::size_t kMaxLines = 32;           // stderr lines in a failure report
inline constexpr std::size_t kMaxLineBytes = 512;
inline constexpr std::size_t kNonceHexBytes = 64;      // 32 random bytes, hex
inline constexpr std::size_t kMacHexBytes = 64;        // HMAC-SHA256, hex
inline constexpr std::size_t kMaxListedNodes = 1024;   // node list sent with an assignment
inline constexpr int kMaxNodes = 1 << 20;
inline constexpr int kMaxNproc = 1 << 16;
inline constexpr int kMaxRestarts = 1000000;
inline constexpr int kMaxTimeoutMs = 24 * 86400 * 1000;  // 24 days (an int of milliseconds)
inline constexpr int kMinKeepAliveMs = 10;
inline constexpr int kMaxKeepAliveMs = 3600 * 1000;
inline constexpr int kMaxKeepAliveAttempts = 1000;

}  // namespace mg::proto
