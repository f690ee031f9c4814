// Catch2's runner for every test binary, compiled once (mg_test_runner, not once per kind of
// main): its implementation is about 20 CPU-s of compile. main() is support/main.cc, or
// support/watchdog_main.cc for the binaries that are also the watchdog program. A filter
// that matches no test case is a failure (exit 2), not a silent pass: ctest runs each
// discovered test by name, and a name that ctest mangles (a ';' splits it into two) must not
// turn into a test that cannot fail.
// A listener counts failed checks, so that a skip after one (support/skip.h) is a failure.
// Another gives each test case a records directory of its own (MGLAUNCH_RECORD_DIR, the
// agents' records of their jobs, launcher/job_record.h), made when the case starts and
// removed when it ends: no case reads a record an agent of another case (or of an earlier
// run of the binary) left, and no agent writes into the user's real $XDG_RUNTIME_DIR.
// The console reporter's width: Catch2 2.13's printHeaderString indents a failing case's
// name past its first ": ", and loops for ever when that indent reaches the width (80 by
// default): a failure of such a case hung until ctest's timeout and showed no assertion
// (review s39 T). Every binary's reporter is compiled here (the runner, and the reducer's
// tests in the top CMakeLists.txt), before any other unit's include of catch.hpp.
#define CATCH_CONFIG_CONSOLE_WIDTH 300
#define CATCH_CONFIG_RUNNER
#include <stdlib.h>

#include <filesystem>
#include <string>

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

struct CaseRecords : Catch::TestEventListenerBase {
  using TestEventListenerBase::TestEventListenerBase;
  std::string dir;
  void testCaseStarting(const Catch::TestCaseInfo&) override {
    const char* tmp = std::getenv("TMPDIR");
    std::string templ = std::string(tmp && *tmp ? tmp : "/tmp") + "/mgrecords_XXXXXX";
    if (::mkdtemp(templ.data()) == nullptr) return;  // (the spawn()'s own fallback then)
    dir = templ;
    ::setenv("MGLAUNCH_RECORD_DIR", dir.c_str(), 1);
  }
  void testCaseEnded(const Catch::TestCaseStats&) override {
    if (dir.empty()) return;
    std::error_code ec;
    std::filesystem::remove_all(dir, ec);
    dir.clear();
  }
};

}  // namespace

CATCH_REGISTER_LISTENER(FailedCheckCounter)
CATCH_REGISTER_LISTENER(CaseRecords)

int mgtest::run_catch(int argc, char* argv[]) {
  Catch::Session session;
  session.configData().warnings = Catch::WarnAbout::NoTests;
  return session.run(argc, argv);
}
