// Splits a byte stream into lines for relaying. Complete lines come out whole; a line
// longer than the limit comes out in pieces of at most `max_line` bytes, each but the last
// flagged `cut`; finish() flushes a last line that had no newline. Pure: no I/O.
// Memory: a splitter holds bytes only while a line is unfinished (up to `max_line`, 1 MiB
// by default), and gives a buffer grown past kKeptCapacity back once that line is out, so
// an agent of many workers pays for long lines only while one is being written.
// Also the other pure text rules of the relay: the live form of a worker stream for a
// terminal (live_relay) and the line prefix template (expand_line_prefix).
#pragma once

#include <cstddef>
#include <cstring>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace mg {

// The longest line relayed whole (prefix aside); longer ones are cut (docs/running.md).
inline constexpr std::size_t kDefaultMaxLine = std::size_t{1} << 20;

class LineSplitter {
 public:
  // What an unfinished line's buffer keeps between lines; a larger one is freed.
  static constexpr std::size_t kKeptCapacity = 4096;

  explicit LineSplitter(std::size_t max_line) : max_line_(max_line ? max_line : 1) {}

  // Calls sink(std::string_view line_without_newline, bool cut) for each line or piece.
  template <typename Sink>
  void feed(std::string_view data, Sink&& sink) {
    while (!data.empty()) {
      const auto nl = data.find('\n');
      const std::size_t room = max_line_ - pending_.size();
      if (nl != std::string_view::npos && nl <= room) {
        if (pending_.empty()) {
          sink(data.substr(0, nl), false);
        } else {
          pending_.append(data.substr(0, nl));
          sink(std::string_view(pending_), false);
          release();
        }
        data.remove_prefix(nl + 1);
      } else if (nl == std::string_view::npos && data.size() <= room) {
        pending_.append(data);
        return;
      } else {
        pending_.append(data.substr(0, room));
        data.remove_prefix(room);
        // A newline right after a full piece ends the line there: no empty continuation.
        const bool ends_here = !data.empty() && data.front() == '\n';
        sink(std::string_view(pending_), !ends_here);
        release();
        if (ends_here) data.remove_prefix(1);
      }
    }
  }

  // As feed(), for a caller that copies whole lines in bulk: the complete lines of `data`
  // that need no joining with earlier bytes come to run(std::string_view) as one run of
  // lines, each with its '\n' and of any length (for_each_piece() cuts them as feed()
  // would); the line that completes earlier bytes and the unfinished tail go to sink as
  // in feed(). Everything comes out in the order of `data`, as from feed().
  template <typename Run, typename Sink>
  void feed_runs(std::string_view data, Run&& run, Sink&& sink) {
    if (!pending_.empty()) {
      const auto nl = data.find('\n');
      if (nl == std::string_view::npos) {
        feed(data, sink);
        return;
      }
      feed(data.substr(0, nl + 1), sink);  // ends with its newline: nothing stays pending
      data.remove_prefix(nl + 1);
    }
    if (const void* last = data.empty() ? nullptr : ::memrchr(data.data(), '\n', data.size())) {
      const std::size_t n = static_cast<std::size_t>(static_cast<const char*>(last) - data.data()) + 1;
      run(data.substr(0, n));
      data.remove_prefix(n);
    }
    feed(data, sink);
  }

  std::size_t max_line() const { return max_line_; }

  template <typename Sink>
  void finish(Sink&& sink) {
    if (!pending_.empty()) sink(std::string_view(pending_), false);
    release();
  }

  bool has_pending() const { return !pending_.empty(); }
  // The unfinished line kept so far (after the last piece given out).
  std::string_view pending() const { return pending_; }
  // Bytes held for the unfinished line now (its buffer's capacity).
  std::size_t held() const { return pending_.capacity(); }

 private:
  // The line went out: empty, and a buffer a long line grew is given back.
  void release() {
    if (pending_.capacity() > kKeptCapacity) std::string().swap(pending_);
    else pending_.clear();
  }

  std::size_t max_line_;
  std::string pending_;
};

// The lines of `run` (complete lines, each ending in '\n') as feed() gives them: sink(line
// without its newline, cut), a line longer than `max_line` in pieces of `max_line` bytes,
// each but the last flagged cut. Pure.
template <typename Sink>
void for_each_piece(std::string_view run, std::size_t max_line, Sink&& sink) {
  if (max_line == 0) max_line = 1;
  while (!run.empty()) {
    const auto* nl = static_cast<const char*>(::memchr(run.data(), '\n', run.size()));
    std::size_t len = nl ? static_cast<std::size_t>(nl - run.data()) : run.size();
    std::string_view line = run.substr(0, len);
    run.remove_prefix(nl ? len + 1 : len);
    while (line.size() > max_line) {
      sink(line.substr(0, max_line), true);
      line.remove_prefix(max_line);
    }
    sink(line, false);
  }
}

// Appends to `out` what the relay writes for `run` (complete lines, as from
// LineSplitter::feed_runs): each line or piece as `prefix` + text (+ `cut_marker` when
// cut) + '\n', byte for byte what one Console::line() call per piece appends. The common
// case (a line within `max_line`) costs two appends. Pure.
inline void append_prefixed_lines(std::string& out, std::string_view prefix, std::string_view run,
                                  std::size_t max_line, std::string_view cut_marker) {
  if (max_line == 0) max_line = 1;
  if (prefix.empty() && run.size() <= max_line) {  // raw lines, none to cut: the bytes as they are
    out.append(run);
    return;
  }
  const char* p = run.data();
  const char* const end = p + run.size();
  while (p < end) {
    const auto* nl = static_cast<const char*>(::memchr(p, '\n', static_cast<std::size_t>(end - p)));
    const char* const stop = nl ? nl : end;
    const auto len = static_cast<std::size_t>(stop - p);
    if (len <= max_line && nl) {
      out.append(prefix);
      out.append(p, len + 1);  // the line with its newline
      p = nl + 1;
      continue;
    }
    std::string_view line(p, len);
    p = nl ? nl + 1 : end;
    while (line.size() > max_line) {
      out.append(prefix);
      out.append(line.substr(0, max_line));
      out.append(cut_marker);
      out.push_back('\n');
      line.remove_prefix(max_line);
    }
    out.append(prefix);
    out.append(line);
    out.push_back('\n');
  }
}

// Where one worker stream stands on a terminal between two pieces of its output.
struct LiveLine {
  bool at_start = true;     // the cursor is at the start of a visual line: the prefix is still to come
  bool cr_pending = false;  // the last byte was '\r': a new visual line, unless '\n' follows (CRLF)
  bool redrawn = false;     // the line is being redrawn after a '\r' (a progress bar) since its last '\n'
  // The console ended this open line for its worker (Console::break_line, when another
  // worker wrote): `ended` with a newline, so a '\n' that comes next is written already;
  // `wiped` (a progress bar erased), so what comes next, unless a redraw ('\r'), shows
  // the bar's last state (`shown`) again first.
  bool ended = false;
  bool wiped = false;
  // The text of the current visual line since its prefix, while at most kShownMax bytes
  // (`shown_lost` beyond): what a wiped bar shows again.
  std::string shown;
  bool shown_lost = false;
  static constexpr std::size_t kShownMax = 4096;

  // `text` went out on the current visual line (`fresh`: it starts that line).
  void note_shown(std::string_view text, bool fresh) {
    if (fresh) {
      shown.clear();
      shown_lost = false;
    }
    if (shown_lost) return;
    if (shown.size() + text.size() > kShownMax) {
      shown.clear();
      shown_lost = true;
      return;
    }
    shown.append(text);
  }
};

// Appends to `out` what a terminal gets for `data` from one worker stream, at once (a
// progress bar's "\r50%", a prompt without newline): `prefix` at the start of each
// visual line, that is at the start of a line and after each '\r' that is not part of
// "\r\n"; a '\r' at the start of a line is dropped (the cursor is already there).
// A '\r' at the end of `data` waits for the next piece (it may be a CRLF).
// Without a prefix (raw lines) the bytes go out exactly as they came. Pure.
inline void live_relay(std::string& out, LiveLine& st, std::string_view prefix, std::string_view data) {
  if ((st.ended || st.wiped) && !data.empty()) {
    // The console ended this line when another worker wrote (see LiveLine). A wiped bar's
    // last state comes back unless the worker redraws it; a newline that only ends the
    // line is not written again (it would leave an empty line with the prefix).
    const bool restore = st.wiped && data.front() != '\r' && !st.shown_lost && !st.shown.empty();
    st.ended = st.wiped = false;
    if (restore) {
      out.append(prefix);
      out.append(st.shown);
      st.at_start = false;
    } else if (data.front() == '\n') {
      data.remove_prefix(1);
    }
  }
  if (prefix.empty()) {
    if (data.empty()) return;
    out.append(data);
    const void* nl = ::memrchr(data.data(), '\n', data.size());
    const std::size_t from = nl ? static_cast<std::size_t>(static_cast<const char*>(nl) - data.data()) + 1 : 0;
    if (nl) st.redrawn = false;
    const std::size_t cr = data.rfind('\r');
    if (cr != std::string_view::npos && cr >= from) st.redrawn = true;
    const std::size_t line_from = cr != std::string_view::npos && cr + 1 > from ? cr + 1 : from;
    st.note_shown(data.substr(line_from), line_from > 0 || st.at_start);
    st.at_start = data.back() == '\n';
    return;
  }
  while (!data.empty()) {
    if (st.cr_pending) {
      st.cr_pending = false;
      if (data.front() == '\n') {
        out.append("\r\n");
        st.at_start = true;
        st.redrawn = false;
        data.remove_prefix(1);
        continue;
      }
      out.push_back('\r');
      st.at_start = true;
      st.redrawn = true;
    }
    const auto stop = data.find_first_of("\r\n");
    const std::string_view text = data.substr(0, stop);
    if (!text.empty()) {
      if (st.at_start) out.append(prefix);
      st.note_shown(text, st.at_start);
      st.at_start = false;
      out.append(text);
    }
    if (stop == std::string_view::npos) return;
    if (data[stop] == '\n') {
      if (st.at_start) out.append(prefix);  // an empty line still shows whose it is
      out.push_back('\n');
      st.at_start = true;
      st.redrawn = false;
    } else if (!st.at_start) {
      st.cr_pending = true;
    } else if (stop + 1 == data.size() || data[stop + 1] != '\n') {
      st.redrawn = true;  // "\r" + a bar at the start of a line (tqdm's first draw)
    }
    data.remove_prefix(stop + 1);
  }
}

// The worker's pid in an expanded prefix until the worker runs (replace_prefix_pid): a
// text no template holds (control characters).
inline constexpr std::string_view kPrefixPidMark = "\x1e" "pid" "\x1e";

// torchrun 2.x's --log-line-prefix-template (TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE): Python
// string.Template.safe_substitute with role_name, rank and local_rank (${name} and $name;
// $$ is a '$'; anything else is left as it is). mglaunch adds hostname (this machine's
// host name) and pid (the worker's process id: kPrefixPidMark here, the number once the
// worker runs). Pure.
inline std::string expand_line_prefix(std::string_view tmpl, const std::string& role_name, int rank, int local_rank,
                                      const std::string& hostname = "") {
  const std::pair<std::string_view, std::string> names[] = {{"role_name", role_name},
                                                            {"local_rank", std::to_string(local_rank)},
                                                            {"rank", std::to_string(rank)},
                                                            {"hostname", hostname},
                                                            {"pid", std::string(kPrefixPidMark)}};
  auto is_ident = [](char c, bool first) {
    return c == '_' || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (!first && c >= '0' && c <= '9');
  };
  std::string out;
  for (std::size_t i = 0; i < tmpl.size();) {
    if (tmpl[i] != '$' || i + 1 == tmpl.size()) {
      out.push_back(tmpl[i++]);
      continue;
    }
    if (tmpl[i + 1] == '$') {
      out.push_back('$');
      i += 2;
      continue;
    }
    std::string_view name;
    std::size_t end = i + 1;
    if (tmpl[i + 1] == '{') {
      const auto close = tmpl.find('}', i + 2);
      if (close != std::string_view::npos) {
        name = tmpl.substr(i + 2, close - i - 2);
        end = close + 1;
      }
    } else {
      std::size_t j = i + 1;
      while (j < tmpl.size() && is_ident(tmpl[j], j == i + 1)) ++j;
      name = tmpl.substr(i + 1, j - i - 1);
      end = j;
    }
    const std::string* value = nullptr;
    for (const auto& [n, v] : names)
      if (n == name) value = &v;
    if (value && !name.empty()) {
      out.append(*value);
      i = end;
    } else {
      out.push_back(tmpl[i++]);  // safe_substitute: left as it is
    }
  }
  return out;
}

// `prefix` (from expand_line_prefix) with the worker's pid in place of kPrefixPidMark.
inline std::string replace_prefix_pid(std::string prefix, long pid) {
  for (auto at = prefix.find(kPrefixPidMark); at != std::string::npos; at = prefix.find(kPrefixPidMark, at))
    prefix.replace(at, kPrefixPidMark.size(), std::to_string(pid));
  return prefix;
}

}  // namespace mg
