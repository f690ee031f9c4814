#!/usr/bin/env bash
# Lists the tests of the last ctest run in BUILD_DIR that skipped, each with its one-line
# reason (the "skipped: ..." line that tests/support/skip.* print before exit 77).
# Usage: skipped.sh BUILD_DIR   (make test runs it after ctest)
log=${1:-build}/Testing/Temporary/LastTest.log
[ -f "$log" ] || exit 0
awk '
  /^[0-9]+\/[0-9]+ Test: / { name = $0; sub(/^[0-9]+\/[0-9]+ Test: /, "", name); last = ""; inside = 0; next }
  /^Output:$/ { inside = 1; getline; next }
  /^<end of output>$/ { if (last ~ /^skipped: /) { n++; lines = lines "  " name ": " substr(last, 10) "\n" } inside = 0; next }
  inside && NF { last = $0 }
  END { if (n) printf "%d test(s) skipped, with the reason:\n%s", n, lines }
' "$log"
