// The one skip policy of every test (C++ here; tests/support/skip.sh and skip.py say the same
// for the shell and Python tests):
// - A test that cannot run here prints one line "skipped: REASON" and exits 77; every test
//   has SKIP_RETURN_CODE 77 (tests/CMakeLists.txt), so ctest reports it as Skipped, never
//   as Passed. `make test` lists the reasons at the end (tests/support/skipped.sh).
// - What `make setup` installs (a Debian package of the Makefile's DEBS) is required: when
//   it is missing the test skips, but under CI=true it FAILS with one line naming the
//   package, so CI never passes because something did not run.
// - What lies outside the repository and its packages (../shared peers, a GPU, root, a
//   second CPU) is skipped when absent, under CI too; but what CI always has (network
//   namespaces as root: require_in_ci) fails under CI=true when absent.
// A skip after a failed check is a failure (exit 1), so a skip never hides one.
// MGTEST_MISSING=name,name... makes require_program() treat those programs as absent (to
// check this policy without uninstalling anything).
#pragma once

#include <sstream>
#include <string>

namespace mgtest {

// Prints "skipped: REASON" and exits 77 (1 when a check of this test has already failed).
// Exits without unwinding: call it before the test starts processes of its own.
[[noreturn]] void skip_test(const std::string& reason);

// CI=true (or 1/yes) in the environment.
bool in_ci();

// A component that `make setup` installs from `debian_package`: returns when `present`,
// else skips (outside CI) or fails (under CI) with one line naming `what` and the package.
void require_installed(bool present, const std::string& what, const std::string& debian_package);

// The program `name_or_path` (an absolute path, or a name looked up on PATH), installed by
// `debian_package`: its absolute path, or a skip/failure as require_installed().
std::string require_program(const std::string& name_or_path, const std::string& debian_package);

// A file or directory (a data set) that `debian_package` installs.
void require_path(const std::string& path, const std::string& debian_package);

// What CI always gives though no package does (network namespaces as root, for the
// namespace cluster of support/netns_cluster.h): returns when `present`; else skips with
// `reason`, or under CI=true fails with it (one line).
void require_in_ci(bool present, const std::string& reason);

namespace detail {
void note_failed_check();  // called by the Catch2 listener in tests/catch_main.cc
}

}  // namespace mgtest

// SKIP_TEST("needs root, not uid " << uid): skip_test() with a streamed reason.
#define SKIP_TEST(reason)                     \
  do {                                        \
    std::ostringstream mgtest_skip_reason_;   \
    mgtest_skip_reason_ << reason;            \
    ::mgtest::skip_test(mgtest_skip_reason_.str()); \
  } while (false)
