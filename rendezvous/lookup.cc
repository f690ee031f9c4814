#include "rendezvous/lookup.h"

#include <netdb.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
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
  return lookup_until(host, port, std::chrono::steady_clock::now() + bound, -1, family, passive);
}

Addresses lookup_until(const std::string& host, int port, std::chrono::steady_clock::time_point deadline,
                       int cancel_fd, int family, bool passive) {
  using Clock = std::chrono::steady_clock;
  if (auto a = numeric(host, port, family, passive)) return std::move(*a);
  const auto t0 = Clock::now();
  deadline = std::min(deadline, t0 + kLookupBound);
  if (deadline <= t0) {  // no time left: no thread
    Addresses none;
    none.error = no_answer(host, std::chrono::milliseconds(0));
    none.timed_out = true;
    return none;
  }
  // The lookup's thread sets the answer and signals an eventfd, which the caller polls beside
  // `cancel_fd`; both outlive whichever of them goes first.
  struct Answer {
    std::mutex m;
    std::optional<Addresses> value;
    int ready = -1;
    ~Answer() {
      if (ready >= 0) ::close(ready);
    }
  };
  auto answer = std::make_shared<Answer>();
  answer->ready = ::eventfd(0, EFD_CLOEXEC);
  if (answer->ready < 0) {  // no descriptor: wait without the cancel
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - t0);
    if (auto a = run_within<Addresses>(left, [=] { return resolve_now(host, port, family, passive, false); }))
      return std::move(*a);
    Addresses late;
    late.error = no_answer(host, left);
    late.timed_out = true;
    return late;
  }
  signal_free_thread([answer, host, port, family, passive] {
    Addresses a = resolve_now(host, port, family, passive, false);
    std::lock_guard g(answer->m);
    answer->value = std::move(a);
    const std::uint64_t one = 1;
    [[maybe_unused]] const ssize_t w = ::write(answer->ready, &one, sizeof one);
  }).detach();  // abandoned when the caller gives up first: it ends when getaddrinfo returns
  for (;;) {
    const auto now = Clock::now();
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - now).count();
    pollfd p[2] = {{answer->ready, POLLIN, 0}, {cancel_fd, POLLIN, 0}};
    const int r = left > 0 ? ::poll(p, cancel_fd >= 0 ? 2 : 1, static_cast<int>(left)) : 0;
    if (r < 0 && errno == EINTR) continue;
    {
      std::lock_guard g(answer->m);
      if (answer->value) return std::move(*answer->value);
    }
    Addresses none;
    if (r > 0 && cancel_fd >= 0 && p[1].revents) {
      none.error = "cancelled";
    } else if (r < 0) {
      none.error = std::strerror(errno);
    } else if (r > 0) {
      continue;  // (the eventfd, and the answer set before it: not reached)
    } else {
      none.error = no_answer(host, std::chrono::duration_cast<std::chrono::milliseconds>(deadline - t0));
      none.timed_out = true;
    }
    return none;
  }
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
