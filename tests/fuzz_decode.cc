// libFuzzer target for the wire decoder: any bytes must give kNeedMore, kOk or kError,
// never a crash, an exception, deep recursion or an allocation beyond the frame bound; a
// decoded frame must re-encode to a frame that decodes again; check_cbor must agree with
// the decoder; and every message parser must either accept its payload or throw
// ProtocolError (validation included); an assignment that parses must come back unchanged
// through the direct encoder (proto/wire.h). Inputs run up to the 1 MiB frame limit.
#include <cstddef>
#include <cstdint>
#include <span>

#include "proto/frame.h"
#include "proto/messages.h"
#include "proto/wire.h"

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
// An assignment that parses must survive the direct encoder (proto/wire.h) unchanged.
void assignment_round_trip(const mg::proto::Frame& f) {
  using namespace mg::proto;
  try {
    Frame copy = f;
    copy.type = static_cast<std::uint8_t>(MsgType::kAssignment);
    const auto a = from_frame<Assignment>(copy);
    const auto back = from_frame<Assignment>(to_wire(a));
    if (nlohmann::json(back) != nlohmann::json(a)) __builtin_trap();
  } catch (const mg::proto::ProtocolError&) {
  }
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace mg::proto;
  const auto bytes = std::span(data, size);
  (void)check_cbor(bytes);  // the raw input as a payload: any depth, any declared length
  for (std::size_t trailer : {std::size_t{0}, std::size_t{32}}) {
    auto r = decode(bytes, kDefaultMaxFrame, trailer);
    if (r.status != DecodeResult::Status::kOk) continue;
    if (r.consumed > size) __builtin_trap();
    if (check_cbor(bytes.subspan(kHeaderSize, r.consumed - kHeaderSize - trailer))) __builtin_trap();
    auto again = decode(encode(r.frame, 1 << 22), 1 << 22);
    if (again.status != DecodeResult::Status::kOk || again.frame.type != r.frame.type) __builtin_trap();
    try_parse<Hello>(r.frame);
    try_parse<Challenge>(r.frame);
    try_parse<Auth>(r.frame);
    try_parse<Join>(r.frame);
    try_parse<Assignment>(r.frame);
    assignment_round_trip(r.frame);
    try_parse<Heartbeat>(r.frame);
    try_parse<WorkerFailed>(r.frame);
    try_parse<Restart>(r.frame);
    try_parse<Abort>(r.frame);
    try_parse<Error>(r.frame);
  }
  return 0;
}
