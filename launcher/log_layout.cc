#include "launcher/log_layout.h"

#include <string.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <filesystem>

#include <fmt/format.h>

#include "launcher/errors.h"

namespace mg {

namespace fs = std::filesystem;

LogLayout::~LogLayout() { clean_up(); }

std::string LogLayout::create(const LogLayoutOptions& o) {
  std::error_code ec;
  if (!o.log_dir.empty()) {
    root_ = o.log_dir;
    run_dir_ = o.rdzv_id == "none" ? root_ : (fs::path(root_) / o.run_id).string();
    fs::create_directories(run_dir_, ec);
    if (ec || ::access(run_dir_.c_str(), W_OK) != 0)
      throw UsageError(fmt::format("--log_dir '{}' is not writable{}; pick a directory you can write to", o.log_dir,
                                   ec ? ": " + ec.message() : ""));
    if (o.rdzv_id != "none") return {};
    // The default run id: each run gets its own directory (as torchrun's RUN_ID_XXXXXX),
    // so a re-run never overwrites the last run's logs.
    std::string templ = fmt::format("{}/{}_{}_XXXXXX", root_, o.run_id, o.time_text);
    if (!::mkdtemp(templ.data()))
      throw UsageError(fmt::format("--log_dir '{}': cannot create {}: {}", o.log_dir, templ, std::strerror(errno)));
    run_dir_ = templ;
    return fmt::format("log directory: {}", run_dir_);
  }
  const char* env = std::getenv("TMPDIR");
  const std::string tmp = !o.tmpdir.empty() ? o.tmpdir : env && *env ? env : "/tmp";
  std::string templ;
  // TMPDIR unset and only error files to hold: in memory when that works, else in /tmp.
  if (o.tmpdir.empty() && !(env && *env) && !o.files_wanted && !o.shm_dir.empty()) {
    templ = fmt::format("{}/mglaunch_XXXXXX", o.shm_dir);
    if (!::mkdtemp(templ.data())) templ.clear();
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
    if (it->is_regular_file(fe)) {
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
