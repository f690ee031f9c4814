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

#include "rendezvous/lookup.h"

namespace mg::rdzv {
namespace {

// Binds a TCP socket to each of `found` in turn; returns errno (0 on success) and reports
// success for the first that binds.
int try_bind(const std::vector<boost::asio::ip::tcp::endpoint>& found, bool listen_too, int* bound_port) {
  int last_err = EADDRNOTAVAIL;
  for (const auto& ep : found) {
    int fd = ::socket(ep.data()->sa_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
      last_err = errno;
      continue;
    }
    int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    int rc = ::bind(fd, ep.data(), static_cast<socklen_t>(ep.size()));
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

// try_bind on the addresses `host` resolves to (within kLookupBound: rendezvous/lookup.h).
int try_bind(const std::string& host, int port, bool listen_too, int* bound_port) {
  return try_bind(lookup_within(host, port, kLookupBound, AF_UNSPEC, /*passive=*/true).found, listen_too, bound_port);
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

bool is_local_address(std::vector<boost::asio::ip::tcp::endpoint> found) {
  for (auto& ep : found) ep.port(0);
  int port = 0;
  return try_bind(found, false, &port) == 0;
}

bool is_loopback_address(const std::vector<boost::asio::ip::tcp::endpoint>& found) {
  if (found.empty()) return false;
  for (const auto& ep : found) {
    const auto a = ep.address();
    const bool one = a.is_v4()   ? a.to_v4() == boost::asio::ip::address_v4::loopback()
                     : a.is_v6() ? a.to_v6().is_loopback() ||
                                       (a.to_v6().is_v4_mapped() &&
                                        boost::asio::ip::make_address_v4(boost::asio::ip::v4_mapped, a.to_v6()) ==
                                            boost::asio::ip::address_v4::loopback())
                                 : false;
    if (!one) return false;
  }
  return true;
}

namespace {
std::vector<std::string> resolve_all(const std::string& host) {
  std::vector<std::string> out;
  for (const auto& ep : lookup_within(host, 0).found) out.push_back(ep.address().to_string());
  return out;
}
}  // namespace

bool resolves(const std::string& host) { return !resolve_all(host).empty(); }

bool is_loopback_host(const std::string& host) {
  return host == "localhost" || is_loopback_address(lookup_within(host, 0).found);
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
