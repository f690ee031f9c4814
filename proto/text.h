// Text from a peer, checked and made safe to print. A message may carry only valid UTF-8
// with no control character (validate() in messages.h refuses anything else), a sender
// cleans its free text with printable() first, and every writer of logs and JSON uses
// dump_json(), so no peer's bytes can make a writer throw or steer a terminal.
#pragma once

#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

namespace mg::proto {

// "" when `v` is valid UTF-8 (no overlong form, surrogate or code point past U+10FFFF)
// without a control character (U+0000..U+001F, U+007F..U+009F); otherwise what is wrong
// and at which byte, e.g. "is not valid UTF-8 (byte 3)".
std::string text_problem(std::string_view v);

// `v` with tabs and line breaks turned into spaces, and every other control character and
// every byte that is not part of valid UTF-8 turned into U+FFFD: text_problem() of the
// result is "". kAscii: into '?' instead, and every code point past ASCII too (a line about
// a local file's raw bytes, for any terminal or log).
enum class Charset { kUtf8, kAscii };
std::string printable(std::string_view v, Charset out = Charset::kUtf8);

// j.dump(indent) that never throws: a string that is not valid UTF-8 is written with
// U+FFFD in place of its bad bytes (nlohmann's dump() throws type_error.316 otherwise).
std::string dump_json(const nlohmann::json& j, int indent = -1);

}  // namespace mg::proto
