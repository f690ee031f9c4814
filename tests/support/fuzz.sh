# Sourced by the libFuzzer scripts (tests/fuzz_*.sh, tests/etcd_fuzz.sh): sets `src`,
# `seconds` ($1, default 20) and `out` ($FUZZ_DIR, else a temporary directory removed at
# exit), applies the skip policy to clang++ and libFuzzer, and defines
#   fuzz_build NAME SOURCE...   clang++ with ASan + UBSan into $out/NAME; $out/corpus made.
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
fuzz_build() {
  local name=$1; shift
  clang++ -std=c++20 -O1 -gline-tables-only -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
    -DFMT_HEADER_ONLY -I"$src" "$@" -o "$out/$name"
  mkdir -p "$out/corpus"
}
