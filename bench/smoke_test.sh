#!/usr/bin/env bash
# ctest "bench: ...": the harness end to end at the smallest sizes, mglaunch only (no
# torchrun, no training, no all-reduce): bench.py writes a results file with every case
# measured and the relay check passed, render.py fills copies of docs/benchmarks.md's markers
# (tables and guardrails) and of the README's headline markers, and draws the plots. Keeps
# `make bench` from rotting without costing a full run.
# Usage: smoke_test.sh BUILD_DIR. Exit 77 (skipped) without hyperfine or gnuplot, 1 under
# CI=true (tests/support/skip.sh).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
build=$(cd "$1" && pwd)
. "$here/../tests/support/skip.sh"
require_program hyperfine hyperfine
require_program gnuplot gnuplot-nox
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# With mgtrain (a build with LibTorch), the recovery case too: one node SIGKILLed under
# mgtrain --in-place-recovery, mglaunch's side only.
cases=launch_exit,agent_rss,restart,rdzv_agents,daemon_scale,relay
[ -x "$build/bin/mgtrain" ] && cases=$cases,recovery
BENCH_SMOKE=1 BENCH_NO_PEER=1 /usr/bin/python3 "$here/bench.py" "$build" --out "$tmp/r.json" --cases "$cases"
/usr/bin/python3 - "$tmp/r.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
if "recovery" in r["cases"]:
    c = r["cases"]["recovery"]
    assert "rows" in c, c
    run = c["runs"]["ours"][0]
    # In-place recovery redoes only the interrupted step; the survivor and the new node end well.
    assert run["steps_lost"] == 0 and run["resumed_from"] >= 15 and run["recovery_ms"] > 0, run
    assert set(run["codes"].split()[1::2]) == {"0"}, run
    print("recovery ok:", run)
assert r["meta"]["cores"] and r["meta"]["versions"]["mglaunch"], r["meta"]
for name in ["launch_exit", "agent_rss", "restart", "rdzv_agents", "daemon_scale", "relay"]:
    c = r["cases"][name]
    assert "rows" in c and c["rows"], (name, c)
    for row in c["rows"]:
        assert row["ours"] and row["ours"]["median"] > 0, (name, row)
assert r["cases"]["relay"]["rows"][0]["check"]["passed"], r["cases"]["relay"]["rows"][0]["check"]
assert all(row.get("runs_ok", 2) == 2 for row in r["cases"]["daemon_scale"]["rows"]), r["cases"]["daemon_scale"]
print("results ok")
PY
printf 'before\n<!-- bench:begin -->\nstale\n<!-- bench:end -->\nafter\n' > "$tmp/benchmarks.md"
printf 'top\n<!-- headline:begin -->\nstale\n<!-- headline:end -->\nbottom\n' > "$tmp/README.md"
render() { /usr/bin/python3 "$here/render.py" --json "$tmp/r.json" --out "$tmp/benchmarks.md" --readme "$tmp/README.md" --docs "$tmp/docs"; }
render
grep -q '^#### (1) launch' "$tmp/benchmarks.md"
! grep -q stale "$tmp/benchmarks.md"
grep -q '^after$' "$tmp/benchmarks.md"
# The guardrails: every one measured at these sizes but the 10,000 agents (smoke: 100).
grep -q '^#### Guardrails' "$tmp/benchmarks.md"
[ "$(grep -cE '^\| .* \| (held|\*\*broken\*\*) \|$' "$tmp/benchmarks.md")" = 3 ] || { grep -A9 '^#### Guardrails' "$tmp/benchmarks.md"; exit 1; }
grep -q '^| 10,000 simulated agents.*not measured' "$tmp/benchmarks.md"
# 1,000 ms and more are written with a comma (a loaded machine's launch takes that long).
grep -q '^| launch → exit, 4 × `/bin/true` | [0-9.,]* ms |' "$tmp/README.md" || { grep '^| launch' "$tmp/README.md"; exit 1; }
if [ -x "$build/bin/mgtrain" ]; then
  grep -q '^#### ([0-9]*) one node SIGKILLed mid-training' "$tmp/benchmarks.md"
  grep -q '^| one node SIGKILLed mid-training .* | [0-9.,]* ms, 0 steps lost |' "$tmp/README.md"
fi
! grep -q stale "$tmp/README.md"
grep -q '^bottom$' "$tmp/README.md"
for png in bench_launch.png bench_rdzv.png bench_relay.png; do
  [ "$(head -c 4 "$tmp/docs/$png" | tail -c 3)" = PNG ] || { echo "no plot $png"; exit 1; }
done
# A peer recorded with this machine's absolute path is written as a checkout has it.
/usr/bin/python3 - "$tmp/r.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
r["meta"]["peer"] = "/usr/bin/python3 /somewhere/shared/peers/torchrun --monitor_interval=0.1"
r["meta"]["peer_note"] = "peer: ../shared/peers/torchrun (/usr/bin/python3 /somewhere/shared/peers/torchrun)"
json.dump(r, open(sys.argv[1], "w"))
PY
render
grep -q '^Peer: `/usr/bin/python3 \.\./shared/peers/torchrun --monitor_interval=0.1`' "$tmp/benchmarks.md"
! grep -q /somewhere "$tmp/benchmarks.md"
echo "bench smoke: ok"
