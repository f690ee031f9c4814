#!/usr/bin/env python3
"""The GPU table and checks of issue #27, run by bench/gpu.sh after it built mgtrain against
the machine's CUDA LibTorch. Writes OUT/gpu.json and OUT/gpu.log (every command and its
output). Everything runs under mglaunch when EXTRA/bin/mglaunch starts there, else under
torch's own torchrun; one GPU, so the world is 1 (NCCL included).

Table: mgtrain eager, mgtrain --cuda-graphs and the Python twin
(examples/ddp_fashion_mnist.py --device cuda), Fashion-MNIST CNN, batch 64 and 512, fp32
and bf16 autocast: samples/s as each trainer reports it (its training loop and
evaluation) and test accuracy. Runs alternate trainer by trainer; GPU_REPS rounds
(default 1), the median kept.
"""
import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time

LOG = None


def sh(cmd, timeout=600, env=None):
    t0 = time.time()
    try:
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout,
                           env={**os.environ, **(env or {})})
        rc, out = p.returncode, p.stdout
    except subprocess.TimeoutExpired as e:
        rc, out = 124, (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
    except OSError as e:
        rc, out = 127, str(e)
    dt = time.time() - t0
    LOG.write(f"$ {' '.join(cmd)}\n[rc {rc}, {dt:.1f} s]\n{out[-6000:]}\n")
    LOG.flush()
    return rc, out, dt


def main():
    global LOG
    ap = argparse.ArgumentParser()
    ap.add_argument("--mgtrain", required=True)
    ap.add_argument("--extra", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--c10d-v2", default="on")
    a = ap.parse_args()
    LOG = open(os.path.join(a.out, "gpu.log"), "w")
    mgtrain = os.path.abspath(a.mgtrain)
    data = os.path.join(a.extra, "data")
    if not os.path.exists(os.path.join(data, "train-images-idx3-ubyte.gz")):
        data = "/usr/share/datasets/fashion-mnist"
    py = sys.executable
    tmp = os.path.join(a.out, "work")
    os.makedirs(tmp, exist_ok=True)
    res = {"checks": {}, "table": [], "c10d_reducer_v2_built": a.c10d_v2 == "on"}

    def save():  # after each stage: a run cut short still leaves what it measured
        with open(os.path.join(a.out, "gpu.json"), "w") as f:
            json.dump(res, f, indent=1)

    import torch
    res["device"] = {
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())),
        "driver": sh(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])[1].strip(),
        "cpus": os.cpu_count(),
    }
    del torch

    mgl = os.path.join(a.extra, "bin", "mglaunch")
    rc, _, _ = sh([mgl, "--standalone", "--nproc_per_node=1", "--no_python", "/bin/true"], timeout=60)
    res["launcher"] = "mglaunch" if rc == 0 else "torchrun"

    def launch(prog, args, extra_flags=()):
        if res["launcher"] == "mglaunch":
            base = [mgl, "--standalone", "--nproc_per_node=1", *extra_flags]
            return base + (["--python", py] if prog.endswith(".py") else []) + [prog] + args
        base = [py, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"]
        return base + ([] if prog.endswith(".py") else ["--no-python"]) + [prog] + args

    def mg(args, tag, timeout=600, extra_flags=()):
        summary = os.path.join(tmp, f"{tag}.json")
        if os.path.exists(summary):
            os.remove(summary)
        rc, out, dt = sh(launch(mgtrain, ["--data-dir", data, "--summary-json", summary, *args], extra_flags), timeout)
        s = json.load(open(summary)) if rc == 0 and os.path.exists(summary) else {}
        return rc, s, out, dt

    only_table = os.environ.get("GPU_ONLY_TABLE") == "1"
    if not only_table:
        # --help and the refusals on a real GPU.
        rc, out, _ = sh([mgtrain, "--help"])
        res["checks"]["help_lists_cuda_graphs"] = "--cuda-graphs" in out
        rc, out, _ = sh([mgtrain, "--cuda-graphs", "--find-unused-parameters"])
        res["checks"]["refuses_find_unused"] = {"rc": rc, "line": out.strip().splitlines()[-1] if out.strip() else ""}

        # The graph trains the same weights as the eager loop (MLP: deterministic kernels), with
        # an epoch whose last batch is partial (eager, between replays): 2,000 / 64 = 31.25.
        common = ["--dataset", "synthetic", "--synthetic-size", "2000", "--model", "mlp", "--epochs", "2", "--log-every", "0"]
        e1 = mg(common, "eq_eager1")
        e2 = mg(common, "eq_eager2")
        g1 = mg(common + ["--cuda-graphs"], "eq_graph")
        res["checks"]["graph_vs_eager"] = {
            "eager_rc": e1[0], "graph_rc": g1[0],
            "eager_repeatable": bool(e1[1]) and e1[1].get("weights_sha256") == e2[1].get("weights_sha256"),
            "weights_equal": bool(g1[1]) and g1[1].get("weights_sha256") == e1[1].get("weights_sha256"),
            "graph_used": g1[1].get("cuda_graphs"),
            "loss_eager": e1[1].get("final_train_loss"), "loss_graph": g1[1].get("final_train_loss"),
            "acc_eager": e1[1].get("test_accuracy"), "acc_graph": g1[1].get("test_accuracy"),
        }
        # --reducer c10d on this LibTorch (c10d::Reducer over NCCL) against ours.
        c = mg(common + ["--reducer", "c10d"], "c10d")
        res["checks"]["c10d_reducer"] = {"rc": c[0], "weights_equal_to_ours": bool(c[1]) and c[1].get("weights_sha256") ==
                                         e1[1].get("weights_sha256"), "error": "" if c[0] == 0 else c[2].strip()[-300:]}
        cc = mg(["--model", "cnn", "--epochs", "1", "--batch-size", "512", "--reducer", "c10d", "--log-every", "0"], "c10d_cnn")
        res["checks"]["c10d_reducer"]["cnn_test_accuracy"] = cc[1].get("test_accuracy")
        # NCCL all-reduce, every element checked.
        rc, out, _ = sh(launch(mgtrain, ["--bench", "allreduce", "--min-bytes", "1K", "--max-bytes", "64M", "--step-factor", "8"]))
        rows = [l.split() for l in out.splitlines() if re.match(r"^\S*\s*\d+\s+\d+\s+float", l.split(":", 1)[-1])]
        res["checks"]["nccl_allreduce"] = {"rc": rc, "rows": len(rows), "wrong": [r[-1] for r in rows]}
        save()

        # doctor and --monitor against nvidia-smi, in the same run.
        if res["launcher"] == "mglaunch":
            q = "name,pci.bus_id,memory.total,memory.used,utilization.gpu,temperature.gpu,power.draw"
            rc, smi, _ = sh(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader,nounits"])
            rc2, doc, _ = sh([mgl, "doctor", "--json", "--no-python"])
            try:
                g = json.loads(doc)["gpus"][0]
            except Exception:  # noqa: BLE001 - recorded as is
                g = {"error": doc[-300:]}
            res["checks"]["doctor_vs_nvidia_smi"] = {"nvidia_smi": [x.strip() for x in smi.strip().split(",")], "doctor": g}
            samples_smi = []
            stop = threading.Event()

            def poll():
                while not stop.is_set():
                    t = time.time()
                    _, o, _ = sh(["nvidia-smi", "--query-gpu=memory.used,utilization.gpu,power.draw,temperature.gpu",
                                  "--format=csv,noheader,nounits"], timeout=10)
                    _, apps, _ = sh(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                                    timeout=10)
                    samples_smi.append({"time": t, "gpu": o.strip(), "apps": apps.strip()})
                    stop.wait(0.5)

            th = threading.Thread(target=poll)
            th.start()
            mfile = os.path.join(tmp, "metrics.jsonl")
            if os.path.exists(mfile):
                os.remove(mfile)
            rc, s, out, dt = mg(["--model", "cnn", "--epochs", "3", "--batch-size", "64", "--log-every", "0"], "monitor",
                                extra_flags=("--monitor=0.5", "--metrics-json", mfile))
            stop.set()
            th.join()
            ours = [json.loads(l) for l in open(mfile)] if os.path.exists(mfile) else []
            res["checks"]["monitor_vs_nvidia_smi"] = {
                "rc": rc,
                "monitor_lines": [l for l in out.splitlines() if "monitor:" in l][-3:],
                "agent_samples": [{"time": x.get("time"), "gpus": x.get("gpus"),
                                   "rank_gpus": [r.get("gpus") for r in x.get("ranks", [])],
                                   "rank_pids": [r.get("pid") for r in x.get("ranks", [])]} for x in ours],
                "nvidia_smi_samples": samples_smi,
            }
        save()
    # The table.
    reps = int(os.environ.get("GPU_REPS", "1"))
    epochs = int(os.environ.get("GPU_EPOCHS", "2"))
    cases = []
    for batch in (64, 512):
        for prec in ("fp32", "bf16"):
            for trainer in ("python twin", "mgtrain", "mgtrain --cuda-graphs"):
                cases.append((batch, prec, trainer))
    samples = {c: [] for c in cases}

    def summarize():
        res["table"] = []
        for (batch, prec, trainer), runs in samples.items():
            ok = [x for x in runs if x["samples_per_sec"]]
            res["table"].append({
                "trainer": trainer, "batch": batch, "precision": prec, "epochs": epochs,
                "samples_per_sec": statistics.median(x["samples_per_sec"] for x in ok) if ok else None,
                "test_accuracy": statistics.median(x["test_accuracy"] for x in ok) if ok else None,
                "runs": runs,
            })
        twin = {(t["batch"], t["precision"]): t["samples_per_sec"] for t in res["table"] if t["trainer"] == "python twin"}
        for t in res["table"]:
            base = twin.get((t["batch"], t["precision"]))
            t["vs_twin"] = t["samples_per_sec"] / base if t["samples_per_sec"] and base else None

    for r in range(reps):
        for batch, prec, trainer in cases:
            amp = ["--amp"] if prec == "bf16" else []
            args = ["--model", "cnn", "--epochs", str(epochs), "--batch-size", str(batch), "--log-every", "0"] + amp
            if trainer.startswith("python twin"):
                rc, out, dt = sh(launch("examples/ddp_fashion_mnist.py",
                                        ["--device", "cuda", "--data-dir", data, "--model", "cnn", "--epochs", str(epochs),
                                         "--batch-size", str(batch), "--log-every", "100000"] + amp))
                m = re.search(r"done: (\d+) steps, (\d+) samples/s, .*test accuracy ([0-9.]+)", out)
                sps, acc = (float(m.group(2)), float(m.group(3))) if m and rc == 0 else (None, None)
            else:
                graphs = ["--cuda-graphs"] if "graphs" in trainer else []
                rc, s, out, dt = mg(args + graphs, f"t{batch}{prec}{len(graphs)}")
                sps, acc = s.get("samples_per_sec"), s.get("test_accuracy")
            samples[(batch, prec, trainer)].append({"rc": rc, "samples_per_sec": sps, "test_accuracy": acc, "wall_s": dt})
            summarize()
            save()

    print(json.dumps({k: v for k, v in res.items() if k != "checks"} | {"checks": {k: (v if k not in (
        "monitor_vs_nvidia_smi",) else "...") for k, v in res["checks"].items()}}, default=str)[:8000])
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
