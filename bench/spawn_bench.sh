#!/usr/bin/env bash
# Many workers: `--nproc_per_node=N --no_python /bin/true` (default N=10000) with mglaunch
# and with ../shared/peers/torchrun (--monitor_interval=0.1), one after the other, each
# REPS times (default 1). Prints wall time, CPU time (user+sys, the workers included) and
# the load average before each run: on a shared machine compare CPU times, and wall times
# only at a similar load. stdout and stderr go to /dev/null together (one pipe per worker
# for mglaunch). Not part of `make bench`: minutes on 2 cores.
# Usage: bench/spawn_bench.sh [BUILD_DIR] [N] [REPS]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
n=${2:-10000}
reps=${3:-1}
mglaunch=$build/bin/mglaunch
torchrun=../shared/peers/torchrun
measure() {  # NAME CMD...
  local name=$1 load t
  shift
  load=$(cut -d' ' -f1 /proc/loadavg)
  t=$(mktemp)
  /usr/bin/time -o "$t" -f "%e %U %S %x" "$@" >/dev/null 2>&1 || true
  read -r wall user sys rc <"$t"
  rm -f "$t"
  printf '%-9s N=%-6s wall %7.2f s  cpu %7.2f s  exit %s  (load %s)\n' "$name" "$n" "$wall" \
    "$(echo "$user + $sys" | bc)" "$rc" "$load"
}
for _ in $(seq "$reps"); do
  measure mglaunch "$mglaunch" --nproc_per_node="$n" --no_python /bin/true
  if [ -e "$torchrun" ]; then
    port=$(/usr/bin/python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    measure torchrun /usr/bin/python3 "$torchrun" --nproc_per_node="$n" --monitor_interval=0.1 \
      --master_port="$port" --no_python /bin/true
  else
    echo "torchrun: skipped ($torchrun is absent)"
  fi
done
