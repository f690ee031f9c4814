#include "worker/control.h"

#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstring>
#include <stdexcept>

#include <nlohmann/json.hpp>

namespace mg::train {
namespace {

constexpr std::size_t kMaxLine = 64 * 1024;  // the protocol's bound on one message

}  // namespace

void Interrupt::fire() {
  std::function<void()> hook;
  {
    std::lock_guard lk(m);
    fired = true;
    cv.notify_all();
    hook = on_fire;
  }
  if (hook) hook();
}

void Interrupt::clear() {
  std::lock_guard lk(m);
  fired = false;
}

ControlChannel::ControlChannel(const std::string& name, int local_rank, std::shared_ptr<Interrupt> interrupt,
                               std::chrono::milliseconds welcome_timeout, bool standby)
    : local_rank_(local_rank), interrupt_(std::move(interrupt)) {
  if (name.size() < 2 || name[0] != '@')
    throw std::runtime_error("MGLAUNCH_CONTROL_SOCKET='" + name + "' is not an abstract socket name (@name)");
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (name.size() > sizeof(addr.sun_path)) throw std::runtime_error("MGLAUNCH_CONTROL_SOCKET is too long");
  std::memcpy(addr.sun_path + 1, name.data() + 1, name.size() - 1);  // sun_path[0] = 0: abstract
  const auto len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + name.size());
  fd_ = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd_ < 0) throw std::runtime_error(std::string("socket: ") + std::strerror(errno));
  if (::connect(fd_, reinterpret_cast<sockaddr*>(&addr), len) != 0) {
    const int err = errno;
    ::close(fd_);
    throw std::runtime_error("cannot connect to the agent's control socket " + name + ": " + std::strerror(err));
  }
  nlohmann::json hello = {{"type", "hello"}, {"version", 1}, {"pid", ::getpid()}, {"local_rank", local_rank}, {"in_place", true}};
  if (standby) hello["standby"] = true;
  if (!send_line(hello.dump())) {
    ::close(fd_);
    throw std::runtime_error("cannot write hello to the agent's control socket " + name);
  }
  reader_ = std::thread([this] { read_loop(); });
  std::unique_lock lk(mu_);
  if (!cv_.wait_for(lk, welcome_timeout, [&] { return welcomed_ || closed_; }) || !welcomed_) {
    const std::string why = closed_ ? closed_reason_ : "no welcome within " + std::to_string(welcome_timeout.count()) + " ms";
    lk.unlock();
    ::shutdown(fd_, SHUT_RDWR);
    reader_.join();
    ::close(fd_);
    throw std::runtime_error("the agent's control socket " + name + " did not welcome this worker: " + why);
  }
}

ControlChannel::~ControlChannel() {
  ::shutdown(fd_, SHUT_RDWR);  // wakes the reader's recv
  if (reader_.joinable()) reader_.join();
  ::close(fd_);
}

bool ControlChannel::send_line(const std::string& line) {
  std::string data = line + "\n";
  std::size_t off = 0;
  while (off < data.size()) {
    const ssize_t n = ::send(fd_, data.data() + off, data.size() - off, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    off += static_cast<std::size_t>(n);
  }
  return true;
}

void ControlChannel::send_paused(std::int64_t step) { send_line(nlohmann::json{{"type", "paused"}, {"step", step}}.dump()); }

void ControlChannel::withdraw() {
  send_line(nlohmann::json{{"type", "hello"}, {"version", 1}, {"pid", ::getpid()}, {"local_rank", local_rank_},
                           {"in_place", false}}
                .dump());
}

void ControlChannel::read_loop() {
  std::string buf;
  char chunk[4096];
  std::string reason = "the agent closed the control channel";
  for (;;) {
    const ssize_t n = ::recv(fd_, chunk, sizeof(chunk), 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    buf.append(chunk, static_cast<std::size_t>(n));
    std::size_t nl;
    while ((nl = buf.find('\n')) != std::string::npos) {
      std::string line = buf.substr(0, nl);
      buf.erase(0, nl + 1);
      handle(line);
    }
    if (buf.size() > kMaxLine) {
      reason = "the agent sent a control message over 64 KiB";
      break;
    }
  }
  std::lock_guard lk(mu_);
  if (!closed_) closed_reason_ = reason;
  closed_ = true;
  cv_.notify_all();
}

void ControlChannel::handle(const std::string& line) {
  nlohmann::json m = nlohmann::json::parse(line, nullptr, false);
  const std::string type = m.is_object() && m.contains("type") && m["type"].is_string() ? m["type"].get<std::string>() : "";
  std::lock_guard lk(mu_);
  if (type == "welcome") {
    welcomed_ = true;
  } else if (type == "pause") {
    Pause p;
    p.round = m.value("round", 0);
    p.reason = m.value("reason", std::string("the agent starts a new round"));
    p.lost = m.value("lost", std::string("peer"));
    p.at = std::chrono::steady_clock::now();
    if (pause_) p.at = pause_->at;  // a second pause: the failure was detected at the first
    pause_ = p;
    assign_.reset();  // an assign before this pause is for a round that already ended
    interrupt_->fire();
  } else if (type == "assign") {
    Assignment a;
    a.round = m.value("round", 0);
    a.restart_count = m.value("restart_count", 0);
    if (m.contains("env") && m["env"].is_object())
      for (auto& [k, v] : m["env"].items()) a.env[k] = v.is_string() ? v.get<std::string>() : v.dump();
    assign_ = a;
  } else if (type == "error") {
    closed_ = true;
    closed_reason_ = "the agent refused: " + m.value("message", std::string("(no message)"));
  }
  cv_.notify_all();
}

std::optional<Pause> ControlChannel::wait_pause(std::chrono::milliseconds timeout) {
  std::unique_lock lk(mu_);
  cv_.wait_for(lk, timeout, [&] { return pause_.has_value() || assign_.has_value() || closed_; });
  if (pause_) return pause_;
  if (assign_) {  // an assign with no pause before it: the round changed all the same
    Pause p;
    p.at = std::chrono::steady_clock::now();
    return p;
  }
  return std::nullopt;
}

std::optional<Assignment> ControlChannel::wait_assign(std::chrono::milliseconds timeout) {
  std::unique_lock lk(mu_);
  cv_.wait_for(lk, timeout, [&] { return assign_.has_value() || closed_; });
  if (!assign_) return std::nullopt;
  Assignment a = std::move(*assign_);
  assign_.reset();
  pause_.reset();
  interrupt_->clear();
  return a;
}

std::string ControlChannel::closed_reason() {
  std::lock_guard lk(mu_);
  return closed_ ? closed_reason_ : "";
}

}  // namespace mg::train
