#!/usr/bin/python3
"""A worker of the in-place recovery tests (tests/inplace_test.cc), speaking the agent's
control protocol (docs/in-place-recovery.md) with the standard library only.

    inplace_worker.py OUT_DIR IN_PLACE_LOCAL_RANKS [fail-once|fail-on-file LOCAL_RANK] [no-standby]
        [ignore-term] [standby-exits-after=SECONDS] [on-pause=close|junk|ack-on-file]

Every event goes to OUT_DIR/events.jsonl, one JSON line each (appended in one write):
start (pid and the torchrun variables), welcome, pause, assign (its env), exit. The local
ranks listed (comma-separated) connect to MGLAUNCH_CONTROL_SOCKET and opt in; the others
never connect. With `fail-once N`, local rank N of the first attempt exits 1 once every
opted-in rank of its node was welcomed; with `fail-on-file N`, once OUT_DIR/fail exists
(the test creates it). Each worker exits 0 once OUT_DIR/finish exists,
and 3 after 120 s (bounded).

Started with MGLAUNCH_STANDBY=1 (a standby's pre-started worker, mglaunch --prestart-standby)
it has no rank yet: its start event says standby, its hello says "standby": true (unless
`no-standby` is given: a worker without the capability), and SIGTERM logs `term` and exits 143.
Such a worker with `ignore-term` logs `term-ignored` for SIGTERM and SIGINT and goes on; with
`standby-exits-after=S` it logs `gave-up` and exits 3 S seconds after its start unless it was
assigned a place. A pre-started worker prints `pre-started worker pid PID` on stdout. With
`on-pause=close` a worker answers its first pause by closing its control connection (and
goes on running); with `on-pause=junk`, by a message of an unknown type (the agent refuses
it); with `on-pause=ack-on-file`, by its "paused" only once OUT_DIR/ack exists (at most 60 s)."""
import json
import os
import select
import signal
import socket
import sys
import time

KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE",
        "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
        "TORCHELASTIC_USE_AGENT_STORE", "MGLAUNCH_CONTROL_SOCKET")

out_dir = sys.argv[1]
in_place = {int(x) for x in sys.argv[2].split(",") if x}
fail_once = int(sys.argv[4]) if len(sys.argv) > 4 and sys.argv[3] == "fail-once" else -1
fail_on_file = int(sys.argv[4]) if len(sys.argv) > 4 and sys.argv[3] == "fail-on-file" else -1
capable = "no-standby" not in sys.argv[3:]
ignore_term = "ignore-term" in sys.argv[3:]
on_pause = next((a.split("=", 1)[1] for a in sys.argv[3:] if a.startswith("on-pause=")), None)
exits_after = next((float(a.split("=", 1)[1]) for a in sys.argv[3:] if a.startswith("standby-exits-after=")), None)
standby = os.environ.get("MGLAUNCH_STANDBY") == "1"
lr = int(os.environ["LOCAL_RANK"])
restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "-1"))  # unset on a pre-started worker


def log(event, **fields):
    fields.update(event=event, pid=os.getpid(), local_rank=lr, time=time.time())
    line = (json.dumps(fields) + "\n").encode()
    fd = os.open(os.path.join(out_dir, "events.jsonl"), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.write(fd, line)
    os.close(fd)


def touch(name):
    open(os.path.join(out_dir, name), "w").close()


log("start", env={k: os.environ.get(k) for k in KEYS}, standby=standby)
if standby:  # one stdout line per pre-started process (the agent's log files keep each one's)
    print(f"pre-started worker pid {os.getpid()}", flush=True)
if standby:
    def on_term(*_):
        log("term")
        sys.exit(143)

    def on_ignored(*_):
        log("term-ignored")
    signal.signal(signal.SIGTERM, on_ignored if ignore_term else on_term)
    if ignore_term:
        signal.signal(signal.SIGINT, on_ignored)
sock = None
buf = b""
placed = False
started = time.time()
if lr in in_place:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect("\0" + os.environ["MGLAUNCH_CONTROL_SOCKET"][1:])
    hello = {"type": "hello", "version": 1, "pid": os.getpid(), "local_rank": lr, "in_place": True}
    if standby and capable:
        hello["standby"] = True
    sock.sendall((json.dumps(hello) + "\n").encode())

deadline = time.time() + 120
while time.time() < deadline:
    if os.path.exists(os.path.join(out_dir, "finish")):
        log("exit")
        sys.exit(0)
    if lr == fail_once and restart == 0 and all(
            os.path.exists(os.path.join(out_dir, "welcome.%d.%d" % (os.getppid(), r))) for r in in_place):
        log("fail")
        sys.exit(1)
    if lr == fail_on_file and restart == 0 and os.path.exists(os.path.join(out_dir, "fail")):
        log("fail")
        sys.exit(1)
    if standby and exits_after is not None and not placed and time.time() - started >= exits_after:
        log("gave-up")
        sys.exit(3)
    if sock is None:
        time.sleep(0.05)
        continue
    ready, _, _ = select.select([sock], [], [], 0.05)
    if not ready:
        continue
    data = sock.recv(65536)
    if not data:
        log("closed")
        sock = None
        continue
    buf += data
    while b"\n" in buf:
        line, buf = buf.split(b"\n", 1)
        m = json.loads(line)
        if m["type"] == "welcome":
            log("welcome")
            touch("welcome.%d.%d" % (os.getppid(), lr))
        elif m["type"] == "pause":
            log("pause", round=m["round"], reason=m["reason"], lost=m.get("lost"))
            if on_pause == "close":
                sock.close()
                sock = None
                break
            if on_pause == "ack-on-file":  # bounded: 60 s
                for _ in range(1200):
                    if os.path.exists(os.path.join(out_dir, "ack")):
                        break
                    time.sleep(0.05)
                log("ack")
            sock.sendall(b'{"type":"junk"}\n' if on_pause == "junk" else b'{"type":"paused","step":7}\n')
        elif m["type"] == "assign":
            log("assign", round=m["round"], restart_count=m["restart_count"], env=m["env"])
            placed = True
        else:
            log("other", message=m)
log("timeout")
sys.exit(3)
