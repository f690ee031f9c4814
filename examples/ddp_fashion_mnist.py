"""The Python twin of mgtrain: same model, data, optimizer and hyper-parameters in
PyTorch DDP, reading the same gzipped IDX files without torchvision. It also makes
mgtrain's model-level choices (the same forward graph: pool before ReLU, in-place ReLUs;
channels-last CNN and inputs on CPU; gradients reset to None; evaluation in chunks of
1000), so that a comparison measures the trainers; --legacy runs the earlier twin
(ReLU then pool, NCHW, zero-filled gradients, one evaluation batch) for the old ratio.

    ../shared/peers/torchrun --standalone --nproc_per_node=2 examples/ddp_fashion_mnist.py
    mglaunch --standalone --nproc_per_node=2 --python /usr/bin/python3 examples/ddp_fashion_mnist.py

On a GPU (--device cuda) it is mgtrain's CUDA twin: NCCL, the data set and each epoch's
sample indices resident on the device, --amp for bf16 autocast of the forward pass, and
the loss read back only for progress lines, as mgtrain does.
"""
import argparse
import gzip
import math
import os
import struct
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler

MEAN, STD = 0.2860, 0.3530
LEGACY = False


def load_idx(data_dir, train, limit):
    prefix = os.path.join(data_dir, "train" if train else "t10k")
    with gzip.open(prefix + "-images-idx3-ubyte.gz") as f:
        _, n, rows, cols = struct.unpack(">IIII", f.read(16))
        images = np.frombuffer(f.read(), dtype=np.uint8).reshape(n, 1, rows, cols)
    with gzip.open(prefix + "-labels-idx1-ubyte.gz") as f:
        f.read(8)
        labels = np.frombuffer(f.read(), dtype=np.uint8)
    if limit >= 0:
        images, labels = images[:limit], labels[:limit]
    x = (torch.from_numpy(images.astype(np.float32)) / 255.0 - MEAN) / STD
    return x, torch.from_numpy(labels.astype(np.int64))


class Cnn(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3)
        self.conv2 = nn.Conv2d(16, 32, 3)
        self.fc1 = nn.Linear(32 * 12 * 12, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        if LEGACY:
            x = F.relu(self.conv1(x))
            x = F.max_pool2d(F.relu(self.conv2(x)), 2)
            return self.fc2(F.relu(self.fc1(x.flatten(1))))
        # mgtrain's graph: max-pool and ReLU commute, so pool first; in-place ReLUs.
        x = self.conv1(x).relu_()
        x = F.max_pool2d(self.conv2(x), 2).relu_()
        return self.fc2(self.fc1(x.flatten(1)).relu_())


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(784, 256), nn.Linear(256, 128), nn.Linear(128, 10)

    def forward(self, x):
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x.flatten(1))))))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data-dir", default="/usr/share/datasets/fashion-mnist")
    p.add_argument("--model", choices=["cnn", "mlp"], default="cnn")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--train-subset", type=int, default=-1)
    p.add_argument("--test-subset", type=int, default=-1)
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument("--legacy", action="store_true", help="the earlier twin: NCHW, ReLU before pool, zeroed grads")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: NCCL, data on the GPU")
    p.add_argument("--amp", action="store_true", help="bf16 autocast of the forward pass (cuda)")
    args = p.parse_args()
    if args.amp and args.device != "cuda":
        p.error("--amp needs --device cuda")
    global LEGACY
    LEGACY = args.legacy

    cuda = args.device == "cuda"
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    train_x, train_y = (t.to(dev) for t in load_idx(args.data_dir, True, args.train_subset))
    test_x, test_y = (t.to(dev) for t in load_idx(args.data_dir, False, args.test_subset))
    torch.manual_seed(args.seed)
    net = (Cnn() if args.model == "cnn" else Mlp()).to(dev)
    if args.model == "cnn" and not LEGACY:  # mgtrain runs its CNN channels-last on CPU
        net = net.to(memory_format=torch.channels_last)
        train_x = train_x.contiguous(memory_format=torch.channels_last)
        test_x = test_x.contiguous(memory_format=torch.channels_last)
    model = DDP(net, device_ids=[dev.index] if cuda else None)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    sampler = DistributedSampler(range(len(train_y)), num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    steps_per_epoch = math.ceil(sampler.num_samples / args.batch_size)
    if rank == 0:
        print(f"ddp_fashion_mnist: {args.model}, world {world}, {steps_per_epoch} steps/epoch", flush=True)
    def train_step(bi):
        x, y = train_x[bi], train_y[bi]
        opt.zero_grad(set_to_none=not LEGACY)
        if args.amp:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(x)
        else:
            logits = model(x)
        loss = F.cross_entropy(logits.float(), y)
        loss.backward()
        opt.step()
        return loss.detach()

    start, cpu_start, samples, step = time.time(), time.process_time(), 0, 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        idx = torch.tensor(list(sampler), device=dev)
        model.train()
        for b in range(0, len(idx), args.batch_size):
            bi = idx[b:b + args.batch_size]
            loss = train_step(bi)
            step += 1
            samples += len(bi) * world
            if rank == 0 and step % args.log_every == 0:
                print(f"epoch {epoch + 1} step {step} loss {loss.item():.4f} "
                      f"samples/s {samples / (time.time() - start):.0f}", flush=True)
        model.eval()
        with torch.no_grad():
            shard = torch.arange(rank, len(test_y), world, device=dev)
            chunk = len(shard) if LEGACY else 1000
            correct = sum((model(test_x[shard[b:b + chunk]]).argmax(1) == test_y[shard[b:b + chunk]]).sum().item()
                          for b in range(0, len(shard), chunk))
        stats = torch.tensor([correct, len(shard)], dtype=torch.float64, device=dev)
        dist.all_reduce(stats)
        acc = (stats[0] / stats[1]).item()
        if rank == 0:
            print(f"epoch {epoch + 1} test accuracy {acc:.4f}", flush=True)
    if rank == 0:
        cpu = (time.process_time() - cpu_start) * world  # every rank did the same work
        print(f"done: {step} steps, {samples / (time.time() - start):.0f} samples/s, {samples / cpu:.0f} per cpu-s, "
              f"test accuracy {acc:.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
