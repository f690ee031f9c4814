# A worker for tests/file_timer_test.cc: torch's own FileTimerClient
# (torch.distributed.elastic.timer) against the agent's FileTimer pipe.
#   hang:   rank 1 takes a 1 s timer (SIGKILL) and sleeps past it; the others finish
#   forge:  rank 0 also writes a request that names the agent's pid, already expired
#   (else)  every rank takes and releases a 60 s timer and finishes
import json, os, stat, sys, time

path = os.environ.get("TORCHELASTIC_TIMER_FILE")
rank = int(os.environ["RANK"])
if path is None:
    print("no timer file", flush=True)
    sys.exit(0)
print("pipe %s fifo %s" % (path, stat.S_ISFIFO(os.stat(path).st_mode)), flush=True)
import torch.distributed.elastic.timer as timer

timer.configure(timer.FileTimerClient(path))
mode = sys.argv[1] if len(sys.argv) > 1 else ""
if mode == "forge" and rank == 0:
    with open(path, "w") as pipe:  # a request for a process that is not a worker
        pipe.write(json.dumps({"version": 1, "pid": os.getppid(), "scope_id": "forged",
                               "expiration_time": time.time() - 1, "signal": 9}) + "\n")
if mode == "hang" and rank == 1:
    with timer.expires(after=1, scope="step"):
        time.sleep(100)
else:
    with timer.expires(after=60, scope="step"):
        time.sleep(0.2)
print("done", flush=True)
