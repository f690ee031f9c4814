#!/usr/bin/env python3
"""Partition bench (#34): from a network partition to the majority training again and to the
minority fenced, in seconds, for mglaunch and for torchrun (../shared/peers/torchrun, torch
1.13) with the same workers in the same namespace cluster (tests/support/netns_cluster.py).

Each case: 3 hosts (node0-node2, each its host name), an agent-hosted job on all three,
  --nnodes=1:3 --nproc_per_node=1 --rdzv_backend=c10d --rdzv_endpoint=node0:29400
  --max_restarts=5 --rdzv_conf=last_call_timeout=1
with the default keep-alive (5 s x 3: torch 1.13's cannot be changed) and
tests/partition_worker.py as the worker (a line every 0.2 s with its round). Once one round
runs on all three, node 2 (or node 0, the host) is cut off (its link down) for --cut seconds,
then healed; the job runs --after seconds more, then the agents are stopped.

From the workers' lines:
  majority_s  cut -> the first moment a new round runs on every node of the majority
  fenced_s    cut -> the minority's last worker line before the heal ("-": it ran on)
  split_s     seconds from the cut to the end with workers of two rounds or more at once
  end         the rounds running at the end, with their nodes

  [TORCHRUN=PATH] partition_bench.py BUILD_DIR [--cut 45] [--after 30] [--report bench/results/partition.json]

Exit codes: 0 done; 77 skipped (no namespaces: needs root); 2 bad arguments.
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "support"))
import netns_cluster  # noqa: E402

PY = "/usr/bin/python3"
WORKER = os.path.join(ROOT, "tests", "partition_worker.py")
# The peer: $TORCHRUN (a path), else ../shared/peers/torchrun beside the checkout.
TORCHRUN = os.environ.get("TORCHRUN") or os.path.normpath(os.path.join(ROOT, "..", "shared", "peers", "torchrun"))


def beats(d):
    out = []
    for name in os.listdir(d):
        with open(os.path.join(d, name)) as f:
            for line in f:
                p = line.split()
                if len(p) == 4:
                    out.append((float(p[0]), p[1], p[2]))
    return sorted(out)


def overlap(bs, start, end):
    span = {}
    for t, r, _ in bs:
        a, z = span.get(r, (t, t))
        span[r] = (min(a, t), max(z, t))
    edges = sorted(e for a, z in span.values() if max(a, start) < min(z, end)
                   for e in ((max(a, start), 1), (min(z, end), -1)))
    total, running, last = 0.0, 0, start
    for t, d in edges:
        if running >= 2:
            total += t - last
        running, last = running + d, t
    return total


def measure(bs, names, minority, t_cut, t_heal, t_end):
    majority = {n for i, n in enumerate(names) if i != minority}
    before = {r for t, r, _ in bs if t < t_cut}
    first = {}  # (round, host) -> first beat after the cut
    for t, r, h in bs:
        if t > t_cut and r not in before:
            first.setdefault((r, h), t)
    starts = [max(first[(r, h)] for h in majority) for r in {r for r, _ in first}
              if all((r, h) in first for h in majority)]
    last_minority = max((t for t, _, h in bs if h == names[minority] and t_cut < t < t_heal), default=None)
    fenced = None if last_minority is None or last_minority > t_heal - 1.0 else last_minority - t_cut
    end = {}
    for t, r, h in bs:
        if t > t_end - 2.0:
            end.setdefault(r, set()).add(h)
    return {"majority_s": round(min(starts) - t_cut, 2) if starts else None,
            "fenced_s": round(fenced, 2) if fenced is not None else None,
            "split_s": round(overlap(bs, t_cut, t_end), 2),
            "end": {r: sorted(h) for r, h in end.items()}}


def run_case(build, launcher, minority, cut_s, after_s):
    net = netns_cluster.NetCluster(3)
    d = tempfile.mkdtemp(prefix="mgpartbench_")   # the workers' lines only
    logs = tempfile.mkdtemp(prefix="mgpartbench_logs_")
    agents = []
    try:
        common = ["--nnodes=1:3", "--nproc_per_node=1", "--rdzv_backend=c10d", "--rdzv_endpoint=node0:29400",
                  "--rdzv_id=bench", "--max_restarts=5", "--rdzv_conf=last_call_timeout=1"]
        if launcher == "mglaunch":
            cmd = [os.path.join(build, "bin", "mglaunch")] + common
        else:
            cmd = [PY, TORCHRUN] + common + ["--monitor_interval=0.5"]
        cmd += ["--no_python", PY, WORKER, d]
        for k in range(3):
            with open(os.path.join(logs, f"agent{k}.log"), "w") as log:
                agents.append(subprocess.Popen(net.on(k) + cmd, stdout=subprocess.DEVNULL, stderr=log,
                                               start_new_session=True))
            if k == 0:
                time.sleep(2)  # node 0 hosts: it is listening first
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            now = time.monotonic()
            recent = [(r, h) for t, r, h in beats(d) if t > now - 1]
            if len({r for r, _ in recent}) == 1 and len({h for _, h in recent}) == 3:
                break
            time.sleep(0.2)
        else:
            raise RuntimeError(f"{launcher}: no round on all three nodes within 120 s")
        t_cut = time.monotonic()
        net.cut(minority)
        time.sleep(cut_s)
        t_heal = time.monotonic()
        net.heal()
        time.sleep(after_s)
        t_end = time.monotonic()
        return measure(beats(d), net.names, minority, t_cut, t_heal, t_end)
    finally:
        for a in agents:
            try:
                os.killpg(a.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for a in agents:
            try:
                a.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(a.pid, signal.SIGKILL)
                a.wait()
        net.close()
        subprocess.run(["rm", "-rf", d, logs], check=False)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("build")
    ap.add_argument("--cut", type=float, default=45.0)
    ap.add_argument("--after", type=float, default=30.0)
    ap.add_argument("--only", choices=["mglaunch", "torchrun"], help="one launcher's cases only")
    ap.add_argument("--report", default=os.path.join(ROOT, "bench", "results", "partition.json"))
    args = ap.parse_args()
    netns_cluster.require()
    cases = [("mglaunch", 2), ("mglaunch", 0)]
    if os.path.exists(TORCHRUN):
        cases += [("torchrun", 2), ("torchrun", 0)]
    else:
        print(f"partition_bench: {TORCHRUN} is absent ($TORCHRUN): torchrun's cases left out", flush=True)
    cases = [c for c in cases if not args.only or c[0] == args.only]
    rows = []
    for launcher, minority in cases:
        r = run_case(os.path.abspath(args.build), launcher, minority, args.cut, args.after)
        r.update(launcher=launcher, cut=f"node{minority}" + (" (the host)" if minority == 0 else ""))
        rows.append(r)
        print(json.dumps(r), flush=True)
    # The commit the binaries were built from: the HEAD of the build directory's source tree.
    src = ROOT
    try:
        with open(os.path.join(args.build, "CMakeCache.txt")) as f:
            src = next((ln.split("=", 1)[1].strip() for ln in f if ln.startswith("CMAKE_HOME_DIRECTORY:")), ROOT)
    except OSError:
        pass
    git = subprocess.run(["git", "-C", src, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    report = {"commit": git.stdout.strip(), "cut_s": args.cut, "after_s": args.after, "cases": rows}
    os.makedirs(os.path.dirname(os.path.abspath(args.report)), exist_ok=True)
    with open(args.report, "w") as f:
        json.dump(report, f, indent=1)
    print("| launcher | cut off | majority trains again (s) | minority fenced (s) | two rounds at once (s) "
          "| rounds at the end |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        ends = "; ".join(f"{len(h)} node(s)" for h in r["end"].values()) or "none"
        print(f"| {r['launcher']} | {r['cut']} | {r['majority_s'] if r['majority_s'] is not None else '-'} | "
              f"{r['fenced_s'] if r['fenced_s'] is not None else '- (ran on)'} | {r['split_s']} | "
              f"{len(r['end'])}: {ends} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
