// The three libFuzzer targets (fuzz_decode.cc, fuzz_hostfile.cc, etcd_fuzz.cc) and the product
// sources they fuzz as one translation unit and one binary, so that the sources two targets
// share (proto/, rendezvous/lookup.cc) and the headers are compiled once (#36: 24 CPU-s as one
// unit, about 33 as three). The binary runs the target its name says (argv[0]: fuzz_decode,
// fuzz_hostfile or etcd_fuzz, a link named so; tests/support/fuzz.sh makes it) or
// MG_FUZZ_TARGET says. Built by tests/CMakeLists.txt (mg_fuzz, clang with libFuzzer) for the
// 5-s smokes, and by tests/support/fuzz.sh for longer runs.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "proto/frame.cc"
#include "proto/messages.cc"
#include "proto/text.cc"
#include "proto/wire.cc"
#include "rendezvous/endpoint.cc"
#include "rendezvous/etcd_log.cc"
#include "rendezvous/job.cc"
#include "rendezvous/job_events.cc"
#include "rendezvous/job_epochs.cc"
#include "rendezvous/job_quorum.cc"
#include "rendezvous/lookup.cc"
#include "baremetal/hostfile.cc"
#include "ops/hwprobe.cc"

#define LLVMFuzzerTestOneInput mg_fuzz_decode
#include "tests/fuzz_decode.cc"
#undef LLVMFuzzerTestOneInput
#define LLVMFuzzerTestOneInput mg_fuzz_hostfile
#include "tests/fuzz_hostfile.cc"
#undef LLVMFuzzerTestOneInput
#define LLVMFuzzerTestOneInput mg_fuzz_etcd
#include "tests/etcd_fuzz.cc"
#undef LLVMFuzzerTestOneInput

namespace {
using Target = int (*)(const std::uint8_t*, std::size_t);
Target target = nullptr;

Target target_named(const char* name) {
  if (std::strcmp(name, "fuzz_decode") == 0) return mg_fuzz_decode;
  if (std::strcmp(name, "fuzz_hostfile") == 0) return mg_fuzz_hostfile;
  if (std::strcmp(name, "etcd_fuzz") == 0) return mg_fuzz_etcd;
  return nullptr;
}
}  // namespace

extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) {
  const char* env = std::getenv("MG_FUZZ_TARGET");
  const char* self = (*argc > 0) ? (*argv)[0] : "";
  const char* base = std::strrchr(self, '/');
  target = target_named(env && *env ? env : base ? base + 1 : self);
  if (!target) {
    std::fprintf(stderr,
                 "mg_fuzz: error: no fuzz target named '%s': run it as fuzz_decode, fuzz_hostfile or etcd_fuzz (a "
                 "link of that name), or set MG_FUZZ_TARGET to one of them\n",
                 env && *env ? env : self);
    std::exit(2);
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) { return target(data, size); }
