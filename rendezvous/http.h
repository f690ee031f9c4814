// HttpServer: a small HTTP/1.1 server (Boost.Beast) on the caller's io_context, for the
// Prometheus /metrics endpoint and status pages: for scrapers and operators, not for load.
// The handler runs on the io_context. Its limits (kHttpLimits) keep one client from
// starving the others: one request per connection, no request bodies, a request line and
// headers of at most 8 KiB that must have arrived 5 s after the connection was accepted
// (however slowly they trickle in), 10 s to write the response, at most 64 connections at
// once (or the owner's share of the descriptors) and 8 from one address. A newcomer beyond
// either displaces a connection still waiting for its request, or is closed at once: at its
// address's cap, that address's oldest one (slow connections cannot lock out a prompt one
// from their own address, e.g. the loopback health check); with all connections taken, the
// oldest of the address holding the most, when that holds at least two more than the
// newcomer's (many addresses holding slow connections cannot lock out one that holds few).
// A request it does not take is answered 431 (headers too large), 413 (a body) or 400
// (malformed).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>

#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/steady_timer.hpp>

namespace mg::rdzv {

struct HttpResponse {
  int status = 200;
  std::string content_type = "text/plain; charset=utf-8";
  std::string body;
};
struct HttpRequest {
  std::string method;
  std::string target;         // path and query
  std::string authorization;  // the Authorization header, "" when absent
};
using HttpHandler = std::function<HttpResponse(const HttpRequest&)>;

struct HttpLimits {
  std::size_t max_connections = 64;
  std::size_t max_per_address = 8;
  std::size_t max_header_bytes = 8192;              // request line and headers
  std::chrono::milliseconds request_timeout{5000};  // from accept to the end of the headers
  std::chrono::milliseconds write_timeout{10000};   // the whole response
};
inline constexpr HttpLimits kHttpLimits{};

class HttpServer {
 public:
  // Binds and listens at once; throws std::runtime_error naming the address on failure.
  HttpServer(boost::asio::io_context& io, const std::string& host, int port, HttpHandler handler,
             std::size_t max_connections = kHttpLimits.max_connections);
  ~HttpServer();
  int port() const { return port_; }
  std::string address() const;
  // Stops accepting and closes every open connection, answered or not, so that none keeps
  // the io_context running until its deadline.
  void stop();
  // The address it listens on is a loopback one (127.0.0.0/8, ::1).
  bool loopback() const;

 private:
  struct Session;
  // Open connections, in total and per client address; shared with sessions (which may
  // outlive a stop()) and touched only on the io_context.
  struct Connections {
    std::size_t total = 0;
    std::map<boost::asio::ip::address, std::size_t> per_address;
    std::set<Session*> open;  // closed by stop()
    std::uint64_t accepted = 0;
    bool stopped = false;
  };
  void accept();
  // At the connection limit, for a newcomer whose address holds `newcomer_holds`: closes
  // the connection to displace (see above); false when none may be.
  bool evict_for(std::size_t newcomer_holds);
  // At the cap of `peer`'s address: closes its connection that has waited longest for its
  // request; false when none waits.
  bool evict_oldest_of(const boost::asio::ip::address& peer);

  boost::asio::io_context& io_;
  std::string host_;
  boost::asio::ip::tcp::acceptor acceptor_;
  boost::asio::steady_timer pause_;  // after an accept error (EMFILE), before the next accept
  std::shared_ptr<HttpHandler> handler_;  // shared with sessions that outlive a stop()
  int port_ = 0;
  std::size_t max_connections_;
  std::shared_ptr<Connections> connections_ = std::make_shared<Connections>();
  bool stopped_ = false;
};

// Prometheus text exposition: a label value with \, " and newline escaped.
std::string prometheus_label(const std::string& value);

}  // namespace mg::rdzv
