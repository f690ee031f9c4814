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
  CHECK_THAT(r.error, Catch::Contains("peer speaks 9") && Catch::Contains("speaks 1"));
  CHECK_THROWS_AS(encode({1, std::string(100, 'x')}, 50), std::length_error);
}

TEST_CASE("garbage payloads are errors, not exceptions") {
  std::vector<std::uint8_t> bytes = {0, 0, 0, 4, kProtocolVersion, 1, 0xff, 0xff};
  CHECK(decode(bytes).status == DecodeResult::Status::kError);
}

TEST_CASE("a CBOR array claiming an absurd size is an error, not an exception (found by the fuzzer)") {
  std::vector<std::uint8_t> bytes = {0x00, 0x00, 0x00, 0x11, 0x01, 0x99, 0x9b, 0x99, 0x2d, 0x99, 0x99,
                                     0x99, 0xbb, 0xbb, 0xbb, 0xbb, 0xbb, 0xbb, 0xbb, 0xbb, 0x99};
  auto r = decode(bytes);
  CHECK(r.status == DecodeResult::Status::kError);
  CHECK_THAT(r.error, Catch::Contains("not valid CBOR"));
}
