// The store itself, without I/O: keys and values, and the clients waiting for keys, as
// c10d's classic TCPStore server keeps them. The server feeds it parsed queries and sends
// the replies it returns; a query that must not be served (a GET of a missing key, an ADD
// to a value that is not a number, a store over its byte budget) returns an error, and the
// server closes that client's connection, as torch's server does. Pure and single-threaded.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "store/wire.h"

namespace mg::store {

using ClientId = std::uint64_t;

struct Reply {
  ClientId to = 0;
  std::string bytes;
};

class Engine {
 public:
  // `max_bytes`: keys and values together, at most. `max_reply`: one reply's bytes, at most
  // (a GET or MULTI_GET over it is refused before its reply is built: one MULTI_GET naming
  // a large value many times would otherwise build a reply of terabytes).
  explicit Engine(std::size_t max_bytes = std::size_t{1} << 30, std::size_t max_reply = std::size_t{64} << 20)
      : max_bytes_(max_bytes), max_reply_(max_reply) {}

  // Applies `q` sent by `from`; appends the replies (to `from`, and to the clients a SET
  // wakes). Returns "" or why `from` must be disconnected.
  // `q`'s values are moved into the store.
  std::string apply(ClientId from, Query q, std::vector<Reply>& out);
  // `c` is gone: its wait is forgotten.
  void disconnected(ClientId c);
  // Forgets every key and wait (a new attempt of the job starts from an empty store, as
  // torch's agent gives each attempt a fresh one).
  void clear();

  std::size_t keys() const { return data_.size(); }
  // `key`'s value, or null when it is not set.
  const std::string* value(const std::string& key) const {
    auto it = data_.find(key);
    return it == data_.end() ? nullptr : &it->second;
  }
  std::size_t bytes() const { return bytes_; }
  std::size_t waiting_clients() const { return awaited_.size(); }
  // The bytes `c`'s wait holds (its keys, kept twice: in its wait and as waited-for keys);
  // 0 when it waits for nothing. The server counts them in its buffer budget.
  std::size_t wait_bytes(ClientId c) const {
    auto a = awaited_.find(c);
    return a == awaited_.end() ? 0 : a->second.bytes;
  }

 private:
  std::string set(const std::string& key, std::string value, std::vector<Reply>& out);
  void wake(const std::string& key, std::vector<Reply>& out);
  bool has_all(const std::vector<std::string>& keys) const;

  std::size_t max_bytes_;
  std::size_t max_reply_;
  std::size_t bytes_ = 0;
  std::unordered_map<std::string, std::string> data_;
  std::unordered_map<std::string, std::vector<ClientId>> waiters_;  // key -> clients waiting for it
  struct Wait {
    std::size_t missing = 0;        // keys still to come
    std::vector<std::string> keys;  // the keys it waits for (to forget it in O(its keys))
    std::size_t bytes = 0;          // 2 x the keys' bytes (wait_bytes)
  };
  std::unordered_map<ClientId, Wait> awaited_;  // client -> its one wait
};

}  // namespace mg::store
