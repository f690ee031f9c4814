"""In-place recovery for plain torch.distributed scripts started by mglaunch.

The worker side of mglaunch's control protocol (docs/in-place-recovery.md) in pure Python
(the standard library and torch): when a peer is lost, the worker is not restarted. It
lets go of its process group (Gloo; NCCL's abort on CUDA) and keeps its model, optimizer,
RNG and data position; on the agent's `assign` it builds a new group under the new round's
store prefix, the ranks agree on the most advanced state (the lowest rank among those with
the highest step broadcasts it) and the interrupted step is redone. A standby's pre-started
worker (MGLAUNCH_STANDBY=1, mglaunch --prestart-standby) loads its data and builds its
model before it has a rank, and takes its state from the survivors when placed.

    rec = mglaunch_recovery.Recovery()          # first: says hello to the agent
    ... load the data, build the model and the optimizer (no rank needed) ...
    rec.start(net, opt, wrap=DDP)               # a standby waits here for its place
    rec.run(train_step, total_steps)            # train_step(step) uses rec.model, rec.rank

Under torchrun, or without mglaunch's control channel, it does nothing (one line on rank
0 says so): start() is init_process_group plus wrap, run() a plain loop. mglaunch puts this
package's directory on its workers' PYTHONPATH (docs/python-recovery.md)."""
import contextlib
import ctypes
import inspect
import io
import json
import os
import random
import re
import socket
import stat
import struct
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["Recovery"]

PROTOCOL_VERSION = 1
MAX_LINE = 64 * 1024  # the protocol's bound on one message
RECOVERY_ATTEMPTS = 8  # recoveries in a row from one step before giving up (as mgtrain)
# What a failed collective or store call says (Gloo's messages name its source file, NCCL's
# and c10d's name themselves; the store's are the socket errors): a peer lost, not a bug. Whole
# phrases only: an ordinary error ("... have already been freed") must not wait for a pause.
_COLLECTIVE_ERRORS = re.compile(r"gloo|nccl|processgroup|c10d|tcpstore|connection (?:closed|reset|refused)|"
                                r"broken pipe|socket timeout|wait timeout|timed out waiting|no route to host|"
                                r"network is unreachable|transport endpoint", re.IGNORECASE)


def _say(msg):
    print(f"mglaunch_recovery: {msg}", file=sys.stderr, flush=True)


class _Channel:
    """The control connection to the agent: hello, then a reader thread that records the
    pause and assign it sends (a pause also calls `on_pause`, from the reader thread)."""

    def __init__(self, name, local_rank, standby, on_pause, welcome_timeout=10.0):
        if len(name) < 2 or name[0] != "@":
            raise OSError(f"MGLAUNCH_CONTROL_SOCKET={name!r} is not an abstract socket name (@name)")
        self._local_rank = local_rank
        self._on_pause = on_pause
        self._cv = threading.Condition()
        self._welcomed = False
        self._closed = ""  # why the channel closed; "" while open
        self._pause = None
        self._assign = None
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.connect("\0" + name[1:])
        except OSError as e:
            self._sock.close()
            raise OSError(f"cannot connect to the agent's control socket {name}: {e.strerror or e}") from None
        hello = {"type": "hello", "version": PROTOCOL_VERSION, "pid": os.getpid(), "local_rank": local_rank,
                 "in_place": True}
        if standby:
            hello["standby"] = True
        self.send(hello)
        threading.Thread(target=self._read, name="mglaunch-control", daemon=True).start()
        with self._cv:
            self._cv.wait_for(lambda: self._welcomed or self._closed, welcome_timeout)
            if not self._welcomed:
                why = self._closed or f"no welcome within {welcome_timeout:g} s"
                self._sock.close()
                raise OSError(f"the agent's control socket {name} did not welcome this worker: {why}")

    def send(self, msg):
        try:
            self._sock.sendall((json.dumps(msg) + "\n").encode())
            return True
        except OSError:
            return False

    def withdraw(self):
        self.send({"type": "hello", "version": PROTOCOL_VERSION, "pid": os.getpid(), "local_rank": self._local_rank,
                   "in_place": False})

    def _read(self):
        buf = b""
        why = "the agent closed the control channel"
        while True:
            try:
                chunk = self._sock.recv(4096)
            except OSError as e:
                why = f"reading the control channel failed: {e}"
                break
            if not chunk:
                break
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                self._handle(line)
            if len(buf) > MAX_LINE:
                why = "the agent sent a control message over 64 KiB"
                break
        with self._cv:
            self._closed = self._closed or why
            self._cv.notify_all()

    def _handle(self, line):
        try:
            msg = json.loads(line)
        except ValueError:
            return
        kind = msg.get("type") if isinstance(msg, dict) else None
        fire = False
        with self._cv:
            if kind == "welcome":
                self._welcomed = True
            elif kind == "pause":
                at = self._pause["at"] if self._pause else time.monotonic()  # a second pause: timed from the first
                self._pause = {"round": msg.get("round", 0), "reason": msg.get("reason", "the agent starts a new round"),
                               "lost": msg.get("lost", "peer"), "at": at}
                self._assign = None  # an assign before this pause is for a round that already ended
                fire = True
            elif kind == "assign":
                env = msg.get("env") if isinstance(msg.get("env"), dict) else {}
                self._assign = {"round": msg.get("round", 0), "restart_count": msg.get("restart_count", 0),
                                "env": {k: v if isinstance(v, str) else json.dumps(v) for k, v in env.items()}}
            elif kind == "error":
                self._closed = "the agent refused: " + str(msg.get("message", "(no message)"))
            self._cv.notify_all()
        if fire:
            self._on_pause()

    def paused(self):
        with self._cv:
            return self._pause is not None

    def wait_pause(self, timeout):
        """The pending pause (an assign with no pause before it counts as one), or None."""
        with self._cv:
            self._cv.wait_for(lambda: self._pause or self._assign or self._closed, timeout)
            if self._pause:
                return dict(self._pause)
            if self._assign:
                return {"round": self._assign["round"], "reason": "a new round", "lost": "peer", "at": time.monotonic()}
            return None

    def wait_assign(self, timeout):
        """The assignment after the last pause (None: timeout or closed); clears both."""
        with self._cv:
            self._cv.wait_for(lambda: self._assign or self._closed, timeout)
            got = self._assign
            if got is not None:  # only an assign ends the pause (as mgtrain: a pause stays until answered)
                self._assign = self._pause = None
            return got

    @property
    def closed(self):
        with self._cv:
            return self._closed


def _sockets():
    """{fd: inode} of this process's open sockets."""
    out = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            st = os.fstat(int(name))
        except OSError:
            continue
        if stat.S_ISSOCK(st.st_mode):
            out[int(name)] = st.st_ino
    return out


def _sockaddr_bytes(family, addr):
    """The bytes of a struct sockaddr_in/sockaddr_in6 as Gloo publishes its addresses in
    the store (raw, inside each rank's record): family in host order, then the port."""
    if family == socket.AF_INET:
        return struct.pack("=H", family) + struct.pack(">H", addr[1]) + socket.inet_aton(addr[0])
    return struct.pack("=H", family) + struct.pack(">HI", addr[1], addr[2]) + \
        socket.inet_pton(socket.AF_INET6, addr[0].split("%")[0])


def _plain_ip(ip):
    return ip[7:] if ip.startswith("::ffff:") else ip  # IPv4-mapped: as IPv4


class _GroupSockets:
    """The TCP sockets of one process group: its store client's connections (their peer is
    the store's address) and Gloo's (either end is an address a rank of the group published
    in the store), each new since the group began to form and told apart by its inode, so
    that a number reused later is never touched. Any other socket the process opens
    meanwhile (a user's data loader, metrics) is never touched.

    shut(), at the agent's pause (from the control reader thread), shuts each of them down:
    a collective or store call blocked on one fails at once, here and at the peer, and
    every later call on them fails at once too. quiet(), once the group is let go of (the
    main thread, not inside a torch call of this group), puts in place of each store
    client connection one end of a socket pair nobody writes to: torch 1.13's store client
    thread polls its connection and peeks at it, busy-looping a core once it is closed (a
    store host SIGKILLed, or shut here); on the quiet socket its poll() or its blocking
    peek sleeps for good (a pipe would fail the peek, an exception that ends the process).
    Each connection gets a socket pair of its own (its other end kept, never written), so
    that a store call on one (a socket option set, a wait) touches no other kept client's.
    Not at the pause itself: a store call made after it on a quiet socket would wait for
    ever (init_process_group's store barrier polls the store every 10 ms). A formation
    thread let go of meanwhile (a pause) makes quiet what it opens after that itself
    (made()): only what that one constructor opened, never a connection another group
    claimed (_claimed: a newer round on the same store, formed while Gloo's constructor
    waited for a peer). One lock for all groups: shut() and quiet() run on different
    threads."""

    _quiet = []  # the other end of each quiet socket pair: never written nor closed
    _lock = threading.Lock()
    _claimed = {}  # {fd: inode}: the connections of every group not let go of (under _lock)

    def __init__(self, store_addr):
        self.store_ips, self.store_port = store_addr
        self.before = _sockets()
        self.gloo = []  # each rank's Gloo record in the store (bytes); none known: no connection is Gloo's
        self.known = {}  # {fd: (inode, "store" or "gloo")}: the group's connections found so far
        self.server_own = {}  # {fd: inode} of a store server's own connections (a TCPStore(is_master=True))
        self.server_forming = False  # that server's constructor runs: a store connection now may be its own
        self.fixed = False  # done(): formed, `known` is the whole group
        self.store_made = False  # the formation thread's store client exists (its constructor returned)
        self.forming = True  # the formation thread runs
        self.abandoned = False  # quiet() ran: let go of for good

    def _find(self, window=None):
        """Records the group's connections among the sockets opened since `before` (or since
        `window`, a snapshot taken just before one constructor: only what it opened); a
        connection another group (a newer round's, on the same store) claimed is not this
        group's."""
        if self.fixed:
            return
        since = self.before if window is None else window
        for fd, ino in _sockets().items():
            if since.get(fd) == ino or fd in self.known and self.known[fd][0] == ino:
                continue
            if self.server_own.get(fd) == ino:
                continue  # this process's store server's own: stopped whole when the group is let go of
            if _GroupSockets._claimed.get(fd) == ino:
                continue  # another group's (a newer round formed while this one's thread was left behind)
            got = self._open(fd, ino)
            if got is None:
                continue
            sock, kind = got
            sock.close()
            if kind == "store" and self.server_forming:
                continue  # perhaps the server's own, known once its constructor returns (never shut: H1)
            if kind is not None:
                self.known[fd] = (ino, kind)
                if not self.abandoned:
                    _GroupSockets._claimed[fd] = ino

    def _open(self, fd, ino, kind=None):
        """(a dup of fd as a socket, its kind: "store", "gloo" or None) while fd is still
        the TCP socket of inode `ino`; None otherwise. The one dup is what is checked and
        what is shut: fd itself may be made quiet meanwhile."""
        try:
            dup = os.dup(fd)
        except OSError:
            return None
        try:
            sock = socket.socket(fileno=dup)
        except OSError:  # fd closed and reused by a file or pipe meanwhile (ENOTSOCK): the dup is ours to close
            os.close(dup)
            return None
        try:
            if os.fstat(sock.fileno()).st_ino != ino or sock.family not in (socket.AF_INET, socket.AF_INET6):
                sock.close()  # closed and reused, made quiet (AF_UNIX), or not TCP
                return None
            if kind is None:
                kind = self._kind(sock)
            return sock, kind
        except OSError:
            sock.close()
            return None

    def _kind(self, sock):
        try:
            local, peer = sock.getsockname(), sock.getpeername()
        except OSError:
            return None  # listening or not connected
        if local[1] == self.store_port and _plain_ip(local[0]) in self.store_ips:
            return None  # this process hosts the store: its server's side stays (parked)
        if peer[1] == self.store_port and _plain_ip(peer[0]) in self.store_ips:
            return "store"
        ends = (_sockaddr_bytes(sock.family, local), _sockaddr_bytes(sock.family, peer))
        if any(end in record for record in self.gloo for end in ends):
            return "gloo"  # accepted on this rank's published address, or connected to a peer's
        return None

    def made(self, window, store=False, gloo=False):
        """From the formation thread after each constructor (`window`: the sockets just
        before it): what it made is recorded (and claimed, so that a thread of an older
        group left behind never takes it), and if the group was let go of meanwhile (a
        pause), the store connections that constructor opened are made quiet now and
        _Interrupted. Only those: the thread may end minutes after the pause (Gloo's wait
        for a peer that never connects), when a newer round's connections to the same store
        and a user's exist."""
        with _GroupSockets._lock:
            self.store_made = self.store_made or store
            if gloo is not False and not self.abandoned:
                self.gloo = gloo
            if self.abandoned:
                if store:
                    self._find(window)
                self._shut(scan=False)
                self._quiet_store()
                raise _Interrupted("the group was let go of while it formed")
            self._find(window)

    def formed(self):
        """From the formation thread, as it ends (done or failed): an abandoned group's
        connections found so far are shut and made quiet again. No new look: what a
        constructor that failed opened, it closed."""
        with _GroupSockets._lock:
            self.forming = False
            if self.abandoned:
                self._shut(scan=False)
                self._quiet_store()

    def done(self):
        """The group formed (registered): its connections are the ones found now."""
        with _GroupSockets._lock:
            self._find()
            self.fixed = True
            self.forming = False

    def shut(self):
        with _GroupSockets._lock:
            self._shut()

    def _shut(self, scan=True):
        if scan:
            self._find()
        for fd, (ino, kind) in self.known.items():
            got = self._open(fd, ino, kind)
            if got is None:
                continue
            sock = got[0]
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()  # the dup; fd stays, now a socket that fails every call at once

    def quiet(self):
        with _GroupSockets._lock:
            self.abandoned = True
            self._shut()
            for fd, (ino, kind) in self.known.items():
                if _GroupSockets._claimed.get(fd) == ino:
                    del _GroupSockets._claimed[fd]
            if self.store_made or not self.forming:  # not while the store client's constructor still uses them
                self._quiet_store()

    def _quiet_store(self):
        for fd, (ino, kind) in list(self.known.items()):
            if kind != "store":
                continue
            try:
                if os.fstat(fd).st_ino != ino:
                    continue  # closed and reused, or quiet already
                ours, other = socket.socketpair()
                _GroupSockets._quiet.append(other)
                with ours:
                    os.dup2(ours.fileno(), fd)  # fd now holds the pair's end: closing `ours` leaves it
            except OSError:
                pass


def _fresh(group):
    """The sockets now, before a constructor of the formation thread; _Interrupted when its
    group was let go of already (a thread left behind builds nothing more)."""
    if group.abandoned:
        raise _Interrupted("the group was let go of while it formed")
    return _sockets()


def _gloo_devices():
    """How many devices ProcessGroupGloo(store, rank, size, timeout) makes: one per
    interface in GLOO_SOCKET_IFNAME (comma-separated; torch 1.13's and 2.6's binding), one
    default device without it."""
    names = os.environ.get("GLOO_SOCKET_IFNAME", "")
    return len(names.split(",")) if names else 1


def _gloo_records(store, world, interrupted=lambda: False):
    """Each rank's record of its Gloo addresses, as Gloo published them in the store (under
    init_process_group's group name "0", then ProcessGroupGloo's device number: 0, 1, ...
    with several devices (GLOO_SOCKET_IFNAME=eth0,eth1), each its own pairs; torch 1.13's
    Gloo writes raw addresses, 2.6's a record with its host name: each holds the struct
    sockaddr of the address the rank's pairs listen on). [] when they cannot be read: then
    no connection is taken for Gloo's (never a user's), and one line says so unless a pause
    (interrupted()) came meanwhile, whose shut connections are why."""
    try:
        got = []
        for device in range(_gloo_devices()):
            records = dist.PrefixStore(str(device), dist.PrefixStore("0", store))
            for r in range(world):
                records.wait([str(r)], timedelta(seconds=5))
                got.append(bytes(records.get(str(r))))
        return got
    except Exception as e:  # another torch's layout
        if not interrupted():
            _say(f"Gloo's addresses are not in the store as expected ({str(e).splitlines()[0] if str(e) else e}): a "
                 "pause cannot free a collective blocked on Gloo's connections before Gloo's own timeout")
        return []


def _keep(obj):
    """Never destroyed, not even at exit: an abandoned group or store may hold a thread blocked
    on a lost peer or on the quiet socket, which its destructor would join for ever (mgtrain
    keeps them the same way)."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))


def _reset_group_count():
    """init_process_group names its group after a counter that only destroy_process_group
    sets back to 0 ("to allow consistent value to be generated when we re-create process
    groups after some trainers recover from failure", torch's own words); a registration
    that failed before its group existed (a pause) leaves it counted, and this rank would
    then use other keys than a fresh peer (torch 1.13: its store barrier's). torch 1.x:
    _group_count; 2.x: _world.group_count."""
    c10d = dist.distributed_c10d
    world = getattr(c10d, "_world", None)
    if world is not None and hasattr(world, "group_count"):
        world.group_count = 0
    elif hasattr(c10d, "_group_count"):
        c10d._group_count = 0


class _HandBack(type):
    """The stand-in for torch's ProcessGroupGloo class in distributed_c10d (_registering):
    its first call hands back the group built, later ones build as the real class does;
    isinstance() and attributes are the real class's (torch 2.x asserts the type)."""

    def __call__(cls, *args, **kwargs):
        if cls.pending:
            return cls.pending.pop()
        return cls.real(*args, **kwargs)  # a second group (TORCH_DISTRIBUTED_DEBUG=DETAIL's wrapper's helper)

    def __instancecheck__(cls, obj):
        return isinstance(obj, cls.real)

    def __getattr__(cls, name):
        return getattr(cls.real, name)


@contextlib.contextmanager
def _registering(pg):
    """init_process_group("gloo") inside this block registers `pg` (a ProcessGroupGloo
    already connected on the formation thread) as the default group, named and kept as
    it registers its own, instead of building and connecting another one: torch's
    ProcessGroupGloo in distributed_c10d, which init_process_group calls once, hands back
    `pg` for the block. None (NCCL): nothing replaced."""
    if pg is None:
        yield
        return
    c10d = dist.distributed_c10d
    real = c10d.ProcessGroupGloo
    stand_in = _HandBack("ProcessGroupGloo", (), {"real": real, "pending": [pg]})
    c10d.ProcessGroupGloo = stand_in
    try:
        yield
    finally:
        c10d.ProcessGroupGloo = real
    if stand_in.pending:
        raise RuntimeError(f"torch {torch.__version__}'s init_process_group did not build its Gloo group through "
                           "distributed_c10d.ProcessGroupGloo: mglaunch_recovery does not support this torch")


def _store_ips(host):
    try:
        return {a[4][0] for a in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)}
    except OSError:
        return {host}


def _rng_state():
    """Tensors, tuples, lists, ints and strings only (numpy's key as a list, not an ndarray;
    its float as hex: torch 1.13's weights_only loader has no floats): what
    torch.load(weights_only=True), torch 2.6's default, takes."""
    state = {"torch": torch.get_rng_state(), "random": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()  # the current device's: each rank has its own device
    if "numpy" in sys.modules:
        name, key, pos, has_gauss, gauss = sys.modules["numpy"].random.get_state()
        state["numpy"] = (str(name), [int(k) for k in key], int(pos), int(has_gauss), float(gauss).hex())
    return state


def _pack(state):
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def _unpack(data):
    """A survivor's state (a peer of this job: as trusted as its store). weights_only=False
    where torch has it (2.6 defaults to True, which refuses the optimizer's or a sampler's
    own types); the RNG part loads either way."""
    kwargs = {"weights_only": False} if "weights_only" in inspect.signature(torch.load).parameters else {}
    return torch.load(io.BytesIO(data), map_location="cpu", **kwargs)


def _set_rng_state(state):
    torch.set_rng_state(state["torch"])
    random.setstate(state["random"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if "numpy" in state and "numpy" in sys.modules:
        name, key, pos, has_gauss, gauss = state["numpy"]
        sys.modules["numpy"].random.set_state((name, key, pos, has_gauss, float.fromhex(gauss)))


def _same(a, b):
    """Whether two RNG states (tensors, tuples, lists, numbers, strings) are equal."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a.cpu(), b.cpu())
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


class _Interrupted(RuntimeError):
    """A pause came while the new group formed, or the channel closed."""


def _is_collective_failure(e):
    """A lost peer's error: torch 2.x's DistError (DistBackendError, DistStoreError,
    DistNetworkError), or a RuntimeError in Gloo's, NCCL's or the store's words."""
    dist_error = getattr(dist, "DistError", None)
    if dist_error is not None and isinstance(e, dist_error):
        return True
    return isinstance(e, RuntimeError) and _COLLECTIVE_ERRORS.search(str(e)) is not None


def _nccl_error_handling(env, torch_major):
    """NCCL errors must raise, not end the process. torch 2.x: TORCH_NCCL_ASYNC_ERROR_HANDLING
    (2.0/2.1 read NCCL_ASYNC_ERROR_HANDLING) 2, CleanUpOnly, in place of the agent's default 1
    (TearDown: the process ends); a user's 0, 2 or 3 stays. torch 1.x reads only
    NCCL_ASYNC_ERROR_HANDLING and takes only 0 or 1 (any other value fails the group's
    creation): left as the agent set it, so an NCCL error there ends the worker and its agent
    restarts it as usual."""
    if torch_major < 2:
        return
    for name in ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING"):
        if env.get(name, "1") == "1":
            env[name] = "2"


class Recovery:
    """One worker's in-place recovery. Create it first (it says hello to the agent, so a
    standby's pre-started worker is known as ready early), then start(), then run().

    backend: "gloo" (CPU) or "nccl" (CUDA: NCCL's abort; written, not yet tested on a GPU).
    timeout: the process group's timeout, and the bound of each wait for the agent's pause
    and assign (a standby's wait for its place has none: the node may stay a standby)."""

    def __init__(self, backend="gloo", timeout=timedelta(minutes=5)):
        self.backend = backend
        self.timeout = timeout
        self.step = 0  # optimizer steps applied
        self.recoveries = []  # [{"step", "seconds", "lost"}], as mgtrain's summary
        self.model = None
        self._module = self._optimizer = self._wrap = None
        self._extra = []
        self._lock = threading.Lock()
        self._updates = 0  # optimizer.step() calls (_count_optimizer_steps)
        self._group = None  # _GroupSockets of the current (or forming) group
        self._server = None  # the store server this rank hosts for the current group, if any
        self._pending = None  # (detected, redone step, lost) until the redone step is applied
        self._rng_at = {}  # {step: the RNG state at its start} for the last 2 steps run() started
        self._attempts, self._attempts_at = 0, -1
        env = os.environ
        self.standby = env.get("MGLAUNCH_STANDBY") == "1"
        self._under_mglaunch = bool(env.get("MGLAUNCH_CONTROL_SOCKET"))
        self._channel = None
        rank = env.get("RANK", "0")
        if not self._under_mglaunch:
            if self.standby:
                raise RuntimeError("MGLAUNCH_STANDBY=1 (a pre-started standby worker) needs mglaunch's control channel: "
                                   "no MGLAUNCH_CONTROL_SOCKET")
            if rank == "0":
                _say("no MGLAUNCH_CONTROL_SOCKET (not started by mglaunch, e.g. torchrun): in-place recovery is off, "
                     "training goes on as usual")
            return
        if backend == "nccl":
            _nccl_error_handling(env, int(torch.__version__.split(".")[0]))
        try:
            self._channel = _Channel(env["MGLAUNCH_CONTROL_SOCKET"], int(env.get("LOCAL_RANK", "0")), self.standby,
                                     self._abort_group)
        except OSError as e:
            if self.standby:
                raise RuntimeError(f"a standby's pre-started worker (MGLAUNCH_STANDBY=1) needs the control channel: {e}")
            if rank == "0":
                _say(f"{e}: in-place recovery is off, training goes on as usual")

    @property
    def enabled(self):
        return self._channel is not None

    @property
    def rank(self):
        return dist.get_rank()

    @property
    def world_size(self):
        return dist.get_world_size()

    # ---- start ----

    def start(self, model, optimizer, wrap=None, state=()):
        """The first process group, one state on every rank, then rec.model = wrap(model).
        `state`: more objects with state_dict()/load_state_dict() that the survivors hand
        to a rank that is behind (a sampler's, a scheduler's)."""
        self._module, self._optimizer, self._wrap, self._extra = model, optimizer, wrap, list(state)
        self._count_optimizer_steps(optimizer)
        if not self._under_mglaunch:
            dist.init_process_group(self.backend, timeout=self.timeout)
            self._rewrap()
            return self
        if self.standby:
            print("mglaunch_recovery: standby worker ready, waiting for a place", flush=True)
            got = self._channel.wait_assign(None)
            if got is None:
                _say(f"a standby's wait for its place ended: {self._channel.closed}")
                sys.exit(75)
            os.environ.update(got["env"])
            os.environ.pop("MGLAUNCH_STANDBY", None)
            self.standby = False
        try:
            self._form_group()
            self._agree()
            self._rewrap()  # DDP's constructor runs collectives: a peer lost there is recovered too
        except Exception as e:
            if not self.enabled or not (isinstance(e, _Interrupted) or _is_collective_failure(e)):
                raise
            self._recover(str(e))
        return self

    def _count_optimizer_steps(self, optimizer):
        """Counts optimizer.step() calls, so that run() sees a step that failed after its
        update (a collective after opt.step()): redoing it would apply the update twice."""
        self._updates = 0
        step = optimizer.step

        def counted(*args, **kwargs):
            self._updates += 1
            return step(*args, **kwargs)

        optimizer.step = counted

    def _rewrap(self):
        self.model = self._wrap(self._module) if self._wrap else self._module

    def _form_group(self):
        """A process group from the environment's round, under the store prefix
        /worker/attempt_<TORCHELASTIC_RESTART_COUNT> (torchrun's and mgtrain's). The store
        client and Gloo's connections are made on a thread of their own, as mgtrain does
        (connect_interruptible): a pause meanwhile ends this call at once, while a peer that
        never comes would hold Gloo's wait for its connection for the whole timeout (nothing
        else ends it). The group so built becomes the default group through
        init_process_group (_registering), on this thread."""
        env = os.environ
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        host, port = env["MASTER_ADDR"], int(env["MASTER_PORT"])
        group = _GroupSockets((_store_ips(host), port))
        with self._lock:
            self._group = group
        if self._interrupted():
            raise _Interrupted("a pause came before the new group formed")
        agent_store = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        is_master = not agent_store and rank == 0  # torch 1.x's c10d jobs: rank 0 hosts the store
        if not is_master:
            self._wait_listening(host, port)
        kwargs = {"world_size": world, "is_master": is_master, "timeout": self.timeout, "wait_for_workers": False,
                  "multi_tenant": True}
        if "use_libuv" in (dist.TCPStore.__init__.__doc__ or ""):
            kwargs["use_libuv"] = env.get("USE_LIBUV", "1") != "0"
        prefix = f"/worker/attempt_{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"

        def build():
            try:
                server = None
                if is_master:  # a server of its own, so that it goes when the group is let go of (_abandon)
                    before = _sockets()
                    with _GroupSockets._lock:
                        group.server_forming = True
                    try:
                        server = dist.TCPStore(host, port, **kwargs)
                    finally:
                        with _GroupSockets._lock:  # its own client connections: never shut nor quiet (its end joins their thread)
                            group.server_own.update({fd: ino for fd, ino in _sockets().items() if before.get(fd) != ino})
                            group.server_forming = False
                client = dict(kwargs, is_master=False)
                client.pop("use_libuv", None)  # a server's option
                window = _fresh(group)
                store = dist.PrefixStore(prefix, dist.TCPStore(host, port, **client))
                _keep(store)
                group.made(window, store=True)
                pg = None
                if self.backend == "gloo":  # NCCL connects at its first collective: nothing to wait for here
                    # The prefix init_process_group gives its first group ("0"), so that the keys stay its own.
                    window = _fresh(group)
                    pg = dist.ProcessGroupGloo(dist.PrefixStore("0", store), rank, world, self.timeout)
                    _keep(pg)  # given up on, it may still hold threads waiting for a peer
                    # Never a store call once paused: its connections are shut or quiet (a wait there
                    # would fail, or set its timeout on the quiet socket).
                    group.made(window, gloo=False if group.abandoned or self._interrupted() else
                               _gloo_records(store, world, self._interrupted))
                return store, pg, server
            finally:
                group.formed()

        store, pg, self._server = self._off_thread("the new group formed", build)
        if dist.is_initialized():  # a registration an earlier pause cut short (torch 1.13: its store barrier)
            self._drop_default_group()
        _reset_group_count()
        try:
            with _registering(pg):
                dist.init_process_group(self.backend, store=store, rank=rank, world_size=world, timeout=self.timeout)
        except Exception as e:
            if self._interrupted():  # its store barrier (torch 1.13) failed on the connections the pause shut
                raise _Interrupted(f"a pause came while the new group registered: {str(e).splitlines()[0] if str(e) else e}") from e
            raise
        group.done()

    def _interrupted(self):
        return self._channel is not None and (self._channel.paused() or bool(self._channel.closed))

    def _off_thread(self, what, fn):
        """fn()'s result (or its exception), fn run on a daemon thread of its own; a pause
        (or the channel's end) meanwhile raises _Interrupted at once and leaves the thread
        behind: it touches nothing of torch.distributed's global state, and its waits end
        on their own (the pause shut its connections; Gloo's wait for a peer that never
        connects ends at the timeout)."""
        box = {}
        done = threading.Event()

        def body():
            try:
                box["value"] = fn()
            except BaseException as e:  # noqa: B036  handed to the waiting thread
                box["error"] = e
            done.set()

        threading.Thread(target=body, name="mglaunch-form-group", daemon=True).start()
        while not done.wait(0.05):
            if self._interrupted():
                raise _Interrupted(f"a pause came before {what}")
        if "error" in box:
            raise box["error"]
        return box["value"]

    def _wait_listening(self, host, port):
        """Until the store listens: c10d's client waits a whole second before it retries a
        refused connection, and a new round's store may open just after the assign."""
        end = time.monotonic() + self.timeout.total_seconds()
        while True:
            try:
                socket.create_connection((host, port), timeout=1.0).close()
                return
            except OSError:
                if time.monotonic() > end:
                    return  # the store's own connect says why
            if self._interrupted():
                raise _Interrupted("a pause came while waiting for the new round's store")
            time.sleep(0.005)

    def _agree(self):
        """Every rank says its step (and whether it has the channel: recovery is on for
        every rank or none); the lowest rank among the most advanced broadcasts its state
        to those behind. A fresh job (every rank at step 0) skips the broadcast."""
        world, rank = dist.get_world_size(), dist.get_rank()
        # NCCL: the current CUDA device, which the script sets (torch.cuda.set_device(LOCAL_RANK))
        # before start(), as NCCL itself requires.
        device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")
        t = torch.zeros(2 * world, dtype=torch.int64)
        t[rank], t[world + rank] = self.step, 1 if self.enabled else 0
        t = t.to(device)
        dist.all_reduce(t)
        t = t.cpu().tolist()
        if sum(t[world:]) < world and self.enabled:
            _say(f"rank {rank}: another rank has no control channel: recovery is off on every rank, training goes on")
            self._channel.withdraw()
            self._channel = None
        best = max(t[:world])
        if best == 0:
            return
        source = t[:world].index(best)
        data = b""
        if rank == source:
            data = _pack({"step": self.step, "model": self._module.state_dict(), "optimizer": self._optimizer.state_dict(),
                          "rng": _rng_state(), "rng_at": self._rng_at, "extra": [o.state_dict() for o in self._extra]})
        size = torch.tensor([len(data)], dtype=torch.int64, device=device)
        dist.broadcast(size, source)
        payload = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(int(size.item()), dtype=torch.uint8)
        payload = payload.to(device)
        dist.broadcast(payload, source)
        if self.step < best:
            got = _unpack(payload.cpu().numpy().tobytes())
            was = self.step
            self._module.load_state_dict(got["model"])
            self._optimizer.load_state_dict(got["optimizer"])
            for o, s in zip(self._extra, got["extra"]):
                o.load_state_dict(s)
            lag = self._take_rng(got, was)
            self.step = got["step"]
            print(f"mglaunch_recovery: rank {rank} took step {best}'s state from rank {source} (it was at step {was})",
                  flush=True)
            if lag:
                print(f"mglaunch_recovery: rank {rank} keeps its own RNG stream ({', '.join(lag)}: not the source "
                      f"rank's), {best - was} step(s) behind", flush=True)
        if rank == 0 and any(0 < s < best for s in t[:world]):
            print(f"mglaunch_recovery: step {best} was applied on some ranks only: recovering from it, the most "
                  f"advanced state (rank {source}'s)", flush=True)

    def _take_rng(self, got, was):
        """A rank behind (at step `was`) and the source's generators (at `best`). A fresh
        worker (step 0) has no stream of its own yet: it takes the source's. A rank with
        steps of its own compares, generator by generator (torch's CPU one, CUDA's,
        random's, numpy's), its state, that of the start of step `was`, with the source's
        at that step's start (the source keeps its last 2): the same state is a stream
        every rank shares (seeded alike, as the example), and it takes the source's
        current one, the undisturbed run's; another is a stream of its own (seeded per
        rank), which it keeps, `best - was` steps behind. Returns the generators kept that
        the source drew from since step `was` (one it never used, e.g. numpy's global one
        that torch imports, is the same kept or taken: not worth a line)."""
        if was == 0:
            _set_rng_state(got["rng"])
            return []
        own, then = _rng_state(), got.get("rng_at", {}).get(was)
        lag = [k for k in own if then is None or k not in then or not _same(own[k], then[k])]
        _set_rng_state({k: own[k] if k in lag else got["rng"].get(k, own[k]) for k in own})
        return [k for k in lag if then is None or k not in then or k not in got["rng"] or
                not _same(then[k], got["rng"][k])]

    # ---- train ----

    def run(self, train_step, steps):
        """Calls train_step(step) for step = self.step .. steps-1 (the step's index: the
        data position follows from it); a step a lost peer interrupted is done again."""
        while self.step < steps:
            if self._channel is not None and self._channel.paused():
                self._recover("the agent paused this worker")
                continue
            rng, updates = _rng_state(), self._updates
            self._rng_at = {k: v for k, v in self._rng_at.items() if k == self.step - 1}
            self._rng_at[self.step] = rng
            try:
                train_step(self.step)
            except Exception as e:
                if self._channel is None or not (self._channel.paused() or _is_collective_failure(e)):
                    raise
                if self._updates != updates:
                    raise RuntimeError(f"step {self.step + 1} failed after its optimizer.step() (a collective after "
                                       "it, e.g. a logging all_reduce): redoing it would apply the update twice; "
                                       "move such collectives before optimizer.step() (docs/python-recovery.md)") from e
                _set_rng_state(rng)  # the step is redone from the state it started from
                self._recover(str(e).splitlines()[0] if str(e) else type(e).__name__)
                continue
            self.step += 1
            if self._pending:
                detected, redone, lost = self._pending
                seconds = time.monotonic() - detected
                self.recoveries.append({"step": redone, "seconds": seconds, "lost": lost})
                if dist.get_rank() == 0:
                    print(f"mglaunch_recovery: recovered in {seconds:.3f} s: step {redone} redone", flush=True)
                self._pending = None
        return self

    # ---- recover ----

    def _abort_group(self):
        """Lets go of the current (or forming) group at once; from the reader thread on a pause."""
        with self._lock:
            group = self._group
        if group is not None:
            group.shut()
        if self.backend == "nccl" and dist.is_initialized():
            pg = dist.distributed_c10d._get_default_group()
            for abort in (getattr(dist.distributed_c10d, "_abort_process_group", None),
                          getattr(getattr(pg, "_get_backend", lambda d: pg)(torch.device("cuda")), "abort", None)):
                if abort is not None:
                    try:
                        abort()
                        break
                    except Exception:
                        pass

    def _abandon(self):
        """Lets go of the group for good: its connections shut, its store clients quiet."""
        self._abort_group()
        with self._lock:
            group = self._group
        if group is not None:
            group.quiet()
        # The store server this rank hosted for the group (torch 1.x's c10d jobs: rank 0): its
        # own client connections are quiet now, so it stops at once (its thread, its port).
        self._server = None
        if dist.is_initialized():
            self._drop_default_group()
        self.model = None

    @staticmethod
    def _drop_default_group():
        # Only the group stays (its destructor would join threads blocked on lost peers). The
        # old DDP (its buckets: a model's size per recovery) goes: its reducer holds the group
        # by reference, and the group outlives it.
        _keep(dist.distributed_c10d._get_default_group())
        dist.destroy_process_group()  # drops torch's references only: ours keeps the C++ group alive

    def _wait(self, what, timeout):
        end = time.monotonic() + timeout
        while True:
            got = what(min(0.1, max(0.0, end - time.monotonic())))
            if got is not None or self._channel.closed or time.monotonic() >= end:
                return got

    def _recover(self, what):
        """Waits for the agent's pause, lets go of the group, takes the new round's
        assign, forms the new group and agrees on the state; a failure meanwhile (a peer
        lost again) goes back to the next pause. Counted from the first detection."""
        detected = time.monotonic()
        limit = self.timeout.total_seconds()
        while True:
            if self.step != self._attempts_at:
                self._attempts, self._attempts_at = 0, self.step
            self._attempts += 1
            if self._attempts > RECOVERY_ATTEMPTS:
                raise RuntimeError(f"{what} (in-place recovery: {RECOVERY_ATTEMPTS} attempts in a row at step "
                                   f"{self.step} failed)")
            pause = self._wait(self._channel.wait_pause, limit)
            if pause is None:
                closed = self._channel.closed
                raise RuntimeError(f"{what} (in-place recovery: no pause from the agent within {limit:g} s"
                                   f"{': ' + closed if closed else ''})")
            detected = min(detected, pause["at"])
            self._channel.send({"type": "paused", "step": self.step})
            self._abandon()
            got = self._wait(self._channel.wait_assign, limit)
            if got is None:
                raise RuntimeError(f"in-place recovery: no assignment from the agent within {limit:g} s of its pause "
                                   f"({pause['reason']}) {self._channel.closed}")
            os.environ.update(got["env"])
            try:
                self._form_group()
                self._agree()
                self._rewrap()  # DDP's constructor runs collectives (shapes, rank 0's broadcast)
            except Exception as e:
                if not (isinstance(e, _Interrupted) or _is_collective_failure(e)):
                    raise
                what = f"the new round's process group did not form: {str(e).splitlines()[0] if str(e) else e}"
                continue
            break
        self._pending = (min(self._pending[0], detected) if self._pending else detected, self.step + 1, pause["lost"])
        if dist.get_rank() == 0:
            print(f"mglaunch_recovery: in-place recovery, round {got['round']} ({pause['reason']}): world "
                  f"{dist.get_world_size()}, redoing step {self.step + 1}", flush=True)
