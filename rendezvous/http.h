// HttpServer: a small HTTP/1.1 server (Boost.Beast) on the caller's io_context, for the
// Prometheus /metrics endpoint and status pages. One request per connection, no request
// bodies, headers up to 8 KiB, 5 s per connection, at most 64 connections at once: it is
// for scrapers and operators, not for load. The handler runs on the io_context.
#pragma once

#include <functional>
#include <memory>
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

class HttpServer {
 public:
  // Binds and listens at once; throws std::runtime_error naming the address on failure.
  HttpServer(boost::asio::io_context& io, const std::string& host, int port, HttpHandler handler);
  ~HttpServer();
  int port() const { return port_; }
  std::string address() const;
  void stop();

 private:
  struct Session;
  void accept();

  boost::asio::io_context& io_;
  std::string host_;
  boost::asio::ip::tcp::acceptor acceptor_;
  boost::asio::steady_timer pause_;  // after an accept error (EMFILE), before the next accept
  std::shared_ptr<HttpHandler> handler_;  // shared with sessions that outlive a stop()
  int port_ = 0;
  std::shared_ptr<int> active_ = std::make_shared<int>(0);  // open connections, shared with sessions
  bool stopped_ = false;
};

// Prometheus text exposition: a label value with \, " and newline escaped.
std::string prometheus_label(const std::string& value);

}  // namespace mg::rdzv
