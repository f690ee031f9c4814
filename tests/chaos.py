#!/usr/bin/env python3
"""Chaos soak (issue #26): mgtrain --in-place-recovery trains on 2 active loopback nodes with
standbys, through mglaunch-rdzv (or a 3-member etcd), while faults are injected at random:
SIGKILL and SIGSTOP of workers, agents and the daemon (or etcd members). A node lost for good
is replaced by a fresh agent, which becomes the next standby.

With --netns every node, the daemon and each etcd member run on a host of their own
(tests/support/netns_cluster.py: network namespaces on a bridge), and network faults join
the others (#34): cut-rdzv (the daemon's host, or an etcd member's, cut off a few seconds),
cut-node (an active node cut off past the keep-alive bound, then healed), one-way (an active
node's packets to every host lost), flap (an active node's link down and up every second).

At the end:
  * the job exits 0 and every rank's --summary-json holds the same weights_sha256;
  * no process that carried this run's tag (MGCHAOS_TAG in its environment) is left, and
    the run's TMPDIR is empty;
  * every fault is in the report with the time from the fault to its detection (the first
    agent line about it) and to recovery (the first step completed after it), and the steps
    lost;
  * then a fault that cannot be survived (an active node lost with no standby left): the
    surviving agent must end with a root cause naming the lost node and a non-zero exit
    code within its bound, never hang.

  chaos.py BUILD_DIR --seconds N [--seed S] [--backend daemon|etcd] [--netns] [--step-ms MS] [--report FILE]

Exit codes: 0 every check held; 1 a check failed (each one printed); 77 skipped (mgtrain not
built, etcd missing for --backend etcd, or no network namespaces for --netns: a failure under
CI=true). Every process is started here in its own
session and killed by pid or process group at the end, whatever happened.
"""
import argparse
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "support"))
import skip  # noqa: E402  (tests/support/skip.py: one policy for skipped tests)
import netns_cluster  # noqa: E402  (tests/support/netns_cluster.py: hosts of their own, --netns)
import ports  # noqa: E402  (tests/support/ports.py: ports no parallel test takes)

NPROC = 2            # workers per node
ACTIVE = 2           # --nnodes
STANDBYS = 1         # agents beyond --nnodes kept waiting
# A node silent for 5 s is hung. 0.5 s x 4 (2 s) declared busy nodes hung on this loaded 2-core
# machine, twice in one soak, with nothing stopped (torchrun's default is 5 s x 3).
KEEP_ALIVE_S, KEEP_ALIVE_ATTEMPTS = 1.0, 5
KEEP_ALIVE = f"keep_alive_interval={KEEP_ALIVE_S:g},keep_alive_max_attempt={KEEP_ALIVE_ATTEMPTS}"
HUNG_AFTER = KEEP_ALIVE_S * KEEP_ALIVE_ATTEMPTS
# A SIGSTOPped agent stays stopped past that bound, so the job goes on without it; so does a
# node cut off.
STOP_AGENT_S = HUNG_AFTER + 3
NET_FAULTS = ["cut-rdzv", "cut-node", "one-way", "flap"]
AGENT_HOSTS = 6      # hosts for agents in --netns (live at once: 2 active, a standby, stopped or cut ones)
# Signals an agent only dies of when it crashes (this harness never sends them): each is a
# failed check, whatever the job did after it.
CRASH_SIGNALS = {signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS, signal.SIGFPE, signal.SIGILL}
LOG_EVERY = 2
IN_PLACE_LOST = 3     # --worker python: the most steps a fault may cost (its redone step, plus a margin)
CALIBRATION_STEPS = 120  # the undisturbed run that sizes --max-steps: 60 progress lines
# With --plan-bound, a fault comes only while the steps left at the calibrated rate and one
# fault's recovery fit the planned seconds; the README's soak: stop-daemon's median 16 s.
RECOVERY_ALLOWANCE_S = 20
# mgtrain's progress line, or examples/ddp_recovery.py's (--worker python): the step is group 1 or 2.
STEP_LINE = re.compile(r"\[rank0\]:(?:epoch \d+/\d+ step (\d+)/\d+|step (\d+) )")
PY_WORKER = os.path.join(os.path.dirname(HERE), "examples", "ddp_recovery.py")
# Agent lines that show a fault was seen (any node).
DETECT = re.compile(r"^(\[mglaunch\]|mglaunch:).*(restart|lost|fail|pause|standby|rendezvous)", re.I)


def now():
    return time.monotonic()


class Process:
    """A process of ours in its own session, its output lines stamped as they arrive."""

    def __init__(self, name, argv, env, log_dir):
        self.name, self.argv = name, argv
        self.lines = []  # (monotonic time, text)
        self.log = open(os.path.join(log_dir, name + ".log"), "w")
        self.p = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, start_new_session=True, text=True, errors="replace")
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.p.stdout:
            t = now()
            self.lines.append((t, line.rstrip("\n")))
            self.log.write(f"{t:.3f} {line}")
            self.log.flush()

    @property
    def pid(self):
        return self.p.pid

    def alive(self):
        return self.p.poll() is None

    def send(self, sig):
        try:
            os.kill(self.p.pid, sig)
        except ProcessLookupError:
            pass

    def stop_all(self):
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.killpg(self.p.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            self.p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self.reader.join(timeout=5)

    def wait(self, timeout):
        try:
            return self.p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def text(self):
        return "\n".join(t for _, t in self.lines)


def tagged_pids(tag):
    """Processes of this user whose environment carries MGCHAOS_TAG=tag (ours, and what they started)."""
    out, needle = [], f"MGCHAOS_TAG={tag}".encode()
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            if os.stat(f"/proc/{d}").st_uid != os.getuid():
                continue
            with open(f"/proc/{d}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    out.append(int(d))
        except OSError:
            pass
    return out


def children(pid):
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


class Chaos:
    def __init__(self, args):
        self.args = args
        # --netns: the rendezvous on hosts 0-2 (the daemon on 0, etcd members on 0-2), agents on the rest.
        self.net = netns_cluster.NetCluster(3 + AGENT_HOSTS) if args.netns else None
        self.healers = []        # threading.Timer ending each network fault
        self.bin = os.path.join(os.path.abspath(args.build), "bin")
        self.rng = random.Random(args.seed)
        self.tag = uuid.uuid4().hex
        self.root = tempfile.mkdtemp(prefix="mgchaos_")
        self.tmp = os.path.join(self.root, "tmp")        # every process's TMPDIR: must end empty
        self.logs = os.path.join(self.root, "logs")
        self.out = os.path.join(self.root, "out")        # summaries
        for d in (self.tmp, self.logs, self.out):
            os.makedirs(d)
        # (MGLAUNCH_RECORD_DIR: the agents' records of their jobs in this run's own directory.)
        self.env = dict(os.environ, TMPDIR=self.tmp, MGCHAOS_TAG=self.tag, OMP_NUM_THREADS="1",
                        MGLAUNCH_RECORD_DIR=os.path.join(self.root, "records"))
        self.procs = []          # every Process started, for the final cleanup
        self.agents = []         # Process per agent, in start order
        self.next_addr = 2
        self.daemon = None
        self.etcd = []           # (Process, name, client port, peer port, data dir)
        self.endpoint = None
        self.faults = []
        self.problems = []
        self.job = f"chaos-{args.seed}-calibration"
        self.replacements = 0    # agents started to replace lost ones (bounded by the faults)
        self.join_timeout = args.join_timeout
        self.phases = {}         # wall seconds of each phase, for the report
        self.rate = None         # steps per second of the undisturbed calibration run
        self.startup = None      # seconds from its agents' start to its first step
        self.faults_stopped = None  # when faults stopped to keep the plan (--plan-bound), from the start

    # ---- processes ----------------------------------------------------------------------------
    def start(self, name, argv):
        p = Process(name, argv, self.env, self.logs)
        self.procs.append(p)
        return p

    def on(self, host):
        """The command-line prefix that runs on namespace host `host` (nothing without --netns)."""
        return self.net.on(host) if self.net else []

    def start_daemon(self, endpoint=None):
        endpoint = endpoint or (f"{self.net.addrs[0]}:{ports.free_port()}" if self.net else "127.0.0.1:0")
        for _ in range(50):
            d = self.start(f"daemon{len(self.procs)}",
                           self.on(0) + [os.path.join(self.bin, "mglaunch-rdzv"), "--listen", endpoint])
            deadline = now() + 10
            # Its first line, after a warning when it listens beyond loopback without a token (--netns).
            listening = lambda: [t for _, t in d.lines if t.startswith("listening on ")]  # noqa: E731
            while now() < deadline and not listening() and d.alive():
                time.sleep(0.01)
            if listening():
                self.daemon, self.endpoint = d, listening()[0][len("listening on "):]
                return
            d.stop_all()
            time.sleep(0.1)  # the port is briefly someone else's: bounded retries
        raise RuntimeError(f"mglaunch-rdzv could not listen on {endpoint}")

    def etcd_addr(self, i):
        return self.net.addrs[i] if self.net else "127.0.0.1"

    def start_etcd(self):
        if self.net:
            members = [(f"m{i}", 2379, 2380) for i in range(3)]
        else:
            members = [(f"m{i}", ports.free_port(), ports.free_port()) for i in range(3)]
        cluster = ",".join(f"{n}=http://{self.etcd_addr(i)}:{pp}" for i, (n, _, pp) in enumerate(members))
        for name, cp, pp in members:
            self.etcd.append([None, name, cp, pp, os.path.join(self.root, "etcd-" + name), cluster])
            self.start_etcd_member(len(self.etcd) - 1, "new")
        self.endpoint = ",".join(f"http://{self.etcd_addr(i)}:{e[2]}" for i, e in enumerate(self.etcd))

    def start_etcd_member(self, i, state):
        _, name, cp, pp, data, cluster = self.etcd[i]
        a = self.etcd_addr(i)
        self.etcd[i][0] = self.start(f"etcd-{name}-{len(self.procs)}", self.on(i) + [
            "/usr/bin/etcd", "--name", name, "--data-dir", data,
            "--listen-client-urls", f"http://{a}:{cp}", "--advertise-client-urls", f"http://{a}:{cp}",
            "--listen-peer-urls", f"http://{a}:{pp}", "--initial-advertise-peer-urls", f"http://{a}:{pp}",
            "--initial-cluster", cluster, "--initial-cluster-state", state, "--log-level", "error"])

    def agent_argv(self, addr, max_steps):
        backend = ["--rdzv_backend=etcd"] if self.args.backend == "etcd" else ["--rdzv_backend=mglaunch"]
        return [os.path.join(self.bin, "mglaunch"), f"--nnodes={ACTIVE}", f"--nproc_per_node={NPROC}", *backend,
                f"--rdzv_endpoint={self.endpoint}", f"--rdzv_id={self.job}", f"--local_addr={addr}",
                "--max_restarts=1000", f"--rdzv_conf=join_timeout={self.join_timeout},{KEEP_ALIVE}",
                f"--grace={self.args.grace}", *self.prestart(), *self.worker_argv(max_steps)]

    def prestart(self):
        # The Python workers take ~20 s to import torch here: a standby's are started ahead
        # (the package's deployment), so a lost node's place is filled in about a second.
        return ["--prestart-standby"] if self.args.worker == "python" else []

    def worker_argv(self, max_steps):
        # The plain torch DDP script with mglaunch_recovery (#37). Its --timeout bounds the survivors'
        # wait for a new group, whose fresh workers (a standby's, no pre-start) take 20-45 s to start
        # here: with mgtrain's 20 s the group never formed and every recovery became a restart.
        pace = ["--step-ms", f"{self.args.step_ms:g}"] if self.args.step_ms else []
        if self.args.worker == "python":
            return ["--python=/usr/bin/python3", PY_WORKER, "--model", "mlp", "--steps", str(max_steps), "--batch-size",
                    "16", "--train-subset", "4096", "--seed", str(self.args.seed), "--timeout", "120", *pace,
                    "--summary-json", os.path.join(self.out, "summary_{rank}.json")]
        # 1,024 samples (16 steps an epoch at world 4): 4,096 took about 0.5 CPU-s more to make in
        # every mgtrain process the run starts (14 and more in the smoke: #36). --max-steps ends
        # the job; the epochs only need to outlast it.
        return [os.path.join(self.bin, "mgtrain"), "--dataset", "synthetic", "--synthetic-size", "1024",
                "--model", "mlp", "--epochs", "100000", "--max-steps", str(max_steps), "--batch-size", "16",
                "--seed", str(self.args.seed), "--threads", "1", "--log-every", str(LOG_EVERY), "--timeout", "20",
                *pace, "--in-place-recovery", "--summary-json", os.path.join(self.out, "summary_{rank}.json")]

    def start_agent(self, max_steps):
        """A new agent: on a fresh loopback address, or on a namespace host with no live agent
        (None when every agent host has one)."""
        host = None
        if self.net:
            busy = {a.host for a in self.agents if a.alive()}
            free = [h for h in range(3, 3 + AGENT_HOSTS) if h not in busy]
            if not free:
                return None
            host = free[0]
            addr = self.net.addrs[host]
        else:
            addr = f"127.0.0.{self.next_addr}"
            self.next_addr += 1
        a = self.start(f"agent-{addr}-{len(self.procs)}", self.on(host) + self.agent_argv(addr, max_steps))
        a.addr, a.host = addr, host
        self.agents.append(a)
        return a

    def workers_of(self, agent):
        worker = "ddp_recovery.py" if self.args.worker == "python" else "mgtrain"
        return [c for c in children(agent.pid) if worker in cmdline(c)]

    def active_agents(self):
        return [a for a in self.agents if a.alive() and self.workers_of(a) and not self.waiting(a)]

    def standby_agents(self):
        return [a for a in self.agents if a.alive() and self.waiting(a)]

    def waiting(self, agent):
        """A standby not placed yet: its last word is its standby line, not a round's; with
        --prestart-standby its workers already run."""
        if not self.prestart():
            return not self.workers_of(agent) and any("standby" in t for _, t in agent.lines)
        last = ""
        for _, t in agent.lines:
            if "standby for job" in t:
                last = "standby"
            elif re.search(r"round \d+: node", t):
                last = "round"
        return last == "standby"

    # ---- progress -----------------------------------------------------------------------------
    def steps(self):
        """(time, step) of every rank-0 progress line seen, in time order."""
        seen = []
        for a in self.agents:
            for t, line in list(a.lines):
                m = STEP_LINE.search(line)
                if m:
                    seen.append((t, int(m.group(1) or m.group(2))))
        return sorted(seen)

    def whose(self, target):
        """ (rank 0's node)" when the agent `target` names printed the last rank-0 progress
        line (it runs rank 0, and hosts the store in torch 1.x's c10d jobs), else " (not
        rank 0's node)"; "" for other targets."""
        last = {}
        for a in self.agents:
            for t, line in list(a.lines):
                if STEP_LINE.search(line):
                    last[a.addr] = t
        if not target.startswith("agent ") or not last:
            return ""
        return " (rank 0's node)" if max(last, key=last.get) == target.split()[-1] else " (not rank 0's node)"

    def first_line_after(self, t0, pattern, until=float("inf")):
        best = None
        for p in [*self.agents, *([self.daemon] if self.daemon else [])]:
            for t, line in list(p.lines):
                if t0 < t < until and pattern.search(line) and (best is None or t < best):
                    best = t
                    break
        return best

    # ---- faults -------------------------------------------------------------------------------
    def fault_kinds(self):
        kinds = ["kill-worker", "stop-worker", "kill-agent", "stop-agent"]
        kinds += ["kill-etcd", "stop-etcd"] if self.args.backend == "etcd" else ["kill-daemon", "stop-daemon"]
        kinds += NET_FAULTS if self.net else []
        if self.args.faults:
            kinds = [k for k in kinds if k in self.args.faults.split(",")]
        return kinds

    def heal_later(self, seconds, heal):
        t = threading.Timer(seconds, heal)
        t.daemon = True
        self.healers.append(t)
        t.start()

    def inject(self, kind, max_steps):
        """Carries out one fault; returns (target, t0) or None when it does not apply now."""
        active = self.active_agents()
        if kind in NET_FAULTS:
            return self.inject_network(kind, active)
        if kind in ("kill-worker", "stop-worker"):
            pids = [w for a in active for w in self.workers_of(a)]
            if not pids:
                return None
            pid = self.rng.choice(pids)
            t0 = now()
            os.kill(pid, signal.SIGKILL if kind == "kill-worker" else signal.SIGSTOP)
            return f"worker pid {pid}", t0
        if kind in ("kill-agent", "stop-agent"):
            if not active or not self.standby_agents():
                return None  # keep the fault survivable: a standby must be waiting
            a = self.rng.choice(active)
            t0 = now()
            a.send(signal.SIGKILL if kind == "kill-agent" else signal.SIGSTOP)
            if kind == "stop-agent":
                # Stopped past the keep-alive bound, so the job goes on without it; then it
                # resumes, finds itself out of the job and must end.
                threading.Timer(STOP_AGENT_S, lambda: a.send(signal.SIGCONT)).start()
            return f"agent {a.addr}", t0
        if kind in ("kill-daemon", "stop-daemon"):
            d, t0 = self.daemon, now()
            if kind == "kill-daemon":
                d.send(signal.SIGKILL)
                d.wait(10)
                time.sleep(self.rng.uniform(0.2, 2.0))
                self.start_daemon(self.endpoint)
            else:
                d.send(signal.SIGSTOP)
                time.sleep(self.rng.uniform(0.5, 3.0))
                d.send(signal.SIGCONT)
            return "daemon", t0
        if kind in ("kill-etcd", "stop-etcd"):
            i = self.rng.randrange(len(self.etcd))
            proc, t0 = self.etcd[i][0], now()
            if kind == "kill-etcd":
                proc.send(signal.SIGKILL)
                proc.wait(10)
                time.sleep(self.rng.uniform(0.5, 3.0))
                self.start_etcd_member(i, "existing")
            else:
                proc.send(signal.SIGSTOP)
                time.sleep(self.rng.uniform(0.5, 3.0))
                proc.send(signal.SIGCONT)
            return f"etcd member {self.etcd[i][1]}", t0
        raise ValueError(kind)

    def inject_network(self, kind, active):
        """A network fault, healed by a timer: the rendezvous's host cut off for 1 s to the
        keep-alive bound and 3 s; an active node (a standby waiting) cut off past that bound, its
        packets lost one way as long, or its link flapping (1 s down, 1 s up) for 4-8 s."""
        net = self.net
        if kind == "cut-rdzv":
            host = self.rng.randrange(3) if self.args.backend == "etcd" else 0
            seconds, t0 = self.rng.uniform(1.0, HUNG_AFTER + 3), now()
            net.cut(host)
            self.heal_later(seconds, lambda: net.reconnect(host))
            return f"{'etcd member m' + str(host) if self.args.backend == 'etcd' else 'daemon'} host {net.addrs[host]}", t0
        if not active or not self.standby_agents():
            return None  # keep the fault survivable: a standby must be waiting
        a = self.rng.choice(active)
        t0 = now()
        if kind == "cut-node":
            net.cut(a.host)
            self.heal_later(STOP_AGENT_S, lambda: net.reconnect(a.host))
        elif kind == "one-way":
            net.drop(a.host)
            self.heal_later(STOP_AGENT_S, lambda: net.undrop(a.host))
        else:
            net.flap(a.host, 1.0, 1.0)
            self.heal_later(self.rng.uniform(4.0, 8.0), lambda: net.stop_flap(a.host))
        return f"agent {a.addr}", t0

    def replace_lost_agents(self, max_steps):
        """An agent that ended (killed, out of the job, declared hung, crashed) is replaced by a
        fresh standby, so that one waits again whatever ended it; bounded: at most one per
        fault, plus two (an agent that ends at once, again and again, cannot start a storm).
        A crash is a failed check anyway (crashes())."""
        live = [a for a in self.agents if a.alive()]
        allowed = 2 + len(self.faults)
        for _ in range(ACTIVE + STANDBYS - len(live)):
            if self.replacements >= allowed:
                return
            if self.start_agent(max_steps) is None:
                return  # every agent host is taken (agents stopped or cut off still live)
            self.replacements += 1

    # ---- the run ------------------------------------------------------------------------------
    def calibrate(self):
        """Steps per second of the undisturbed job (a short run), to size --max-steps."""
        if self.args.max_steps:
            return self.args.max_steps
        t0 = now()
        agents = [self.start_agent(CALIBRATION_STEPS) for _ in range(ACTIVE)]
        for a in agents:
            if a.wait(300) != 0:
                raise RuntimeError(f"the undisturbed calibration run failed:\n{a.text()[-3000:]}")
        steps = self.steps()
        self.agents.clear()
        for f in os.listdir(self.out):
            os.unlink(os.path.join(self.out, f))
        if len(steps) < 10:
            raise RuntimeError("the calibration run printed too few progress lines")
        rate = (steps[-1][1] - steps[2][1]) / max(1e-3, steps[-1][0] - steps[2][0])
        self.rate = rate
        # The job's start (the rendezvous, the workers' start, up to the first step): with
        # --plan-bound it is part of the plan's seconds (before, only the steps were sized, so
        # a slow start overran the plan by its own length).
        self.startup = steps[0][0] - t0
        seconds = self.args.seconds
        if self.args.plan_bound:
            seconds = max(seconds / 2, seconds - self.startup)
        # 70% of the run's seconds undisturbed: the faults' recoveries take the rest (the
        # faults stop at 85%).
        return max(200, int(rate * seconds * 0.7))

    def on_plan(self, t_start, max_steps):
        """With --plan-bound: whether one more fault still fits the plan, i.e. the steps left at
        the calibrated rate, plus one fault's recovery (RECOVERY_ALLOWANCE_S), end within the
        planned seconds. The faults came on a wall-clock schedule whatever the progress, so their
        recoveries were not bounded by the 30% the plan leaves them (the daemon soak of 0bdafd7:
        75 faults, 450 s from fault to the next step in all, for 216 s)."""
        if not self.args.plan_bound or not self.rate:
            return True
        done = ([s for _, s in self.steps()] or [0])[-1]
        left = max(0, max_steps - done) / self.rate
        return now() + left + RECOVERY_ALLOWANCE_S <= t_start + self.args.seconds

    def run(self):
        if self.args.backend == "etcd":
            self.start_etcd()
        else:
            self.start_daemon()
        t_cal = now()
        max_steps = self.calibrate()
        self.phases["calibration"] = round(now() - t_cal, 1)
        self.job = f"chaos-{self.args.seed}-soak"
        t_start = now()
        for _ in range(ACTIVE + STANDBYS):
            self.start_agent(max_steps)
        faults_until = t_start + self.args.seconds * 0.85
        deadline = t_start + self.args.seconds * 3 + 120
        kinds = self.fault_kinds()
        next_fault = t_start + self.rng.uniform(5, 10)
        first = self.args.first_fault
        # With --max-steps (no calibration: the smokes) the job's seconds are not known: on a
        # fast machine its 300 steps were done before the first fault's 5-10 s, and the smoke
        # failed with no fault. Its first fault comes at a step drawn from 10 to a third of the
        # steps instead, once rank 0 printed it.
        fault_step = self.rng.randint(10, max(10, max_steps // 3)) if self.args.max_steps else None
        while now() < deadline:
            if any(a.p.poll() == 0 for a in self.agents):
                break  # the job is done: the others end on their own (evaluate waits for them)
            if (now() >= next_fault and now() < faults_until and self.steps() and self.faults_stopped is None
                    and not self.on_plan(t_start, max_steps)):
                self.faults_stopped = round(now() - t_start, 1)
                print(f"chaos: t+{self.faults_stopped:.1f}s no more faults: the steps left would not end within "
                      f"the plan's {self.args.seconds:.0f} s", flush=True)
            steps = self.steps()
            due = (steps[-1][1] >= fault_step if fault_step is not None and not self.faults else now() >= next_fault) \
                if steps else False
            # Never a fault in the job's last steps (2 s at the calibrated rate, 10 at least): the
            # etcd soak of 712c039 cut a member after step 16,048 of 16,049, the job ended 2 s
            # later, and the fault had no step after it to recover to (a failure of the harness).
            if due and steps[-1][1] >= max_steps - max(10, int((self.rate or 0) * 2)):
                due = False
            if due and now() < faults_until and self.faults_stopped is None:
                kind = first or self.rng.choice(kinds)
                done = self.inject(kind, max_steps)
                if done:
                    first = ""
                    target, t0 = done
                    self.faults.append({"kind": kind, "target": target, "t0": t0,
                                        "step_before": ([s for t, s in self.steps() if t <= t0] or [0])[-1]})
                    print(f"chaos: t+{t0 - t_start:.1f}s {kind} {target}{self.whose(target)}, after step "
                          f"{self.faults[-1]['step_before']}", flush=True)
                # The first fault, when it does not apply yet (no standby waits), is tried again
                # on the next pass, not a whole gap later (the smoke's gap outlasts its job).
                next_fault = now() if not self.faults else now() + self.rng.uniform(self.args.min_gap, self.args.max_gap)
            self.replace_lost_agents(max_steps)
            time.sleep(0.05)
        self.phases["soak"] = round(now() - t_start, 1)
        self.evaluate(t_start, max_steps)
        self.check_plan(t_start, max_steps)
        self.phases["evaluation"] = round(now() - t_start - self.phases["soak"], 1)

    def crashes(self, agents):
        """Agents that died of a signal this harness never sends (SIGSEGV...): product bugs."""
        for a in agents:
            code = a.p.poll()
            if code is None:
                continue
            sig = -code if code < 0 else 0  # died of the signal (no shell between: its own exit code is its own)
            if sig in CRASH_SIGNALS:
                self.problems.append(f"agent {a.addr} crashed: {signal.Signals(sig).name} (exit {code}); "
                                     f"its last lines: {a.text()[-600:]}")

    def hung_without_fault(self):
        """Nodes the rendezvous declared hung although no fault stopped them (a loaded
        machine, or an agent whose loop blocks): in the report, not a failed check."""
        stopped = {f["target"].split()[-1] for f in self.faults
                   if f["kind"] in ("stop-agent", "cut-node", "one-way", "flap")}
        out = []
        for a in self.agents:
            for t, line in a.lines:
                m = re.search(r"node \S+ \(([0-9.]+)\) missed \d+ heartbeats", line)
                if m and m.group(1) not in stopped and m.group(1) not in out:
                    out.append(m.group(1))
        return out

    def evaluate(self, t_start, max_steps):
        # Every agent still alive has ended on its own by now, or it hangs.
        for a in self.agents:
            if a.wait(60) is None:
                self.problems.append(f"agent {a.addr} did not end (pid {a.pid})")
        self.crashes(self.agents)
        steps = self.steps()
        # A fault's detection is an agent line before the next fault and before the last step:
        # a fault no agent noticed (an etcd member of three cut off a few seconds) has none, and
        # its recovery is the first step after it (not after some later fault's line).
        ends = [f["t0"] for f in self.faults[1:]] + [float("inf")]
        last_step = steps[-1][0] if steps else float("inf")
        for f, until in zip(self.faults, ends):
            f["detected_s"] = None
            t_det = self.first_line_after(f["t0"], DETECT, min(until, last_step))
            if t_det is not None:
                f["detected_s"] = round(t_det - f["t0"], 3)
            after = [(t, s) for t, s in steps if t > (t_det or f["t0"])]
            f["recovered_s"] = round(after[0][0] - f["t0"], 3) if after else None
            f["step_after"] = after[0][1] if after else None
            f["steps_lost"] = max(0, f["step_before"] + LOG_EVERY - after[0][1]) if after else None
            f["t"] = round(f.pop("t0") - t_start, 3)
        summaries = {}
        for name in os.listdir(self.out):
            with open(os.path.join(self.out, name)) as fh:
                summaries[name] = json.load(fh)
        shas = {s.get("weights_sha256") for s in summaries.values()}
        if len(summaries) != ACTIVE * NPROC:
            self.problems.append(f"{len(summaries)} rank summaries, expected {ACTIVE * NPROC}")
        if len(shas) != 1:
            self.problems.append(f"ranks disagree on the weights: {sorted(map(str, shas))}")
        finals = [s.get("steps") for s in summaries.values()]
        if finals and set(finals) != {max_steps}:
            self.problems.append(f"ranks ended at steps {sorted(set(finals))}, expected {max_steps}")
        if self.args.worker == "python":
            # In place, a fault costs its interrupted step; a fall-back to a restart from step 0
            # (the workers ended, every step lost) must not pass as a survived fault.
            fell_back = [f for f in self.faults if (f["steps_lost"] or 0) > IN_PLACE_LOST]
            if fell_back:
                self.problems.append(f"{len(fell_back)} faults lost over {IN_PLACE_LOST} steps (not recovered in place): "
                                     f"{fell_back[:3]}")
            if not self.faults:
                self.problems.append("no fault came while the job trained (nothing was proved)")
            elif not any(s.get("recoveries") for s in summaries.values()):
                self.problems.append("no rank recorded an in-place recovery")
        unrecovered = [f for f in self.faults if f["recovered_s"] is None]
        if unrecovered:
            self.problems.append(f"{len(unrecovered)} faults without a step after them: {unrecovered[:3]}")
        self.report = {"backend": self.args.backend, "seed": self.args.seed, "seconds": round(now() - t_start, 1),
                       "max_steps": max_steps, "faults": self.faults, "weights_sha256": sorted(map(str, shas)),
                       "hung_without_fault": self.hung_without_fault(), "agents_started": len(self.agents),
                       "recoveries": [r for s in summaries.values() for r in s.get("recoveries", [])][:1000]}

    def check_plan(self, t_start, max_steps):
        """With --plan-bound B: the soak's job took at most B times its planned seconds (#34).
        Reports the training rate after the last fault's recovery beside the calibrated one: a
        job slowed for good (a spinning thread in a surviving worker) overruns with no fault left."""
        soak = self.phases.get("soak", now() - t_start)
        steps = self.steps()
        recovered = [f["t"] + f["recovered_s"] for f in self.faults if f.get("recovered_s") is not None]
        since = t_start + max(recovered) if recovered else t_start
        tail = [(t, st) for t, st in steps if t >= since]
        rate_after = None
        if len(tail) > 1 and tail[-1][0] > tail[0][0]:
            rate_after = (tail[-1][1] - tail[0][1]) / (tail[-1][0] - tail[0][0])
        self.report["plan"] = {"seconds": self.args.seconds, "bound": self.args.plan_bound,
                               "calibrated_steps_per_s": round(self.rate, 2) if self.rate else None,
                               "calibrated_startup_s": round(self.startup, 1) if self.startup is not None else None,
                               "steps_per_s_after_last_fault": round(rate_after, 2) if rate_after else None,
                               "faults_stopped_at_s": self.faults_stopped}
        if self.args.plan_bound and soak > self.args.plan_bound * self.args.seconds:
            self.problems.append(
                f"the soak's job took {soak:.0f} s, over {self.args.plan_bound:g} times its plan of "
                f"{self.args.seconds:.0f} s ({max_steps} steps at the calibrated "
                f"{self.rate or 0:.1f} steps/s; after the last fault's recovery "
                f"{rate_after or 0:.1f} steps/s)")

    def unsurvivable(self):
        """An active node lost with no standby: the survivor ends, non-zero, with a root cause
        that names the lost node, within its bound. Through the daemon the job waits
        join_timeout for a node to take the lost one's place (torchrun's rule; a standby
        would have taken it at once), so that bound is join_timeout, plus the keep-alive
        bound, the workers' stop (--grace) and a margin for a loaded machine: a hang never
        passes. A short join_timeout here: the wait for a node that cannot come is all it adds."""
        max_steps = 100000
        self.job = f"chaos-{self.args.seed}-unsurvivable"
        self.join_timeout = min(self.args.join_timeout, 10)
        agents = [self.start_agent(max_steps) for _ in range(ACTIVE)]
        deadline = now() + 120
        while now() < deadline and not all(self.workers_of(a) for a in agents):
            time.sleep(0.05)
        while now() < deadline and not self.steps_of(agents):
            time.sleep(0.05)
        victim, survivor = agents[1], agents[0]
        t0 = now()
        victim.send(signal.SIGKILL)
        bound = self.join_timeout + HUNG_AFTER + self.args.grace + 30
        code = survivor.wait(bound)
        took = now() - t0
        result = {"exit_code": code, "seconds": round(took, 2), "bound_s": bound}
        cause = [t for t in survivor.text().splitlines() if re.match(r"\s*message\s*:", t)]
        if code is None:
            self.problems.append(f"unsurvivable fault: the survivor hung for {took:.0f} s (bound {bound:.0f} s)")
        elif code == 0:
            self.problems.append("unsurvivable fault: the survivor exited 0")
        elif not any(victim.addr + ")" in t for t in cause):
            self.problems.append(f"unsurvivable fault: the root cause does not name {victim.addr}: "
                                 f"{survivor.text()[-800:]}")
        self.crashes(agents)
        return result

    def steps_of(self, agents):
        return [1 for a in agents for _, t in a.lines if STEP_LINE.search(t)]

    def cleanup(self):
        for t in self.healers:
            t.cancel()
        for p in self.procs:
            p.stop_all()
        if self.net:
            self.net.close()  # every process left in its namespaces, then the namespaces
        time.sleep(0.5)
        left = tagged_pids(self.tag)
        if left:
            self.problems.append(f"processes left behind: {[(p, cmdline(p)[:80]) for p in left]}")
            for p in left:
                try:
                    os.kill(p, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        # A failed run keeps its error files and logs on purpose, and says where: those go.
        for p in self.procs:
            for _, line in p.lines:
                m = re.search(r"error files and logs are kept in (\S+)", line)
                if m and m.group(1).startswith(self.tmp + os.sep):
                    shutil.rmtree(m.group(1), ignore_errors=True)
        leftover = []
        for dirpath, dirs, files in os.walk(self.tmp):
            leftover += [os.path.join(dirpath, x) for x in files + dirs]
        if leftover:
            self.problems.append(f"temporary files left behind: {leftover[:10]}")


def summarize(report):
    faults = report["faults"]
    by_kind = {}
    for f in faults:
        by_kind.setdefault(f["kind"], []).append(f)
    rows = []
    for kind, fs in sorted(by_kind.items()):
        rec = sorted(f["recovered_s"] for f in fs if f["recovered_s"] is not None)
        det = sorted(f["detected_s"] for f in fs if f["detected_s"] is not None)
        lost = sum(f["steps_lost"] or 0 for f in fs)
        rows.append({"kind": kind, "n": len(fs), "survived": len(rec),
                     "detect_median_s": statistics.median(det) if det else None,
                     "recover_median_s": statistics.median(rec) if rec else None,
                     "recover_max_s": rec[-1] if rec else None, "steps_lost": lost})
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("build")
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--seed", type=int, default=int(time.time()) % 100000)
    ap.add_argument("--backend", choices=["daemon", "etcd"], default="daemon")
    ap.add_argument("--report", default="")
    ap.add_argument("--min-gap", type=float, default=4.0, help="seconds between faults, at least")
    ap.add_argument("--max-gap", type=float, default=10.0)
    ap.add_argument("--max-steps", type=int, default=0, help="skip the calibration run")
    ap.add_argument("--step-ms", type=int, default=0,
                    help="the workers sleep this long after each step (--step-ms): a slower pace for the same seconds, "
                         "less CPU (make test's smoke); the calibration run has it too")
    ap.add_argument("--skip-unsurvivable", action="store_true",
                    help="no unsurvivable case at the end (the launcher's side: the mgtrain smoke runs it)")
    ap.add_argument("--join-timeout", type=int, default=20)
    ap.add_argument("--grace", type=float, default=5,
                    help="the agents' --grace: also how long a paused worker has to answer (a SIGSTOPped one is "
                         "SIGKILLed and started anew after it)")
    ap.add_argument("--faults", default="", help="only these kinds (comma-separated), e.g. kill-worker,kill-agent")
    ap.add_argument("--netns", action="store_true",
                    help="every node and the rendezvous on hosts of their own (network namespaces), with the network "
                         "faults cut-rdzv, cut-node, one-way, flap (needs root)")
    ap.add_argument("--worker", choices=["mgtrain", "python"], default="mgtrain",
                    help="python: examples/ddp_recovery.py (plain torch DDP with mglaunch_recovery) instead of mgtrain")
    ap.add_argument("--first-fault", default="", help="the first fault's kind (then at random), e.g. cut-node")
    ap.add_argument("--plan-bound", type=float, default=0,
                    help="the job must end within this many times --seconds (a failed check past it; make chaos: "
                         "1.25), and faults stop once the steps left would not end within --seconds at the "
                         "calibrated rate; 0: neither")
    args = ap.parse_args()
    if args.worker == "python":
        global LOG_EVERY
        LOG_EVERY = 1  # its rank 0 prints every step
    elif not os.path.exists(os.path.join(args.build, "bin", "mgtrain")):
        skip.skip_test("mgtrain is not built (configure with -DMGLAUNCH_WITH_TORCH=ON)")
    if args.backend == "etcd":
        skip.require_program("/usr/bin/etcd", "etcd-server")
    if args.netns:
        netns_cluster.require()
    if args.first_fault and args.faults and args.first_fault not in args.faults.split(","):
        ap.error(f"--first-fault {args.first_fault} is not among --faults")
    if args.first_fault in NET_FAULTS and not args.netns:
        ap.error(f"--first-fault {args.first_fault} is a network fault: give --netns")
    c = Chaos(args)
    print(f"chaos: seed {args.seed}, backend {args.backend}, {args.seconds:.0f} s, files in {c.root}", flush=True)
    try:
        c.run()
        if not args.skip_unsurvivable:
            t_uns = now()
            c.report["unsurvivable"] = c.unsurvivable()
            c.phases["unsurvivable"] = round(now() - t_uns, 1)
    except Exception as e:  # noqa: BLE001 (reported as a failed check, after the cleanup)
        c.problems.append(f"{type(e).__name__}: {e}")
        c.report = getattr(c, "report", {"faults": c.faults})
    finally:
        c.cleanup()
    c.report["summary"] = summarize(c.report) if c.report.get("faults") else []
    c.report["problems"] = c.problems
    c.report["phases_s"] = c.phases
    print("chaos: phases (s): " + json.dumps(c.phases), flush=True)
    if args.report:
        text = json.dumps(c.report, indent=1)
        if c.net:  # the namespace hosts by their host names: their addresses mean nothing outside the run
            names = dict(zip(c.net.addrs, c.net.names))
            text = re.sub(r"\b10\.34\.0\.\d+\b", lambda m: names.get(m.group(0), m.group(0)), text)
        with open(args.report, "w") as f:
            f.write(text)
    for row in c.report["summary"]:
        print("chaos: " + json.dumps(row), flush=True)
    for p in c.problems:
        print("chaos: FAILED: " + p, flush=True)
    if not c.problems:
        shutil.rmtree(c.root, ignore_errors=True)
        print(f"chaos: {len(c.report.get('faults', []))} faults survived; every check held", flush=True)
        return 0
    print(f"chaos: logs kept in {c.logs}", flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main())
