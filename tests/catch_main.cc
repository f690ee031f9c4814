// Catch2's runner for every test binary, compiled once (mg_test_runner, not once per kind of
// main): its implementation is about 20 CPU-s of compile. main() is support/main.cc, or
// support/watchdog_main.cc for the binaries that are also the watchdog program. A filter
// that matches no test case is a failure (exit 2), not a silent pass: ctest runs each
// discovered test by name, and a name that ctest mangles (a ';' splits it into two) must not
// turn into a test that cannot fail.
// A listener counts failed checks, so that a skip after one (support/skip.h) is a failure.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include "support/main.h"
#include "support/skip.h"

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

int mgtest::run_catch(int argc, char* argv[]) {
  Catch::Session session;
  session.configData().warnings = Catch::WarnAbout::NoTests;
  return session.run(argc, argv);
}
