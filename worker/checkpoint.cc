#include "worker/checkpoint.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <random>
#include <sstream>
#include <thread>
#include <utility>

#include <fmt/format.h>

namespace mg::train {
namespace {

void fsync_or_throw(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw std::runtime_error(fmt::format("checkpoint: cannot open {} to fsync it: {}", path, std::strerror(errno)));
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0) throw std::runtime_error(fmt::format("checkpoint: fsync of {} failed: {}", path, std::strerror(err)));
}

std::int64_t read_int(torch::serialize::InputArchive& ar, const char* key) {
  torch::Tensor t;  // a fresh tensor per key: read() cannot re-seat one that holds storage
  ar.read(key, t);
  return t.item<std::int64_t>();
}

// `touched` (when given) is set once the archive parsed and the model starts to take it: a
// failure before leaves the model and optimizer as they were.
Position load_from_bytes(const std::string& bytes, const torch::Device& device, torch::nn::Module& model,
                         torch::optim::Optimizer& opt, bool* touched = nullptr) {
  std::istringstream in(bytes);
  torch::serialize::InputArchive ar;
  ar.load_from(in, device);
  if (touched != nullptr) *touched = true;
  model.load(ar);
  torch::serialize::InputArchive opt_ar;
  ar.read("optimizer", opt_ar);
  opt.load(opt_ar);
  Position p;
  p.step = read_int(ar, "step");
  p.epoch = read_int(ar, "epoch");
  p.batch_in_epoch = read_int(ar, "batch_in_epoch");
  for (auto [key, field] : {std::pair{"epoch_offset", &p.epoch_offset}, std::pair{"world", &p.world}}) {
    torch::Tensor t;  // absent from the checkpoints of older mgtrains: 0
    if (ar.try_read(key, t)) *field = t.item<std::int64_t>();
  }
  torch::Tensor rng;
  ar.read("rng", rng);
  at::Generator gen = at::detail::getDefaultCPUGenerator();
  gen.set_state(rng.to(torch::kCPU));  // the archive was mapped to `device`; the generator's state is a CPU tensor
  return p;
}

void write_state(torch::serialize::OutputArchive& ar, torch::nn::Module& model, torch::optim::Optimizer& opt,
                 const Position& pos) {
  model.save(ar);  // parameters and buffers
  torch::serialize::OutputArchive opt_ar;
  opt.save(opt_ar);
  ar.write("optimizer", opt_ar);
  ar.write("step", torch::tensor(pos.step));
  ar.write("epoch", torch::tensor(pos.epoch));
  ar.write("batch_in_epoch", torch::tensor(pos.batch_in_epoch));
  ar.write("epoch_offset", torch::tensor(pos.epoch_offset));
  ar.write("world", torch::tensor(pos.world));
  at::Generator gen = at::detail::getDefaultCPUGenerator();
  ar.write("rng", gen.get_state());
}

// D/checkpoint.key (docs/mgtrain.md, Checkpoints): the key of D/checkpoint.pt (its step,
// epoch and run, as the archive records them) and the identity of the file it describes
// (inode, size, mtime in ns, as stat() gives them), one line written beside it after its
// rename. A reader trusts the line only while stat() of the checkpoint gives that identity,
// so that comparing the ranks' checkpoints reads ~100 bytes per rank, not every archive.
struct FileId {
  std::uint64_t ino = 0;
  std::int64_t size = 0, mtime_ns = 0;
  bool operator==(const FileId&) const = default;
};

FileId file_id(const struct ::stat& st) {
  return {static_cast<std::uint64_t>(st.st_ino), static_cast<std::int64_t>(st.st_size),
          static_cast<std::int64_t>(st.st_mtim.tv_sec) * 1'000'000'000 + st.st_mtim.tv_nsec};
}

std::string key_line(const CheckpointKey& key, const FileId& id) {
  return fmt::format("step={} epoch={} run={} size={} mtime_ns={} ino={}{}\n", key.step, key.epoch, key.run, id.size,
                     id.mtime_ns, id.ino, key.supersedes.empty() ? "" : " supersedes=" + key.supersedes);
}

// The key and identity in a checkpoint.key line; nullopt when `text` is not one (torn,
// another format, a field missing or bad).
std::optional<std::pair<CheckpointKey, FileId>> parse_key_line(const std::string& text) {
  if (text.empty() || text.back() != '\n' || std::count(text.begin(), text.end(), '\n') != 1) return std::nullopt;
  std::map<std::string, std::string> f;
  std::istringstream in(text);
  for (std::string tok; in >> tok;) {
    const auto eq = tok.find('=');
    if (eq == std::string::npos || !f.emplace(tok.substr(0, eq), tok.substr(eq + 1)).second) return std::nullopt;
  }
  const auto num = [&](const char* name, auto& out) {
    const auto it = f.find(name);
    if (it == f.end()) return false;
    const auto [end, ec] = std::from_chars(it->second.data(), it->second.data() + it->second.size(), out);
    return ec == std::errc{} && end == it->second.data() + it->second.size();
  };
  std::pair<CheckpointKey, FileId> k;
  // "run=" where none is recorded; "supersedes=T" only where the run took run T over
  if (f.size() != 6u + f.contains("supersedes") || !f.contains("run")) return std::nullopt;
  k.first.run = f["run"];
  k.first.supersedes = f.contains("supersedes") ? f["supersedes"] : std::string();
  if (f.contains("supersedes") && !run_problem(k.first.supersedes).empty()) return std::nullopt;
  if (!num("step", k.first.step) || !num("epoch", k.first.epoch) || !num("size", k.second.size) ||
      !num("mtime_ns", k.second.mtime_ns) || !num("ino", k.second.ino) ||
      (!k.first.run.empty() && !run_problem(k.first.run).empty()))
    return std::nullopt;
  return k;
}

// The text of a small file, nullopt when it cannot be read (absent); at most 512 bytes.
std::optional<std::string> read_small(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return std::nullopt;
  char buf[512];
  const ssize_t n = ::read(fd, buf, sizeof buf);
  ::close(fd);
  if (n < 0) return std::nullopt;
  return std::string(buf, static_cast<std::size_t>(n));
}

// Writes `line` to `path` whole: a temporary file of this process beside it, fsync, rename
// (the directory's fsync is the caller's). Throws std::runtime_error naming the path.
void replace_file(const std::string& path, const std::string& line) {
  const std::string tmp = fmt::format("{}.tmp.{}", path, ::getpid());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw std::runtime_error(fmt::format("checkpoint: cannot create {}: {}", tmp, std::strerror(errno)));
  const bool ok = ::write(fd, line.data(), line.size()) == static_cast<ssize_t>(line.size()) && ::fsync(fd) == 0;
  const int err = errno;
  ::close(fd);
  if (!ok) throw std::runtime_error(fmt::format("checkpoint: cannot write {}: {}", tmp, std::strerror(err)));
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    throw std::runtime_error(fmt::format("checkpoint: cannot rename {} to {}: {}", tmp, path, std::strerror(err)));
  }
}

// Whether a rank holds a checkpoint (the first long of its census row, newest_checkpoint):
// kUnreadable is an I/O error (EIO, ESTALE, EACCES: perhaps transient, the file perhaps the
// newest), kCorrupt a file read whole that does not parse (review s39 M2).
enum Census : std::int64_t { kAbsent = 0, kPresent = 1, kUnreadable = 2, kCorrupt = 3 };

// Reads the whole file at `path` into `bytes` (when given; else reads it through in chunks);
// false with `error` set ("cannot read PATH: errno's text") on an I/O error.
bool read_whole(const std::string& path, std::string* bytes, std::string& error) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    error = fmt::format("cannot read {}: {}", path, std::strerror(errno));
    return false;
  }
  std::string chunk(1 << 20, '\0');
  for (;;) {
    const ssize_t n = ::read(fd, chunk.data(), chunk.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) error = fmt::format("cannot read {}: {}", path, std::strerror(errno));
    if (n <= 0) break;
    if (bytes != nullptr) bytes->append(chunk.data(), static_cast<std::size_t>(n));
  }
  ::close(fd);
  return error.empty();
}

// The key of the checkpoint in `dir`: from its checkpoint.key when that describes the file
// stat() finds, else (none: an mgtrain before it, or a crash between the two renames; or one
// that describes another file) from the archive itself, every tensor loaded. kUnreadable
// with `error` set when it cannot be read.
Census read_key(const std::string& dir, CheckpointKey& key, std::string& error) {
  const std::string path = checkpoint_file(dir), sidecar = checkpoint_key_file(dir);
  struct ::stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    if (errno == ENOENT || errno == ENOTDIR) return kAbsent;
    error = fmt::format("cannot stat checkpoint {}: {}", path, std::strerror(errno));
    return kUnreadable;
  }
  if (const auto text = read_small(sidecar)) {
    if (const auto k = parse_key_line(*text); k && k->second == file_id(st)) {
      key = k->first;
      return kPresent;
    }
    std::fprintf(stderr, "mgtrain: %s does not describe %s (another writer replaced it, or a crash came between "
                 "their renames): reading its step, epoch and run from the checkpoint itself\n",
                 sidecar.c_str(), path.c_str());
  }
  try {
    torch::serialize::InputArchive ar;
    ar.load_from(path, torch::kCPU);
    key.step = read_int(ar, "step");
    torch::Tensor t;
    if (ar.try_read("mglaunch_epoch", t)) key.epoch = t.item<std::int64_t>();
    c10::IValue run;
    if (ar.try_read("mglaunch_run", run) && run.isString() && run_problem(run.toStringRef()).empty())
      key.run = run.toStringRef();
    if (ar.try_read("mglaunch_supersedes", run) && run.isString() && run_problem(run.toStringRef()).empty())
      key.supersedes = run.toStringRef();
    // Its key beside it for the next start, when the file read is still the one stat() gave
    // (review s38 M2: only rank 0 writes checkpoints, so another rank's node-local D was read
    // whole at every start). No lock is needed: a key that a writer's rename makes stale no
    // longer matches, and one that cannot be written (a read-only D) only costs the next
    // start this read again.
    struct ::stat after {};
    if (::stat(path.c_str(), &after) == 0 && file_id(after) == file_id(st)) {
      try {
        replace_file(sidecar, key_line(key, file_id(st)));
      } catch (const std::exception&) {
      }
    }
    return kPresent;
  } catch (const std::exception& e) {
    std::string what = e.what();
    // An archive that does not load: the read's error where reading it fails (I/O), else a
    // file that does not parse.
    if (!read_whole(path, nullptr, error)) return kUnreadable;
    error = fmt::format("cannot load checkpoint {}: {}", path, what.substr(0, what.find('\n')));
  }
  return kCorrupt;
}

// The epoch and run recorded for the checkpoint in `dir` (its key), nullopt when it has no
// epoch or cannot be read.
std::optional<Owner> recorded_owner(const std::string& dir) {
  CheckpointKey key;
  std::string error;
  if (read_key(dir, key, error) != kPresent || key.epoch < 0) return std::nullopt;
  return Owner{key.epoch, key.run, key.supersedes};
}

// flock() errors of a file system that has no locks: Lustre mounted without flock
// (ENOSYS), NFS mounted nolock (ENOLCK), others (EOPNOTSUPP, EINVAL).
bool no_locks_here(int err) { return err == ENOSYS || err == ENOLCK || err == EOPNOTSUPP || err == EINVAL; }

// An exclusive flock() of a checkpoint's lock file, held while this object lives. Other
// writers wait for it; the kernel lets go of it when its holder dies. Where the file system
// has no locks, the writer goes on unlocked (one warning line per process): the epoch record
// is then replaced by rename, so that a reader sees the old record or the new one, never a
// torn one, and only two writers in the same instant can both pass the check.
class EpochLock {
 public:
  EpochLock(const std::string& path, int timeout_s) : path_(path) {
    fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd_ < 0) throw std::runtime_error(fmt::format("checkpoint: cannot open {}: {}", path, std::strerror(errno)));
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(timeout_s);
    while (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
      const int err = errno;
      if (no_locks_here(err)) {
        unlocked_ = true;
        static bool warned = false;
        if (!std::exchange(warned, true))
          std::fprintf(stderr,
                       "mgtrain: warning: cannot lock %s (%s: the file system has no locks, as Lustre without flock "
                       "or NFS with nolock): checkpoints are fenced by its epoch record alone, replaced by rename\n",
                       path.c_str(), std::strerror(err));
        return;
      }
      if (err != EWOULDBLOCK && err != EINTR) fail("lock", err);
      if (std::chrono::steady_clock::now() >= until)
        fail(fmt::format("lock (another writer held it for {} s)", timeout_s), err);
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }
  ~EpochLock() { ::close(fd_); }  // closing the last descriptor releases the lock
  EpochLock(const EpochLock&) = delete;
  EpochLock& operator=(const EpochLock&) = delete;
  bool unlocked() const { return unlocked_; }

  // The epoch (and run, and the run that run took over) the file holds, "EPOCH[ RUN[ ~T]]\n";
  // nullopt when it holds none (new, empty, or not that).
  std::optional<Owner> owner() const {
    char buf[128] = {};
    const ssize_t n = ::pread(fd_, buf, sizeof buf - 1, 0);
    if (n <= 0) return std::nullopt;
    char* end = nullptr;
    errno = 0;
    const long long v = std::strtoll(buf, &end, 10);
    if (end == buf || errno != 0 || v < 0) return std::nullopt;
    Owner o{v, {}, {}};
    if (*end == ' ') {
      const char* run = end + 1;
      const char* eol = std::strchr(run, '\n');
      if (!eol) return std::nullopt;
      o.run.assign(run, eol);
      if (const auto tilde = o.run.find(" ~"); tilde != std::string::npos) {
        o.superseded = o.run.substr(tilde + 2);
        o.run.resize(tilde);
        if (!run_problem(o.superseded).empty()) return std::nullopt;
      }
      if (!run_problem(o.run).empty()) return std::nullopt;
      return o;
    }
    if (*end != '\n' && *end != '\0') return std::nullopt;
    return o;
  }
  // Records `epoch` of `run` (which took run `superseded` over; empty: none) as the newest,
  // on disk before the checkpoint is written.
  void record(std::int64_t epoch, const std::string& run, const std::string& superseded) {
    const std::string line =
        std::to_string(epoch) + (run.empty() ? "" : " " + run) + (superseded.empty() ? "" : " ~" + superseded) + "\n";
    // Unlocked: written whole beside it, then renamed over it (the directory's fsync comes
    // with the checkpoint's rename).
    if (unlocked_) return replace_file(path_, line);
    if (::ftruncate(fd_, 0) != 0) fail("truncate", errno);
    if (::pwrite(fd_, line.data(), line.size(), 0) != static_cast<ssize_t>(line.size())) fail("write", errno);
    if (::fsync(fd_) != 0) fail("fsync", errno);
  }

 private:
  [[noreturn]] void fail(const std::string& what, int err) const {
    throw std::runtime_error(fmt::format("checkpoint: cannot {} {}: {}", what, path_, std::strerror(err)));
  }
  std::string path_;
  int fd_ = -1;
  bool unlocked_ = false;  // the file system has no locks
};

// A temporary checkpoint file unchanged for this long is a killed writer's leftover: a
// live writer's grows, or is renamed, well within it (review s39 L2).
constexpr auto kLeftoverAge = std::chrono::minutes(10);

// Removes the temporary checkpoint files (checkpoint.pt.tmp, checkpoint.pt.tmp.*) in `dir`
// not modified for kLeftoverAge: under the lock, those of writers killed while writing. Not
// younger ones: a flock that locks only this node (Lustre localflock, NFS nolock) lets
// another node's writer be mid-write (review s39 L2). Errors are ignored (the next writer
// tries again).
void remove_leftovers(const std::string& dir) {
  std::error_code ec;
  const auto now = std::filesystem::file_time_type::clock::now();
  for (std::filesystem::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    std::error_code ignored;
    if (!(name == "checkpoint.pt.tmp" || name.starts_with("checkpoint.pt.tmp.")) || !it->is_regular_file(ignored))
      continue;
    const auto mtime = std::filesystem::last_write_time(it->path(), ignored);
    if (!ignored && now - mtime >= kLeftoverAge) std::filesystem::remove(it->path(), ignored);
  }
}

}  // namespace

bool refuses(const Owner& owner, const Fence& fence) {
  if (!fence.epoch) return false;
  // The holder took this run over (--checkpoint-take-over): this run trains no more here.
  if (!fence.run.empty() && owner.superseded == fence.run) return true;
  if (!fence.run.empty() && owner.run != fence.run) {
    // Another run of the job wrote there: an older one (or one without a run, an mglaunch
    // before #37) left the checkpoint this run starts from; a newer one holds it for good.
    // --checkpoint-take-over names a run that counts as older than this one.
    return !owner.run.empty() && owner.run != fence.take_over && run_before(fence.run, owner.run);
  }
  return owner.epoch > *fence.epoch;  // one run (or no runs): the newest epoch writes
}

std::string state_bytes(torch::nn::Module& model, torch::optim::Optimizer& opt, const Position& pos) {
  torch::serialize::OutputArchive ar;
  write_state(ar, model, opt, pos);
  std::ostringstream out;
  ar.save_to(out);
  return out.str();
}

Position load_state(const std::string& bytes, const torch::Device& device, torch::nn::Module& model,
                    torch::optim::Optimizer& opt) {
  return load_from_bytes(bytes, device, model, opt);
}

std::string broadcast_bytes(const Comm& comm, int root, std::string bytes) {
  if (!comm.distributed()) return bytes;
  const auto cpu_long = torch::TensorOptions().dtype(torch::kLong);
  c10d::BroadcastOptions from;
  from.rootRank = root;
  auto head = torch::tensor({static_cast<std::int64_t>(bytes.size())}, cpu_long).to(comm.device);
  std::vector<torch::Tensor> h{head};
  wait_work(comm.pg->broadcast(h, from));
  const std::int64_t n = head.to(torch::kCPU).item<std::int64_t>();
  auto buf = comm.rank == root ? torch::from_blob(bytes.data(), {n}, torch::kByte).clone() : torch::empty({n}, torch::kByte);
  buf = buf.to(comm.device);
  std::vector<torch::Tensor> b{buf};
  wait_work(comm.pg->broadcast(b, from));
  if (comm.rank != root) {
    buf = buf.to(torch::kCPU);
    bytes.assign(static_cast<const char*>(buf.data_ptr()), static_cast<std::size_t>(n));
  }
  return bytes;
}

std::string with_rank(std::string path, int rank) {
  if (auto p = path.find("{rank}"); p != std::string::npos) path.replace(p, 6, std::to_string(rank));
  return path;
}

std::string checkpoint_file(const std::string& dir) { return dir + "/checkpoint.pt"; }
std::string checkpoint_lock_file(const std::string& dir) { return dir + "/checkpoint.lock"; }
std::string checkpoint_key_file(const std::string& dir) { return dir + "/checkpoint.key"; }

Saved save_checkpoint(const std::string& dir, torch::nn::Module& model, torch::optim::Optimizer& opt, const Position& pos,
                      const Fence& fence) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) throw std::runtime_error(fmt::format("checkpoint: cannot create directory {}: {}", dir, ec.message()));
  torch::serialize::OutputArchive ar;
  write_state(ar, model, opt, pos);
  if (fence.epoch) ar.write("mglaunch_epoch", torch::tensor(*fence.epoch));
  const bool run_recorded = fence.epoch && !fence.run.empty();
  const std::string supersedes = run_recorded ? fence.take_over : std::string();
  if (run_recorded) ar.write("mglaunch_run", c10::IValue(fence.run));
  if (!supersedes.empty()) ar.write("mglaunch_supersedes", c10::IValue(supersedes));
  const std::string path = checkpoint_file(dir);
  // Check and write as one step: every fenced writer holds the lock from its comparison
  // to its rename, so an older epoch never writes after (or while) a newer one does.
  std::optional<EpochLock> lock;
  Saved result;
  if (fence.epoch) {
    lock.emplace(checkpoint_lock_file(dir), fence.lock_timeout_s);
    auto owner = lock->owner();
    if (!owner) owner = recorded_owner(dir);  // a lock file lost, or the first fenced write
    if (!fence.run.empty() && !fence.taken_by.empty())  // the census: a run took this one over
      return Saved{false, owner ? owner->epoch : -1, fence.taken_by, {}, true};
    if (owner && refuses(*owner, fence))
      return Saved{false, owner->epoch, owner->run, {}, !fence.run.empty() && owner->superseded == fence.run};
    lock->record(*fence.epoch, fence.run, supersedes);
    if (owner && !fence.run.empty() && owner->run == fence.take_over && run_before(fence.run, owner->run))
      result.taken_over = owner->run;
  }
  // Each writer its own temporary file (pid and a random number: two hosts on one D may share
  // a pid), so that two writers never write into one inode, whether unlocked (unfenced, a file
  // system without locks) or once a lock was lost (review s38 L2). Under the lock no other
  // fenced writer is between its lock and its rename: a temporary file there is one left by a
  // writer killed while writing (a multi-GiB archive), removed first.
  if (lock && !lock->unlocked()) remove_leftovers(dir);
  std::random_device rd;
  const std::string tmp = fmt::format("{}.tmp.{}.{:08x}{:08x}", path, ::getpid(), rd(), rd());
  struct ::stat st {};
  // A failed write removes its own temporary file (review s39 L2: ENOSPC left multi-GiB files).
  try {
    try {
      ar.save_to(tmp);
    } catch (const std::exception& e) {
      std::string what = e.what();
      throw std::runtime_error(fmt::format("checkpoint: cannot write {}: {}", tmp, what.substr(0, what.find('\n'))));
    }
    fsync_or_throw(tmp);
    if (::stat(tmp.c_str(), &st) != 0)
      throw std::runtime_error(fmt::format("checkpoint: cannot stat {}: {}", tmp, std::strerror(errno)));
    if (::rename(tmp.c_str(), path.c_str()) != 0)
      throw std::runtime_error(fmt::format("checkpoint: cannot rename {} to {}: {}", tmp, path, std::strerror(errno)));
  } catch (...) {
    ::unlink(tmp.c_str());
    throw;
  }
  // Its key beside it, for the next start's comparison (read_key): what the archive records.
  // The checkpoint is written: a key that cannot be is a warning (the next start reads the archive).
  try {
    replace_file(checkpoint_key_file(dir), key_line({run_recorded ? fence.run : std::string(), fence.epoch.value_or(-1),
                                                     pos.step, supersedes},
                                                    file_id(st)));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "mgtrain: warning: %s: the checkpoint %s is written; the next start reads its step from it\n",
                 e.what(), path.c_str());
  }
  fsync_or_throw(dir);
  return result;
}

namespace {

// A duration for a person: minutes up to two days, then days.
std::string duration(std::int64_t ms) {
  const std::int64_t min = ms / 60000;
  return min < 48 * 60 ? fmt::format("{} min", min) : fmt::format("{} days", min / (24 * 60));
}

}  // namespace

std::string refusal(const Saved& saved, const Fence& fence, std::int64_t step, const std::string& path,
                    std::int64_t now_ms) {
  if (fence.run.empty() || saved.owner_run == fence.run)
    return fmt::format("checkpoint refused at step {}: {} belongs to epoch {} of this job, newer than this round's "
                       "MGLAUNCH_EPOCH={}: this side of the job is stale (a newer round trains elsewhere), so every "
                       "rank stops without writing (exit {})",
                       step, path, saved.owner, fence.epoch.value_or(-1), kExitFenced);
  if (saved.superseded)
    return fmt::format("checkpoint refused at step {}: run {} took this run's checkpoints over (--checkpoint-take-over "
                       "{}), so this run (MGLAUNCH_RUN={}) trains no more and every rank stops without writing {} "
                       "(exit {})",
                       step, saved.owner_run, fence.run, fence.run, path, kExitFenced);
  const std::int64_t ahead = run_ahead_ms(saved.owner_run, now_ms);
  // The way on is offered only for a run dated past the skew bound in this host's future:
  // otherwise the holder is a genuinely newer run (this one a stale requeue) and the fence
  // is doing its job.
  const std::string suspect =
      ahead > kRunAheadSuspectMs
          ? fmt::format(", and run {} is dated {} after this host's clock: the clock that made it was probably ahead; "
                        "if run {} trains no more, rerun with --checkpoint-take-over {} to go on from its checkpoint "
                        "(it is then refused at its next checkpoint)",
                        saved.owner_run, duration(ahead), saved.owner_run, saved.owner_run)
          : std::string();
  return fmt::format(
      "checkpoint refused at step {}: {} belongs to run {} of this job, newer than this run's MGLAUNCH_RUN={}: this "
      "run is stale, so every rank stops without writing (exit {}). Runs are ordered by the clock of the host that "
      "made them{}",
      step, path, saved.owner_run, fence.run, kExitFenced, suspect);
}

namespace {

// A census row per rank: its Census, the checkpoint's epoch, step and run (its size, then its
// bytes packed into longs; run_problem() bounds a run to 64 characters), then the run it took
// over (size, bytes).
constexpr int kRunLongs = 8, kRow = 5 + 2 * kRunLongs;

void put_run(std::int64_t* at, const std::string& run) {
  at[0] = static_cast<std::int64_t>(run.size());
  std::memcpy(at + 1, run.data(), std::min<std::size_t>(run.size(), 8 * kRunLongs));
}

std::string get_run(const std::int64_t* at) {
  return std::string(reinterpret_cast<const char*>(at + 1),
                     static_cast<std::size_t>(std::clamp<std::int64_t>(at[0], 0, 8 * kRunLongs)));
}

// The shape of the census, live-state, resume and checkpoint collectives (kRow, the slots below). Raise it whenever
// they change: ranks of different builds then stop at check_census_version(), not in a
// collective of another size (gloo throws, NCCL hangs; review s38 M3). An mgtrain before this
// check has no such step, so one of those beside a newer one still mismatches there.
// 3: the live states' keys (gather_live_states); 4: every checkpoint's {refused, failed}
// all-reduce; 5: resume's head says whether the root's model took part of an unreadable archive;
// 6: the census row and resume's head tell an I/O error (exit 3) from an archive that does not parse.
constexpr std::int64_t kCensusVersion = 6;

}  // namespace

void check_census_version(const Comm& comm) {
  std::int64_t mine = kCensusVersion;
  if (const char* v = std::getenv("MGTRAIN_TEST_CENSUS_VERSION"); v != nullptr && *v != 0)
    std::from_chars(v, v + std::strlen(v), mine);
  auto t = torch::tensor({mine, -mine}, torch::kLong).to(comm.device);
  std::vector<torch::Tensor> v{t};
  c10d::AllreduceOptions max;
  max.reduceOp = c10d::ReduceOp::MAX;
  wait_work(comm.pg->allreduce(v, max));
  t = t.to(torch::kCPU);
  const std::int64_t high = t[0].item<std::int64_t>(), low = -t[1].item<std::int64_t>();
  if (high != low)
    throw SetupError(fmt::format("ranks run different mgtrain builds (census version {} and {}): use one "
                                 "mglaunch/mgtrain release on every node",
                                 low, high));
}

LiveStates gather_live_states(const Comm& comm, const CheckpointKey& mine, bool channel) {
  constexpr int kLive = 4 + kRunLongs;  // step, channel, epoch, run
  auto rows = torch::zeros({comm.world, kLive}, torch::kLong);
  rows[comm.rank][0] = mine.step;
  rows[comm.rank][1] = channel ? 1 : 0;
  rows[comm.rank][2] = mine.epoch;
  put_run(rows[comm.rank].data_ptr<std::int64_t>() + 3, mine.run);
  rows = rows.to(comm.device);
  comm.allreduce_sum(rows);
  rows = rows.to(torch::kCPU).contiguous();
  LiveStates live;
  const auto* r = rows.data_ptr<std::int64_t>();
  for (int k = 0; k < comm.world; ++k, r += kLive) {
    live.keys.push_back(CheckpointKey{get_run(r + 3), r[2], r[0], {}});
    live.channels += static_cast<int>(r[1]);
  }
  return live;
}

int LiveStates::newest(const Newest& order) const {
  int best = -1;
  for (int k = 0; k < static_cast<int>(keys.size()); ++k) {
    const auto& key = keys[static_cast<std::size_t>(k)];
    if (key.step > 0 && (best < 0 || older_checkpoint(keys[static_cast<std::size_t>(best)], key, order.taken, order.order)))
      best = k;
  }
  return best;
}

namespace {

// The way on from rank k's checkpoint at `path` that cannot be read (review s38 M4: the same
// words on every rank, naming the file, for node-local directories too).
std::string remove_or_restore(int k, const std::string& path) {
  return fmt::format("remove rank {}'s {} (the next newest is then used), or restore it", k, path);
}

// Rank k's line where in-place recovery goes on from the live states without its checkpoint,
// one that does not parse (review s39 M2: no other checkpoint is tried then).
void warn_going_on(int k, const std::string& error, const std::string& path) {
  std::fprintf(stderr, "mgtrain: warning: rank %d: %s: it does not parse: in-place recovery goes on from the ranks' "
               "live states, no checkpoint is resumed this round; restore rank %d's %s, or remove it\n",
               k, error.c_str(), k, path.c_str());
}

}  // namespace

Newest newest_checkpoint(const std::string& dirs, const Comm& comm, const Fence& fence, bool live) {
  Newest out;
  const int world = comm.distributed() ? comm.world : 1, me = comm.distributed() ? comm.rank : 0;
  const std::string dir = with_rank(dirs, me);
  // The order: this run's own take-over, then the ones the checkpoints record (below).
  if (!fence.run.empty() && !fence.take_over.empty()) out.taken[fence.take_over] = fence.run;
  out.order = checkpoint_order(!fence.run.empty(), fence.epoch.has_value());
  if (dir.empty()) return out;
  CheckpointKey mine;
  std::string error;
  const Census held = read_key(dir, mine, error);
  if (held == kPresent) out.own = mine;
  // Every rank's row, gathered by one sum all-reduce (each rank fills its own row).
  auto rows = torch::zeros({world, kRow}, torch::kLong);
  rows[me][0] = static_cast<std::int64_t>(held);
  rows[me][1] = mine.epoch;
  rows[me][2] = mine.step;
  put_run(rows[me].data_ptr<std::int64_t>() + 3, mine.run);
  put_run(rows[me].data_ptr<std::int64_t>() + 4 + kRunLongs, mine.supersedes);
  if (comm.distributed()) {
    rows = rows.to(comm.device);
    comm.allreduce_sum(rows);
    rows = rows.to(torch::kCPU).contiguous();
  }
  std::vector<CheckpointKey> keys(static_cast<std::size_t>(world));
  // The take-overs the checkpoints record (the newest taker of a run), and this run's own.
  Supersessions taken;
  const auto* r = rows.data_ptr<std::int64_t>();
  for (int k = 0; k < world; ++k, r += kRow) {
    const std::string path = checkpoint_file(with_rank(dirs, k));
    // It may be the newest: nothing is resumed, on every rank, unless in-place recovery goes
    // on from the ranks' live states (`live`), as it would with no checkpoint at all, from an
    // archive that does not parse; never past an I/O error (review s39 M2: a transient EIO
    // or ESTALE on a shared D would otherwise drop the newest and let it be written over).
    if (r[0] == kCorrupt && live && k == me) warn_going_on(k, error, path);
    if (r[0] == kUnreadable || (r[0] == kCorrupt && !live))
      throw SetupError(k == me ? fmt::format("{}; {}", error, remove_or_restore(k, path))
                               : fmt::format("rank {} cannot read its checkpoint {} (see rank {}'s error), which may be "
                                             "the newest; nothing was resumed: {}",
                                             k, path, k, remove_or_restore(k, path)));
    if (r[0] != kPresent) continue;
    auto& key = keys[static_cast<std::size_t>(k)];
    key = CheckpointKey{get_run(r + 3), r[1], r[2], get_run(r + 4 + kRunLongs)};
    if (key.supersedes.empty() || key.run.empty()) continue;
    auto [it, fresh] = taken.emplace(key.supersedes, key.run);
    if (!fresh && run_before(it->second, key.run)) it->second = key.run;
  }
  if (!fence.run.empty() && !fence.take_over.empty()) taken[fence.take_over] = fence.run;
  out.taken = taken;
  r = rows.data_ptr<std::int64_t>();
  for (int k = 0; k < world; ++k, r += kRow) {
    if (r[0] != kPresent) continue;
    const auto& key = keys[static_cast<std::size_t>(k)];
    if (out.rank < 0 || older_checkpoint(out.key, key, taken, out.order)) out.rank = k, out.key = key;
  }
  if (out.rank >= 0) out.path = checkpoint_file(with_rank(dirs, out.rank));
  if (const auto it = taken.find(fence.run); !fence.run.empty() && it != taken.end()) out.taken_by = it->second;
  return out;
}

std::optional<Position> resume(const Comm& comm, torch::nn::Module& model, torch::optim::Optimizer& opt,
                               const Newest& newest, bool* unreadable) {
  if (newest.rank < 0) return std::nullopt;
  const std::string& path = newest.path;
  const auto cpu_long = torch::TensorOptions().dtype(torch::kLong);
  const int root = newest.rank;
  // The root reads and parses the file; its bytes travel to every rank (ok flag first).
  std::string bytes, error;
  const bool reader = comm.distributed() ? comm.rank == root : true;
  bool io = false;  // an I/O error: never passed over (review s39 M2)
  if (reader) {
    io = !read_whole(path, &bytes, error);
    if (error.empty() && bytes.empty()) error = path + " is empty";
  }
  Position pos;
  bool touched = false;  // the root's model took part of it: no live state to go on from there
  if (reader && error.empty()) {
    try {
      pos = load_from_bytes(bytes, comm.device, model, opt, &touched);
    } catch (const std::exception& e) {
      std::string what = e.what();
      error = fmt::format("cannot load checkpoint {}: {}", path, what.substr(0, what.find('\n')));
    }
  }
  if (comm.distributed()) {
    c10d::BroadcastOptions from;
    from.rootRank = root;
    // 1: loaded; 0: does not parse, nothing taken; 2: failed once the root's model took part of
    // it; 3: cannot be read (I/O).
    auto head = torch::tensor({error.empty() ? 1L : io ? 3L : touched ? 2L : 0L, static_cast<std::int64_t>(bytes.size())}, cpu_long)
                    .to(comm.device);
    std::vector<torch::Tensor> v{head};
    wait_work(comm.pg->broadcast(v, from));
    head = head.to(torch::kCPU);
    if (const std::int64_t status = head[0].item<std::int64_t>(); status == 0 && unreadable != nullptr) {
      if (comm.rank == root) warn_going_on(root, error, path);  // every rank goes on from the live states
      *unreadable = true;
      return std::nullopt;
    } else if (status != 1) {
      throw SetupError(comm.rank == root ? fmt::format("{}; {}", error, remove_or_restore(root, path))
                                         : fmt::format("rank {} could not load its checkpoint {} (see rank {}'s error); "
                                                       "nothing was resumed: {}",
                                                       root, path, root, remove_or_restore(root, path)));
    }
    const std::int64_t n = head[1].item<std::int64_t>();
    auto buf = comm.rank == root ? torch::from_blob(bytes.data(), {n}, torch::kByte).clone() : torch::empty({n}, torch::kByte);
    buf = buf.to(comm.device);
    std::vector<torch::Tensor> b{buf};
    wait_work(comm.pg->broadcast(b, from));
    std::string failed;  // a rank that cannot load the bytes still enters the collective below
    if (comm.rank != root) {
      buf = buf.to(torch::kCPU);
      bytes.assign(static_cast<const char*>(buf.data_ptr()), static_cast<std::size_t>(n));
      try {
        pos = load_from_bytes(bytes, comm.device, model, opt);
      } catch (const std::exception& e) {
        std::string what = e.what();
        failed = fmt::format("cannot load rank {}'s checkpoint bytes: {}", root, what.substr(0, what.find('\n')));
      }
    }
    // Every rank checks that all loaded them (MAX of world - rank: the lowest that did not) and hold the same step.
    auto steps = torch::tensor({pos.step, -pos.step, failed.empty() ? 0L : comm.world - comm.rank}, cpu_long).to(comm.device);
    std::vector<torch::Tensor> s{steps};
    c10d::AllreduceOptions max;
    max.reduceOp = c10d::ReduceOp::MAX;
    wait_work(comm.pg->allreduce(s, max));
    steps = steps.to(torch::kCPU);
    if (const std::int64_t bad = steps[2].item<std::int64_t>(); bad > 0)
      throw SetupError(!failed.empty() ? failed
                                       : fmt::format("rank {} could not load rank {}'s checkpoint bytes (see its error); "
                                                     "nothing was resumed",
                                                     comm.world - bad, root));
    if (steps[0].item<std::int64_t>() != -steps[1].item<std::int64_t>())
      throw SetupError(fmt::format("ranks resumed at different steps ({}..{}); remove the checkpoints and start again",
                                   -steps[1].item<std::int64_t>(), steps[0].item<std::int64_t>()));
  } else if (!error.empty()) {
    throw SetupError(fmt::format("{}; {}", error, remove_or_restore(root, path)));
  }
  return pos;
}

// Rank 0's line of a resume: from its own checkpoint, or from another rank's (where rank 0
// has none, or an older one).
void say_resumed(const std::string& dirs, const Newest& newest, const Position& pos) {
  const long long step = pos.step, epoch = pos.epoch + 1;
  if (newest.rank == 0) {
    std::printf("resumed from %s at step %lld (epoch %lld)\n", checkpoint_file(with_rank(dirs, 0)).c_str(),
                step, epoch);
    return;
  }
  const std::string why =
      !newest.own ? std::string("rank 0 has none")
                  : fmt::format("rank 0's holds older training: step {}, epoch {} of run {}", newest.own->step,
                                newest.own->epoch, newest.own->run.empty() ? "(none)" : newest.own->run);
  std::printf("resumed from rank %d's checkpoint %s at step %lld (%s) (epoch %lld)\n", newest.rank,
              checkpoint_file(with_rank(dirs, newest.rank)).c_str(), step, why.c_str(), epoch);
}

}  // namespace mg::train
