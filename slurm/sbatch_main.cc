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
#include "process/command.h"
#include "process/fd.h"
#include "process/spawn.h"
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

// Runs `sbatch [--wait]` (found on PATH) through the process layer's spawner with the
// script on its stdin and our stdout/stderr as its own; returns its shell-style exit code.
int submit(const std::string& script, bool wait) {
  auto cannot_run = [](const std::string& why) {
    std::cerr << "mglaunch-sbatch: error: cannot run sbatch: " << why
              << "; install Slurm's client commands or put sbatch on PATH\n";
    return kNotFound;
  };
  const char* path = std::getenv("PATH");
  const std::string exe = mg::find_executable("sbatch", path ? path : "/usr/bin:/bin");
  if (exe.empty()) return cannot_run("not found on PATH");
  int in[2];
  if (::pipe2(in, O_CLOEXEC) != 0) throw std::runtime_error(fmt::format("pipe: {}", std::strerror(errno)));
  std::vector<const char*> argv{"sbatch"};
  if (wait) argv.push_back("--wait");
  argv.push_back(nullptr);
  mg::SpawnRequest req;
  req.path = exe.c_str();
  req.argv = argv.data();
  req.envp = environ;
  req.fds[0] = in[0];
  req.fds[1] = STDOUT_FILENO;
  req.fds[2] = STDERR_FILENO;
  mg::SpawnError error;
  const pid_t pid = mg::spawn_process(req, error);
  ::close(in[0]);
  if (pid < 0) {  // no child (a process limit), or one that could not exec (the spawner says so at once)
    ::close(in[1]);
    return cannot_run(exe + ": " + error.message());
  }
  auto reap = [pid] {
    int status = 0;
    while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    return status;
  };
  mg::write_fully(in[1], script);  // a failed write shows up as sbatch's own error
  ::close(in[1]);
  return mg::shell_exit_code(reap());
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
