#include "proto/text.h"

#include <fmt/format.h>

namespace mg::proto {

namespace {

// The length of the valid UTF-8 sequence at s[i] (its code point in `cp`), 0 if invalid.
std::size_t decode_one(std::string_view s, std::size_t i, char32_t& cp) {
  const auto b0 = static_cast<unsigned char>(s[i]);
  if (b0 < 0x80) {
    cp = b0;
    return 1;
  }
  std::size_t n = 0;
  char32_t min = 0;
  if (b0 < 0xC2) return 0;  // a continuation byte, or an overlong 2-byte form
  if (b0 < 0xE0) n = 2, cp = b0 & 0x1Fu, min = 0x80;
  else if (b0 < 0xF0) n = 3, cp = b0 & 0x0Fu, min = 0x800;
  else if (b0 < 0xF5) n = 4, cp = b0 & 0x07u, min = 0x10000;
  else return 0;
  if (s.size() - i < n) return 0;
  for (std::size_t k = 1; k < n; ++k) {
    const auto b = static_cast<unsigned char>(s[i + k]);
    if ((b & 0xC0) != 0x80) return 0;
    cp = (cp << 6) | (b & 0x3Fu);
  }
  if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return 0;
  return n;
}

bool control(char32_t cp) { return cp < 0x20 || (cp >= 0x7F && cp <= 0x9F); }

}  // namespace

std::string text_problem(std::string_view v) {
  for (std::size_t i = 0; i < v.size();) {
    char32_t cp = 0;
    const std::size_t n = decode_one(v, i, cp);
    if (n == 0) return fmt::format("is not valid UTF-8 (byte {})", i);
    if (control(cp)) return fmt::format("holds a control character (U+{:04X} at byte {})", static_cast<unsigned>(cp), i);
    i += n;
  }
  return {};
}

std::string printable(std::string_view v, Charset charset) {
  const std::string_view bad = charset == Charset::kAscii ? "?" : "\xEF\xBF\xBD";  // U+FFFD
  std::string out;
  out.reserve(v.size());
  for (std::size_t i = 0; i < v.size();) {
    char32_t cp = 0;
    const std::size_t n = decode_one(v, i, cp);
    if (n == 0) {
      out += bad;  // for the bad byte; resynchronise at the next one
      ++i;
      continue;
    }
    if (cp == '\t' || cp == '\n' || cp == '\r') out += ' ';
    else if (control(cp) || (charset == Charset::kAscii && cp > 0x7F)) out += bad;
    else out.append(v.substr(i, n));
    i += n;
  }
  return out;
}

std::string dump_json(const nlohmann::json& j, int indent) {
  return j.dump(indent, ' ', false, nlohmann::json::error_handler_t::replace);
}

}  // namespace mg::proto
