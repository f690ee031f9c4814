# Sourced by the libFuzzer scripts (tests/fuzz_*.sh, tests/etcd_fuzz.sh): sets `src`,
# `seconds` ($1, default 20) and `out` ($FUZZ_DIR, else a temporary directory removed at
# exit), and defines
#   fuzz_build NAME   $out/NAME, the fuzzer NAME (fuzz_decode, fuzz_hostfile or etcd_fuzz) and
#                     $out/corpus: tests/fuzz_all.cc, every target in one binary that runs the
#                     one its name says (a link named NAME to it).
# ctest's 5-s smokes pass FUZZ_BIN, that binary built with the build (tests/CMakeLists.txt:
# mg_fuzz, at -O0), and nothing is compiled here (#36: their compiles were most of their
# CPU); a longer run, or a run without FUZZ_BIN, compiles it here with clang++ (ASan + UBSan),
# after the skip policy's checks of clang++ and libFuzzer.
src=$(cd "$(dirname "$0")/.." && pwd)
seconds=${1:-20}
out=${FUZZ_DIR:-}
if [ -z "$out" ]; then
  out=$(mktemp -d)
  trap 'rm -rf "$out"' EXIT
fi
. "$src/tests/support/skip.sh"
fuzz_build() {
  # One translation unit, tests/fuzz_all.cc: the targets with the product sources they fuzz,
  # so fmt's and the project's headers are parsed once (cold, the three fuzzers' 17 compiles
  # were most of their ctest time, #36). fmt from its shared library (header-only fmt doubled
  # every compile). A smoke run (10 s or less: ctest's 5 s) is built without optimisation,
  # which compiles about 3x faster and still runs thousands of inputs; a longer run gets -O1.
  local name=$1
  mkdir -p "$out/obj" "$out/corpus"
  if [ -n "${FUZZ_BIN:-}" ] && [ "$seconds" -le 10 ] 2>/dev/null; then
    [ -x "$FUZZ_BIN" ] || { echo "error: FUZZ_BIN=$FUZZ_BIN is not an executable: build the mg_fuzz target"; exit 1; }
    ln -s "$FUZZ_BIN" "$out/$name"
    return
  fi
  require_program clang++ clang
  require_installed "$([ -f "$(clang++ -print-file-name=libclang_rt.fuzzer-x86_64.a)" ] && echo 1 || echo 0)" \
    "libFuzzer (libclang_rt.fuzzer for clang++)" libclang-rt-14-dev
  local opt=-O1 cxx=(clang++)
  [ "$seconds" -gt 10 ] 2>/dev/null || opt=-O0
  command -v ccache >/dev/null && cxx=(ccache clang++)
  local flags=(-std=c++20 "$opt" -gline-tables-only -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined)
  "${cxx[@]}" "${flags[@]}" -I"$src" -c "$src/tests/fuzz_all.cc" -o "$out/obj/mg_fuzz.o"
  clang++ "${flags[@]}" "$out/obj/mg_fuzz.o" -lfmt -o "$out/mg_fuzz"
  ln -s mg_fuzz "$out/$name"
}
