// The test binaries' main() (support/main.cc, support/watchdog_main.cc) hands over to
// Catch2's runner, compiled once in tests/catch_main.cc (mg_test_runner).
#pragma once

namespace mgtest {

// Runs the Catch2 session on the command line: the test binary's exit status.
int run_catch(int argc, char* argv[]);

}  // namespace mgtest
