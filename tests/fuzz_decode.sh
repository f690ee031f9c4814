#!/usr/bin/env bash
# Builds the libFuzzer target for proto::decode with clang (ASan + UBSan) and runs it for
# SECONDS (default 20; the issue's 10-minute run: tests/fuzz_decode.sh 600).
set -euo pipefail
src=$(cd "$(dirname "$0")/.." && pwd)
seconds=${1:-20}
out=${FUZZ_DIR:-$(mktemp -d)}
clang++ -std=c++20 -O1 -g -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined -DFMT_HEADER_ONLY \
  -I"$src" "$src/proto/frame.cc" "$src/tests/fuzz_decode.cc" -o "$out/fuzz_decode"
mkdir -p "$out/corpus"
exec "$out/fuzz_decode" -max_total_time="$seconds" -max_len=8192 -print_final_stats=1 "$out/corpus"
