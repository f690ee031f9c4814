// The preflight check's transport (ops/preflight.cc runs the check over it): TCP sockets
// with deadlines and a cancel descriptor, the control messages (length-prefixed JSON, with
// frame MACs once both ends proved the job key), the admission of connections that arrive
// side by side (admit()), and one timed transfer (exchange()). Blocking calls, each bounded
// by its deadline; a readable `cancel_fd` (-1: none) ends any wait early. Internal to ops/.
#pragma once

#include <sys/socket.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <set>
#include <string>

#include <nlohmann/json.hpp>

#include "process/fd.h"
#include "rendezvous/auth.h"

namespace mg::preflight {

using Clock = std::chrono::steady_clock;
using TimePoint = Clock::time_point;

inline constexpr std::uint32_t kMagic = 0x4d475046;  // "MGPF": a data connection's first word
inline constexpr std::size_t kTagBytes = 64;         // a data connection's tag (hex), after its magic and rank
inline constexpr std::size_t kHeaderBytes = 8 + kTagBytes;
inline constexpr int kBacklog = 128;  // every listener's accept queue (the coordinator's too)

// A control connection, with its frame MACs once both ends proved the job key (none
// without a key).
struct Link {
  Fd fd;
  std::optional<rdzv::auth::FrameMac> out, in;
  explicit operator bool() const { return static_cast<bool>(fd); }
};

// Waits for `events` on fd until `deadline`: 1 ready, 0 timed out, -1 cancelled.
int wait_fd(int fd, short events, TimePoint deadline, int cancel_fd);

// A listener on `host` (its first address that binds here), else on every IPv4 address;
// port 0 unless given. Sets `port` to the one bound. Fails when the lookup of `host` got no
// answer by `deadline` (at most 20 s) or was cancelled.
Fd listen_on(const std::string& host, int want_port, bool reuse, int& port, std::string& error, TimePoint deadline,
             int cancel_fd);

// Connects to host:port by `deadline`; with `retry_refused`, a refusal is tried again
// (every 20 ms: the listener may not be up yet). `host` is looked up once, bounded by
// `deadline` (at most 20 s) and ended by `cancel_fd`.
// With `source`, the connection comes from that address of this host when it binds (so
// the far end can tell a node's connection by its address), else from any.
Fd connect_to(const std::string& host, int port, TimePoint deadline, bool retry_refused, int cancel_fd,
              std::string& error, const std::string& source = {});

// Sends all n bytes by `deadline`.
bool send_all(int fd, const void* data, std::size_t n, TimePoint deadline, int cancel_fd, std::string& error);

// Control messages: a 4-byte big-endian length, then JSON, then (with a key) the frame's
// MAC (rendezvous/auth.h: HMAC-SHA256 under the session key, the length field counting it).
bool send_msg(int fd, rdzv::auth::FrameMac* mac, const nlohmann::json& j, TimePoint deadline, int cancel_fd,
              std::string& error);
bool send_msg(Link& l, const nlohmann::json& j, TimePoint deadline, int cancel_fd, std::string& error);
// The next control message on `l` (its MAC checked with a key); nullopt with `error` set.
std::optional<nlohmann::json> recv_msg(Link& l, TimePoint deadline, int cancel_fd, std::string& error);

// A connection accepted and not yet admitted: the bytes it sent so far (never more than
// `need`: what comes after its first messages is not ours to read here).
struct Pending {
  Fd fd;
  TimePoint since;
  std::string from;  // its source address (text; an IPv4-mapped IPv6 one as IPv4)
  std::size_t need = 4;
  std::string in;
  int stage = 0;  // the admission's own
  int rank = -1, port = 0;
  std::string client_nonce, server_nonce;
};
enum class Step { kMore, kDrop, kAdmitted };

// The next unsigned control message of a pending connection: nullopt while it is not all
// there (`bad` set when it never can be: too long, or not a JSON object).
std::optional<nlohmann::json> pending_msg(Pending& p, bool& bad);

// Every address `host` resolves to, as addr_text() writes them (none when its lookup got no
// answer by `deadline`, at most 20 s, or was cancelled).
std::set<std::string> addresses_of(const std::string& host, TimePoint deadline, int cancel_fd);

// What admit() turned away to keep its table: connections closed unadmitted for want of
// room, and from where (the first few addresses).
struct Flood {
  std::size_t turned_away = 0;
  std::set<std::string> from;
  void add(const std::string& a) {
    ++turned_away;
    if (from.size() < 8) from.insert(a);
  }
  std::string text() const;  // "N connections from A, B turned away for want of room"
};

// Accepts connections on `listener` and hands each one's bytes to `step` as they come, none
// waiting for another, until `complete()` or `until`. A connection that is not admitted
// within kPatience, or sends more than its first messages may be, or that `step` refuses,
// is closed. What a connection sent before it was accepted is read at once, so a node's
// hello is never taken for silence. Room: at most kMaxPending wait at once, at most
// kPerAddress from one address (a newer one pushes out that address's oldest); when the
// table is full a connection from a node's own address (`of_node`) pushes out one from
// elsewhere, and one from elsewhere only a connection silent for kSilent; else it is
// closed (counted in `flood`). So strangers that never say a valid hello cost the check
// neither its time nor a node's place; a node turned away connects again. `step` moves the
// descriptor of a connection it admits. 1: complete, 0: `until` passed, -1: cancelled.
int admit(int listener, std::size_t first_need, TimePoint until, int cancel_fd,
          const std::function<Step(Pending&)>& step, const std::function<bool()>& complete,
          const std::function<bool(const std::string&)>& of_node, Flood& flood);

// One timed transfer: sends `sn` bytes of `sbuf` on `out` while it receives `rn` bytes on
// `in` (into `rbuf`, or a scratch buffer when null). With `cap`, the send stops `cap`
// after it began and the receive `cap` after its first byte. `rate` paces the sends.
// With `cap` (a timed round), the send begins only once its receiver said it is ready (one
// byte back on the data connection, sent here on `in` as this node starts receiving): a
// sender that began before its receiver came to the round would fill the socket buffers,
// and the receiver, reading that backlog at once, would rate the link by how fast it read
// its own buffer (a node paced to 2 MB/s was rated above 9 MB/s on a loaded machine).
struct Xfer {
  std::size_t sent = 0, received = 0;
  TimePoint first{}, last{};
  std::string send_error, recv_error;
  bool recv_timed_out = false;
  double seconds() const { return std::max(std::chrono::duration<double>(last - first).count(), 1e-6); }
};

Xfer exchange(int out, const char* sbuf, std::size_t sn, int in, char* rbuf, std::size_t rn, TimePoint deadline,
              std::chrono::milliseconds cap, double rate, int cancel_fd);

}  // namespace mg::preflight
