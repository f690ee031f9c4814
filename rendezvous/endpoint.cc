#include "rendezvous/endpoint.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <cstring>
#include <vector>

#include <fmt/format.h>

namespace mg::rdzv {
namespace {

struct AddrInfo {
  addrinfo* head = nullptr;
  ~AddrInfo() {
    if (head) freeaddrinfo(head);
  }
};

// Binds a TCP socket to host:port; returns errno (0 on success). Tries every address the
// name resolves to and reports success for the first that binds.
int try_bind(const std::string& host, int port, bool listen_too, int* bound_port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  AddrInfo ai;
  const std::string service = std::to_string(port);
  if (int rc = getaddrinfo(host.c_str(), service.c_str(), &hints, &ai.head); rc != 0) return EADDRNOTAVAIL;
  int last_err = EADDRNOTAVAIL;
  for (addrinfo* p = ai.head; p; p = p->ai_next) {
    int fd = ::socket(p->ai_family, p->ai_socktype | SOCK_CLOEXEC, p->ai_protocol);
    if (fd < 0) {
      last_err = errno;
      continue;
    }
    int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    int rc = ::bind(fd, p->ai_addr, p->ai_addrlen);
    if (rc == 0 && listen_too) rc = ::listen(fd, 1);
    if (rc == 0) {
      if (bound_port) {
        sockaddr_storage ss{};
        socklen_t len = sizeof(ss);
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len);
        *bound_port = ss.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port)
                                               : ntohs(reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
      }
      ::close(fd);
      return 0;
    }
    last_err = errno;
    ::close(fd);
  }
  return last_err;
}

}  // namespace

std::optional<std::string> host_problem(std::string_view host) {
  if (host.empty()) return "empty host";
  if (host.find(':') != std::string_view::npos) {
    in6_addr a6{};
    if (::inet_pton(AF_INET6, std::string(host).c_str(), &a6) != 1)
      return fmt::format("'{}' is not an IPv6 address (write HOST:PORT, or [IPv6]:PORT)", host);
    return std::nullopt;
  }
  if (host.size() > 253) return "host name longer than 253 characters";
  std::string_view rest = host;
  if (rest.back() == '.') rest.remove_suffix(1);  // a fully qualified "name."
  while (true) {
    const auto dot = rest.find('.');
    const auto label = rest.substr(0, dot);
    if (label.empty() || label.size() > 63)
      return fmt::format("'{}' is not a host name (empty or over-long label between dots)", host);
    for (unsigned char c : label)
      if (!std::isalnum(c) && c != '-' && c != '_')
        return fmt::format("'{}' is not a host name or address (character '{}')", host, static_cast<char>(c));
    if (dot == std::string_view::npos) break;
    rest = rest.substr(dot + 1);
  }
  return std::nullopt;
}

Endpoint parse_endpoint(std::string_view text, int default_port) {
  auto bad = [&](std::string_view why) {
    return std::invalid_argument(fmt::format("bad endpoint '{}': {}", text, why));
  };
  if (text.empty()) throw bad("empty; expected HOST or HOST:PORT");
  Endpoint ep;
  std::string_view port_text;
  if (text.front() == '[') {
    auto close = text.find(']');
    if (close == std::string_view::npos) throw bad("missing ']' after an IPv6 address");
    ep.host = std::string(text.substr(1, close - 1));
    auto rest = text.substr(close + 1);
    if (!rest.empty()) {
      if (rest.front() != ':') throw bad("expected ':PORT' after ']'");
      port_text = rest.substr(1);
      if (port_text.empty()) throw bad("empty port after ':'");
    }
  } else {
    auto colon = text.rfind(':');
    if (colon != std::string_view::npos && text.find(':') != colon) {
      ep.host = std::string(text);  // only a bare IPv6 address (no port) has several ':'
      in6_addr a6{};
      if (::inet_pton(AF_INET6, ep.host.c_str(), &a6) != 1)
        throw bad("more than one ':' but not an IPv6 address; write HOST:PORT, or [IPv6]:PORT for an IPv6 address");
    } else if (colon != std::string_view::npos) {
      ep.host = std::string(text.substr(0, colon));
      port_text = text.substr(colon + 1);
      if (port_text.empty()) throw bad("empty port after ':'");
    } else {
      ep.host = std::string(text);
    }
  }
  if (auto why = host_problem(ep.host)) throw bad(*why);
  ep.port = default_port;
  if (!port_text.empty()) {
    int port = -1;
    auto [ptr, ec] = std::from_chars(port_text.data(), port_text.data() + port_text.size(), port);
    if (ec != std::errc{} || ptr != port_text.data() + port_text.size() || port < 0 || port > 65535)
      throw bad("port must be a number in 0..65535");
    ep.port = port;
  }
  return ep;
}

bool is_local_host(const std::string& host) {
  int port = 0;
  return try_bind(host, 0, false, &port) == 0;
}

namespace {
std::vector<std::string> resolve_all(const std::string& host) {
  std::vector<std::string> out;
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (::getaddrinfo(host.c_str(), nullptr, &hints, &res) != 0) return out;
  for (addrinfo* p = res; p; p = p->ai_next) {
    char buf[INET6_ADDRSTRLEN] = {};
    const void* a = p->ai_family == AF_INET ? static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(p->ai_addr)->sin_addr)
                                            : static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(p->ai_addr)->sin6_addr);
    if (::inet_ntop(p->ai_family, a, buf, sizeof buf)) out.emplace_back(buf);
  }
  ::freeaddrinfo(res);
  return out;
}
}  // namespace

bool resolves(const std::string& host) { return !resolve_all(host).empty(); }

bool is_loopback_host(const std::string& host) {
  if (host == "localhost") return true;
  const auto addrs = resolve_all(host);
  if (addrs.empty()) return false;
  for (const auto& a : addrs)  // inet_ntop's text
    if (!(a == "127.0.0.1" || a == "::1" || a == "::ffff:127.0.0.1")) return false;
  return true;
}

bool same_address(const std::string& a, const std::string& b) {
  if (a == b) return true;
  const auto x = resolve_all(a), y = resolve_all(b);
  for (const auto& i : x)
    for (const auto& j : y)
      if (i == j) return true;
  return false;
}

int find_free_port(const std::string& host) {
  int port = 0;
  if (int err = try_bind(host, 0, true, &port); err != 0)
    throw std::runtime_error(fmt::format("cannot bind a free port on {}: {}", host, std::strerror(err)));
  return port;
}

std::optional<std::string> probe_listen(const std::string& host, int port) {
  if (int err = try_bind(host, port, true, nullptr); err != 0) return std::string(std::strerror(err));
  return std::nullopt;
}

}  // namespace mg::rdzv
