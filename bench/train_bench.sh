#!/usr/bin/env bash
# mgtrain vs its Python twin (examples/ddp_fashion_mnist.py, PyTorch DDP): same CNN, data,
# optimizer and hyper-parameters, 2 processes with gloo on CPU, one Fashion-MNIST epoch
# each, both under mglaunch so only the trainer differs. Prints samples/s, accuracy, ratio.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
epochs=${EPOCHS:-1}
ours=$("$build/bin/mglaunch" --standalone --nproc_per_node=2 "$build/bin/mgtrain" --model cnn --epochs "$epochs" \
       --log-every 0 2>/dev/null | grep 'done:')
twin=$("$build/bin/mglaunch" --standalone --nproc_per_node=2 --python /usr/bin/python3 examples/ddp_fashion_mnist.py \
       --model cnn --epochs "$epochs" --log-every 100000 2>/dev/null | grep 'done:')
sps() { sed -E 's/.* ([0-9.]+) samples\/s.*/\1/' <<<"$1"; }
acc() { sed -E 's/.*test accuracy ([0-9.]+).*/\1/' <<<"$1"; }
echo "| trainer (2 procs, gloo, CPU, CNN, $epochs epoch) | samples/s | test accuracy |"
echo "|---|---|---|"
echo "| mgtrain | $(sps "$ours") | $(acc "$ours") |"
echo "| Python twin (PyTorch DDP) | $(sps "$twin") | $(acc "$twin") |"
awk -v a="$(sps "$ours")" -v b="$(sps "$twin")" 'BEGIN { printf "mgtrain / twin samples/s: %.2fx\n", a / b }'
