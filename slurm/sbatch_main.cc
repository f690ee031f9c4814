// mglaunch-sbatch: thin main. Parses flags, finds mglaunch, prints the batch script
// (--dry-run) or pipes it into sbatch, whose output and exit code pass through unchanged.
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <map>

#include <fmt/format.h>

#include "cli/args.h"
#include "slurm/sbatch.h"
#include "slurm/sbatch_check.h"

extern char** environ;

namespace {

constexpr int kUsage = 2, kNotFound = 127, kInternal = 1;

bool executable(const std::string& p) { return !p.empty() && ::access(p.c_str(), X_OK) == 0; }

// mglaunch next to this binary, else on PATH; absolute either way.
std::string find_mglaunch() {
  std::error_code ec;
  auto self = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    auto candidate = (self.parent_path() / "mglaunch").string();
    if (executable(candidate)) return candidate;
  }
  const char* path = std::getenv("PATH");
  std::string_view rest = path ? path : "";
  while (!rest.empty()) {
    auto colon = rest.find(':');
    std::string dir(rest.substr(0, colon));
    rest = colon == std::string_view::npos ? std::string_view{} : rest.substr(colon + 1);
    if (dir.empty() || dir.front() != '/') continue;
    if (auto candidate = dir + "/mglaunch"; executable(candidate)) return candidate;
  }
  return {};
}

bool write_all(int fd, std::string_view data) {
  while (!data.empty()) {
    ssize_t n = ::write(fd, data.data(), data.size());
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    data.remove_prefix(static_cast<std::size_t>(n));
  }
  return true;
}

// Runs `sbatch [--wait]` with the script on its stdin; returns its shell-style exit code.
int submit(const std::string& script, bool wait) {
  int in[2];
  if (::pipe(in) != 0) throw std::runtime_error(fmt::format("pipe: {}", std::strerror(errno)));
  int err[2];  // exec failure reported through a close-on-exec pipe
  if (::pipe2(err, O_CLOEXEC) != 0) throw std::runtime_error(fmt::format("pipe: {}", std::strerror(errno)));
  pid_t pid = ::fork();
  if (pid < 0) throw std::runtime_error(fmt::format("fork: {}", std::strerror(errno)));
  if (pid == 0) {
    ::dup2(in[0], STDIN_FILENO);
    ::close(in[0]);
    ::close(in[1]);
    ::close(err[0]);
    std::vector<const char*> argv{"sbatch"};
    if (wait) argv.push_back("--wait");
    argv.push_back(nullptr);
    ::execvp("sbatch", const_cast<char* const*>(argv.data()));
    int e = errno;
    ssize_t ignored = ::write(err[1], &e, sizeof(e));
    (void)ignored;
    ::_exit(kNotFound);
  }
  ::close(in[0]);
  ::close(err[1]);
  int exec_errno = 0;
  ssize_t got;
  do got = ::read(err[0], &exec_errno, sizeof(exec_errno));
  while (got < 0 && errno == EINTR);
  ::close(err[0]);
  if (got == sizeof(exec_errno)) {
    ::close(in[1]);
    ::waitpid(pid, nullptr, 0);
    std::cerr << "mglaunch-sbatch: error: cannot run sbatch: " << std::strerror(exec_errno)
              << "; install Slurm's client commands or put sbatch on PATH\n";
    return kNotFound;
  }
  write_all(in[1], script);  // a failed write shows up as sbatch's own error
  ::close(in[1]);
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return kInternal;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace mg::slurm;
  ::signal(SIGPIPE, SIG_IGN);
  try {
    SbatchParse parsed = parse_sbatch_args(std::vector<std::string>(argv, argv + argc));
    if (!parsed.options) {
      std::cout << parsed.message;
      return 0;
    }
    SbatchOptions& o = *parsed.options;
    if (o.mglaunch.empty()) o.mglaunch = find_mglaunch();
    if (o.mglaunch.empty()) {
      std::cerr << "mglaunch-sbatch: error: mglaunch is neither next to mglaunch-sbatch nor on PATH; "
                   "give --mglaunch /abs/path/to/mglaunch\n";
      return kNotFound;
    }
    // A typo in the mglaunch flags is refused here, not on the nodes after waiting in the queue.
    std::map<std::string, std::string> env;
    for (char** e = environ; *e; ++e) {
      std::string_view kv = *e;
      if (auto eq = kv.find('='); eq != std::string_view::npos) env.emplace(kv.substr(0, eq), kv.substr(eq + 1));
    }
    std::string warning;
    if (auto why = mglaunch_usage_error(o, env, &warning)) {
      std::cerr << "mglaunch-sbatch: error: the mglaunch flags after '--': " << mg::cli::one_line(*why)
                << "; nothing was submitted\n";
      return kUsage;
    }
    if (!warning.empty())
      std::cerr << "mglaunch-sbatch: warning: the mglaunch flags after '--': " << mg::cli::one_line(warning) << "\n";
    const std::string script = make_batch_script(o);
    if (o.dry_run) {
      std::cout << script;
      return 0;
    }
    return submit(script, o.wait);
  } catch (const SbatchUsageError& e) {
    std::cerr << "mglaunch-sbatch: error: " << mg::cli::one_line(e.what()) << "\n";
    return kUsage;
  } catch (const std::exception& e) {
    std::cerr << "mglaunch-sbatch: error: internal error: " << mg::cli::one_line(e.what()) << "\n";
    return kInternal;
  } catch (...) {
    std::cerr << "mglaunch-sbatch: error: internal error: an unknown exception\n";
    return kInternal;
  }
}
