#include "logs/log_layout.h"

#include <signal.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <fmt/format.h>

#include "cli/errors.h"

namespace mg {

namespace fs = std::filesystem;

namespace {

constexpr const char* kOwnerFile = ".mglaunch-agent";  // "PID PIDNS\n": the agent that made the tree

std::string pid_namespace() {
  std::error_code ec;
  const auto target = fs::read_symlink("/proc/self/ns/pid", ec);
  return ec ? std::string() : target.string();  // "pid:[4026531836]"
}

}  // namespace

std::size_t sweep_dead_trees(const std::string& dir) {
  // Only what can be proved to be a dead agent's, of this user, with nothing in it: a tree
  // named mglaunch_*, a real directory owned by us, whose owner file names a pid of our own
  // pid namespace (another container's pids mean nothing here) that no longer exists, and
  // that holds directories only (a failed run's error files are kept, as finish() keeps them).
  const std::string ns = pid_namespace();
  if (ns.empty()) return 0;
  std::size_t removed = 0, seen = 0;
  std::error_code ec;
  for (auto it = fs::directory_iterator(dir, ec); !ec && it != fs::directory_iterator() && seen < 4096;
       it.increment(ec), ++seen) {
    const fs::path root = it->path();
    if (!root.filename().string().starts_with("mglaunch_")) continue;
    struct stat st{};
    if (::lstat(root.c_str(), &st) != 0 || !S_ISDIR(st.st_mode) || st.st_uid != ::geteuid()) continue;
    std::ifstream f(root / kOwnerFile);
    long long pid = 0;
    std::string their_ns;
    if (!(f >> pid >> their_ns) || pid <= 0 || their_ns != ns) continue;
    if (::kill(static_cast<pid_t>(pid), 0) == 0 || errno != ESRCH) continue;  // alive (or not ours to ask)
    bool only_dirs = true;
    std::error_code we;
    std::size_t entries = 0;
    for (auto w = fs::recursive_directory_iterator(root, fs::directory_options::none, we);
         !we && w != fs::recursive_directory_iterator() && only_dirs; w.increment(we)) {
      if (++entries > 100000) only_dirs = false;
      const auto type = w->symlink_status(we).type();
      if (type == fs::file_type::directory) continue;
      if (type == fs::file_type::regular && w->path().parent_path() == root && w->path().filename() == kOwnerFile)
        continue;
      only_dirs = false;
    }
    if (we || !only_dirs) continue;
    std::error_code re;
    fs::remove_all(root, re);
    if (!re) ++removed;
  }
  return removed;
}

LogLayout::~LogLayout() { clean_up(); }

std::string LogLayout::create(const LogLayoutOptions& o) {
  std::error_code ec;
  if (!o.log_dir.empty()) {
    root_ = o.log_dir;
    fs::create_directories(root_, ec);
    if (ec || ::access(root_.c_str(), W_OK) != 0)
      throw UsageError(fmt::format("--log_dir '{}' is not writable{}; pick a directory you can write to", o.log_dir,
                                   ec ? ": " + ec.message() : ""));
    // Each run gets its own directory (as torchrun's RUN_ID_XXXXXXXX), so a re-run with the
    // same id (a Slurm requeue keeps its id) never overwrites or mixes with the last run.
    std::string templ = fmt::format("{}/{}_{}_XXXXXX", root_, o.run_id, o.time_text);
    fs::create_directories(fs::path(templ).parent_path(), ec);  // an id with '/' in it
    if (!::mkdtemp(templ.data()))
      throw UsageError(fmt::format("--log_dir '{}': cannot create {}: {}", o.log_dir, templ, std::strerror(errno)));
    run_dir_ = templ;
    if (o.rdzv_id == "none") return fmt::format("log directory: {}", run_dir_);
    // A named run: {log_dir}/{run_id} is a link to the newest run of that id, replaced
    // atomically (rename), so it never dangles half-made.
    const fs::path link = fs::path(root_) / o.run_id;
    const std::string own = fs::path(run_dir_).filename().string();
    if (fs::exists(fs::symlink_status(link, ec)) && !fs::is_symlink(fs::symlink_status(link, ec)))
      return fmt::format("log directory: {} ({} is not a link: an older mglaunch's run, left as it is)", run_dir_,
                         link.string());
    const fs::path tmp = fs::path(run_dir_).parent_path() / ("." + own + ".link");
    fs::create_directory_symlink(own, tmp, ec);
    if (!ec) fs::rename(tmp, link, ec);
    if (ec) {
      std::error_code ignored;
      fs::remove(tmp, ignored);
      return fmt::format("log directory: {} (cannot point {} at it: {})", run_dir_, link.string(), ec.message());
    }
    return fmt::format("log directory: {} (newest run of {}: {})", run_dir_, o.run_id, link.string());
  }
  const char* env = std::getenv("TMPDIR");
  const std::string tmp = !o.tmpdir.empty() ? o.tmpdir : env && *env ? env : "/tmp";
  std::string templ;
  // TMPDIR unset and only error files to hold: in memory when that works, else in /tmp.
  if (o.tmpdir.empty() && !(env && *env) && !o.files_wanted && !o.shm_dir.empty()) {
    // Agents killed with their watchdog (a whole process group SIGKILLed, a Slurm step
    // cancelled) could not remove their trees: the next run removes the empty ones.
    sweep_dead_trees(o.shm_dir);
    templ = fmt::format("{}/mglaunch_XXXXXX", o.shm_dir);
    if (!::mkdtemp(templ.data())) {
      templ.clear();
    } else if (const std::string ns = pid_namespace(); !ns.empty()) {
      std::ofstream owner(fs::path(templ) / kOwnerFile);
      owner << ::getpid() << ' ' << ns << '\n';
    }
  }
  if (templ.empty()) {
    templ = fmt::format("{}/mglaunch_XXXXXX", tmp);
    if (!::mkdtemp(templ.data()))
      throw UsageError(fmt::format("cannot create a temporary log directory {}: {}", templ, std::strerror(errno)));
  }
  root_ = templ;
  run_dir_ = (fs::path(root_) / o.run_id).string();
  is_temp_ = true;
  keep_ = o.files_wanted;  // redirected output must not vanish
  return o.files_wanted ? fmt::format("log directory: {}", root_) : std::string();
}

std::string LogLayout::attempt_dir(int attempt, int local_rank) const {
  return (fs::path(run_dir_) / fmt::format("attempt_{}", attempt) / std::to_string(local_rank)).string();
}

std::string LogLayout::finish(int code) {
  if (code == exit_code::kOk || !is_temp_ || keep_) return {};
  // A failed run keeps what its workers wrote; only a successful run's temporary
  // directory goes. An empty tree goes either way.
  std::error_code fe;
  for (auto it = fs::recursive_directory_iterator(root_, fe); !fe && it != fs::recursive_directory_iterator();
       it.increment(fe))
    if (it->is_regular_file(fe) && it->path().filename() != kOwnerFile) {
      keep_ = true;
      return fmt::format("this run failed: its error files and logs are kept in {}", root_);
    }
  return {};
}

void LogLayout::clean_up() {
  if (!is_temp_ || keep_ || root_.empty()) return;
  std::error_code ec;
  fs::remove_all(root_, ec);
  root_.clear();
}

}  // namespace mg
