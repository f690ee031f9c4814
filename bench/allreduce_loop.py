#!/usr/bin/python3
"""What a Python user would run: a torch.distributed.all_reduce loop (gloo on CPU) over the
same sizes, with the same method and columns as `mgtrain --bench allreduce`: per size a
tensor of ones, WARMUP untimed all-reduces, a barrier, ITERS timed all-reduces, then a
check that ranks contributing rank+1 sum to world*(world+1)/2. Start it under a launcher
(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set).

Usage: allreduce_loop.py [--min-bytes N] [--max-bytes N] [--step-factor F] [--iters N] [--warmup N]
"""
import argparse
import os
import sys
import time

import torch
import torch.distributed as dist


def parse_bytes(text):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper()
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--min-bytes", default="4K")
    p.add_argument("--max-bytes", default="16M")
    p.add_argument("--step-factor", type=float, default=4.0)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    a = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    esize = 4  # float32, as mgtrain's default --dtype float
    lo, hi = max(esize, parse_bytes(a.min_bytes)), parse_bytes(a.max_bytes)
    if rank == 0:
        print(f"# python all_reduce loop: backend gloo, world {world}, {a.iters} iters after {a.warmup} warm-up")
        print(f"{'size(B)':>12} {'count':>12} {'type':>8} {'time(us)':>12} {'algbw(GB/s)':>10} {'busbw(GB/s)':>10} "
              f"{'#wrong':>8}")
    total_wrong = 0
    size = lo
    while size <= hi:
        count = size // esize
        t = torch.ones(count, dtype=torch.float32)
        for _ in range(a.warmup):
            dist.all_reduce(t)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(a.iters):
            dist.all_reduce(t)
        us = (time.perf_counter() - t0) * 1e6 / a.iters
        t.fill_(rank + 1)
        dist.all_reduce(t)
        wrong = int((t != world * (world + 1) / 2).sum())
        total_wrong += wrong
        algbw = size / us / 1e3
        busbw = algbw * 2.0 * (world - 1) / world
        if rank == 0:
            print(f"{size:>12} {count:>12} {'float':>8} {us:>12.1f} {algbw:>10.3f} {busbw:>10.3f} {wrong:>8}")
        size = max(size + esize, int(size * a.step_factor))
    sys.stdout.flush()
    dist.destroy_process_group()
    return 0 if total_wrong == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
