#!/usr/bin/env bash
# mgtrain vs its Python twin (examples/ddp_fashion_mnist.py, PyTorch DDP): same CNN graph,
# data, optimizer and hyper-parameters, gloo on CPU, one Fashion-MNIST epoch per run, all
# under mglaunch so only the trainer differs. For each process count in $NPROCS and seed
# in $SEEDS the runs alternate: mgtrain, the fair twin (mgtrain's model-level choices:
# pool before ReLU, in-place ReLUs, channels-last, grads set to None) and the legacy twin
# (--legacy, the earlier comparison). Prints per-run figures, means and both ratios, in
# wall-clock samples/s and in samples per CPU second.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
epochs=${EPOCHS:-1}
seeds=${SEEDS:-1 2 3}
nprocs=${NPROCS:-1 2}
extra=${EXTRA:-}  # e.g. EXTRA="--train-subset 20000" for a shorter run (given to all three)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}  # the same intra-op threads for both trainers
sps() { sed -E 's/.* ([0-9.]+) samples\/s.*/\1/' <<<"$1"; }
cpu() { sed -E 's/.* ([0-9.]+) per cpu-s.*/\1/' <<<"$1"; }
acc() { sed -E 's/.*test accuracy ([0-9.]+).*/\1/' <<<"$1"; }
fig() { echo "$(sps "$1") $(cpu "$1") $(acc "$1")"; }
twin() {
  "$build/bin/mglaunch" --standalone --nproc_per_node="$1" --python /usr/bin/python3 examples/ddp_fashion_mnist.py \
    --model cnn --epochs "$epochs" --seed "$2" --log-every 100000 $extra "${@:3}" 2>/dev/null | grep 'done:'
}
# Samples/s is wall time; samples per CPU second (all ranks' CPU time in the training
# loop) is the figure to trust when other jobs load the machine.
for n in $nprocs; do
  rows=""
  for seed in $seeds; do
    ours=$("$build/bin/mglaunch" --standalone --nproc_per_node="$n" "$build/bin/mgtrain" --model cnn --epochs "$epochs" \
           --seed "$seed" --log-every 0 $extra 2>/dev/null | grep 'done:')
    fair=$(twin "$n" "$seed")
    legacy=$(twin "$n" "$seed" --legacy)
    rows+="$seed $(fig "$ours") $(fig "$fair") $(fig "$legacy")"$'\n'
  done
  echo "### $n process(es), OMP_NUM_THREADS=$OMP_NUM_THREADS"
  echo "| seed | mgtrain samples/s | per cpu-s | accuracy | fair twin samples/s | per cpu-s | accuracy | legacy twin samples/s | per cpu-s | accuracy |"
  echo "|---|---|---|---|---|---|---|---|---|---|"
  awk 'NF == 10 { printf "| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |\n", $1, $2, $3, $4, $5, $6, $7, $8, $9, $10;
                  for (i = 2; i <= 10; i++) m[i] += $i; n++ }
       END { printf "| mean | %.0f | %.0f | %.4f | %.0f | %.0f | %.4f | %.0f | %.0f | %.4f |\n",
                    m[2]/n, m[3]/n, m[4]/n, m[5]/n, m[6]/n, m[7]/n, m[8]/n, m[9]/n, m[10]/n;
             printf "mgtrain / fair twin: %.2fx samples/s, %.2fx per cpu-s (accuracy %+.2f points); ", m[2]/m[5], m[3]/m[6], (m[4]-m[7])*100/n;
             printf "mgtrain / legacy twin: %.2fx samples/s, %.2fx per cpu-s\n", m[2]/m[8], m[3]/m[9] }' <<<"$rows"
done
