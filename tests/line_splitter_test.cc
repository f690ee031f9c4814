#include <catch2/catch.hpp>

#include <algorithm>
#include <string>
#include <vector>

#include "logs/line_splitter.h"

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

TEST_CASE("a 100,000-byte line read in 64 KiB pieces comes out whole under the default limit (#38)") {
  LineSplitter s(mg::kDefaultMaxLine);
  CHECK(mg::kDefaultMaxLine >= std::size_t{1} << 20);
  const std::string line(100000, 'x');
  auto c = feed_all(s, {line.substr(0, 65536), line.substr(65536) + "\n"});
  REQUIRE(c.lines.size() == 1);
  CHECK(c.lines[0] == line);
  CHECK(c.cuts == std::vector<bool>{false});
}

TEST_CASE("a splitter holds memory only while a line is unfinished: a long line's buffer is given back once it is out (#38)") {
  LineSplitter s(mg::kDefaultMaxLine);
  auto sink = [](std::string_view, bool) {};
  s.feed(std::string(300000, 'x'), sink);  // unfinished: held
  CHECK(s.held() >= 300000);
  s.feed("y\nshort", sink);  // the line went out; a short unfinished one stays
  CHECK(s.pending() == "short");
  CHECK(s.held() <= LineSplitter::kKeptCapacity);
  s.feed(std::string(200000, 'z') + "\n", sink);
  CHECK(s.held() <= LineSplitter::kKeptCapacity);
  // A line above the limit, cut into pieces: nothing kept after its last piece either.
  LineSplitter small(1000);
  small.feed(std::string(5000, 'x'), sink);
  small.finish(sink);
  CHECK_FALSE(small.has_pending());
  CHECK(small.held() <= LineSplitter::kKeptCapacity);
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

TEST_CASE("live relay marks a line redrawn after a carriage return, and raw lines keep every byte") {
  std::string out;
  mg::LiveLine st;
  mg::live_relay(out, st, "P:", "plain");
  CHECK_FALSE(st.redrawn);
  mg::live_relay(out, st, "P:", "\r10%");
  CHECK(st.redrawn);  // a progress bar: the console may wipe it instead of ending it
  mg::live_relay(out, st, "P:", "\n");
  CHECK_FALSE(st.redrawn);
  mg::live_relay(out, st, "P:", "\r 0%");
  CHECK(st.redrawn);  // tqdm's first draw, at the start of a line
  mg::LiveLine crlf;
  mg::live_relay(out, crlf, "P:", "a\r");
  mg::live_relay(out, crlf, "P:", "\n");
  CHECK_FALSE(crlf.redrawn);  // a CRLF line end, split between two reads
  out.clear();
  mg::LiveLine raw;  // no prefix: nothing dropped, nothing held back
  mg::live_relay(out, raw, "", "\rx\r");
  CHECK(out == "\rx\r");
  CHECK(raw.redrawn);
  CHECK_FALSE(raw.at_start);
  mg::live_relay(out, raw, "", "y\n");
  CHECK(out == "\rx\ry\n");
  CHECK(raw.at_start);
  CHECK_FALSE(raw.redrawn);
}

TEST_CASE("live relay after the console ended a line: a lone newline is not written twice, a wiped bar comes back") {
  std::string out;
  mg::LiveLine st;
  mg::live_relay(out, st, "P:", "half");
  st = mg::LiveLine{.at_start = true, .ended = true};  // as Console::break_line leaves it
  out.clear();
  mg::live_relay(out, st, "P:", "\n");
  CHECK(out.empty());  // the console wrote that newline already: no empty "P:" line
  mg::live_relay(out, st, "P:", "\n");
  CHECK(out == "P:\n");  // a second one is the worker's own empty line
  // A bar wiped by another worker's output: its newline shows its last state again.
  mg::LiveLine bar;
  out.clear();
  mg::live_relay(out, bar, "P:", "\r10%\r20%");
  bar.at_start = true;
  bar.wiped = true;
  bar.redrawn = false;
  out.clear();
  mg::live_relay(out, bar, "P:", "\n");
  CHECK(out == "P:20%\n");
  // A redraw after the wipe draws afresh; raw lines (no prefix) restore the same way.
  bar.at_start = true;
  bar.wiped = true;
  out.clear();
  mg::live_relay(out, bar, "P:", "\r30%");
  CHECK(out == "P:30%");
  mg::LiveLine raw;
  out.clear();
  mg::live_relay(out, raw, "", "a\rb 1");
  raw.at_start = true;
  raw.wiped = true;
  out.clear();
  mg::live_relay(out, raw, "", "\n");
  CHECK(out == "b 1\n");
}

TEST_CASE("the line prefix template substitutes role_name, rank and local_rank as Python's safe_substitute") {
  CHECK(mg::expand_line_prefix("[${role_name}${rank}]:", "default", 3, 1) == "[default3]:");
  CHECK(mg::expand_line_prefix("$rank/$local_rank ", "r", 12, 4) == "12/4 ");
  CHECK(mg::expand_line_prefix("$$${rank} ${unknown} $other $", "r", 5, 0) == "$5 ${unknown} $other $");
  CHECK(mg::expand_line_prefix("${rank", "r", 5, 0) == "${rank");
  CHECK(mg::expand_line_prefix("", "r", 5, 0).empty());
}

namespace {
// Random text: short and long lines, empty lines, '\r', an unfinished last line or not.
std::string random_text(unsigned seed, std::size_t max_line) {
  std::string text;
  unsigned x = seed * 2654435761u + 1;
  auto next = [&] { return x = x * 1103515245u + 12345u, (x >> 8) & 0xffff; };
  const int lines = 1 + static_cast<int>(next() % 40);
  for (int i = 0; i < lines; ++i) {
    const std::size_t len = next() % 4 == 0 ? next() % (3 * max_line + 2) : next() % (max_line + 1);
    for (std::size_t k = 0; k < len; ++k) text.push_back(static_cast<char>('a' + next() % 26));
    if (i + 1 < lines || next() % 2) text.push_back('\n');
  }
  return text;
}
// The same text cut at random points.
std::vector<std::string> random_chunks(const std::string& text, unsigned seed) {
  std::vector<std::string> chunks;
  unsigned x = seed + 7;
  for (std::size_t i = 0; i < text.size();) {
    x = x * 1103515245u + 12345u;
    const std::size_t n = std::min<std::size_t>(text.size() - i, 1 + (x >> 8) % 23);
    chunks.push_back(text.substr(i, n));
    i += n;
  }
  return chunks;
}
}  // namespace

TEST_CASE("feed_runs gives the same lines and cut flags as feed, in the same order, for any chunking") {
  for (std::size_t max_line : {1u, 3u, 8u, 64u}) {
    for (unsigned seed = 0; seed < 200; ++seed) {
      const std::string text = random_text(seed, max_line);
      const auto chunks = random_chunks(text, seed);
      LineSplitter plain(max_line), runs(max_line);
      const Collected want = feed_all(plain, chunks);
      Collected got;
      auto sink = [&](std::string_view l, bool cut) {
        got.lines.emplace_back(l);
        got.cuts.push_back(cut);
      };
      for (const auto& ch : chunks)
        runs.feed_runs(ch, [&](std::string_view run) {
          REQUIRE(!run.empty());
          REQUIRE(run.back() == '\n');
          mg::for_each_piece(run, runs.max_line(), sink);
        }, sink);
      runs.finish(sink);
      INFO("max_line " << max_line << ", seed " << seed);
      REQUIRE(got.lines == want.lines);
      REQUIRE(got.cuts == want.cuts);
    }
  }
}

TEST_CASE("append_prefixed_lines writes byte for byte what one prefixed line per piece would") {
  const std::string marker = " [cut]";
  for (std::size_t max_line : {1u, 4u, 16u}) {
    for (unsigned seed = 0; seed < 200; ++seed) {
      std::string run = random_text(seed, max_line);
      if (run.empty() || run.back() != '\n') run.push_back('\n');
      std::string want = "before|";
      mg::for_each_piece(run, max_line, [&](std::string_view l, bool cut) {
        want.append("[rank7]:").append(l);
        if (cut) want.append(marker);
        want.push_back('\n');
      });
      std::string got = "before|";
      mg::append_prefixed_lines(got, "[rank7]:", run, max_line, marker);
      INFO("max_line " << max_line << ", seed " << seed);
      REQUIRE(got == want);
    }
  }
  std::string empty_prefix;
  mg::append_prefixed_lines(empty_prefix, "", "a\n\nbcdef\n", 3, "+");
  CHECK(empty_prefix == "a\n\nbcd+\nef\n");
}
