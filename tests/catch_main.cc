// Catch2 main for every test binary. A filter that matches no test case is a failure
// (exit 2), not a silent pass: ctest runs each discovered test by name, and a name that
// ctest mangles (a ';' splits it into two) must not turn into a test that cannot fail.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

int main(int argc, char* argv[]) {
  Catch::Session session;
  session.configData().warnings = Catch::WarnAbout::NoTests;
  return session.run(argc, argv);
}
