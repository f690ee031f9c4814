"""Ports for servers under test that bind a number (tests/support/net.h's free_port_on, the
same scheme, so C++ and Python tests share one reservation): drawn from [10000, 19999] outside
the kernel's ephemeral range (no bind(0) and no outgoing connection takes one) and below the
ports mglaunch draws its master ports from (20000 and up), and reserved for the life of this
process by a lock (flock) on /tmp/mgtest-ports-UID/PORT, so no other test process picks it.
A port that does not bind now is passed over. The lock directory is used only when it is a
directory of this user that no one else can write, never through a link (else
$TMPDIR/mgtest-ports-UID, else one of this process's own). The kernel's bind(0) where that
range leaves nothing, no lock directory can be had, or no reserved port is free."""
import fcntl
import os
import random
import socket
import stat
import tempfile

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


def _lock_dir_at(path):
    """A descriptor of the lock directory at `path` (made 0700 when missing), or None when it
    is not a directory of this user that no one else can write, or is a link (review s39
    L10: another user's /tmp/mgtest-ports-UID must neither starve nor steer the tests)."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    st = os.fstat(fd)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        os.close(fd)
        return None
    return fd


_dir = []  # the lock directory's descriptor (None: none), found once


def _lock_dir():
    """/tmp/mgtest-ports-UID (shared with net.cc), else $TMPDIR/mgtest-ports-UID, else a
    directory of this process's own."""
    if not _dir:
        leaf = f"mgtest-ports-{os.getuid()}"
        fd = _lock_dir_at(os.path.join("/tmp", leaf))
        tmpdir = os.environ.get("TMPDIR", "")
        if fd is None and tmpdir and tmpdir != "/tmp":
            fd = _lock_dir_at(os.path.join(tmpdir, leaf))
        if fd is None:
            try:
                fd = _lock_dir_at(tempfile.mkdtemp(prefix="mgtest-ports-"))
            except OSError:
                fd = None
        _dir.append(fd)
    return _dir[0]


def _ephemeral_port(host):
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def free_port(host="127.0.0.1"):
    lo, hi = _ephemeral()
    ports = [p for p in range(LO, HI + 1) if p < lo or p > hi]
    d = _lock_dir()
    if not ports or d is None:
        return _ephemeral_port(host)
    for _ in range(1000):
        port = random.choice(ports)
        try:
            fd = os.open(str(port), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600, dir_fd=d)
        except OSError:
            continue
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
    return _ephemeral_port(host)
