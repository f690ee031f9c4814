#include "launcher/file_timer.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <utility>

#include <boost/asio/posix/stream_descriptor.hpp>
#include <boost/asio/system_timer.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "launcher/plan.h"

namespace mg::ftimer {

namespace asio = boost::asio;

std::optional<Request> parse_request(std::string_view line, std::string& error) {
  const auto j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) {
    error = "not a JSON object";
    return std::nullopt;
  }
  Request r;
  auto field = [&](const char* name) -> const nlohmann::json* {
    auto it = j.find(name);
    return it == j.end() ? nullptr : &*it;
  };
  const auto* pid = field("pid");
  const auto* scope = field("scope_id");
  const auto* exp = field("expiration_time");
  const auto* sig = field("signal");
  if (!pid || !pid->is_number_integer() || pid->get<long long>() <= 0 || pid->get<long long>() > 0x3fffffff) {
    error = "no positive integer \"pid\"";
    return std::nullopt;
  }
  if (!scope || !scope->is_string()) {
    error = "no string \"scope_id\"";
    return std::nullopt;
  }
  if (!exp || !exp->is_number() || !std::isfinite(exp->get<double>())) {
    error = "no number \"expiration_time\"";
    return std::nullopt;
  }
  if (!sig || !sig->is_number_integer() || sig->get<long long>() < -1000 || sig->get<long long>() > 1000) {
    error = "no integer \"signal\"";
    return std::nullopt;
  }
  if (const auto* v = field("version"); v && v->is_number_integer()) r.version = v->get<int>();
  r.pid = static_cast<pid_t>(pid->get<long long>());
  r.scope_id = scope->get<std::string>();
  r.expiration_time = exp->get<double>();
  r.signal = static_cast<int>(sig->get<long long>());
  return r;
}

bool Table::apply(const Request& r) {
  // A later process given the pid: the timers of the one that ended cannot reap anything.
  if (auto p = per_pid_.find(r.pid); p != per_pid_.end() && p->second.start != r.start) forget(r.pid);
  auto key = std::make_pair(r.pid, r.scope_id);
  auto it = timers_.find(key);
  if (r.expiration_time < 0) {
    if (it != timers_.end()) erase(it);
    return true;
  }
  if (it != timers_.end()) {  // a new deadline for a timer held
    by_deadline_.erase({it->second.expiration_time, r.pid, r.scope_id});
    it->second = r;
    by_deadline_.insert({r.expiration_time, r.pid, r.scope_id});
    return true;
  }
  PerPid& mine = per_pid_[r.pid];
  if (mine.timers >= max_per_pid_ || timers_.size() >= max_timers_) {
    if (mine.timers == 0) per_pid_.erase(r.pid);
    return false;
  }
  ++mine.timers;
  mine.start = r.start;
  timers_.emplace(std::move(key), r);
  by_deadline_.insert({r.expiration_time, r.pid, r.scope_id});
  return true;
}

void Table::forget(pid_t pid) {
  for (auto it = timers_.lower_bound({pid, std::string()}); it != timers_.end() && it->first.first == pid;)
    erase(it++);
}

void Table::erase(std::map<std::pair<pid_t, std::string>, Request>::iterator it) {
  by_deadline_.erase({it->second.expiration_time, it->first.first, it->first.second});
  if (auto p = per_pid_.find(it->first.first); p != per_pid_.end() && --p->second.timers == 0) per_pid_.erase(p);
  timers_.erase(it);
}

std::vector<Expired> Table::expire(double now) {
  std::set<pid_t> pids;  // only the processes with a timer due: no scan of the others
  for (auto it = by_deadline_.begin(); it != by_deadline_.end() && std::get<0>(*it) <= now; ++it)
    pids.insert(std::get<1>(*it));
  std::vector<Expired> out;
  for (pid_t pid : pids) {
    std::vector<const Request*> list;
    for (auto it = timers_.lower_bound({pid, std::string()}); it != timers_.end() && it->first.first == pid; ++it)
      if (it->second.expiration_time <= now) list.push_back(&it->second);
    std::stable_sort(list.begin(), list.end(),
                     [](const Request* a, const Request* b) { return a->expiration_time < b->expiration_time; });
    Expired e;
    e.pid = pid;
    e.start = list.front()->start;
    e.scope_id = list.front()->scope_id;
    e.expiration_time = list.front()->expiration_time;
    for (const Request* r : list) {
      e.scopes.push_back(r->scope_id);
      if (e.signal == 0 && r->signal > 0) {
        e.signal = r->signal;
        e.scope_id = r->scope_id;
        e.expiration_time = r->expiration_time;
      }
    }
    out.push_back(std::move(e));
  }
  for (const Expired& e : out) forget(e.pid);
  return out;
}

std::optional<double> Table::next_deadline() const {
  if (by_deadline_.empty()) return std::nullopt;
  return std::get<0>(*by_deadline_.begin());
}

void AdmissionCache::add(pid_t pid, std::uint64_t start, bool leader,
                         const std::function<bool(pid_t, std::uint64_t)>& alive) {
  if (entries_.size() >= max_ && !entries_.contains(pid)) {
    std::erase_if(entries_, [&](const auto& e) { return !e.second.leader && !alive(e.first, e.second.start); });
    if (entries_.size() >= max_) {  // all alive: the older half goes (they are walked again if they ask)
      std::vector<std::uint64_t> order;
      for (const auto& [p, e] : entries_) order.push_back(e.added);
      std::nth_element(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(order.size() / 2), order.end());
      const std::uint64_t median = order[order.size() / 2];
      std::erase_if(entries_, [&](const auto& e) { return e.second.added < median; });
    }
  }
  entries_[pid] = Entry{start, leader, next_++};
}

std::string default_pipe_path() {
  std::array<unsigned char, 16> b{};
  random_bytes(b.data(), b.size());
  b[6] = static_cast<unsigned char>((b[6] & 0x0f) | 0x40);  // version 4
  b[8] = static_cast<unsigned char>((b[8] & 0x3f) | 0x80);  // RFC 4122 variant
  std::string hex;
  for (std::size_t i = 0; i < b.size(); ++i) {
    if (i == 4 || i == 6 || i == 8 || i == 10) hex += '-';
    hex += fmt::format("{:02x}", b[i]);
  }
  return "/tmp/watchdog_timer_" + hex;
}

struct Server::Impl : std::enable_shared_from_this<Impl> {
  Impl(asio::io_context& io, std::string p, ServerHooks h)
      : path(std::move(p)), hooks(std::move(h)), pipe(io), timer(io) {}

  static constexpr std::size_t kMaxLine = 64 * 1024;  // torch's client writes at most PIPE_BUF (4 KiB)
  static constexpr int kMaxLogged = 10;               // malformed lines said, then only counted

  std::string path;
  ServerHooks hooks;
  asio::posix::stream_descriptor pipe;
  int writer = -1;  // our own writer: the pipe never reads as ended between clients
  dev_t dev = 0;    // the pipe made (stop() removes only it)
  ino_t ino = 0;
  asio::system_timer timer;
  Table table;
  AdmissionCache cache;
  std::array<char, 8192> chunk{};
  std::string partial;
  bool skipping = false;  // inside a line longer than kMaxLine
  bool stopped = false;
  int bad_lines = 0;

  void log(const std::string& line) {
    if (hooks.log) hooks.log(line);
  }
  void event(const std::string& name, const Request* r) {
    if (hooks.event) hooks.event(name, r);
  }

  void read() {
    pipe.async_read_some(asio::buffer(chunk), [self = shared_from_this()](boost::system::error_code ec, std::size_t n) {
      if (self->stopped) return;
      if (ec) {
        if (ec != asio::error::operation_aborted)
          self->log(fmt::format("the FileTimer pipe {} cannot be read ({}): worker timers are no longer watched",
                                self->path, ec.message()));
        return;
      }
      self->take(std::string_view(self->chunk.data(), n));
      self->arm();
      self->read();
    });
  }

  void take(std::string_view data) {
    while (!data.empty()) {
      const auto nl = data.find('\n');
      const std::string_view piece = data.substr(0, nl);
      if (!skipping) {
        if (partial.size() + piece.size() > kMaxLine) {
          skipping = true;
          partial.clear();
          bad(fmt::format("a line longer than {} bytes", kMaxLine));
        } else {
          partial.append(piece);
        }
      }
      if (nl == std::string_view::npos) return;
      if (!skipping && !partial.empty()) line(partial);
      partial.clear();
      skipping = false;
      data.remove_prefix(nl + 1);
    }
  }

  void line(const std::string& text) {
    std::string error;
    auto r = parse_request(text, error);
    if (!r) {
      bad(error);
      return;
    }
    if (r->expiration_time < 0) {  // a release: nothing to check (a timer never held changes nothing)
      r->start = released_start(r->pid);
    } else if (!admitted(*r)) {
      return dropped(*r, "that process is not one of this agent's workers or their descendants");
    }
    if (!table.apply(*r))
      dropped(*r, fmt::format("at most {} timers per process and {} in all are kept", Table::kMaxPerPid,
                              Table::kMaxTimers));
  }

  // Whether r.pid may hold timers, and its start time into r.start: a worker leader the
  // agent has not reaped is known without /proc; any other process costs one read of its
  // stat, and the walk up its parent chain (hooks.admit) only the first time.
  bool admitted(Request& r) {
    if (hooks.is_worker && hooks.is_worker(r.pid)) {
      if (auto start = cache.leader_start(r.pid)) {
        r.start = *start;
        return true;
      }
      const auto st = read_proc_stat(r.pid);
      if (!st) return false;
      r.start = st->starttime;
      cache.add(r.pid, r.start, /*leader=*/true, alive);
      return true;
    }
    const auto st = read_proc_stat(r.pid);
    if (!st || st->state == 'Z') return false;
    r.start = st->starttime;
    if (cache.contains(r.pid, r.start)) return true;
    if (hooks.admit && !hooks.admit(*st)) return false;
    cache.add(r.pid, r.start, /*leader=*/false, alive);
    return true;
  }
  // A release names no start time: the timers held for the pid are the ones released
  // (those of an ended process given the same pid cannot be told apart by a release, and
  // releasing them reaps nothing).
  std::uint64_t released_start(pid_t pid) const { return table.start_of(pid).value_or(0); }
  static bool alive(pid_t pid, std::uint64_t start) {
    const auto st = read_proc_stat(pid);
    return st && st->starttime == start && st->state != 'Z';
  }

  // At most one line a second (the next one counts those left out).
  std::chrono::steady_clock::time_point last_drop_log{};
  std::size_t unlogged_drops = 0;
  void dropped(const Request& r, const std::string& why) {
    const auto now = std::chrono::steady_clock::now();
    if (last_drop_log != std::chrono::steady_clock::time_point{} && now - last_drop_log < std::chrono::seconds(1)) {
      ++unlogged_drops;
      return;
    }
    last_drop_log = now;
    log(fmt::format("FileTimer pipe {}: dropped timer '{}' of pid {}: {}{}", path, r.scope_id, r.pid, why,
                    unlogged_drops ? fmt::format(" (and {} more dropped in the second before)",
                                                 std::exchange(unlogged_drops, 0))
                                   : ""));
  }

  void bad(const std::string& why) {
    if (++bad_lines <= kMaxLogged)
      log(fmt::format("FileTimer pipe {}: ignored a request ({}){}", path, why,
                      bad_lines == kMaxLogged ? "; further ones are not reported" : ""));
  }

  static double now_s() {
    return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  }

  // The timer fires at the next expiry (time.time() terms: the system clock).
  void arm() {
    const auto next = table.next_deadline();
    if (!next) {
      timer.cancel();
      return;
    }
    const auto at = std::chrono::system_clock::time_point(std::chrono::duration_cast<std::chrono::system_clock::duration>(
        std::chrono::duration<double>(std::min(*next, 4.0e9))));
    timer.expires_at(at);
    timer.async_wait([self = shared_from_this()](boost::system::error_code ec) {
      if (ec || self->stopped) return;
      self->fire();
    });
  }

  void fire() {
    for (const Expired& e : table.expire(now_s())) {
      Request r;
      r.pid = e.pid;
      r.scope_id = e.scope_id;
      r.expiration_time = e.expiration_time;
      r.signal = e.signal;
      event("timer expired", &r);
      if (e.signal <= 0) {
        log(fmt::format("FileTimer '{}' of pid {} expired; it asked for no signal, so it is not reaped", e.scope_id,
                        e.pid));
        continue;
      }
      if (hooks.reap) hooks.reap(e);
    }
    arm();
  }

  void stop() {
    if (stopped) return;
    stopped = true;
    boost::system::error_code ec;
    timer.cancel();
    pipe.close(ec);
    if (writer >= 0) ::close(writer);
    writer = -1;
    // Only our own pipe: one made at the same path since (a later run) is not ours to remove.
    struct stat st{};
    if (::lstat(path.c_str(), &st) == 0 && st.st_dev == dev && st.st_ino == ino) ::unlink(path.c_str());
    event("watchdog stopped", nullptr);
  }
};

Server::Server(asio::io_context& io, std::string path, ServerHooks hooks)
    : impl_(std::make_shared<Impl>(io, std::move(path), std::move(hooks))) {
  const std::string& p = impl_->path;
  struct stat st{};
  if (::lstat(p.c_str(), &st) == 0) {
    if (!S_ISFIFO(st.st_mode))
      throw std::runtime_error(fmt::format("TORCHELASTIC_TIMER_FILE '{}' exists and is not a named pipe: remove it or "
                                           "name another path",
                                           p));
    // A live reader (another agent's FileTimer server): opening for writing succeeds only
    // then. Replacing its pipe would leave its workers' timers unwatched: refused.
    if (const int probe = ::open(p.c_str(), O_WRONLY | O_NONBLOCK | O_CLOEXEC); probe >= 0) {
      ::close(probe);
      throw std::runtime_error(fmt::format("TORCHELASTIC_TIMER_FILE '{}' is a named pipe that a live process reads "
                                           "(another agent's FileTimer?): give each agent its own path, or leave the "
                                           "variable unset",
                                           p));
    }
    ::unlink(p.c_str());  // a pipe left by an earlier run, as torch's server replaces it
  }
  if (::mkfifo(p.c_str(), 0600) != 0)
    throw std::runtime_error(fmt::format("TORCHELASTIC_TIMER_FILE '{}': cannot create the named pipe: {}; name a path "
                                         "in a writable directory",
                                         p, std::strerror(errno)));
  const int rd = ::open(p.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  const int wr = rd < 0 ? -1 : ::open(p.c_str(), O_WRONLY | O_NONBLOCK | O_CLOEXEC);
  if (rd < 0 || wr < 0) {
    const int err = errno;
    if (rd >= 0) ::close(rd);
    ::unlink(p.c_str());
    throw std::runtime_error(fmt::format("TORCHELASTIC_TIMER_FILE '{}': cannot open the named pipe: {}", p,
                                         std::strerror(err)));
  }
  impl_->pipe.assign(rd);
  impl_->writer = wr;
  if (::fstat(rd, &st) == 0) {
    impl_->dev = st.st_dev;
    impl_->ino = st.st_ino;
  }
  impl_->event("watchdog started", nullptr);
  impl_->read();
}

Server::~Server() { impl_->stop(); }

const std::string& Server::path() const { return impl_->path; }

void Server::clear() {
  impl_->table.clear();
  impl_->cache.clear();
  impl_->arm();
}

void Server::process_ended(pid_t pid) {
  impl_->table.forget(pid);
  impl_->cache.forget(pid);
  impl_->arm();
}

void Server::stop() { impl_->stop(); }

}  // namespace mg::ftimer
