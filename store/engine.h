// The store itself, without I/O: keys and values, and the clients waiting for keys, as
// c10d's classic TCPStore server keeps them. The server feeds it parsed queries and sends
// the replies it returns; a query that must not be served (a GET of a missing key, an ADD
// to a value that is not a number, a store over its byte budget) returns an error, and the
// server closes that client's connection, as torch's server does. Pure and single-threaded.
#pragma once

#include <cstddef>
#include <cstdint>
#include <list>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "store/wire.h"

namespace mg::store {

using ClientId = std::uint64_t;

// A stored value as replies carry it: shared with the store and never changed once shared,
// so that N readers of one value cost one copy, not N.
using Value = std::shared_ptr<const std::string>;

struct Reply {
  ClientId to = 0;
  std::string bytes;  // its own bytes (an answer, a value's length): all of it but `values`
  // The values of a GET, MULTI_GET or COMPARE_SET's answer, not copied: value i goes after
  // the first values[i].first bytes of `bytes` (a write sends them as one scatter/gather list).
  std::vector<std::pair<std::size_t, Value>> values;
  std::size_t size() const;  // all its bytes as sent
  std::string flat() const;  // all its bytes as sent, in one string (tests, benches)
};
// Values up to this size go into a reply's own bytes, copied: sharing one costs a `values`
// entry and the write's iovecs (56 bytes), more than the copy (a MULTI_GET naming a small
// key 65536 times holds 65536 x 8 bytes, not 65536 entries).
inline constexpr std::size_t kCopiedValue = 64;

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
    return it == data_.end() ? nullptr : it->second.get();
  }
  std::size_t bytes() const { return bytes_; }
  // Values that left the store (replaced, deleted) while a reply shared them, since the last
  // call: from then on their bytes are the readers' alone (the server's buffer budget counts
  // them). Pointers only: compared, never read.
  std::vector<const std::string*> take_unstored() { return std::exchange(unstored_, {}); }
  std::size_t waiting_clients() const { return awaited_.size(); }
  // Keys some client waits for, and registrations (a client for a key) in all: both fall
  // back as waits end or are forgotten (a test's check that nothing is left behind).
  std::size_t awaited_keys() const { return waiters_.size(); }
  std::size_t registrations() const {
    std::size_t n = 0;
    for (const auto& kv : waiters_) n += kv.second.size();
    return n;
  }
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
  // Values are changed in place (APPEND) only while no reply shares them (use_count 1);
  // otherwise a change makes a new one and the replies keep the old.
  std::unordered_map<std::string, std::shared_ptr<std::string>> data_;
  // key -> clients waiting for it, in the order they asked. A list: a client's wait keeps
  // the position of each of its registrations, so forgetting it (disconnect, CANCEL_WAIT)
  // costs O(its keys), not a search through every other waiter of each key (O(N*K)).
  // Each entry: the client, and which of its wait's keys this is (Wait::keys' index).
  using Waiters = std::list<std::pair<ClientId, std::size_t>>;
  std::unordered_map<std::string, Waiters> waiters_;
  struct Registration {
    std::string key;
    Waiters::iterator place;  // in waiters_[key]
    bool done = false;        // the key came: its list is gone (wake)
  };
  struct Wait {
    std::size_t missing = 0;  // keys still to come
    std::vector<Registration> keys;
    std::size_t bytes = 0;  // 2 x the keys' bytes (wait_bytes)
  };
  std::unordered_map<ClientId, Wait> awaited_;  // client -> its one wait
  std::vector<const std::string*> unstored_;    // take_unstored()'s
  void unstore(const std::shared_ptr<std::string>& v) {
    if (v.use_count() > 1) unstored_.push_back(v.get());
  }
};

}  // namespace mg::store
