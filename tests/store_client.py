"""A real torch TCPStore client against the agent's store (store/), run by tests/store_test.cc.

  store_client.py ops HOST PORT      every query type this torch's client sends; prints "ok"
  store_client.py allreduce HOST PORT RANK WORLD
                                     one env:// gloo worker as mglaunch starts it with the agent
                                     store (TORCHELASTIC_USE_AGENT_STORE=True); prints the sum
  store_client.py hold HOST PORT WAIT
                                     one TCPStore client that sets a key, prints "up", waits for
                                     SIGUSR1, then prints the CPU seconds it used in the next 2 s
                                     (about 2 when a thread of its busy-loops); WAIT=1: made as an
                                     agent-store worker makes it (world size given: an ADD before
                                     its second connection), 0: with wait_for_workers=False (both
                                     connections before a query)

Exits non-zero with the failed check on stderr.
"""
import datetime
import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist


def client(host, port, timeout=30):
    kw = dict(is_master=False, wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout))
    try:
        return dist.TCPStore(host, port, use_libuv=False, **kw)  # torch 2.x: a client of the classic server
    except TypeError:
        return dist.TCPStore(host, port, **kw)  # torch 1.x has no use_libuv


def check(cond, what):
    if not cond:
        sys.exit(f"store_client: {what}")


def ops(host, port):
    s = client(host, port)
    s.set("a", "1")
    check(s.get("a") == b"1", "get after set")
    s.set("a", b"\x00\xffbytes")
    check(s.get("a") == b"\x00\xffbytes", "a set replaces and keeps every byte")
    check(s.add("n", 5) == 5 and s.add("n", -2) == 3, "add counts from 0")
    check(s.get("n") == b"3", "add stores the number as text")
    check(s.compare_set("cs", "", "first") == b"first", "compare_set creates with an empty expected value")
    check(s.compare_set("cs", "wrong", "x") == b"first", "compare_set keeps a value that differs")
    check(s.compare_set("cs", "first", "second") == b"second", "compare_set replaces the expected value")
    if hasattr(s, "check"):  # not in torch 1.x's Python API
        check(s.check(["a", "n"]) and not s.check(["a", "missing"]), "check")
    n = s.num_keys()
    check(n >= 3, f"num_keys {n}")
    check(s.delete_key("cs") and not s.delete_key("cs"), "delete_key says whether it deleted")
    # A wait served by another client's set.
    other = client(host, port)
    threading.Timer(0.3, lambda: other.set("late", "here")).start()
    s.wait(["late", "a"])
    check(s.get("late") == b"here", "wait ends when another client sets the key")
    # A wait that times out, then the connection still serves.
    try:
        s.wait(["never"], datetime.timedelta(milliseconds=300))
        check(False, "a wait for a key nobody sets times out")
    except Exception:
        pass
    if hasattr(s, "multi_set"):
        s.multi_set(["m1", "m2"], ["x", "y"])
        check(s.multi_get(["m1", "m2"]) == [b"x", b"y"], "multi_get")
        s.append("ap", "ab")
        s.append("ap", "cd")
        check(s.get("ap") == b"abcd", "append")
    check(other.get("a") == b"\x00\xffbytes", "a second client sees the first one's keys")
    print("ok", torch.__version__)


def allreduce(host, port, rank, world):
    os.environ.update({"MASTER_ADDR": host, "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world), "TORCHELASTIC_USE_AGENT_STORE": "True",
                       "TORCHELASTIC_RESTART_COUNT": "0", "USE_LIBUV": "0"})
    dist.init_process_group("gloo", init_method="env://", timeout=datetime.timedelta(seconds=60))
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    dist.barrier()
    print("sum", int(t.item()))
    dist.destroy_process_group()


def hold(host, port, wait):
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR1])  # before torch's threads, which inherit it
    if wait:
        s = dist.TCPStore(host, port, 1, False, datetime.timedelta(seconds=30))
    else:
        s = client(host, port)
    s.set("up", "1")
    print("up", flush=True)
    signal.sigwait([signal.SIGUSR1])
    start = time.process_time()  # every thread's
    time.sleep(2)
    used = time.process_time() - start
    check(s.get("up") == b"1", "the store still serves")
    print("cpu", round(used, 2), flush=True)


if __name__ == "__main__":
    mode, host, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if mode == "ops":
        ops(host, port)
    elif mode == "hold":
        hold(host, port, sys.argv[4] == "1")
    else:
        allreduce(host, port, int(sys.argv[4]), int(sys.argv[5]))
