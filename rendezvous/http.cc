#include "rendezvous/http.h"

#include <algorithm>
#include <vector>

#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <fmt/format.h>

#include "proto/accept_backoff.h"
#include "rendezvous/lookup.h"

namespace mg::rdzv {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;

struct HttpServer::Session : std::enable_shared_from_this<Session> {
  Session(asio::ip::tcp::socket s, asio::ip::address peer, std::shared_ptr<HttpHandler> h,
          std::shared_ptr<Connections> connections)
      : stream(std::move(s)), peer(peer), handler(std::move(h)), connections(std::move(connections)) {
    ++this->connections->total;
    ++this->connections->per_address[peer];
    this->connections->open.insert(this);
    seq = ++this->connections->accepted;
    parser.header_limit(static_cast<std::uint32_t>(kHttpLimits.max_header_bytes));
    parser.body_limit(0);
  }
  ~Session() { release(); }

  // Gives its place back (once): from its close on, it counts as gone.
  void release() {
    if (released) return;
    released = true;
    connections->open.erase(this);
    --connections->total;
    if (auto it = connections->per_address.find(peer); it != connections->per_address.end() && --it->second == 0)
      connections->per_address.erase(it);
  }

  void start() {
    // One deadline for the whole request, not reset by each byte: a client trickling its
    // headers in is closed as surely as a silent one.
    stream.expires_after(kHttpLimits.request_timeout);
    http::async_read(stream, buffer, parser, [self = shared_from_this()](beast::error_code ec, std::size_t) {
      self->on_read(ec);
    });
  }

  void on_read(beast::error_code ec) {
    waiting = false;
    if (connections->stopped) return close();
    if (ec) {
      // A request it will not take gets a status saying why; a client that went away or
      // ran out of time gets nothing.
      if (ec == http::error::header_limit || ec == http::error::buffer_overflow)
        return refuse(431, fmt::format("request line and headers over {} bytes\n", kHttpLimits.max_header_bytes));
      if (ec == http::error::body_limit) return refuse(413, "no request body is accepted\n");
      if (ec.category() == http::make_error_code(http::error::bad_target).category() && ec != http::error::end_of_stream &&
          ec != http::error::partial_message)
        return refuse(400, fmt::format("bad request: {}\n", ec.message()));
      return close();
    }
    const auto& req = parser.get();
    HttpResponse r;
    try {
      HttpRequest request{std::string(req.method_string()), std::string(req.target()), ""};
      if (auto it = req.find(http::field::authorization); it != req.end()) request.authorization = std::string(it->value());
      r = (*handler)(request);
    } catch (const std::exception& e) {
      r = {500, "text/plain; charset=utf-8", fmt::format("internal error: {}\n", e.what())};
    }
    respond(req.version(), req.method() == http::verb::head, std::move(r));
  }

  void refuse(int status, std::string text) { respond(11, false, {status, "text/plain; charset=utf-8", std::move(text)}); }

  void respond(unsigned version, bool head, HttpResponse r) {
    res.version(version);
    res.result(static_cast<http::status>(r.status));
    res.set(http::field::server, "mglaunch");
    res.set(http::field::content_type, r.content_type);
    res.set(http::field::cache_control, "no-store");
    res.keep_alive(false);
    if (head) {  // the headers a GET would get, no body
      res.content_length(r.body.size());
    } else {
      res.body() = std::move(r.body);
      res.prepare_payload();
    }
    stream.expires_after(kHttpLimits.write_timeout);  // a client that does not read its answer
    http::async_write(stream, res, [self = shared_from_this()](beast::error_code, std::size_t) { self->close(); });
  }

  void close() {
    release();
    beast::error_code ignored;
    stream.socket().shutdown(asio::ip::tcp::socket::shutdown_both, ignored);
    stream.close();
  }

  beast::tcp_stream stream;
  asio::ip::address peer;
  beast::flat_buffer buffer{kHttpLimits.max_header_bytes};
  http::request_parser<http::empty_body> parser;
  http::response<http::string_body> res;
  std::shared_ptr<HttpHandler> handler;
  std::shared_ptr<Connections> connections;
  std::uint64_t seq = 0;  // order of acceptance
  bool waiting = true;    // for its request
  bool released = false;
};

HttpServer::HttpServer(asio::io_context& io, const std::string& host, int port, HttpHandler handler,
                       std::size_t max_connections)
    : io_(io),
      host_(host),
      acceptor_(io),
      pause_(io),
      handler_(std::make_shared<HttpHandler>(std::move(handler))),
      max_connections_(std::max<std::size_t>(1, max_connections)) {
  boost::system::error_code ec;
  auto addr = asio::ip::make_address(host, ec);
  if (ec) {  // a name: looked up within a bound (rendezvous/lookup.h)
    const Addresses found = lookup_within(host, 0);
    if (found.found.empty())
      throw std::runtime_error(fmt::format("cannot resolve HTTP listen address '{}': {}", host, found.error));
    addr = found.found.front().address();
    ec.clear();
  }
  asio::ip::tcp::endpoint ep(addr, static_cast<unsigned short>(port));
  acceptor_.open(ep.protocol(), ec);
  if (!ec) acceptor_.set_option(asio::ip::tcp::acceptor::reuse_address(true), ec);
  if (!ec) acceptor_.bind(ep, ec);
  if (!ec) acceptor_.listen(asio::socket_base::max_listen_connections, ec);
  if (ec) throw std::runtime_error(fmt::format("cannot listen for HTTP on {}:{}: {}", host, port, ec.message()));
  port_ = acceptor_.local_endpoint().port();
  accept();
}

HttpServer::~HttpServer() { stop(); }

std::string HttpServer::address() const { return fmt::format("{}:{}", host_, port_); }

bool HttpServer::loopback() const {
  boost::system::error_code ec;
  const auto ep = acceptor_.local_endpoint(ec);
  return !ec && ep.address().is_loopback();
}

void HttpServer::stop() {
  if (stopped_) return;
  stopped_ = true;
  boost::system::error_code ec;
  acceptor_.close(ec);
  pause_.cancel();
  connections_->stopped = true;
  const std::vector<Session*> open(connections_->open.begin(), connections_->open.end());
  for (Session* s : open) s->close();  // each leaves the set; its completion comes later
}

bool HttpServer::evict_oldest_of(const asio::ip::address& peer) {
  Session* victim = nullptr;
  for (Session* s : connections_->open)
    if (s->waiting && s->peer == peer && (!victim || s->seq < victim->seq)) victim = s;
  if (!victim) return false;
  victim->close();
  return true;
}

bool HttpServer::evict_for(std::size_t newcomer_holds) {
  Session* victim = nullptr;
  std::size_t most = 0;
  for (Session* s : connections_->open) {
    if (!s->waiting) continue;
    const std::size_t n = connections_->per_address.at(s->peer);
    if (!victim || n > most || (n == most && s->seq < victim->seq)) {
      victim = s;
      most = n;
    }
  }
  if (!victim || most < newcomer_holds + 2) return false;
  victim->close();
  return true;
}

void HttpServer::accept() {
  acceptor_.async_accept([this](boost::system::error_code ec, asio::ip::tcp::socket socket) {
    if (stopped_) return;
    if (!ec) {
      boost::system::error_code peer_ec;
      auto peer = socket.remote_endpoint(peer_ec).address();
      if (peer.is_v6() && peer.to_v6().is_v4_mapped()) peer = asio::ip::make_address_v4(asio::ip::v4_mapped, peer.to_v6());
      const auto it = connections_->per_address.find(peer);
      const std::size_t holds = it == connections_->per_address.end() ? 0 : it->second;
      // At its address's cap, a newcomer displaces that address's connection that has waited
      // longest for its request: slow connections cannot lock out a prompt one (a loopback
      // health check) from their own address.
      const std::size_t per_address = std::min(kHttpLimits.max_per_address, max_connections_);
      const bool admitted = !peer_ec && (holds >= per_address                ? evict_oldest_of(peer)
                                         : connections_->total >= max_connections_ ? evict_for(holds)
                                                                                    : true);
      if (!admitted) {
        boost::system::error_code ignored;
        socket.close(ignored);
      } else {
        std::make_shared<Session>(std::move(socket), peer, handler_, connections_)->start();
      }
    } else if (ec != asio::error::operation_aborted) {
      // Out of descriptors (EMFILE) or another accept error: pause instead of spinning.
      proto::pause_accepts(pause_, [this] {
        if (!stopped_) accept();
      });
      return;
    }
    accept();
  });
}

std::string prometheus_label(const std::string& value) {
  std::string out;
  out.reserve(value.size());
  for (char c : value) {
    if (c == '\\') out += "\\\\";
    else if (c == '"') out += "\\\"";
    else if (c == '\n') out += "\\n";
    else out += c;
  }
  return out;
}

}  // namespace mg::rdzv
