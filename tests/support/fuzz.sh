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
  # One translation unit (a unity build): the target's own file (the last SOURCE) with every
  # other SOURCE -include'd before it, so fmt's and the project's headers are parsed once,
  # not once per source (cold, the three fuzzers' 17 compiles were most of their ctest time,
  # #36). Its input path stays the repository's, so ccache, when installed, still hits.
  # fmt from its shared library (header-only fmt doubled every compile). A smoke run (10 s
  # or less: ctest's 5 s) is built without optimisation, which compiles about 3x faster and
  # still runs thousands of inputs; a longer run gets -O1.
  local name=$1; shift
  local opt=-O1 cxx=(clang++) includes=() s
  [ "$seconds" -gt 10 ] 2>/dev/null || opt=-O0
  command -v ccache >/dev/null && cxx=(ccache clang++)
  local flags=(-std=c++20 "$opt" -gline-tables-only -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined)
  mkdir -p "$out/obj" "$out/corpus"
  for s in "${@:1:$#-1}"; do includes+=(-include "$s"); done
  "${cxx[@]}" "${flags[@]}" -I"$src" "${includes[@]}" -c "${!#}" -o "$out/obj/$name.o"
  clang++ "${flags[@]}" "$out/obj/$name.o" -lfmt -o "$out/$name"
}
