#!/usr/bin/env bash
# mgtrain built against Debian 13's LibTorch 2.6 inside the torch 2.6 peer's root
# (../shared/peers/torch2): the worker-only build (-DMGLAUNCH_WORKER_ONLY=ON), target mgtrain
# and the reducer's own tests (mgtrain_reducer_tests, -DMGLAUNCH_WORKER_TESTS=ON, with the
# host's Catch2 v2 header copied into BUILD_DIR/extra: Debian 13 has Catch2 v3) only, with
# ccache (the root's own cache, /root/.cache/ccache inside it, shared by every checkout and
# build directory; a kept BUILD_DIR rebuilds nothing at all).
# Usage: torch2_mgtrain.sh BUILD_DIR   (then BUILD_DIR/bin/mgtrain and mgtrain_reducer_tests
# run under `torch2 run`)
# First installs what the root lacks (torch2_libtorch.sh). Exit 0: built; 77 with one line:
# the peer is absent (skip); 1: the build failed (its log is BUILD_DIR/build.log).
set -euo pipefail
[ $# = 1 ] || { echo "usage: $0 BUILD_DIR" >&2; exit 2; }
here=$(cd "$(dirname "$0")" && pwd)
src=$(cd "$here/../.." && pwd)
t2=${MGTEST_TORCH2:-$src/../shared/peers/torch2}
"$here/torch2_libtorch.sh"  # exit 77 (skip) and 1 pass through set -e
mkdir -p "$1"
bld=$(cd "$1" && pwd)
# The root sees the host's /tmp and the directory it runs in: run it in the deepest directory
# that holds both the sources and BUILD_DIR.
top=$src
while [ "${bld#"$top"/}" = "$bld" ]; do top=$(dirname "$top"); done
[ "$top" != / ] || { echo "error: $src and $bld share no directory but /; put BUILD_DIR under $src or beside it" >&2; exit 2; }
cd "$top"
log=$bld/build.log
# One build at a time per BUILD_DIR (tests running side by side share it).
exec 9>"$bld/.torch2_mgtrain.lock"
flock -w "${MGTEST_TORCH2_BUILD_TIMEOUT:-1500}" 9 || { echo "error: another build of $bld held it too long" >&2; exit 1; }
catch=/usr/include/catch2/catch.hpp
[ -f "$catch" ] || { echo "error: $catch is missing (Debian package catch2; make setup installs it)" >&2; exit 1; }
mkdir -p "$bld/extra/include/catch2"
cmp -s "$catch" "$bld/extra/include/catch2/catch.hpp" || cp "$catch" "$bld/extra/include/catch2/catch.hpp"
if ! timeout -k 10 "${MGTEST_TORCH2_BUILD_TIMEOUT:-1500}" "$t2" run /usr/bin/env \
    CCACHE_BASEDIR="$top" CCACHE_SLOPPINESS=include_file_ctime,include_file_mtime,pch_defines,time_macros \
    /bin/sh -ec 'cmake -S "$1" -B "$2" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMGLAUNCH_WORKER_ONLY=ON \
      -DMGLAUNCH_WITH_TORCH=ON -DMGLAUNCH_WORKER_TESTS=ON -DMGLAUNCH_EXTRA_PREFIX="$2/extra"
    cmake --build "$2" --target mgtrain mgtrain_reducer_tests -j "${MGTEST_TORCH2_JOBS:-2}"' _ "$src" "$bld" >"$log" 2>&1; then
  echo "error: building mgtrain against LibTorch 2.6 failed; see $log:" >&2
  grep -m 5 -E 'error|Error' "$log" >&2 || tail -n 5 "$log" >&2
  exit 1
fi
