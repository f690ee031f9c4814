#!/usr/bin/env bash
# Builds the libFuzzer target for the hostfile/selection and doctor parsers with clang
# (ASan + UBSan) and runs it for SECONDS (default 20; ctest: 5, and 120 under the soak label).
set -euo pipefail
. "$(dirname "$0")/support/fuzz.sh"
fuzz_build fuzz_hostfile
printf '# rack\nnode-a slots=4\nnode-b slots=8 # big\nnode-c\nnode-a:0,2@node-c\n' > "$out/corpus/hostfile"
printf '0-3,8-11\n' > "$out/corpus/cpus"
printf 'MemTotal:       16318260 kB\n0::/user.slice\n' > "$out/corpus/meminfo"
"$out/fuzz_hostfile" -max_total_time="$seconds" -max_len=4096 -rss_limit_mb=2048 -print_final_stats=1 "$out/corpus"
