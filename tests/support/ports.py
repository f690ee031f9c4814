"""Ports for servers under test that bind a number (tests/support/net.h's free_port_on, the
same scheme, so C++ and Python tests share one reservation): drawn from [10000, 19999] outside
the kernel's ephemeral range (no bind(0) and no outgoing connection takes one) and below the
ports mglaunch draws its master ports from (20000 and up), and reserved for the life of this
process by a lock (flock) on /tmp/mgtest-ports-UID/PORT, so no other test process picks it.
A port that does not bind now is passed over. The kernel's bind(0) where that range leaves
nothing or the lock directory cannot be made."""
import fcntl
import os
import random
import socket

LO, HI = 10000, 19999
_held = []  # the locks' files, open for the life of this process (close-on-exec)


def _ephemeral():
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
            return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def _binds(host, port):
    with socket.socket() as s:
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False


def free_port(host="127.0.0.1"):
    lo, hi = _ephemeral()
    ports = [p for p in range(LO, HI + 1) if p < lo or p > hi]
    d = f"/tmp/mgtest-ports-{os.getuid()}"
    try:
        os.makedirs(d, mode=0o700, exist_ok=True)
    except OSError:
        ports = []
    if not ports:
        with socket.socket() as s:
            s.bind((host, 0))
            return s.getsockname()[1]
    for _ in range(1000):
        port = random.choice(ports)
        fd = os.open(os.path.join(d, str(port)), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue
        if not _binds(host, port):
            os.close(fd)
            continue
        _held.append(fd)
        return port
    raise RuntimeError(f"no free port in {LO}..{HI} on {host}")
