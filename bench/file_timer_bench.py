#!/usr/bin/env python3
"""The agent's CPU per FileTimer request (TORCHELASTIC_ENABLE_FILE_TIMER), as torch's
FileTimerClient sends them: a timer set, then released, step after step. The requests come
from a process DEPTH levels below the worker (0: the worker itself; each level in a session
of its own, as a daemonised helper: one still in the worker's process group is found by
its group at the first step of the walk), whose admission the
agent checks: before #35 (reap35) by a walk up the /proc parent chain per request, after it
by one /proc/PID/stat read against a cache of the processes admitted.

  bench/file_timer_bench.py [--mglaunch PATH] [--pairs N] [--depth D ...] [--runs R]

Prints, per depth, the agent's CPU time per request (utime + stime of the agent process,
read from /proc before and after the requests, after the agent went idle), median of R runs.
"""
import argparse
import os
import statistics
import subprocess
import sys
import tempfile

WRITER = r'''
import json, os, sys, time
path, pairs, depth, agent = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
if depth > 0:  # one level further down, each in a session of its own (a daemonised helper):
    import subprocess  # a process still in the worker's group was found by its group at the first step
    sys.exit(subprocess.call([sys.executable, __file__, sys.argv[1], sys.argv[2], str(depth - 1), str(agent)],
                             start_new_session=True))
def cpu():
    f = open("/proc/%d/stat" % agent).read().rsplit(")", 1)[1].split()
    return int(f[11]) + int(f[12])  # utime + stime, clock ticks
def settle():
    last = cpu()
    while True:
        time.sleep(0.3)
        now = cpu()
        if now == last:
            return now
        last = now
pid = os.getpid()
batch = []
for i in range(pairs):
    batch.append(json.dumps({"version": 1, "pid": pid, "scope_id": "step", "expiration_time": time.time() + 3600, "signal": 9}))
    batch.append(json.dumps({"version": 1, "pid": pid, "scope_id": "step", "expiration_time": -1, "signal": 0}))
data = "\n".join(batch) + "\n"
with open(path, "w") as pipe:
    before = settle()
    pipe.write(data)
    pipe.flush()
    after = settle()
print("ticks %d requests %d" % (after - before, 2 * pairs), flush=True)
'''


def one(mglaunch, pairs, depth, tmp):
    script = os.path.join(tmp, "writer.py")
    with open(script, "w") as f:
        f.write(WRITER)
    env = dict(os.environ, TORCHELASTIC_ENABLE_FILE_TIMER="1", TORCHELASTIC_TIMER_FILE=os.path.join(tmp, "pipe"))
    # The worker is a shell that runs the writer with the agent's pid ($PPID: the shell's parent).
    cmd = [mglaunch, "--nproc_per_node=1", "--no_python", "/bin/sh", "-c",
           'exec /usr/bin/python3 "$0" "$TORCHELASTIC_TIMER_FILE" %d %d $PPID' % (pairs, depth), script]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    for line in out.stdout.splitlines():
        if "ticks " in line:
            f = line.split("ticks ", 1)[1].split()
            return int(f[0]) / os.sysconf("SC_CLK_TCK") / int(f[2])
    raise SystemExit("no result: %s %s" % (out.stdout, out.stderr))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mglaunch", default="build/bin/mglaunch")
    ap.add_argument("--pairs", type=int, default=50000)
    ap.add_argument("--depth", type=int, nargs="+", default=[0, 3])
    ap.add_argument("--runs", type=int, default=3)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for d in a.depth:
            per = [one(a.mglaunch, a.pairs, d, tmp) for _ in range(a.runs)]
            print("depth %d: %.2f us of agent CPU per request (median of %d; %s)" %
                  (d, statistics.median(per) * 1e6, a.runs, ", ".join("%.2f" % (p * 1e6) for p in per)))


if __name__ == "__main__":
    main()
