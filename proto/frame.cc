#include "proto/frame.h"

#include <stdexcept>

#include <fmt/format.h>

namespace mg::proto {

std::vector<std::uint8_t> encode(const Frame& frame, std::size_t max_frame, std::size_t trailer) {
  std::vector<std::uint8_t> body = nlohmann::json::to_cbor(frame.payload);
  const std::size_t length = body.size() + 2 + trailer;
  if (length > max_frame)
    throw std::length_error(fmt::format("frame of {} bytes exceeds the limit of {} bytes", length, max_frame));
  std::vector<std::uint8_t> out;
  out.reserve(4 + length);
  for (int shift = 24; shift >= 0; shift -= 8) out.push_back(static_cast<std::uint8_t>(length >> shift));
  out.push_back(kProtocolVersion);
  out.push_back(frame.type);
  out.insert(out.end(), body.begin(), body.end());
  return out;
}

namespace {

DecodeResult fail(std::string msg) {
  DecodeResult r;
  r.status = DecodeResult::Status::kError;
  r.error = std::move(msg);
  return r;
}

}  // namespace

DecodeResult peek(std::span<const std::uint8_t> bytes, std::size_t max_frame) {
  DecodeResult r;
  if (bytes.size() < 4) return r;
  const std::uint32_t length = (std::uint32_t{bytes[0]} << 24) | (std::uint32_t{bytes[1]} << 16) |
                               (std::uint32_t{bytes[2]} << 8) | std::uint32_t{bytes[3]};
  if (length < 2) return fail(fmt::format("frame length {} is below the 2-byte minimum", length));
  if (length > max_frame) return fail(fmt::format("frame of {} bytes exceeds the limit of {} bytes", length, max_frame));
  if (bytes.size() >= 5 && bytes[4] != kProtocolVersion)
    return fail(fmt::format("protocol version mismatch: peer speaks {}, this build speaks {}; run the same "
                            "mglaunch version on every node",
                            bytes[4], kProtocolVersion));
  r.consumed = 4 + std::size_t{length};
  if (bytes.size() >= r.consumed) r.status = DecodeResult::Status::kOk;
  return r;
}

DecodeResult decode(std::span<const std::uint8_t> bytes, std::size_t max_frame, std::size_t trailer) {
  DecodeResult r = peek(bytes, max_frame);
  if (r.status != DecodeResult::Status::kOk) return r;
  if (r.consumed < kHeaderSize + trailer) return fail("frame too short for its authentication trailer");
  auto body = bytes.subspan(kHeaderSize, r.consumed - kHeaderSize - trailer);
  if (auto bad = check_cbor(body)) return fail(fmt::format("frame payload is not valid CBOR: {}", *bad));
  nlohmann::json payload;
  try {
    // allow_exceptions=false still throws for some inputs (e.g. an absurd array size).
    payload = nlohmann::json::from_cbor(body.begin(), body.end(), true, false);
  } catch (const nlohmann::json::exception& e) {
    return fail(fmt::format("frame payload is not valid CBOR: {}", e.what()));
  }
  if (payload.is_discarded()) return fail("frame payload is not valid CBOR");
  r.frame.type = bytes[5];
  r.frame.payload = std::move(payload);
  return r;
}

std::optional<std::string> check_cbor(std::span<const std::uint8_t> cbor, std::size_t max_depth) {
  // pending.back(): items still to read in the innermost open container (the bottom
  // entry is the single top-level item).
  std::vector<std::uint64_t> pending{1};
  std::size_t pos = 0;
  const std::size_t n = cbor.size();
  while (!pending.empty()) {
    if (pending.back() == 0) {
      pending.pop_back();
      continue;
    }
    --pending.back();
    if (pos >= n) return "truncated item";
    const std::uint8_t initial = cbor[pos++];
    const int major = initial >> 5, info = initial & 31;
    std::uint64_t value = static_cast<std::uint64_t>(info);
    if (info >= 24 && info <= 27) {
      const std::size_t k = std::size_t{1} << (info - 24);
      if (n - pos < k) return "truncated item";
      value = 0;
      for (std::size_t i = 0; i < k; ++i) value = (value << 8) | cbor[pos++];
    } else if (info > 27) {
      return "indefinite-length or reserved items are not accepted";
    }
    switch (major) {
      case 2:
      case 3:
        if (value > n - pos) return fmt::format("a string claims {} bytes, {} remain", value, n - pos);
        pos += static_cast<std::size_t>(value);
        break;
      case 4:
      case 5: {
        const std::uint64_t items = major == 5 ? value * 2 : value;
        if (value > n - pos || items > n - pos) return fmt::format("a container claims {} items, {} bytes remain", value, n - pos);
        if (pending.size() > max_depth) return fmt::format("nested deeper than {} levels", max_depth);
        pending.push_back(items);
        break;
      }
      case 6:
        return "CBOR tags are not accepted";
      default:  // 0, 1: integers; 7: simple values and floats (their bytes were read above)
        break;
    }
  }
  if (pos != n) return fmt::format("{} bytes after the payload", n - pos);
  return std::nullopt;
}

}  // namespace mg::proto
