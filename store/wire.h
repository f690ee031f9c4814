// The wire of c10d's classic TCPStore, as torch's clients speak it: a query is one type
// byte and its arguments; strings and byte vectors are a uint64 length and the bytes;
// numbers are host-order (little-endian) integers. Two dialects share the socket:
//  - torch 1.x (checked with 1.13): SET=0 COMPARE_SET=1 GET=2 ADD=3 CHECK=4 WAIT=5
//    GETNUMKEYS=6 WATCH_KEY=7 DELETE_KEY=8, no handshake;
//  - torch 2.x: VALIDATE=0 (with the magic 0x3C85F7CE, the first query of every
//    connection) SET=1 COMPARE_SET=2 GET=3 ADD=4 CHECK=5 WAIT=6 GETNUMKEYS=7 DELETE_KEY=8
//    APPEND=9 MULTI_GET=10 MULTI_SET=11 CANCEL_WAIT=12 PING=13.
// A connection's first query tells them apart: type 0 followed by the magic is 2.x's
// VALIDATE (as a 1.x SET it would announce a key of ~1 GB); anything else is 1.x.
// Pure: bytes in, a query or "need more" or an error out.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace mg::store {

inline constexpr std::uint32_t kValidationMagic = 0x3C85F7CE;

enum class Dialect : std::uint8_t { kUnknown, kV1, kV2 };

enum class Op : std::uint8_t {
  kValidate, kSet, kCompareSet, kGet, kAdd, kCheck, kWait, kNumKeys, kDelete, kAppend, kMultiGet, kMultiSet,
  kCancelWait, kPing, kWatchKey
};
std::string_view op_name(Op op);

struct Query {
  Op op = Op::kSet;
  std::vector<std::string> keys;    // one for most ops; several for CHECK, WAIT, MULTI_*
  std::vector<std::string> values;  // SET/APPEND: 1; COMPARE_SET: expected, desired; MULTI_SET: one per key
  std::int64_t number = 0;          // ADD's amount, PING's nonce
};

struct Limits {
  std::size_t max_key = 64 * 1024;
  std::size_t max_value = std::size_t{64} << 20;
  std::size_t max_keys = 65536;  // per CHECK/WAIT/MULTI_* query
  // One whole query, bytes: two of the largest keys and values with their headers (a
  // MULTI_SET, a COMPARE_SET: the type, a count, a length before each string); the store
  // server holds at most its max_buffered for all clients' queries.
  std::size_t max_query = 1 + 8 + 2 * (8 + max_key + 8 + max_value);
};

struct Parsed {
  enum Status { kNeedMore, kOk, kBad } status = kNeedMore;
  std::size_t consumed = 0;  // bytes of the query (kOk)
  // kNeedMore: the query cannot be whole before this many bytes are there (a length field
  // already read says so); parsing again earlier finds nothing new.
  std::size_t need = 0;
  Query query;
  std::string error;  // kBad: what was wrong, e.g. "key of 70000 bytes is over 65536"
  std::size_t fields = 0;  // length fields this call read: a measure of its work (for tests)
};

// How far the lengths of an unfinished multi-key query (CHECK, WAIT, MULTI_GET, MULTI_SET)
// have been checked. Handed back with the same query's bytes grown, the check goes on
// from there instead of from the first key, so a query costs work linear in its bytes
// however it trickles in (not quadratic: a 128 MiB CHECK of small keys cost minutes).
// Start each query with a fresh one ({}).
struct Progress {
  std::size_t pos = 0;       // bytes of the query checked (0: not started)
  std::uint64_t fields = 0;  // key (and value) fields still to check
};

// Parses the first query of `in`. `dialect` is the connection's; with kUnknown this is its
// first query and decides it (set on kOk). `progress` (may be null) is where an earlier
// call on the start of the same query got to; on kNeedMore it says where this one did.
Parsed parse_query(std::string_view in, Dialect& dialect, const Limits& limits = {}, Progress* progress = nullptr);

// Replies, as the clients read them.
void put_u8(std::string& out, std::uint8_t v);
void put_i64(std::string& out, std::int64_t v);
void put_u32(std::string& out, std::uint32_t v);
void put_bytes(std::string& out, std::string_view bytes);  // uint64 length + bytes

// CHECK's answer bytes; WAIT's "stop waiting" and "wait canceled".
inline constexpr std::uint8_t kCheckReady = 0, kCheckNotReady = 1;
inline constexpr std::uint8_t kStopWaiting = 0, kWaitCanceled = 1;

}  // namespace mg::store
