"""A plain PyTorch DDP script, written the way the getting-started guides write them.

Runs unchanged under torchrun or mglaunch:

    mglaunch --standalone --nproc_per_node=4 examples/ddp_train.py

It learns y = sin(x0) + x1*x2 on a synthetic dataset with a small MLP, shards the data
with DistributedSampler, all-reduces gradients with gloo (CPU) and logs from rank 0 only.
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def make_dataset(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 3, generator=g) * 4 - 2
    y = torch.sin(x[:, 0]) + x[:, 1] * x[:, 2]
    return TensorDataset(x, y.unsqueeze(1))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--samples", type=int, default=8192)
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)

    train = make_dataset(args.samples, seed=1)
    sampler = DistributedSampler(train, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler)
    model = DDP(nn.Sequential(nn.Linear(3, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    loss_fn = nn.MSELoss()

    if rank == 0:
        print(f"training on world_size={world} (local ranks {os.environ['LOCAL_WORLD_SIZE']} per node)")
    start = time.time()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        total, count = 0.0, 0
        for x, y in loader:
            opt.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
            total += loss.item() * len(x)
            count += len(x)
        stats = torch.tensor([total, count], dtype=torch.float64)
        dist.all_reduce(stats)
        if rank == 0:
            print(f"epoch {epoch + 1}/{args.epochs} loss {stats[0] / stats[1]:.4f} ({time.time() - start:.1f}s)")
    if rank == 0:
        print("done")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
