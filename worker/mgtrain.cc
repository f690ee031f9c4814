// mgtrain: a LibTorch data-parallel trainer on c10d (Gloo on CPU, NCCL on GPU builds).
// This thin main parses the flags and the torchrun environment, runs the trainer and maps
// errors to exit codes; the units beside it hold one concern each (options, comm,
// models, reducer, checkpoint, allreduce_bench, trainer).
#include <cstdio>
#include <string>
#include <string_view>

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
