#!/usr/bin/env bash
# The skip policy of tests/support/skip.h for shell tests. Source it, then:
#   skip_test REASON             one line "skipped: REASON", exit 77 (ctest: Skipped)
#   require_program NAME PACKAGE a program `make setup` installs from Debian package PACKAGE:
#                                missing, it skips; under CI=true it fails (exit 1, one line)
#   require_installed OK WHAT PACKAGE   the same for any component (OK: 1 present, 0 missing)
# Run as a command: skip.sh skip REASON | skip.sh missing WHAT PACKAGE (for CMake's
# stand-in tests of parts that were not built).
# MGTEST_MISSING=name,name... treats those programs as absent (to check the policy).

mgtest_in_ci() { case "${CI:-}" in true | TRUE | True | 1 | yes) return 0 ;; esac; return 1; }

skip_test() {
  echo "skipped: $*"
  exit 77
}

require_installed() {
  local ok=$1 what=$2 pkg=$3
  [ "$ok" = 1 ] && return 0
  if mgtest_in_ci; then
    echo "error: $what is missing and CI=true: install Debian package $pkg (make setup installs it; under CI a missing component fails, it does not skip)"
    exit 1
  fi
  skip_test "$what is missing (make setup installs Debian package $pkg)"
}

require_program() {
  local name=$1 pkg=$2 ok=1
  case ",${MGTEST_MISSING:-}," in *",${name##*/},"*) ok=0 ;; esac
  [ "$ok" = 1 ] && { command -v "$name" > /dev/null || ok=0; }
  require_installed "$ok" "$name" "$pkg"
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  case "${1:-}" in
    skip) shift; skip_test "$*" ;;
    missing) require_installed 0 "$2" "$3" ;;
    *) echo "usage: $0 skip REASON | missing WHAT PACKAGE" >&2; exit 2 ;;
  esac
fi
