#!/usr/bin/python3
"""In-place recovery of a plain torch DDP script (examples/ddp_recovery.py with
python/mglaunch_recovery, issue #37), with real processes: mglaunch-rdzv, mglaunch agents
and torch 1.13 workers on Gloo over 127.0.0.0/8.

    py_recovery_test.py BIN_DIR CASE [WORK_DIR]

CASE:
  reference   an undisturbed 2-node run under mglaunch; writes WORK_DIR/reference.json (the
              weights the other cases compare with: ctest's fixture, run once)
  done-when   2 active nodes and 1 pre-started standby; node 1's agent SIGKILLed at step 10
              or later: exit 0, rank 0 records one recovery of at most 2 s, the weights equal
              the reference's
  torchrun    the same script under ../shared/peers/torchrun: recovery off in one line, the
              same weights (exit 77 without ../shared)
  torch2      the done-when case with torch 2.6 workers from ../shared/peers/torch2's root,
              against an undisturbed run of its own under torch 2.6 (exit 77 when it is absent
              or not set up)
  quiet-store a store client whose server was SIGKILLed, once its group is let go of, does
              not spin (torch 1.13's client thread busy-loops on the closed connection)
  import      a worker mglaunch starts imports the shipped package (PYTHONPATH, no install)
  off         without a control channel (MGLAUNCH_CONTROL_SOCKET unset) one line says
              recovery is off and the script trains
  store-server
              a rank that hosts the store (torch 1.x's c10d jobs: rank 0) stops its server
              when it lets go of the group: one was kept, listening, per recovery
  rng         the state agreement between two ranks seeded per rank (torch.manual_seed(100 +
              rank)): a rank behind that has steps of its own keeps its own generator state;
              a fresh one (step 0) takes the source's
  group-sockets
              a pause shuts, and a group let go of makes quiet, only the group's sockets:
              a user's connection opened while the group forms survives; a store connection
              the formation thread opens after the group was let go of is made quiet; a
              second pause racing the quiet loop never shuts the shared quiet socket
  left-behind a formation thread left behind by a pause in Gloo's constructor ends (raises, or
              returns) after the next round formed on the same store: the next round's store
              connections and a user's connection opened after it formed survive
  pause-in-gloo
              a pause while Gloo's constructor connects: a user's connection survives the
              let-go and no line claims Gloo's addresses are missing; a store call on a quiet
              connection sets no option on another kept client's
  gloo-devices
              two Gloo devices (GLOO_SOCKET_IFNAME=lo,lo) between two ranks in one process:
              every pair of both devices is found as the group's
  rng-behind  a step applied on rank 0 only (rank 1 fails after DDP's all-reduce, before
              its optimizer step; this test is the agent): after the state agreement the
              example (every rank seeded alike, dropout) ends with an undisturbed run's weights
  pause-forming
              a pause that comes while the worker forms its group, a peer missing (this test
              is the agent and hosts the store): once while the peer never joins (the worker
              waits in Gloo's exchange of addresses), once while the peer joined Gloo but never
              registers (torch 1.13: init_process_group's store barrier). The worker answers
              at once, not after its --timeout (1 h here), and the next round, with a fresh
              peer, trains to the end: the same weights on both ranks
  unit        the package's parts in this one process (one torch start): the state a
              survivor sends loads as torch 2.6 loads (weights_only), only collective and
              store errors wait for a pause, a pause stays until an assign, NCCL's error
              handling per torch version, a peer lost in DDP's rebuild is recovered, and an
              abandoned DDP is freed"""
import atexit
import json
import os
import shlex
import shutil
import uuid
import signal
import socket
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "support"))
from skip import skip_test  # noqa: E402
from ports import free_port  # noqa: E402  (tests/support/ports.py: ports no parallel test takes)

SRC = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(SRC, "examples", "ddp_recovery.py")
PEERS = os.path.join(SRC, "..", "shared", "peers")
STEPS = 30
# The cheap model, small batches, one thread (every run the same arithmetic), and a
# sleep per step so that the kill lands mid-run on a loaded machine.
TRAIN = ["--model", "mlp", "--batch-size", "16", "--steps", str(STEPS), "--seed", "3", "--train-subset", "2048"]
# MGLAUNCH_RECORD_DIR: the agents' records of their jobs (launcher/job_record.h) in a
# directory of this run's own, never the user's $XDG_RUNTIME_DIR.
ENV = dict(os.environ, OMP_NUM_THREADS="1", MGLAUNCH_RECORD_DIR=tempfile.mkdtemp(prefix="mgrecords_"))
atexit.register(shutil.rmtree, ENV["MGLAUNCH_RECORD_DIR"], True)
procs = []


class Proc:
    def __init__(self, argv, work, name, env=None):
        self.out_path = os.path.join(work, name + ".out")
        self.err_path = os.path.join(work, name + ".err")
        with open(self.out_path, "wb") as out, open(self.err_path, "wb") as err:
            self.p = subprocess.Popen(argv, stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=env or ENV,
                                      start_new_session=True)
        procs.append(self)

    def out(self):
        with open(self.out_path, errors="replace") as f:
            return f.read()

    def err(self):
        with open(self.err_path, errors="replace") as f:
            return f.read()

    def wait(self, seconds):
        try:
            return self.p.wait(seconds)
        except subprocess.TimeoutExpired:
            return None


def stop_all():
    for p in procs:
        if p.p.poll() is None:
            try:
                os.killpg(p.p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.p.wait()


def fail(msg, *shown):
    for p in shown:
        print(f"--- {p.out_path}\n{p.out()[-4000:]}\n--- {p.err_path}\n{p.err()[-6000:]}")
    print(f"FAILED: {msg}", flush=True)
    stop_all()
    sys.exit(1)


def eventually(cond, seconds, what, *shown):
    """Waits for cond() (bounded); fails at once when one of `shown` ended meanwhile."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if cond():
            return
        ended = [p for p in shown if p.p.poll() is not None]
        if ended:
            fail(f"{what}: {ended[0].out_path[:-4]} ended (exit {ended[0].p.returncode}) first", *shown)
        time.sleep(0.05)
    fail(f"{what} not within {seconds} s", *shown)


def daemon(bin_dir, work):
    d = Proc([os.path.join(bin_dir, "mglaunch-rdzv"), "--listen", "127.0.0.1:0"], work, "rdzv")
    eventually(lambda: "\n" in d.out(), 30, "the daemon's first line", d)
    line = d.out().splitlines()[0]
    if not line.startswith("listening on "):
        fail(f"the daemon said {line!r}", d)
    return d, line[len("listening on "):]


def node(bin_dir, work, endpoint, job, host, summary, flags=(), python="/usr/bin/python3", train=()):
    argv = [os.path.join(bin_dir, "mglaunch"), "--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d",
            f"--rdzv_endpoint={endpoint}", f"--rdzv_id={job}", "--max_restarts=2", f"--local_addr=127.0.0.{host}",
            f"--python={python}", *flags, EXAMPLE, *TRAIN, *train, "--summary-json", summary]
    return Proc(argv, work, f"{job}-node{host}")


def summary(path):
    with open(path) as f:
        return json.load(f)


def reference(bin_dir, work, python="/usr/bin/python3"):
    d, ep = daemon(bin_dir, work)
    a = node(bin_dir, work, ep, "calm", 2, work + "/c{rank}.json", python=python)
    b = node(bin_dir, work, ep, "calm", 3, work + "/c{rank}.json", python=python)
    for n in (a, b):
        if n.wait(300) != 0:
            fail(f"an undisturbed node exited with {n.p.returncode}", a, b)
    s0, s1 = summary(work + "/c0.json"), summary(work + "/c1.json")
    if s0["steps"] != STEPS or s0["weights_sha256"] != s1["weights_sha256"] or s0["recoveries"]:
        fail(f"the undisturbed run: {s0} {s1}", a, b)
    with open(work + "/reference.json", "w") as f:
        json.dump(s0, f)
    d.p.terminate()
    d.wait(10)
    print(f"reference: {STEPS} steps, weights sha256 {s0['weights_sha256']}")


def reference_weights(work):
    path = work + "/reference.json"
    if not os.path.exists(path):
        fail(f"{path} is missing: run the reference case first (ctest's fixture py_recovery_reference)")
    return summary(path)["weights_sha256"]


def done_when(bin_dir, work, python="/usr/bin/python3", what="torch 1.13"):
    want = reference_weights(work)
    run = tempfile.mkdtemp(dir=work)
    d, ep = daemon(bin_dir, run)
    # Steps of 250 ms, which rank 0 spends inside the gradient all-reduce (rank 1 sleeps
    # before its backward()): the kill lands mid-collective, and the standby, started with
    # the active nodes' workers, is ready well before step 10 even on a loaded machine. The
    # example's dropout makes the weights depend on the RNG state restored and handed over.
    slow = ["--lag-ms", "250"]
    nodes = [node(bin_dir, run, ep, "hit", h, run + "/s{rank}.json", python=python, train=slow) for h in (2, 3)]
    eventually(lambda: all("round 1:" in n.err() for n in nodes), 120, "round 1 of the active nodes", *nodes)
    standby = node(bin_dir, run, ep, "hit", 4, run + "/s{rank}.json", ["--prestart-standby"], python=python, train=slow)
    nodes.append(standby)
    lead = []  # rank 0's progress lines tell which agent hosts it: the other active one is "node 1"
    eventually(lambda: lead.extend(i for i in (0, 1) if "]:step 1 " in nodes[i].out()) or lead, 180,
               "rank 0's step 1", *nodes)
    eventually(lambda: "standby worker ready" in standby.out(), 180, "the pre-started standby's ready line", *nodes)
    eventually(lambda: "]:step 10 " in nodes[lead[0]].out(), 180, "rank 0's step 10", *nodes)
    victim = nodes[1 - lead[0]]
    os.kill(victim.p.pid, signal.SIGKILL)
    victim.wait(30)
    survivor = nodes[lead[0]]
    for n in (survivor, standby):
        if n.wait(300) is None:
            fail("the job did not end within 300 s of the kill", survivor, standby)
    if survivor.p.returncode != 0 or standby.p.returncode != 0:
        fail(f"exit codes: rank 0's node {survivor.p.returncode}, the standby {standby.p.returncode}", survivor, standby)
    s0, s1 = summary(run + "/s0.json"), summary(run + "/s1.json")
    checks = [(s0["steps"] == STEPS, f"rank 0 ran {s0['steps']} steps, not {STEPS}"),
              (len(s0["recoveries"]) == 1, f"rank 0's recoveries: {s0['recoveries']}"),
              (s0["weights_sha256"] == want, f"rank 0's weights {s0['weights_sha256']} differ from the undisturbed {want}"),
              (s1["weights_sha256"] == want, f"rank 1's weights {s1['weights_sha256']} differ from the undisturbed {want}")]
    for ok, msg in checks:
        if not ok:
            fail(msg, survivor, standby)
    r = s0["recoveries"][0]
    if r["step"] < 11 or r["lost"] != "host" or r["seconds"] > 2.0:
        fail(f"rank 0's recovery {r}: want step >= 11, lost host, at most 2 s", survivor, standby)
    if "the pre-started worker (pid " not in standby.err():
        fail("the standby's pre-started worker did not take the place", standby)
    print(f"{what}: node 1's agent SIGKILLed, rank 0 recovered in {r['seconds']:.3f} s (step {r['step']} redone), "
          f"weights equal the undisturbed run's")
    d.p.terminate()
    d.wait(10)
    if not os.environ.get("MGTEST_KEEP"):
        shutil.rmtree(run, ignore_errors=True)


def torchrun(work):
    peer = os.path.join(PEERS, "torchrun")
    if not os.path.exists(peer):
        skip_test("the reference torchrun is not at ../shared/peers/torchrun (../shared is absent beside this checkout)")
    want = reference_weights(work)
    argv = ["/usr/bin/python3", peer, "--standalone", "--nproc_per_node=2", "--monitor_interval=0.1", EXAMPLE, *TRAIN,
            "--summary-json", work + "/t{rank}.json"]
    # torch 1.13's --standalone takes a fixed port: in a network namespace of its own (loopback only).
    if subprocess.run(["/usr/bin/unshare", "-n", "/bin/true"]).returncode == 0 and os.path.exists("/usr/sbin/ip"):
        argv = ["/usr/bin/unshare", "-n", "/bin/sh", "-c", '/usr/sbin/ip link set lo up && exec "$@"', "sh", *argv]
    env = {k: v for k, v in ENV.items() if not k.startswith("MGLAUNCH_")}
    t = Proc(argv, work, "torchrun", env)
    if t.wait(300) != 0:
        fail(f"torchrun exited with {t.p.returncode}", t)
    off = [l for l in t.err().splitlines() if "in-place recovery is off" in l]
    if len(off) != 1:
        fail(f"want one line saying recovery is off, got {off}", t)
    s0 = summary(work + "/t0.json")
    if s0["steps"] != STEPS or s0["recovery"] or s0["weights_sha256"] != want:
        fail(f"under torchrun: {s0}, want the undisturbed weights {want}", t)
    print(f"torchrun: {off[0]}; the same weights")


def torch2(bin_dir, work):
    peer = os.path.join(PEERS, "torch2")
    if not os.path.exists(peer):
        skip_test("torch 2.6 is not at ../shared/peers/torch2 (../shared is absent beside this checkout)")
    root = os.environ.get("TORCH2_ROOT", "/var/cache/mglaunch-peers/torch2-root")
    if not os.path.exists(root + "/.ready"):
        skip_test("the torch 2.6 root is not set up: run ../shared/peers/torch2 setup once (~2 min)")
    # Each worker's python is the root's: the wrapper execs into it (same pid, so the agent
    # knows it), sharing /tmp (the summaries) and the checkout (the example and the package):
    # the root sees the current directory, so the wrapper runs from the checkout (ctest runs
    # this test in the build tree, where the example is not).
    wrapper = os.path.join(work, "python-torch2")
    with open(wrapper, "w") as f:
        f.write(f'#!/bin/sh\ncd {shlex.quote(SRC)} && exec {shlex.quote(os.path.abspath(peer))} '
                'run /usr/bin/python3 "$@"\n')
    os.chmod(wrapper, 0o755)
    # Its own undisturbed run: another torch's arithmetic and sampler give other weights than 1.13's.
    own = os.path.join(work, "torch2")
    os.makedirs(own, exist_ok=True)
    reference(bin_dir, own, python=wrapper)
    done_when(bin_dir, own, python=wrapper, what="torch 2.6")


def quiet_store(bin_dir, work):
    sys.path.insert(0, os.path.join(SRC, "python"))
    from datetime import timedelta

    import torch.distributed as dist
    import mglaunch_recovery

    # The agent's store (tests/store_serve: no second torch import, #36) on a free port.
    host = Proc([os.path.join(bin_dir, "store_serve")], work, "store-host")
    eventually(lambda: host.out().endswith("\n"), 60, "the store host's start", host)
    port = int(host.out())
    group = mglaunch_recovery._GroupSockets(({"127.0.0.1"}, port))
    store = dist.TCPStore("127.0.0.1", port, 2, False, timedelta(seconds=30))
    store.set("k", "v")
    store.get("k")  # a round trip: the host read everything (unread bytes make its kill a reset, not an end)
    group.done()
    os.kill(host.p.pid, signal.SIGKILL)
    host.wait(30)

    def cpu_ns():
        out = {}
        for t in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{t}/schedstat") as f:
                    out[t] = int(f.read().split()[0])
            except OSError:
                pass
        return out

    def busiest(seconds):
        a = cpu_ns()
        time.sleep(seconds)
        b = cpu_ns()
        return max(b[t] - a[t] for t in b if t in a and t != str(os.getpid())) / 1e6

    spinning = busiest(1.0)  # not asserted: on a loaded machine a spinner's share varies
    group.quiet()
    after = busiest(2.0)
    print(f"the store client's busiest thread: {spinning:.1f} ms of CPU in 1 s after its server's SIGKILL, "
          f"{after:.1f} ms in 2 s once let go of")
    if after > 20:
        fail(f"the abandoned store client still spins: {after:.1f} ms of CPU in 2 s")
    print("passed", flush=True)
    os._exit(0)  # the store object stays: its destructor is what a worker never runs


def off(work):
    env = {k: v for k, v in ENV.items() if not k.startswith("MGLAUNCH_")}
    env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", PYTHONPATH=os.path.join(SRC, "python"))
    env["MASTER_PORT"] = str(free_port())
    p = Proc(["/usr/bin/python3", EXAMPLE, "--model", "mlp", "--steps", "3", "--batch-size", "8", "--train-subset",
              "256", "--summary-json", work + "/o{rank}.json"], work, "off", env)
    if p.wait(120) != 0:
        fail(f"exit {p.p.returncode}", p)
    lines = [l for l in p.err().splitlines() if l.startswith("mglaunch_recovery:")]
    if lines != ["mglaunch_recovery: no MGLAUNCH_CONTROL_SOCKET (not started by mglaunch, e.g. torchrun): in-place "
                 "recovery is off, training goes on as usual"]:
        fail(f"want one line saying recovery is off, got {lines}", p)
    if summary(work + "/o0.json")["steps"] != 3 or "step 3 " not in p.out():
        fail("it did not train", p)


class FakeAgent:
    """The agent's side of one worker's control channel (docs/in-place-recovery.md): an
    abstract Unix socket, the welcome, then the messages this test sends and expects."""

    def __init__(self):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        name = f"mgtest-{os.getpid()}-{uuid.uuid4().hex[:16]}"
        self.sock.bind("\0" + name)
        self.sock.listen(4)
        self.name = "@" + name
        self.conn, self.buf = None, b""

    def accept(self, seconds, *shown):
        self.sock.settimeout(seconds)
        try:
            self.conn, _ = self.sock.accept()
        except socket.timeout:
            fail(f"no worker connected to {self.name} within {seconds} s", *shown)
        hello = self.expect("hello", seconds, *shown)
        if not hello.get("in_place"):
            fail(f"the worker's hello did not opt in: {hello}", *shown)
        self.send({"type": "welcome", "version": 1})

    def send(self, msg):
        self.conn.sendall((json.dumps(msg) + "\n").encode())

    def expect(self, kind, seconds, *shown):
        end = time.monotonic() + seconds
        while True:
            while b"\n" in self.buf:
                line, self.buf = self.buf.split(b"\n", 1)
                msg = json.loads(line)
                if msg.get("type") == kind:
                    return msg
            left = end - time.monotonic()
            if left <= 0:
                fail(f"no {kind!r} from the worker within {seconds} s", *shown)
            self.conn.settimeout(min(left, 0.5))
            try:
                chunk = self.conn.recv(4096)
            except socket.timeout:
                continue
            if not chunk:
                fail(f"the worker closed its control channel before its {kind!r}", *shown)
            self.buf += chunk

    def close(self):
        for s in (self.conn, self.sock):
            if s is not None:
                s.close()


def store_server(work):
    """The store server a rank hosted for a group goes with the group (_abandon)."""
    sys.path.insert(0, os.path.join(SRC, "python"))
    import mglaunch_recovery as mr

    class Channel:
        closed = ""

        def paused(self):
            return False

    def listening(port):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
            return True
        except ConnectionRefusedError:
            return False

    for k in [k for k in os.environ if k.startswith("MGLAUNCH_")]:
        del os.environ[k]
    rec = mr.Recovery()
    rec._channel = Channel()
    for restart in range(2):
        port = free_port()
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                          TORCHELASTIC_RESTART_COUNT=str(restart), TORCHELASTIC_USE_AGENT_STORE="False")
        rec._form_group()
        if not listening(port):
            fail(f"round {restart}: this rank's store server does not listen on {port}")
        rec._abandon()
        if listening(port):
            fail(f"round {restart}: the store server of a group let go of still listens on {port} (one kept per "
                 "recovery)")
    print("store-server: the server went with its group, twice", flush=True)
    os._exit(0)  # the kept clients stay: their destructors are what a worker never runs


class PauseChannel:
    """The control channel as the package sees it, its pause set by the test."""
    closed = ""
    pause = False

    def paused(self):
        return self.pause


def user_connection():
    """A user's own TCP connection (a data loader's, metrics'): both ends."""
    listener = socket.create_server(("127.0.0.1", 0))
    mine = socket.create_connection(listener.getsockname(), timeout=10)
    theirs = listener.accept()[0]
    listener.close()
    theirs.settimeout(10)
    return mine, theirs


def works(pair):
    mine, theirs = pair
    try:
        mine.sendall(b"x")
        theirs.sendall(b"y")
        return theirs.recv(1) == b"x" and mine.recv(1) == b"y"
    except OSError:
        return False


def join_left_behind():
    import threading

    for t in threading.enumerate():
        if t.name == "mglaunch-form-group":
            t.join(60)
            if t.is_alive():
                fail("the left-behind formation thread did not end within 60 s")


def paused_recovery():
    """(the package, the agent's store for 1 rank, its port, a Recovery whose channel's
    pause the test sets)."""
    sys.path.insert(0, os.path.join(SRC, "python"))
    from datetime import timedelta

    import mglaunch_recovery as mr

    store, port = agent_store(1)
    for k in [k for k in os.environ if k.startswith("MGLAUNCH_")]:
        del os.environ[k]
    rec = mr.Recovery(timeout=timedelta(seconds=60))
    rec._channel = PauseChannel()
    return mr, store, port, rec


def pause_while_forming(mr, rec, entered, meanwhile=lambda: None):
    """rec forms its group on a thread until `entered` (a constructor held by the test),
    then meanwhile() and the pause (as the control reader thread gives it), which must end
    the formation; meanwhile()'s result."""
    import threading

    errors = []

    def form():
        try:
            rec._form_group()
        except Exception as e:
            errors.append(e)

    forming = threading.Thread(target=form, daemon=True)
    forming.start()
    if not entered.wait(60):
        fail("the formation thread did not reach the constructor the test holds")
    got = meanwhile()
    rec._channel.pause = True
    rec._abort_group()
    forming.join(60)
    if forming.is_alive() or not errors or not isinstance(errors[0], mr._Interrupted):
        fail(f"the pause did not end the formation: {errors}")
    return got


def left_behind(work):
    """A formation thread left behind by a pause in Gloo's constructor (a peer that never
    connects: Gloo waits its whole timeout) ends after the next round formed on the same
    store (the agent's, MASTER_ADDR:MASTER_PORT the same every round): Gloo's constructor
    raises at last, or returns (the peer connected late). Neither may shut or make quiet
    the next round's store connections nor a user's connection opened after it formed."""
    import threading
    from datetime import timedelta
    from unittest import mock

    mr, store, port, rec = paused_recovery()
    real_gloo = mr.dist.ProcessGroupGloo
    for restart, ending in ((0, "raises"), (2, "returns")):
        entered, release = threading.Event(), threading.Event()

        def stuck_gloo(*args, **kwargs):  # Gloo's constructor waiting for a peer until its timeout
            entered.set()
            release.wait(120)
            if ending == "raises":
                raise RuntimeError("[gloo] Timed out waiting for peer (the test's)")
            return real_gloo(mr.dist.HashStore(), 0, 1, timedelta(seconds=30))  # the peer connected late

        os.environ.update(round_env(port, 0, 1, restart))
        with mock.patch.object(mr.dist, "ProcessGroupGloo", stuck_gloo):
            pause_while_forming(mr, rec, entered)
            rec._abandon()
        rec._channel.pause = False
        os.environ.update(round_env(port, 0, 1, restart + 1))
        rec._form_group()  # the next round forms and registers, the old thread still in Gloo's constructor
        group = rec._group
        mine = mr.dist.distributed_c10d._get_default_store()
        mine.set_timeout(timedelta(seconds=10))
        mine.set("k", "1")
        user = user_connection()
        release.set()  # the old round's Gloo constructor ends now
        join_left_behind()
        quieted = []
        for fd in group.known:
            with socket.socket(fileno=os.dup(fd)) as x:
                if x.family == socket.AF_UNIX:
                    quieted.append(fd)
        if quieted:
            fail(f"a formation thread left behind whose Gloo constructor {ending} late made the next round's store "
                 f"connections quiet (fds {quieted})")
        try:
            mine.get("k")
        except Exception as e:
            fail(f"the next round's store fails once the left-behind Gloo constructor {ending}: {e}")
        if not works(user):
            fail(f"a user's connection opened after the next round formed was shut when the left-behind Gloo "
                 f"constructor {ending}")
        rec._abort_group()
        rec._abandon()
    print("left-behind: the next round's store connections and a user's connection survived a left-behind formation "
          "thread whose Gloo constructor raised late, and one whose constructor returned late", flush=True)
    os._exit(0)  # the kept clients stay: their destructors are what a worker never runs


def pause_in_gloo(work):
    """A pause while Gloo's constructor connects its pairs (its store phase over): the
    formation thread's late reading of Gloo's addresses must not turn into "every
    connection is the group's" (a user's connection shut at the let-go, a false line); and
    a store call on a quiet connection must set no option on another kept client's."""
    import struct
    import threading
    from datetime import timedelta
    from unittest import mock

    mr, store, port, rec = paused_recovery()
    real_gloo = mr.dist.ProcessGroupGloo
    entered, release = threading.Event(), threading.Event()

    def connecting_gloo(*args, **kwargs):  # in its pair-connect phase when the pause comes; done right after
        entered.set()
        release.wait(120)
        return real_gloo(mr.dist.HashStore(), 0, 1, timedelta(seconds=30))

    os.environ.update(round_env(port, 0, 1, 0))
    said = []
    with mock.patch.object(mr.dist, "ProcessGroupGloo", connecting_gloo), \
            mock.patch.object(mr, "_say", lambda msg: said.append(msg)):
        user = pause_while_forming(mr, rec, entered, user_connection)
        release.set()  # Gloo's constructor returns before the let-go: the thread reads Gloo's addresses
        join_left_behind()
        rec._abandon()
    if not works(user):
        fail("a pause during Gloo's connect phase shut a user's connection at the let-go (Gloo's addresses unread: "
             "every connection counted as the group's)")
    if said:
        fail(f"a pause during Gloo's connect phase printed a false line: {said}")

    # A store call on a quiet connection (a kept client used after its group was let go of).
    group = mr._GroupSockets(({"127.0.0.1"}, port))
    first = mr.dist.TCPStore("127.0.0.1", port, 1, False, timedelta(seconds=30))
    between = mr._sockets()
    second = mr.dist.TCPStore("127.0.0.1", port, 1, False, timedelta(seconds=30))
    seconds = []
    for fd, ino in mr._sockets().items():
        if between.get(fd) != ino:
            with socket.socket(fileno=os.dup(fd)) as x:
                if x.family in (socket.AF_INET, socket.AF_INET6) and x.getpeername()[1] == port:
                    seconds.append(fd)
    if not seconds:
        fail("the second store client's connections were not found")
    group.done()
    group.quiet()
    first.set_timeout(timedelta(seconds=2))
    try:
        first.get("never")
        fail("a store call on a quiet connection returned")
    except RuntimeError:
        pass
    for fd in seconds:
        with socket.socket(fileno=os.dup(fd)) as x:
            if x.family != socket.AF_UNIX:
                fail(f"the second store client's fd {fd} was not made quiet")
            got = struct.unpack("ll", x.getsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, 16))
            if got != (0, 0):
                fail(f"a store call on one quiet connection set SO_RCVTIMEO {got} on another kept client's (fd {fd}): "
                     "its thread's blocking read would no longer sleep for good")
    print("pause-in-gloo: a user's connection survived a pause in Gloo's connect phase, no false line; a store call "
          "on a quiet connection left another kept client's alone", flush=True)
    os._exit(0)  # the kept clients stay: their destructors are what a worker never runs


def gloo_devices(work):
    """Several Gloo devices (GLOO_SOCKET_IFNAME=lo,lo: two devices on one host, each with
    pairs of its own): every pair of every device is the group's (its addresses read from
    the store), so that a pause can free a collective blocked on device 1 too."""
    sys.path.insert(0, os.path.join(SRC, "python"))
    import threading
    from datetime import timedelta

    os.environ["GLOO_SOCKET_IFNAME"] = "lo,lo"
    import mglaunch_recovery as mr

    store, port = agent_store(2)
    before = mr._sockets()
    pgs, errors = [None, None], []

    def build(rank):
        try:
            client = mr.dist.TCPStore("127.0.0.1", port, 2, False, timedelta(seconds=60))
            pgs[rank] = mr.dist.ProcessGroupGloo(mr.dist.PrefixStore("0", client), rank, 2, timedelta(seconds=60))
        except Exception as e:
            errors.append(e)

    ranks = [threading.Thread(target=build, args=(r,), daemon=True) for r in range(2)]
    for t in ranks:
        t.start()
    for t in ranks:
        t.join(120)
    if errors or None in pgs:
        fail(f"two ranks' Gloo groups on devices lo,lo did not form: {errors}")
    group = mr._GroupSockets(({"127.0.0.1"}, port))
    group.gloo = mr._gloo_records(store, 2)
    pairs, missed = 0, []
    for fd, ino in mr._sockets().items():
        if before.get(fd) == ino:
            continue
        with socket.socket(fileno=os.dup(fd)) as x:
            try:
                peer = x.getpeername()
            except OSError:
                continue  # a listener
            if port in (peer[1], x.getsockname()[1]):
                continue  # a store connection: a client's, or the store's (hosted here)
            pairs += 1
            if group._kind(x) != "gloo":
                missed.append((fd, x.getsockname(), peer))
    if pairs < 4:
        fail(f"two devices' pairs between two ranks not found: {pairs} connections")
    if missed:
        fail(f"{len(missed)} of {pairs} Gloo connections on two devices are not the group's (a pause would not free a "
             f"collective blocked on them): {missed}")
    print(f"gloo-devices: all {pairs} connections of two Gloo devices are the group's", flush=True)
    os._exit(0)  # the kept clients stay: their destructors are what a worker never runs


def group_sockets(work):
    """Which sockets a pause shuts and a let-go-of group makes quiet (_GroupSockets): only
    the group's, not a user's own (opened while the group forms); a connection the
    formation thread opens after the group was let go of is made quiet too; and a second
    pause racing the quiet loop never shuts a quiet socket a kept store client sleeps on."""
    sys.path.insert(0, os.path.join(SRC, "python"))
    import threading
    from unittest import mock

    import mglaunch_recovery as mr

    store, port = agent_store(2)

    def live_store_connections(before):
        """This process's TCP connections to the store opened since `before` and not made quiet."""
        out = []
        for fd, ino in mr._sockets().items():
            if before.get(fd) == ino:
                continue
            try:
                with socket.socket(fileno=os.dup(fd)) as s:
                    if s.family in (socket.AF_INET, socket.AF_INET6) and s.getpeername()[1] == port:
                        out.append(fd)
            except OSError:
                pass
        return out

    for k in [k for k in os.environ if k.startswith("MGLAUNCH_")]:
        del os.environ[k]
    rec = mr.Recovery()
    rec._channel = PauseChannel()

    # 1. A pause while the group forms, the formation thread slow to connect to the store
    # (it connects after the group was let go of); a user's connection opened meanwhile.
    os.environ.update(round_env(port, 0, 1, 0))
    entered, go = threading.Event(), threading.Event()
    real_store = mr.dist.TCPStore

    def slow_store(*args, **kwargs):
        entered.set()
        go.wait(60)
        return real_store(*args, **kwargs)

    before = mr._sockets()
    user = [None]
    with mock.patch.object(mr.dist, "TCPStore", slow_store):
        user[0] = pause_while_forming(mr, rec, entered, user_connection)
        rec._abandon()
        go.set()  # the left-behind formation thread now connects to the store, and ends
        join_left_behind()
        late = live_store_connections(before)
        if late:
            fail(f"store connections the formation thread opened after the group was let go of are neither closed nor "
                 f"quiet: fds {late} (torch 1.13's client thread spins on them once the store goes)")
    if not works(user[0]):
        fail("a pause while the group formed shut a user's own connection opened meanwhile")

    # 2. A group formed while a user's connection opened, then a pause and its let-go.
    rec._channel.pause = False
    os.environ.update(round_env(port, 0, 1, 1))
    mine = [None]

    def store_and_user(*args, **kwargs):
        mine[0] = user_connection()
        return real_store(*args, **kwargs)

    with mock.patch.object(mr.dist, "TCPStore", store_and_user):
        rec._form_group()
    rec._abort_group()
    rec._abandon()
    if not works(mine[0]):
        fail("the pause and let-go of a formed group shut a user's own connection opened while it formed")

    # 3. A second pause (shut(), the control reader thread) while quiet() (the main thread)
    # makes a store connection quiet between shut's check of the socket and its shutdown:
    # shut must not reach the quiet socket, on which the kept store client then sleeps.
    group = mr._GroupSockets(({"127.0.0.1"}, port))
    conn = socket.create_connection(("127.0.0.1", port), timeout=10)
    group.done()
    quiet = socket.socketpair()
    real_dup, raced = os.dup, []

    def dup_then_quiet(fd):  # the main thread's dup2 lands right after shut's first look at fd
        got = real_dup(fd)
        if fd == conn.fileno() and not raced:
            raced.append(fd)
            os.dup2(quiet[0].fileno(), fd)
        return got

    with mock.patch.object(mr.os, "dup", dup_then_quiet):
        group.shut()
    if not raced:
        fail("the race was not set up: shut() did not look at the store connection")
    quiet[1].setblocking(False)
    try:
        got = quiet[1].recv(1)
        fail(f"a pause racing the quiet loop shut the quiet socket down (its peer read {got!r}): every kept store "
             "client's thread would spin on it")
    except BlockingIOError:
        pass
    # 4. A number reused by a pipe between the look and the dup: the dup is closed, not leaked.
    r, w = os.pipe()
    pipe, dups = os.fstat(r).st_ino, []

    def recorded_dup(fd):
        dups.append(real_dup(fd))
        return dups[-1]

    with mock.patch.object(mr.os, "dup", recorded_dup):
        if group._open(r, pipe) is not None:
            fail("a pipe was taken for a socket")
    for d in dups:  # each still the pipe's (same inode) would be a leak; another file is another thread's reuse
        try:
            if os.fstat(d).st_ino == pipe:
                fail(f"a look at an fd reused by a pipe leaked its dup (fd {d})")
        except OSError:
            pass  # closed
    if not dups:
        fail("the look at the pipe's fd made no dup")
    os.close(r)
    os.close(w)
    print("group-sockets: a user's connections survived a pause while the group formed and after, a late store "
          "connection was made quiet, the quiet socket survived a racing pause", flush=True)
    os._exit(0)  # the kept clients stay: their destructors are what a worker never runs


def rng_case(work):
    """Per-rank RNG streams stay per rank through the state agreement (_agree)."""
    script = os.path.join(work, "agree.py")
    with open(script, "w") as f:
        f.write("import os, sys, torch, torch.distributed as dist\n"
                f"sys.path.insert(0, {os.path.join(SRC, 'python')!r})\n"
                "import mglaunch_recovery as mr\n"
                "rank = int(os.environ['RANK'])\n"
                "dist.init_process_group('gloo')\n"
                "torch.manual_seed(100 + rank)\n"
                "net = torch.nn.Linear(2, 2)\n"
                "rec = mr.Recovery()\n"
                "rec._module, rec._optimizer, rec._extra = net, torch.optim.SGD(net.parameters(), lr=0.1), []\n"
                "rec.step = int(sys.argv[1 + rank])\n"
                "rec._rng_at = {rec.step - 1: mr._rng_state()} if sys.argv[3:] else {}  # the source's last step\n"
                "torch.rand(1)  # drawn from during that step (a stream not drawn from is behind by nothing)\n"
                "own = torch.get_rng_state()\n"
                "rec._agree()\n"
                "print('step', rec.step, 'own' if torch.equal(own, torch.get_rng_state()) else 'taken', "
                "torch.rand(1).item(), flush=True)\n"
                # Both ranks done before the group goes: torch 1.13 aborted ("terminate called without
                # an active exception") once when the store's host tore it down at exit after its peer left.
                "dist.barrier()\n"
                "dist.destroy_process_group()\n")
    for steps, want in (((5, 3), "own"), ((5, 0), "taken"), ((5, 4, "history"), "own")):
        port = free_port()
        env = {k: v for k, v in ENV.items() if not k.startswith("MGLAUNCH_")}
        env.update(WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        ranks = [Proc(["/usr/bin/python3", script, *map(str, steps)], work, f"agree{r}-{'-'.join(map(str, steps))}", dict(env, RANK=str(r)))
                 for r in (0, 1)]
        for p in ranks:
            if p.wait(120) != 0:
                fail(f"exit {p.p.returncode}", *ranks)
        out = [[l for l in p.out().splitlines() if l.startswith('step ')][-1:][0].split() if 'step ' in p.out() else []
               for p in ranks]
        if out[1][:3] != ["step", "5", want] or out[0][2] != "own":
            fail(f"rank 1 at step {steps[1]}, rank 0 at 5: want rank 1 at step 5 with the generator state {want}, "
                 f"got {out}", *ranks)
        if (out[1][3] == out[0][3]) != (want == "taken"):
            fail(f"the two ranks' next draws: {out[0][3]} and {out[1][3]}, want them {'equal' if want == 'taken' else 'different'}",
                 *ranks)
        if len(steps) > 2 and "keeps its own RNG stream (torch" not in ranks[1].out():
            fail("a rank behind whose stream differs from the source's at its step did not say it keeps its own", *ranks)
    print("rng: a rank behind with steps of its own kept its generator (its stream not the source's at its step), a "
          "fresh one took the source's", flush=True)


def agent_store(world):
    """(store, port): the agent's store (TORCHELASTIC_USE_AGENT_STORE=True), hosted here as
    an agent does, so that a test sees the workers' keys. A port found free may be taken
    before the store binds it (a -j8 run saw EADDRINUSE): another, at most 5."""
    from datetime import timedelta

    import torch.distributed as dist

    for attempt in range(5):
        port = free_port()
        try:
            return dist.TCPStore("127.0.0.1", port, world, True, timedelta(seconds=60), wait_for_workers=False), port
        except RuntimeError as e:
            if "Address already in use" not in str(e) or attempt == 4:
                raise


def round_env(port, rank, world, restart):
    """A round's environment as the agent gives it (assign's env), the agent's store at port."""
    return {"RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "TORCHELASTIC_RESTART_COUNT": str(restart), "TORCHELASTIC_USE_AGENT_STORE": "True",
            "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": str(rank), "LOCAL_RANK": "0"}


def example_worker(work, name, agent, port, rank, world, restart, train, script=EXAMPLE, env=()):
    """The example (or `script`) as a worker of round `restart` whose agent is `agent` (a FakeAgent)."""
    env = dict(ENV, MGLAUNCH_CONTROL_SOCKET=agent.name, PYTHONPATH=os.path.join(SRC, "python"),
               **round_env(port, rank, world, restart), **dict(env))
    env.pop("MGLAUNCH_STANDBY", None)
    return Proc(["/usr/bin/python3", script, *train, "--summary-json", work + f"/{name}.json"], work, name, env)


def pause_forming(work):
    """A pause while the group forms with a peer missing must end the formation at once."""
    store, port = agent_store(3)
    train = ["--model", "mlp", "--batch-size", "8", "--steps", "3", "--seed", "5", "--train-subset", "256",
             "--timeout", "3600"]  # a wait for the timeout fails this test (its bound is 120 s)

    def worker(name, agent, rank, world, restart):
        return example_worker(work, name, agent, port, rank, world, restart, train)

    def keys():
        return store.num_keys()

    restart = 0
    for phase in ("never joins", "joins Gloo, never registers"):
        agent = FakeAgent()
        a = worker(f"a{restart}", agent, 0, 2, restart)
        agent.accept(120, a)
        before = keys()
        peer = None
        if phase != "never joins":
            # A peer that forms Gloo's connections (the group's own prefix: the attempt's, then
            # init_process_group's group name "0") and then stops, as one SIGKILLed right after.
            peer = Proc(["/usr/bin/python3", "-c",
                         "import sys, time, datetime, torch.distributed as d\n"
                         f"s = d.PrefixStore('/worker/attempt_{restart}/0', d.TCPStore('127.0.0.1', {port}, 2, False,"
                         " datetime.timedelta(seconds=3600)))\n"
                         "g = d.ProcessGroupGloo(s, 1, 2, datetime.timedelta(seconds=3600))\n"
                         "print('formed', flush=True)\ntime.sleep(3600)"], work, f"peer{restart}")
            eventually(lambda: "formed" in peer.out(), 120, "the peer's Gloo connections", a, peer)
        else:
            eventually(lambda: keys() > before, 120, "the worker's address in the store (its group forming)", a)
        time.sleep(0.5)  # not a wait for a condition: the worker goes on waiting for its peer meanwhile
        t0 = time.monotonic()
        agent.send({"type": "pause", "round": restart + 1, "reason": f"test: a peer {phase}", "lost": "host"})
        paused = agent.expect("paused", 120, a)
        took = time.monotonic() - t0
        print(f"a peer that {phase}: the worker answered the pause in {took:.2f} s (its timeout: 3600 s)", flush=True)
        if peer is not None:
            os.killpg(peer.p.pid, signal.SIGKILL)
            peer.wait(30)
        # The next round: the worker and a fresh peer (a new process, at step 0) train to the end.
        restart += 1
        fresh_agent = FakeAgent()
        b = worker(f"b{restart}", fresh_agent, 1, 2, restart)
        fresh_agent.accept(120, a, b)
        agent.send({"type": "assign", "round": restart + 1, "restart_count": restart,
                    "env": round_env(port, 0, 2, restart)})
        for p in (a, b):
            if p.wait(300) != 0:
                fail(f"after a pause while a peer {phase}: {os.path.basename(p.out_path)} exited with "
                     f"{p.p.returncode}", a, b)
        sa, sb = summary(work + f"/a{restart - 1}.json"), summary(work + f"/b{restart}.json")
        if sa["steps"] != 3 or sb["steps"] != 3 or sa["weights_sha256"] != sb["weights_sha256"]:
            fail(f"after a pause while a peer {phase}: {sa} {sb}", a, b)
        if paused.get("step") != 0:
            fail(f"the paused answer said step {paused.get('step')}, want 0", a)
        agent.close()
        fresh_agent.close()
        restart += 1
    print("pause-forming: both pauses answered at once, the next rounds trained", flush=True)


def rng_behind(work):
    """A step applied on some ranks only: rank 1 fails after DDP's all-reduce of step K and
    before its optimizer step, rank 0 applies it. The example seeds every rank alike
    (dropout masks shared), so after the state agreement rank 1 must draw step K+1's masks
    as an undisturbed run does: the final weights equal that run's."""
    store, port = agent_store(2)
    steps, fail_at = 8, 4  # rank 1's 4th backward (step 4) fails after its all-reduce
    train = ["--model", "mlp", "--batch-size", "8", "--steps", str(steps), "--seed", "5", "--train-subset", "256",
             "--timeout", "300"]
    script = os.path.join(work, "fail_after_allreduce.py")
    with open(script, "w") as f:
        f.write("import os, runpy, sys, torch\n"
                "calls = [0]\n"
                "real = torch.Tensor.backward\n"
                "def backward(self, *args, **kwargs):\n"
                "    real(self, *args, **kwargs)  # DDP's gradient all-reduce has ended on both ranks\n"
                "    calls[0] += 1\n"
                "    if os.environ['RANK'] == '1' and calls[0] == int(os.environ.get('MGTEST_FAIL_BACKWARD', 0)):\n"
                "        print('injected', file=sys.stderr, flush=True)\n"
                "        raise RuntimeError('[test] Connection closed by peer (before this rank applied its step)')\n"
                "torch.Tensor.backward = backward\n"
                f"sys.argv[0] = {EXAMPLE!r}\n"
                f"runpy.run_path({EXAMPLE!r}, run_name='__main__')\n")

    def run(tag, restart, disturbed):
        agents = [FakeAgent(), FakeAgent()]
        fault = {"MGTEST_FAIL_BACKWARD": str(fail_at if disturbed else 0)}
        ranks = [example_worker(work, f"{tag}{r}", agents[r], port, r, 2, restart, train, script, fault) for r in (0, 1)]
        for a in agents:
            a.accept(120, *ranks)
        if disturbed:
            eventually(lambda: "injected" in ranks[1].err(), 120, "rank 1's failure after its all-reduce", *ranks)
            eventually(lambda: f"step {fail_at} " in ranks[0].out(), 120, f"rank 0's step {fail_at}", *ranks)
            for a in agents:
                a.send({"type": "pause", "round": 2, "reason": "test: step applied on rank 0 only", "lost": "peer"})
            said = [a.expect("paused", 120, *ranks).get("step") for a in agents]
            if said != [fail_at, fail_at - 1]:
                fail(f"the ranks paused at steps {said}, want {[fail_at, fail_at - 1]} (a step applied on rank 0 only)",
                     *ranks)
            for r, a in enumerate(agents):
                a.send({"type": "assign", "round": 2, "restart_count": restart + 1,
                        "env": round_env(port, r, 2, restart + 1)})
        for p in ranks:
            if p.wait(300) != 0:
                fail(f"{tag}: {os.path.basename(p.out_path)} exited with {p.p.returncode}", *ranks)
        for a in agents:
            a.close()
        return [summary(work + f"/{tag}{r}.json") for r in (0, 1)], ranks

    (calm, _), restart = run("calm", 0, False), 1
    (hit, ranks) = run("hit", restart, True)
    want = calm[0]["weights_sha256"]
    if "took step 4's state from rank 0 (it was at step 3)" not in ranks[1].out():
        fail("rank 1 did not take rank 0's state", *ranks)
    if "keeps its own RNG stream" in ranks[1].out():
        fail("rank 1 said it keeps its own RNG stream, but the example draws only from torch's, which every rank "
             "shares (random's and numpy's, seeded per process, are never drawn from)", *ranks)
    if hit[0]["steps"] != steps or [s["weights_sha256"] for s in hit] != [want, want]:
        fail(f"a rank behind by one step: the final weights {[s['weights_sha256'] for s in hit]} differ from the "
             f"undisturbed run's {want} (its generator one step out of place)", *ranks)
    print("rng-behind: a rank behind by one step drew the undisturbed run's dropout masks, the same weights", flush=True)


def import_case(bin_dir, work):
    """A worker mglaunch starts imports the shipped package with no install step, and the
    inherited PYTHONPATH comes after it."""
    script = os.path.join(work, "where.py")
    with open(script, "w") as f:
        f.write("import os, mglaunch_recovery\nprint(os.path.realpath(mglaunch_recovery.__file__))\n"
                "print(os.environ['PYTHONPATH'])\n")
    env = dict(ENV, PYTHONPATH="/nonexistent/inherited")
    p = Proc([os.path.join(bin_dir, "mglaunch"), "--standalone", "--nproc_per_node=1", "--python=/usr/bin/python3",
              script], work, "import", env)
    if p.wait(120) != 0:
        fail(f"exit {p.p.returncode}", p)
    shipped = os.path.realpath(os.path.join(bin_dir, "..", "share", "mglaunch", "python"))
    lines = [l.split(":", 1)[1] for l in p.out().splitlines() if l.startswith("[rank0]:")]
    want = [os.path.join(os.path.realpath(os.path.join(SRC, "python")), "mglaunch_recovery", "__init__.py"),
            os.path.join(bin_dir, "..", "share", "mglaunch", "python") + ":/nonexistent/inherited"]
    if len(lines) != 2 or lines[0] != want[0] or os.path.realpath(lines[1].split(":")[0]) != shipped or \
            not lines[1].endswith(":/nonexistent/inherited"):
        fail(f"the worker printed {lines}, want {want}", p)


def unit(work):
    sys.path.insert(0, os.path.join(SRC, "python"))
    import gc
    import io
    import weakref
    from unittest import mock

    import numpy
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    import mglaunch_recovery as mr

    # 1. torch 2.6 loads with weights_only=True by default, which refuses numpy's ndarray
    # (1.13 has the same loader): the RNG state must load that way, the whole state too.
    numpy.random.seed(5)
    numpy.random.rand(3)
    rng = mr._rng_state()
    want = numpy.random.rand()
    try:
        got = torch.load(io.BytesIO(mr._pack({"rng": rng})), weights_only=True)
    except Exception as e:
        fail(f"the RNG state does not load with weights_only=True: {type(e).__name__}: {str(e)[:150]}")
    load = torch.load
    def load26(f, map_location=None, *, weights_only=True):  # torch 2.6's default
        return load(f, map_location=map_location, weights_only=weights_only)

    with mock.patch.object(torch, "load", load26):
        try:  # a sampler's own state (an ndarray) in `state`, loaded with 2.6's default
            mr._unpack(mr._pack({"rng": rng, "extra": [{"perm": numpy.arange(4)}]}))
        except Exception as e:
            fail(f"a survivor's state does not load under torch 2.6's default: {type(e).__name__}: {str(e)[:150]}")
    mr._set_rng_state(got["rng"])
    if numpy.random.rand() != want:
        fail("numpy's RNG state did not come back")

    # 2. Only a lost peer's errors wait for a pause; a user's bug is raised at once.
    lost = ["[../third_party/gloo/gloo/transport/tcp/pair.cc:598] Connection closed by peer [127.0.0.1]:41234",
            "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 20000ms for recv operation",
            "Connection reset by peer", "Broken pipe", "Socket Timeout", "NCCL error in: ProcessGroupNCCL.cpp:1191",
            "[c10d] The client socket has timed out after 20s while trying to connect"]
    bugs = ["Trying to backward through the graph a second time (or directly access saved tensors after they have "
            "already been freed). Saved intermediate values of the graph are freed when you call .backward()",
            "the thread is not ready", "mat1 and mat2 shapes cannot be multiplied (16x784 and 10x10)",
            "Expected all tensors to be on the same device: the store of results", "cannot send the batch"]
    wrong = [m for m in lost if not mr._is_collective_failure(RuntimeError(m))] + \
            [m for m in bugs if mr._is_collective_failure(RuntimeError(m))] + \
            [m for m in lost[:1] if mr._is_collective_failure(ValueError(m))]
    if wrong:
        fail(f"misclassified as (not) a lost peer: {wrong}")

    # 3. A pause stays pending until an assign answers it (a wait that times out keeps it).
    ch = object.__new__(mr._Channel)
    ch._cv, ch._welcomed, ch._closed, ch._pause, ch._assign = mr.threading.Condition(), True, "", None, None
    ch._on_pause = lambda: None
    ch._handle(b'{"type": "pause", "round": 2, "reason": "a node lost", "lost": "host"}')
    if ch.wait_assign(0.01) is not None or not ch.paused():
        fail("a wait for the assign that timed out dropped the pending pause")
    ch._handle(b'{"type": "assign", "round": 2, "env": {"RANK": "0"}}')
    if ch.wait_assign(0.01) is None or ch.paused():
        fail("the assign did not end the pause")

    # 4. NCCL's error handling: torch 1.x takes only 0/1 (left alone), 2.x gets 2 for the agent's 1.
    for major, env, expect in [(1, {"NCCL_ASYNC_ERROR_HANDLING": "1"}, {"NCCL_ASYNC_ERROR_HANDLING": "1"}),
                               (2, {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}, {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
                                                                             "NCCL_ASYNC_ERROR_HANDLING": "2"}),
                               (2, {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "NCCL_ASYNC_ERROR_HANDLING": "0"},
                                {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "NCCL_ASYNC_ERROR_HANDLING": "0"})]:
        mr._nccl_error_handling(env, major)
        if env != expect:
            fail(f"torch {major}.x: NCCL error handling {env}, want {expect}")

    # 5. A peer lost in DDP's rebuild (its constructor's collectives) goes back to the next
    # pause instead of out of run(); the abandoned DDP is freed (only the group is kept).
    class Channel:
        closed = ""
        sent = []

        def paused(self):
            return False

        def wait_pause(self, timeout):
            return {"round": 1, "reason": "a node lost", "lost": "host", "at": time.monotonic()}

        def wait_assign(self, timeout):
            return {"round": 1, "restart_count": 1, "env": {}}

        def send(self, msg):
            self.sent.append(msg)

    rec = mr.Recovery()
    rec._channel = Channel()
    net = torch.nn.Linear(2, 2)
    rec._module, rec._optimizer = net, torch.optim.SGD(net.parameters(), lr=0.1)
    rec._form_group = lambda: dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    rec._agree = lambda: None
    wraps = []

    def wrap(m):
        wraps.append(m)
        if len(wraps) == 1:
            raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:598] Connection closed by peer")
        return DDP(m)

    rec._wrap = wrap
    rec._form_group()
    rec.model = DDP(net)
    old = weakref.ref(rec.model)
    try:
        rec._recover("a peer lost")
    except RuntimeError as e:
        fail(f"a peer lost in DDP's rebuild ended the worker: {e}")
    gc.collect()
    if len(wraps) != 2 or not isinstance(rec.model, DDP) or len(rec._channel.sent) != 2:
        fail(f"want a second pause answered and the model wrapped again: {len(wraps)} wraps, {rec._channel.sent}")
    if old() is not None:
        fail("the abandoned DDP is still alive (its buckets stay for good: memory grows per recovery)")
    # 6. A step that fails after its optimizer.step() (a logging all_reduce after it) is not
    # redone (the update would be applied twice): a clear error instead.
    calls = []

    def late_collective(step):
        calls.append(step)
        rec._optimizer.step()
        if len(calls) == 1:
            raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:598] Connection closed by peer")

    rec._wrap = DDP
    rec._count_optimizer_steps(rec._optimizer)
    try:
        rec.run(late_collective, 1)
        fail(f"a step that failed after its optimizer.step() was redone: {len(calls)} calls")
    except RuntimeError as e:
        if "twice" not in str(e):
            raise
    print("unit: the RNG state loads with weights_only, errors classified, a pause kept until its assign, "
          "NCCL's error handling, DDP's rebuild recovered, the old DDP freed, a failure after opt.step() not redone",
          flush=True)


def main():
    bin_dir, case = sys.argv[1], sys.argv[2]
    work = sys.argv[3] if len(sys.argv) > 3 else tempfile.mkdtemp(prefix="py_recovery.")
    os.makedirs(work, exist_ok=True)
    try:
        if case == "reference":
            reference(bin_dir, work)
        elif case == "done-when":
            done_when(bin_dir, work)
        elif case == "torchrun":
            torchrun(work)
        elif case == "torch2":
            torch2(bin_dir, work)
        elif case == "quiet-store":
            quiet_store(bin_dir, work)
        elif case == "import":
            import_case(bin_dir, work)
        elif case == "off":
            off(work)
        elif case == "store-server":
            store_server(work)
        elif case == "rng":
            rng_case(work)
        elif case == "group-sockets":
            group_sockets(work)
        elif case == "left-behind":
            left_behind(work)
        elif case == "pause-in-gloo":
            pause_in_gloo(work)
        elif case == "gloo-devices":
            gloo_devices(work)
        elif case == "rng-behind":
            rng_behind(work)
        elif case == "pause-forming":
            pause_forming(work)
        elif case == "unit":
            unit(work)
        else:
            print(f"unknown case {case!r}")
            sys.exit(2)
    finally:
        stop_all()
    print("passed")


if __name__ == "__main__":
    main()
