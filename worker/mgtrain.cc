// mgtrain: a LibTorch data-parallel trainer on c10d (Gloo on CPU, NCCL on GPU builds).
// This thin main parses the flags and the torchrun environment, runs the trainer and maps
// errors to exit codes; the units beside it hold one concern each (options, comm,
// models, reducer, checkpoint, allreduce_bench, trainer).
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "cli/args.h"
#include "worker/options.h"
#include "worker/trainer.h"

namespace {

// One line, whatever the message holds (cli::one_line escapes a flag value's newline); a
// multi-line torch error keeps its first line (the rest is a C++ backtrace).
void error_line(std::string_view what, bool first_line_only = false) {
  if (first_line_only) what = what.substr(0, what.find('\n'));
  std::fprintf(stderr, "mgtrain: error: %s\n", mg::cli::one_line(what).c_str());
}

#ifdef MGLAUNCH_WITH_NCCL
constexpr bool kNccl = true;
#else
constexpr bool kNccl = false;
#endif

// This program again, same pid and arguments, with `vars` as its whole environment
// (environment_to_reexec). Returns only when execve failed.
void reexec(char** argv, const std::map<std::string, std::string>& vars) {
  std::vector<std::string> entries;
  for (const auto& [k, v] : vars) entries.push_back(k + "=" + v);
  std::vector<char*> envp;
  for (auto& e : entries) envp.push_back(e.data());
  envp.push_back(nullptr);
  ::execve("/proc/self/exe", argv, envp.data());
}

}  // namespace

int main(int argc, char** argv) {
  using namespace mg::train;
  Options o;
  Env env;
  try {
    auto parsed = parse_options(argc, argv);
    if (!parsed.help.empty()) {
      std::fputs(parsed.help.c_str(), stdout);
      return 0;
    }
    o = parsed.options;
    env = read_env(process_env());
    resolve_mode(o, env);
  } catch (const std::exception& e) {
    error_line(e.what());
    return kExitUsage;
  }
  if (auto vars = environment_to_reexec(o, process_env(), kNccl)) {
    reexec(argv, *vars);
    error_line(std::string("cannot start mgtrain again with TORCH_NCCL_ASYNC_ERROR_HANDLING=2 (--in-place-recovery): "
                           "execve /proc/self/exe: ") + std::strerror(errno) +
               "; set TORCH_NCCL_ASYNC_ERROR_HANDLING=2 in its environment");
    return kExitSetup;
  }
  install_stop_handlers();
  try {
    return run(o, env);
  } catch (const UsageError& e) {
    error_line(e.what());
    return kExitUsage;
  } catch (const SetupError& e) {
    error_line(e.what(), true);
    write_error_file(e.what());
    return kExitSetup;
  } catch (const std::exception& e) {
    std::string what = e.what();
    what = what.substr(0, what.find('\n'));
    error_line(what, true);
    write_error_file(what);
    return kExitFailure;
  } catch (...) {
    error_line("internal error: an unknown exception");
    write_error_file("internal error: an unknown exception");
    return kExitFailure;
  }
}
