#include "rendezvous/auth.h"

#include <sys/random.h>

#include <openssl/evp.h>
#include <openssl/hmac.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <stdexcept>

namespace mg::rdzv::auth {

namespace {

// Constant-time: the time depends on the length only.
bool equal_bytes_ct(const unsigned char* a, const unsigned char* b, std::size_t n) {
  volatile unsigned char diff = 0;  // no early exit
  for (std::size_t i = 0; i < n; ++i) diff = static_cast<unsigned char>(diff | (a[i] ^ b[i]));
  return diff == 0;
}

std::string to_hex(const unsigned char* p, std::size_t n) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string hex(2 * n, '0');
  for (std::size_t i = 0; i < n; ++i) {
    hex[2 * i] = kDigits[p[i] >> 4];
    hex[2 * i + 1] = kDigits[p[i] & 15];
  }
  return hex;
}

}  // namespace

std::string hmac_sha256_hex(const std::string& key, const std::string& data) {
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()), reinterpret_cast<const unsigned char*>(data.data()),
       data.size(), md, &len);
  return to_hex(md, len);
}

bool equal_ct(const std::string& a, const std::string& b) {
  return a.size() == b.size() && equal_bytes_ct(reinterpret_cast<const unsigned char*>(a.data()),
                                                reinterpret_cast<const unsigned char*>(b.data()), a.size());
}

std::string random_hex(std::size_t bytes) {
  // The kernel's generator (what OpenSSL's seeds from): no OpenSSL needed for a nonce.
  std::vector<unsigned char> buf(bytes);
  for (std::size_t got = 0; got < buf.size();) {
    const ssize_t n = ::getrandom(buf.data() + got, buf.size() - got, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) throw std::runtime_error(std::string("getrandom failed: no randomness for a nonce: ") + std::strerror(errno));
    got += static_cast<std::size_t>(n);
  }
  return to_hex(buf.data(), buf.size());
}

std::string job_key(const std::string& daemon_token, const std::string& job_id) {
  return hmac_sha256_hex(daemon_token, "mglaunch-job:" + job_id);
}

std::string server_proof(const std::string& key, const std::string& cn, const std::string& sn) {
  return hmac_sha256_hex(key, "mglaunch-server|" + cn + "|" + sn);
}

std::string not_hosting_proof(const std::string& key, const std::string& cn, const std::string& run,
                              int recalling_epoch) {
  const std::string recalling = recalling_epoch < 0 ? std::string() : "|recalling|" + std::to_string(recalling_epoch);
  return hmac_sha256_hex(key, "mglaunch-not-hosting|" + cn + "|" + run + recalling);
}

std::string client_proof(const std::string& key, const std::string& cn, const std::string& sn) {
  return hmac_sha256_hex(key, "mglaunch-client|" + cn + "|" + sn);
}

std::string session_key(const std::string& key, const std::string& cn, const std::string& sn) {
  return hmac_sha256_hex(key, "mglaunch-session|" + cn + "|" + sn);
}

void FrameMac::mac(std::span<const std::uint8_t> bytes, unsigned char out[kFrameMacBytes]) const {
  std::vector<unsigned char> data(9 + bytes.size());
  data[0] = static_cast<unsigned char>(direction_);
  for (int i = 0; i < 8; ++i) data[1 + static_cast<std::size_t>(i)] = static_cast<unsigned char>(seq_ >> (56 - 8 * i));
  std::copy(bytes.begin(), bytes.end(), data.begin() + 9);
  unsigned int len = 0;
  if (!HMAC(EVP_sha256(), key_.data(), static_cast<int>(key_.size()), data.data(), data.size(), out, &len) ||
      len != kFrameMacBytes)
    throw std::runtime_error("OpenSSL HMAC failed");
}

void FrameMac::sign(std::vector<std::uint8_t>& buf, std::size_t from) {
  unsigned char out[kFrameMacBytes];
  mac(std::span<const std::uint8_t>(buf).subspan(from), out);
  ++seq_;
  buf.insert(buf.end(), out, out + kFrameMacBytes);
}

bool FrameMac::verify(std::span<const std::uint8_t> frame) {
  if (frame.size() < kFrameMacBytes) return false;
  unsigned char out[kFrameMacBytes];
  mac(frame.first(frame.size() - kFrameMacBytes), out);
  ++seq_;
  return equal_bytes_ct(out, frame.data() + frame.size() - kFrameMacBytes, kFrameMacBytes);
}

}  // namespace mg::rdzv::auth
