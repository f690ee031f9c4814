#!/usr/bin/env bash
# Debian 13's LibTorch 2.6 (libtorch-dev, libgloo-dev) and what mgtrain's worker-only build
# needs (g++, cmake, ninja, ccache, fmt, CLI11, nlohmann-json, OpenSSL, zlib) inside the torch
# 2.6 peer's root (../shared/peers/torch2 beside the checkout), installed as its header says:
# apt-get inside the root (`torch2 run apt-get install`). The peer script is not changed.
# Idempotent: only missing packages are installed (none: nothing runs); one install at a time
# (flock), bounded by MGTEST_TORCH2_APT_TIMEOUT seconds (default 600).
# Exit 0: all present; 77 with one line: the peer or its root is absent (skip); 1 with one
# line: apt failed (its log is named).
set -euo pipefail
src=$(cd "$(dirname "$0")/../.." && pwd)
t2=${MGTEST_TORCH2:-$src/../shared/peers/torch2}
root=${TORCH2_ROOT:-/var/cache/mglaunch-peers/torch2-root}
[ -x "$t2" ] || { echo "skipped: torch 2.6 is not at ../shared/peers/torch2 (../shared is absent beside this checkout)"; exit 77; }
[ -f "$root/.ready" ] || { echo "skipped: the torch 2.6 root is not set up: run ../shared/peers/torch2 setup once (~2 min)"; exit 77; }

pkgs=(libtorch-dev libgloo-dev g++ cmake ninja-build ccache libfmt-dev libcli11-dev nlohmann-json3-dev libssl-dev zlib1g-dev)
missing() {
  local p
  for p in "${pkgs[@]}"; do
    chroot "$root" dpkg-query -W -f='${Status}\n' "$p" 2>/dev/null | grep -q 'install ok installed' || echo "$p"
  done
}
[ -z "$(missing)" ] && exit 0

exec 9>/tmp/mglaunch-torch2-libtorch.lock
flock -w "${MGTEST_TORCH2_APT_TIMEOUT:-600}" 9 || { echo "error: another install into $root held the lock too long" >&2; exit 1; }
todo=$(missing | tr '\n' ' ')
[ -z "$todo" ] && exit 0  # installed meanwhile by the lock's holder
log=/tmp/mglaunch-torch2-libtorch.log
echo "torch2_libtorch: installing into $root: $todo(log: $log)" >&2
# The root's package lists first, as they are (nothing installed is upgraded: 0 upgraded); when
# the mirror has moved on and a .deb is gone, the lists are refreshed once and it is retried.
cd /tmp
if ! timeout -k 10 "${MGTEST_TORCH2_APT_TIMEOUT:-600}" "$t2" run /bin/sh -c '
    apt_get() { DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 -y -q --no-install-recommends "$@"; }
    apt_get install "$@" || { apt-get -q update && apt_get install "$@"; }' _ $todo >"$log" 2>&1; then
  echo "error: installing $todo into the torch 2.6 root failed; see $log" >&2
  exit 1
fi
