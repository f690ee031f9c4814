# A worker for tests/file_timer_test.cc: torch's own FileTimerClient
# (torch.distributed.elastic.timer) against the agent's FileTimer pipe.
#   hang:   rank 1 takes a 1 s timer (SIGKILL) and sleeps past it; the others finish
#   forge:  rank 0 also writes a request that names the agent's pid, already expired
#   flood:  (no torch) 64 made-up pids x 1,024 timers, then its own 1 s timer; sleeps 30 s
#   setsid: (no torch) starts a child in a session of its own (setsid: out of the worker's
#           process group), which takes a 1 s timer (SIGKILL) and sleeps 30 s; the worker
#           prints how the child ended
#   (else)  every rank takes and releases a 60 s timer and finishes
import json, os, stat, sys, time

path = os.environ.get("TORCHELASTIC_TIMER_FILE")
rank = int(os.environ["RANK"])
if path is None:
    print("no timer file", flush=True)
    sys.exit(0)
print("pipe %s fifo %s" % (path, stat.S_ISFIFO(os.stat(path).st_mode)), flush=True)
if sys.argv[1:] == ["flood"]:  # no torch: 64 made-up pids x 1,024 timers, then its own 1 s timer
    def request(pid, scope, after):
        return json.dumps({"version": 1, "pid": pid, "scope_id": scope,
                           "expiration_time": time.time() + after, "signal": 9}) + "\n"
    with open(path, "w") as pipe:
        for p in range(64):
            pipe.write("".join(request(900000000 + p, "s%d" % s, 3600) for s in range(1024)))
        pipe.write(request(os.getpid(), "step", 1))
    print("flooded", flush=True)
    time.sleep(30)
    print("not reaped", flush=True)
    sys.exit(0)
if sys.argv[1:] == ["setsid"]:
    import subprocess
    child = subprocess.Popen([sys.executable, "-c",
        "import json, os, sys, time\n"
        "open(sys.argv[1], 'w').write(json.dumps({'version': 1, 'pid': os.getpid(), 'scope_id': 'child', "
        "'expiration_time': time.time() + 1, 'signal': 9}) + '\\n')\n"
        "print('child %d session %d' % (os.getpid(), os.getsid(0)), flush=True)\n"
        "time.sleep(30)\n"
        "print('child not reaped', flush=True)\n", path], start_new_session=True)
    print("child ended %d" % child.wait(), flush=True)
    sys.exit(0)
import torch.distributed.elastic.timer as timer

timer.configure(timer.FileTimerClient(path))
mode = sys.argv[1] if len(sys.argv) > 1 else ""
if mode == "forge" and rank == 0:
    with open(path, "w") as pipe:  # a request for a process that is not a worker
        pipe.write(json.dumps({"version": 1, "pid": os.getppid(), "scope_id": "forged",
                               "expiration_time": time.time() - 1, "signal": 9}) + "\n")
# hang: rank 1 takes its timer only once rank 0 is done (a marker beside the pipe, waited for
# at most 60 s): the agent stops the group when the timer fires, and on a loaded machine
# rank 0 could still be importing torch then.
rank0_done = os.path.join(os.path.dirname(path), "rank0.done")
if mode == "hang" and rank == 1:
    end = time.monotonic() + 60
    while not os.path.exists(rank0_done) and time.monotonic() < end:
        time.sleep(0.05)
    with timer.expires(after=1, scope="step"):
        time.sleep(100)
else:
    with timer.expires(after=60, scope="step"):
        time.sleep(0.2)
print("done", flush=True)
if mode == "hang" and rank == 0:
    open(rank0_done, "w").close()
