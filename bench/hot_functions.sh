#!/bin/sh
# bench/hot_functions.sh [BUILD]: regenerates launcher/hot_functions.txt, the functions of
# `mglaunch` that a plain run executes (callgrind, in the order it lists them), which the
# link places side by side (launcher/CMakeLists.txt, lld --symbol-ordering-file). The
# kernel maps an executable's pages 64 KiB at a time (fault-around): the fewer windows the
# run touches, the smaller the agent's resident set. Run it after large changes to the
# agent; a stale list costs memory, never correctness (names no longer present are skipped).
# Needs valgrind. Scenarios: 4 × /bin/true, 4 sleeping workers, a failed worker and its
# restart, a failed run with a root cause, workers that print.
set -eu
BUILD=${1:-build}
BIN=$BUILD/bin/mglaunch
FAKE=$BUILD/bin/fake_worker
OUT=$(dirname "$0")/../launcher/hot_functions.txt
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
# valgrind runs clone(CLONE_VM) only as vfork: a preloaded clone() adds CLONE_VFORK (the
# agent then waits for each exec, as where the kernel lacks CLOSE_RANGE_CLOEXEC).
cat > "$TMP/vfork.c" <<'EOF_C'
#define _GNU_SOURCE
#include <dlfcn.h>
#include <sched.h>
#include <stdarg.h>
int clone(int (*fn)(void*), void* stack, int flags, void* arg, ...) {
  va_list ap;
  va_start(ap, arg);
  void* ptid = va_arg(ap, void*);
  void* tls = va_arg(ap, void*);
  void* ctid = va_arg(ap, void*);
  va_end(ap);
  if ((flags & CLONE_VM) && !(flags & CLONE_THREAD)) flags |= CLONE_VFORK;
  int (*real)(int (*)(void*), void*, int, void*, ...) = dlsym(RTLD_NEXT, "clone");
  return real(fn, stack, flags, arg, ptid, tls, ctid);
}
EOF_C
cc -shared -fPIC -O1 -o "$TMP/vfork.so" "$TMP/vfork.c" -ldl
cg() {
  LD_PRELOAD="$TMP/vfork.so" valgrind -q --tool=callgrind --callgrind-out-file="$TMP/cg.%p" --compress-strings=no --demangle=no \
    "$BIN" --standalone --nproc_per_node=4 "$@" >/dev/null 2>&1 || true
}
cg --no_python /bin/true
cg --no_python "$FAKE" hang 0.3
cg --max_restarts=1 --no_python "$FAKE" stamp "$TMP/stamps" start when-restart-below 1 when-rank 0 exit 1
cg --no_python "$FAKE" error-file boom exit 3
cg --no_python "$FAKE" print hello eprint world lines 200
# Function names (mangled) of the mglaunch object, in first-seen order; the CLONE_VM spawn
# child (callgrind does not follow it) runs child_main on the agent's own pages.
{
  for f in "$TMP"/cg.*; do
    awk -v bin="$(basename "$BIN")" '/^ob=/ { ob = substr($0, 4) } /^fn=/ { n = split(ob, p, "/"); if (p[n] == bin) print substr($0, 4) }' "$f"
  done
  nm "$BIN" | awk '$3 ~ /child_main/ { print $3 }'
} | grep -v -e '^0x' -e '^(below main)' | awk '!seen[$0]++' > "$OUT"
echo "$(wc -l < "$OUT") functions -> $OUT"
