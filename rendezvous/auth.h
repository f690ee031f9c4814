// Authentication of the rendezvous, shared by the daemon, the agent's client and its
// built-in server (and any later backend). Pure functions over OpenSSL's HMAC-SHA256.
//
// Secrets: the daemon holds the daemon token T. The key of job J is
// K_J = HMAC(T, "mglaunch-job:" + J); an agent holds T (and derives K_J) or only K_J
// (`mglaunch-rdzv --job-token J` prints it), so a job's agents can be given a secret that
// opens their own job and no other.
//
// Handshake, both sides proving K_J over fresh nonces (cn from the client's Hello, sn
// from the server's Challenge):
//   server proof  = HMAC(K_J, "mglaunch-server|" + cn + "|" + sn)
//   client proof  = HMAC(K_J, "mglaunch-client|" + cn + "|" + sn)
//   session key S = HMAC(K_J, "mglaunch-session|" + cn + "|" + sn)
// Every later frame carries a trailer HMAC(S, direction | sequence number | frame bytes),
// so frames cannot be forged, altered, replayed, reordered or moved between sessions.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace mg::rdzv::auth {

inline constexpr std::size_t kFrameMacBytes = 32;

std::string hmac_sha256_hex(const std::string& key, const std::string& data);
bool equal_ct(const std::string& a, const std::string& b);  // constant-time
std::string random_hex(std::size_t bytes);

std::string job_key(const std::string& daemon_token, const std::string& job_id);
std::string server_proof(const std::string& key, const std::string& client_nonce, const std::string& server_nonce);
std::string client_proof(const std::string& key, const std::string& client_nonce, const std::string& server_nonce);
std::string session_key(const std::string& key, const std::string& client_nonce, const std::string& server_nonce);
// proto::NotHosting's proof: the job's key over the client's nonce and the run told.
// `recalling_epoch` >= 0: the answerer recalls `run` at that epoch (proto::NotHosting).
std::string not_hosting_proof(const std::string& key, const std::string& client_nonce, const std::string& run,
                              int recalling_epoch = -1);

// One direction of a session's frame MACs: sign() appends the trailer to an encoded frame
// (whose length field already counts it), verify() checks the trailer of a whole frame.
// The sequence number advances with each frame.
class FrameMac {
 public:
  FrameMac(std::string session_key, char direction) : key_(std::move(session_key)), direction_(direction) {}
  void sign(std::vector<std::uint8_t>& frame) { sign(frame, 0); }
  // Signs the frame that starts at buf[from] and ends the buffer (frames queued before it
  // stay as they are), appending its trailer.
  void sign(std::vector<std::uint8_t>& buf, std::size_t from);
  bool verify(std::span<const std::uint8_t> frame);

 private:
  void mac(std::span<const std::uint8_t> bytes, unsigned char out[kFrameMacBytes]) const;
  std::string key_;
  char direction_;
  std::uint64_t seq_ = 0;
};

}  // namespace mg::rdzv::auth
