"""A torch worker for tests/agent_store_test.cc: env:// gloo all-reduce through whatever store
the launcher announces. Prints "store <TORCHELASTIC_USE_AGENT_STORE> sum <S> bound <B>", where
B says whether this process listens on MASTER_PORT itself (it must not with the agent's store).
"""
import datetime
import os
import time

import torch
import torch.distributed as dist


def listens_on(port):
    """True when one of this process's sockets listens on `port` (/proc/net/tcp{,6})."""
    inodes = set()
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(name) as f:
                for line in f.readlines()[1:]:
                    fields = line.split()
                    if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                        inodes.add(fields[9])
        except OSError:
            pass
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:[") and target[8:-1] in inodes:
            return True
    return False


dist.init_process_group("gloo", init_method="env://", timeout=datetime.timedelta(seconds=60))
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
bound = listens_on(int(os.environ["MASTER_PORT"]))
late = float(os.environ.get("AGENT_STORE_TEST_LATE", "0"))
store = dist.distributed_c10d._get_default_store()
if late and dist.get_rank() == 0:
    store.set("rank0_pid", str(os.getpid()))
dist.barrier()
if late and dist.get_rank() != 0:
    # Once rank 0's process is gone (same machine; waited for at most 120 s, not guessed with
    # a sleep that a loaded machine outlasts) and LATE s more, node 0's agent store must
    # still serve this rank.
    rank0 = int(store.get("rank0_pid"))
    end = time.monotonic() + 120
    while os.path.exists(f"/proc/{rank0}") and time.monotonic() < end:
        time.sleep(0.05)
    time.sleep(late)
    store.set("late", "1")
    print("late store use ok", flush=True)
dist.destroy_process_group()
print("store", os.environ.get("TORCHELASTIC_USE_AGENT_STORE"), "sum", int(t.item()), "bound", bound, flush=True)
