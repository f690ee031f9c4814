"""The seed-style recovery of bench.py's "recovery" case: a plain PyTorch DDP script as the
getting-started guides write it (like examples/ddp_train.py), which checkpoints every N
steps on rank 0 and, when torchrun restarts it, reloads the last checkpoint and goes on
from there. The model and data are mgtrain's `--model mlp --dataset synthetic`
(784-256-128-10 on random 28x28 inputs, SGD with momentum), so a step costs about the same.

    ../shared/peers/torchrun --nnodes=2 --nproc_per_node=1 --rdzv_backend=c10d ... \\
        bench/ddp_checkpoint_train.py --checkpoint-dir DIR --checkpoint-every 10

Rank 0 prints one progress line per step, in mgtrain's format (`epoch E/N step K/T loss L
...`), and on a restart `resumed from DIR/checkpoint.pt at step C` (or `no checkpoint`).
"""
import argparse
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--checkpoint-dir", required=True)
    p.add_argument("--checkpoint-every", type=int, default=10)
    p.add_argument("--samples", type=int, default=4096)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--max-steps", type=int, default=60)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=7)
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    g = torch.Generator().manual_seed(args.seed)
    data_x = torch.randn(args.samples, 784, generator=g)
    data_y = torch.randint(0, 10, (args.samples,), generator=g)
    model = DDP(nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 10)))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    sampler = DistributedSampler(range(args.samples), num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    per_epoch = math.ceil(sampler.num_samples / args.batch_size)
    epochs = math.ceil(args.max_steps / per_epoch)

    # Resume: every rank loads the checkpoint rank 0 wrote (one directory on one machine).
    ckpt = os.path.join(args.checkpoint_dir, "checkpoint.pt")
    step = 0
    if os.path.exists(ckpt):
        state = torch.load(ckpt, map_location="cpu")
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        step = state["step"]
        if rank == 0:
            print(f"resumed from {ckpt} at step {step}", flush=True)
    elif rank == 0:
        print("no checkpoint: starting at step 0", flush=True)

    start = time.time()
    done = 0
    for epoch in range(step // per_epoch, epochs):
        sampler.set_epoch(epoch)
        idx = list(sampler)
        for b in range(step % per_epoch if epoch == step // per_epoch else 0, per_epoch):
            if step >= args.max_steps:
                break
            bi = idx[b * args.batch_size:(b + 1) * args.batch_size]
            opt.zero_grad()
            loss = F.cross_entropy(model(data_x[bi]), data_y[bi])
            loss.backward()
            opt.step()
            step += 1
            done += 1
            if rank == 0:
                if step % args.checkpoint_every == 0:  # the guides' pattern: rank 0 saves
                    tmp = ckpt + ".tmp"
                    torch.save({"model": model.module.state_dict(), "optimizer": opt.state_dict(), "step": step}, tmp)
                    os.replace(tmp, ckpt)
                sps = done * args.batch_size * world / max(time.time() - start, 1e-9)
                print(f"epoch {epoch + 1}/{epochs} step {step}/{args.max_steps} loss {loss.item():.4f} "
                      f"samples/s {sps:.0f}", flush=True)
    if rank == 0:
        print(f"done: {step} steps", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
