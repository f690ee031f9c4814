#include "rendezvous/journal.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>

#include <fmt/format.h>

#include "proto/text.h"

namespace mg::rdzv {

namespace {
constexpr std::size_t kRecentEvents = 1000;

std::string errno_text() { return std::strerror(errno); }

// The kinds after which the journal is flushed to disk: those that change a job's state.
bool durable(const std::string& kind) { return kind != "joined" && kind != "standby" && kind != "log"; }

bool write_all(int fd, const std::string& bytes) {
  std::size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    done += static_cast<std::size_t>(n);
  }
  return true;
}
}  // namespace

void fold_event(nlohmann::json& s, const nlohmann::json& e) {
  const std::string kind = e.value("event", "");
  const std::string job = e.value("job", "");
  const bool rebuilt = kind == "created" && e.value("how", "") == "re-registered" && s.is_object();
  if (!s.is_object() || (kind == "created" && !rebuilt)) {
    // A new run of this id starts a new summary (an id may be used again once a job ended).
    // The last run that ended (done, failed) stays named in it ("ended_run", "ended_state"):
    // a daemon restarted before the new run's first round still tells that run's stragglers
    // its end (Server::job_of(), review s39 L1).
    nlohmann::json ended = nlohmann::json::object();
    if (s.is_object()) {
      const std::string state = s.value("state", "");
      if ((state == "done" || state == "failed") && s.contains("run") && s["run"].is_string())
        ended = {{"ended_run", s["run"]}, {"ended_state", state}};
      else if (s.contains("ended_run") && s["ended_run"].is_string())
        ended = {{"ended_run", s["ended_run"]}, {"ended_state", s.value("ended_state", "done")}};
    }
    s = {{"id", job}, {"state", "joining"}, {"round", 0}, {"restart_count", 0}, {"max_restarts", 0},
         {"min_nodes", 0}, {"max_nodes", 0}, {"standby_nodes", 0}, {"nodes", nlohmann::json::array()}};
    s.update(ended);
  }
  for (const char* k : {"round", "restart_count", "max_restarts", "min_nodes", "max_nodes"})
    if (e.contains(k) && e[k].is_number_integer()) s[k] = e[k];
  if (kind == "created" && e.contains("unix_ms")) s["created_unix_ms"] = e["unix_ms"];
  // The job's run, kept across a restart (Server::job_of() seeds its Job with it, review s38 M1).
  // With it, its epoch (the next round is one on, review s38-late H1).
  if (e.contains("run") && e["run"].is_string()) {
    s["run"] = e["run"];
    s["epoch"] = e.value("epoch", 0);
  }
  if (rebuilt) s["state"] = "running";  // a restarted daemon rebuilds the round its nodes re-registered
  if (kind == "round_started") {
    s["state"] = "running";
    nlohmann::json nodes = nlohmann::json::array();
    for (const auto& m : e.value("members", nlohmann::json::array()))
      if (m.is_object()) nodes.push_back({{"host", m.value("host", "")}, {"addr", m.value("addr", "")}, {"status", "running"}});
    s["nodes"] = nodes;
    s["node_count"] = e.value("nodes", 0);
    s["world_size"] = e.value("world_size", 0);
  } else if (kind == "restart" || kind == "takeover") {
    s["state"] = "restarting";
  } else if (kind == "forgotten") {
    // The daemon dropped a job that never ended (nobody connected: its agents killed, a
    // scancel, a preemption): it ended, and its id used again is a new run (review s38-late H1).
    s["state"] = kind;
  } else if (kind == "done" || kind == "failed") {
    s["state"] = kind;
    for (auto& n : s["nodes"]) n["status"] = kind;
    if (e.contains("unix_ms")) s["ended_unix_ms"] = e["unix_ms"];
    if (kind == "failed") s["root_cause"] = e.value("why", "");
  }
}

Journal::Journal(const std::string& dir, std::string& warning, std::uint64_t max_file_bytes)
    : dir_(dir), path_(dir + "/journal.jsonl"), old_path_(dir + "/journal.1.jsonl"), max_bytes_(max_file_bytes) {
  using K = JournalError::Kind;
  struct stat st{};
  if (dir.empty()) throw JournalError(K::kBadDir, "--state-dir is empty: give a directory the daemon may write");
  if (::stat(dir.c_str(), &st) != 0)
    throw JournalError(K::kBadDir, fmt::format("--state-dir '{}': {}; create it first (mkdir -p)", dir, errno_text()));
  if (!S_ISDIR(st.st_mode)) throw JournalError(K::kBadDir, fmt::format("--state-dir '{}' is not a directory", dir));
  lock_fd_ = ::open((dir + "/lock").c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (lock_fd_ < 0)
    throw JournalError(K::kBadDir, fmt::format("--state-dir '{}' is not writable ({}): give a directory this user "
                                               "may write", dir, errno_text()));
  if (::flock(lock_fd_, LOCK_EX | LOCK_NB) != 0) {
    ::close(lock_fd_);
    throw JournalError(K::kCorrupt, fmt::format("--state-dir '{}' is in use by another mglaunch-rdzv (its lock is "
                                                "held): give each daemon a directory of its own", dir));
  }
  try {
    load(old_path_, false, warning);
    load(path_, true, warning);
  } catch (...) {
    ::close(lock_fd_);
    throw;
  }
  fd_ = ::open(path_.c_str(), O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0600);
  if (fd_ < 0) {
    ::close(lock_fd_);
    throw JournalError(K::kBadDir, fmt::format("--state-dir '{}': cannot open {} for appending: {}", dir, path_,
                                               errno_text()));
  }
  if (::fstat(fd_, &st) == 0) size_ = static_cast<std::uint64_t>(st.st_size);
}

Journal::~Journal() {
  if (fd_ >= 0) {
    ::fdatasync(fd_);
    ::close(fd_);
  }
  if (lock_fd_ >= 0) ::close(lock_fd_);
}

void Journal::load(const std::string& path, bool tail_may_be_cut, std::string& warning) {
  if (::access(path.c_str(), F_OK) != 0) return;  // a new directory, or nothing rotated yet
  std::ifstream in(path, std::ios::binary);
  if (!in) throw JournalError(JournalError::Kind::kBadDir, fmt::format("--state-dir: cannot read {}", path));
  const std::string data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::size_t pos = 0, line_no = 0;
  while (pos < data.size()) {
    ++line_no;
    const std::size_t nl = data.find('\n', pos);
    const bool whole = nl != std::string::npos;
    const std::string_view line(data.data() + pos, (whole ? nl : data.size()) - pos);
    nlohmann::json e = line.size() <= kMaxLineBytes ? nlohmann::json::parse(line, nullptr, false)
                                                    : nlohmann::json(nlohmann::json::value_t::discarded);
    const bool good = whole && e.is_object() && e.contains("event") && e["event"].is_string() && e.contains("job") &&
                      e["job"].is_string();
    if (!good) {
      const bool last = !whole || nl + 1 == data.size();
      if (!tail_may_be_cut || !last)
        throw JournalError(JournalError::Kind::kCorrupt,
                           fmt::format("--state-dir: {} line {} is not a journal event (the file was edited or "
                                       "damaged): move it away to start with an empty history",
                                       path, line_no));
      // A crash cut the last write short: drop it.
      if (::truncate(path.c_str(), static_cast<off_t>(pos)) != 0)
        throw JournalError(JournalError::Kind::kBadDir,
                           fmt::format("--state-dir: cannot truncate {}'s cut last line: {}", path, errno_text()));
      warning = fmt::format("--state-dir: {}'s last {} bytes were not a whole event (a crash during a write?): "
                            "truncated", path, data.size() - pos);
      return;
    }
    remember(e);
    pos = nl + 1;
  }
}

void Journal::remember(const nlohmann::json& e) {
  const std::string job = e["job"].get<std::string>();
  auto it = jobs_.find(job);
  if (it == jobs_.end()) {
    if (jobs_.size() >= kMaxJobs) {
      auto oldest = std::min_element(jobs_.begin(), jobs_.end(),
                                     [](const auto& a, const auto& b) { return a.second.last_ms < b.second.last_ms; });
      jobs_.erase(oldest);
    }
    it = jobs_.emplace(job, JobHistory{}).first;
  }
  auto& h = it->second;
  fold_event(h.summary, e);
  h.events.push_back(e);
  if (h.events.size() > kMaxEventsPerJob) h.events.pop_front();
  h.last_ms = e.value("unix_ms", std::int64_t{0});
  recent_.push_back(e);
  if (recent_.size() > kRecentEvents) recent_.pop_front();
}

void Journal::rotate() {
  ::fdatasync(fd_);
  ::close(fd_);
  fd_ = -1;
  if (::rename(path_.c_str(), old_path_.c_str()) != 0) last_error = fmt::format("cannot rotate {}: {}", path_, errno_text());
  fd_ = ::open(path_.c_str(), O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0600);
  if (fd_ < 0) last_error = fmt::format("cannot open {}: {}", path_, errno_text());
  size_ = 0;
  // The directory entry of the new file outlives a crash too.
  if (int d = ::open(dir_.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC); d >= 0) {
    ::fsync(d);
    ::close(d);
  }
}

void Journal::record(const nlohmann::json& event, bool sync_now) {
  remember(event);
  std::string line = proto::dump_json(event);
  if (line.size() > kMaxLineBytes) return;  // never: events hold bounded text
  line += '\n';
  if (size_ + line.size() > max_bytes_ && size_ > 0) rotate();
  if (fd_ < 0) return;
  if (!write_all(fd_, line)) {
    last_error = fmt::format("cannot append to {}: {}", path_, errno_text());
    // No cut line stays behind for the next event to continue (the file would be corrupt).
    if (::ftruncate(fd_, static_cast<off_t>(size_)) != 0) last_error += "; and cannot truncate it back";
    return;
  }
  size_ += line.size();
  unsynced_ = unsynced_ || durable(event.value("event", ""));
  if (sync_now) sync();
}

void Journal::sync() {
  if (!unsynced_ || fd_ < 0) return;
  unsynced_ = false;
  if (::fdatasync(fd_) != 0) last_error = fmt::format("cannot flush {}: {}", path_, errno_text());
}

std::vector<nlohmann::json> Journal::last_events(std::size_t n) const {
  const std::size_t from = recent_.size() > n ? recent_.size() - n : 0;
  return {recent_.begin() + static_cast<std::ptrdiff_t>(from), recent_.end()};
}

}  // namespace mg::rdzv
