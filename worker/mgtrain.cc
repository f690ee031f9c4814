// mgtrain: a LibTorch data-parallel trainer on c10d (Gloo on CPU, NCCL on GPU builds).
// This thin main parses the flags and the torchrun environment, runs the trainer and maps
// errors to exit codes; the units beside it hold one concern each (options, comm,
// models, reducer, checkpoint, allreduce_bench, trainer).
#include <cstdio>
#include <string>

#include "worker/options.h"
#include "worker/trainer.h"

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
    std::fprintf(stderr, "mgtrain: error: %s\n", e.what());
    return kExitUsage;
  }
  install_stop_handlers();
  try {
    return run(o, env);
  } catch (const UsageError& e) {
    std::fprintf(stderr, "mgtrain: error: %s\n", e.what());
    return kExitUsage;
  } catch (const SetupError& e) {
    std::fprintf(stderr, "mgtrain: error: %s\n", e.what());
    write_error_file(e.what());
    return kExitSetup;
  } catch (const std::exception& e) {
    std::string what = e.what();
    what = what.substr(0, what.find('\n'));
    std::fprintf(stderr, "mgtrain: error: %s\n", what.c_str());
    write_error_file(what);
    return kExitFailure;
  }
}
