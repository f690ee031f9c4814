#!/usr/bin/python3
"""make test's summary at its end (tests/support/skipped.sh, tests/support/failed.sh): a
throwaway ctest project with a passing, a failing, a skipped and a timed-out test is run
by a real ctest, then both scripts read its LastTest.log. The failed tests' last lines
come last (a CI log kept by its tail still shows why a test failed: ctest prints a failure
mid-run), only the failed ones, and only their last lines. Usage: test_summary_test.py
SUPPORT_DIR. Exit 0 when all hold, 1 with a line per problem."""
import os
import subprocess
import sys
import tempfile

support = os.path.abspath(sys.argv[1])
problems = []
with tempfile.TemporaryDirectory(prefix="mgsummary_") as d:
    with open(os.path.join(d, "CMakeLists.txt"), "w") as f:
        f.write("""cmake_minimum_required(VERSION 3.19)
project(summary NONE)
enable_testing()
add_test(NAME "ok: passes" COMMAND sh -c "echo all is well")
add_test(NAME "bad: fails" COMMAND sh -c "for i in $(seq 1 60); do echo bad line $i; done; exit 1")
add_test(NAME "skip: skips" COMMAND sh -c "echo 'skipped: no such thing here'; exit 77")
add_test(NAME "slow: times out" COMMAND sh -c "echo slow begun; exec sleep 30")
set_tests_properties("skip: skips" PROPERTIES SKIP_RETURN_CODE 77)
set_tests_properties("slow: times out" PROPERTIES TIMEOUT 2)
""")
    build = os.path.join(d, "b")
    subprocess.run(["cmake", "-S", d, "-B", build], check=True, stdout=subprocess.DEVNULL, timeout=120)
    rc = subprocess.run(["ctest", "--test-dir", build, "-j4"], stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL, timeout=120).returncode
    if rc == 0:
        problems.append("ctest passed a project with a failing test")
    skipped = subprocess.run([os.path.join(support, "skipped.sh"), build], capture_output=True, text=True,
                             timeout=60).stdout
    failed = subprocess.run([os.path.join(support, "failed.sh"), build, "5"], capture_output=True, text=True,
                            timeout=60).stdout
    if "skip: skips: no such thing here" not in skipped:
        problems.append(f"skipped.sh did not give the skipped test's reason: {skipped!r}")
    lines = failed.splitlines()
    if '---- the last lines of failed test "bad: fails" (Test Failed.):' not in lines:
        problems.append(f"failed.sh did not name the failed test: {failed!r}")
    if [l.strip() for l in lines if "bad line" in l] != [f"bad line {i}" for i in range(56, 61)]:
        problems.append(f"failed.sh did not give exactly the failed test's last 5 lines: {failed!r}")
    if not any('failed test "slow: times out"' in l for l in lines):
        problems.append(f"failed.sh left out the test that timed out: {failed!r}")
    if "ok: passes" in failed or "skip: skips" in failed or "all is well" in failed:
        problems.append(f"failed.sh printed a test that did not fail: {failed!r}")
    if not lines or not lines[-1].startswith("---- 2 failed test(s)"):
        problems.append(f"failed.sh's last line is not its count: {failed!r}")
for p in problems:
    print(p)
sys.exit(1 if problems else 0)
