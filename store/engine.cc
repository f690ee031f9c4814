#include "store/engine.h"

#include <algorithm>
#include <charconv>
#include <string_view>
#include <unordered_set>

#include <fmt/format.h>

namespace mg::store {

std::size_t Reply::size() const {
  std::size_t n = bytes.size();
  for (const auto& [at, v] : values) n += v->size();
  return n;
}

std::string Reply::flat() const {
  std::string out;
  out.reserve(size());
  std::size_t from = 0;
  for (const auto& [at, v] : values) {
    out.append(bytes, from, at - from);
    out += *v;
    from = at;
  }
  out.append(bytes, from);
  return out;
}

namespace {
// A value's length, then the value itself: shared (not copied) into `r`, or copied when it
// is small (kCopiedValue).
void put_value(Reply& r, const Value& v) {
  if (v->size() <= kCopiedValue) return put_bytes(r.bytes, *v);
  put_i64(r.bytes, static_cast<std::int64_t>(v->size()));
  r.values.emplace_back(r.bytes.size(), v);
}
}  // namespace

bool Engine::has_all(const std::vector<std::string>& keys) const {
  return std::all_of(keys.begin(), keys.end(), [&](const std::string& k) { return data_.count(k) > 0; });
}

void Engine::wake(const std::string& key, std::vector<Reply>& out) {
  auto it = waiters_.find(key);
  if (it == waiters_.end()) return;
  for (const auto& [c, index] : it->second) {
    auto a = awaited_.find(c);
    if (a == awaited_.end()) continue;
    a->second.keys[index].done = true;
    if (--a->second.missing == 0) {
      awaited_.erase(a);
      Reply r{c, {}, {}};
      put_u8(r.bytes, kStopWaiting);
      out.push_back(std::move(r));
    }
  }
  waiters_.erase(it);
}

std::string Engine::set(const std::string& key, std::string value, std::vector<Reply>& out) {
  auto it = data_.find(key);
  const std::size_t old = it == data_.end() ? 0 : key.size() + it->second->size();
  const std::size_t now = key.size() + value.size();
  if (bytes_ - old + now > max_bytes_)
    return fmt::format("the store would hold more than {} bytes (set of a {}-byte value)", max_bytes_, value.size());
  bytes_ = bytes_ - old + now;
  if (it != data_.end()) unstore(it->second);
  data_[key] = std::make_shared<std::string>(std::move(value));
  wake(key, out);
  return {};
}

std::string Engine::apply(ClientId from, Query q, std::vector<Reply>& out) {
  auto reply = [&]() -> std::string& { return out.emplace_back(Reply{from, {}, {}}).bytes; };
  switch (q.op) {
    case Op::kValidate:
      return {};
    case Op::kSet:
      return set(q.keys[0], std::move(q.values[0]), out);
    case Op::kAppend: {
      auto it = data_.find(q.keys[0]);
      if (it == data_.end()) return set(q.keys[0], std::move(q.values[0]), out);
      // In place (checked first, then grown): a copy of the whole value at every call made
      // many small appends quadratic, and held the value twice.
      const std::string& more = q.values[0];
      if (bytes_ + more.size() > max_bytes_)
        return fmt::format("the store would hold more than {} bytes (append of a {}-byte value)", max_bytes_,
                           more.size());
      if (it->second.use_count() > 1) {  // a reply being written shares it: it keeps the old one
        auto grown = std::make_shared<std::string>();
        grown->reserve(it->second->size() + more.size());
        grown->append(*it->second);
        unstore(it->second);
        it->second = std::move(grown);
      }
      it->second->append(more);
      bytes_ += more.size();
      wake(q.keys[0], out);
      return {};
    }
    case Op::kMultiSet:
      for (std::size_t i = 0; i < q.keys.size(); ++i)
        if (auto e = set(q.keys[i], std::move(q.values[i]), out); !e.empty()) return e;
      return {};
    case Op::kCompareSet: {
      const std::string& key = q.keys[0];
      const std::string& expected = q.values[0];
      auto it = data_.find(key);
      if (it == data_.end()) {
        if (!expected.empty()) {  // torch answers with the expected value: nothing was set
          put_bytes(reply(), expected);
          return {};
        }
        if (auto e = set(key, q.values[1], out); !e.empty()) return e;
      } else if (*it->second == expected) {
        if (auto e = set(key, q.values[1], out); !e.empty()) return e;
      }
      reply();
      put_value(out.back(), data_.at(key));
      return {};
    }
    case Op::kGet:
    case Op::kMultiGet: {
      if (!has_all(q.keys)) return fmt::format("{} of a key that is not set", op_name(q.op));
      std::size_t size = 0;  // summed first: a key named many times must not build a huge reply
      std::size_t own = 0, shared = 0;  // the reply's own bytes and shared values, reserved at once
      for (const auto& k : q.keys) {
        const std::size_t n = data_.at(k)->size();
        size += 8 + n;
        own += 8 + (n <= kCopiedValue ? n : 0);
        shared += n <= kCopiedValue ? 0 : 1;
      }
      if (size > max_reply_)
        return fmt::format("a {} reply of {} bytes would be over the limit of {}", op_name(q.op), size, max_reply_);
      reply().reserve(own);
      Reply& r = out.back();
      r.values.reserve(shared);
      for (const auto& k : q.keys) put_value(r, data_.at(k));
      return {};
    }
    case Op::kAdd: {
      std::int64_t value = q.number;
      if (auto it = data_.find(q.keys[0]); it != data_.end()) {
        std::int64_t old = 0;
        const char* b = it->second->data();
        const char* e = b + it->second->size();
        while (b < e && (*b == ' ' || *b == '\t')) ++b;  // as std::stoll, torch's parser, skips
        auto [p, ec] = std::from_chars(b, e, old);
        if (ec != std::errc() || p == b) return fmt::format("add to key '{}', whose value is not a number", q.keys[0]);
        if (__builtin_add_overflow(value, old, &value))
          return fmt::format("add to key '{}' overflows a 64-bit number", q.keys[0]);
      }
      if (auto e = set(q.keys[0], std::to_string(value), out); !e.empty()) return e;
      put_i64(reply(), value);
      return {};
    }
    case Op::kCheck:
      put_u8(reply(), has_all(q.keys) ? kCheckReady : kCheckNotReady);
      return {};
    case Op::kWait: {
      if (awaited_.count(from)) return "a second wait before the first one ended";
      Wait w;
      std::unordered_set<std::string_view> seen;  // a key named twice counts once
      for (const auto& k : q.keys) {
        if (data_.count(k) || !seen.insert(k).second) continue;
        auto& list = waiters_[k];
        w.keys.push_back({k, list.insert(list.end(), {from, w.keys.size()})});
        w.bytes += 2 * k.size();
      }
      w.missing = w.keys.size();
      if (w.missing == 0)
        put_u8(reply(), kStopWaiting);
      else
        awaited_[from] = std::move(w);
      return {};
    }
    case Op::kCancelWait:
      disconnected(from);
      put_u8(reply(), kWaitCanceled);
      return {};
    case Op::kNumKeys:
      put_i64(reply(), static_cast<std::int64_t>(data_.size()));
      return {};
    case Op::kDelete: {
      auto it = data_.find(q.keys[0]);
      std::int64_t n = 0;
      if (it != data_.end()) {
        bytes_ -= it->first.size() + it->second->size();
        unstore(it->second);
        data_.erase(it);
        n = 1;
      }
      put_i64(reply(), n);
      return {};
    }
    case Op::kPing:
      put_u32(reply(), static_cast<std::uint32_t>(q.number));
      return {};
    case Op::kWatchKey:
      return "watch_key (torch 1.x's key callbacks) is not served by the agent's store";
  }
  return "unknown query";
}

void Engine::disconnected(ClientId c) {
  auto a = awaited_.find(c);
  if (a == awaited_.end()) return;
  for (const auto& r : a->second.keys) {
    if (r.done) continue;  // its key came: wake() dropped the key's list
    auto it = waiters_.find(r.key);
    it->second.erase(r.place);
    if (it->second.empty()) waiters_.erase(it);
  }
  awaited_.erase(a);
}

void Engine::clear() {
  data_.clear();
  waiters_.clear();
  awaited_.clear();
  unstored_.clear();
  bytes_ = 0;
}

}  // namespace mg::store
