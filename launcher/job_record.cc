#include "launcher/job_record.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <charconv>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string_view>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "process/fd.h"
#include "process/thread.h"
#include "proto/text.h"

namespace mg {

namespace {

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

// `text` as one printable ASCII line (raw bytes a parser quotes from the file), from its
// first 200 bytes (review s38 L1).
std::string printable_line(std::string_view text) {
  return proto::printable(text.substr(0, 200), proto::Charset::kAscii);
}

// fsync of the record directory, "" or why not. EINVAL and ENOTSUP (some FUSE and network
// file systems cannot sync a directory) are no failure: the file itself was synced (review
// s39 L8).
std::string sync_dir(int fd, const std::string& path) {
  if (::fsync(fd) == 0 || errno == EINVAL || errno == ENOTSUP || errno == EOPNOTSUPP) return {};
  return fmt::format("cannot sync the record directory {}: {}", path, errno_text());
}

// A whole number in [lo, hi] from `j`, read wide (review s39 L4: get<int>() of 4294996796
// was 29500); throws std::runtime_error (caught as "not a record") otherwise.
std::int64_t integer_in(const nlohmann::json& j, std::int64_t lo, std::int64_t hi, const char* what) {
  if (!j.is_number_integer())
    throw std::runtime_error(fmt::format("{} {} is not a whole number", what, proto::dump_json(j)));
  const std::int64_t v = j.is_number_unsigned() && j.get<std::uint64_t>() > static_cast<std::uint64_t>(hi)
                             ? hi + 1
                             : j.get<std::int64_t>();
  if (v < lo || v > hi)
    throw std::runtime_error(fmt::format("{} {} outside {}..{}", what, proto::dump_json(j), lo, hi));
  return v;
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

std::string job_record_name(const std::string& job, const std::string& node, const std::string& endpoint, int slot,
                            bool lock) {
  std::uint64_t h = 14695981039346656037ull;  // FNV-1a, 64 bits
  auto mix = [&h](const std::string& s) {
    for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
    h = (h ^ 0xffu) * 1099511628211ull;  // (a separator no UTF-8 text holds)
  };
  mix(job);
  mix(node);
  mix(endpoint);
  return fmt::format("job-{:016x}{}.{}", h, slot > 0 ? fmt::format(".{}", slot) : "", lock ? "lock" : "json");
}

std::string job_record_path(const std::string& dir, const std::string& job, const std::string& node,
                            const std::string& endpoint, int slot) {
  return dir + "/" + job_record_name(job, node, endpoint, slot);
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

namespace {
std::string record_text(const JobRecord& r) {
  nlohmann::json hosts = nlohmann::json::array();
  for (const auto& [h, p] : r.hosts) hosts.push_back({h, p});
  nlohmann::json voter_hosts = nlohmann::json::array();
  for (const auto& [h, p] : r.voter_hosts) voter_hosts.push_back({h, p});
  // (dump_json: a string that is not UTF-8 never throws on the helper thread, review s39 L3.)
  return proto::dump_json(nlohmann::json{{"job", r.job},     {"node", r.node},   {"endpoint", r.endpoint},
                                         {"run", r.run},     {"epoch", r.epoch}, {"hosts", hosts},
                                         {"takeover_port", r.takeover_port}, {"voters", r.voters},
                                         {"voter_hosts", voter_hosts}, {"self_voter", r.self_voter}}) +
         "\n";
}
}  // namespace

std::string fit_job_record(JobRecord& r) {
  std::string text = record_text(r);
  if (text.size() <= kMaxJobRecordBytes) return text;
  // Unused without a voter count (the every-host rule).
  if (r.voters == 0) r.voter_hosts.clear();
  // With one, fewer targets or fewer countable answers cost only time: the majority is of
  // all `voters`. Without one every host must answer, and a host left out could be the
  // job's: never trimmed then.
  while ((text = record_text(r)).size() > kMaxJobRecordBytes && r.voters > 0 &&
         (!r.hosts.empty() || !r.voter_hosts.empty()))
    (r.hosts.size() >= r.voter_hosts.size() ? r.hosts : r.voter_hosts).pop_back();
  return text.size() <= kMaxJobRecordBytes ? text : std::string();
}

std::string JobRecordDir::write(const JobRecord& record) const {
  JobRecord r = record;
  const std::string text = fit_job_record(r);
  const std::string name = job_record_name(r.job, r.node, r.endpoint, r.slot);
  if (text.empty())  // (review s39-late L1: never a record a restarted agent refuses)
    return fmt::format("cannot write {}/{}: the record of job '{}' would exceed {} bytes", path_, name, r.job,
                       kMaxJobRecordBytes);
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
  return sync_dir(fd_.get(), path_);
}

std::optional<JobRecord> JobRecordDir::read(const std::string& job, const std::string& node,
                                            const std::string& endpoint, std::string* why, int slot) const {
  const std::string name = job_record_name(job, node, endpoint, slot);
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
  else if (static_cast<std::size_t>(st.st_size) > kMaxJobRecordBytes)
    bad = fmt::format("{} bytes, over the {} a record holds", st.st_size, kMaxJobRecordBytes);
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
      r.epoch = static_cast<int>(integer_in(j.at("epoch"), 0, INT_MAX, "epoch"));
      for (const auto& h : j.at("hosts"))
        r.hosts.emplace_back(h.at(0).get<std::string>(), static_cast<int>(integer_in(h.at(1), 1, 65535, "port")));
      if (j.contains("voter_hosts"))  // (absent before review s39-late H2: none, the every-host rule)
        for (const auto& h : j.at("voter_hosts"))
          r.voter_hosts.emplace_back(h.at(0).get<std::string>(),
                                     static_cast<int>(integer_in(h.at(1), 1, 65535, "port")));
      if (j.contains("takeover_port"))  // (absent from a record before it: none)
        r.takeover_port = static_cast<int>(integer_in(j.at("takeover_port"), 0, 65535, "takeover_port"));
      if (j.contains("voters"))  // (absent before review s39 H1: 0, unknown)
        r.voters = static_cast<int>(integer_in(j.at("voters"), 0, 1 << 20, "voters"));
      // Absent before review s40-recall M1: an older node wrote its own takeover address
      // among the voters' when it was one, so it is one only then, or when it had no port
      // (an older host, a socket never bound: the old rule). An older late standby's record
      // is none (review s41-c L1).
      const std::pair<std::string, int> own{node.substr(0, node.rfind('@')), r.takeover_port};
      r.self_voter = j.contains("self_voter")
                         ? j.at("self_voter").get<bool>()
                         : r.takeover_port == 0 || std::find(r.voter_hosts.begin(), r.voter_hosts.end(), own) !=
                                                       r.voter_hosts.end();
      // Fewer voters than their addresses: not one epoch's (review s40 L1), the every-host rule.
      if (static_cast<std::size_t>(r.voters) < r.voter_hosts.size()) r.voters = 0;
    } catch (const std::exception& e) {  // (nlohmann's, and integer_in's)
      // (nlohmann quotes the file's bytes, control characters and newlines too.)
      bad = fmt::format("not a record ({})", printable_line(e.what()));
    }
  }
  if (!bad.empty()) {
    if (why) *why = fmt::format("cannot use {}: {}", path, bad);
    return std::nullopt;
  }
  // Another job's, node's or endpoint's (the hash's collision).
  if (r.job != job || r.node != node || r.endpoint != endpoint) return std::nullopt;
  r.slot = slot;  // its file's, the key of a discard (never slot 0's: review s41-d H1)
  return r;
}

void JobRecordDir::remove(const std::string& job, const std::string& node, const std::string& endpoint,
                          int slot) const {
  // The removal reaches the disk too: a record back after a power loss costs a recall pass.
  if (::unlinkat(fd_.get(), job_record_name(job, node, endpoint, slot).c_str(), 0) == 0) sync_dir(fd_.get(), path_);
}

void JobRecordDir::release(const std::string& job, const std::string& node, const std::string& endpoint,
                           int slot) const {
  ::unlinkat(fd_.get(), job_record_name(job, node, endpoint, slot, /*lock=*/true).c_str(), 0);
}

std::optional<JobRecordSlot> JobRecordDir::claim(const std::string& job, const std::string& node,
                                                 const std::string& endpoint, std::string* why,
                                                 const JobRecordLockOps* ops) const {
  auto open_at = [&](const char* name, int flags) {
    return ops && ops->open ? ops->open(fd_.get(), name, flags, 0600) : ::openat(fd_.get(), name, flags, 0600);
  };
  auto lock_it = [&](int fd) { return ops && ops->flock ? ops->flock(fd, LOCK_EX | LOCK_NB) : ::flock(fd, LOCK_EX | LOCK_NB); };
  auto exists = [&](int n, bool lock) {
    struct stat st{};
    return ::fstatat(fd_.get(), job_record_name(job, node, endpoint, n, lock).c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0;
  };
  // Slot n's lock, held: its file locked and still the one at its name (one removed by its
  // agent at the job's end, release(), between the open and the lock is no lock). `err`: set
  // when the directory keeps no locks (record_dir_has_no_locks()); `created`: this call made
  // the file (O_EXCL), the only lock file it may remove unheld.
  auto take = [&](int n, int& err, bool& created) -> Fd {
    const std::string name = job_record_name(job, node, endpoint, n, /*lock=*/true);
    constexpr int kFlags = O_RDWR | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK;
    Fd fd(open_at(name.c_str(), kFlags | O_CREAT | O_EXCL));
    created = fd.get() >= 0;
    if (!created && errno == EEXIST) fd = Fd(open_at(name.c_str(), kFlags));
    if (fd.get() < 0) {
      if (record_dir_has_no_locks(errno, /*at_open=*/true)) err = errno;
      return Fd();
    }
    int got = -1;
    while ((got = lock_it(fd.get())) != 0 && errno == EINTR) {
    }
    if (got != 0 && record_dir_has_no_locks(errno, /*at_open=*/false)) {
      err = errno;
      if (created) ::unlinkat(fd_.get(), name.c_str(), 0);  // (no lock file of its own left behind)
      return Fd();
    }
    struct stat held{}, named{};
    if (got != 0 || ::fstat(fd.get(), &held) != 0 || !S_ISREG(held.st_mode) || held.st_uid != ::geteuid() ||
        ::fstatat(fd_.get(), name.c_str(), &named, AT_SYMLINK_NOFOLLOW) != 0 || named.st_ino != held.st_ino)
      return Fd();
    return fd;
  };
  std::optional<JobRecordSlot> first;  // the first slot got that holds no record
  bool first_created = false;
  for (int n = 0; n < kMaxJobRecordSlots; ++n) {
    // (Past the first slot got, only slots in use: one may hold a dead agent's record.)
    if (first && !exists(n, false) && !exists(n, true)) continue;
    int err = 0;
    bool created = false;
    Fd fd = take(n, err, created);
    if (err != 0) {
      // No slot unlocked, ever (review s41-e H1): a one-off ENOSPC or ENOLCK beside a live
      // agent's held slot 0 would share it, the #34 fork. The agent ends (exit 3).
      if (first && first_created)  // (held: its own, removed before the lock goes)
        ::unlinkat(fd_.get(), job_record_name(job, node, endpoint, first->slot, true).c_str(), 0);
      if (why)
        *why = fmt::format("cannot lock {}/{} ({}): set MGLAUNCH_RECORD_DIR to a directory on a local disk that "
                           "keeps flock locks (and has room)",
                           path_, job_record_name(job, node, endpoint, n, /*lock=*/true), std::strerror(err));
      return std::nullopt;
    }
    if (fd.get() < 0) continue;  // another live agent's (or unusable)
    if (exists(n, false)) return JobRecordSlot{n, std::move(fd)};  // a dead agent's record
    if (!first) {
      first = JobRecordSlot{n, std::move(fd)};
      first_created = created;
    }
  }
  if (!first && why)
    *why = fmt::format("none of the {} record slots of this node in {} can be locked (as many agents of this job "
                       "on this machine advertise one address?); give each agent --local_addr",
                       kMaxJobRecordSlots, path_);
  return first;
}

bool record_dir_has_no_locks(int err, bool at_open) {
  // A lock held (EWOULDBLOCK) or one slot's odd file (a link, a directory, another mode) is
  // that slot's alone; these are the whole directory's.
  if (at_open) return err == ENOSPC || err == EDQUOT || err == EROFS;
  return err != EWOULDBLOCK && err != EAGAIN && err != EINTR;
}

int JobRecordDir::sweep(std::chrono::system_clock::time_point now, std::chrono::seconds min_age,
                        const std::function<bool(pid_t)>& alive) const {
  const int again = ::openat(fd_.get(), ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);  // closedir() closes it
  DIR* d = again < 0 ? nullptr : ::fdopendir(again);
  if (!d) {
    if (again >= 0) ::close(again);
    return 0;
  }
  const std::int64_t newest_ms =
      std::chrono::duration_cast<std::chrono::milliseconds>((now - min_age).time_since_epoch()).count();
  auto hex = [](std::string_view v) {
    return std::all_of(v.begin(), v.end(), [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); });
  };
  std::vector<std::pair<std::string, struct stat>> doomed;
  while (const dirent* e = ::readdir(d)) {
    // job-<16 lowercase hex>[.SLOT].json.PID.tmp, as write() names it, and nothing else (review
    // s39 M1, L2; the slot: s41-c M1)
    const std::string_view n = e->d_name;
    if (n.size() <= 4 + 16 + 10 || !n.starts_with("job-") || !hex(n.substr(4, 16)) || !n.ends_with(".tmp")) continue;
    std::size_t at = 20;  // past the hash: the slot, if any
    if (n[at] == '.' && n[at + 1] >= '1' && n[at + 1] <= '9') {
      for (++at; at < n.size() && n[at] >= '0' && n[at] <= '9';) ++at;
    }
    if (n.substr(at, 6) != ".json.") continue;
    const std::size_t kRecord = at + 5;
    if (n.size() <= kRecord + 5) continue;
    const std::string_view digits = n.substr(kRecord + 1, n.size() - kRecord - 5);
    pid_t pid = 0;
    const auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), pid);
    if (ec != std::errc() || end != digits.data() + digits.size() || pid <= 0 || digits[0] == '0' || alive(pid))
      continue;
    struct stat st{};
    if (::fstatat(fd_.get(), e->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISREG(st.st_mode) ||
        st.st_uid != ::geteuid() || ms_of(st.st_mtim) >= newest_ms)
      continue;
    doomed.emplace_back(n, st);
  }
  ::closedir(d);
  int removed = 0;
  for (const auto& [n, was] : doomed) {
    struct stat st{};  // (still that file: not replaced or written since)
    if (::fstatat(fd_.get(), n.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0 || st.st_ino != was.st_ino ||
        ms_of(st.st_mtim) != ms_of(was.st_mtim))
      continue;
    removed += ::unlinkat(fd_.get(), n.c_str(), 0) == 0;
  }
  return removed;
}

JobRecordWriter::Ops JobRecordWriter::ops_of(std::shared_ptr<const JobRecordDir> dir) {
  Ops ops;
  ops.write = [dir](const JobRecord& r) { return dir->write(r); };
  ops.remove = [dir](const JobRecord& r) { dir->remove(r.job, r.node, r.endpoint, r.slot); };
  ops.release = [dir](const JobRecord& r) { dir->release(r.job, r.node, r.endpoint, r.slot); };
  ops.sweep = [dir] {
    dir->sweep(std::chrono::system_clock::now(), kJobRecordTmpMinAge,
               [](pid_t pid) { return ::kill(pid, 0) == 0 || errno != ESRCH; });
  };
  return ops;
}

// The writer's state, shared with its thread: a thread left detached by the destructor
// (a hung NFS server) keeps it alive.
struct JobRecordWriter::State {
  explicit State(Ops o) : ops(std::move(o)) {}
  Ops ops;
  std::mutex mu;
  std::condition_variable cv;
  std::optional<JobRecord> pending_write;
  std::optional<JobRecord> last;  // the key of remove()
  bool pending_remove = false, pending_sweep = false, busy = false, stop = false;
  bool ended = false;     // remove() was asked: the job ended, nothing is written after it
  bool on_disk = false;   // the newest write asked landed (on_disk())
  bool finished = false;  // the thread returned
  std::string error;
  std::function<void()> on_failure;  // (cleared by the destructor)
  Fd lock;                           // the slot's (hold()): closed with the last owner, the thread or the writer
  bool idle() const { return !busy && !pending_write && !pending_remove && !pending_sweep; }
};

JobRecordWriter::JobRecordWriter(Ops ops, std::chrono::milliseconds wait)
    : st_(std::make_shared<State>(std::move(ops))), wait_(wait) {
  thread_ = signal_free_thread([st = st_] { loop(st); });
}

JobRecordWriter::~JobRecordWriter() {
  std::unique_lock lock(st_->mu);
  st_->on_failure = nullptr;  // (its caller may be gone before a detached thread's next failure)
  st_->stop = true;
  st_->cv.notify_all();
  if (st_->cv.wait_for(lock, wait_, [this] { return st_->finished; })) {
    lock.unlock();
    thread_.join();
    return;
  }
  const bool busy = st_->busy;
  lock.unlock();
  thread_.detach();  // (it holds the state; the process's exit ends it)
  std::fprintf(stderr, "[mglaunch] warning: this node's job record is still being %s after %.1f s (a hung file "
               "system?): going on without waiting for it\n",
               busy ? "written" : "queued", static_cast<double>(wait_.count()) / 1000.0);
}

void JobRecordWriter::write(JobRecord r) {
  {
    std::lock_guard lock(st_->mu);
    if (st_->ended) return;  // the job ended: a late write must not bring its record back
    st_->last = r;
    st_->on_disk = false;
    st_->pending_write = std::move(r);  // the one that waited, if any, is outdated
    st_->pending_remove = false;
  }
  st_->cv.notify_all();
}

void JobRecordWriter::remove() {
  {
    std::lock_guard lock(st_->mu);
    st_->ended = true;
    if (!st_->last) return;
    st_->pending_write.reset();
    st_->pending_remove = true;
  }
  st_->cv.notify_all();
}

void JobRecordWriter::discard(JobRecord key) {
  {
    std::lock_guard lock(st_->mu);
    if (st_->ended || st_->last) return;  // (a write since replaced the file)
    st_->last = std::move(key);
    st_->pending_remove = true;
  }
  st_->cv.notify_all();
}

void JobRecordWriter::sweep() {
  {
    std::lock_guard lock(st_->mu);
    st_->pending_sweep = true;
  }
  st_->cv.notify_all();
}

void JobRecordWriter::drain() {
  std::unique_lock lock(st_->mu);
  st_->cv.wait(lock, [this] { return st_->idle(); });
}

bool JobRecordWriter::drain_for(std::chrono::milliseconds wait) {
  std::unique_lock lock(st_->mu);
  return st_->cv.wait_for(lock, wait, [this] { return st_->idle(); });
}

bool JobRecordWriter::on_disk() const {
  std::lock_guard lock(st_->mu);
  return st_->on_disk;
}

void JobRecordWriter::on_failure(std::function<void()> f) {
  std::lock_guard lock(st_->mu);
  st_->on_failure = std::move(f);
}

void JobRecordWriter::hold(Fd lock) {
  std::lock_guard l(st_->mu);
  st_->lock = std::move(lock);
}

std::string JobRecordWriter::take_error() {
  std::lock_guard lock(st_->mu);
  return std::exchange(st_->error, {});
}

void JobRecordWriter::loop(const std::shared_ptr<State>& st) {
  std::unique_lock lock(st->mu);
  for (;;) {
    st->cv.wait(lock, [&] { return st->stop || !st->idle(); });
    if (st->idle()) break;  // stopped, all done
    // One operation at a time, in the order they matter: the start's sweep, then the record.
    std::function<std::string()> op;
    bool is_write = false;
    if (std::exchange(st->pending_sweep, false)) {
      op = [&ops = st->ops] { return ops.sweep(), std::string(); };
    } else if (st->pending_remove) {
      st->pending_remove = false;
      op = [&ops = st->ops, r = *st->last, ended = st->ended] {
        ops.remove(r);
        if (ended && ops.release) ops.release(r);
        return std::string();
      };
    } else {
      op = [&ops = st->ops, r = std::move(*st->pending_write)] { return ops.write(r); };
      st->pending_write.reset();
      is_write = true;
    }
    st->busy = true;
    lock.unlock();
    std::string why;
    try {  // (nothing escapes the thread: review s39 L3)
      why = op();
    } catch (const std::exception& e) {
      why = fmt::format("the record's helper thread: {}", printable_line(e.what()));
    } catch (...) {
      why = "the record's helper thread: an unknown exception";
    }
    lock.lock();
    if (is_write) st->on_disk = why.empty() && !st->pending_write;  // (a newer one asked meanwhile: not yet)
    if (!why.empty()) {
      if (st->error.empty()) st->error = std::move(why);
      if (st->on_failure) st->on_failure();
    }
    st->busy = false;
    st->cv.notify_all();
  }
  st->finished = true;
  st->cv.notify_all();
}

}  // namespace mg
