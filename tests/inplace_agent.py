#!/usr/bin/python3
"""A stand-in agent for mgtrain's in-place recovery tests (docs/in-place-recovery.md).

It does what one mglaunch agent of a one-node job does for the worker side of the
protocol, and no more: it serves the c10d store (the agent's own, store/, through
--store-serve: tests/store_serve, so that no torch is imported here, #36), listens on an
abstract Unix socket named in MGLAUNCH_CONTROL_SOCKET, spawns --nproc workers, and injects
one fault once rank 0 reports step --at-step or later:

  kill  SIGKILL rank --victim; the survivors see their collective fail.
  stop  SIGSTOP rank --victim (a hung peer: the survivors' collective blocks), pause
        the survivors at once, SIGKILL the victim only once every survivor said paused.
  term  SIGKILL rank --victim, pause the survivors but assign nothing: once every survivor
        said paused, SIGTERM them (the agent stopping the job).
  kill-all  SIGKILL every worker at once (no rank left holding the state), and once all
        ended start them all anew with TORCHELASTIC_RESTART_COUNT + 1, as an agent restarting
        the whole job does.
  none  no fault (the undisturbed twin run).
--no-control gives the workers no control socket (mgtrain then says recovery is off).
--garbage PATH[:STEP] (with kill): once the victim ended, PATH holds 4096 zero bytes (a
checkpoint no one can read), and with STEP a checkpoint.key beside it describes it at that step;
with --unreadable a directory takes its place instead (read() fails: EISDIR, an I/O error).
--epoch E [--run R]: a fenced job: MGLAUNCH_EPOCH E in the first round, one more in each
round after, and MGLAUNCH_RUN R in every round.
--again N (with kill or stop): a peer lost again during the recovery, N times: the
replacement is SIGKILLed as soon as it says hello (before the new group forms), and the
round after is paused and assigned anew (up to N + 1 restarts); a survivor that fails
then ends the job (the others are SIGKILLed).
--shrink (with kill): the failed worker is not replaced: the survivors are assigned a world
one smaller, ranked in their old order (an elastic job that lost a node and has no standby).
--kill-store S (with kill): the store is SIGKILLed with the victim (its host lost with its
agent) and a new one serves the next round; once every survivor said paused, each
survivor's CPU time over the next S seconds (utime + stime of all its threads, from
/proc/PID/stat) is reported as "paused_cpu_s" {rank: seconds} before the round is assigned:
a survivor idles then, except for an abandoned store client that spins on its dead connection.

When a worker fails it sends `pause` to every live worker that opted in, spawns a
replacement with TORCHELASTIC_RESTART_COUNT + 1 and sends `assign` to the paused ones.
Every loop is bounded by --deadline; every process it started is killed on the way out.
Prints one JSON line: exit codes and the fault it injected. Exit 0 when every worker
ended with 0.
"""
import argparse
import json
import os
import re
import secrets
import select
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mgtrain", required=True)
    ap.add_argument("--store-serve", required=True, help="tests/store_serve: the agent's store on a free port")
    ap.add_argument("--out", required=True, help="directory for the workers' logs")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--fault", choices=["none", "kill", "stop", "term", "kill-all"], default="none")
    ap.add_argument("--victim", type=int, default=1)
    ap.add_argument("--at-step", type=int, default=10)
    ap.add_argument("--deadline", type=float, default=240)
    ap.add_argument("--no-control", action="store_true", help="give the workers no MGLAUNCH_CONTROL_SOCKET")
    ap.add_argument("--again", type=int, default=0, help="SIGKILL this many replacements at their hello")
    ap.add_argument("--shrink", action="store_true", help="go on without the failed worker, at a smaller world")
    ap.add_argument("--kill-store", type=float, default=0,
                    help="SIGKILL the store with the victim; report each survivor's CPU time over this many seconds once paused")
    ap.add_argument("--plant", default="",
                    help="SRC:DST (with kill): copy checkpoint SRC to DST as the victim is killed (a newer checkpoint "
                         "left by the part of the job that trained on while a survivor was cut off)")
    ap.add_argument("--garbage", default="",
                    help="PATH[:STEP]: with kill, once the victim ended PATH holds 4096 zero bytes (an unreadable "
                         "checkpoint), and with STEP a checkpoint.key beside it describes it at step STEP")
    ap.add_argument("--unreadable", action="store_true",
                    help="with --garbage: a directory in place of the checkpoint (an I/O error, not a parse error)")
    ap.add_argument("--epoch", type=int, default=0,
                    help="MGLAUNCH_EPOCH of the first round, one more each round after (0: none)")
    ap.add_argument("--run", default="", help="MGLAUNCH_RUN of every round (with --epoch)")
    ap.add_argument("args", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    worker_args = a.args[1:] if a.args[:1] == ["--"] else a.args
    deadline = time.monotonic() + a.deadline

    stores = []
    try:
        port = start_store(a, stores)
        return 2 if port is None else run(a, worker_args, deadline, stores, port)
    finally:
        for store in stores:
            store.terminate()
            store.wait()


def start_store(a, stores):
    """The agent's store (appended to `stores`): it prints its port, and ends when its stdin
    closes (we end, however). Its port, or None after one line saying why."""
    store = subprocess.Popen([a.store_serve], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    stores.append(store)
    line = store.stdout.readline() if select.select([store.stdout], [], [], 60)[0] else b""
    if not line.strip().isdigit():
        print("inplace_agent: %s printed no port in 60 s (exit %s)" % (a.store_serve, store.poll()), file=sys.stderr)
        return None
    return int(line)


def cpu_seconds(pid):
    """utime + stime of every thread of `pid` (fields 14 and 15 of /proc/PID/stat), or None once it ended."""
    try:
        with open("/proc/%d/stat" % pid, "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def plant_garbage(spec, unreadable):
    path, _, step = spec.partition(":")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if unreadable:
        if os.path.isfile(path):
            os.unlink(path)
        os.makedirs(path, exist_ok=True)
    else:
        with open(path, "wb") as f:
            f.write(bytes(4096))
    key = os.path.join(os.path.dirname(path), "checkpoint.key")
    if step:  # the key line mgtrain writes (worker/checkpoint.cc, key_line), describing the zeros
        st = os.stat(path)
        with open(key, "w") as f:
            f.write("step=%s epoch=-1 run= size=%d mtime_ns=%d ino=%d\n" % (step, st.st_size, st.st_mtime_ns, st.st_ino))


def run(a, worker_args, deadline, stores, store_port):
    name = "mglaunch-standin-%d-%s" % (os.getpid(), secrets.token_hex(8))
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind("\0" + name)
    listener.listen(16)
    listener.setblocking(False)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, ("listen", None))

    restart_count = 0
    rnd = 0
    workers = {}   # rank -> dict(proc, conn, paused, log)
    conns = {}     # socket -> dict(buf, pid)
    codes = {}     # "rank/attempt" -> exit code
    fault = {"kind": a.fault, "injected_at_step": None}
    step_re = re.compile(rb" step (\d+)/")

    def env_for(rank, world=None):
        world = a.nproc if world is None else world
        return {
            "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
            "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "ROLE_RANK": str(rank),
            "ROLE_WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store_port),
            "TORCHELASTIC_RESTART_COUNT": str(restart_count), "TORCHELASTIC_USE_AGENT_STORE": "True",
            **({"MGLAUNCH_EPOCH": str(a.epoch + rnd)} if a.epoch else {}),
            **({"MGLAUNCH_RUN": a.run} if a.epoch and a.run else {}),
        }

    def spawn(rank):
        env = dict(os.environ)
        env.update(env_for(rank))
        env.pop("MGLAUNCH_CONTROL_SOCKET", None)
        if not a.no_control:
            env["MGLAUNCH_CONTROL_SOCKET"] = "@" + name
        env["OMP_NUM_THREADS"] = "1"
        log = open(os.path.join(a.out, "worker%d.%d.log" % (rank, restart_count)), "wb")
        p = subprocess.Popen([a.mgtrain] + worker_args, env=env, stdout=subprocess.PIPE, stderr=log)
        os.set_blocking(p.stdout.fileno(), False)
        sel.register(p.stdout, selectors.EVENT_READ, ("out", rank))
        workers[rank] = {"proc": p, "conn": None, "paused": False, "log": log, "attempt": restart_count}

    def send(conn, msg):
        try:
            conn.sendall((json.dumps(msg) + "\n").encode())
        except OSError:
            pass

    def conn_of_pid(pid):
        for c, st in conns.items():
            if st["pid"] == pid:
                return c
        return None

    def new_round(failed_rank, reason):
        nonlocal restart_count, rnd
        # pause the live opted-in workers, replace the failed one, assign the new round
        for r, w in workers.items():
            if r != failed_rank and w["proc"].poll() is None:
                c = conn_of_pid(w["proc"].pid)
                if c is not None:
                    send(c, {"type": "pause", "round": rnd, "reason": reason, "lost": "worker"})
        rnd += 1
        restart_count += 1
        if a.shrink:
            survivors = sorted(r for r, w in workers.items() if r != failed_rank and w["proc"].poll() is None)
            for new_rank, r in enumerate(survivors):
                c = conn_of_pid(workers[r]["proc"].pid)
                if c is not None:
                    send(c, {"type": "assign", "round": rnd, "restart_count": restart_count,
                             "env": env_for(new_rank, len(survivors))})
            return
        if a.kill_store:
            held["failed_rank"] = failed_rank  # assigned once the survivors' CPU is measured
            return
        assign_round(failed_rank)

    def assign_round(failed_rank):
        spawn(failed_rank)
        for r, w in workers.items():
            if r != failed_rank and w["proc"].poll() is None:
                c = conn_of_pid(w["proc"].pid)
                if c is not None:
                    send(c, {"type": "assign", "round": rnd, "restart_count": restart_count, "env": env_for(r)})

    for r in range(a.nproc):
        spawn(r)
    held = {}               # --kill-store: the round held back while the survivors' CPU is measured
    stopped_victim = None   # (rank, pid) SIGSTOPped, waiting for the survivors' paused
    paused_pids = set()
    rc = 0
    try:
        while workers and time.monotonic() < deadline:
            for key, _ in sel.select(timeout=0.05):
                kind, rank = key.data
                if kind == "listen":
                    c, _ = listener.accept()
                    c.setblocking(False)
                    conns[c] = {"buf": b"", "pid": None}
                    sel.register(c, selectors.EVENT_READ, ("conn", None))
                elif kind == "conn":
                    c = key.fileobj
                    data = b""
                    try:
                        data = c.recv(65536)
                    except BlockingIOError:
                        continue
                    except OSError:
                        pass
                    if not data:
                        sel.unregister(c)
                        c.close()
                        conns.pop(c, None)
                        continue
                    st = conns[c]
                    st["buf"] += data
                    while b"\n" in st["buf"]:
                        line, st["buf"] = st["buf"].split(b"\n", 1)
                        msg = json.loads(line)
                        if msg.get("type") == "hello":
                            st["pid"] = msg.get("pid")
                            w = workers.get(a.victim)
                            if (fault["injected_at_step"] is not None and fault.get("again", 0) < a.again
                                    and w is not None and w["attempt"] > 0 and w["proc"].pid == st["pid"]):
                                w["proc"].kill()  # lost again, before the new group forms
                                fault["again"] = fault.get("again", 0) + 1
                                continue
                            send(c, {"type": "welcome", "version": 1})
                        elif msg.get("type") == "paused":
                            paused_pids.add(st["pid"])
                elif kind == "out":
                    w = workers.get(rank)
                    chunk = b""
                    try:
                        chunk = key.fileobj.read() or b""
                    except (BlockingIOError, ValueError):
                        pass
                    if not chunk:
                        sel.unregister(key.fileobj)
                        continue
                    w["log"].write(chunk)
                    w["log"].flush()
                    if rank == 0 and a.fault != "none" and fault["injected_at_step"] is None:
                        steps = [int(m) for m in step_re.findall(chunk)]
                        if steps and max(steps) >= a.at_step:
                            victim = workers[a.victim]["proc"]
                            fault["injected_at_step"] = max(steps)
                            fault["victim_pid"] = victim.pid
                            if a.fault == "kill-all":
                                for ww in workers.values():
                                    ww["proc"].kill()
                            elif a.fault in ("kill", "term"):
                                victim.kill()
                                if a.plant:
                                    src, dst = a.plant.split(":", 1)
                                    victim.wait()
                                    os.makedirs(os.path.dirname(dst), exist_ok=True)
                                    shutil.copyfile(src, dst)
                                if a.garbage:
                                    victim.wait()
                                    plant_garbage(a.garbage, a.unreadable)
                                if a.kill_store:  # its host lost with the victim: the next round has another
                                    stores[-1].kill()
                                    stores[-1].wait()
                                    store_port = start_store(a, stores)
                                    if store_port is None:
                                        return 2
                            else:
                                victim.send_signal(signal.SIGSTOP)
                                stopped_victim = (a.victim, victim.pid)
                                for r, ww in workers.items():
                                    c = conn_of_pid(ww["proc"].pid)
                                    if r != a.victim and c is not None:
                                        send(c, {"type": "pause", "round": rnd,
                                                 "reason": "worker rank %d (pid %d) hangs" % (a.victim, victim.pid),
                                                 "lost": "worker"})
            if fault.get("term_pending"):
                survivors = [w["proc"] for r, w in workers.items() if r != a.victim]
                if survivors and all(p.pid in paused_pids for p in survivors):
                    for p in survivors:
                        p.send_signal(signal.SIGTERM)
                    fault["term_pending"] = False
                    fault["terminated"] = True
            if "failed_rank" in held:
                survivors = {r: w["proc"].pid for r, w in workers.items() if r != held["failed_rank"]}
                if "since" not in held and all(p in paused_pids for p in survivors.values()):
                    held["since"] = time.monotonic()
                    held["cpu"] = {r: cpu_seconds(p) for r, p in survivors.items()}
                elif "since" in held and time.monotonic() >= held["since"] + a.kill_store:
                    fault["paused_cpu_s"] = {str(r): round(cpu_seconds(p) - held["cpu"][r], 3)
                                             for r, p in survivors.items()
                                             if held["cpu"].get(r) is not None and cpu_seconds(p) is not None}
                    fault["paused_window_s"] = round(time.monotonic() - held["since"], 3)
                    assign_round(held.pop("failed_rank"))
                    held.clear()
            if stopped_victim:
                survivors = [w["proc"].pid for r, w in workers.items() if r != stopped_victim[0]]
                if all(p in paused_pids for p in survivors):
                    workers[stopped_victim[0]]["proc"].kill()
                    stopped_victim = None
            for r in list(workers):
                w = workers[r]
                code = w["proc"].poll()
                if code is None:
                    continue
                codes["%d/%d" % (r, w["attempt"])] = code
                try:
                    sel.unregister(w["proc"].stdout)
                except (KeyError, ValueError):
                    pass
                w["log"].close()
                del workers[r]
                if a.fault == "kill-all" and fault["injected_at_step"] is not None and not fault.get("respawned"):
                    if not workers:  # the last one ended: the whole job starts again
                        restart_count += 1
                        fault["respawned"] = True
                        for rr in range(a.nproc):
                            spawn(rr)
                    continue
                if code != 0 and a.fault == "term" and not fault.get("terminated"):
                    for rr, ww in workers.items():
                        c = conn_of_pid(ww["proc"].pid)
                        if c is not None:
                            send(c, {"type": "pause", "round": rnd, "reason": "worker rank %d failed" % r,
                                     "lost": "worker"})
                    fault["term_pending"] = True
                elif (code != 0 and restart_count <= a.again and a.fault != "term" and not fault.get("ended")
                      and (r == a.victim or not a.again)):
                    new_round(r, "worker rank %d (pid %d) failed: exit %d" % (r, w["proc"].pid, code))
                elif code != 0:
                    rc = 1
                    if a.again:  # a survivor gave up: the job ends, as an agent out of restarts ends it
                        fault["ended"] = True
                        for ww in workers.values():
                            ww["proc"].kill()
        if workers:
            rc = 3
            codes["deadline"] = a.deadline
    finally:
        for w in workers.values():
            w["proc"].kill()
            w["proc"].wait()
        listener.close()
    print(json.dumps({"codes": codes, "fault": fault, "restart_count": restart_count}))
    sys.stdout.flush()
    return rc


if __name__ == "__main__":
    sys.exit(main())
