#include "rendezvous/etcd_client.h"

#include <boost/asio/co_spawn.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/redirect_error.hpp>
#include <boost/asio/ssl.hpp>
#include <boost/asio/ssl/host_name_verification.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <boost/beast/ssl.hpp>
#include <fmt/format.h>

#include "rendezvous/lookup.h"


namespace mg::rdzv::etcd {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using asio::use_awaitable;
using std::chrono::milliseconds;

namespace {

constexpr std::size_t kMaxResponse = 64u << 20;

template <class Stream>
asio::awaitable<std::string> talk(Stream& s, const std::string& host, const std::string& target,
                                  const std::string& body, const std::string& token, milliseconds idle,
                                  const std::function<bool(const nlohmann::json&)>* on_message, int* status) {
  http::request<http::string_body> req{http::verb::post, target, 11};
  req.set(http::field::host, host);
  req.set(http::field::content_type, "application/json");
  if (!token.empty()) req.set(http::field::authorization, token);
  req.body() = body;
  req.prepare_payload();
  co_await http::async_write(s, req, use_awaitable);
  beast::flat_buffer buf;
  http::response_parser<http::buffer_body> p;
  p.body_limit(boost::none);
  co_await http::async_read_header(s, buf, p, use_awaitable);
  *status = static_cast<int>(p.get().result_int());
  const bool streaming = on_message && *status == 200;
  std::string all;
  JsonStream objects;
  char tmp[16384];
  while (!p.is_done()) {
    p.get().body().data = tmp;
    p.get().body().size = sizeof tmp;
    if (streaming) beast::get_lowest_layer(s).expires_after(idle);
    boost::system::error_code ec;
    co_await http::async_read_some(s, buf, p, asio::redirect_error(use_awaitable, ec));
    if (ec == http::error::need_buffer) ec = {};
    if (ec) throw boost::system::system_error(ec);
    const std::size_t got = sizeof tmp - p.get().body().size;
    if (!streaming) {
      all.append(tmp, got);
      if (all.size() > kMaxResponse) throw Error("etcd's answer is larger than 64 MiB");
      continue;
    }
    objects.feed(std::string_view(tmp, got));
    while (auto j = objects.next())
      if (!(*on_message)(*j)) co_return std::string();
  }
  if (streaming) throw Error("the stream ended");
  co_return all;
}

std::string describe(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const boost::system::system_error& se) {
    if (se.code() == beast::error::timeout) return "timed out";
    return se.code().message();
  } catch (const std::exception& ex) {
    return ex.what();
  }
  return "unknown error";
}

}  // namespace

Http::Http(std::vector<Endpoint> endpoints, Credentials credentials)
    : endpoints_(std::move(endpoints)), cred_(std::move(credentials)), lookups_(std::make_unique<Lookups>(ioc_)) {
  if (endpoints_.empty()) throw Error("no etcd endpoint");
  bool tls = false;
  for (const auto& ep : endpoints_) tls = tls || ep.tls;
  if (!tls) return;
  ssl_ = std::make_unique<asio::ssl::context>(asio::ssl::context::tls_client);
  boost::system::error_code ec;
  if (!cred_.cacert.empty()) ssl_->load_verify_file(cred_.cacert, ec);
  else ssl_->set_default_verify_paths(ec);
  if (ec) throw Error(fmt::format("cannot load the CA certificate '{}': {}", cred_.cacert, ec.message()));
  ssl_->set_verify_mode(asio::ssl::verify_peer);
  if (!cred_.cert.empty()) {
    ssl_->use_certificate_chain_file(cred_.cert, ec);
    if (ec) throw Error(fmt::format("cannot load the client certificate '{}': {}", cred_.cert, ec.message()));
    ssl_->use_private_key_file(cred_.key.empty() ? cred_.cert : cred_.key, asio::ssl::context::pem, ec);
    if (ec) throw Error(fmt::format("cannot load the client key '{}': {}", cred_.key, ec.message()));
  }
}

Http::~Http() = default;

std::string Http::all() const {
  std::string out;
  for (const auto& ep : endpoints_) out += (out.empty() ? "" : ", ") + ep.text();
  return out;
}

void Http::fail_over() { current_ = (current_ + 1) % endpoints_.size(); }

void Http::stop() {
  stopped_ = true;
  ioc_.stop();
}

std::string Http::run_exchange(const Endpoint& ep, const std::string& path, const std::string& body,
                               milliseconds timeout, milliseconds idle,
                               const std::function<bool(const nlohmann::json&)>* on_message, int* status) {
  if (stopped_) throw Error("stopped");
  auto work = [&]() -> asio::awaitable<std::string> {
    auto ex = co_await asio::this_coro::executor;
    beast::tcp_stream tcp(ex);
    tcp.expires_after(timeout);
    // The name off this thread and within the try's bound (rendezvous/lookup.h): Asio's
    // resolver thread would be joined when ioc_ goes, however long getaddrinfo waits (#35).
    const Addresses found = co_await asio::async_initiate<decltype(use_awaitable), void(Addresses)>(
        [&](auto handler) {
          auto h = std::make_shared<decltype(handler)>(std::move(handler));
          lookups_->start(ep.host, ep.port, timeout, [h](Addresses a) { std::move(*h)(std::move(a)); });
        },
        use_awaitable);
    if (found.found.empty()) throw Error(fmt::format("cannot resolve '{}': {}", ep.host, found.error));
    co_await tcp.async_connect(found.found, use_awaitable);
    const std::string host = fmt::format("{}:{}", ep.host, ep.port);
    if (!ep.tls) co_return co_await talk(tcp, host, path, body, token_, idle, on_message, status);
    beast::ssl_stream<beast::tcp_stream> tls(std::move(tcp), *ssl_);
    if (!SSL_set_tlsext_host_name(tls.native_handle(), ep.host.c_str()))
      throw Error("cannot set the TLS server name");
    tls.set_verify_callback(asio::ssl::host_name_verification(ep.host));
    co_await tls.async_handshake(asio::ssl::stream_base::client, use_awaitable);
    co_return co_await talk(tls, host, path, body, token_, idle, on_message, status);
  };
  std::string result;
  std::exception_ptr error;
  bool finished = false;
  asio::co_spawn(ioc_, work(), [&](std::exception_ptr e, std::string r) {
    finished = true;
    error = e;
    result = std::move(r);
  });
  ioc_.restart();
  if (!stopped_) ioc_.run();  // a stop() from now on makes run() return
  if (stopped_ || !finished) throw Error("stopped");
  if (error) throw Error(describe(error));
  return result;
}

void Http::authenticate(const Endpoint& ep, milliseconds timeout) {
  int status = 0;
  const std::string body = nlohmann::json{{"name", cred_.user}, {"password", cred_.password}}.dump();
  token_.clear();
  const auto text = run_exchange(ep, "/v3/auth/authenticate", body, timeout, timeout, nullptr, &status);
  auto j = nlohmann::json::parse(text, nullptr, false);
  if (status != 200 || !j.is_object() || !j.contains("token"))
    throw Error(fmt::format("authentication as '{}' failed: {}", cred_.user,
                            j.is_object() ? j.value("message", j.value("error", text)) : text),
                /*answered=*/true);
  token_ = j["token"].get<std::string>();
}

nlohmann::json Http::call(const std::string& path, const nlohmann::json& body, milliseconds timeout) {
  std::string errors;
  bool answered = false;
  int refused = 0;  // endpoints that answered 4xx
  int refused_status = 0;
  const std::string text = body.dump();
  for (std::size_t tried = 0; tried < endpoints_.size(); ++tried) {
    const auto& ep = endpoints_[current_];
    for (int attempt = 0; attempt < 2; ++attempt) {
      try {
        if (!cred_.user.empty() && token_.empty()) authenticate(ep, timeout);
        int status = 0;
        const auto answer = run_exchange(ep, path, text, timeout, timeout, nullptr, &status);
        auto j = nlohmann::json::parse(answer, nullptr, false);
        if (status == 200 && j.is_object()) return j;
        const std::string message =
            j.is_object() ? j.value("message", j.value("error", answer)) : fmt::format("HTTP {}", status);
        if (!cred_.user.empty() && attempt == 0 && message.find("token") != std::string::npos) {
          token_.clear();  // expired or from another member: authenticate again
          continue;
        }
        throw Error(fmt::format("HTTP {}: {}", status, message), /*answered=*/true, status);
      } catch (const Error& e) {
        if (stopped_) throw;
        answered = answered || e.answered;
        if (e.status >= 400 && e.status < 500) {
          ++refused;
          refused_status = e.status;
        }
        errors += fmt::format("{}{}: {}", errors.empty() ? "" : "; ", ep.text(), e.what());
        break;
      }
    }
    fail_over();
  }
  throw Error(errors, answered, refused == static_cast<int>(endpoints_.size()) ? refused_status : 0);
}

void Http::stream(const std::string& path, const nlohmann::json& body, milliseconds connect_timeout, milliseconds idle,
                  const std::function<bool(const nlohmann::json&)>& on_message) {
  const auto& ep = endpoints_[current_];
  if (!cred_.user.empty() && token_.empty()) authenticate(ep, connect_timeout);
  int status = 0;
  const auto answer = run_exchange(ep, path, body.dump(), connect_timeout, idle, &on_message, &status);
  if (status != 200) {
    if (answer.find("token") != std::string::npos) token_.clear();
    throw Error(fmt::format("{}: HTTP {}: {}", ep.text(), status, answer.substr(0, 200)));
  }
}

}  // namespace mg::rdzv::etcd
