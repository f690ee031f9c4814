#include "ops/preflight.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <deque>
#include <map>
#include <optional>
#include <set>
#include <stdexcept>
#include <thread>
#include <utility>

#include <fmt/format.h>

#include "process/fd.h"
#include "process/thread.h"
#include "rendezvous/auth.h"

namespace mg::preflight {

namespace {

using Clock = std::chrono::steady_clock;
using TimePoint = Clock::time_point;
using std::chrono::milliseconds;
namespace auth = mg::rdzv::auth;

constexpr std::size_t kMaxMessage = 1 << 20;  // a control message (a node's report is a few KiB)
constexpr std::size_t kChunk = 256 * 1024;    // one send or receive call
constexpr std::size_t kBurst = 64 * 1024;     // what a paced sender may send at once
constexpr std::uint32_t kMagic = 0x4d475046;  // "MGPF": a data connection's first word
constexpr std::size_t kTagBytes = 64;         // a data connection's tag (hex), after its magic and rank
constexpr std::size_t kHeaderBytes = 8 + kTagBytes;
// A connection not yet admitted (a node's hello and proof, a peer's data header): at most
// this many wait at once, each for at most kPatience, each message at most kMaxHello.
constexpr std::size_t kMaxPending = 64;
constexpr milliseconds kPatience{2000};
constexpr std::size_t kMaxHello = 4096;
constexpr int kBacklog = 128;  // every listener's accept queue (the coordinator's too)
// How much longer than the coordinator a node waits for its word: the coordinator's own
// time-out (a node that never came) must reach the others before theirs.
constexpr std::chrono::milliseconds kGrace{2000};

// A control connection, with its frame MACs once both ends proved the job key (none
// without a key).
struct Link {
  Fd fd;
  std::optional<auth::FrameMac> out, in;
  explicit operator bool() const { return static_cast<bool>(fd); }
};

int ms_until(TimePoint t) {
  const auto d = std::chrono::ceil<milliseconds>(t - Clock::now()).count();
  return static_cast<int>(std::clamp<long long>(d, 0, 60'000));
}

// Waits for `events` on fd until `deadline`: 1 ready, 0 timed out, -1 cancelled.
int wait_fd(int fd, short events, TimePoint deadline, int cancel_fd) {
  for (;;) {
    pollfd p[2] = {{fd, events, 0}, {cancel_fd, POLLIN, 0}};
    const int r = ::poll(p, cancel_fd >= 0 ? 2 : 1, ms_until(deadline));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return -1;
    if (cancel_fd >= 0 && p[1].revents) return -1;
    if (r > 0) return 1;
    if (Clock::now() >= deadline) return 0;
  }
}

void set_nonblocking(int fd) {
  const int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);
}

struct Addr {
  sockaddr_storage ss{};
  socklen_t len = 0;
  int family = AF_INET;
  const sockaddr* sa() const { return reinterpret_cast<const sockaddr*>(&ss); }
};

std::vector<Addr> resolve(const std::string& host, int port, std::string& error) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* res = nullptr;
  const int rc = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res);
  std::vector<Addr> out;
  if (rc != 0) {
    error = fmt::format("cannot resolve '{}': {}", host, ::gai_strerror(rc));
    return out;
  }
  for (addrinfo* a = res; a; a = a->ai_next) {
    if (a->ai_addrlen > sizeof(sockaddr_storage)) continue;
    Addr x;
    std::memcpy(&x.ss, a->ai_addr, a->ai_addrlen);
    x.len = a->ai_addrlen;
    x.family = a->ai_family;
    out.push_back(x);
  }
  ::freeaddrinfo(res);
  return out;
}

// A listener on `host` (its first address that binds here), else on every IPv4 address;
// port 0 unless given. Sets `port` to the one bound.
Fd listen_on(const std::string& host, int want_port, bool reuse, int& port, std::string& error) {
  std::string why;
  std::vector<Addr> addrs = host.empty() ? std::vector<Addr>{} : resolve(host, want_port, why);
  Addr any;
  auto* in = reinterpret_cast<sockaddr_in*>(&any.ss);
  in->sin_family = AF_INET;
  in->sin_port = htons(static_cast<std::uint16_t>(want_port));
  in->sin_addr.s_addr = htonl(INADDR_ANY);
  any.len = sizeof(sockaddr_in);
  addrs.push_back(any);
  for (const auto& a : addrs) {
    Fd fd(::socket(a.family, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (!fd) continue;
    const int one = 1;
    if (reuse) ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(fd.get(), a.sa(), a.len) != 0 || ::listen(fd.get(), kBacklog) != 0) {
      error = fmt::format("cannot listen on {}:{}: {}", host.empty() ? "*" : host, want_port, std::strerror(errno));
      continue;
    }
    sockaddr_storage ss{};
    socklen_t len = sizeof(ss);
    ::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&ss), &len);
    port = ntohs(ss.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port
                                          : reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
    set_nonblocking(fd.get());
    error.clear();
    return fd;
  }
  return Fd();
}

// Connects to host:port by `deadline`; with `retry_refused`, a refusal is tried again
// (every 20 ms: the listener may not be up yet).
// With `source`, the connection comes from that address of this host when it binds (so
// the far end can tell a node's connection by its address), else from any.
Fd connect_to(const std::string& host, int port, TimePoint deadline, bool retry_refused, int cancel_fd,
              std::string& error, const std::string& source = {}) {
  std::string ignored;
  const std::vector<Addr> sources = source.empty() ? std::vector<Addr>{} : resolve(source, 0, ignored);
  for (;;) {
    std::vector<Addr> addrs = resolve(host, port, error);
    if (addrs.empty()) return Fd();
    bool refused = false;
    for (const auto& a : addrs) {
      Fd fd(::socket(a.family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
      if (!fd) continue;
      for (const auto& src : sources)
        if (src.family == a.family && ::bind(fd.get(), src.sa(), src.len) == 0) break;
      int err = 0;
      if (::connect(fd.get(), a.sa(), a.len) != 0) {
        err = errno;
        if (err == EINPROGRESS) {
          const int w = wait_fd(fd.get(), POLLOUT, deadline, cancel_fd);
          if (w <= 0) {
            error = fmt::format("cannot connect to {}:{}: {}", host, port, w == 0 ? "timed out" : "cancelled");
            return Fd();
          }
          socklen_t len = sizeof(err);
          ::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len);
        }
      }
      if (err == 0) {
        set_nonblocking(fd.get());
        error.clear();
        return fd;
      }
      refused = refused || err == ECONNREFUSED;
      error = fmt::format("cannot connect to {}:{}: {}", host, port, std::strerror(err));
    }
    if (!retry_refused || !refused) return Fd();
    const TimePoint next = std::min(deadline, Clock::now() + milliseconds(20));
    if (Clock::now() >= deadline) return Fd();
    if (cancel_fd >= 0) {
      if (wait_fd(cancel_fd, POLLIN, next, -1) != 0) {
        error = "cancelled";
        return Fd();
      }
    } else {
      std::this_thread::sleep_until(next);
    }
  }
}

bool send_all(int fd, const void* data, std::size_t n, TimePoint deadline, int cancel_fd, std::string& error) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w = ::send(fd, p, n, MSG_NOSIGNAL);
    if (w > 0) {
      p += w;
      n -= static_cast<std::size_t>(w);
      continue;
    }
    if (w < 0 && errno == EINTR) continue;
    if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      const int r = wait_fd(fd, POLLOUT, deadline, cancel_fd);
      if (r <= 0) {
        error = r == 0 ? "timed out sending" : "cancelled";
        return false;
      }
      continue;
    }
    error = fmt::format("send: {}", std::strerror(errno));
    return false;
  }
  return true;
}

bool recv_all(int fd, void* data, std::size_t n, TimePoint deadline, int cancel_fd, std::string& error) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    const ssize_t r = ::recv(fd, p, n, 0);
    if (r > 0) {
      p += r;
      n -= static_cast<std::size_t>(r);
      continue;
    }
    if (r == 0) {
      error = "the peer closed the connection";
      return false;
    }
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      const int w = wait_fd(fd, POLLIN, deadline, cancel_fd);
      if (w <= 0) {
        error = w == 0 ? "timed out" : "cancelled";
        return false;
      }
      continue;
    }
    error = fmt::format("recv: {}", std::strerror(errno));
    return false;
  }
  return true;
}

std::optional<nlohmann::json> parse_body(std::string_view body, std::string& error) {
  auto j = nlohmann::json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    error = "a malformed control message";
    return std::nullopt;
  }
  return j;
}

// Control messages: a 4-byte big-endian length, then JSON, then (with a key) the frame's
// MAC (rendezvous/auth.h: HMAC-SHA256 under the session key, the length field counting it).
bool send_msg(int fd, auth::FrameMac* mac, const nlohmann::json& j, TimePoint deadline, int cancel_fd,
              std::string& error) {
  const std::string body = j.dump();
  const std::uint32_t len = htonl(static_cast<std::uint32_t>(body.size() + (mac ? auth::kFrameMacBytes : 0)));
  std::vector<std::uint8_t> frame(sizeof(len) + body.size());
  std::memcpy(frame.data(), &len, sizeof(len));
  std::memcpy(frame.data() + sizeof(len), body.data(), body.size());
  if (mac) mac->sign(frame);
  return send_all(fd, frame.data(), frame.size(), deadline, cancel_fd, error);
}

bool send_msg(Link& l, const nlohmann::json& j, TimePoint deadline, int cancel_fd, std::string& error) {
  return send_msg(l.fd.get(), l.out ? &*l.out : nullptr, j, deadline, cancel_fd, error);
}

std::optional<nlohmann::json> recv_msg(Link& l, TimePoint deadline, int cancel_fd, std::string& error) {
  std::uint32_t len = 0;
  if (!recv_all(l.fd.get(), &len, sizeof(len), deadline, cancel_fd, error)) return std::nullopt;
  len = ntohl(len);
  if (len > kMaxMessage) {
    error = fmt::format("a control message of {} bytes (at most {})", len, kMaxMessage);
    return std::nullopt;
  }
  std::vector<std::uint8_t> frame(sizeof(len) + len);
  const std::uint32_t be = htonl(len);
  std::memcpy(frame.data(), &be, sizeof(be));
  if (!recv_all(l.fd.get(), frame.data() + sizeof(len), len, deadline, cancel_fd, error)) return std::nullopt;
  std::size_t end = frame.size();
  if (l.in) {
    if (len < auth::kFrameMacBytes || !l.in->verify(frame)) {
      error = "a control message whose MAC is wrong (forged or altered on the way)";
      return std::nullopt;
    }
    end -= auth::kFrameMacBytes;
  }
  return parse_body(std::string_view(reinterpret_cast<const char*>(frame.data()) + sizeof(len), end - sizeof(len)),
                    error);
}

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
std::optional<nlohmann::json> pending_msg(Pending& p, bool& bad) {
  if (p.in.size() < p.need) return std::nullopt;
  if (p.need == 4) {
    std::uint32_t len = 0;
    std::memcpy(&len, p.in.data(), sizeof(len));
    len = ntohl(len);
    if (len == 0 || len > kMaxHello - 4) bad = true;
    p.need = 4 + len;
    return std::nullopt;
  }
  std::string error;
  auto j = parse_body(std::string_view(p.in).substr(4), error);
  p.in.clear();
  p.need = 4;
  if (!j) bad = true;
  return j;
}

// An address as text, an IPv4-mapped IPv6 one as its IPv4 ("" when neither family).
std::string addr_text(const sockaddr_storage& ss) {
  char buf[INET6_ADDRSTRLEN] = {};
  if (ss.ss_family == AF_INET) {
    ::inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(&ss)->sin_addr, buf, sizeof(buf));
  } else if (ss.ss_family == AF_INET6) {
    const auto& a6 = reinterpret_cast<const sockaddr_in6*>(&ss)->sin6_addr;
    if (IN6_IS_ADDR_V4MAPPED(&a6)) ::inet_ntop(AF_INET, &a6.s6_addr[12], buf, sizeof(buf));
    else ::inet_ntop(AF_INET6, &a6, buf, sizeof(buf));
  }
  return buf;
}

// Every address `host` resolves to, as addr_text() writes them.
std::set<std::string> addresses_of(const std::string& host) {
  std::string error;
  std::set<std::string> out;
  for (const auto& a : resolve(host, 0, error)) out.insert(addr_text(a.ss));
  return out;
}

// What admit() turned away to keep its table: connections closed unadmitted for want of
// room, and from where (the first few addresses).
struct Flood {
  std::size_t turned_away = 0;
  std::set<std::string> from;
  void add(const std::string& a) {
    ++turned_away;
    if (from.size() < 8) from.insert(a);
  }
  std::string text() const {
    std::string list;
    for (const auto& a : from) list += (list.empty() ? "" : ", ") + a;
    return fmt::format("{} connection{} from {} turned away for want of room", turned_away, turned_away == 1 ? "" : "s",
                       list);
  }
};

// Feeds what a pending connection has sent to `step`, one read after another until it
// would block or `step` decides: kMore (waits for more), kDrop or kAdmitted.
Step feed(Pending& p, const std::function<Step(Pending&)>& step) {
  for (int reads = 0; reads < 8; ++reads) {
    char buf[kMaxHello];
    const ssize_t got = ::recv(p.fd.get(), buf, std::min(sizeof(buf), p.need - p.in.size()), 0);
    if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return Step::kMore;
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) return Step::kDrop;
    p.in.append(buf, static_cast<std::size_t>(got));
    Step st = Step::kDrop;
    try {
      st = step(p);
    } catch (const nlohmann::json::exception&) {  // a field of the wrong type
      st = Step::kDrop;
    }
    if (st != Step::kMore) return st;
  }
  return Step::kMore;
}

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
constexpr std::size_t kPerAddress = 4;
constexpr milliseconds kSilent{100};
constexpr milliseconds kAcceptPause{100};  // after EMFILE and the like (proto/accept_backoff.h's pause)
int admit(int listener, std::size_t first_need, TimePoint until, int cancel_fd,
          const std::function<Step(Pending&)>& step, const std::function<bool()>& complete,
          const std::function<bool(const std::string&)>& of_node, Flood& flood) {
  ::fcntl(listener, F_SETFL, ::fcntl(listener, F_GETFL) | O_NONBLOCK);
  std::deque<Pending> pending;  // oldest first
  std::vector<pollfd> fds;
  TimePoint accepts_paused_until{};
  // Makes room for a new connection from `from`: false when it must go instead.
  auto make_room = [&](const std::string& from, TimePoint now) {
    auto oldest = [&](auto pred) { return std::find_if(pending.begin(), pending.end(), pred); };
    auto it = pending.end();
    if (std::count_if(pending.begin(), pending.end(), [&](const Pending& x) { return x.from == from; }) >=
        static_cast<long>(kPerAddress))
      it = oldest([&](const Pending& x) { return x.from == from; });
    else if (pending.size() < kMaxPending)
      return true;
    else if (of_node(from))
      it = oldest([&](const Pending& x) { return !of_node(x.from); });
    if (it == pending.end())
      it = oldest([&](const Pending& x) {
        return x.in.empty() && x.stage == 0 && now - x.since >= kSilent && (!of_node(x.from) || of_node(from));
      });
    if (it == pending.end()) return false;
    flood.add(it->from);
    pending.erase(it);
    return true;
  };
  while (!complete()) {
    const TimePoint now = Clock::now();
    if (now >= until) return 0;
    std::erase_if(pending, [&](const Pending& p) { return now - p.since >= kPatience; });
    TimePoint wake = until;
    const bool accepting = now >= accepts_paused_until;
    fds.assign(1, {accepting ? listener : -1, POLLIN, 0});
    if (!accepting) wake = std::min(wake, accepts_paused_until);
    for (const auto& p : pending) {
      wake = std::min(wake, p.since + kPatience);
      fds.push_back({p.fd.get(), POLLIN, 0});
    }
    if (cancel_fd >= 0) fds.push_back({cancel_fd, POLLIN, 0});
    const int r = ::poll(fds.data(), static_cast<nfds_t>(fds.size()), std::max(1, ms_until(wake)));
    if (r < 0 && errno != EINTR) return -1;
    if (r <= 0) continue;
    if (cancel_fd >= 0 && fds.back().revents) return -1;
    std::vector<std::size_t> done;
    for (std::size_t i = 0; i < pending.size(); ++i) {
      if (!fds[i + 1].revents) continue;
      if (feed(pending[i], step) != Step::kMore) done.push_back(i);
      if (complete()) break;
    }
    for (auto it = done.rbegin(); it != done.rend(); ++it) pending.erase(pending.begin() + static_cast<long>(*it));
    if (fds[0].revents && !complete())
      for (int k = 0; k < 64; ++k) {  // what waits in the backlog, a bounded batch per wake-up
        sockaddr_storage ss{};
        socklen_t len = sizeof(ss);
        Fd c(::accept4(listener, reinterpret_cast<sockaddr*>(&ss), &len, SOCK_CLOEXEC | SOCK_NONBLOCK));
        if (!c) {
          // Out of descriptors or memory: the connection stays in the backlog and the
          // listener readable; serve the others and try again later instead of spinning.
          if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM)
            accepts_paused_until = Clock::now() + kAcceptPause;
          break;
        }
        set_nonblocking(c.get());
        Pending p;
        p.fd = std::move(c);
        p.since = Clock::now();
        p.from = addr_text(ss);
        p.need = first_need;
        const Step st = feed(p, step);
        if (st == Step::kAdmitted && complete()) break;
        if (st != Step::kMore) continue;
        if (!make_room(p.from, p.since)) {
          flood.add(p.from);
          continue;
        }
        pending.push_back(std::move(p));
      }
  }
  return 1;
}

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
              milliseconds cap, double rate, int cancel_fd) {
  Xfer x;
  std::vector<char> scratch;
  if (!rbuf && rn > 0) scratch.resize(std::min(rn, kChunk));
  bool send_done = sn == 0 || out < 0, recv_done = rn == 0 || in < 0;
  const bool timed = cap.count() > 0;
  if (timed && !recv_done) {
    const char ready = 'R';
    if (::send(in, &ready, 1, MSG_NOSIGNAL) != 1) {
      x.recv_error = fmt::format("cannot say ready: {}", std::strerror(errno));
      recv_done = true;
    }
  }
  bool go = !timed || send_done;  // the receiver said it is ready (untimed: at once)
  TimePoint start = Clock::now();  // of the send, once `go`
  while (!send_done || !recv_done) {
    const TimePoint now = Clock::now();
    if (now >= deadline) {
      if (!send_done) x.send_error = "timed out sending";
      if (!recv_done) {
        x.recv_error = x.received ? "timed out receiving" : "nothing came";
        x.recv_timed_out = true;
      }
      break;
    }
    TimePoint wake = deadline;
    if (cap.count() > 0) {
      if (!send_done && go && now - start >= cap) send_done = true;
      if (!recv_done && x.received > 0 && now - x.first >= cap) recv_done = true;
      if (send_done && recv_done) break;
      if (!send_done && go) wake = std::min(wake, start + cap);
      if (!recv_done && x.received > 0) wake = std::min(wake, x.first + cap);
    }
    std::size_t may_send = sn - x.sent;  // now, by the pace
    if (!send_done && go && rate > 0) {
      const double allowed = rate * std::chrono::duration<double>(now - start).count() + kBurst;
      may_send = allowed > static_cast<double>(x.sent)
                     ? std::min(may_send, static_cast<std::size_t>(allowed - static_cast<double>(x.sent)))
                     : 0;
      if (may_send == 0)
        wake = std::min(wake, start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(
                                          (static_cast<double>(x.sent) - kBurst + 4096) / rate)));
    }
    pollfd p[3];
    int np = 0, pi_out = -1, pi_in = -1;
    if (!send_done && !go) {
      pi_out = np;
      p[np++] = {out, POLLIN, 0};  // the receiver's ready
    } else if (!send_done && may_send > 0) {
      pi_out = np;
      p[np++] = {out, POLLOUT, 0};
    }
    if (!recv_done) {
      pi_in = np;
      p[np++] = {in, POLLIN, 0};
    }
    const int pi_cancel = np;
    if (cancel_fd >= 0) p[np++] = {cancel_fd, POLLIN, 0};
    const int r = ::poll(p, static_cast<nfds_t>(np), std::max(1, ms_until(wake)));
    if (r < 0 && errno != EINTR) {
      x.send_error = x.recv_error = std::strerror(errno);
      break;
    }
    if (r <= 0) continue;
    if (cancel_fd >= 0 && p[pi_cancel].revents) {
      x.send_error = x.recv_error = "cancelled";
      break;
    }
    if (pi_out >= 0 && p[pi_out].revents && !go) {
      char ready = 0;
      const ssize_t got = ::recv(out, &ready, 1, 0);
      if (got == 1) {
        go = true;
        start = Clock::now();
      } else if (got == 0) {
        x.send_error = "the peer closed the connection";
        send_done = true;
      } else if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
        x.send_error = std::strerror(errno);
        send_done = true;
      }
    } else if (pi_out >= 0 && p[pi_out].revents) {
      const ssize_t w = ::send(out, sbuf + x.sent, std::min({may_send, kChunk}), MSG_NOSIGNAL);
      if (w > 0) {
        x.sent += static_cast<std::size_t>(w);
        send_done = x.sent >= sn;
      } else if (w < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
        x.send_error = std::strerror(errno);
        send_done = true;
      }
    }
    if (pi_in >= 0 && p[pi_in].revents) {
      char* dst = rbuf ? rbuf + x.received : scratch.data();
      const std::size_t want = std::min(rn - x.received, rbuf ? kChunk : scratch.size());
      const ssize_t got = ::recv(in, dst, want, 0);
      if (got > 0) {
        const TimePoint t = Clock::now();
        if (x.received == 0) x.first = t;
        x.last = t;
        x.received += static_cast<std::size_t>(got);
        recv_done = x.received >= rn;
      } else if (got == 0) {
        x.recv_error = "the peer closed the connection";
        recv_done = true;
      } else if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
        x.recv_error = std::strerror(errno);
        recv_done = true;
      }
    }
  }
  return x;
}

std::string rate_text(double bytes_per_s) {
  if (bytes_per_s >= 1e9) return fmt::format("{:.2f} GB/s", bytes_per_s / 1e9);
  if (bytes_per_s >= 1e6) return fmt::format("{:.0f} MB/s", bytes_per_s / 1e6);
  return fmt::format("{:.2f} MB/s", bytes_per_s / 1e6);
}

std::string node_name(int r, const std::vector<std::string>& nodes) {
  return r >= 0 && r < static_cast<int>(nodes.size()) ? fmt::format("node {} ({})", r, nodes[static_cast<std::size_t>(r)])
                                                      : fmt::format("node {}", r);
}

std::string names(const std::vector<int>& rs, const std::vector<std::string>& nodes) {
  std::string out;
  for (std::size_t i = 0; i < rs.size(); ++i) {
    if (i) out += i + 1 == rs.size() ? " and " : ", ";
    out += node_name(rs[i], nodes);
  }
  return out;
}

void add_unique(std::vector<int>& v, int x) {
  if (std::find(v.begin(), v.end(), x) == v.end()) v.push_back(x);
}

}  // namespace

std::vector<int> shifts(int n) {
  std::vector<int> s;
  for (int k = 1; k < n; k *= 2) s.push_back(k);
  return s;
}

nlohmann::json to_json(const NodeReport& r) {
  nlohmann::json rec = nlohmann::json::array();
  for (const auto& x : r.received) rec.push_back({{"from", x.from}, {"bytes", x.bytes}, {"seconds", x.seconds}});
  return {{"rank", r.rank},           {"unreachable", r.unreachable}, {"waited_on", r.waited_on},
          {"errors", r.errors},       {"allreduce_s", r.allreduce_s}, {"allreduce_wrong", r.allreduce_wrong},
          {"received", rec},          {"flooded", r.flooded}};
}

NodeReport node_report_from_json(const nlohmann::json& j) {
  NodeReport r;
  r.rank = j.at("rank").get<int>();
  r.unreachable = j.at("unreachable").get<std::vector<int>>();
  r.waited_on = j.at("waited_on").get<std::vector<int>>();
  r.errors = j.at("errors").get<std::vector<std::string>>();
  r.allreduce_s = j.at("allreduce_s").get<double>();
  r.allreduce_wrong = j.at("allreduce_wrong").get<long long>();
  r.flooded = j.value("flooded", std::string());
  for (const auto& x : j.at("received"))
    r.received.push_back({x.at("from").get<int>(), x.at("bytes").get<double>(), x.at("seconds").get<double>()});
  return r;
}

Verdict judge(const std::vector<NodeReport>& reports, const std::vector<std::string>& nodes, double slow_fraction,
              double seconds) {
  Verdict v;
  const int n = static_cast<int>(nodes.size());
  // A node whose data port strangers flooded: its peers' connections may have been among
  // those turned away, so what failed between nodes names nobody (as a flood of the
  // control port does).
  std::string flooded;
  for (const auto& r : reports)
    if (!r.flooded.empty() && r.rank >= 0 && r.rank < n)
      flooded += fmt::format("{}{}'s data port: {}", flooded.empty() ? "" : "; ", node_name(r.rank, nodes), r.flooded);
  auto fail = [&](std::vector<int> named, const std::string& what, bool between_nodes = true) {
    std::sort(named.begin(), named.end());
    v.named = std::move(named);
    v.line = fmt::format("preflight failed after {:.2f} s: {}", seconds, what);
    if (between_nodes && !flooded.empty()) {
      v.named.clear();
      v.line += fmt::format("; but nobody is named: strangers flooded {} (find what connects to that port; a token, "
                            "--token-file, lets nodes prove they belong)",
                            flooded);
    }
    return v;
  };
  std::vector<const NodeReport*> by_rank(static_cast<std::size_t>(n), nullptr);
  for (const auto& r : reports)
    if (r.rank >= 0 && r.rank < n) by_rank[static_cast<std::size_t>(r.rank)] = &r;

  // Broken: never came, or stopped answering.
  {
    std::vector<int> absent, silent;
    for (int r = 0; r < n; ++r) {
      const NodeReport* p = by_rank[static_cast<std::size_t>(r)];
      if (!p || !p->reached) absent.push_back(r);
      else if (!p->reported) silent.push_back(r);
    }
    if (!absent.empty())
      return fail(absent, fmt::format("{} did not reach the coordinator, {}, at MASTER_ADDR:MASTER_PORT "
                                      "(is its agent running, and can it reach that address?)",
                                      names(absent, nodes), node_name(0, nodes)),
                  /*between_nodes=*/false);
    if (!silent.empty())
      return fail(silent, fmt::format("{} stopped answering during the check (stopped or overloaded?)",
                                      names(silent, nodes)),
                  /*between_nodes=*/false);
  }
  // Connections that failed: blame a node nobody reaches, else one that reaches nobody.
  {
    std::vector<int> tried(static_cast<std::size_t>(n)), failed_to(static_cast<std::size_t>(n));
    std::vector<std::pair<int, int>> pairs;
    for (int r = 0; r < n; ++r)
      for (int s : shifts(n)) {
        const int t = (r + s) % n;
        ++tried[static_cast<std::size_t>(t)];
        const auto& u = by_rank[static_cast<std::size_t>(r)]->unreachable;
        if (std::find(u.begin(), u.end(), t) != u.end()) {
          ++failed_to[static_cast<std::size_t>(t)];
          pairs.emplace_back(r, t);
        }
      }
    if (!pairs.empty()) {
      std::vector<int> nobody_reaches, reaches_nobody;
      for (int t = 0; t < n; ++t)
        if (tried[static_cast<std::size_t>(t)] > 0 && failed_to[static_cast<std::size_t>(t)] == tried[static_cast<std::size_t>(t)])
          nobody_reaches.push_back(t);
      if (!nobody_reaches.empty()) {
        std::string detail;  // one of the errors, as an example
        const std::string to = fmt::format("-> node {}:", nobody_reaches.front());
        for (const auto* p : by_rank)
          for (const auto& e : p->errors)
            if (detail.empty() && e.find(to) != std::string::npos) detail = " (" + e + ")";
        return fail(nobody_reaches, fmt::format("no node can connect to {}: its port is unreachable{}; check its "
                                                "firewall and the address it advertises (--local_addr)",
                                                names(nobody_reaches, nodes), detail));
      }
      for (int r = 0; r < n; ++r)
        if (by_rank[static_cast<std::size_t>(r)]->unreachable.size() == shifts(n).size()) reaches_nobody.push_back(r);
      if (!reaches_nobody.empty())
        return fail(reaches_nobody, fmt::format("{} cannot connect to any of its peers ({}); check its routes and "
                                                "firewall",
                                                names(reaches_nobody, nodes),
                                                by_rank[static_cast<std::size_t>(reaches_nobody.front())]->errors.empty()
                                                    ? std::string("refused")
                                                    : by_rank[static_cast<std::size_t>(reaches_nobody.front())]->errors.front()));
      std::vector<int> all;
      std::string list;
      for (auto [a, b] : pairs) {
        add_unique(all, a);
        add_unique(all, b);
        if (!list.empty()) list += ", ";
        list += fmt::format("{} -> {}", a, b);
      }
      return fail(all, fmt::format("some connections between nodes failed ({}); check the firewall between {}", list,
                                   names(all, nodes)));
    }
  }
  // Data that never came: the node most waited on.
  {
    std::map<int, int> waited;
    for (const auto* p : by_rank)
      for (int w : p->waited_on) ++waited[w];
    if (!waited.empty()) {
      int most = 0;
      for (auto [r, c] : waited) most = std::max(most, c);
      std::vector<int> named;
      for (auto [r, c] : waited)
        if (c == most) named.push_back(r);
      std::string detail;
      for (const auto* p : by_rank)
        if (!p->errors.empty()) {
          detail = fmt::format(" (node {}: {})", p->rank, p->errors.front());
          break;
        }
      return fail(named, fmt::format("{} sent nothing its peers could receive within the time-out{}", names(named, nodes),
                                     detail));
    }
  }
  // A wrong sum.
  {
    std::vector<int> wrong;
    for (const auto* p : by_rank)
      if (p->allreduce_wrong > 0) wrong.push_back(p->rank);
    if (!wrong.empty())
      return fail(wrong, fmt::format("the all-reduce gave wrong sums on {}: data is corrupted between nodes",
                                     names(wrong, nodes)));
  }
  for (const auto* p : by_rank) v.allreduce_s = std::max(v.allreduce_s, p->allreduce_s);
  // Slow links.
  struct Link {
    int from, to;
    double rate;
  };
  std::vector<Link> links;
  for (const auto* p : by_rank)
    for (const auto& x : p->received)
      if (x.bytes > 0 && x.seconds > 0) links.push_back({x.from, p->rank, x.bytes / x.seconds});
  if (!links.empty()) {
    std::vector<double> rates;
    for (const auto& l : links) rates.push_back(l.rate);
    std::sort(rates.begin(), rates.end());
    const std::size_t m = rates.size();
    v.median_rate = m % 2 ? rates[m / 2] : (rates[m / 2 - 1] + rates[m / 2]) / 2;
    const double floor = slow_fraction * v.median_rate;
    std::map<int, double> send_best, recv_best;
    for (const auto& l : links) send_best[l.from] = std::max(send_best[l.from], l.rate);
    std::set<int> slow_senders;
    for (auto [r, best] : send_best)
      if (best < floor) slow_senders.insert(r);
    for (const auto& l : links)
      if (!slow_senders.count(l.from)) recv_best[l.to] = std::max(recv_best[l.to], l.rate);
    std::vector<int> named;
    std::vector<std::string> what;
    for (int r = 0; r < n; ++r) {
      const bool s = slow_senders.count(r) > 0;
      const bool rcv = recv_best.count(r) && recv_best[r] < floor;
      if (!s && !rcv) continue;
      named.push_back(r);
      if (s && rcv)
        what.push_back(fmt::format("{} sends at {} and receives at {}", node_name(r, nodes), rate_text(send_best[r]),
                                   rate_text(recv_best[r])));
      else if (s)
        what.push_back(fmt::format("{} sends at {}", node_name(r, nodes), rate_text(send_best[r])));
      else
        what.push_back(fmt::format("{} receives at {}", node_name(r, nodes), rate_text(recv_best[r])));
    }
    if (!named.empty()) {
      std::string list;
      for (std::size_t i = 0; i < what.size(); ++i) list += (i ? "; " : "") + what[i];
      const double inv = 1 / slow_fraction;
      const std::string frac = std::abs(inv - std::round(inv)) < 1e-9 ? fmt::format("1/{:.0f}", inv)
                                                                       : fmt::format("{:g}", slow_fraction);
      return fail(named, fmt::format("slow: {} at best, while the median link runs at {} (slow: below {} of it)",
                                     list, rate_text(v.median_rate), frac));
    }
    // The figures, the slowest node named.
    int slowest = -1;
    double slowest_rate = 0;
    for (auto [r, best] : send_best)
      if (slowest < 0 || best < slowest_rate) {
        slowest = r;
        slowest_rate = best;
      }
    v.ok = true;
    v.line = fmt::format("preflight passed in {:.2f} s: {} nodes, all-reduce {:.1f} ms, point-to-point median {} "
                         "(slowest sender {} at {})",
                         seconds, n, v.allreduce_s * 1e3, rate_text(v.median_rate), node_name(slowest, nodes),
                         rate_text(slowest_rate));
    return v;
  }
  v.ok = true;
  v.line = fmt::format("preflight passed in {:.2f} s: {} node{}, nothing to measure between nodes", seconds, n,
                       n == 1 ? "" : "s");
  return v;
}

namespace {

// One node's run; see the header for the steps.
class Node {
 public:
  explicit Node(const Options& o) : o_(o), n_(static_cast<int>(o.nodes.size())), t0_(Clock::now()) {
    deadline_ = t0_ + o.timeout;
    data_deadline_ = t0_ + o.timeout * 7 / 10;  // the data steps end first: reports still arrive
    report_.rank = o.rank;
    report_.reached = true;
    // The check's own key, bound to its job and round: its proofs can never stand in for
    // the rendezvous' (the same functions over K_J), nor for another round's check.
    if (!o.key.empty()) key_ = auth::hmac_sha256_hex(o.key, "mglaunch-preflight:" + o.job);
  }

  Result run() {
    try {
      steps();
    } catch (const nlohmann::json::exception& e) {  // a field of the wrong type from a peer
      local_failure(fmt::format("{} got a malformed message: {}", node_name(o_.rank, o_.nodes), e.what()));
    }
    // Whatever happened, the verdict says something (an empty one read "error: ; fix ...").
    if (result_.line.empty()) local_failure(fmt::format("{} ended the check without a verdict", node_name(o_.rank, o_.nodes)));
    return std::move(result_);
  }

 private:
  double elapsed() const { return std::chrono::duration<double>(Clock::now() - t0_).count(); }

  void steps() {
    if (!listen()) {
      local_failure(fmt::format("{} cannot listen for its peers: {}", node_name(o_.rank, o_.nodes), error_));
      return;
    }
    if (o_.rank == 0 ? !gather_hellos() : !hello()) return;
    connect_peers();
    if (!settle_connections()) return;
    accept_peers();
    if (report_.errors.empty()) allreduce();
    if (report_.errors.empty()) bandwidth();
    report_.reported = true;
    finish();
  }

  void local_failure(const std::string& what) {
    result_.ok = false;
    result_.line = fmt::format("preflight failed after {:.2f} s: {}", elapsed(), what);
    result_.seconds = elapsed();
    result_.reports = nlohmann::json::array({to_json(report_)});
  }

  bool listen() {
    data_listener_ = listen_on(o_.nodes[static_cast<std::size_t>(o_.rank)], 0, false, data_port_, error_);
    if (!data_listener_) return false;
    if (o_.unreachable) data_listener_.reset();  // test hook: the port it announces refuses
    if (o_.rank == 0) {
      if (o_.coordinator_fd >= 0) {
        coord_fd_ = o_.coordinator_fd;
        ::listen(coord_fd_, kBacklog);  // its queue as long as our own listeners', whoever made it
      } else {
        int port = 0;
        coord_listener_ = listen_on("", o_.coordinator_port, /*reuse=*/true, port, error_);
        if (!coord_listener_) {
          error_ = fmt::format("MASTER_PORT {}: {}", o_.coordinator_port, error_);
          return false;
        }
        coord_fd_ = coord_listener_.get();
      }
    }
    return true;
  }

  // Rank 0: every other node's hello (job, rank, data port; with a key, then its proof of
  // it), then the port table. Connections are served side by side (admit()): one that
  // never says a valid hello, or fails the proof, is dropped and takes no node's place.
  bool gather_hellos() {
    ports_.assign(static_cast<std::size_t>(n_), 0);
    ports_[0] = data_port_;
    ctl_.resize(static_cast<std::size_t>(n_));
    secret_ = auth::random_hex(kTagBytes / 2);
    int missing = n_ - 1;
    auto step = [&](Pending& p) {
      bool bad = false;
      auto m = pending_msg(p, bad);
      if (bad) return Step::kDrop;
      if (!m) return Step::kMore;
      if (p.stage == 0) {
        if (m->value("t", "") != "hello" || m->value("job", "") != o_.job) return Step::kDrop;  // not one of ours
        p.rank = m->value("rank", -1);
        p.port = m->value("port", 0);
        if (p.rank <= 0 || p.rank >= n_) return Step::kDrop;
        if (key_.empty()) return claim(p, missing);
        if (ctl_[static_cast<std::size_t>(p.rank)]) return Step::kDrop;
        // The rendezvous' handshake (rendezvous/auth.h) under the check's key: our proof
        // over both nonces, then theirs.
        p.client_nonce = m->value("nonce", "");
        if (p.client_nonce.size() != 64) return Step::kDrop;
        p.server_nonce = auth::random_hex(32);
        std::string err;
        p.stage = 1;
        return p.in.empty() && send_msg(p.fd.get(), nullptr,
                                        {{"t", "challenge"}, {"nonce", p.server_nonce},
                                         {"proof", auth::server_proof(key_, p.client_nonce, p.server_nonce)}},
                                        Clock::now() + milliseconds(100), -1, err)
                   ? Step::kMore
                   : Step::kDrop;
      }
      if (m->value("t", "") != "proof" || ctl_[static_cast<std::size_t>(p.rank)] ||
          !auth::equal_ct(m->value("proof", ""), hello_proof(p.client_nonce, p.server_nonce, p.rank, p.port)))
        return Step::kDrop;  // a wrong key: not this job's node, whatever rank it claimed
      return take_node(p, auth::session_key(key_, p.client_nonce, p.server_nonce), missing);
    };
    Flood flood;
    if (admit(coord_fd_, 4, deadline_, o_.cancel_fd, step, [&] { return missing == 0; }, of_node(), flood) < 0)
      return cancelled();
    coord_listener_.reset();  // MASTER_PORT is the workers' again (the agent's hold stays)
    if (missing > 0) {
      std::vector<NodeReport> reports;
      for (int r = 0; r < n_; ++r) {
        NodeReport x;
        x.rank = r;
        x.reached = r == 0 || ctl_[static_cast<std::size_t>(r)];
        reports.push_back(x);
      }
      Verdict v = judge(reports, o_.nodes, o_.slow_fraction, elapsed());
      if (flood.turned_away > 0) {
        // The missing node may be one of those turned away: whose fault it is, nobody knows.
        std::vector<int> absent;
        for (const auto& x : reports)
          if (!x.reached) absent.push_back(x.rank);
        v.named.clear();
        v.line = fmt::format("preflight failed after {:.2f} s: MASTER_PORT {} was flooded ({}) while {} had not come; "
                             "nobody is named (find what connects to that port; a token, --token-file, lets nodes "
                             "prove they belong)",
                             elapsed(), o_.coordinator_port, flood.text(), names(absent, o_.nodes));
      }
      broadcast_verdict(v, reports);
      return false;
    }
    std::string err;
    for (int r = 1; r < n_; ++r)
      send_msg(ctl_[static_cast<std::size_t>(r)], {{"t", "peers"}, {"ports", ports_}, {"secret", secret_}}, deadline_,
               o_.cancel_fd, err);
    return true;
  }

  // Whether an address is one of the nodes' (resolved once).
  std::function<bool(const std::string&)> of_node() {
    if (node_addrs_.empty())
      for (const auto& h : o_.nodes) node_addrs_.push_back(addresses_of(h));
    return [this](const std::string& a) {
      return std::any_of(node_addrs_.begin(), node_addrs_.end(), [&](const auto& s) { return s.count(a) > 0; });
    };
  }

  // Without a key, a hello is all a node shows, and where it comes from: a claim for rank r
  // is taken only from one of node r's addresses (nodes connect from their own; any claim
  // when they cannot be resolved). Others are refused, and the rank marked contested
  // (contested_): a verdict that would name it names nobody, since the node's own hello
  // may be the one refused.
  Step claim(Pending& p, int& missing) {
    of_node();
    const auto r = static_cast<std::size_t>(p.rank);
    if (ctl_[r] || (!node_addrs_[r].empty() && !node_addrs_[r].count(p.from))) {
      contested_[p.rank].insert(p.from);
      return Step::kDrop;
    }
    return take_node(p, {}, missing);
  }

  // A node's control connection, admitted: its place, its data port, its MACs (with a key).
  Step take_node(Pending& p, const std::string& session, int& missing) {
    Link& l = ctl_[static_cast<std::size_t>(p.rank)];
    l.fd = std::move(p.fd);
    if (!session.empty()) {
      l.out.emplace(session, 's');
      l.in.emplace(session, 'c');
    }
    ports_[static_cast<std::size_t>(p.rank)] = p.port;
    --missing;
    return Step::kAdmitted;
  }

  // Others: reach the coordinator (it may not listen yet), say hello (with a key, prove it
  // and check the coordinator's proof), get the port table. A connection closed before the
  // table came (the coordinator turned it away to keep room in a flood) is made again,
  // until the deadline.
  bool hello() {
    for (;;) {
      bool again = false;
      const bool ok = hello_once(again);
      if (!again) return ok;
      if (Clock::now() + milliseconds(50) >= deadline_) return lost_coordinator();
      if (o_.cancel_fd >= 0 ? wait_fd(o_.cancel_fd, POLLIN, Clock::now() + milliseconds(50), -1) != 0
                            : (std::this_thread::sleep_for(milliseconds(50)), false))
        return cancelled();
    }
  }

  // One try of hello(); `again` set when the connection closed before the port table came.
  bool hello_once(bool& again) {
    coord_ = Link();
    coord_.fd = connect_to(o_.coordinator_host, o_.coordinator_port, deadline_, /*retry_refused=*/true, o_.cancel_fd,
                           error_, o_.nodes[static_cast<std::size_t>(o_.rank)]);
    if (!coord_) {
      if (error_ == "cancelled") return cancelled();
      local_failure(fmt::format("{} cannot reach the coordinator, {}, at {}:{}: {}", node_name(o_.rank, o_.nodes),
                                node_name(0, o_.nodes), o_.coordinator_host, o_.coordinator_port, error_));
      result_.named = {0};
      return false;
    }
    auto closed = [&] {
      again = error_ == "the peer closed the connection" || error_.starts_with("recv: ") || error_.starts_with("send: ");
      return again ? false : lost_coordinator();
    };
    nlohmann::json h = {{"t", "hello"}, {"job", o_.job}, {"rank", o_.rank}, {"port", data_port_}};
    const std::string nonce = key_.empty() ? std::string() : auth::random_hex(32);
    if (!key_.empty()) h["nonce"] = nonce;
    if (!send_msg(coord_, h, deadline_, o_.cancel_fd, error_)) return closed();
    if (!key_.empty()) {
      auto c = recv_msg(coord_, deadline_ + kGrace, o_.cancel_fd, error_);
      if (!c) return error_ == "cancelled" ? cancelled() : closed();
      const std::string sn = c->value("nonce", "");
      if (c->value("t", "") != "challenge" || sn.size() != 64 ||
          !auth::equal_ct(c->value("proof", ""), auth::server_proof(key_, nonce, sn))) {
        // Not node 0's agent (it would know the key): whoever listens there is named by no one.
        local_failure(fmt::format("{}: whatever answers at MASTER_ADDR:MASTER_PORT ({}:{}) cannot prove this job's key "
                                  "(another process on that port?); the check cannot run",
                                  node_name(o_.rank, o_.nodes), o_.coordinator_host, o_.coordinator_port));
        return false;
      }
      if (!send_msg(coord_, {{"t", "proof"}, {"proof", hello_proof(nonce, sn, o_.rank, data_port_)}}, deadline_,
                    o_.cancel_fd, error_))
        return closed();
      const std::string session = auth::session_key(key_, nonce, sn);
      coord_.out.emplace(session, 'c');
      coord_.in.emplace(session, 's');
    }
    auto m = recv_msg(coord_, deadline_ + kGrace, o_.cancel_fd, error_);
    if (!m) return error_ == "cancelled" ? cancelled() : closed();
    if ((*m)["t"] == "verdict") return take_verdict(*m);
    ports_ = m->value("ports", std::vector<int>{});
    secret_ = m->value("secret", "");
    if (static_cast<int>(ports_.size()) != n_ || secret_.size() != kTagBytes) {
      error_ = "a malformed port table";
      return lost_coordinator();
    }
    if (!key_.empty() && ports_[static_cast<std::size_t>(o_.rank)] != data_port_) {
      // The table came under the session's MAC, so the coordinator itself said so.
      local_failure(fmt::format("{}: the coordinator's port table gives it port {}, not its own {}; the check cannot run",
                                node_name(o_.rank, o_.nodes), ports_[static_cast<std::size_t>(o_.rank)], data_port_));
      return false;
    }
    return true;
  }

  // A node's proof of the key, bound to what its hello said (the job, its rank and data
  // port) as well as to both nonces: a hello altered on the way fails it.
  std::string hello_proof(const std::string& cn, const std::string& sn, int rank, int port) const {
    return auth::client_proof(key_, cn, fmt::format("{}|{}|{}|{}", sn, o_.job, rank, port));
  }

  // What a data connection from `from` to `to` shows: the coordinator's secret of this
  // check (only its nodes have it), with a key an HMAC of it under the check's key.
  std::string data_tag(int from, int to) const {
    return key_.empty() ? secret_
                        : auth::hmac_sha256_hex(key_, fmt::format("mglaunch-preflight-data|{}|{}|{}", secret_, from, to));
  }

  void connect_peers() {
    for (int s : shifts(n_)) {
      const int peer = (o_.rank + s) % n_;
      std::string err;
      Fd fd = connect_to(o_.nodes[static_cast<std::size_t>(peer)], ports_[static_cast<std::size_t>(peer)],
                         std::min(data_deadline_, Clock::now() + milliseconds(3000)), false, o_.cancel_fd, err);
      const std::uint32_t words[2] = {htonl(kMagic), htonl(static_cast<std::uint32_t>(o_.rank))};
      std::string header(reinterpret_cast<const char*>(words), sizeof(words));
      header += data_tag(o_.rank, peer);
      if (fd && !send_all(fd.get(), header.data(), header.size(), data_deadline_, o_.cancel_fd, err)) fd.reset();
      if (!fd) {
        add_unique(report_.unreachable, peer);
        report_.errors.push_back(fmt::format("node {} -> node {}: {}", o_.rank, peer, err));
        continue;
      }
      out_[s] = std::move(fd);
    }
  }

  // Everyone says whom it could not reach; the coordinator stops the check there or says go.
  bool settle_connections() {
    note_full_queue();
    const nlohmann::json mine = {{"t", "connected"},
                                 {"unreachable", report_.unreachable},
                                 {"errors", report_.errors},
                                 {"flooded", report_.flooded}};
    if (o_.rank != 0) {
      if (!send_msg(coord_, mine, deadline_, o_.cancel_fd, error_)) return lost_coordinator();
      auto m = await_coordinator(deadline_ + kGrace);
      if (!m) return false;
      if ((*m)["t"] == "verdict") return take_verdict(*m);
      return true;
    }
    std::vector<NodeReport> reports(static_cast<std::size_t>(n_));
    bool any_failed = !report_.unreachable.empty();
    for (int r = 0; r < n_; ++r) {
      auto& x = reports[static_cast<std::size_t>(r)];
      x.rank = r;
      x.reached = true;
      x.reported = true;
      if (r == 0) {
        x.unreachable = report_.unreachable;
        x.errors = report_.errors;
        x.flooded = report_.flooded;
        continue;
      }
      std::string err;
      auto m = recv_msg(ctl_[static_cast<std::size_t>(r)], deadline_, o_.cancel_fd, err);
      if (err == "cancelled") return cancelled();
      if (!m || m->value("t", "") != "connected") {
        x.reported = false;
        any_failed = true;
        continue;
      }
      x.unreachable = m->value("unreachable", std::vector<int>{});
      x.errors = m->value("errors", std::vector<std::string>{});
      x.flooded = m->value("flooded", std::string());
      any_failed = any_failed || !x.unreachable.empty();
    }
    if (any_failed) {
      broadcast_verdict(judge(reports, o_.nodes, o_.slow_fraction, elapsed()), reports);
      return false;
    }
    std::string err;
    for (int r = 1; r < n_; ++r) send_msg(ctl_[static_cast<std::size_t>(r)], {{"t", "go"}}, deadline_, o_.cancel_fd, err);
    return true;
  }

  // This node's data port, once its peers have connected (or failed to): an accept queue
  // that is full refused their connections, and its peers would name this node for it.
  // TCP_INFO of a listener: tcpi_unacked is the queue's length, tcpi_sacked its bound.
  void note_full_queue() {
    if (!data_listener_) return;
    tcp_info ti{};
    socklen_t len = sizeof(ti);
    if (::getsockopt(data_listener_.get(), IPPROTO_TCP, TCP_INFO, &ti, &len) != 0 || ti.tcpi_sacked == 0) return;
    if (ti.tcpi_unacked >= ti.tcpi_sacked)
      report_.flooded = fmt::format("its accept queue was full ({} connections waiting) when its peers connected",
                                    ti.tcpi_unacked);
  }

  // The peers' data connections, each showing its tag (data_tag()); served side by side
  // like the hellos, so a stranger's connection to this port delays no peer's.
  void accept_peers() {
    std::size_t want = shifts(n_).size();
    const auto sh = shifts(n_);
    auto step = [&](Pending& p) {
      if (p.in.size() < kHeaderBytes) return Step::kMore;
      std::uint32_t words[2];
      std::memcpy(words, p.in.data(), sizeof(words));
      const int from = static_cast<int>(ntohl(words[1]));
      const int s = ((o_.rank - from) % n_ + n_) % n_;
      if (ntohl(words[0]) != kMagic || from < 0 || from >= n_ || std::find(sh.begin(), sh.end(), s) == sh.end() ||
          in_.count(s) || !auth::equal_ct(p.in.substr(sizeof(words)), data_tag(from, o_.rank)))
        return Step::kDrop;
      in_[s] = std::move(p.fd);
      --want;
      return Step::kAdmitted;
    };
    Flood flood;
    if (data_listener_)
      admit(data_listener_.get(), kHeaderBytes, data_deadline_, o_.cancel_fd, step, [&] { return want == 0; }, of_node(),
            flood);
    if (flood.turned_away > 0 && want > 0 && report_.flooded.empty()) report_.flooded = flood.text();
    for (int s : shifts(n_))
      if (!in_.count(s)) {
        const int from = ((o_.rank - s) % n_ + n_) % n_;
        add_unique(report_.waited_on, from);
        report_.errors.push_back(fmt::format("node {} never connected to node {}", from, o_.rank));
      }
  }

  // Reduce-scatter then all-gather over the shift-1 ring; each element's sum is checked.
  void allreduce() {
    const std::size_t count = std::max<std::size_t>(o_.allreduce_bytes / sizeof(float), static_cast<std::size_t>(n_));
    std::vector<float> data(count);
    for (std::size_t i = 0; i < count; ++i) data[i] = static_cast<float>((o_.rank + 1) * static_cast<int>(i % 7 + 1));
    auto begin = [&](int c) { return count * static_cast<std::size_t>(c) / static_cast<std::size_t>(n_); };
    std::vector<float> tmp(count / static_cast<std::size_t>(n_) + 1);
    const int out = out_.at(1).get(), in = in_.at(1).get();
    const int prev = (o_.rank - 1 + n_) % n_;
    const TimePoint start = Clock::now();
    for (int phase = 0; phase < 2; ++phase)
      for (int k = 0; k < n_ - 1; ++k) {
        // reduce-scatter: send chunk r-k, add into chunk r-k-1; all-gather: send r+1-k, copy r-k.
        const int sc = ((phase == 0 ? o_.rank - k : o_.rank + 1 - k) % n_ + n_) % n_;
        const int rc = ((phase == 0 ? o_.rank - k - 1 : o_.rank - k) % n_ + n_) % n_;
        const std::size_t sn = (begin(sc + 1) - begin(sc)) * sizeof(float);
        const std::size_t rn = (begin(rc + 1) - begin(rc)) * sizeof(float);
        Xfer x = exchange(out, reinterpret_cast<const char*>(data.data() + begin(sc)), sn, in,
                          reinterpret_cast<char*>(tmp.data()), rn, data_deadline_, milliseconds(0), o_.send_rate,
                          o_.cancel_fd);
        if (!x.recv_error.empty() || x.received < rn) {
          add_unique(report_.waited_on, prev);
          report_.errors.push_back(fmt::format("all-reduce: node {} from node {}: {}", o_.rank, prev,
                                               x.recv_error.empty() ? "short" : x.recv_error));
          return;
        }
        if (!x.send_error.empty()) {
          report_.errors.push_back(fmt::format("all-reduce: node {} to node {}: {}", o_.rank, (o_.rank + 1) % n_,
                                               x.send_error));
          return;
        }
        for (std::size_t i = 0; i < rn / sizeof(float); ++i)
          data[begin(rc) + i] = phase == 0 ? data[begin(rc) + i] + tmp[i] : tmp[i];
      }
    report_.allreduce_s = std::chrono::duration<double>(Clock::now() - start).count();
    const int ranks_sum = n_ * (n_ + 1) / 2;
    for (std::size_t i = 0; i < count; ++i)
      if (data[i] != static_cast<float>(ranks_sum * static_cast<int>(i % 7 + 1))) ++report_.allreduce_wrong;
  }

  // One timed round per shift: send to r+s while receiving from r-s.
  void bandwidth() {
    std::vector<char> buf(o_.p2p_bytes, '\x5a');
    for (int s : shifts(n_)) {
      const int from = ((o_.rank - s) % n_ + n_) % n_;
      Xfer x = exchange(out_.at(s).get(), buf.data(), buf.size(), in_.at(s).get(), nullptr, buf.size(), data_deadline_,
                        o_.transfer_cap, o_.send_rate, o_.cancel_fd);
      if (x.received == 0) {
        add_unique(report_.waited_on, from);
        report_.errors.push_back(fmt::format("point-to-point: node {} from node {}: {}", o_.rank, from,
                                             x.recv_error.empty() ? "nothing came" : x.recv_error));
        return;
      }
      report_.received.push_back({from, static_cast<double>(x.received), x.seconds()});
      out_.at(s).reset();  // used once
    }
  }

  // Reports go to the coordinator, which judges; everyone takes its verdict.
  void finish() {
    if (o_.rank != 0) {
      nlohmann::json m = to_json(report_);
      m["t"] = "report";
      if (!send_msg(coord_, m, deadline_, o_.cancel_fd, error_)) {
        lost_coordinator();
        return;
      }
      auto v = await_coordinator(deadline_ + kGrace);
      if (v) take_verdict(*v);
      return;
    }
    std::vector<NodeReport> reports;
    reports.push_back(report_);
    for (int r = 1; r < n_; ++r) {
      std::string err;
      auto m = recv_msg(ctl_[static_cast<std::size_t>(r)], deadline_, o_.cancel_fd, err);
      if (err == "cancelled") {
        cancelled();
        return;
      }
      NodeReport x;
      x.rank = r;
      x.reached = true;
      if (m && m->value("t", "") == "report") {
        try {
          x = node_report_from_json(*m);
          x.reached = x.reported = true;
        } catch (const nlohmann::json::exception&) {
          x = NodeReport{};
          x.rank = r;
          x.reached = true;
        }
        x.rank = r;
      }
      reports.push_back(std::move(x));
    }
    broadcast_verdict(judge(reports, o_.nodes, o_.slow_fraction, elapsed()), reports);
  }

  void broadcast_verdict(Verdict v, const std::vector<NodeReport>& reports) {
    std::string err;
    if (!v.ok && std::any_of(v.named.begin(), v.named.end(), [&](int r) { return contested_.count(r) > 0; })) {
      std::string claims;
      for (const auto& [r, from] : contested_) {
        std::string list;
        for (const auto& a : from) list += (list.empty() ? "" : ", ") + a;
        claims += fmt::format("{}rank {} from {}", claims.empty() ? "" : "; ", r, list);
      }
      v.named.clear();
      v.line += fmt::format("; but nobody is named: without a token anyone who knows the run id can pose as a node, "
                            "and a hello was refused for {} (a second claim, or not from the node's address; "
                            "use a token: --token-file)",
                            claims);
    }
    const nlohmann::json m = {{"t", "verdict"}, {"ok", v.ok}, {"line", v.line}, {"named", v.named}};
    for (int r = 1; r < static_cast<int>(ctl_.size()); ++r)
      if (ctl_[static_cast<std::size_t>(r)])
        send_msg(ctl_[static_cast<std::size_t>(r)], m, std::min(deadline_ + milliseconds(1000),
                                                                      Clock::now() + milliseconds(1000)),
                 o_.cancel_fd, err);
    result_.ok = v.ok;
    result_.line = v.line;
    result_.named = v.named;
    result_.seconds = elapsed();
    result_.reports = nlohmann::json::array();
    for (const auto& r : reports) {
      nlohmann::json j = to_json(r);
      j["reached"] = r.reached;
      j["reported"] = r.reported;
      result_.reports.push_back(std::move(j));
    }
  }

  std::optional<nlohmann::json> await_coordinator(TimePoint until) {
    auto m = recv_msg(coord_, until, o_.cancel_fd, error_);
    if (!m) {
      if (error_ == "cancelled") cancelled();
      else lost_coordinator();
    }
    return m;
  }

  bool take_verdict(const nlohmann::json& m) {
    result_.ok = m.value("ok", false);
    result_.line = m.value("line", std::string("preflight failed: the coordinator sent no reason"));
    result_.named = m.value("named", std::vector<int>{});
    result_.seconds = elapsed();
    result_.reports = nlohmann::json::array({to_json(report_)});
    return false;
  }

  bool lost_coordinator() {
    local_failure(fmt::format("{} lost the coordinator, {}: {}", node_name(o_.rank, o_.nodes), node_name(0, o_.nodes),
                              error_));
    result_.named = {0};
    return false;
  }

  bool cancelled() {
    result_.ok = false;
    result_.line = "preflight cancelled";
    result_.seconds = elapsed();
    return false;
  }

  const Options& o_;
  const int n_;
  const TimePoint t0_;
  TimePoint deadline_, data_deadline_;
  NodeReport report_;
  Result result_;
  std::string error_;
  std::string key_;     // the check's key (from the job key), empty without a token
  std::string secret_;  // the coordinator's secret of this check (data_tag())
  Fd data_listener_, coord_listener_;
  Link coord_;  // others: the control connection to the coordinator
  int data_port_ = 0;
  int coord_fd_ = -1;
  std::vector<Link> ctl_;       // rank 0: each node's control connection
  std::vector<int> ports_;      // each node's data port
  std::vector<std::set<std::string>> node_addrs_;  // each node's addresses (of_node())
  std::map<int, std::set<std::string>> contested_;  // rank 0, no key: ranks claimed twice, by whom
  std::map<int, Fd> out_, in_;  // data connections by shift
};

}  // namespace

Result run(const Options& o) {
  if (o.rank < 0 || o.rank >= static_cast<int>(o.nodes.size()))
    throw std::invalid_argument(fmt::format("preflight: rank {} outside the {} nodes", o.rank, o.nodes.size()));
  Node node(o);
  return node.run();
}

Result run_local(int nodes, const std::vector<std::string>& addresses, const Options& base,
                 const std::function<void(int, Options&)>& tweak) {
  if (nodes < 1 || addresses.empty()) throw std::invalid_argument("preflight: no nodes");
  std::vector<std::string> where;
  for (int r = 0; r < nodes; ++r) where.push_back(addresses[static_cast<std::size_t>(r) % addresses.size()]);
  int port = 0;
  std::string error;
  Fd coord = listen_on(where[0], 0, true, port, error);
  if (!coord) {
    Result r;
    r.line = fmt::format("preflight failed: {}", error);
    return r;
  }
  std::vector<Options> opts(static_cast<std::size_t>(nodes), base);
  std::vector<Result> results(static_cast<std::size_t>(nodes));
  for (int r = 0; r < nodes; ++r) {
    Options& o = opts[static_cast<std::size_t>(r)];
    o.rank = r;
    o.nodes = where;
    o.coordinator_host = where[0];
    o.coordinator_port = port;
    o.coordinator_fd = r == 0 ? coord.get() : -1;
    if (o.job.empty()) o.job = "local";
    if (tweak) tweak(r, o);
  }
  std::vector<std::thread> threads;
  for (int r = 0; r < nodes; ++r)
    threads.push_back(signal_free_thread([&, r] { results[static_cast<std::size_t>(r)] = run(opts[static_cast<std::size_t>(r)]); }));
  for (auto& t : threads) t.join();
  return results.front();
}

}  // namespace mg::preflight
