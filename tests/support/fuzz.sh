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
  # One object per source, through ccache when it is installed (the three fuzzers share
  # proto/; a warm cache rebuilds nothing), fmt from its shared library (header-only fmt
  # doubled every compile). A smoke run (10 s or less: ctest's 5 s) is built without
  # optimisation, which compiles about 3x faster and still runs thousands of inputs; a
  # longer run gets -O1.
  local name=$1; shift
  local opt=-O1 cxx=(clang++) objs=() s o
  [ "$seconds" -gt 10 ] 2>/dev/null || opt=-O0
  command -v ccache >/dev/null && cxx=(ccache clang++)
  local flags=(-std=c++20 "$opt" -gline-tables-only -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined)
  mkdir -p "$out/obj/$name" "$out/corpus"
  for s in "$@"; do
    o="$out/obj/$name/$(echo "${s#"$src"/}" | tr / _).o"
    "${cxx[@]}" "${flags[@]}" -I"$src" -c "$s" -o "$o"
    objs+=("$o")
  done
  clang++ "${flags[@]}" "${objs[@]}" -lfmt -o "$out/$name"
}
