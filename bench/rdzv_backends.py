#!/usr/bin/python3
"""The two rendezvous backends side by side, in one run on this machine.

8 agents on 127.0.0.1-127.0.0.8, nproc 1, /bin/true, start -> all exited (median of RUNS):
  daemon   a dedicated mglaunch-rdzv on 127.0.0.1 (started once, before the runs)
  hosted   --rdzv_backend=c10d, the first agent hosts the rendezvous in-process
  etcd-1   --rdzv_backend=etcd, one etcd member on 127.0.0.1
  etcd-3   --rdzv_backend=etcd, a 3-member etcd cluster on 127.0.0.1-3 (agents list all three)
Then a SIGSTOPped agent among 3 (keep_alive_interval=1 s x 3 attempts) -> survivors exited,
on the daemon and on etcd-1.

Usage: bench/rdzv_backends.py [BUILD_DIR] [RUNS]   (needs /usr/bin/etcd for the etcd rows)
"""
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILD = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "build")
RUNS = int(sys.argv[2]) if len(sys.argv) > 2 else 7
BIN = os.path.join(BUILD, "bin")
MGLAUNCH = os.path.join(BIN, "mglaunch")
ETCD = "/usr/bin/etcd"
ETCDCTL = "/usr/bin/etcdctl"
DEVNULL = subprocess.DEVNULL


def free_port(host="127.0.0.1"):
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class Etcd:
    """n members on 127.0.0.1..n, free ports, a temporary data dir; stop() kills them."""

    def __init__(self, n):
        self.dir = tempfile.mkdtemp(prefix="mg_etcd_bench_")
        self.procs = []
        hosts = [f"127.0.0.{i + 1}" for i in range(n)]
        self.clients = [f"{h}:{free_port(h)}" for h in hosts]
        peers = [f"http://{h}:{free_port(h)}" for h in hosts]
        initial = ",".join(f"m{i}={p}" for i, p in enumerate(peers))
        for i in range(n):
            self.procs.append(subprocess.Popen(
                [ETCD, "--name", f"m{i}", "--data-dir", os.path.join(self.dir, f"m{i}"),
                 "--listen-client-urls", "http://" + self.clients[i], "--advertise-client-urls", "http://" + self.clients[i],
                 "--listen-peer-urls", peers[i], "--initial-advertise-peer-urls", peers[i],
                 "--initial-cluster", initial, "--initial-cluster-token", f"bench{os.getpid()}", "--log-level", "error"],
                stdout=DEVNULL, stderr=DEVNULL))
        deadline = time.time() + 60
        while subprocess.run([ETCDCTL, "--endpoints=" + self.endpoints(), "--command-timeout=2s", "endpoint", "health"],
                             stdout=DEVNULL, stderr=DEVNULL).returncode != 0:
            if time.time() > deadline:
                self.stop()
                raise RuntimeError("etcd did not start")
            time.sleep(0.2)

    def endpoints(self):
        return ",".join(self.clients)

    def stop(self):
        for p in self.procs:
            p.kill()
            p.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


def agent_argv(backend, endpoint, job, i, nnodes, extra=()):
    return [MGLAUNCH, f"--nnodes={nnodes}", "--nproc_per_node=1", f"--rdzv_backend={backend}",
            f"--rdzv_endpoint={endpoint}", f"--rdzv_id={job}", f"--local_addr=127.0.0.{i + 1}", *extra]


def eight_agents(backend, endpoint_of_run, runs):
    times = []
    for r in range(runs):
        endpoint = endpoint_of_run()
        job = f"b{os.getpid()}x{r}"
        t0 = time.perf_counter()
        procs = [subprocess.Popen(agent_argv(backend, endpoint, job, i, 8, ["--no_python", "/bin/true"]),
                                  stdout=DEVNULL, stderr=DEVNULL) for i in range(8)]
        codes = [p.wait(timeout=120) for p in procs]
        times.append(time.perf_counter() - t0)
        assert codes == [0] * 8, (backend, codes)
    return statistics.median(times)


def hung_node(backend, endpoint):
    """3 agents; the second is SIGSTOPped once all run; seconds until both survivors exited."""
    extra = ["--rdzv_conf=keep_alive_interval=1,keep_alive_max_attempt=3", "--no_python", "/bin/sleep", "60"]
    job = f"hung{os.getpid()}{backend}"
    procs = [subprocess.Popen(agent_argv(backend, endpoint, job, i, 3, extra), stdout=DEVNULL, stderr=subprocess.PIPE,
                              text=True) for i in range(3)]
    time.sleep(2.0)  # the round is running (both backends close it in well under a second)
    t0 = time.perf_counter()
    procs[1].send_signal(signal.SIGSTOP)
    for i in (0, 2):
        procs[i].wait(timeout=60)
    elapsed = time.perf_counter() - t0
    procs[1].kill()
    procs[1].wait()
    return elapsed


def main():
    rows = []
    daemon = subprocess.Popen([os.path.join(BIN, "mglaunch-rdzv"), "--listen", "127.0.0.1:0"], stdout=subprocess.PIPE,
                              stderr=DEVNULL, text=True)
    daemon_ep = daemon.stdout.readline().split()[-1]
    try:
        rows.append(("daemon (mglaunch-rdzv)", eight_agents("c10d", lambda: daemon_ep, RUNS)))
        rows.append(("agent-hosted (c10d)", eight_agents("c10d", lambda: f"127.0.0.1:{free_port()}", RUNS)))
        hung = {"daemon (mglaunch-rdzv)": hung_node("c10d", daemon_ep)}
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(timeout=30)
    if os.access(ETCD, os.X_OK):
        for n in (1, 3):
            etcd = Etcd(n)
            try:
                rows.append((f"etcd, {n} member{'s' if n > 1 else ''}", eight_agents("etcd", etcd.endpoints, RUNS)))
                if n == 1:
                    hung["etcd, 1 member"] = hung_node("etcd", etcd.endpoints())
            finally:
                etcd.stop()
    else:
        print(f"(no {ETCD}: etcd rows skipped)")
    print(f"8 agents x 1 worker, /bin/true, start -> all exited, median of {RUNS}:")
    for name, t in rows:
        print(f"  {name:28s} {t * 1000:8.0f} ms")
    print("SIGSTOPped agent -> survivors exited (keep-alive 1 s x 3):")
    for name, t in hung.items():
        print(f"  {name:28s} {t:8.2f} s")


if __name__ == "__main__":
    main()
