"""Plain PyTorch DDP on Gloo (CPU) with in-place recovery (mglaunch_recovery): the seed's
Fashion-MNIST CNN (examples/ddp_fashion_mnist.py), a fixed number of steps, deterministic
for a --seed. Under mglaunch a lost node costs its interrupted step, not the run; under
torchrun it trains as usual (recovery off, one line says so). docs/python-recovery.md.

    mglaunch --nnodes=2 --rdzv_backend=c10d --rdzv_endpoint=HOST:PORT --prestart-standby \\
        examples/ddp_recovery.py --steps 100 --seed 1 --summary-json /tmp/s{rank}.json
    ../shared/peers/torchrun --standalone --nproc_per_node=2 examples/ddp_recovery.py --steps 100

Rank 0 prints `step N` after every step. --summary-json PATH ({rank} in PATH is the rank)
gets steps, recoveries ([{"step", "seconds", "lost"}]: the step redone, from the failure's
detection to that step's end) and weights_sha256 (of the model's parameters and buffers),
as mgtrain's summary."""
import argparse
import hashlib
import json
import math
import os
import sys
import time
from datetime import timedelta

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
try:
    import mglaunch_recovery  # on the PYTHONPATH of every worker mglaunch starts
except ImportError:  # another launcher (torchrun) on a checkout: the package beside this directory
    sys.path.insert(1, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
    import mglaunch_recovery
from ddp_fashion_mnist import Cnn, Mlp, load_idx  # noqa: E402  the seed's models and reader


def weights_sha256(module):
    h = hashlib.sha256()
    for t in module.state_dict().values():
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=100, help="optimizer steps in all")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--summary-json", default="", help="summary file; {rank} is replaced by the rank")
    p.add_argument("--model", choices=["cnn", "mlp"], default="cnn", help="mlp: the seed's cheaper model (tests)")
    p.add_argument("--data-dir", default="/usr/share/datasets/fashion-mnist")
    p.add_argument("--train-subset", type=int, default=8192, help="first N training images (-1: all)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--timeout", type=float, default=300, help="seconds: the process group's timeout, and each wait "
                   "for the agent's pause and assign")
    p.add_argument("--step-ms", type=float, default=0, help="sleep this long in each step (benchmarks: a slower step)")
    p.add_argument("--lag-ms", type=float, default=0, help="tests: ranks other than 0 sleep this long before "
                   "backward(), so rank 0 spends the step waiting inside the gradient all-reduce")
    p.add_argument("--dropout", type=float, default=0.1, help="dropout on the input (the RNG's part in the weights)")
    args = p.parse_args()

    rec = mglaunch_recovery.Recovery(backend="gloo", timeout=timedelta(seconds=args.timeout))  # first: a standby says it is ready early
    # Everything that needs no rank: a standby's pre-started worker does it before its place.
    train_x, train_y = load_idx(args.data_dir, True, args.train_subset)
    torch.manual_seed(args.seed)
    net = torch.nn.Sequential(torch.nn.Dropout(args.dropout), Cnn() if args.model == "cnn" else Mlp())
    opt = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=args.momentum)
    rec.start(net, opt, wrap=DDP)
    start = time.time()

    shards = {}  # (epoch, rank, world) -> this rank's sample indices of the epoch

    def batch(step):
        """The data position is the step: the same batches whatever happened before."""
        world, rank = rec.world_size, rec.rank
        per_rank = math.ceil(len(train_y) / world)
        steps_per_epoch = math.ceil(per_rank / args.batch_size)
        epoch, b = divmod(step, steps_per_epoch)
        key = (epoch, rank, world)
        if key not in shards:
            sampler = DistributedSampler(range(len(train_y)), num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
            sampler.set_epoch(epoch)
            shards.clear()
            shards[key] = torch.tensor(list(sampler))
        return shards[key][b * args.batch_size:(b + 1) * args.batch_size]

    def train_step(step):
        bi = batch(step)
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(rec.model(train_x[bi]), train_y[bi])
        if args.lag_ms > 0 and rec.rank != 0:
            time.sleep(args.lag_ms / 1000)
        loss.backward()
        opt.step()
        if args.step_ms > 0:
            time.sleep(args.step_ms / 1000)
        if rec.rank == 0:
            print(f"step {step + 1} loss {loss.item():.4f}", flush=True)

    rec.run(train_step, args.steps)
    digest = weights_sha256(net)
    if rec.rank == 0:
        print(f"done: {rec.step} steps in {time.time() - start:.1f} s, {len(rec.recoveries)} recoveries, "
              f"weights sha256 {digest}", flush=True)
    if args.summary_json:
        summary = {"rank": rec.rank, "world_size": rec.world_size, "steps": rec.step, "recovery": rec.enabled,
                   "recoveries": rec.recoveries, "weights_sha256": digest}
        with open(args.summary_json.replace("{rank}", str(rec.rank)), "w") as f:
            json.dump(summary, f, indent=2)


if __name__ == "__main__":
    main()
