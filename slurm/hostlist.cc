#include "slurm/hostlist.h"

#include <charconv>
#include <stdexcept>

#include <fmt/format.h>

namespace mg::slurm {
namespace {

constexpr std::size_t kMaxDigits = 18;  // fits an unsigned long long with room to add 1

struct Range {
  unsigned long long lo = 0, hi = 0;
  std::size_t width = 0;
  std::size_t count() const { return static_cast<std::size_t>(hi - lo + 1); }
};

bool is_separator(char c) { return c == ',' || c == ' ' || c == '\t' || c == '\n'; }
bool is_digit(char c) { return c >= '0' && c <= '9'; }

[[noreturn]] void bad(std::string_view expr, std::string_view why) {
  throw std::invalid_argument(fmt::format("bad hostlist '{}': {}", expr, why));
}

unsigned long long parse_number(std::string_view expr, std::string_view item, std::string_view t) {
  if (t.empty() || t.size() > kMaxDigits) bad(expr, fmt::format("'{}' is not a number or LO-HI range", item));
  for (char c : t)
    if (!is_digit(c)) bad(expr, fmt::format("'{}' is not a number or LO-HI range", item));
  unsigned long long v = 0;
  std::from_chars(t.data(), t.data() + t.size(), v);
  return v;
}

// "01-03,7" (the inside of one bracket group).
std::vector<Range> parse_group(std::string_view expr, std::string_view inner) {
  if (inner.empty()) bad(expr, "empty brackets '[]'");
  std::vector<Range> out;
  std::size_t pos = 0;
  while (true) {
    auto comma = inner.find(',', pos);
    auto item = inner.substr(pos, comma == std::string_view::npos ? std::string_view::npos : comma - pos);
    auto dash = item.find('-');
    auto lo_text = item.substr(0, dash);
    Range r;
    r.lo = parse_number(expr, item, lo_text);
    r.hi = dash == std::string_view::npos ? r.lo : parse_number(expr, item, item.substr(dash + 1));
    if (r.hi < r.lo) bad(expr, fmt::format("range '{}' runs backwards", item));
    r.width = lo_text.size();
    out.push_back(r);
    if (comma == std::string_view::npos) break;
    pos = comma + 1;
  }
  return out;
}

struct Piece {
  std::string text;            // literal text before the group
  std::vector<Range> ranges;   // empty for the trailing literal
};

// Expands one term such as "rack[1-2]-node[08-10]" (no top-level separators inside).
void expand_term(std::string_view expr, std::string_view term, std::vector<std::string>& out, std::size_t max_hosts) {
  std::vector<Piece> pieces;
  std::size_t pos = 0, total = 1;
  while (pos <= term.size()) {
    auto open = term.find('[', pos);
    auto literal = term.substr(pos, open == std::string_view::npos ? std::string_view::npos : open - pos);
    if (literal.find(']') != std::string_view::npos) bad(expr, "']' without '['");
    if (open == std::string_view::npos) {
      pieces.push_back({std::string(literal), {}});
      break;
    }
    auto close = term.find(']', open);
    if (close == std::string_view::npos) bad(expr, "'[' without ']'");
    auto inner = term.substr(open + 1, close - open - 1);
    if (inner.find('[') != std::string_view::npos) bad(expr, "nested '['");
    Piece p{std::string(literal), parse_group(expr, inner)};
    std::size_t n = 0;
    for (const Range& r : p.ranges) {
      if (r.hi - r.lo >= max_hosts) n = max_hosts + 1;
      else n += r.count();
      if (n > max_hosts) break;
    }
    if (n > max_hosts || total > max_hosts / n || out.size() + total * n > max_hosts)
      throw std::invalid_argument(
          fmt::format("hostlist '{}' expands to more than {} hosts; check the ranges", expr, max_hosts));
    total *= n;
    pieces.push_back(std::move(p));
    pos = close + 1;
  }
  // Cartesian product, leftmost group slowest (Slurm's order).
  std::vector<std::string> partial{""};
  for (const Piece& p : pieces) {
    if (p.ranges.empty()) {
      for (auto& s : partial) s += p.text;
      continue;
    }
    std::vector<std::string> next;
    next.reserve(partial.size() * 2);
    for (const auto& s : partial)
      for (const Range& r : p.ranges)
        for (unsigned long long v = r.lo; v <= r.hi; ++v) next.push_back(fmt::format("{}{}{:0{}}", s, p.text, v, r.width));
    partial = std::move(next);
  }
  for (auto& s : partial) out.push_back(std::move(s));
}

// A host name split like Slurm's hostname_create: prefix and trailing number.
struct Host {
  std::string prefix;
  bool numbered = false;
  unsigned long long num = 0;
  int width = 0;
};

Host split_host(const std::string& name) {
  std::size_t d = name.size();
  while (d > 0 && is_digit(name[d - 1])) --d;
  Host h{name.substr(0, d)};
  const std::size_t digits = name.size() - d;
  if (digits == 0 || digits > kMaxDigits) {
    h.prefix = name;
    return h;
  }
  h.numbered = true;
  std::from_chars(name.data() + d, name.data() + name.size(), h.num);
  h.width = static_cast<int>(digits);
  return h;
}

// Leading zeros printed when `n` is written with `width` digits.
int zero_padding(unsigned long long n, int width) {
  int digits = 1;
  for (auto v = n; v >= 10; v /= 10) ++digits;
  return width > digits ? width - digits : 0;
}

// Slurm's _width_equiv: may a range starting at n (width wn) go on with m (width wm)?
// On success the widths are made equal.
bool width_equiv(unsigned long long n, int& wn, unsigned long long m, int& wm) {
  if (wn == wm) return true;
  const int npad = zero_padding(n, wn), nmpad = zero_padding(n, wm);
  const int mpad = zero_padding(m, wm), mnpad = zero_padding(m, wn);
  if (npad != nmpad && mpad != mnpad) return false;
  if (npad != nmpad) {
    wm = wn;
    return true;
  }
  wn = wm;
  return true;
}

struct HostRange {
  std::string prefix;
  bool numbered = false;
  unsigned long long lo = 0, hi = 0;
  int width = 0;
};

std::string number_text(const HostRange& r) {
  if (r.lo == r.hi) return fmt::format("{:0{}}", r.lo, r.width);
  return fmt::format("{:0{}}-{:0{}}", r.lo, r.width, r.hi, r.width);
}

bool same_bracket(const HostRange& a, const HostRange& b) { return a.numbered && b.numbered && a.prefix == b.prefix; }

}  // namespace

std::vector<std::string> expand_hostlist(std::string_view expr, std::size_t max_hosts) {
  std::vector<std::string> out;
  int depth = 0;
  std::size_t start = 0;
  for (std::size_t i = 0; i <= expr.size(); ++i) {
    const bool end = i == expr.size();
    if (!end && expr[i] == '[' && ++depth > 1) bad(expr, "nested '['");
    if (!end && expr[i] == ']' && --depth < 0) bad(expr, "']' without '['");
    if (end || (depth == 0 && is_separator(expr[i]))) {
      if (depth != 0) bad(expr, "'[' without ']'");
      if (i > start) expand_term(expr, expr.substr(start, i - start), out, max_hosts);
      start = i + 1;
    }
  }
  return out;
}

std::string compress_hostlist(const std::vector<std::string>& hosts) {
  // Pushing in order, like hostlist_push_host: a host extends the last range when it is
  // its successor with the same prefix and an equivalent width.
  std::vector<HostRange> ranges;
  for (const auto& name : hosts) {
    Host h = split_host(name);
    if (!ranges.empty()) {
      HostRange& tail = ranges.back();
      int tw = tail.width, hw = h.width;
      if (h.numbered && tail.numbered && tail.prefix == h.prefix && tail.hi + 1 == h.num &&
          width_equiv(tail.lo, tw, h.num, hw)) {  // Slurm compares with the range's low end
        tail.width = tw;
        tail.hi = h.num;
        continue;
      }
    }
    ranges.push_back({h.prefix, h.numbered, h.num, h.num, h.width});
  }
  std::string out;
  for (std::size_t i = 0; i < ranges.size();) {
    if (!out.empty()) out += ',';
    const HostRange& r = ranges[i];
    out += r.prefix;
    if (!r.numbered) {
      ++i;
      continue;
    }
    const bool bracket = r.lo != r.hi || (i + 1 < ranges.size() && same_bracket(r, ranges[i + 1]));
    if (!bracket) {
      out += number_text(r);
      ++i;
      continue;
    }
    out += '[';
    out += number_text(r);
    for (++i; i < ranges.size() && same_bracket(ranges[i - 1], ranges[i]); ++i) out += "," + number_text(ranges[i]);
    out += ']';
  }
  return out;
}

}  // namespace mg::slurm
