#!/usr/bin/env python3
"""In-place recovery over NCCL on one GPU (issue #26), run by `bench/gpu.sh OUT EXTRA recovery`
after it built mgtrain against the machine's CUDA LibTorch.

One GPU holds every rank: each emulated node (an mglaunch agent on its own loopback address)
gets its own NCCL_HOSTID, so NCCL sees separate hosts (it refuses two ranks of one host on
one device) and connects them over sockets on `lo`. The rendezvous is embedded in the agent
at 127.0.0.2 (no daemon to carry).

  calm, calm2  two nodes, undisturbed: the reference weights (twice: is the GPU run
               bit-reproducible at all?)
  hit          two nodes and a standby; the other active node's agent SIGKILLed at step 10
               or later; the survivor keeps its process (recoveries in its summary), the
               standby takes the place, and the weights are compared with calm's

Writes OUT/gpu_recovery.json and OUT/gpu_recovery.log. Also runs on a CPU machine with
--backend gloo (to check this script itself).
"""
import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time

LOG = None


def log(s):
    LOG.write(s + "\n")
    LOG.flush()
    print(s, flush=True)


def free_port(addr):
    with socket.socket() as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


class Node:
    def __init__(self, a, tag, index, endpoint, job_id, out):
        self.name = f"{tag}-n{index}"
        self.out_path = os.path.join(out, self.name + ".out")
        self.err_path = os.path.join(out, self.name + ".err")
        env = {**os.environ, "NCCL_HOSTID": f"mgnode{index}", "NCCL_SOCKET_IFNAME": "lo", "NCCL_IB_DISABLE": "1",
               "NCCL_DEBUG": os.environ.get("NCCL_DEBUG", "WARN"),
               "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
        argv = [a.mglaunch, "--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d", f"--rdzv_endpoint={endpoint}",
                f"--rdzv_id={job_id}", "--max_restarts=2", f"--local_addr=127.0.0.{index}", a.mgtrain,
                "--backend", a.backend, "--dataset", "synthetic", "--synthetic-size", "4096", "--batch-size", "32",
                "--model", a.model, "--max-steps", str(a.steps), "--seed", "3", "--log-every", "1", "--timeout", "60",
                "--in-place-recovery", "--summary-json", os.path.join(out, tag + "{rank}.json")]
        log(f"$ [{self.name}] " + " ".join(argv))
        self.p = subprocess.Popen(argv, stdout=open(self.out_path, "w"), stderr=open(self.err_path, "w"), env=env,
                                  start_new_session=True)

    def text(self):
        return open(self.out_path, errors="replace").read() + open(self.err_path, errors="replace").read()

    def wait(self, seconds):
        try:
            return self.p.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            os.killpg(self.p.pid, signal.SIGKILL)
            self.p.wait()
            return "timeout"


def until(pred, seconds):
    end = time.time() + seconds
    while time.time() < end:
        if pred():
            return True
        time.sleep(0.05)
    return False


def summary(out, tag, rank):
    try:
        return json.load(open(os.path.join(out, f"{tag}{rank}.json")))
    except (OSError, ValueError):
        return {}


def calm(a, tag):
    ep = f"127.0.0.2:{free_port('127.0.0.2')}"
    nodes = [Node(a, tag, 2, ep, tag, a.out), Node(a, tag, 3, ep, tag, a.out)]
    codes = [n.wait(240) for n in nodes]
    res = {"codes": codes, "sha": [summary(a.out, tag, r).get("weights_sha256") for r in (0, 1)]}
    log(f"{tag}: {json.dumps(res)}")
    return res


def hit(a):
    tag = "hit"
    ep = f"127.0.0.2:{free_port('127.0.0.2')}"
    nodes = [Node(a, tag, 2, ep, tag, a.out), Node(a, tag, 3, ep, tag, a.out)]
    lead = None

    def find_lead():
        nonlocal lead
        for i in (0, 1):
            if " step 1/" in open(nodes[i].out_path, errors="replace").read():
                lead = i
        return lead is not None

    res = {}
    if not until(find_lead, 180):
        res["error"] = "no step 1 within 180 s"
    else:
        nodes.append(Node(a, tag, 4, ep, tag, a.out))
        res["standby_seen"] = until(lambda: "standby for job" in nodes[2].text(), 60)
        res["step10_seen"] = until(lambda: " step 10/" in open(nodes[lead].out_path, errors="replace").read(), 180)
        victim = nodes[1 - lead]
        t_kill = time.time()
        os.kill(victim.p.pid, signal.SIGKILL)
        res["victim_code"] = victim.wait(10)
        res["lead_code"] = nodes[lead].wait(240)
        res["standby_code"] = nodes[2].wait(60)
        res["wall_after_kill_s"] = round(time.time() - t_kill, 2)
    for n in nodes:
        if n.p.poll() is None:
            os.killpg(n.p.pid, signal.SIGKILL)
            n.p.wait()
    s = [summary(a.out, tag, r) for r in (0, 1)]
    res["sha"] = [x.get("weights_sha256") for x in s]
    res["steps"] = [x.get("steps") for x in s]
    res["recoveries"] = [x.get("recoveries") for x in s]
    res["took_state_line"] = [ln for n in nodes for ln in n.text().splitlines() if "took step" in ln][:4]
    res["nccl_lines"] = [ln for n in nodes for ln in n.text().splitlines() if "NCCL" in ln or "watchdog" in ln.lower()][:20]
    log(f"hit: {json.dumps(res)}")
    return res


def main():
    global LOG
    ap = argparse.ArgumentParser()
    ap.add_argument("--mgtrain", required=True)
    ap.add_argument("--mglaunch", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--backend", default="nccl")
    ap.add_argument("--steps", type=int, default=60)
    # The MLP: cuDNN's convolutions are not bit-reproducible run to run, so the CNN's weights
    # cannot be compared with an undisturbed run's.
    ap.add_argument("--model", default="mlp")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    LOG = open(os.path.join(a.out, "gpu_recovery.log"), "w")
    r = {"backend": a.backend}
    try:
        import torch
        r["torch"] = torch.__version__
        r["cuda"] = torch.version.cuda
        r["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None
        r["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except Exception as e:  # the CPU check of this script runs with /usr/bin/python3 or without torch
        r["torch"] = f"unknown ({e})"
    r["calm"] = calm(a, "calm")
    r["calm2"] = calm(a, "calm2")
    r["hit"] = hit(a)
    ref = r["calm"]["sha"][0]
    h = r["hit"]
    r["verdict"] = {
        "gpu_run_reproducible": ref is not None and r["calm2"]["sha"][0] == ref,
        "job_exit_0": h.get("lead_code") == 0 and h.get("standby_code") == 0,
        "survivor_recovered_in_place": any(rec for rec in h["recoveries"] if rec),
        "weights_equal_undisturbed": ref is not None and h["sha"] == [ref, ref],
    }
    log("verdict: " + json.dumps(r["verdict"]))
    json.dump(r, open(os.path.join(a.out, "gpu_recovery.json"), "w"), indent=1)
    return 0 if all(r["verdict"][k] for k in ("job_exit_0", "survivor_recovered_in_place")) else 1


if __name__ == "__main__":
    sys.exit(main())
