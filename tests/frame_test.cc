#include <catch2/catch.hpp>

#include "proto/frame.h"

using namespace mg::proto;

TEST_CASE("frames round-trip and report how many bytes they used") {
  Frame f{7, {{"job", "j1"}, {"nproc", 8}}};
  auto bytes = encode(f);
  bytes.push_back(0xAA);  // the start of the next frame
  auto r = decode(bytes);
  REQUIRE(r.status == DecodeResult::Status::kOk);
  CHECK(r.frame.type == 7);
  CHECK(r.frame.payload == f.payload);
  CHECK(r.consumed == bytes.size() - 1);
}

TEST_CASE("a frame prefix needs more bytes") {
  auto bytes = encode({1, {{"a", 1}}});
  for (std::size_t n = 0; n < bytes.size(); ++n)
    CHECK(decode(std::span(bytes.data(), n)).status == DecodeResult::Status::kNeedMore);
}

TEST_CASE("oversized, short and foreign-version frames are errors before allocation") {
  std::vector<std::uint8_t> huge = {0x7f, 0xff, 0xff, 0xff};
  auto r = decode(huge);
  CHECK(r.status == DecodeResult::Status::kError);
  CHECK_THAT(r.error, Catch::Contains("exceeds"));
  CHECK(decode(std::vector<std::uint8_t>{0, 0, 0, 1}).status == DecodeResult::Status::kError);
  auto bytes = encode({1, {}});
  bytes[4] = 9;
  r = decode(bytes);
  CHECK(r.status == DecodeResult::Status::kError);
  CHECK_THAT(r.error, Catch::Contains("peer speaks 9") && Catch::Contains("speaks 2"));
  CHECK_THROWS_AS(encode({1, std::string(100, 'x')}, 50), std::length_error);
}

TEST_CASE("garbage payloads are errors, not exceptions") {
  std::vector<std::uint8_t> bytes = {0, 0, 0, 4, kProtocolVersion, 1, 0xff, 0xff};
  CHECK(decode(bytes).status == DecodeResult::Status::kError);
}

TEST_CASE("a CBOR array claiming an absurd size is an error, not an exception (found by the fuzzer)") {
  std::vector<std::uint8_t> bytes = {0x00, 0x00, 0x00, 0x11, kProtocolVersion, 0x99, 0x9b, 0x99, 0x2d, 0x99, 0x99,
                                     0x99, 0xbb, 0xbb, 0xbb, 0xbb, 0xbb, 0xbb, 0xbb, 0xbb, 0x99};
  auto r = decode(bytes);
  CHECK(r.status == DecodeResult::Status::kError);
  CHECK_THAT(r.error, Catch::Contains("not valid CBOR"));
}

namespace {
// A frame around raw CBOR bytes.
std::vector<std::uint8_t> frame_of(const std::vector<std::uint8_t>& cbor, std::uint8_t type = 1) {
  const std::size_t len = cbor.size() + 2;
  std::vector<std::uint8_t> out{static_cast<std::uint8_t>(len >> 24), static_cast<std::uint8_t>(len >> 16),
                                static_cast<std::uint8_t>(len >> 8), static_cast<std::uint8_t>(len), kProtocolVersion,
                                type};
  out.insert(out.end(), cbor.begin(), cbor.end());
  return out;
}
}  // namespace

TEST_CASE("CBOR nested 300,000 deep is an error, not a stack overflow") {
  std::vector<std::uint8_t> deep(300000, 0x81);  // [[[[...
  deep.push_back(0x00);
  auto r = decode(frame_of(deep), 1 << 20);
  CHECK(r.status == DecodeResult::Status::kError);
  CHECK_THAT(r.error, Catch::Contains("nested deeper than 16"));
  std::vector<std::uint8_t> maps;  // {0: {0: {0: ...
  for (int i = 0; i < 100000; ++i) maps.insert(maps.end(), {0xa1, 0x00});
  maps.push_back(0x00);
  CHECK(decode(frame_of(maps), 1 << 20).status == DecodeResult::Status::kError);
  std::vector<std::uint8_t> ok(16, 0x81);  // exactly at the bound
  ok.push_back(0x00);
  CHECK(decode(frame_of(ok)).status == DecodeResult::Status::kOk);
}

TEST_CASE("CBOR lengths beyond the frame, indefinite items, tags and trailing bytes are refused") {
  CHECK(check_cbor(std::vector<std::uint8_t>{0x9b, 0, 0, 0, 0, 0xff, 0xff, 0xff, 0xff}).has_value());  // 4G items
  CHECK(check_cbor(std::vector<std::uint8_t>{0x7a, 0x00, 0x10, 0x00, 0x00, 'a'}).has_value());         // 1 MB string
  CHECK(check_cbor(std::vector<std::uint8_t>{0x9f, 0x00, 0xff}).has_value());                           // indefinite
  CHECK(check_cbor(std::vector<std::uint8_t>{0xc1, 0x00}).has_value());                                 // a tag
  CHECK(check_cbor(std::vector<std::uint8_t>{0x00, 0x00}).has_value());                                 // two items
  CHECK(check_cbor(std::vector<std::uint8_t>{0xa1, 0x61, 'a'}).has_value());                            // truncated
  CHECK_FALSE(check_cbor(nlohmann::json::to_cbor({{"a", {1, 2.5, "x", nullptr, true}}})).has_value());
}

TEST_CASE("a frame's trailer is not parsed as CBOR") {
  auto bytes = encode({3, {{"a", 1}}}, kDefaultMaxFrame, 4);
  bytes.insert(bytes.end(), {0xde, 0xad, 0xbe, 0xef});
  auto r = decode(bytes, kDefaultMaxFrame, 4);
  REQUIRE(r.status == DecodeResult::Status::kOk);
  CHECK(r.frame.payload["a"] == 1);
  CHECK(r.consumed == bytes.size());
  CHECK(decode(bytes).status == DecodeResult::Status::kError);  // read without the trailer: junk after the CBOR
}
