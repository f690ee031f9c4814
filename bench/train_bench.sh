#!/usr/bin/env bash
# mgtrain vs its Python twin (examples/ddp_fashion_mnist.py, PyTorch DDP): same CNN, data,
# optimizer and hyper-parameters, 2 processes with gloo on CPU, one Fashion-MNIST epoch
# per run, both under mglaunch so only the trainer differs. Runs alternate between the
# two for each seed in $SEEDS; prints per-run figures, means and the samples/s ratio.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
epochs=${EPOCHS:-1}
seeds=${SEEDS:-1 2 3}
sps() { sed -E 's/.* ([0-9.]+) samples\/s.*/\1/' <<<"$1"; }
acc() { sed -E 's/.*test accuracy ([0-9.]+).*/\1/' <<<"$1"; }
rows=""
for seed in $seeds; do
  ours=$("$build/bin/mglaunch" --standalone --nproc_per_node=2 "$build/bin/mgtrain" --model cnn --epochs "$epochs" \
         --seed "$seed" --log-every 0 2>/dev/null | grep 'done:')
  twin=$("$build/bin/mglaunch" --standalone --nproc_per_node=2 --python /usr/bin/python3 examples/ddp_fashion_mnist.py \
         --model cnn --epochs "$epochs" --seed "$seed" --log-every 100000 2>/dev/null | grep 'done:')
  rows+="$seed $(sps "$ours") $(acc "$ours") $(sps "$twin") $(acc "$twin")"$'\n'
done
echo "| seed | mgtrain samples/s | mgtrain accuracy | twin samples/s | twin accuracy |"
echo "|---|---|---|---|---|"
awk 'NF == 5 { printf "| %s | %s | %s | %s | %s |\n", $1, $2, $3, $4, $5;
               a += $2; b += $3; c += $4; d += $5; n++ }
     END { printf "| mean | %.0f | %.4f | %.0f | %.4f |\n", a/n, b/n, c/n, d/n;
           printf "mgtrain / twin samples/s: %.2fx; accuracy difference %+.2f points\n", a/c, (b-d)*100/n }' <<<"$rows"
