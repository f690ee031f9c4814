#include "rendezvous/lookup.h"

#include <netdb.h>

#include <cstring>
#include <mutex>

#include <boost/asio/post.hpp>
#include <fmt/format.h>

#include "process/thread.h"

namespace mg::rdzv {
namespace asio = boost::asio;

namespace {

Addresses resolve_now(const std::string& host, int port, int family, bool passive, bool numeric_only) {
  addrinfo hints{};
  hints.ai_family = family;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV | (passive ? AI_PASSIVE : 0) | (numeric_only ? AI_NUMERICHOST : 0);
  addrinfo* head = nullptr;
  Addresses out;
  const std::string service = std::to_string(port);
  if (const int rc = ::getaddrinfo(host.empty() ? nullptr : host.c_str(), service.c_str(), &hints, &head); rc != 0) {
    out.error = rc == EAI_SYSTEM ? std::string(std::strerror(errno)) : std::string(::gai_strerror(rc));
    return out;
  }
  for (const addrinfo* p = head; p; p = p->ai_next) {
    if (p->ai_addrlen > sizeof(sockaddr_storage)) continue;
    asio::ip::tcp::endpoint ep;
    std::memcpy(ep.data(), p->ai_addr, p->ai_addrlen);
    ep.resize(p->ai_addrlen);
    out.found.push_back(ep);
  }
  ::freeaddrinfo(head);
  if (out.found.empty()) out.error = "no address";
  return out;
}

// An address (or the empty host of a passive lookup) needs no lookup: nullopt for a name.
std::optional<Addresses> numeric(const std::string& host, int port, int family, bool passive) {
  if (host.empty() && passive) return resolve_now(host, port, family, passive, true);
  Addresses a = resolve_now(host, port, family, passive, true);
  if (a.found.empty()) return std::nullopt;
  return a;
}

// Whether the owner of a lookup still waits for it (io thread).
template <class Shared>
bool live(const std::weak_ptr<Shared>& w) {
  const auto s = w.lock();
  if (!s) return false;
  std::lock_guard g(s->m);
  return s->alive;
}

std::string no_answer(const std::string& host, std::chrono::milliseconds bound) {
  return fmt::format("no answer for '{}' within {:.0f} s (a DNS server that does not answer?)", host,
                     std::chrono::duration<double>(bound).count());
}

}  // namespace

Addresses lookup_within(const std::string& host, int port, std::chrono::milliseconds bound, int family, bool passive) {
  if (auto a = numeric(host, port, family, passive)) return std::move(*a);
  if (auto a = run_within<Addresses>(bound, [=] { return resolve_now(host, port, family, passive, false); }))
    return std::move(*a);
  Addresses late;
  late.error = no_answer(host, bound);
  late.timed_out = true;
  return late;
}

// A lookup's thread posts its answer only while its owner lives: ~Lookups and cancel() clear
// `alive` under the mutex the thread holds while it posts, so nothing reaches an io_context
// (or an owner) that is gone.
struct Lookups::Shared {
  std::mutex m;
  bool alive = true;
};

Lookups::Lookups(asio::io_context& io) : io_(io), shared_(std::make_shared<Shared>()) {}

Lookups::~Lookups() { cancel(); }

void Lookups::cancel() {
  {
    std::lock_guard g(shared_->m);
    shared_->alive = false;
  }
  shared_ = std::make_shared<Shared>();
  for (auto& [id, p] : pending_) p.timer->cancel();
  pending_.clear();
}

void Lookups::start(const std::string& host, int port, std::chrono::milliseconds bound,
                    std::function<void(Addresses)> done, int family) {
  const std::uint64_t id = ++next_;
  Pending& p = pending_[id];
  p.done = std::move(done);
  p.timer = std::make_unique<asio::steady_timer>(io_);
  std::weak_ptr<Shared> alive = shared_;
  if (auto a = numeric(host, port, family, false)) {
    asio::post(io_, [this, id, alive, a = std::move(*a)]() mutable {
      if (live(alive)) deliver(id, std::move(a));
    });
    return;
  }
  p.timer->expires_after(bound);
  p.timer->async_wait([this, id, alive, host, bound](boost::system::error_code ec) {
    if (ec || !live(alive)) return;
    Addresses late;
    late.error = no_answer(host, bound);
    late.timed_out = true;
    deliver(id, std::move(late));
  });
  signal_free_thread([shared = shared_, io = &io_, this, id, host, port, family] {
    Addresses a = resolve_now(host, port, family, false, false);
    std::lock_guard g(shared->m);
    if (!shared->alive) return;  // the owner (and perhaps the io_context) is gone
    asio::post(*io, [this, id, alive = std::weak_ptr<Shared>(shared), a = std::move(a)]() mutable {
      if (live(alive)) deliver(id, std::move(a));
    });
  }).detach();  // abandoned when its owner goes first
}

void Lookups::deliver(std::uint64_t id, Addresses a) {
  auto it = pending_.find(id);
  if (it == pending_.end()) return;  // answered already (the bound, or the answer)
  auto done = std::move(it->second.done);
  it->second.timer->cancel();
  pending_.erase(it);
  done(std::move(a));  // last: it may start lookups or destroy this
}

}  // namespace mg::rdzv
