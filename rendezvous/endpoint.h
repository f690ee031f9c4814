// Rendezvous endpoints (HOST[:PORT]) and the small socket probes around them: is a host
// one of this machine's addresses, is a TCP port free, pick a free one. Pure parsing is
// separate from the probes so it can be unit-tested without sockets.
#pragma once

#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include <boost/asio/ip/tcp.hpp>

namespace mg::rdzv {

struct Endpoint {
  std::string host;
  int port = 0;  // 0: not given
};

// Parses "HOST", "HOST:PORT", "[v6]:PORT" (a bare IPv6 address without a port too). The
// host must be a host name (labels of letters, digits, '-', '_'), an IPv4 or an IPv6
// address; the port 0..65535. Throws std::invalid_argument naming the input.
Endpoint parse_endpoint(std::string_view text, int default_port);

// Why `host` is not a host name, IPv4 or IPv6 address (without brackets), or nullopt.
std::optional<std::string> host_problem(std::string_view host);

// True when `host` resolves to an address this machine can bind (loopback included).
bool is_local_host(const std::string& host);

// The same for addresses already looked up (no lookup: for the event loop's thread). The
// ports are ignored.
bool is_local_address(std::vector<boost::asio::ip::tcp::endpoint> found);

// True when `host` resolves here (getaddrinfo; may wait for DNS).
bool resolves(const std::string& host);

// True when `host` is this machine's loopback: "localhost", or a name or address that
// resolves only to 127.0.0.1 or ::1, as torchrun takes such an endpoint for this machine.
// The rest of 127.0.0.0/8 is not: it emulates other nodes on one machine (tests), and
// an agent there still hosts only at its own advertised address.
bool is_loopback_host(const std::string& host);
// The same for addresses already looked up: every one of `found` is 127.0.0.1 or ::1 (and
// there is one at least).
bool is_loopback_address(const std::vector<boost::asio::ip::tcp::endpoint>& found);

// True when `a` and `b` resolve to at least one common IP address (a name and its FQDN,
// or a name and its address); false when either does not resolve.
bool same_address(const std::string& a, const std::string& b);

// Binds HOST:0 and returns the port the kernel chose (the socket is closed again, so a
// race with another process is possible, exactly as with torchrun's probe).
int find_free_port(const std::string& host);

// Returns an error text ("address already in use", ...) when HOST:PORT cannot be bound
// for listening, std::nullopt when it can. Uses SO_REUSEADDR like a real server would.
std::optional<std::string> probe_listen(const std::string& host, int port);

}  // namespace mg::rdzv
