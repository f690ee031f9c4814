#include "launcher/job_record.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <cstring>
#include <string_view>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "process/fd.h"
#include "process/thread.h"

namespace mg {

namespace {

constexpr std::size_t kMaxRecordBytes = 64 * 1024;

std::string errno_text() { return std::strerror(errno); }

// Why `st` (of `what`) is no file or directory of this user's alone; "" when it is. `open`:
// the mode bits that make it so (077 for a file; 022 for a directory, where only writing
// matters: a `mkdir` under umask 022 gives 0755, review s38 M4).
std::string not_ours(const struct stat& st, const std::string& what, mode_t open) {
  if (st.st_uid != ::geteuid())
    return fmt::format("{} belongs to uid {}, not to this user (uid {})", what, st.st_uid, ::geteuid());
  if ((st.st_mode & open) != 0) return fmt::format("{} is open to other users (mode {:o})", what, st.st_mode & 0777);
  return {};
}

// `text` as one printable line: a control byte or a byte past ASCII (raw bytes a parser
// quotes from the file) becomes '?', at most 200 characters (review s38 L1).
std::string printable_line(const std::string& text) {
  std::string out;
  for (unsigned char c : text.substr(0, 200)) out += (c >= 0x20 && c < 0x7f) ? static_cast<char>(c) : '?';
  return out;
}

std::int64_t ms_of(const timespec& t) { return static_cast<std::int64_t>(t.tv_sec) * 1000 + t.tv_nsec / 1000000; }

}  // namespace

std::string node_identity(const std::string& advertised, const std::string& hostname) {
  return advertised + "@" + hostname;
}

std::string job_endpoint(const std::string& backend, const std::string& endpoint) {
  return backend + " " + endpoint;
}

std::string job_record_dir(const std::string& record_dir_env, const std::string& xdg_runtime_dir, uid_t uid) {
  if (!record_dir_env.empty()) return record_dir_env;
  // (A missing one, as Slurm's --export=ALL passes the login node's /run/user/UID to nodes
  // without pam_systemd, is passed over without a word: review s38 M4.)
  struct stat st{};
  if (!xdg_runtime_dir.empty() && ::stat(xdg_runtime_dir.c_str(), &st) == 0 && S_ISDIR(st.st_mode))
    return xdg_runtime_dir + "/mglaunch";
  return fmt::format("/tmp/mglaunch-{}", uid);
}

std::string job_record_name(const std::string& job, const std::string& node, const std::string& endpoint) {
  std::uint64_t h = 14695981039346656037ull;  // FNV-1a, 64 bits
  auto mix = [&h](const std::string& s) {
    for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
    h = (h ^ 0xffu) * 1099511628211ull;  // (a separator no UTF-8 text holds)
  };
  mix(job);
  mix(node);
  mix(endpoint);
  return fmt::format("job-{:016x}.json", h);
}

std::string job_record_path(const std::string& dir, const std::string& job, const std::string& node,
                            const std::string& endpoint) {
  return dir + "/" + job_record_name(job, node, endpoint);
}

std::shared_ptr<JobRecordDir> JobRecordDir::open(const std::string& dir, std::string* why) {
  auto fail = [&](std::string text) -> std::shared_ptr<JobRecordDir> {
    if (why) *why = std::move(text);
    return nullptr;
  };
  if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST)
    return fail(fmt::format("cannot make the record directory {}: {}", dir, errno_text()));
  Fd fd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
  if (fd.get() < 0) {
    if (errno == ENOTDIR || errno == ELOOP)
      return fail(fmt::format("the record directory {} is not a directory (a link?)", dir));
    return fail(fmt::format("cannot use the record directory {}: {}", dir, errno_text()));
  }
  struct stat st{};
  if (::fstat(fd.get(), &st) != 0) return fail(fmt::format("cannot use the record directory {}: {}", dir, errno_text()));
  if (auto bad = not_ours(st, "the record directory " + dir, 022); !bad.empty()) return fail(bad);
  return std::shared_ptr<JobRecordDir>(new JobRecordDir(std::move(fd), dir));
}

std::string JobRecordDir::write(const JobRecord& r) const {
  nlohmann::json hosts = nlohmann::json::array();
  for (const auto& [h, p] : r.hosts) hosts.push_back({h, p});
  const std::string text =
      nlohmann::json{{"job", r.job},     {"node", r.node},   {"endpoint", r.endpoint},
                     {"run", r.run},     {"epoch", r.epoch}, {"hosts", hosts},
                     {"takeover_port", r.takeover_port}}
          .dump() +
      "\n";
  const std::string name = job_record_name(r.job, r.node, r.endpoint);
  const std::string tmp = fmt::format("{}.{}.tmp", name, ::getpid());
  auto where = [&](const std::string& n) { return path_ + "/" + n; };
  Fd fd(::openat(fd_.get(), tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0600));
  if (fd.get() < 0) return fmt::format("cannot write {}: {}", where(tmp), errno_text());
  if (!write_fully(fd.get(), text) || ::fsync(fd.get()) != 0) {
    const std::string why = fmt::format("cannot write {}: {}", where(tmp), errno_text());
    ::unlinkat(fd_.get(), tmp.c_str(), 0);
    return why;
  }
  fd.reset();
  if (::renameat(fd_.get(), tmp.c_str(), fd_.get(), name.c_str()) != 0) {
    const std::string why = fmt::format("cannot rename {} to {}: {}", where(tmp), where(name), errno_text());
    ::unlinkat(fd_.get(), tmp.c_str(), 0);
    return why;
  }
  // The rename itself reaches the disk (a record that a power loss took is no record).
  if (::fsync(fd_.get()) != 0) return fmt::format("cannot sync the record directory {}: {}", path_, errno_text());
  return {};
}

std::optional<JobRecord> JobRecordDir::read(const std::string& job, const std::string& node,
                                            const std::string& endpoint, std::string* why) const {
  const std::string name = job_record_name(job, node, endpoint);
  const std::string path = path_ + "/" + name;
  Fd fd(::openat(fd_.get(), name.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK));
  if (fd.get() < 0) {
    if (errno != ENOENT && why) *why = fmt::format("cannot read {}: {}", path, errno_text());
    return std::nullopt;
  }
  struct stat st{};
  std::string bad;
  if (::fstat(fd.get(), &st) != 0) bad = errno_text();
  else if (!S_ISREG(st.st_mode)) bad = "not a regular file";
  else if (static_cast<std::size_t>(st.st_size) > kMaxRecordBytes) bad = fmt::format("{} bytes", st.st_size);
  else bad = not_ours(st, "the file", 077);
  std::string text;
  if (bad.empty()) {
    text.resize(static_cast<std::size_t>(st.st_size));
    if (::read(fd.get(), text.data(), text.size()) != static_cast<ssize_t>(text.size())) bad = "a short read";
  }
  JobRecord r;
  if (bad.empty()) {
    try {
      const auto j = nlohmann::json::parse(text);
      r.job = j.at("job").get<std::string>();
      r.node = j.at("node").get<std::string>();
      r.endpoint = j.at("endpoint").get<std::string>();
      r.run = j.at("run").get<std::string>();
      r.epoch = j.at("epoch").get<int>();
      for (const auto& h : j.at("hosts")) {
        const int port = h.at(1).get<int>();
        if (port < 1 || port > 65535) {
          bad = fmt::format("not a record (port {} outside 1..65535)", port);
          break;
        }
        r.hosts.emplace_back(h.at(0).get<std::string>(), port);
      }
      r.takeover_port = j.value("takeover_port", 0);  // (absent from a record before it: none)
    } catch (const nlohmann::json::exception& e) {
      // (nlohmann quotes the file's bytes, control characters and newlines too.)
      bad = fmt::format("not a record ({})", printable_line(e.what()));
    }
  }
  if (!bad.empty()) {
    if (why) *why = fmt::format("ignoring {}: {}", path, bad);
    return std::nullopt;
  }
  // Another job's, node's or endpoint's (the hash's collision).
  if (r.job != job || r.node != node || r.endpoint != endpoint) return std::nullopt;
  r.written_ms = ms_of(st.st_mtim);
  return r;
}

bool JobRecordDir::touch(const std::string& job, const std::string& node, const std::string& endpoint) const {
  return ::utimensat(fd_.get(), job_record_name(job, node, endpoint).c_str(), nullptr, AT_SYMLINK_NOFOLLOW) == 0;
}

void JobRecordDir::remove(const std::string& job, const std::string& node, const std::string& endpoint) const {
  ::unlinkat(fd_.get(), job_record_name(job, node, endpoint).c_str(), 0);
}

int JobRecordDir::sweep(std::chrono::system_clock::time_point now, std::chrono::seconds max_age,
                        const std::function<bool(pid_t)>& alive) const {
  const int again = ::openat(fd_.get(), ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);  // closedir() closes it
  DIR* d = again < 0 ? nullptr : ::fdopendir(again);
  if (!d) {
    if (again >= 0) ::close(again);
    return 0;
  }
  const std::int64_t oldest_ms =
      std::chrono::duration_cast<std::chrono::milliseconds>((now - max_age).time_since_epoch()).count();
  std::vector<std::string> doomed;
  while (const dirent* e = ::readdir(d)) {
    const std::string_view n = e->d_name;
    // job-<16 hex>.json, or that and .PID.tmp
    constexpr std::size_t kRecord = 4 + 16 + 5;
    if (n.size() < kRecord || !n.starts_with("job-") || n.substr(20, 5) != ".json") continue;
    bool gone = false;
    if (n.size() == kRecord) {
      gone = true;  // by its age, below
    } else if (n.ends_with(".tmp") && n[kRecord] == '.') {
      const std::string_view digits = n.substr(kRecord + 1, n.size() - kRecord - 5);
      pid_t pid = 0;
      const auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), pid);
      gone = ec == std::errc() && end == digits.data() + digits.size() && pid > 0 && !alive(pid);
      if (!gone) continue;
    } else {
      continue;
    }
    struct stat st{};
    if (::fstatat(fd_.get(), e->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISREG(st.st_mode) || st.st_uid != ::geteuid())
      continue;
    if (n.size() == kRecord && ms_of(st.st_mtim) >= oldest_ms) continue;
    doomed.emplace_back(n);
  }
  ::closedir(d);
  int removed = 0;
  for (const auto& n : doomed) removed += ::unlinkat(fd_.get(), n.c_str(), 0) == 0;
  return removed;
}

JobRecordWriter::Ops JobRecordWriter::ops_of(std::shared_ptr<const JobRecordDir> dir) {
  Ops ops;
  ops.write = [dir](const JobRecord& r) { return dir->write(r); };
  ops.touch = [dir](const JobRecord& r) { dir->touch(r.job, r.node, r.endpoint); };
  ops.remove = [dir](const JobRecord& r) { dir->remove(r.job, r.node, r.endpoint); };
  ops.sweep = [dir] {
    dir->sweep(std::chrono::system_clock::now(), kJobRecordMaxAge,
               [](pid_t pid) { return ::kill(pid, 0) == 0 || errno != ESRCH; });
  };
  return ops;
}

JobRecordWriter::JobRecordWriter(Ops ops) : ops_(std::move(ops)) {
  thread_ = signal_free_thread([this] { loop(); });
}

JobRecordWriter::~JobRecordWriter() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void JobRecordWriter::write(JobRecord r) {
  {
    std::lock_guard lock(mu_);
    last_ = r;
    pending_write_ = std::move(r);  // the one that waited, if any, is outdated
    pending_touch_ = pending_remove_ = false;
  }
  cv_.notify_all();
}

void JobRecordWriter::touch() {
  {
    std::lock_guard lock(mu_);
    if (!last_ || pending_write_ || pending_remove_) return;
    pending_touch_ = true;
  }
  cv_.notify_all();
}

void JobRecordWriter::remove() {
  {
    std::lock_guard lock(mu_);
    if (!last_) return;
    pending_write_.reset();
    pending_touch_ = false;
    pending_remove_ = true;
  }
  cv_.notify_all();
}

void JobRecordWriter::sweep() {
  {
    std::lock_guard lock(mu_);
    pending_sweep_ = true;
  }
  cv_.notify_all();
}

void JobRecordWriter::drain() {
  std::unique_lock lock(mu_);
  cv_.wait(lock, [this] { return !busy_ && !pending_write_ && !pending_touch_ && !pending_remove_ && !pending_sweep_; });
}

std::string JobRecordWriter::take_error() {
  std::lock_guard lock(mu_);
  return std::exchange(error_, {});
}

void JobRecordWriter::loop() {
  std::unique_lock lock(mu_);
  for (;;) {
    cv_.wait(lock, [this] { return stop_ || pending_write_ || pending_touch_ || pending_remove_ || pending_sweep_; });
    if (!pending_write_ && !pending_touch_ && !pending_remove_ && !pending_sweep_) return;  // stopped, all done
    // One operation at a time, in the order they matter: the start's sweep, then the record.
    std::function<void()> op;
    if (std::exchange(pending_sweep_, false)) {
      op = [this] { ops_.sweep(); };
    } else if (pending_remove_) {
      pending_remove_ = false;
      op = [this, r = *last_] { ops_.remove(r); };
    } else if (pending_write_) {
      op = [this, r = std::move(*pending_write_)] {
        std::string why = ops_.write(r);
        if (why.empty()) return;
        std::lock_guard relock(mu_);
        if (error_.empty()) error_ = std::move(why);
      };
      pending_write_.reset();
    } else {
      pending_touch_ = false;
      op = [this, r = *last_] { ops_.touch(r); };
    }
    busy_ = true;
    lock.unlock();
    op();
    lock.lock();
    busy_ = false;
    cv_.notify_all();
  }
}

}  // namespace mg
