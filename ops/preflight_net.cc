#include "ops/preflight_net.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <deque>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "rendezvous/lookup.h"

namespace mg::preflight {

namespace {

using std::chrono::milliseconds;
namespace auth = mg::rdzv::auth;

constexpr std::size_t kMaxMessage = 1 << 20;  // a control message (a node's report is a few KiB)
constexpr std::size_t kChunk = 256 * 1024;    // one send or receive call
constexpr std::size_t kBurst = 64 * 1024;     // what a paced sender may send at once
// A connection not yet admitted (a node's hello and proof, a peer's data header): at most
// this many wait at once, each for at most kPatience, each message at most kMaxHello.
constexpr std::size_t kMaxPending = 64;
constexpr milliseconds kPatience{2000};
constexpr std::size_t kMaxHello = 4096;

int ms_until(TimePoint t) {
  const auto d = std::chrono::ceil<milliseconds>(t - Clock::now()).count();
  return static_cast<int>(std::clamp<long long>(d, 0, 60'000));
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

// Every lookup of a name is bounded (rdzv::lookup_until: until `deadline`, at most 20 s, and
// ended early by `cancel_fd`) and runs on a thread of its own: getaddrinfo waits on a DNS
// server that does not answer for glibc's attempts x timeout (90 s), past the check's
// deadline and its agent's stop (#35). `gave_up`, when given, is set when no answer came in
// time or the check was cancelled (not when the name does not resolve).
std::vector<Addr> resolve(const std::string& host, int port, std::string& error, TimePoint deadline, int cancel_fd,
                          bool* gave_up = nullptr) {
  const rdzv::Addresses found = rdzv::lookup_until(host, port, deadline, cancel_fd);
  std::vector<Addr> out;
  if (found.found.empty()) {
    const bool cancelled = found.error == "cancelled";
    error = cancelled ? found.error : fmt::format("cannot resolve '{}': {}", host, found.error);  // (as wait_fd's)
    if (gave_up) *gave_up = found.timed_out || cancelled;
    return out;
  }
  for (const auto& ep : found.found) {
    if (ep.size() > sizeof(sockaddr_storage)) continue;
    Addr x;
    std::memcpy(&x.ss, ep.data(), ep.size());
    x.len = static_cast<socklen_t>(ep.size());
    x.family = ep.data()->sa_family;
    out.push_back(x);
  }
  return out;
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
constexpr std::size_t kPerAddress = 4;
constexpr milliseconds kSilent{100};
constexpr milliseconds kAcceptPause{100};  // after EMFILE and the like (proto/accept_backoff.h's pause)

}  // namespace

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
Fd listen_on(const std::string& host, int want_port, bool reuse, int& port, std::string& error, TimePoint deadline,
             int cancel_fd) {
  std::string why;
  bool gave_up = false;
  std::vector<Addr> addrs = host.empty() ? std::vector<Addr>{} : resolve(host, want_port, why, deadline, cancel_fd, &gave_up);
  if (gave_up) {
    error = why;
    return Fd();
  }
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
Fd connect_to(const std::string& host, int port, TimePoint deadline, bool retry_refused, int cancel_fd,
              std::string& error, const std::string& source) {
  std::string ignored;
  const std::vector<Addr> sources =
      source.empty() ? std::vector<Addr>{} : resolve(source, 0, ignored, deadline, cancel_fd);
  // Looked up once: a retry after a refusal waits for a listener, not for another answer.
  const std::vector<Addr> addrs = resolve(host, port, error, deadline, cancel_fd);
  if (addrs.empty()) return Fd();
  for (;;) {
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
std::set<std::string> addresses_of(const std::string& host, TimePoint deadline, int cancel_fd) {
  std::string error;
  std::set<std::string> out;
  for (const auto& a : resolve(host, 0, error, deadline, cancel_fd)) out.insert(addr_text(a.ss));
  return out;
}
std::string Flood::text() const {
  std::string list;
  for (const auto& a : from) list += (list.empty() ? "" : ", ") + a;
  return fmt::format("{} connection{} from {} turned away for want of room", turned_away, turned_away == 1 ? "" : "s",
                     list);
}

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

}  // namespace mg::preflight
