#include <catch2/catch.hpp>

#include <string>
#include <vector>

#include "launcher/line_splitter.h"

using mg::LineSplitter;

namespace {
struct Collected {
  std::vector<std::string> lines;
  std::vector<bool> cuts;
};
Collected feed_all(LineSplitter& s, const std::vector<std::string>& chunks, bool finish = true) {
  Collected c;
  auto sink = [&](std::string_view l, bool cut) {
    c.lines.emplace_back(l);
    c.cuts.push_back(cut);
  };
  for (const auto& ch : chunks) s.feed(ch, sink);
  if (finish) s.finish(sink);
  return c;
}
}  // namespace

TEST_CASE("lines split across reads come out whole") {
  LineSplitter s(100);
  auto c = feed_all(s, {"ab", "c\nde", "f\n\ng"}, false);
  CHECK(c.lines == std::vector<std::string>{"abc", "def", ""});
  CHECK(s.has_pending());
}

TEST_CASE("the last line without a newline is flushed at finish") {
  LineSplitter s(100);
  auto c = feed_all(s, {"one\ntwo"});
  CHECK(c.lines == std::vector<std::string>{"one", "two"});
  CHECK_FALSE(s.has_pending());
}

TEST_CASE("long lines are cut into flagged pieces") {
  LineSplitter s(4);
  auto c = feed_all(s, {"abcdefghij\nxy\n"});
  CHECK(c.lines == std::vector<std::string>{"abcd", "efgh", "ij", "xy"});
  CHECK(c.cuts == std::vector<bool>{true, true, false, false});
}

TEST_CASE("a line of exactly the limit is not cut") {
  LineSplitter s(4);
  auto c = feed_all(s, {"abcd", "\nefgh\n"});
  CHECK(c.lines == std::vector<std::string>{"abcd", "efgh"});
  CHECK(c.cuts == std::vector<bool>{false, false});
}

TEST_CASE("byte-by-byte feeding gives the same lines as one chunk") {
  std::string text = "alpha\nbeta\n\ngamma delta\nz";
  LineSplitter whole(5), bytes(5);
  auto a = feed_all(whole, {text});
  std::vector<std::string> singles;
  for (char ch : text) singles.emplace_back(1, ch);
  auto b = feed_all(bytes, singles);
  CHECK(a.lines == b.lines);
  CHECK(a.cuts == b.cuts);
}

TEST_CASE("live relay puts the prefix at each visual line start, keeps CRLF, and holds a trailing carriage return") {
  std::string out;
  mg::LiveLine st;
  mg::live_relay(out, st, "P:", "50%");
  CHECK(out == "P:50%");
  CHECK_FALSE(st.at_start);
  mg::live_relay(out, st, "P:", "\r60%\r");
  CHECK(out == "P:50%\rP:60%");  // the last \r waits: it may start "\r\n"
  CHECK(st.cr_pending);
  mg::live_relay(out, st, "P:", "\n\n");
  CHECK(out == "P:50%\rP:60%\r\nP:\n");  // CRLF as is; an empty line still gets its prefix
  CHECK(st.at_start);
  out.clear();
  mg::live_relay(out, st, "P:", "\rfrom the start\n");  // a \r at a line start is dropped
  CHECK(out == "P:from the start\n");
  out.clear();
  mg::LiveLine raw;
  mg::live_relay(out, raw, "", "a\rb\nc");
  CHECK(out == "a\rb\nc");
}

TEST_CASE("the line prefix template substitutes role_name, rank and local_rank as Python's safe_substitute") {
  CHECK(mg::expand_line_prefix("[${role_name}${rank}]:", "default", 3, 1) == "[default3]:");
  CHECK(mg::expand_line_prefix("$rank/$local_rank ", "r", 12, 4) == "12/4 ");
  CHECK(mg::expand_line_prefix("$$${rank} ${unknown} $other $", "r", 5, 0) == "$5 ${unknown} $other $");
  CHECK(mg::expand_line_prefix("${rank", "r", 5, 0) == "${rank");
  CHECK(mg::expand_line_prefix("", "r", 5, 0).empty());
}
