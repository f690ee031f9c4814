#!/usr/bin/env bash
# The GPU checks (issue #27) in one run on a machine with an NVIDIA GPU and CUDA LibTorch
# from pip (python3 -c 'import torch' works there), nothing else assumed:
#   bench/gpu.sh OUT [EXTRA] [recovery]
# builds mgtrain alone against that LibTorch (-DMGLAUNCH_WORKER_ONLY=ON), then runs
# bench/gpu_bench.py, which writes OUT/gpu.json (bench/render_gpu.py turns it into the
# GPU table of docs/benchmarks.md). EXTRA (default .gpu) may hold what the machine lacks:
#   EXTRA/sys/{include,lib}  header-only CLI11, nlohmann_json and fmt; OpenSSL and zlib
#   EXTRA/data               the Fashion-MNIST IDX .gz files
#   EXTRA/bin/mglaunch       an mglaunch built elsewhere (EXTRA/bin/lib: its libraries),
#                            for the launcher, doctor and --monitor checks
# With `recovery`, it runs bench/gpu_recovery.py instead (#26: in-place recovery over NCCL,
# every rank on the one GPU; OUT/gpu_recovery.json).
set -uo pipefail
out=${1:?usage: bench/gpu.sh OUT [EXTRA]}
extra=$(readlink -f "${2:-.gpu}")
mkdir -p "$out"
log=$out/build.log
prefix=$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)') || { echo "gpu.sh: python3 has no torch" | tee "$log"; exit 3; }
configure() {
  rm -rf build-gpu
  cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DMGLAUNCH_WORKER_ONLY=ON -DMGLAUNCH_WITH_TORCH=ON \
    -DMGLAUNCH_WITH_CUDA=ON "-DCMAKE_PREFIX_PATH=$prefix" "-DMGLAUNCH_EXTRA_PREFIX=$extra/sys" \
    "-DOPENSSL_ROOT_DIR=$extra/sys" "-DZLIB_ROOT=$extra/sys" "$@" >>"$log" 2>&1
}
c10d_v2=on
{ configure && cmake --build build-gpu -j "$(nproc)" >>"$log" 2>&1; } || {
  echo "=== build failed; again without --reducer c10d for LibTorch 2.x" >>"$log"
  c10d_v2=off
  configure -DMGLAUNCH_C10D_REDUCER_V2=OFF && cmake --build build-gpu -j "$(nproc)" >>"$log" 2>&1
} || { echo "gpu.sh: the build failed, see $log"; tail -40 "$log"; exit 1; }
export LD_LIBRARY_PATH="$extra/bin/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
if [ "${3:-}" = recovery ]; then
  exec python3 -u bench/gpu_recovery.py --mgtrain build-gpu/bin/mgtrain --mglaunch "$extra/bin/mglaunch" --out "$out"
fi
exec python3 -u bench/gpu_bench.py --mgtrain build-gpu/bin/mgtrain --extra "$extra" --out "$out" --c10d-v2 "$c10d_v2"
