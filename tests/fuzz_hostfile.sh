#!/usr/bin/env bash
# Builds the libFuzzer target for the hostfile/selection and doctor parsers with clang
# (ASan + UBSan) and runs it for SECONDS (default 20; ctest: 5, and 120 under the soak label).
set -euo pipefail
src=$(cd "$(dirname "$0")/.." && pwd)
seconds=${1:-20}
out=${FUZZ_DIR:-}
if [ -z "$out" ]; then
  out=$(mktemp -d)
  trap 'rm -rf "$out"' EXIT
fi
. "$src/tests/support/skip.sh"
require_program clang++ clang
require_installed "$([ -f "$(clang++ -print-file-name=libclang_rt.fuzzer-x86_64.a)" ] && echo 1 || echo 0)" \
  "libFuzzer (libclang_rt.fuzzer for clang++)" libclang-rt-14-dev
clang++ -std=c++20 -O1 -gline-tables-only -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined -DFMT_HEADER_ONLY \
  -I"$src" "$src/launcher/hostfile.cc" "$src/launcher/hwprobe.cc" "$src/tests/fuzz_hostfile.cc" -o "$out/fuzz_hostfile"
mkdir -p "$out/corpus"
printf '# rack\nnode-a slots=4\nnode-b slots=8 # big\nnode-c\nnode-a:0,2@node-c\n' > "$out/corpus/hostfile"
printf '0-3,8-11\n' > "$out/corpus/cpus"
printf 'MemTotal:       16318260 kB\n0::/user.slice\n' > "$out/corpus/meminfo"
"$out/fuzz_hostfile" -max_total_time="$seconds" -max_len=4096 -rss_limit_mb=2048 -print_final_stats=1 "$out/corpus"
