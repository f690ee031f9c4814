#include "launcher/job_record.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "process/fd.h"

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

}  // namespace

std::string node_identity(const std::string& advertised, const std::string& hostname) {
  return advertised + "@" + hostname;
}

std::string job_endpoint(const std::string& backend, const std::string& endpoint) {
  return backend + " " + endpoint;
}

std::string job_record_dir(const std::string& record_dir_env, const std::string& xdg_runtime_dir, uid_t uid) {
  if (!record_dir_env.empty()) return record_dir_env;
  if (!xdg_runtime_dir.empty()) return xdg_runtime_dir + "/mglaunch";
  return fmt::format("/tmp/mglaunch-{}", uid);
}

std::string job_record_path(const std::string& dir, const std::string& job, const std::string& node,
                            const std::string& endpoint) {
  std::uint64_t h = 14695981039346656037ull;  // FNV-1a, 64 bits
  auto mix = [&h](const std::string& s) {
    for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
    h = (h ^ 0xffu) * 1099511628211ull;  // (a separator no UTF-8 text holds)
  };
  mix(job);
  mix(node);
  mix(endpoint);
  return fmt::format("{}/job-{:016x}.json", dir, h);
}

std::string prepare_job_record_dir(const std::string& dir) {
  struct stat st{};
  if (::lstat(dir.c_str(), &st) != 0) {
    if (errno != ENOENT) return fmt::format("cannot use the record directory {}: {}", dir, errno_text());
    if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST)
      return fmt::format("cannot make the record directory {}: {}", dir, errno_text());
    if (::lstat(dir.c_str(), &st) != 0) return fmt::format("cannot use the record directory {}: {}", dir, errno_text());
  }
  if (!S_ISDIR(st.st_mode)) return fmt::format("the record directory {} is not a directory (a link?)", dir);
  if (auto why = not_ours(st, "the record directory " + dir, 022); !why.empty()) return why;
  return {};
}

std::string write_job_record(const std::string& dir, const JobRecord& r) {
  nlohmann::json hosts = nlohmann::json::array();
  for (const auto& [h, p] : r.hosts) hosts.push_back({h, p});
  const std::string text =
      nlohmann::json{{"job", r.job},     {"node", r.node},   {"endpoint", r.endpoint},
                     {"run", r.run},     {"epoch", r.epoch}, {"hosts", hosts}}
          .dump() +
      "\n";
  const std::string path = job_record_path(dir, r.job, r.node, r.endpoint);
  const std::string tmp = fmt::format("{}.{}.tmp", path, ::getpid());
  Fd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0600));
  if (fd.get() < 0) return fmt::format("cannot write {}: {}", tmp, errno_text());
  if (!write_fully(fd.get(), text) || ::fsync(fd.get()) != 0) {
    const std::string why = fmt::format("cannot write {}: {}", tmp, errno_text());
    ::unlink(tmp.c_str());
    return why;
  }
  fd.reset();
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const std::string why = fmt::format("cannot rename {} to {}: {}", tmp, path, errno_text());
    ::unlink(tmp.c_str());
    return why;
  }
  return {};
}

std::optional<JobRecord> read_job_record(const std::string& dir, const std::string& job, const std::string& node,
                                         const std::string& endpoint, std::string* why) {
  const std::string path = job_record_path(dir, job, node, endpoint);
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK));
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
      for (const auto& h : j.at("hosts")) r.hosts.emplace_back(h.at(0).get<std::string>(), h.at(1).get<int>());
    } catch (const nlohmann::json::exception& e) {
      bad = fmt::format("not a record ({})", e.what());
    }
  }
  if (!bad.empty()) {
    if (why) *why = fmt::format("ignoring {}: {}", path, bad);
    return std::nullopt;
  }
  // Another job's, node's or endpoint's (the hash's collision).
  if (r.job != job || r.node != node || r.endpoint != endpoint) return std::nullopt;
  r.written_ms = static_cast<std::int64_t>(st.st_mtim.tv_sec) * 1000 + st.st_mtim.tv_nsec / 1000000;
  return r;
}

bool touch_job_record(const std::string& dir, const std::string& job, const std::string& node,
                      const std::string& endpoint) {
  return ::utimensat(AT_FDCWD, job_record_path(dir, job, node, endpoint).c_str(), nullptr, AT_SYMLINK_NOFOLLOW) == 0;
}

void remove_job_record(const std::string& dir, const std::string& job, const std::string& node,
                       const std::string& endpoint) {
  ::unlink(job_record_path(dir, job, node, endpoint).c_str());
}

}  // namespace mg
