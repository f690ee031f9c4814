// The skip policy of every suite (support/skip.h, skip.sh, skip.py), checked on real
// processes: this binary runs its own hidden probe cases, the shell helper and the Python
// helper, with and without CI=true. MGTEST_MISSING stands in for an uninstalled package.
#include <catch2/catch.hpp>

#include <unistd.h>

#include <climits>

#include "support/proc.h"
#include "support/skip.h"

using namespace mgtest;
using namespace std::chrono_literals;

namespace {

std::string self() {
  char buf[PATH_MAX];
  const ssize_t n = ::readlink("/proc/self/exe", buf, sizeof buf - 1);
  REQUIRE(n > 0);
  return std::string(buf, static_cast<std::size_t>(n));
}

Result probe(const std::string& name, std::map<std::string, std::string> env) {
  return run({self(), name}, env, 30s);
}

// The last line of `out` (Catch2 prints its filter first; make test's list of skipped tests
// reads the last line too).
std::string last_line(const std::string& out) {
  auto lines = split_lines(out);
  while (!lines.empty() && lines.back().empty()) lines.pop_back();
  return lines.empty() ? "" : lines.back();
}

}  // namespace

// Hidden ([.]): run only by name, from the cases below.
TEST_CASE("probe: needs /bin/sh from dash", "[.]") {
  const std::string sh = require_program("/bin/sh", "dash");
  CHECK(sh == "/bin/sh");
  CHECK(require_program("sh", "dash").ends_with("/sh"));  // looked up on PATH
}

TEST_CASE("probe: a skip for a reason outside the repository", "[.]") { SKIP_TEST("no GPU here (" << 0 << " found)"); }

TEST_CASE("probe: a failed check then a skip", "[.]") {
  CHECK(1 + 1 == 3);
  SKIP_TEST("too late to skip");
}

TEST_CASE("a missing package skips with one line naming it, and fails under CI=true") {
  auto present = probe("probe: needs /bin/sh from dash", {{"CI", "true"}, {"MGTEST_MISSING", kUnset}});
  INFO(present.out);
  CHECK(present.code == 0);

  auto skipped = probe("probe: needs /bin/sh from dash", {{"CI", kUnset}, {"MGTEST_MISSING", "etcdctl,sh"}});
  INFO(skipped.out);
  CHECK(skipped.code == 77);
  CHECK(last_line(skipped.out) == "skipped: /bin/sh is missing (make setup installs Debian package dash)");

  for (const char* ci : {"true", "1"}) {
    auto failed = probe("probe: needs /bin/sh from dash", {{"CI", ci}, {"MGTEST_MISSING", "sh"}});
    INFO(failed.out);
    CHECK(failed.code == 1);
    CHECK_THAT(last_line(failed.out),
               Catch::StartsWith("error: /bin/sh is missing and CI=true: install Debian package dash"));
  }
  auto not_ci = probe("probe: needs /bin/sh from dash", {{"CI", "false"}, {"MGTEST_MISSING", "sh"}});
  CHECK(not_ci.code == 77);
}

TEST_CASE("a test that cannot run for a reason outside the repository skips, under CI=true too") {
  for (const char* ci : {"true", "\x01unset"}) {
    auto r = probe("probe: a skip for a reason outside the repository", {{"CI", ci}});
    INFO(r.out);
    CHECK(r.code == 77);
    CHECK(last_line(r.out) == "skipped: no GPU here (0 found)");
  }
}

TEST_CASE("a skip after a failed check is a failure, not a skip") {
  auto r = probe("probe: a failed check then a skip", {{"CI", kUnset}});
  INFO(r.out);
  CHECK(r.code == 1);
  CHECK_THAT(r.out, Catch::Contains("error: 1 check(s) failed before this test skipped (too late to skip)"));
}

TEST_CASE("the shell and Python helpers skip and fail as the C++ one does") {
  const std::string sh = kSourceDir + "/tests/support/skip.sh";
  const std::string py_path = kSourceDir + "/tests/support";
  const std::string sh_require = ". '" + sh + "'; require_program sh dash; echo present";
  const std::string py_require =
      "import sys; sys.path.insert(0, sys.argv[1]); import skip; skip.require_program('sh', 'dash'); print('present')";
  for (const bool ci : {false, true}) {
    const std::map<std::string, std::string> missing{{"CI", ci ? "true" : kUnset}, {"MGTEST_MISSING", "sh"}};
    const int code = ci ? 1 : 77;
    const std::string line = ci ? "error: sh is missing and CI=true: install Debian package dash"
                                : "skipped: sh is missing (make setup installs Debian package dash)";
    auto a = run({"/bin/bash", "-c", sh_require}, missing);
    auto b = run({"/usr/bin/python3", "-c", py_require, py_path}, missing);
    auto c = run({sh, "missing", "sh", "dash"}, missing);
    for (const auto* r : {&a, &b, &c}) {
      INFO(r->out << r->err);
      CHECK(r->code == code);
      CHECK_THAT(r->out, Catch::StartsWith(line));
      CHECK_THAT(r->out, !Catch::Contains("present"));
    }
    auto outside = run({sh, "skip", "no", "GPU"}, missing);
    CHECK(outside.code == 77);
    CHECK(outside.out == "skipped: no GPU\n");
  }
  const std::map<std::string, std::string> present{{"CI", "true"}, {"MGTEST_MISSING", kUnset}};
  auto a = run({"/bin/bash", "-c", sh_require}, present);
  auto b = run({"/usr/bin/python3", "-c", py_require, py_path}, present);
  CHECK(a.code == 0);
  CHECK(a.out == "present\n");
  CHECK(b.code == 0);
  CHECK(b.out == "present\n");
}
