#include "launcher/watchdog.h"

#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/random.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string_view>
#include <utility>

#include <fmt/format.h>

#include "process/dirents.h"


extern "C" char _end[];  // the end of the program's .data and .bss (the linker's symbol)

namespace mg {

bool environ_has_mark(std::string_view environ, std::string_view token) {
  if (token.empty()) return false;
  constexpr std::string_view key = "MGLAUNCH_RUN_MARK=";
  while (!environ.empty()) {
    std::size_t end = environ.find('\0');
    std::string_view entry = environ.substr(0, end);
    if (entry.substr(0, key.size()) == key && entry.substr(key.size()).find(token) != std::string_view::npos)
      return true;
    if (end == std::string_view::npos) break;
    environ.remove_prefix(end + 1);
  }
  return false;
}

bool parse_stat_ids(std::string_view text, StatIds& out) {
  // "pid (comm) S ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime
  //  stime cutime cstime priority nice threads itrealvalue starttime ...": comm is
  // everything up to the LAST ')'.
  const auto open = text.find('(');
  const auto close = text.rfind(')');
  if (open == std::string_view::npos || close == std::string_view::npos || close < open) return false;
  auto number = [](std::string_view& t, unsigned long long& v, bool& neg) {
    while (!t.empty() && t.front() == ' ') t.remove_prefix(1);
    neg = !t.empty() && t.front() == '-';
    if (neg) t.remove_prefix(1);
    if (t.empty() || t.front() < '0' || t.front() > '9') return false;
    v = 0;
    while (!t.empty() && t.front() >= '0' && t.front() <= '9') {
      if (v > (~0ULL - 9) / 10) return false;
      v = v * 10 + static_cast<unsigned>(t.front() - '0');
      t.remove_prefix(1);
    }
    return true;
  };
  unsigned long long v = 0;
  bool neg = false;
  std::string_view head = text.substr(0, open);
  if (!number(head, v, neg) || neg || v == 0 || v > (1U << 30)) return false;
  out.pid = static_cast<long>(v);
  std::string_view rest = text.substr(close + 1);
  while (!rest.empty() && rest.front() == ' ') rest.remove_prefix(1);
  if (rest.empty()) return false;
  out.state = rest.front();
  rest.remove_prefix(1);
  for (int field = 4; field <= 22; ++field) {
    if (!number(rest, v, neg)) return false;
    if (field == 4) out.ppid = neg ? -1 : static_cast<long>(v);
    if (field == 5) out.pgrp = neg ? -1 : static_cast<long>(v);
    if (field == 9) out.flags = v;
    if (field == 22) out.starttime = v;
  }
  return true;
}

std::pair<std::uintptr_t, std::uintptr_t> heap_range_in(std::string_view maps, std::uintptr_t data_end,
                                                        std::uintptr_t page) {
  const std::uintptr_t floor = page > 0 ? (data_end + page - 1) / page * page : data_end;
  for (std::size_t pos = 0; pos < maps.size();) {
    std::size_t nl = maps.find('\n', pos);
    if (nl == std::string_view::npos) nl = maps.size();
    const std::string_view line = maps.substr(pos, nl - pos);
    pos = nl + 1;
    if (!line.ends_with("[heap]")) continue;
    std::uintptr_t lo = 0, hi = 0;
    const char* p = line.data();
    const char* end = line.data() + line.size();
    auto hex = [&](std::uintptr_t& v) {
      const auto r = std::from_chars(p, end, v, 16);
      p = r.ptr;
      return r.ec == std::errc();
    };
    if (!hex(lo) || p == end || *p++ != '-' || !hex(hi) || lo >= hi) return {0, 0};
    lo = std::max(lo, floor);  // never the program's own data, which the watchdog uses
    if (lo < hi) return {lo, hi};
  }
  return {0, 0};
}

namespace {

// Reads up to `cap` bytes of `path` into buf; -1 when it cannot be opened.
long read_small(const char* path, char* buf, std::size_t cap) {
  const int fd = ::open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return -1;
  std::size_t got = 0;
  while (got < cap) {
    const ssize_t n = ::read(fd, buf + got, cap - got);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    got += static_cast<std::size_t>(n);
  }
  ::close(fd);
  return static_cast<long>(got);
}

// Writes "/proc/<pid>/<leaf>" into out (no allocation).
void proc_path(char* out, long pid, const char* leaf) {
  char digits[24];
  int n = 0;
  do {
    digits[n++] = static_cast<char>('0' + pid % 10);
    pid /= 10;
  } while (pid > 0 && n < 20);
  char* p = out;
  for (const char* s = "/proc/"; *s;) *p++ = *s++;
  while (n > 0) *p++ = digits[--n];
  *p++ = '/';
  for (const char* s = leaf; *s;) *p++ = *s++;
  *p = '\0';
}

// Appends text to the trace descriptor, if any (system calls only).
void trace(int fd, const char* what, long n) {
  if (fd < 0) return;
  char line[96];
  char* p = line;
  for (const char* s = what; *s && p < line + 60;) *p++ = *s++;
  *p++ = ' ';
  char digits[24];
  int k = 0;
  do {
    digits[k++] = static_cast<char>('0' + n % 10);
    n /= 10;
  } while (n > 0 && k < 20);
  while (k > 0) *p++ = digits[--k];
  *p++ = '\n';
  [[maybe_unused]] ssize_t w = ::write(fd, line, static_cast<std::size_t>(p - line));
}

// All tables are static: the child of a threaded process may not allocate. fork gives
// the watchdog its own copy; the agent never touches them (no cost to its memory).
constexpr long kMaxPid = 1L << 22;  // the kernel's PID_MAX_LIMIT
constexpr std::size_t kMaxProcs = 1 << 16;
struct Entry {
  long pid, ppid, pgrp;
  unsigned long long starttime;
  char state;
};
Entry g_table[kMaxProcs];      // the processes /proc shows, in the order it lists them
std::size_t g_count = 0;
bool g_table_sorted = true;    // by pid (/proc lists them so in practice)
std::size_t g_cap = kMaxProcs;  // MGLAUNCH_WATCHDOG_MAX_PROCS (a test seam) may lower it
int g_err_fd = -1;              // the agent's stderr, for the one overflow warning
bool g_overflow_said = false;
std::size_t g_skipped_d = 0;    // fresh processes whose environ was not read (state D)
// The agent and its ancestors when the watchdog started (pid and start time): the agent's
// orphans are its children while it lives (it is a subreaper) and land on one of its
// ancestors when it dies (init or a subreaper above it).
constexpr std::size_t kMaxAncestors = 64;
Entry g_ancestors[kMaxAncestors];
std::size_t g_ancestor_count = 0;
Entry g_snapshot[kMaxProcs];  // the agent's descendants at the last snapshot, by pid
std::size_t g_snapshot_count = 0;
bool g_snapshot_sorted = true;
Entry g_previous[kMaxProcs];  // the snapshot before, restored when the agent died during a scan
std::size_t g_previous_count = 0;
bool g_previous_sorted = true;
unsigned char g_victim[kMaxPid / 8];  // a bit per pid
Entry g_victims[kMaxProcs];           // each victim's identity, to re-check after stops
std::size_t g_victim_count = 0;
PidSet<kMaxProcs * 2> g_victim_set;   // the same victims, for lookups in O(1)
char g_environ_buf[1 << 20];
alignas(8) char g_dents[1 << 15];

bool bit(const unsigned char* bits, long pid) { return pid > 0 && pid < kMaxPid && (bits[pid >> 3] >> (pid & 7)) & 1; }
void set_bit(unsigned char* bits, long pid) {
  if (pid > 0 && pid < kMaxPid) bits[pid >> 3] = static_cast<unsigned char>(bits[pid >> 3] | (1 << (pid & 7)));
}

// Says once on the agent's stderr that a table is full (system calls only; skipped when
// stderr would block, so a full pipe cannot hold the watchdog up).
void say_overflow(const char* what) {
  if (g_overflow_said || g_err_fd < 0) return;
  g_overflow_said = true;
  char line[256];
  char* p = line;
  auto put = [&](const char* t) {
    for (; *t && p < line + sizeof(line) - 24; ++t) *p++ = *t;
  };
  put("mglaunch: warning: watchdog: more than ");
  char digits[24];
  int k = 0;
  std::size_t n = g_cap;
  do {
    digits[k++] = static_cast<char>('0' + n % 10);
    n /= 10;
  } while (n > 0 && k < 20);
  while (k > 0) *p++ = digits[--k];
  put(" ");
  put(what);
  put("; the ones beyond are not watched and may outlive the agent\n");
  pollfd out{g_err_fd, POLLOUT, 0};
  if (::poll(&out, 1, 0) == 1 && (out.revents & POLLOUT))
    [[maybe_unused]] ssize_t w = ::write(g_err_fd, line, static_cast<std::size_t>(p - line));
}

// Reads every process's ids into g_table (zombies and kernel threads are skipped).
void scan() {
  g_count = 0;
  g_table_sorted = true;
  const int dir = ::open("/proc", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir < 0) return;
  for_each_dirent(dir, g_dents, sizeof(g_dents), [](const char* name) {
    if (*name < '1' || *name > '9') return;
    long pid = 0;
    bool numeric = true;
    for (const char* c = name; *c; ++c) {
      if (*c < '0' || *c > '9' || pid >= kMaxPid) {
        numeric = false;
        break;
      }
      pid = pid * 10 + (*c - '0');
    }
    if (!numeric) return;
    if (g_count >= g_cap) {
      say_overflow("processes on this machine");
      return;
    }
    char path[64], stat[1024];
    proc_path(path, pid, "stat");
    const long len = read_small(path, stat, sizeof(stat));
    StatIds ids;
    if (len <= 0 || !parse_stat_ids(std::string_view(stat, static_cast<std::size_t>(len)), ids)) return;
    constexpr unsigned long long kPfKthread = 0x00200000;  // pid 2 may be ours in a pid namespace
    if (ids.state == 'Z' || (ids.flags & kPfKthread)) return;  // dead already, or a kernel thread
    if (g_count > 0 && g_table[g_count - 1].pid > ids.pid) g_table_sorted = false;
    g_table[g_count++] = Entry{ids.pid, ids.ppid, ids.pgrp, ids.starttime, ids.state};
  });
  ::close(dir);
}

// Marks in `bits` every process of g_table below one already marked; bounded passes.
void close_under(unsigned char* bits) {
  for (int pass = 0; pass < 256; ++pass) {
    bool changed = false;
    for (std::size_t i = 0; i < g_count; ++i)
      if (!bit(bits, g_table[i].pid) && bit(bits, g_table[i].ppid)) {
        set_bit(bits, g_table[i].pid);
        changed = true;
      }
    if (!changed) break;
  }
}

void clear_bits(unsigned char* bits, const Entry* entries, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i)
    if (entries[i].pid > 0 && entries[i].pid < kMaxPid) bits[entries[i].pid >> 3] = 0;
}

// The agent's descendants now, into g_snapshot (g_victim is scratch space here).
void take_snapshot(long agent, long self) {
  scan();
  set_bit(g_victim, agent);
  close_under(g_victim);
  g_snapshot_count = 0;
  g_snapshot_sorted = true;
  for (std::size_t i = 0; i < g_count; ++i) {
    const Entry& e = g_table[i];
    if (e.pid == self || e.pid == agent || !bit(g_victim, e.pid)) continue;
    if (g_snapshot_count > 0 && g_snapshot[g_snapshot_count - 1].pid > e.pid) g_snapshot_sorted = false;
    g_snapshot[g_snapshot_count++] = e;
  }
  clear_bits(g_victim, g_table, g_count);
  if (agent > 0 && agent < kMaxPid) g_victim[agent >> 3] = 0;
}

bool in_snapshot(const Entry& e) {
  if (g_snapshot_sorted) {
    std::size_t lo = 0, hi = g_snapshot_count;
    while (lo < hi) {
      const std::size_t mid = lo + (hi - lo) / 2;
      if (g_snapshot[mid].pid < e.pid)
        lo = mid + 1;
      else
        hi = mid;
    }
    return lo < g_snapshot_count && g_snapshot[lo].pid == e.pid && g_snapshot[lo].starttime == e.starttime;
  }
  for (std::size_t i = 0; i < g_snapshot_count; ++i)
    if (g_snapshot[i].pid == e.pid) return g_snapshot[i].starttime == e.starttime;
  return false;
}

// The entry of `pid` in g_table, or nullptr.
const Entry* find_in_table(long pid) {
  if (g_table_sorted) {
    std::size_t lo = 0, hi = g_count;
    while (lo < hi) {
      const std::size_t mid = lo + (hi - lo) / 2;
      if (g_table[mid].pid < pid)
        lo = mid + 1;
      else
        hi = mid;
    }
    return lo < g_count && g_table[lo].pid == pid ? &g_table[lo] : nullptr;
  }
  for (std::size_t i = 0; i < g_count; ++i)
    if (g_table[i].pid == pid) return &g_table[i];
  return nullptr;
}

bool is_ancestor_of_agent(const Entry& e) {
  for (std::size_t i = 0; i < g_ancestor_count; ++i)
    if (g_ancestors[i].pid == e.pid && g_ancestors[i].starttime == e.starttime) return true;
  return false;
}

// A fresh process (started after the last snapshot) may be ours only when, going up
// through fresh processes, the first one that is not fresh is where the agent's orphans
// land (one of the agent's ancestors: init or a subreaper above it). A fresh child of a
// spared stranger that copied the token (its first older ancestor is the stranger) is not.
// Descendants of snapshot processes and victims are found by close_under() anyway.
bool fresh_orphan_of_agent(const Entry& e, unsigned long long fresh_after) {
  const Entry* cur = &e;
  for (int depth = 0; depth < 64; ++depth) {
    const Entry* parent = find_in_table(cur->ppid);
    if (!parent) return false;  // its parent is gone or was not listed (a full table)
    if (parent->starttime < fresh_after) return is_ancestor_of_agent(*parent);
    cur = parent;
  }
  return false;
}

bool carries_mark(const Entry& e, std::string_view token) {
  // Reading /proc/PID/environ takes the process's memory-map lock: a process in state D
  // may hold it (or wait behind a holder) for ever, and the watchdog must not hang there.
  if (e.state == 'D') {
    ++g_skipped_d;
    return false;
  }
  char path[64];
  proc_path(path, e.pid, "environ");
  const long len = read_small(path, g_environ_buf, sizeof(g_environ_buf));
  return len > 0 && environ_has_mark(std::string_view(g_environ_buf, static_cast<std::size_t>(len)), token);
}

bool is_victim(const Entry& e) { return g_victim_set.contains(e.pid, e.starttime); }

// One pass: finds the victims /proc shows now (see the header), SIGSTOPs the new ones and
// returns how many new ones it found.
std::size_t stop_new_victims(long self, std::string_view token, unsigned long long fresh_after) {
  scan();
  // Known victims and the snapshot's processes (still the same ones) seed the set.
  for (std::size_t i = 0; i < g_count; ++i) {
    const Entry& e = g_table[i];
    if (e.pid == self) continue;
    if (is_victim(e) || in_snapshot(e)) set_bit(g_victim, e.pid);
  }
  close_under(g_victim);
  // Then fresh processes that carry the token and are orphans of the agent's tree.
  bool more = false;
  for (std::size_t i = 0; i < g_count; ++i) {
    const Entry& e = g_table[i];
    if (e.pid == self || bit(g_victim, e.pid) || e.starttime < fresh_after) continue;
    if (fresh_orphan_of_agent(e, fresh_after) && carries_mark(e, token)) {
      set_bit(g_victim, e.pid);
      more = true;
    }
  }
  if (more) close_under(g_victim);
  std::size_t found = 0;
  for (std::size_t i = 0; i < g_count; ++i) {
    const Entry& e = g_table[i];
    if (e.pid == self || !bit(g_victim, e.pid) || is_victim(e)) continue;
    if (g_victim_count == g_cap || g_victim_count == kMaxProcs) {
      say_overflow("processes to stop");
      break;
    }
    // Stopped only while it is still the process the scan saw (a pidfd pins it).
    if (signal_same_process(e.pid, e.starttime, SIGSTOP) == 0) continue;  // gone, or its pid reused
    g_victims[g_victim_count++] = e;
    g_victim_set.insert(e.pid, e.starttime);
    ++found;
  }
  clear_bits(g_victim, g_table, g_count);
  return found;
}

unsigned long long boot_ticks(long ticks_per_second) {
  timespec ts{};
  ::clock_gettime(CLOCK_BOOTTIME, &ts);
  return static_cast<unsigned long long>(ts.tv_sec) * static_cast<unsigned long long>(ticks_per_second) +
         static_cast<unsigned long long>(ts.tv_nsec) / (1000000000ULL / static_cast<unsigned long long>(ticks_per_second));
}

// The byte the agent writes before closing the pipe when nothing of its tree is left.
constexpr char kCleanExit = 'C';
// The byte the agent writes before closing the pipe otherwise: it is alive and sees to its
// temporary directory itself. End of file without either: the agent died.
constexpr char kAgentEnds = 'E';

char g_tree[4096];  // the agent's temporary directory, removed when the agent dies; "" for none

// Removes the directory tree at `dir` (an open directory; `depth` levels further at most),
// with system calls only, never following a symbolic link.
void remove_entries(int dir, int depth) {
  alignas(8) char buf[4096];
  for (int pass = 0; pass < 64; ++pass) {  // getdents after unlinks: rescan until empty
    bool any = false;
    ::lseek(dir, 0, SEEK_SET);
    for_each_dirent(dir, buf, sizeof(buf), [&](const char* name) {
      if (std::strcmp(name, ".") == 0 || std::strcmp(name, "..") == 0) return;
      any = true;
      if (::unlinkat(dir, name, 0) == 0 || errno == ENOENT) return;
      if (depth <= 0) return;
      const int sub = ::openat(dir, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
      if (sub < 0) return;
      remove_entries(sub, depth - 1);
      ::close(sub);
      ::unlinkat(dir, name, AT_REMOVEDIR);
    });
    if (!any) return;
  }
}

void remove_tree(const char* path) {
  const int dir = ::open(path, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (dir < 0) return;
  remove_entries(dir, 8);
  ::close(dir);
  ::rmdir(path);
}

struct WatchArgs {
  int pipe_fd, trace_fd, err_fd;
  std::size_t cap;
  long agent, ticks_per_second;
  unsigned long long agent_start;
  const char* token;
  std::size_t token_len;
};

[[noreturn]] void watchdog_main(const WatchArgs& a) {
  const long self = ::getpid();
  const std::string_view token(a.token, a.token_len);
  g_cap = a.cap;
  g_err_fd = a.err_fd;
  // Processes started after this tick cannot be in the snapshot: the token is believed.
  unsigned long long fresh_after = a.agent_start;
  long generation = 0;
  int interval_ms = 1000;
  bool agent_ends = false;  // the agent said it sees to its temporary directory
  for (;;) {
    pollfd p{a.pipe_fd, POLLIN, 0};
    const int r = ::poll(&p, 1, interval_ms);
    if (r < 0 && errno == EINTR) continue;
    if (r > 0) {
      char buf[64];
      const ssize_t n = ::read(a.pipe_fd, buf, sizeof(buf));
      if (n == 0) break;  // end of file: the agent is gone
      if (n > 0 && std::memchr(buf, kCleanExit, static_cast<std::size_t>(n))) ::_exit(0);  // nothing left to kill
      if (n > 0 && std::memchr(buf, kAgentEnds, static_cast<std::size_t>(n))) agent_ends = true;
      if (n < 0 && errno != EINTR && errno != EAGAIN) {  // not a reason to kill a live run
        timespec ts{0, 100 * 1000 * 1000};
        ::nanosleep(&ts, nullptr);
      }
      continue;
    }
    if (r < 0) {
      timespec ts{0, 100 * 1000 * 1000};
      ::nanosleep(&ts, nullptr);
      continue;
    }
    // A snapshot; the next one waits at least 50 times as long as this one took.
    const unsigned long long before = boot_ticks(a.ticks_per_second);
    timespec t0{}, t1{};
    ::clock_gettime(CLOCK_MONOTONIC, &t0);
    take_snapshot(a.agent, self);
    ::clock_gettime(CLOCK_MONOTONIC, &t1);
    // The agent may have died during the scan: its children were handed on, so this
    // snapshot would miss them. Keep the last one (and its tick) then.
    pollfd after{a.pipe_fd, POLLIN, 0};
    if (::poll(&after, 1, 0) > 0) {
      g_snapshot_count = g_previous_count;
      for (std::size_t i = 0; i < g_previous_count; ++i) g_snapshot[i] = g_previous[i];
      g_snapshot_sorted = g_previous_sorted;
      continue;  // the read above tells a byte from end-of-file
    }
    for (std::size_t i = 0; i < g_snapshot_count; ++i) g_previous[i] = g_snapshot[i];
    g_previous_count = g_snapshot_count;
    g_previous_sorted = g_snapshot_sorted;
    fresh_after = before > 0 ? before - 1 : 0;
    const long took_ms = (t1.tv_sec - t0.tv_sec) * 1000 + (t1.tv_nsec - t0.tv_nsec) / 1000000;
    interval_ms = took_ms * 50 > 1000 ? static_cast<int>(took_ms * 50 < 30000 ? took_ms * 50 : 30000) : 1000;
    trace(a.trace_fd, "snapshot", ++generation);
  }
  // Stop every victim, rescanning until none is new (bounded), then kill them all.
  std::size_t stopped = 0;
  for (int round = 0; round < 50; ++round) {
    const std::size_t found = stop_new_victims(self, token, fresh_after);
    stopped += found;
    if (found == 0) break;
  }
  trace(a.trace_fd, "stopped", static_cast<long>(stopped));
  if (g_skipped_d > 0) trace(a.trace_fd, "environ not read (state D)", static_cast<long>(g_skipped_d));
  for (int round = 0; round < 100; ++round) {
    std::size_t alive = 0;
    for (std::size_t i = 0; i < g_victim_count; ++i) {
      char path[64], stat[1024];
      proc_path(path, g_victims[i].pid, "stat");
      const long len = read_small(path, stat, sizeof(stat));
      StatIds ids;
      if (len <= 0 || !parse_stat_ids(std::string_view(stat, static_cast<std::size_t>(len)), ids)) continue;
      if (ids.starttime != g_victims[i].starttime || ids.state == 'Z') continue;  // gone (or its pid reused)
      ++alive;
      // Its group too, when the group's leader is a victim (e.g. a worker's group) and still
      // alive: a group id cannot be reused while its leader lives.
      if (ids.pgrp > 1 && ids.pgrp == g_victims[i].pid && signal_same_process(ids.pid, ids.starttime, 0) == 1)
        ::kill(static_cast<pid_t>(-ids.pgrp), SIGKILL);
      signal_same_process(g_victims[i].pid, g_victims[i].starttime, SIGKILL);
    }
    trace(a.trace_fd, "kill round alive", static_cast<long>(alive));
    if (alive == 0) break;
    timespec ts{0, 20 * 1000 * 1000};
    ::nanosleep(&ts, nullptr);
  }
  // The agent died (kill -9): its temporary directory, which nobody was told of, goes too.
  if (!agent_ends && g_tree[0] != '\0') {
    remove_tree(g_tree);
    trace(a.trace_fd, "temporary directory removed", 1);
  }
  ::_exit(0);
}

// The start time (clock ticks after boot) of this process, 0 when unknown.
unsigned long long own_starttime() {
  char stat[1024];
  const long len = read_small("/proc/self/stat", stat, sizeof(stat));
  StatIds ids;
  return len > 0 && parse_stat_ids(std::string_view(stat, static_cast<std::size_t>(len)), ids) ? ids.starttime : 0;
}

// [start, end) of the agent's brk heap, from /proc/self/maps; {0, 0} if not found.
std::pair<std::uintptr_t, std::uintptr_t> heap_range() {
  char maps[16384];
  const long len = read_small("/proc/self/maps", maps, sizeof(maps));
  if (len <= 0) return {0, 0};
  return heap_range_in(std::string_view(maps, static_cast<std::size_t>(len)), reinterpret_cast<std::uintptr_t>(_end),
                       static_cast<std::uintptr_t>(::sysconf(_SC_PAGESIZE)));
}

char g_token[128];  // the token, out of the heap the watchdog does not inherit

// The agent and its ancestors up to pid 1 (called in the agent before the fork).
void record_ancestors() {
  g_ancestor_count = 0;
  long pid = ::getpid();
  while (pid > 0 && g_ancestor_count < kMaxAncestors) {
    char path[64], stat[1024];
    proc_path(path, pid, "stat");
    const long len = read_small(path, stat, sizeof(stat));
    StatIds ids;
    if (len <= 0 || !parse_stat_ids(std::string_view(stat, static_cast<std::size_t>(len)), ids)) break;
    g_ancestors[g_ancestor_count++] = Entry{ids.pid, ids.ppid, ids.pgrp, ids.starttime, ids.state};
    if (ids.pid == 1) break;
    pid = ids.ppid;
  }
}

}  // namespace

int signal_same_process(long pid, unsigned long long starttime, int sig, bool use_pidfd) {
  if (pid <= 0) return 0;
  int pidfd = -1;
#ifdef SYS_pidfd_open
  if (use_pidfd) {
    pidfd = static_cast<int>(::syscall(SYS_pidfd_open, static_cast<pid_t>(pid), 0));
    if (pidfd < 0 && errno != ENOSYS) return errno == ESRCH ? 0 : -1;
  }
#endif
  // The pidfd (when there is one) was opened first: if the start time still matches now,
  // it refers to that process, and a signal through it cannot reach a later one.
  char path[64], stat[1024];
  proc_path(path, pid, "stat");
  const long len = read_small(path, stat, sizeof(stat));
  StatIds ids;
  if (len <= 0 || !parse_stat_ids(std::string_view(stat, static_cast<std::size_t>(len)), ids) ||
      ids.starttime != starttime || ids.state == 'Z') {
    if (pidfd >= 0) ::close(pidfd);
    return 0;
  }
#ifdef SYS_pidfd_send_signal
  if (pidfd >= 0) {
    const long r = ::syscall(SYS_pidfd_send_signal, pidfd, sig, nullptr, 0U);
    const int e = errno;
    ::close(pidfd);
    if (r == 0) return 1;
    if (e != ENOSYS) return e == ESRCH ? 0 : -1;
  }
#else
  if (pidfd >= 0) ::close(pidfd);
#endif
  return ::kill(static_cast<pid_t>(pid), sig) == 0 ? 1 : (errno == ESRCH ? 0 : -1);
}

bool Watchdog::start(std::string& error) {
  unsigned char raw[16];
  if (::getrandom(raw, sizeof(raw), 0) != static_cast<ssize_t>(sizeof(raw))) {
    error = fmt::format("getrandom: {}", std::strerror(errno));
    return false;
  }
  token_.clear();
  for (unsigned char c : raw) token_ += fmt::format("{:02x}", c);
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) {
    error = fmt::format("pipe: {}", std::strerror(errno));
    return false;
  }
  const int devnull = ::open("/dev/null", O_RDWR | O_CLOEXEC);
  int trace_fd = -1;
  if (const char* path = std::getenv("MGLAUNCH_WATCHDOG_TRACE"); path && *path)
    trace_fd = ::open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  std::size_t cap = kMaxProcs;
  if (const char* v = std::getenv("MGLAUNCH_WATCHDOG_MAX_PROCS"); v && *v) {
    char* end = nullptr;
    const unsigned long n = std::strtoul(v, &end, 10);
    if (*end == '\0' && n >= 1 && n < kMaxProcs) cap = n;
  }
  record_ancestors();
  const std::size_t token_len = std::min(token_.size(), sizeof(g_token) - 1);
  std::memcpy(g_token, token_.data(), token_len);
  g_token[token_len] = '\0';
  WatchArgs args{fds[0], trace_fd, -1, cap, static_cast<long>(::getpid()), ::sysconf(_SC_CLK_TCK), own_starttime(),
                 g_token, token_len};
  if (args.ticks_per_second <= 0) args.ticks_per_second = 100;
  // The watchdog never reads the agent's heap: it does not inherit it (MADV_DONTFORK), so
  // the fork neither copies nor write-protects those page table entries, and each heap
  // page the agent writes afterwards costs no copy-on-write fault (a page copy and a TLB
  // shootdown of the CPUs running the agent's thread and spawn children). glibc's fork()
  // runs child-side handlers that touch the heap (NSS state): then the raw system call,
  // after which the child makes system calls only, as it does anyway.
  const auto [heap_lo, heap_hi] = heap_range();
  bool no_heap = heap_lo < heap_hi;
  if (no_heap && ::madvise(reinterpret_cast<void*>(heap_lo), heap_hi - heap_lo, MADV_DONTFORK) != 0) {
    // The heap changed meanwhile (trimmed by another thread): whatever part took the
    // advice is inherited again, and glibc's fork() runs as before.
    ::madvise(reinterpret_cast<void*>(heap_lo), heap_hi - heap_lo, MADV_DOFORK);
    no_heap = false;
  }
  // No signal may run the agent's handlers in the child before it resets them.
  sigset_t all, old;
  sigfillset(&all);
  ::pthread_sigmask(SIG_SETMASK, &all, &old);
  const pid_t pid = no_heap ? static_cast<pid_t>(::syscall(SYS_clone, SIGCHLD, 0, 0, 0, 0)) : ::fork();
  if (pid == 0) {
    // Only system calls from here on: the agent has threads.
    ::setpgid(0, 0);
    ::prctl(PR_SET_NAME, "mglaunch-watch");
    for (int sig = 1; sig < NSIG; ++sig)
      if (sig != SIGKILL && sig != SIGSTOP) ::signal(sig, SIG_DFL);
    for (int sig : {SIGINT, SIGHUP, SIGTERM, SIGQUIT, SIGTSTP, SIGTTIN, SIGTTOU, SIGPIPE, SIGUSR1, SIGUSR2})
      ::signal(sig, SIG_IGN);
    sigset_t none;
    sigemptyset(&none);
    ::sigprocmask(SIG_SETMASK, &none, nullptr);
    ::close(fds[1]);  // only the agent may hold the write end: its death is our end-of-file
    const int keep = ::fcntl(fds[0], F_DUPFD, 10);  // out of the way of 0..4
    if (keep < 0) ::_exit(1);
    const int keep_trace = trace_fd >= 0 ? ::fcntl(trace_fd, F_DUPFD, 10) : -1;
    const int keep_err = ::fcntl(STDERR_FILENO, F_DUPFD, 10);  // the agent's stderr, for one warning
    if (devnull >= 0)
      for (int i = 0; i < 2; ++i) ::dup2(devnull, i);
    if (keep_err >= 0) {
      ::dup2(keep_err, STDERR_FILENO);
      args.err_fd = STDERR_FILENO;
    } else if (devnull >= 0) {
      ::dup2(devnull, STDERR_FILENO);
    }
    ::dup2(keep, 3);
    args.pipe_fd = 3;
    args.trace_fd = -1;
    if (keep_trace >= 0) {
      ::dup2(keep_trace, 4);
      args.trace_fd = 4;
    }
    const unsigned first_free = args.trace_fd >= 0 ? 5U : 4U;
    if (::syscall(SYS_close_range, first_free, ~0U, 0U) != 0) {  // before Linux 5.9: one by one
      const int dir = ::open("/proc/self/fd", O_RDONLY | O_DIRECTORY);
      alignas(8) char buf[4096];
      if (dir >= 0) {
        for_each_dirent(dir, buf, sizeof(buf), [dir, first_free](const char* c) {
          int fd = 0;
          if (*c < '0' || *c > '9') return;
          for (; *c >= '0' && *c <= '9'; ++c) fd = fd * 10 + (*c - '0');
          if (fd >= static_cast<int>(first_free) && fd != dir) ::close(fd);
        });
        ::close(dir);
      }
    }
    watchdog_main(args);
  }
  const int fork_errno = errno;
  if (no_heap) ::madvise(reinterpret_cast<void*>(heap_lo), heap_hi - heap_lo, MADV_DOFORK);
  ::pthread_sigmask(SIG_SETMASK, &old, nullptr);
  ::close(fds[0]);
  if (devnull >= 0) ::close(devnull);
  if (trace_fd >= 0) ::close(trace_fd);
  if (pid < 0) {
    error = fmt::format("fork: {}", std::strerror(fork_errno));
    ::close(fds[1]);
    return false;
  }
  pid_ = pid;
  pipe_fd_ = fds[1];
  return true;
}

std::string Watchdog::mark_value(const std::string& inherited) const {
  return inherited.empty() ? token_ : inherited + "," + token_;
}

void Watchdog::set_temporary_tree(std::string_view path) {
  const std::size_t n = path.size() < sizeof(g_tree) ? path.size() : 0;  // too long: none
  std::memcpy(g_tree, path.data(), n);
  g_tree[n] = '\0';
}

void Watchdog::let_go(bool clean) {
  if (pipe_fd_ >= 0) {
    const char c = clean ? kCleanExit : kAgentEnds;
    while (::write(pipe_fd_, &c, 1) < 0 && errno == EINTR) {
    }
    ::close(pipe_fd_);
  }
  pipe_fd_ = -1;
}

void Watchdog::release(bool clean, int wait_ms) {
  let_go(clean);
  if (pid_ <= 0) return;
  // Woken the moment it exits (a pidfd polls readable then); every 5 ms without one.
  const int pidfd = static_cast<int>(::syscall(SYS_pidfd_open, pid_, 0));
  for (int waited = 0; waited <= wait_ms; waited += 5) {
    int status = 0;
    const pid_t r = ::waitpid(pid_, &status, WNOHANG);
    if (r == pid_ || (r < 0 && errno == ECHILD)) break;
    if (pidfd >= 0) {
      pollfd p{pidfd, POLLIN, 0};
      ::poll(&p, 1, 5);
    } else {
      timespec ts{0, 5 * 1000 * 1000};
      ::nanosleep(&ts, nullptr);
    }
  }
  if (pidfd >= 0) ::close(pidfd);
  pid_ = -1;
}

}  // namespace mg
