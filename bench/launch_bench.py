#!/usr/bin/python3
"""Agent benchmarks against the reference torchrun, in one run on this machine.

1. launch->exit of `--standalone --nproc_per_node=4 --no_python /bin/true`
2. the agent's own peak RSS (VmHWM of the agent process while 4 workers sleep)
3. restart latency: a worker fails -> all 4 workers of the next attempt have started
   (timestamps written by the workers themselves, CLOCK_REALTIME)

torchrun gets --monitor_interval=0.1 (torch 2.x's default). Prints a Markdown table
with medians and the torchrun/mglaunch ratio.
"""
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILD = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "build")
MGLAUNCH = [os.path.join(BUILD, "bin", "mglaunch")]
FAKE = os.path.join(BUILD, "bin", "fake_worker")
TORCHRUN = ["/usr/bin/python3", os.path.join(ROOT, "..", "shared", "peers", "torchrun"), "--monitor_interval=0.1"]
DEVNULL = subprocess.DEVNULL


def launch_exit(cmd, runs):
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run(cmd + ["--standalone", "--nproc_per_node=4", "--no_python", "/bin/true"],
                       stdout=DEVNULL, stderr=DEVNULL, check=True, timeout=120)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def agent_rss_kib(cmd):
    p = subprocess.Popen(cmd + ["--standalone", "--nproc_per_node=4", "--no_python", FAKE, "hang", "3"],
                         stdout=DEVNULL, stderr=DEVNULL)
    peak = 0
    deadline = time.time() + 60
    while p.poll() is None and time.time() < deadline:
        try:
            with open(f"/proc/{p.pid}/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        peak = max(peak, int(line.split()[1]))
        except OSError:
            pass
        time.sleep(0.05)
    p.wait(timeout=60)
    return peak


def restart_latency(cmd, runs):
    lat = []
    for _ in range(runs):
        with tempfile.TemporaryDirectory() as d:
            stamps = os.path.join(d, "stamps")
            worker = [FAKE, "stamp", stamps, "start", "when-restart-below", "1", "when-rank", "0",
                      "stamp", stamps, "fail", "exit", "1"]
            subprocess.run(cmd + ["--standalone", "--nproc_per_node=4", "--max_restarts=1", "--no_python"] + worker,
                           stdout=DEVNULL, stderr=DEVNULL, check=True, timeout=120)
            rows = [line.split() for line in open(stamps)]
            fail = min(int(r[3]) for r in rows if r[0] == "fail")
            started = [int(r[3]) for r in rows if r[0] == "start" and r[1] == "1"]
            assert len(started) == 4, rows
            lat.append((max(started) - fail) / 1e9)
    return statistics.median(lat)


def main():
    ours_launch = launch_exit(MGLAUNCH, 30)
    ref_launch = launch_exit(TORCHRUN, 5)
    ours_rss = agent_rss_kib(MGLAUNCH)
    ref_rss = agent_rss_kib(TORCHRUN)
    ours_restart = restart_latency(MGLAUNCH, 10)
    ref_restart = restart_latency(TORCHRUN, 5)
    print("| metric | mglaunch | torchrun (1.13, --monitor_interval=0.1) | torchrun / mglaunch |")
    print("|---|---|---|---|")
    print(f"| launch->exit, 4 x /bin/true (median) | {ours_launch*1e3:.1f} ms | {ref_launch*1e3:.0f} ms | "
          f"{ref_launch/ours_launch:.0f}x |")
    print(f"| agent peak RSS (VmHWM) | {ours_rss/1024:.1f} MiB | {ref_rss/1024:.0f} MiB | {ref_rss/ours_rss:.0f}x |")
    print(f"| worker failure -> group of 4 restarted (median) | {ours_restart*1e3:.1f} ms | "
          f"{ref_restart*1e3:.0f} ms | {ref_restart/ours_restart:.0f}x |")


if __name__ == "__main__":
    main()
