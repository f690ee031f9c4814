#include "slurm/hostlist.h"

#include <charconv>
#include <stdexcept>

#include <fmt/format.h>

namespace mg::slurm {
namespace {

struct Range {
  unsigned long lo = 0, hi = 0;
  std::size_t width = 0;
};

std::vector<Range> parse_ranges(std::string_view expr, std::string_view inner) {
  std::vector<Range> out;
  std::size_t pos = 0;
  while (pos <= inner.size()) {
    auto comma = inner.find(',', pos);
    auto item = inner.substr(pos, comma == std::string_view::npos ? std::string_view::npos : comma - pos);
    auto dash = item.find('-');
    auto lo_text = item.substr(0, dash);
    auto hi_text = dash == std::string_view::npos ? lo_text : item.substr(dash + 1);
    Range r;
    auto num = [&](std::string_view t, unsigned long& v) {
      auto [p, ec] = std::from_chars(t.data(), t.data() + t.size(), v);
      if (t.empty() || ec != std::errc{} || p != t.data() + t.size())
        throw std::invalid_argument(fmt::format("bad hostlist '{}': '{}' is not a number or range", expr, item));
    };
    num(lo_text, r.lo);
    num(hi_text, r.hi);
    if (r.hi < r.lo) throw std::invalid_argument(fmt::format("bad hostlist '{}': range '{}' runs backwards", expr, item));
    r.width = lo_text.size();
    out.push_back(r);
    if (comma == std::string_view::npos) break;
    pos = comma + 1;
  }
  return out;
}

// Expands one comma-free-at-top-level term such as "gpu[1-2]-ib[01,03]".
void expand_term(std::string_view expr, std::string_view term, std::vector<std::string>& out, std::size_t max_hosts) {
  std::vector<std::string> partial{""};
  std::size_t pos = 0;
  while (pos < term.size()) {
    auto open = term.find('[', pos);
    if (open == std::string_view::npos) {
      for (auto& p : partial) p += term.substr(pos);
      break;
    }
    auto close = term.find(']', open);
    if (close == std::string_view::npos) throw std::invalid_argument(fmt::format("bad hostlist '{}': unbalanced '['", expr));
    auto prefix = term.substr(pos, open - pos);
    std::vector<std::string> next;
    for (const auto& p : partial) {
      for (const Range& r : parse_ranges(expr, term.substr(open + 1, close - open - 1))) {
        if (r.hi - r.lo >= max_hosts || next.size() + (r.hi - r.lo + 1) > max_hosts)
          throw std::invalid_argument(fmt::format("hostlist '{}' expands to more than {} hosts", expr, max_hosts));
        for (unsigned long v = r.lo; v <= r.hi; ++v)
          next.push_back(fmt::format("{}{}{:0{}}", p, prefix, v, r.width));
      }
    }
    partial = std::move(next);
    pos = close + 1;
  }
  if (out.size() + partial.size() > max_hosts)
    throw std::invalid_argument(fmt::format("hostlist '{}' expands to more than {} hosts", expr, max_hosts));
  for (auto& p : partial) {
    if (p.empty()) throw std::invalid_argument(fmt::format("bad hostlist '{}': empty host name", expr));
    out.push_back(std::move(p));
  }
}

}  // namespace

std::vector<std::string> expand_hostlist(std::string_view expr, std::size_t max_hosts) {
  std::vector<std::string> out;
  int depth = 0;
  std::size_t start = 0;
  for (std::size_t i = 0; i <= expr.size(); ++i) {
    if (i < expr.size() && expr[i] == '[') ++depth;
    if (i < expr.size() && expr[i] == ']') --depth;
    if (depth < 0 || depth > 1) throw std::invalid_argument(fmt::format("bad hostlist '{}': unbalanced brackets", expr));
    if (i == expr.size() || (expr[i] == ',' && depth == 0)) {
      if (depth != 0) throw std::invalid_argument(fmt::format("bad hostlist '{}': unbalanced '['", expr));
      if (i > start) expand_term(expr, expr.substr(start, i - start), out, max_hosts);
      start = i + 1;
    }
  }
  return out;
}

}  // namespace mg::slurm
