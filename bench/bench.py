#!/usr/bin/python3
"""mglaunch's benchmark harness: every case, mglaunch and its peer (torchrun) in the same
run on this machine, written to one results file. `make bench` runs it and then
bench/render.py (docs/benchmarks.md tables, the README headline, docs/*.png plots).

Usage: bench.py BUILD_DIR [--out FILE] [--cases a,b,...] [--merge FILE]
  BENCH_QUICK=1   every case once, with smaller sizes (a smoke run)
  BENCH_SMOKE=1   as quick, smallest sizes (the ctest `bench: ...`)
  BENCH_NO_PEER=1 skip the peer (torchrun) everywhere
  BENCH_RECOVERY_LOG=FILE  the recovery case appends every line it read there, in seconds after the kill
  BENCH_TRAIN_SEEDS="1 2 3"  seeds for the training case (each seed: one epoch per trainer and count)
  BENCH_PEER_MAX_AGENTS=K  torchrun's c10d case only up to K agents (default 8: each
                  torchrun agent is a ~230 MiB Python process on a 2-core machine)
  TORCHRUN=CMD    the peer; else `torchrun` on PATH, else ../shared/peers/torchrun. It
                  always gets --monitor_interval=0.1.

Whole-process timings come from hyperfine (warm-up runs discarded; mglaunch and the peer
alternate round by round); in-run events from CLOCK_REALTIME stamps the workers write.
"""
import argparse
import datetime
import json
import os
import platform
import queue
import re
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICK = os.environ.get("BENCH_QUICK", "") not in ("", "0")
# BENCH_SMOKE=1 (the ctest): as quick, with the smallest sizes that still run every path.
SMOKE = os.environ.get("BENCH_SMOKE", "") not in ("", "0")
QUICK = QUICK or SMOKE


def size(full, quick, smoke):
    return smoke if SMOKE else quick if QUICK else full
NO_PEER = os.environ.get("BENCH_NO_PEER", "") not in ("", "0")
PEER_MAX_AGENTS = int(os.environ.get("BENCH_PEER_MAX_AGENTS", "8"))
DEVNULL = subprocess.DEVNULL
PY = "/usr/bin/python3"  # Debian's python3-torch lives there


def log(msg):
    print(f"bench: {msg}", file=sys.stderr, flush=True)


def stats(samples):
    s = sorted(samples)
    return {"samples": s, "min": s[0], "median": statistics.median(s), "max": s[-1]} if s else None


def row(param, ours, peer=None, unit="ms", better="lower", target=None, note=None, extra=None):
    """One result row: ours/peer are sample lists; ratio = how many times better ours is."""
    r = {"param": param, "unit": unit, "better": better, "ours": stats(ours), "peer": stats(peer) if peer else None}
    if r["ours"] and r["peer"] and r["ours"]["median"] and r["peer"]["median"]:
        a, b = r["ours"]["median"], r["peer"]["median"]
        r["ratio"] = b / a if better == "lower" else a / b
    else:
        r["ratio"] = None
    if target:
        op, value = target
        m = r["ours"]["median"] if r["ours"] else None
        r["target"] = {"op": op, "value": value,
                       "met": m is not None and (m <= value if op == "<=" else m >= value)}
    if note:
        r["note"] = note
    if extra:
        r.update(extra)
    return r


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def peak_kib(pid, field="VmHWM:"):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


class Bench:
    def __init__(self, build):
        self.build = os.path.abspath(build)
        self.bin = os.path.join(self.build, "bin")
        self.ours = [os.path.join(self.bin, "mglaunch")]
        self.fake = os.path.join(self.bin, "fake_worker")
        self.peer, self.peer_note = (None, "BENCH_NO_PEER set") if NO_PEER else self.find_peer()
        self.tmp = tempfile.mkdtemp(prefix="mgbench_")

    # ---- the peer -------------------------------------------------------------------------
    def find_peer(self):
        cands = []
        if os.environ.get("TORCHRUN"):
            cands.append(("$TORCHRUN", shlex.split(os.environ["TORCHRUN"])))
        if shutil.which("torchrun"):
            cands.append(("torchrun on PATH", [shutil.which("torchrun")]))
        shared = os.path.normpath(os.path.join(ROOT, "..", "shared", "peers", "torchrun"))
        if os.path.exists(shared):
            cands.append(("../shared/peers/torchrun", [PY, shared]))
        notes = []
        for name, cmd in cands:
            cmd = cmd + ["--monitor_interval=0.1"]
            # The relay case needs --tee: Debian's stock torchrun (Python 3.11) cannot parse it.
            probe = subprocess.run(cmd + ["--standalone", "--nproc_per_node=1", "--tee", "3", "--no_python", "/bin/true"],
                                   stdout=DEVNULL, stderr=subprocess.PIPE, text=True, timeout=300)
            if probe.returncode == 0:
                # Recorded as a checkout has it, not as this machine's absolute path.
                shown = " ".join("../shared/peers/torchrun" if c == shared else c for c in cmd)
                return cmd, "; ".join(notes + [f"peer: {name} ({shown})"])
            last = (probe.stderr.strip().splitlines() or ["?"])[-1][:160]
            notes.append(f"{name} skipped: `--tee 3` run failed ({last})")
        return None, "; ".join(notes) or "no torchrun found ($TORCHRUN, PATH, ../shared/peers/torchrun)"

    def peer_shown(self):
        """The peer's command as a checkout has it: ../shared/peers/torchrun, not this machine's path."""
        if not self.peer:
            return None
        shared = os.path.normpath(os.path.join(ROOT, "..", "shared", "peers", "torchrun"))
        return " ".join("../shared/peers/torchrun" if c == shared else c for c in self.peer)

    # ---- helpers ------------------------------------------------------------------------------
    def hyperfine(self, cmd, warmup, runs, output="null"):
        """Seconds of each timed run of `cmd` (a list), warm-up runs discarded."""
        out = os.path.join(self.tmp, "hf.json")
        subprocess.run(["hyperfine", "-N", "--style", "none", "--warmup", str(warmup), "--runs", str(runs),
                        "--output", output, "--export-json", out, shlex.join(cmd)],
                       stdout=DEVNULL, check=True, timeout=3600)
        with open(out) as f:
            r = json.load(f)["results"][0]
        self.last_cpu_ms = (r["user"] + r["system"]) * 1e3  # mean CPU of one run, children included
        return r["times"]

    def alternate(self, ours_cmd, peer_cmd, rounds, ours_runs, peer_runs, warmup=2, peer_warmup=1, output="null"):
        """Rounds of hyperfine, mglaunch then the peer: ms samples of each."""
        a, b = [], []
        self.cpu = ([], [])
        for _ in range(rounds):
            a += [t * 1e3 for t in self.hyperfine(ours_cmd, warmup, ours_runs, output)]
            self.cpu[0].append(self.last_cpu_ms)
            if peer_cmd:
                b += [t * 1e3 for t in self.hyperfine(peer_cmd, peer_warmup, peer_runs, output)]
                self.cpu[1].append(self.last_cpu_ms)
        return a, b

    # ---- (1) launch -> exit -------------------------------------------------------------------
    def launch_exit(self):
        rows = []
        for n in size([1, 4, 16, 64], [1, 4, 16, 64], [1, 4]):
            args = ["--standalone", f"--nproc_per_node={n}", "--no_python", "/bin/true"]
            ours, peer = self.alternate(self.ours + args, self.peer + args if self.peer else None,
                                        rounds=1 if QUICK else 3, ours_runs=1 if QUICK else 10,
                                        peer_runs=1 if QUICK else 2, warmup=0 if QUICK else 3,
                                        peer_warmup=0 if QUICK else 1)
            # CPU time (user + system of the launcher and its workers) does not wait for a
            # busy machine's scheduler: the load-independent figure beside the wall time.
            rows.append(row({"N": n}, ours, peer, target=("<=", 8.0) if n == 4 else None,
                            extra={"cpu_ms": {"ours": statistics.median(self.cpu[0]),
                                              "peer": statistics.median(self.cpu[1]) if self.cpu[1] else None}}))
        return {"title": "launch → exit, `--standalone --nproc_per_node=N --no_python /bin/true` (hyperfine)",
                "param": "N", "rows": rows}

    # ---- (2) agent peak RSS ---------------------------------------------------------------------
    def rss_once(self, cmd):
        p = subprocess.Popen(cmd + ["--standalone", "--nproc_per_node=4", "--no_python", self.fake, "hang", "1.5"],
                             stdout=DEVNULL, stderr=DEVNULL)
        peak, anon, deadline = 0, 0, time.time() + 120
        while p.poll() is None and time.time() < deadline:
            peak = max(peak, peak_kib(p.pid))
            anon = max(anon, peak_kib(p.pid, "RssAnon:"))
            time.sleep(0.05)
        p.wait(timeout=120)
        self.anon.append(anon / 1024)
        return peak / 1024

    def agent_rss(self):
        n = 1 if QUICK else 3
        self.anon = []
        ours = [self.rss_once(self.ours) for _ in range(n)]
        ours_anon = self.anon
        self.anon = []
        peer = [self.rss_once(self.peer) for _ in range(1 if QUICK else 2)] if self.peer else None
        return {"title": "agent peak RSS (VmHWM of the agent process) while 4 workers run", "param": "",
                "rows": [row({"what": "VmHWM (shared library pages included)"}, ours, peer, unit="MiB",
                             target=("<=", 8.0)),
                         row({"what": "private memory (largest RssAnon seen)"}, ours_anon, self.anon or None,
                             unit="MiB")]}

    # ---- (3) restart ----------------------------------------------------------------------------
    def restart_once(self, cmd):
        stamps = os.path.join(self.tmp, "restart_stamps")
        if os.path.exists(stamps):
            os.unlink(stamps)
        worker = [self.fake, "stamp", stamps, "start", "when-restart-below", "1", "when-rank", "0",
                  "stamp", stamps, "fail", "exit", "1"]
        subprocess.run(cmd + ["--standalone", "--nproc_per_node=4", "--max_restarts=1", "--no_python"] + worker,
                       stdout=DEVNULL, stderr=DEVNULL, check=True, timeout=300)
        rows = [line.split() for line in open(stamps)]
        fail = min(int(r[3]) for r in rows if r[0] == "fail")
        started = [int(r[3]) for r in rows if r[0] == "start" and r[1] == "1"]
        assert len(started) == 4, rows
        return (max(started) - fail) / 1e6

    def restart(self):
        ours = [self.restart_once(self.ours) for _ in range(1 if QUICK else 10)]
        peer = [self.restart_once(self.peer) for _ in range(1 if QUICK else 3)] if self.peer else None
        return {"title": "a worker fails → all 4 workers of the next attempt started (worker stamps)", "param": "",
                "rows": [row({}, ours, peer, target=("<=", 10.0))]}

    # ---- (4) K agents on loopback -----------------------------------------------------------------
    def agents_once(self, cmd, k, local_addr):
        stamps = os.path.join(self.tmp, f"agents_{k}")
        if os.path.exists(stamps):
            os.unlink(stamps)
        port = free_port()

        def argv(i):
            # torch 1.13's torchrun has no --local_addr: its agents all advertise this host.
            addr = [f"--local_addr=127.0.0.{i + 1}"] if local_addr else []
            return cmd + [f"--nnodes={k}", "--nproc_per_node=1", "--rdzv_backend=c10d",
                          f"--rdzv_endpoint=127.0.0.1:{port}", f"--rdzv_id=bench{port}"] + addr + \
                ["--no_python", self.fake, "stamp", stamps, "start"]
        # The nodes of a cluster start their agents at about the same time, not one after
        # another from one Python loop (whose spawn cost grows with K and is not the
        # launchers'): every agent waits behind a gate (a shell reading the pipe on its stdin),
        # and the clock starts when the gate opens (the pipe's write end closes).
        gate_r, gate_w = os.pipe()
        procs = [subprocess.Popen(["sh", "-c", 'read _; exec "$@" </dev/null', "gate"] + argv(i), stdin=gate_r,
                                  stdout=DEVNULL, stderr=DEVNULL) for i in range(k)]
        os.close(gate_r)
        wait_reading_stdin([p.pid for p in procs])
        t0 = time.time_ns()
        os.close(gate_w)
        codes = [p.wait(timeout=600) for p in procs]
        assert codes == [0] * k, codes
        started = [int(line.split()[3]) for line in open(stamps)]
        assert len(started) == k, started
        return (max(started) - t0) / 1e6

    def rdzv_agents(self):
        rows = []
        for k in size([2, 8, 32, 64], [2, 8, 32, 64], [2, 4]):
            ours = [self.agents_once(self.ours, k, True) for _ in range(1 if QUICK else 5)]
            peer = None
            if self.peer and k <= PEER_MAX_AGENTS:
                peer = [self.agents_once(self.peer, k, False) for _ in range(1 if QUICK else 2)]
            rows.append(row({"K": k}, ours, peer, target=("<=", 150.0) if k == 64 else None,
                            note=None if peer or not self.peer else f"torchrun not run above {PEER_MAX_AGENTS} agents"))
        return {"title": "K agents on 127.0.0.1..K × 1 worker, c10d: all agents let go at once (as K nodes "
                         "starting together) → all workers started (worker stamps)", "param": "K", "rows": rows}

    # ---- (4b) --preflight (issue #26) ------------------------------------------------------------
    def preflight_once(self, k, flags):
        """K agents on 127.0.0.2.. through mglaunch-rdzv, let go at once (as agents_once):
        (gate -> every worker started in ms, the slowest node's `preflight passed in S s`)."""
        stamps = os.path.join(self.tmp, f"preflight_{k}")
        if os.path.exists(stamps):
            os.unlink(stamps)
        d = subprocess.Popen([os.path.join(self.bin, "mglaunch-rdzv"), "--listen", "127.0.0.1:0"],
                             stdout=subprocess.PIPE, stderr=DEVNULL, text=True)
        try:
            endpoint = d.stdout.readline().split()[-1]
            outs = [os.path.join(self.tmp, f"preflight_{k}_{i}.out") for i in range(k)]
            job = f"pf{d.pid}_{time.time_ns()}"
            gate_r, gate_w = os.pipe()
            procs = [subprocess.Popen(["sh", "-c", 'read _; exec "$@" </dev/null', "gate"] + self.ours +
                                      [f"--nnodes={k}", "--nproc_per_node=1", "--rdzv_backend=c10d",
                                       f"--rdzv_endpoint={endpoint}", f"--rdzv_id={job}",
                                       f"--local_addr=127.0.0.{i + 2}"] + flags +
                                      ["--no_python", self.fake, "stamp", stamps, "start"],
                                      stdin=gate_r, stdout=open(outs[i], "w"), stderr=subprocess.STDOUT)
                     for i in range(k)]
            os.close(gate_r)
            wait_reading_stdin([p.pid for p in procs])
            t0 = time.time_ns()
            os.close(gate_w)
            codes = [p.wait(timeout=600) for p in procs]
            assert codes == [0] * k, codes
            started = [int(line.split()[3]) for line in open(stamps)]
            assert len(started) == k, started
            checks = []
            for o in outs:
                for line in open(o):
                    if "preflight passed in " in line:
                        checks.append(float(line.split("preflight passed in ")[1].split()[0]) * 1e3)
            assert not flags or len(checks) == k, open(outs[0]).read()[-500:]
            return (max(started) - t0) / 1e6, max(checks) if checks else None
        finally:
            d.send_signal(signal.SIGTERM)
            d.wait(timeout=60)

    def preflight(self):
        k = 8
        runs = 1 if QUICK else 5
        with_check = [self.preflight_once(k, ["--preflight"]) for _ in range(runs)]
        without = [self.preflight_once(k, [])[0] for _ in range(runs)]
        return {"title": "--preflight: 8 agents on 127.0.0.2-9 through mglaunch-rdzv, all let go at once "
                         "(all-reduce of 256 KiB, 3 rounds of 4 MiB point-to-point per node)", "param": "",
                "rows": [row({"what": "the check itself (slowest node's `preflight passed in`)"},
                             [c for _, c in with_check], target=("<=", 3000.0)),
                         row({"what": "gate → all 8 workers started, with --preflight"}, [t for t, _ in with_check]),
                         row({"what": "gate → all 8 workers started, without"}, without)]}

    # ---- (5) the daemon alone -------------------------------------------------------------------
    def daemon_scale(self):
        rows = []
        for n in size([1000, 10000], [1000, 10000], [100]):
            d = subprocess.Popen([os.path.join(self.bin, "mglaunch-rdzv"), "--listen", "127.0.0.1:0",
                                  "--max-connections-per-address", "100000"], stdout=subprocess.PIPE, stderr=DEVNULL,
                                 text=True)
            try:
                endpoint = d.stdout.readline().split()[-1]
                base = peak_kib(d.pid)
                times, errors = [], []
                for run in range(2):  # the second run against the same daemon must work too
                    r = subprocess.run([os.path.join(self.bin, "rdzv_scale"), endpoint, str(n), f"scale{run}"],
                                       capture_output=True, text=True, timeout=600)
                    if r.returncode != 0:
                        errors.append(f"run {run + 1}: {r.stdout.strip()} {r.stderr.strip()}"[:300])
                    else:
                        times.append(float(r.stdout.split()[-2]) * 1e3)
                per_agent = (peak_kib(d.pid) - base) / n
            finally:
                d.send_signal(signal.SIGTERM)
                d.wait(timeout=60)
            rows.append(row({"agents": n, "what": "time (two runs, one daemon)"}, times,
                            target=("<=", 1000.0) if n == 10000 else None,
                            note="; ".join(errors) if errors else None, extra={"runs_ok": len(times)}))
            # (peak - the daemon's own start-up peak) / n: at 1,000 the daemon's fixed memory dominates.
            rows.append(row({"agents": n, "what": "daemon peak memory per agent"}, [per_agent], unit="KiB",
                            target=("<=", 2.0) if n == 10000 else None))
        n = size(100000, 100000, 1000)
        out = subprocess.run([os.path.join(self.bin, "rdzv_job_bench"), str(n)], capture_output=True, text=True,
                             timeout=600, check=True).stdout
        rows.append(row({"agents": n, "what": "in-process job state machine (rdzv_job_bench)"},
                        [float(out.split()[-2]) * 1e3], target=("<=", 10000.0)))
        return {"title": "the daemon alone: simulated agents over real sockets (rdzv_scale) join one job", "param": "",
                "rows": rows}

    # ---- (5b) the agent's store against torch's TCPStore server ----------------------------------
    def store(self):
        """N simulated clients (bench/store_bench.cc, one event loop) do init_process_group's
        store traffic (add, set, wait, get, a barrier) against our store server (store/, its own
        process) and against torch's classic TCPStore server (a Python process holding a
        TCPStore(is_master=True)), speaking torch 1.x's dialect to both; per client memory is
        the server's (peak - its idle peak) / N."""
        sb = os.path.join(self.bin, "store_bench")
        torch_server = os.path.join(ROOT, "bench", "torch_store_server.py")

        def serve(argv):
            p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=DEVNULL, text=True)
            port = int(p.stdout.readline().split()[-1])
            return p, port, peak_kib(p.pid)

        def run_clients(port, n, dialect):
            r = subprocess.run([sb, "clients", str(port), str(n), str(dialect)], capture_output=True, text=True,
                               timeout=300)
            out = json.loads(r.stdout) if r.stdout.strip() else {}
            return (out["seconds"] * 1e3 if r.returncode == 0 else None), out

        rows = []
        for n in size([1000, 10000], [1000, 10000], [100]):
            ours, peer, mem, notes = [], [], [], []
            for _ in range(size(3, 1, 1)):
                for argv, times, who in ([sb, "serve"], ours, "ours"), ([PY, torch_server], peer, "torch's server"):
                    if NO_PEER and times is peer:
                        continue
                    p, port, base = serve(argv)
                    try:
                        ms, out = run_clients(port, n, 1)
                        if ms is None:
                            notes.append(f"{who}: {out.get('done', 0)} of {n} clients done in 120 s")
                        else:
                            times.append(ms)
                            if times is ours:
                                mem.append((peak_kib(p.pid) - base) * 1024 / n)
                    finally:
                        p.stdin.close()
                        p.wait(timeout=60)
            rows.append(row({"clients": n, "what": "init_process_group's store traffic"}, ours, peer or None,
                            target=("<=", 1000.0) if n == 10000 else None,
                            note="; ".join(sorted(set(notes))) if notes else None))
            rows.append(row({"clients": n, "what": "store server memory per client"}, mem, unit="B",
                            target=("<=", 2048.0) if n == 10000 else None))
        n = size(100000, 100000, 1000)
        out = json.loads(subprocess.run([sb, "inprocess", str(n)], capture_output=True, text=True, timeout=600,
                                        check=True).stdout)
        rows.append(row({"clients": n, "what": "in-process: parser and engine alone"}, [out["seconds"] * 1e3],
                        target=("<=", 10000.0)))
        return {"title": "the agent's store (store/) against torch's TCPStore server", "param": "", "rows": rows}

    # ---- (6) log relay ---------------------------------------------------------------------------
    def relay(self):
        """(6) 4 workers x N lines: mglaunch relaying them with prefixes into a pipe, vs the
        same 4 workers (same program, same lines, same 64 KiB stdio buffer) writing straight
        to /dev/null: the limit does strictly less (no pipes, no prefixes, no agent start or
        exit), so the ratio is a lower bound of our share. hyperfine --output=pipe drains our
        stdout with splice(2) to /dev/null, the cheapest reader there is. Our runs and the
        limit's take turns (one of each per round, 5 rounds), so a change in the machine's load
        falls on both; torchrun's runs come after."""
        lines = size(1000000, 100000, 10000)
        total = 4 * lines
        worker = [self.fake, "lines", str(lines)]
        args = ["--standalone", "--nproc_per_node=4", "--no_python"] + worker
        # The check: one run into a file, every line prefixed, none lost, none mixed.
        out = os.path.join(self.tmp, "relay.out")
        with open(out, "wb") as f:
            subprocess.run(self.ours + args, stdout=f, stderr=DEVNULL, check=True, timeout=600)
        check = check_relay(out, 4, lines)
        os.unlink(out)
        sh = " ".join(f"RANK={r} {shlex.quote(self.fake)} lines {lines} >/dev/null &" for r in range(4)) + " wait"
        ours_ms, limit_ms = self.alternate(self.ours + args, ["sh", "-c", sh], rounds=1 if QUICK else 5, ours_runs=1,
                                           peer_runs=1, warmup=0 if QUICK else 1, peer_warmup=0 if QUICK else 1,
                                           output="pipe")
        ours = [total / (t / 1e3) for t in ours_ms]
        limit = [total / (t / 1e3) for t in limit_ms]
        peer = None
        if self.peer:
            peer = [total / (t / 1e3) for t in
                    self.alternate(self.peer + ["--tee", "3"] + args, None, 1, 1 if QUICK else 2, 0, 0 if QUICK else 1,
                                  "pipe")[0]]
        rows = [row({"what": "mglaunch vs torchrun --tee 3"}, ours, peer, unit="lines/s", better="higher",
                    extra={"check": check}),
                row({"what": "mglaunch vs workers straight to /dev/null (the limit)"}, ours, limit, unit="lines/s",
                    better="higher")]
        if rows[0]["ratio"] is not None:
            rows[0]["target"] = {"op": ">=", "value": 10.0, "on": "ratio", "met": rows[0]["ratio"] >= 10.0}
        if rows[1]["ratio"] is not None:
            rows[1]["target"] = {"op": ">=", "value": 0.5, "on": "ratio", "met": rows[1]["ratio"] >= 0.5}
        return {"title": f"log relay: 4 workers × {lines:,} lines each to a pipe, lines/s with `[rankN]:` prefixes",
                "param": "", "rows": rows}

    # ---- (7) all-reduce -----------------------------------------------------------------------
    def allreduce(self):
        """mgtrain --bench allreduce vs bench/allreduce_loop.py: the same Gloo under both, so
        the time ratio is our overhead. Both programs do the same per size: a tensor of ones,
        WARMUP untimed all-reduces, a barrier, ITERS timed ones (mean time), a check. Read
        line by line, neither does extra work in the timed loop (no allocation, copy or
        synchronisation beyond the all-reduce's wait; Gloo's 2 threads per group in both;
        OMP_NUM_THREADS=1 from the launcher in both).

        The noise is the machine's: 4 ranks x (1 + 2 Gloo threads) on 2 cores swing one
        run's mean by tens of percent either way. So the sizes the target is about (>= 1 MiB)
        get their own sweep with more iterations (ITERS_LARGE) and more runs (ROUNDS_LARGE),
        and the overhead is median(mgtrain times) / median(Python times) - 1 over runs that
        interleave the two programs, the first of each pair alternating (ABBA), so drift in
        the machine's load falls on both alike. Each pair's own ratio is kept in the
        results too (`pair_overheads`). The smaller sizes keep one sweep of 3 rounds x 20."""
        mgtrain = os.path.join(self.bin, "mgtrain")
        if not os.path.exists(mgtrain):
            return {"skipped": "mgtrain not built (no LibTorch)"}
        rounds_large = size(5, 1, 1)
        iters_large = size(200, 2, 2)
        sweeps = [  # (arguments, rounds); QUICK: one sweep, every size once
            (["--min-bytes", "4K", "--max-bytes", "1M" if QUICK else "256K", "--step-factor", "4",
              "--iters", "2" if QUICK else "20", "--warmup", "1" if QUICK else "5"], 1 if QUICK else 3)]
        if not QUICK:
            sweeps.append((["--min-bytes", "1M", "--max-bytes", "16M", "--step-factor", "4", "--iters", str(iters_large),
                            "--warmup", "5"], rounds_large))
        rows = []
        for world in (2, 4):
            launch = self.ours + ["--standalone", f"--nproc_per_node={world}"]
            ours_t, py_t = {}, {}
            for args, rounds in sweeps:
                progs = [(launch + [mgtrain, "--bench", "allreduce"] + args, ours_t),
                         (launch + ["--no_python", PY, os.path.join(ROOT, "bench", "allreduce_loop.py")] + args, py_t)]
                for rnd in range(rounds):
                    for cmd, into in (progs if rnd % 2 == 0 else progs[::-1]):
                        r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
                        if r.returncode != 0:
                            raise RuntimeError(f"{' '.join(cmd)} failed: {r.stderr[-500:]}")
                        for size_b, us, busbw in parse_allreduce(r.stdout):
                            into.setdefault(size_b, []).append((us, busbw))
            for size_b in sorted(ours_t):
                bus = lambda v: [b for _, b in v]
                r = row({"world": world, "bytes": size_b}, bus(ours_t[size_b]), bus(py_t.get(size_b, [])), unit="GB/s",
                        better="higher")
                o, p = [u for u, _ in ours_t[size_b]], [u for u, _ in py_t[size_b]]
                r["overhead"] = statistics.median(o) / statistics.median(p) - 1.0  # time per all-reduce
                r["pair_overheads"] = [a / b - 1.0 for a, b in zip(o, p)]  # run i of mgtrain vs run i of Python
                if size_b >= 1 << 20:
                    r["target"] = {"op": "<=", "value": 0.05, "on": "overhead", "met": r["overhead"] <= 0.05}
                rows.append(r)
        method = ("medians of 3 alternating runs of 20 timed all-reduces each below 1 MiB, of "
                  f"{rounds_large} alternating runs (ABBA) of {iters_large} from 1 MiB on" if not QUICK else
                  "one run of each, 2 timed all-reduces per size (quick)")
        return {"title": "Gloo all-reduce bus bandwidth: `mgtrain --bench allreduce` vs a Python "
                         "`torch.distributed.all_reduce` loop (bench/allreduce_loop.py), both under mglaunch",
                "param": "world, bytes", "method": method, "rows": rows}

    # ---- (8) training -----------------------------------------------------------------------------
    def training(self):
        if not os.path.exists(os.path.join(self.bin, "mgtrain")):
            return {"skipped": "mgtrain not built (no LibTorch)"}
        env = dict(os.environ, NPROCS="1 2", SEEDS="1" if QUICK else os.environ.get("BENCH_TRAIN_SEEDS", "1 2 3"))
        if QUICK:
            env["EXTRA"] = "--train-subset 2000 --test-subset 1000"
        r = subprocess.run([os.path.join(ROOT, "bench", "train_bench.sh"), self.build], capture_output=True, text=True,
                           env=env, timeout=7200)
        if r.returncode != 0:
            return {"skipped": f"bench/train_bench.sh failed: {r.stderr.strip()[-300:]}"}
        return {"title": "training: mgtrain vs the Python twin (bench/train_bench.sh), Fashion-MNIST CNN, gloo on CPU",
                "text": r.stdout, "rows": parse_train(r.stdout)}

    # ---- (9) rendezvous backends (bench/rdzv_backends.py, when present) ---------------------------
    def backends(self):
        script = os.path.join(ROOT, "bench", "rdzv_backends.py")
        if not os.path.exists(script):
            return {"skipped": "bench/rdzv_backends.py not present"}
        r = subprocess.run([PY, script, self.build, "1" if QUICK else "3"], capture_output=True, text=True, timeout=3600,
                           env=dict(os.environ, BENCH_QUICK="1" if QUICK else "0"))
        if r.returncode != 0:
            return {"skipped": f"bench/rdzv_backends.py failed: {r.stderr.strip()[-300:]}"}
        return {"title": "rendezvous backends, 8 agents (bench/rdzv_backends.py)", "text": r.stdout}

    # ---- (10) a hung node ------------------------------------------------------------------------
    def hung(self):
        port = free_port()
        agents = [subprocess.Popen(self.ours + ["--nnodes=3", "--nproc_per_node=1", "--rdzv_backend=c10d",
                                                f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=hung",
                                                "--rdzv_conf=keep_alive_interval=1,keep_alive_max_attempt=3",
                                                f"--local_addr=127.0.0.{i + 1}", "--no_python", "sleep", "60"],
                                   stdout=DEVNULL, stderr=DEVNULL) for i in range(3)]
        try:
            time.sleep(2)  # round formed, workers sleeping
            t0 = time.perf_counter()
            agents[2].send_signal(signal.SIGSTOP)
            for a in agents[:2]:
                a.wait(timeout=60)
            elapsed = time.perf_counter() - t0
        finally:
            for a in agents:
                if a.poll() is None:
                    a.kill()
                    a.wait()
        return {"title": "a SIGSTOPped node → the survivors told and exited (keep-alive 1 s × 3; bound 4 s)",
                "param": "", "rows": [row({}, [elapsed * 1e3], note="torchrun 1.13 never detects it")]}

    # ---- (11) one node SIGKILLed mid-training: torchrun's restart vs in-place recovery -------------
    def recovery(self):
        """Two nodes (one worker each) on loopback, CPU/Gloo; node 1 (its agent and its worker)
        SIGKILLed by pid at step KILL_AT or later, read from rank 0's progress lines.
        torchrun: bench/ddp_checkpoint_train.py (seed style: checkpoint every CKPT_EVERY
        steps, restart all, reload); torchrun has no standby, so a replacement agent starts
        the moment node 1 is killed. mglaunch: mgtrain --in-place-recovery through
        mglaunch-rdzv, with a third agent as a standby when this build has standbys (else a
        replacement started at the kill, as for torchrun). Both measured the same way from
        the outside: bench.py stamps every line of rank 0 as it reads it."""
        mgtrain = os.path.join(self.bin, "mgtrain")
        if not os.path.exists(mgtrain):
            return {"skipped": "mgtrain not built (no LibTorch)"}
        with open(self.ours[0], "rb") as f:
            binary = f.read()
        standby = b"standby for job" in binary
        # The standby's mgtrain started ahead, loaded and waiting when the place comes (#26).
        prestart = standby and b"--prestart-standby" in binary
        n = size(3, 1, 1)
        ours = [self.recovery_once("ours", mgtrain, standby, prestart) for _ in range(n)]
        peer = [self.recovery_once("peer", None, False) for _ in range(n)] if self.peer else []
        # What a new node's worker costs before it can join: a fresh mgtrain process loading LibTorch.
        starts = []
        for _ in range(3):
            t0 = time.monotonic()
            subprocess.run([mgtrain, "--help"], stdout=DEVNULL, stderr=DEVNULL, timeout=120)
            starts.append((time.monotonic() - t0) * 1e3)
        how = ("a standby (a third agent, beyond --nnodes=2) takes node 1's place"
               + (" with its mgtrain pre-started (`--prestart-standby`: loaded and waiting before the kill)"
                  if prestart else "") if standby else
               "this build has no standbys: a replacement agent starts at the kill, as for torchrun")
        rows, lines = recovery_rows(ours, peer, "mgtrain", 1000.0)
        lines += ["", f"Both sides: 2 nodes × 1 worker, `--nnodes=2 --rdzv_backend=c10d`, OMP_NUM_THREADS=1, "
                  f"the same MLP (784-256-128-10) on synthetic data, batch 16 per rank, {RECOVERY_STEPS} steps; the "
                  f"kill hits node 1's agent and its worker (a node lost) at the first progress line of step ≥ "
                  f"{KILL_AT}. torchrun (`--max_restarts=3`, a separate torch TCPStore as its c10d store, "
                  f"`is_host=false`; torch 1.13's torchrun has no `--local_addr`) runs bench/ddp_checkpoint_train.py, "
                  f"checkpointing every {CKPT_EVERY} steps; it has no standby, so **a replacement agent is started the "
                  f"moment node 1 is killed (the node comes back at once)**. mglaunch (`--local_addr=127.0.0.2/.3`, "
                  f"mglaunch-rdzv, `--max_restarts=3`) runs `mgtrain --in-place-recovery`: {how}. First step after "
                  "the kill: the first progress line after the restarted rank 0's `resumed from` line (torchrun) or "
                  "after mgtrain's `in-place recovery ... redoing step K` line (mglaunch); lines still in flight "
                  "from before the failure count as steps reached. Kill → new round: until a surviving mglaunch agent "
                  "prints the new round's assignment (`[mglaunch] round N:`), the launcher's part; torch 1.13's "
                  "torchrun logs no such line. Between the new round and the `redoing step` line, mgtrain's survivor "
                  "waits for the new node's worker: a fresh process that loads LibTorch (`mgtrain --help` alone took "
                  f"{statistics.median(starts):.0f} ms here, median of 3, measured in this run), joins the new group "
                  "and receives the state."]
        return {"title": "one node SIGKILLed mid-training → training goes on: torchrun (restart all, checkpoint "
                         "reload) vs mglaunch + `mgtrain --in-place-recovery`", "param": "", "rows": rows,
                "standby": standby, "runs": {"ours": ours, "peer": peer}, "mgtrain_help_ms": starts,
                "text": "\n".join(lines)}

    def py_recovery(self):
        """recovery() with a plain PyTorch DDP script on mglaunch's side (#37):
        examples/ddp_recovery.py with mglaunch_recovery, a standby whose worker is pre-started
        (`--prestart-standby`), against the same torchrun restart plus checkpoint reload of
        bench/ddp_checkpoint_train.py. Both the MLP 784-256-128-10, batch 16 per rank."""
        with open(self.ours[0], "rb") as f:
            if b"--prestart-standby" not in f.read():
                return {"skipped": "this mglaunch has no --prestart-standby"}
        n = size(3, 1, 1)
        ours = [self.recovery_once("ours", None, True, True, python=True, steps=PY_RECOVERY_STEPS) for _ in range(n)]
        peer = [self.recovery_once("peer", None, False, steps=PY_RECOVERY_STEPS) for _ in range(n)] if self.peer else []
        rows, lines = recovery_rows(ours, peer, "mglaunch_recovery", 2000.0)
        lines += ["", f"As the `recovery` case (2 nodes × 1 worker on loopback, OMP_NUM_THREADS=1, node 1's agent and "
                  f"worker SIGKILLed at the first progress line of step ≥ {KILL_AT}, {PY_RECOVERY_STEPS} steps), with a "
                  "plain PyTorch DDP script on both sides. mglaunch (mglaunch-rdzv, a third agent as a standby with "
                  "`--prestart-standby`) runs examples/ddp_recovery.py `--model mlp --batch-size 16 --step-ms 10` "
                  "(Fashion-MNIST, the seed's MLP; a 10 ms sleep per step so that the standby's worker is loaded "
                  "before the kill) with mglaunch_recovery: the survivor keeps its process and state, the standby's "
                  "pre-started worker takes the place and the state. torchrun runs bench/ddp_checkpoint_train.py "
                  f"(the same MLP on synthetic data), checkpointing every {CKPT_EVERY} steps, a replacement agent "
                  "started the moment node 1 is killed. First step after the kill: the first progress line after "
                  "`mglaunch_recovery: in-place recovery ... redoing step K` (mglaunch) or after the restarted rank "
                  "0's `resumed from` line (torchrun)."]
        return {"title": "one node SIGKILLed mid-training, a plain PyTorch DDP script → training goes on: torchrun "
                         "(restart all, checkpoint reload) vs mglaunch + a pre-started standby + mglaunch_recovery",
                "param": "", "rows": rows, "standby": True, "runs": {"ours": ours, "peer": peer},
                "text": "\n".join(lines)}

    def recovery_once(self, side, mgtrain, standby, prestart=False, python=False, steps=None):
        """One run: returns the figures of this fault (see recovery()); `python`: ours runs
        examples/ddp_recovery.py with mglaunch_recovery instead of mgtrain (py_recovery())."""
        steps = steps or RECOVERY_STEPS
        tmp = tempfile.mkdtemp(prefix=f"recovery_{side}_", dir=self.tmp)
        env = dict(os.environ, OMP_NUM_THREADS="1")
        env.pop("PET_MASTER_PORT", None)
        events = queue.Queue()
        procs = []  # [(name, Popen)]

        def start(name, argv, stdin=DEVNULL):
            p = subprocess.Popen(argv, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
            procs.append((name, p))
            for stream, pipe in (("out", p.stdout), ("err", p.stderr)):
                threading.Thread(target=read_lines, args=(pipe, name, stream, events), daemon=True).start()
            return p
        try:
            if side == "ours":
                d = subprocess.Popen([os.path.join(self.bin, "mglaunch-rdzv"), "--listen", "127.0.0.1:0"],
                                     stdout=subprocess.PIPE, stderr=DEVNULL, text=True)
                procs.append(("daemon", d))
                endpoint = d.stdout.readline().split()[-1]
                if python:
                    train = [f"--python={PY}", os.path.join(ROOT, "examples", "ddp_recovery.py"), "--model", "mlp",
                             "--batch-size", "16", "--train-subset", "4096", "--steps", str(steps), "--seed", "7",
                             "--step-ms", "10", "--timeout", "60", "--summary-json", os.path.join(tmp, "s{rank}.json")]
                else:
                    train = [mgtrain, "--dataset", "synthetic", "--synthetic-size", "4096", "--batch-size", "16",
                             "--model", "mlp", "--max-steps", str(steps), "--seed", "7", "--log-every", "1",
                             "--timeout", "60", "--in-place-recovery", "--summary-json", os.path.join(tmp, "s{rank}.json")]

                def agent(addr, extra=()):
                    return self.ours + ["--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d",
                                        f"--rdzv_endpoint={endpoint}", "--rdzv_id=recovery", "--max_restarts=3",
                                        f"--local_addr=127.0.0.{addr}"] + list(extra) + train
                start("n0", agent(2))
                start("n1", agent(3))
                victim_of = lambda rank0_node: "n1"
                progress = re.compile(r"^\[rank0\]:step (\d+) loss " if python else
                                      r"^\[rank0\]:epoch \d+/\d+ step (\d+)/\d+ loss ")
                marker = re.compile(r"^\[rank0\]:(?:mgtrain|mglaunch_recovery): in-place recovery, .*redoing step (\d+)")
                resumed = lambda m: int(m.group(1)) - 1
            else:
                store = subprocess.Popen([PY, os.path.join(ROOT, "bench", "torch_store_server.py")],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=DEVNULL, text=True)
                procs.append(("store", store))
                port = int(store.stdout.readline().split()[-1])
                train = [os.path.join(ROOT, "bench", "ddp_checkpoint_train.py"), "--checkpoint-dir", tmp,
                         "--checkpoint-every", str(CKPT_EVERY), "--max-steps", str(steps)]

                def agent(addr):  # torch 1.13's torchrun has no --local_addr
                    return self.peer + ["--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d",
                                        f"--rdzv_endpoint=127.0.0.1:{port}", f"--rdzv_id=recovery{port}",
                                        "--rdzv_conf=is_host=false", "--max_restarts=3"] + train
                start("n0", agent(2))
                start("n1", agent(3))
                # c10d gives torchrun's group ranks in its own order: node 1 is the node without rank 0.
                victim_of = lambda rank0_node: "n1" if rank0_node == "n0" else "n0"
                progress = re.compile(r"^epoch \d+/\d+ step (\d+)/\d+ loss ")
                marker = re.compile(r"^(?:resumed from .* at step (\d+)|no checkpoint)")
                resumed = lambda m: int(m.group(1) or 0)
            use_standby = side == "ours" and standby
            deadline = time.monotonic() + 300
            log_lines, killed, t_kill, reached, rank0_node = [], None, None, 0, None
            standby_ready = not use_standby
            prestart_ready = False  # the standby's pre-started mgtrain was loaded at the kill
            after_marker, resumed_from, t_first, first_step, t_round = set(), None, None, None, None
            new_round = re.compile(r"^\[mglaunch\] round (\d+): ")
            while t_first is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RuntimeError(f"{side}: no step after the kill within 300 s; last lines: "
                                       + " / ".join(log_lines[-8:]))
                try:
                    t, name, stream, line = events.get(timeout=min(left, 1.0))
                except queue.Empty:
                    agents = [p for n, p in procs if n not in ("daemon", "store", killed)]
                    if all(p.poll() is not None for p in agents):
                        raise RuntimeError(f"{side}: the agents ended {'after' if killed else 'before'} the kill "
                                           "with no step after it: " + " / ".join(log_lines[-8:]))
                    continue
                log_lines.append(f"{t - t_kill if t_kill else 0:8.3f} {name}/{stream}: {line}"[:300])
                # With --prestart-standby the kill waits for the standby's worker to be loaded.
                if use_standby and name == "n2" and (
                        "standby worker ready" in line if prestart else "standby for job" in line):
                    standby_ready = True
                if stream != "out":
                    if killed and t_round is None and name != killed and new_round.match(line):
                        t_round = t  # the launcher's part is done: the survivors know the new round
                    if prestart and not killed and new_round.match(line) and not any(n == "n2" for n, _ in procs):
                        # The round is full: the standby comes now, so that its pre-started mgtrain
                        # loads while the others do (60 steps take about a second).
                        start("n2", agent(4, ["--prestart-standby"]))
                    continue
                m = progress.match(line)
                if killed is None:
                    if not m:
                        continue
                    step = int(m.group(1))
                    reached, rank0_node = max(reached, step), name
                    if use_standby and not any(n == "n2" for n, _ in procs):
                        start("n2", agent(4, ["--prestart-standby"] if prestart else []))  # the round is full: a standby
                    # (a standby still loading at step RECOVERY_STEPS - 20 is killed for all that)
                    if step >= KILL_AT and (standby_ready or (prestart and step >= steps - 20)):
                        prestart_ready = prestart and standby_ready
                        killed = victim_of(name)
                        victim = next(p for n, p in procs if n == killed)
                        pids = [victim.pid] + descendants(victim.pid)
                        t_kill = time.monotonic()  # the fault begins with the first kill
                        for pid in pids:
                            os.kill(pid, signal.SIGKILL)
                        killed_at = step
                        if not use_standby:
                            start("r1", agent(3))  # the node comes back at once
                    continue
                mk = marker.match(line)
                if mk:
                    after_marker.add(name)
                    resumed_from, t_marker = resumed(mk), t
                elif m and name in after_marker:
                    t_first, first_step = t, int(m.group(1))
                elif m and name != killed:
                    reached = max(reached, int(m.group(1)))  # in flight from before the failure
            codes = {}
            for name, p in procs:
                if name in ("daemon", "store"):
                    continue
                try:
                    codes[name] = p.wait(timeout=max(1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    codes[name] = "hung"
            summary_s = None
            if side == "ours":
                try:
                    with open(os.path.join(tmp, "s0.json")) as f:
                        rec = json.load(f).get("recoveries") or []
                    summary_s = rec[0]["seconds"] if rec else None
                except (OSError, ValueError):
                    pass
            if os.environ.get("BENCH_RECOVERY_LOG"):  # every line read, seconds after the kill
                with open(os.environ["BENCH_RECOVERY_LOG"], "a") as f:
                    f.write("\n".join([f"== {side}"] + log_lines) + "\n")
            return {"killed_at": killed_at, "reached": reached, "resumed_from": resumed_from,
                    "steps_lost": reached - resumed_from, "first_step": first_step,
                    "recovery_ms": (t_first - t_kill) * 1e3, "resumed_ms": (t_marker - t_kill) * 1e3,
                    "round_ms": (t_round - t_kill) * 1e3 if t_round else None,
                    "summary_s": summary_s, "prestarted": prestart_ready,
                    "codes": " ".join(f"{k} {v}" for k, v in codes.items() if k != killed)}
        finally:
            for name, p in procs:
                if p.poll() is None:
                    if name == "store":
                        p.stdin.close()
                    else:
                        p.send_signal(signal.SIGTERM)
            for name, p in procs:
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()


RECOVERY_STEPS, KILL_AT, CKPT_EVERY = 60, 15, 10
PY_RECOVERY_STEPS = 600  # a Python standby takes seconds to load: the kill waits for it (py_recovery)


def recovery_rows(ours, peer, trainer, target_ms):
    """The rows and the per-run table of a recovery case (recovery, py_recovery): `trainer`
    names whose summary gives the `recoveries` figure."""
    ms = lambda runs: [r["recovery_ms"] for r in runs]  # noqa: E731
    lost = lambda runs: [r["steps_lost"] for r in runs]  # noqa: E731
    rows = [row({"what": "SIGKILL of node 1 → first step completed after it (rank 0's progress lines)"},
                ms(ours), ms(peer), target=("<=", target_ms)),
            row({"what": "steps lost (step reached before the kill − step training resumed from)"},
                lost(ours), lost(peer), unit="steps", target=("<=", 0)),
            row({"what": f"{trainer}'s own figure: summary `recoveries` seconds (detection → first step)"},
                [r["summary_s"] * 1e3 for r in ours if r.get("summary_s") is not None])]
    lines = ["| run | launcher | killed at step (reached) | resumed from | steps lost | kill → first step (ms) | "
             f"of which kill → new round (ms) | kill → resumed line (ms) | {trainer} `recoveries` (ms) | pre-started | "
             "exit codes |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for who, runs in (("mglaunch", ours), ("torchrun", peer)):
        for i, r in enumerate(runs, 1):
            s = f"{r['summary_s'] * 1e3:.0f}" if r.get("summary_s") is not None else "–"
            lines.append(f"| {i} | {who} | {r['killed_at']} ({r['reached']}) | {r['resumed_from']} | "
                         f"{r['steps_lost']} | {r['recovery_ms']:.0f} | "
                         f"{'–' if r.get('round_ms') is None else format(r['round_ms'], '.0f')} | "
                         f"{r['resumed_ms']:.0f} | {s} | {'yes' if r.get('prestarted') else 'no'} | {r['codes']} |")
    return rows, lines


def read_lines(pipe, name, stream, events):
    """Every line of `pipe` onto `events`, stamped (CLOCK_MONOTONIC) the moment it is read."""
    for raw in iter(pipe.readline, b""):
        events.put((time.monotonic(), name, stream, raw.decode(errors="replace").rstrip("\n")))
    pipe.close()


def descendants(pid):
    """Every process below `pid` (children first found through /proc's ppid fields)."""
    parent = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    parent[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out += kids
        todo += kids
    return out


def wait_reading_stdin(pids, timeout=60):
    """Until every process in `pids` blocks in read() on its stdin (bounded in time)."""
    deadline = time.time() + timeout
    left = set(pids)
    while left and time.time() < deadline:
        for pid in list(left):
            try:
                with open(f"/proc/{pid}/syscall") as f:
                    if f.read().startswith("0 0x0 "):
                        left.discard(pid)
            except OSError:
                left.discard(pid)  # gone: its wait() will tell
        if left:
            time.sleep(0.005)
    if left:
        raise RuntimeError(f"{len(left)} agents never reached the start gate")


def check_relay(path, ranks, lines):
    """Every line `[rankR]:R:i:payload`, each rank's i = 0..lines-1 in order: none lost or mixed."""
    nxt = [0] * ranks
    bad = 0
    payload = b"abcdefghijklmnopqrstuvwxyz0123456789"
    with open(path, "rb") as f:
        for line in f:
            if not line.startswith(b"[rank"):
                if line.startswith(b"[mglaunch]"):
                    continue
                bad += 1
                continue
            head, _, rest = line.partition(b"]:")
            try:
                r = int(head[5:])
                rr, i, p = rest.rstrip(b"\n").split(b":")
                ok = int(rr) == r and int(i) == nxt[r] and p == payload
            except (ValueError, IndexError):
                ok = False
            if ok:
                nxt[r] += 1
            else:
                bad += 1
    return {"lines_expected": ranks * lines, "lines_ok": sum(nxt), "bad_lines": bad,
            "passed": bad == 0 and nxt == [lines] * ranks}


def parse_allreduce(text):
    for line in text.splitlines():
        f = line.split("]:", 1)[-1].split()
        if len(f) == 7 and f[0].isdigit():
            yield int(f[0]), float(f[3]), float(f[5])


def parse_train(text):
    """Rows from train_bench.sh's tables: per process count, each tool's mean samples/s and accuracy."""
    rows, nproc = [], 2
    header = []
    for line in text.splitlines():
        if line.startswith("###"):
            digits = [int(w) for w in line.split() if w.isdigit()]
            nproc = digits[0] if digits else nproc
        elif line.startswith("| seed"):
            header = [c.strip() for c in line.strip("|").split("|")]
        elif line.startswith("| mean"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            rows.append({"nproc": nproc, "columns": header, "mean": cells})
    return rows


def build_compiler(build):
    """The C++ compiler the build directory was configured with (CMakeCache.txt), else g++."""
    try:
        with open(os.path.join(build, "CMakeCache.txt")) as f:
            for line in f:
                if line.startswith("CMAKE_CXX_COMPILER:"):
                    return line.split("=", 1)[1].strip()
    except OSError:
        pass
    return "g++"


def meta(bench):
    def version(cmd):
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=60).stdout.strip().splitlines()[0]
        except (OSError, IndexError, subprocess.TimeoutExpired):
            return None
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    mem = next((int(l.split()[1]) // 1024 for l in open("/proc/meminfo") if l.startswith("MemTotal")), 0)
    torch_v = version([PY, "-c", "import torch; print(torch.__version__)"])
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{cpu}, {mem // 1024} GiB",
        "kernel": platform.release(),
        "cores": os.cpu_count(),
        "load_at_start": os.getloadavg()[0],
        "quick": QUICK,
        "peer": bench.peer_shown(),
        "peer_note": bench.peer_note,
        "versions": {
            "mglaunch": version(["git", "-C", ROOT, "describe", "--always", "--dirty"]),
            "torch (peer and Python loops)": torch_v,
            "hyperfine": version(["hyperfine", "--version"]),
            "compiler": version([build_compiler(bench.build), "--version"]),
            "python": version([PY, "--version"]),
        },
    }


def merge(res, path):
    """The cases of results `res` into the results file `path`: they replace its cases of the
    same name, each stamped with its own run (date, version, load); its meta and other cases
    stay (render.py names such a case's run)."""
    with open(path) as f:
        into = json.load(f)
    m = res["meta"]
    for name, case in res["cases"].items():
        case["run"] = {"date": m["date"], "mglaunch": m["versions"]["mglaunch"], "quick": m["quick"],
                       "load_at_start": m["load_at_start"], "load_at_end": m["load_at_end"]}
        into["cases"][name] = case
        earlier = into["meta"].get("earlier")
        if earlier and name in earlier.get("cases", []):
            earlier["cases"].remove(name)
    with open(path, "w") as f:
        json.dump(into, f, indent=1)


CASES = ["launch_exit", "agent_rss", "restart", "rdzv_agents", "preflight", "daemon_scale", "store", "relay", "allreduce", "training",
         "backends", "hung", "recovery", "py_recovery"]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("build")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "latest.json"))
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--merge", metavar="FILE",
                   help="also merge the cases of this run into FILE (e.g. bench/results/latest.json): they replace "
                        "FILE's cases of the same name, each stamped with this run's date, version and load; FILE's "
                        "meta and other cases are kept")
    a = p.parse_args()
    b = Bench(a.build)
    log(b.peer_note)
    res = {"meta": meta(b), "cases": {}}
    try:
        for name in a.cases.split(","):
            log(f"{name} ...")
            t0 = time.time()
            try:
                res["cases"][name] = getattr(b, name)()
            except Exception as e:  # one broken case must not lose the others
                res["cases"][name] = {"error": f"{type(e).__name__}: {e}"[:500]}
                log(f"{name} FAILED: {e}")
            log(f"{name} done in {time.time() - t0:.0f} s")
    finally:
        shutil.rmtree(b.tmp, ignore_errors=True)
    res["meta"]["load_at_end"] = os.getloadavg()[0]
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    log(f"wrote {a.out}")
    if a.merge:
        merge(res, a.merge)
        log(f"merged {', '.join(res['cases'])} into {a.merge}")
    return 1 if any("error" in c for c in res["cases"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
