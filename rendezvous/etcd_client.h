// etcd's v3 JSON gateway over HTTP/1.1 (Boost.Beast), blocking calls with deadlines for one
// thread: POST /v3/... with a JSON body, fail over between the listed endpoints, TLS
// (https://, OpenSSL: --rdzv_conf cacert/cert/key) and user/password (/v3/auth/authenticate,
// its token sent in the Authorization header and renewed when etcd refuses it). stream()
// reads a streamed response (/v3/watch) object by object. stop() may be called from any
// thread: it ends the call or stream in progress and every later one.
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include <boost/asio/io_context.hpp>
#include <nlohmann/json.hpp>

#include "rendezvous/etcd_log.h"
#include "rendezvous/lookup.h"

namespace boost::asio::ssl {
class context;
}

namespace mg::rdzv::etcd {

struct Error : std::runtime_error {
  explicit Error(const std::string& what, bool answered_ = false, int status_ = 0)
      : std::runtime_error(what), answered(answered_), status(status_) {}
  bool answered;  // some endpoint answered (and refused): not an outage
  int status;     // 4xx when every endpoint refused the request itself (no retry helps), else 0
};

struct Credentials {
  std::string user, password;  // --rdzv_conf user=..., MGLAUNCH_ETCD_PASSWORD
  std::string cacert;          // PEM file of the CA that signed etcd's certificate (default: the system's)
  std::string cert, key;       // this client's certificate and key (etcd --client-cert-auth)
};

class Http {
 public:
  Http(std::vector<Endpoint> endpoints, Credentials credentials);
  ~Http();
  Http(const Http&) = delete;
  Http& operator=(const Http&) = delete;

  // POSTs `body` to `path` ("/v3/kv/range") on the current endpoint, then on each other one
  // until one answers 200; each try is bounded by `timeout`. Throws Error naming every
  // endpoint and why it failed.
  nlohmann::json call(const std::string& path, const nlohmann::json& body, std::chrono::milliseconds timeout);
  // One streamed request to the current endpoint: on_message gets each JSON object until
  // it returns false, the response ends, nothing arrives for `idle`, or stop(). Throws
  // Error when the request fails or the stream breaks.
  void stream(const std::string& path, const nlohmann::json& body, std::chrono::milliseconds connect_timeout,
              std::chrono::milliseconds idle, const std::function<bool(const nlohmann::json&)>& on_message);
  void fail_over();  // the next call or stream starts at the next endpoint
  std::string current() const { return endpoints_[current_].text(); }
  std::string all() const;  // "http://a:2379, http://b:2379"
  void stop();
  bool stopped() const { return stopped_; }

 private:
  struct Exchange;
  std::string run_exchange(const Endpoint& ep, const std::string& path, const std::string& body,
                           std::chrono::milliseconds timeout, std::chrono::milliseconds idle,
                           const std::function<bool(const nlohmann::json&)>* on_message, int* status);
  void authenticate(const Endpoint& ep, std::chrono::milliseconds timeout);

  std::vector<Endpoint> endpoints_;
  Credentials cred_;
  std::size_t current_ = 0;
  std::string token_;
  boost::asio::io_context ioc_;
  std::unique_ptr<Lookups> lookups_;  // on ioc_; goes before it (abandoning a lookup under way)
  std::unique_ptr<boost::asio::ssl::context> ssl_;
  std::atomic<bool> stopped_{false};
};

}  // namespace mg::rdzv::etcd
