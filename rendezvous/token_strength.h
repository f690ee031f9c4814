// How strong a rendezvous token can be, for the warning mglaunch and mglaunch-rdzv give
// once on a short one. In the handshake (rendezvous/auth.h) the server proves the job key
// first: anyone who can connect gets HMAC(K_J, nonces) and can test guesses of the token
// offline, at any speed, where the daemon's rate of proof checks does not reach. Only a
// token of at least 128 random bits stands that. Pure.
#pragma once

#include <cmath>
#include <string>
#include <string_view>

#include <fmt/format.h>

namespace mg::rdzv {

inline constexpr double kMinTokenBits = 128;

// The most random bits `token` can hold given its length and the kinds of characters in
// it: 4 per character for hex digits only, else log2 of the size of the classes it uses
// (digits 10, lower case 26, upper case 26, anything else 33). An upper bound: a word or
// a pattern holds far fewer, which no check can see.
inline double token_bits_at_most(std::string_view token) {
  bool digit = false, lower = false, upper = false, other = false, hex = true;
  for (const unsigned char c : token) {
    const bool d = c >= '0' && c <= '9', l = c >= 'a' && c <= 'z', u = c >= 'A' && c <= 'Z';
    digit |= d;
    lower |= l;
    upper |= u;
    other |= !(d || l || u);
    hex &= d || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F');
  }
  const int alphabet = hex ? 16 : (digit ? 10 : 0) + (lower ? 26 : 0) + (upper ? 26 : 0) + (other ? 33 : 0);
  return alphabet < 2 ? 0 : static_cast<double>(token.size()) * std::log2(alphabet);
}

// "" for a token that can hold 128 random bits, else the warning (one line) naming where
// the token came from (`source`: "--token-file FILE", "MGLAUNCH_RDZV_TOKEN") and the fix.
inline std::string weak_token_warning(std::string_view token, std::string_view source) {
  const double bits = token_bits_at_most(token);
  if (bits >= kMinTokenBits) return {};
  return fmt::format("the rendezvous token from {} holds at most {:.0f} random bits ({} characters): anyone who can "
                     "connect gets a proof made with it and can test guesses offline; use at least 128 random bits, "
                     "e.g. the output of `openssl rand -hex 32`",
                     source, std::floor(bits), token.size());
}

}  // namespace mg::rdzv
