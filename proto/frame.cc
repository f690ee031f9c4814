#include "proto/frame.h"

#include <stdexcept>

#include <fmt/format.h>

namespace mg::proto {

std::vector<std::uint8_t> encode(const Frame& frame, std::size_t max_frame) {
  std::vector<std::uint8_t> body = nlohmann::json::to_cbor(frame.payload);
  const std::size_t length = body.size() + 2;
  if (length > max_frame)
    throw std::length_error(fmt::format("frame of {} bytes exceeds the limit of {} bytes", length, max_frame));
  std::vector<std::uint8_t> out;
  out.reserve(kHeaderSize + body.size());
  for (int shift = 24; shift >= 0; shift -= 8) out.push_back(static_cast<std::uint8_t>(length >> shift));
  out.push_back(kProtocolVersion);
  out.push_back(frame.type);
  out.insert(out.end(), body.begin(), body.end());
  return out;
}

DecodeResult decode(std::span<const std::uint8_t> bytes, std::size_t max_frame) {
  DecodeResult r;
  if (bytes.size() < 4) return r;
  const std::uint32_t length = (std::uint32_t{bytes[0]} << 24) | (std::uint32_t{bytes[1]} << 16) |
                               (std::uint32_t{bytes[2]} << 8) | std::uint32_t{bytes[3]};
  auto fail = [&r](std::string msg) {
    r.status = DecodeResult::Status::kError;
    r.error = std::move(msg);
    return r;
  };
  if (length < 2) return fail(fmt::format("frame length {} is below the 2-byte minimum", length));
  if (length > max_frame) return fail(fmt::format("frame of {} bytes exceeds the limit of {} bytes", length, max_frame));
  if (bytes.size() >= 5 && bytes[4] != kProtocolVersion)
    return fail(fmt::format("protocol version mismatch: peer speaks {}, this build speaks {}; run the same "
                            "mglaunch version on every node",
                            bytes[4], kProtocolVersion));
  if (bytes.size() < 4 + std::size_t{length}) return r;
  auto body = bytes.subspan(kHeaderSize, length - 2);
  nlohmann::json payload;
  try {
    // allow_exceptions=false still throws for some inputs (e.g. an absurd array size).
    payload = nlohmann::json::from_cbor(body.begin(), body.end(), true, false);
  } catch (const nlohmann::json::exception& e) {
    return fail(fmt::format("frame payload is not valid CBOR: {}", e.what()));
  }
  if (payload.is_discarded()) return fail("frame payload is not valid CBOR");
  r.status = DecodeResult::Status::kOk;
  r.frame.type = bytes[5];
  r.frame.payload = std::move(payload);
  r.consumed = 4 + std::size_t{length};
  return r;
}

}  // namespace mg::proto
