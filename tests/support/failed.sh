#!/usr/bin/env bash
# Prints the last lines of each failed test's output from the last ctest run in BUILD_DIR,
# after everything else make test prints: ctest's --output-on-failure shows a failure where
# it happened, mid-run, and a CI log that keeps only its tail would lose it.
# Usage: failed.sh BUILD_DIR [LINES]   (make test runs it after skipped.sh)
log=${1:-build}/Testing/Temporary/LastTest.log
[ -f "$log" ] || exit 0
awk -v keep="${2:-40}" '
  /^[0-9]+\/[0-9]+ Test: / { name = $0; sub(/^[0-9]+\/[0-9]+ Test: /, "", name); n = 0; inside = 0; next }
  /^Output:$/ { inside = 1; getline; next }
  /^<end of output>$/ { inside = 0; ended = 1; next }
  inside { buf[n++ % keep] = substr($0, 1, 400); next }
  ended && /^Test / && !/^Test time/ {
    ended = 0
    if ($0 != "Test Passed." && $0 !~ /Skipped/) {
      failed++
      printf "---- the last lines of failed test \"%s\" (%s):\n", name, $0
      for (i = (n > keep ? n - keep : 0); i < n; i++) print "  " buf[i % keep]
    }
  }
  END { if (failed) printf "---- %d failed test(s); every line of their output: %s\n", failed, FILENAME }
' "$log"
