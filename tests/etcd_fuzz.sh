#!/usr/bin/env bash
# Builds the libFuzzer target for the etcd backend's input side (gateway stream splitter,
# base64, endpoint lists, events replayed into the Job) with clang (ASan + UBSan) and runs
# it for SECONDS (default 20; ctest: 5, and 120 under the soak label). Seeds: a watch
# response and a small job log.
set -euo pipefail
. "$(dirname "$0")/support/fuzz.sh"
fuzz_build etcd_fuzz
printf '%s\n' '{"result":{"header":{"revision":"5"},"events":[{"kv":{"key":"YQ==","mod_revision":"5","value":"Yg=="}}]}}' \
  > "$out/corpus/watch"
j='"job_id":"job","agent_id":"A","host":"h","addr":"127.0.0.1","nproc":2,"min_nodes":2,"max_nodes":2,"max_restarts":1'
printf '%s\n' "{\"kind\":\"join\",\"agent\":\"a\",\"t\":1700000000000,\"join\":{$j}}" \
  "{\"kind\":\"join\",\"agent\":\"b\",\"t\":1700000000001,\"join\":{${j/127.0.0.1/127.0.0.2}}}" \
  '{"kind":"failed","agent":"b","t":1700000000100,"failed":{"round":1,"host":"h","rank":3,"exit_code":7}}' \
  '{"kind":"lost","agent":"a","t":1700000000200,"why":"lease"}' '{"kind":"tick","agent":"b","t":1700000999999}' \
  '{"kind":"done","agent":"b","t":1700001000000,"round":1}' > "$out/corpus/log"
"$out/etcd_fuzz" -max_total_time="$seconds" -max_len=8192 -rss_limit_mb=2048 -print_final_stats=1 "$out/corpus"
