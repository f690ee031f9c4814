// main() of the process layer's test binaries (mg_test_main_watchdog): each is also the
// watchdog program its tests start (process/watchdog.h), else Catch2's runner.
#include <cstring>

#include "process/watchdog.h"
#include "support/main.h"

int main(int argc, char* argv[]) {
  if (argc > 1 && std::strcmp(argv[1], mg::kWatchdogMode) == 0) return mg::watchdog_main(argc, argv);
  return mgtest::run_catch(argc, argv);
}
