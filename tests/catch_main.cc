// Catch2 main for every test binary. A filter that matches no test case is a failure
// (exit 2), not a silent pass: ctest runs each discovered test by name, and a name that
// ctest mangles (a ';' splits it into two) must not turn into a test that cannot fail.
// A listener counts failed checks, so that a skip after one (support/skip.h) is a failure.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include "support/skip.h"

#ifdef MGTEST_WATCHDOG_MODE
#include <cstring>

#include "process/watchdog.h"
#endif

namespace {

struct FailedCheckCounter : Catch::TestEventListenerBase {
  using TestEventListenerBase::TestEventListenerBase;
  bool assertionEnded(const Catch::AssertionStats& stats) override {
    if (!stats.assertionResult.isOk()) mgtest::detail::note_failed_check();
    return true;
  }
};

}  // namespace

CATCH_REGISTER_LISTENER(FailedCheckCounter)

int main(int argc, char* argv[]) {
#ifdef MGTEST_WATCHDOG_MODE
  // This test binary is also the watchdog program its tests start (process/watchdog.h).
  if (argc > 1 && std::strcmp(argv[1], mg::kWatchdogMode) == 0) return mg::watchdog_main(argc, argv);
#endif
  Catch::Session session;
  session.configData().warnings = Catch::WarnAbout::NoTests;
  return session.run(argc, argv);
}
