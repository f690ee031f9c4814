// mgtrain: a LibTorch data-parallel trainer on c10d (Gloo on CPU, NCCL on GPU builds).
// This thin main parses the flags and the torchrun environment, runs the trainer and maps
// errors to exit codes; the units beside it hold one concern each (options, comm,
// models, reducer, checkpoint, allreduce_bench, trainer).
#include <cstdio>
#include <string>
#include <string_view>

#include "worker/options.h"
#include "worker/trainer.h"

namespace {

// One line, whatever the message holds (a flag value with a newline, a multi-line torch
// error): the first line, control characters as '?', cut at 2000 bytes.
void error_line(std::string_view what) {
  what = what.substr(0, what.find('\n'));
  std::string line(what.substr(0, 2000));
  for (char& c : line)
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) c = '?';
  std::fprintf(stderr, "mgtrain: error: %s\n", line.c_str());
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
    error_line(e.what());
    write_error_file(e.what());
    return kExitSetup;
  } catch (const std::exception& e) {
    std::string what = e.what();
    what = what.substr(0, what.find('\n'));
    error_line(what);
    write_error_file(what);
    return kExitFailure;
  } catch (...) {
    error_line("internal error: an unknown exception");
    write_error_file("internal error: an unknown exception");
    return kExitFailure;
  }
}
