#!/usr/bin/env python3
"""CPU seconds and wall time of each ctest test, run as `make test` runs them.

    bench/test_cpu.py BUILD_DIR [--jobs 4] [--cpus 2] [--json OUT] [-- CTEST_SELECTION...]

Reads `ctest --show-only=json-v1` (default selection: -LE soak, what `make test` runs) and
runs every test itself at --jobs at once, the way ctest 3.25 does on a fresh clone: highest
COST first (no CTestCostData.txt), a fixture's setup before the tests that require it, at
most --cpus tests holding RESOURCE_GROUPS cpus:1 at a time, each test's WORKING_DIRECTORY,
ENVIRONMENT and TIMEOUT honoured. Each test runs under a small wrapper that is a child
subreaper (prctl PR_SET_CHILD_SUBREAPER) and reaps every descendant, so os.wait4 on the
wrapper gives the user+system CPU of the whole tree, daemons that double-forked included.

CPU seconds are the number to compare on a loaded machine (the wall times stretch with the
load); the report prints the top N by CPU and by wall, the totals, and when the longest tests
started (a long test started late is the run's tail). docs/benchmarks.md "make test's time".
"""
import argparse
import ctypes
import json
import os
import resource
import tempfile
import signal
import subprocess
import sys
import time

PR_SET_CHILD_SUBREAPER = 36


def wrap(self_file, argv):
    """The wrapper: run argv as a child, reap it and every orphan under it, exit as it did;
    its own CPU (Python's start-up, not the test's) goes to self_file, to be subtracted."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    child = subprocess.Popen(argv)
    rc = None
    deadline = None
    while True:
        try:
            if deadline is None:
                pid, status = os.waitpid(-1, 0)
            else:
                pid, status = os.waitpid(-1, os.WNOHANG)
                if pid == 0:
                    if time.monotonic() > deadline:
                        break  # something the test left behind: not ours to wait for longer
                    time.sleep(0.05)
                    continue
        except ChildProcessError:
            break
        if pid == child.pid:
            rc = os.waitstatus_to_exitcode(status)
            deadline = time.monotonic() + 5.0
    if rc is None:
        rc = 1
    ru = resource.getrusage(resource.RUSAGE_SELF)
    with open(self_file, "w") as f:
        f.write(f"{ru.ru_utime} {ru.ru_stime}")
    sys.exit(rc if rc >= 0 else 128 - rc)


def props_of(test):
    return {p["name"]: p["value"] for p in test.get("properties", [])}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("build_dir")
    ap.add_argument("--jobs", type=int, default=4)
    ap.add_argument("--cpus", type=int, default=2, help="slots of the `cpus` resource (make test: one per core)")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--json", help="write every test's numbers here")
    ap.add_argument("--timeout", type=float, default=600.0, help="for tests without TIMEOUT (make test: 600)")
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    a = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    sel = extra or ["-LE", "soak"]
    out = subprocess.run(["ctest", "--test-dir", a.build_dir, "--show-only=json-v1", *sel],
                         check=True, capture_output=True, text=True).stdout
    tests = json.loads(out)["tests"]
    todo = []
    for i, t in enumerate(tests):
        p = props_of(t)
        todo.append({
            "name": t["name"], "cmd": t["command"], "index": i,
            "cost": float(p.get("COST", 0)),
            "cwd": p.get("WORKING_DIRECTORY"),
            "env": p.get("ENVIRONMENT", []),
            "timeout": float(p.get("TIMEOUT", a.timeout)),
            "skip_rc": p.get("SKIP_RETURN_CODE"),
            "cpu_heavy": any("cpus" in str(g) for g in p.get("RESOURCE_GROUPS", [])),
            "setup": set(p.get("FIXTURES_SETUP", [])),
            "requires": set(p.get("FIXTURES_REQUIRED", [])),
        })
    # ctest without history: highest COST first, then the order of definition.
    todo.sort(key=lambda t: (-t["cost"], t["index"]))
    pending_setups = {}
    for t in todo:
        for f in t["setup"]:
            pending_setups[f] = pending_setups.get(f, 0) + 1
    running = {}
    done = []
    t0 = time.monotonic()
    me = os.path.abspath(__file__)
    scratch = tempfile.mkdtemp(prefix="test_cpu.")
    while todo or running:
        started = True
        while started and len(running) < a.jobs:
            started = False
            heavy = sum(1 for r in running.values() if r["cpu_heavy"])
            for t in todo:
                if any(pending_setups.get(f, 0) for f in t["requires"]):
                    continue
                if t["cpu_heavy"] and heavy >= a.cpus:
                    continue
                env = dict(os.environ)
                for kv in t["env"]:
                    k, _, v = kv.partition("=")
                    env[k] = v
                t["start"] = time.monotonic() - t0
                t["self_file"] = os.path.join(scratch, f"{t['index']}.self")
                t["proc"] = subprocess.Popen(["/usr/bin/python3", me, "--wrap", t["self_file"], "--", *t["cmd"]], cwd=t["cwd"], env=env,
                                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                             start_new_session=True)
                running[t["proc"].pid] = t
                todo.remove(t)
                started = True
                break
        pid, status, ru = os.wait4(-1, os.WNOHANG)
        if pid == 0:
            now = time.monotonic() - t0
            for t in running.values():
                if now - t["start"] > t["timeout"] and not t.get("killed"):
                    t["killed"] = True
                    os.killpg(t["proc"].pid, signal.SIGKILL)
            time.sleep(0.05)
            continue
        t = running.pop(pid, None)
        if t is None:
            continue
        t["wall"] = time.monotonic() - t0 - t["start"]
        try:
            with open(t["self_file"]) as f:
                su, ss = (float(x) for x in f.read().split())
            os.unlink(t["self_file"])
        except (OSError, ValueError):
            su = ss = 0.0
        t["user"], t["sys"] = max(0.0, ru.ru_utime - su), max(0.0, ru.ru_stime - ss)
        t["cpu"] = t["user"] + t["sys"]
        rc = os.waitstatus_to_exitcode(status)
        t["result"] = ("timeout" if t.get("killed") else "skipped" if rc == t["skip_rc"] else
                       "passed" if rc == 0 else f"failed({rc})")
        for f in t["setup"]:
            pending_setups[f] -= 1
        del t["proc"], t["self_file"]
        done.append(t)
        print(f"{t['start']:7.1f} +{t['wall']:6.1f}s {t['cpu']:7.1f} CPU-s {t['result']:9} {t['name'][:100]}",
              file=sys.stderr, flush=True)
    wall = time.monotonic() - t0
    os.rmdir(scratch)

    def table(key, title):
        print(f"\nTop {a.top} by {title}:")
        print(f"{'CPU-s':>7} {'wall-s':>7} {'start':>7}  test")
        for t in sorted(done, key=lambda t: -t[key])[:a.top]:
            print(f"{t['cpu']:7.1f} {t['wall']:7.1f} {t['start']:7.1f}  {t['name'][:110]}")

    table("cpu", "CPU seconds (user+sys, the test and every process under it)")
    table("wall", "wall seconds")
    counts = {}
    for t in done:
        k = t["result"].split("(")[0]
        counts[k] = counts.get(k, 0) + 1
    cpu = sum(t["cpu"] for t in done)
    print(f"\n{len(done)} tests ({', '.join(f'{v} {k}' for k, v in sorted(counts.items()))}); "
          f"CPU {cpu:.0f} s (user {sum(t['user'] for t in done):.0f}, sys {sum(t['sys'] for t in done):.0f}); "
          f"test-seconds {sum(t['wall'] for t in done):.0f}; wall {wall:.0f} s at -j{a.jobs}; "
          f"load at the end {os.getloadavg()[0]:.1f}")
    last = max(done, key=lambda t: t["start"] + t["wall"])
    print(f"last to end: {last['name'][:100]} (started {last['start']:.0f} s, took {last['wall']:.0f} s)")
    for t in done:
        if not t["result"].startswith(("passed", "skipped")):
            print(f"NOT PASSED: {t['result']} {t['name']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"wall": wall, "jobs": a.jobs, "tests": [{k: (sorted(v) if isinstance(v, set) else v)
                                                                for k, v in t.items()} for t in done]}, f, indent=1)


if __name__ == "__main__":
    if len(sys.argv) > 3 and sys.argv[1] == "--wrap" and sys.argv[3] == "--":
        wrap(sys.argv[2], sys.argv[4:])
    else:
        main()
