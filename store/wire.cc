#include "store/wire.h"

#include <cstring>

#include <fmt/format.h>

namespace mg::store {

std::string_view op_name(Op op) {
  switch (op) {
    case Op::kValidate: return "validate";
    case Op::kSet: return "set";
    case Op::kCompareSet: return "compare_set";
    case Op::kGet: return "get";
    case Op::kAdd: return "add";
    case Op::kCheck: return "check";
    case Op::kWait: return "wait";
    case Op::kNumKeys: return "num_keys";
    case Op::kDelete: return "delete_key";
    case Op::kAppend: return "append";
    case Op::kMultiGet: return "multi_get";
    case Op::kMultiSet: return "multi_set";
    case Op::kCancelWait: return "cancel_wait";
    case Op::kPing: return "ping";
    case Op::kWatchKey: return "watch_key";
  }
  return "?";
}

namespace {

// Reads fields from the front of a buffer; every read says whether the bytes were there.
class Reader {
 public:
  explicit Reader(std::string_view in) : in_(in) {}
  template <typename T>
  bool value(T& v) {
    if (in_.size() - pos_ < sizeof(T)) {
      need_ = pos_ + sizeof(T);
      return false;
    }
    std::memcpy(&v, in_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    ++reads_;
    return true;
  }
  // A uint64 length and that many bytes. `error` is set when the length is over `max`.
  bool bytes(std::string& out, std::size_t max, const char* what, std::string& error) {
    std::uint64_t n = 0;
    if (!value(n)) return false;
    if (n > max) {
      error = fmt::format("{} of {} bytes is over the limit of {}", what, n, max);
      return false;
    }
    if (in_.size() - pos_ < n) {
      need_ = pos_ + n;
      return false;
    }
    out.assign(in_.data() + pos_, n);
    pos_ += n;
    return true;
  }
  std::size_t pos() const { return pos_; }
  std::size_t need() const { return need_; }
  std::size_t reads() const { return reads_; }

 private:
  std::string_view in_;
  std::size_t pos_ = 0;
  std::size_t need_ = 0;
  std::size_t reads_ = 0;
};

bool multi_key(Op op) { return op == Op::kCheck || op == Op::kWait || op == Op::kMultiGet || op == Op::kMultiSet; }

// A multi-key query's key count and field lengths, checked from where `pr` got to without
// reading a key: true when the whole query is in `in`. Otherwise `p` says the bytes needed
// or (error set) the bound broken.
bool check_lengths(std::string_view in, Op op, const Limits& limits, Progress& pr, Parsed& p) {
  if (pr.pos > in.size()) pr = {};  // not the same query: start again
  const bool with_values = op == Op::kMultiSet;
  auto u64_at = [&](std::size_t at, std::uint64_t& v) {
    if (in.size() - at < sizeof(v)) {
      p.need = at + sizeof(v);
      return false;
    }
    std::memcpy(&v, in.data() + at, sizeof(v));
    ++p.fields;
    return true;
  };
  if (pr.pos == 0) {
    std::uint64_t n = 0;
    if (!u64_at(1, n)) return false;  // after the type byte
    if (n > limits.max_keys) {
      p.error = fmt::format("a {} of {} keys is over the limit of {}", op_name(op), n, limits.max_keys);
      return false;
    }
    pr.pos = 1 + sizeof(n);
    pr.fields = with_values ? 2 * n : n;
  }
  while (pr.fields > 0) {
    const bool value = with_values && pr.fields % 2 == 1;  // MULTI_SET's fields: key, value, key, ...
    std::uint64_t len = 0;
    if (!u64_at(pr.pos, len)) return false;
    const std::size_t max = value ? limits.max_value : limits.max_key;
    if (len > max) {
      p.error = fmt::format("{} of {} bytes is over the limit of {}", value ? "a value" : "a key", len, max);
      return false;
    }
    if (in.size() - pr.pos - sizeof(len) < len) {
      p.need = pr.pos + sizeof(len) + len;
      return false;
    }
    pr.pos += sizeof(len) + len;
    --pr.fields;
  }
  return true;
}

bool op_of(std::uint8_t type, Dialect d, Op& op) {
  static constexpr Op kV1[] = {Op::kSet, Op::kCompareSet, Op::kGet, Op::kAdd, Op::kCheck,
                               Op::kWait, Op::kNumKeys, Op::kWatchKey, Op::kDelete};
  static constexpr Op kV2[] = {Op::kValidate, Op::kSet, Op::kCompareSet, Op::kGet, Op::kAdd,
                               Op::kCheck, Op::kWait, Op::kNumKeys, Op::kDelete, Op::kAppend,
                               Op::kMultiGet, Op::kMultiSet, Op::kCancelWait, Op::kPing};
  if (d == Dialect::kV1 && type < std::size(kV1)) return op = kV1[type], true;
  if (d == Dialect::kV2 && type < std::size(kV2)) return op = kV2[type], true;
  return false;
}

}  // namespace

Parsed parse_query(std::string_view in, Dialect& dialect, const Limits& limits, Progress* progress) {
  Parsed p;
  if (in.empty()) return p;
  Reader r(in);
  std::uint8_t type = 0;
  r.value(type);
  Dialect d = dialect;
  if (d == Dialect::kUnknown) {
    if (type == 0) {
      if (in.size() < 5) return p;  // the magic or a 1.x key length decides
      std::uint32_t magic = 0;
      std::memcpy(&magic, in.data() + 1, 4);
      d = magic == kValidationMagic ? Dialect::kV2 : Dialect::kV1;
    } else {
      d = Dialect::kV1;
    }
  }
  Op op{};
  if (!op_of(type, d, op)) {
    p.status = Parsed::kBad;
    p.error = fmt::format("unknown query type {} (torch {} client)", type, d == Dialect::kV1 ? "1.x" : "2.x");
    return p;
  }
  // An unfinished query: the bytes it needs, or kBad when that is over the limit.
  auto more = [&](std::size_t need, std::size_t fields) {
    Parsed m;
    m.need = need;
    m.fields = fields;
    if (m.need > limits.max_query) {
      m.status = Parsed::kBad;
      m.error = fmt::format("a {} query of more than {} bytes is over the limit", op_name(op), limits.max_query);
    }
    return m;
  };
  Progress none;
  Progress& pr = progress ? *progress : none;
  if (multi_key(op)) {  // its lengths first, resumed: the keys are read once, when all are there
    if (!check_lengths(in, op, limits, pr, p)) {
      if (!p.error.empty()) {
        p.status = Parsed::kBad;
        pr = {};
        return p;
      }
      return more(p.need, p.fields);
    }
  }
  pr = {};
  Query& q = p.query;
  q.op = op;
  std::string& err = p.error;
  auto key = [&] { return r.bytes(q.keys.emplace_back(), limits.max_key, "a key", err); };
  auto val = [&] { return r.bytes(q.values.emplace_back(), limits.max_value, "a value", err); };
  auto keys = [&](bool with_values) {
    std::uint64_t n = 0;
    if (!r.value(n)) return false;
    if (n > limits.max_keys) {
      err = fmt::format("a {} of {} keys is over the limit of {}", op_name(op), n, limits.max_keys);
      return false;
    }
    for (std::uint64_t i = 0; i < n; ++i)
      if (!key() || (with_values && !val())) return false;
    return true;
  };
  bool ok = false;
  switch (op) {
    case Op::kValidate: {
      std::uint32_t magic = 0;
      ok = r.value(magic);
      if (ok && magic != kValidationMagic) {
        err = fmt::format("bad validation number {:#x}", magic);
        ok = false;
      }
      break;
    }
    case Op::kSet:
    case Op::kAppend: ok = key() && val(); break;
    case Op::kCompareSet: ok = key() && val() && val(); break;
    case Op::kGet:
    case Op::kDelete:
    case Op::kWatchKey: ok = key(); break;
    case Op::kAdd: ok = key() && r.value(q.number); break;
    case Op::kCheck:
    case Op::kWait:
    case Op::kMultiGet: ok = keys(false); break;
    case Op::kMultiSet: ok = keys(true); break;
    case Op::kNumKeys:
    case Op::kCancelWait: ok = true; break;
    case Op::kPing: {
      std::uint32_t nonce = 0;
      ok = r.value(nonce);
      q.number = nonce;
      break;
    }
  }
  if (!err.empty()) {
    p.status = Parsed::kBad;
    return p;
  }
  if (!ok) return more(r.need(), p.fields + r.reads());
  p.status = Parsed::kOk;
  p.consumed = r.pos();
  p.fields += r.reads();
  dialect = d;
  return p;
}

void put_u8(std::string& out, std::uint8_t v) { out.push_back(static_cast<char>(v)); }
void put_i64(std::string& out, std::int64_t v) { out.append(reinterpret_cast<const char*>(&v), sizeof(v)); }
void put_u32(std::string& out, std::uint32_t v) { out.append(reinterpret_cast<const char*>(&v), sizeof(v)); }
void put_bytes(std::string& out, std::string_view bytes) {
  const std::uint64_t n = bytes.size();
  out.append(reinterpret_cast<const char*>(&n), sizeof(n));
  out.append(bytes);
}

}  // namespace mg::store
