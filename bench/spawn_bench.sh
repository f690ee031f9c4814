#!/usr/bin/env bash
# Many workers: `--nproc_per_node=N --no_python /bin/true` (default N=10000) with mglaunch
# and with ../shared/peers/torchrun (--monitor_interval=0.1), one after the other, each
# REPS times (default 1). Prints wall time, CPU time (user+sys, the workers included) and
# the load average before each run: on a shared machine compare CPU times, and wall times
# only at a similar load. stdout and stderr go to /dev/null together (one pipe per worker
# for mglaunch). Not part of `make bench`: minutes on 2 cores.
# BEFORE=PATH also runs another mglaunch binary (e.g. one built from an older tree) in
# each round, for a before/after comparison at the same load. The agent's own CPU (without
# its workers) is printed too when perf is installed.
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
agent_cpu() {  # NAME CMD...: CPU of the launcher process alone (perf stat --no-inherit)
  local name=$1 t
  shift
  command -v perf >/dev/null || return 0
  t=$(mktemp)
  perf stat -x, -e task-clock --no-inherit -o "$t" "$@" >/dev/null 2>&1 || true
  printf '%-9s N=%-6s agent alone: %s ms of CPU\n' "$name" "$n" "$(grep task-clock "$t" | cut -d, -f1)"
  rm -f "$t"
}
for _ in $(seq "$reps"); do
  measure mglaunch "$mglaunch" --nproc_per_node="$n" --no_python /bin/true
  agent_cpu mglaunch "$mglaunch" --nproc_per_node="$n" --no_python /bin/true
  if [ -n "${BEFORE:-}" ]; then
    measure before "$BEFORE" --nproc_per_node="$n" --no_python /bin/true
    agent_cpu before "$BEFORE" --nproc_per_node="$n" --no_python /bin/true
  fi
  if [ -e "$torchrun" ]; then
    port=$(/usr/bin/python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    measure torchrun /usr/bin/python3 "$torchrun" --nproc_per_node="$n" --monitor_interval=0.1 \
      --master_port="$port" --no_python /bin/true
  else
    echo "torchrun: skipped ($torchrun is absent)"
  fi
done
