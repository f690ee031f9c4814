#include "process/watchdog.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/random.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <optional>
#include <set>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "process/proc.h"
#include "process/spawn.h"

extern char** environ;

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

namespace {

// The byte the agent writes before closing the pipe when nothing of its tree is left.
constexpr char kCleanExit = 'C';
// The byte the agent writes before closing the pipe otherwise: it is alive and sees to its
// temporary directory itself. End of file without either: the agent died.
constexpr char kAgentEnds = 'E';
constexpr const char* kTokenVar = "MGLAUNCH_WATCHDOG_TOKEN";
constexpr std::size_t kMaxProcs = 1 << 16;

// A process as the watchdog knows it: with its start time, (pid, starttime) names it.
struct Entry {
  long pid = 0, ppid = 0, pgrp = 0;
  unsigned long long starttime = 0;
  char state = '?';
};
using Id = std::pair<long, unsigned long long>;

// One run of the watchdog (watchdog_main): the agent's last snapshot, the victims.
class Watch {
 public:
  Watch(Entry agent, std::vector<Entry> ancestors, std::string token, std::size_t cap, int trace_fd)
      : agent_(agent), ancestors_(std::move(ancestors)), token_(std::move(token)), cap_(cap), trace_fd_(trace_fd) {}

  // Snapshots until the agent goes; true when it said there is nothing to sweep.
  bool watch_agent(int pipe_fd, bool& agent_ends);
  // Stops every victim (rescanning until none is new), then kills them all.
  void sweep();
  void trace(std::string_view what, long n) const {
    if (trace_fd_ < 0) return;
    const std::string line = fmt::format("{} {}\n", what, n);
    [[maybe_unused]] ssize_t w = ::write(trace_fd_, line.data(), line.size());
  }

 private:
  void scan();
  std::vector<Entry> descendants(const std::unordered_set<long>& roots) const;
  void take_snapshot();
  bool in_snapshot(const Entry& e) const { return snapshot_ids_.count({e.pid, e.starttime}) > 0; }
  const Entry* find_in_table(long pid) const {
    auto it = by_pid_.find(pid);
    return it == by_pid_.end() ? nullptr : &table_[it->second];
  }
  bool is_ancestor_of_agent(const Entry& e) const {
    return std::any_of(ancestors_.begin(), ancestors_.end(),
                       [&](const Entry& a) { return a.pid == e.pid && a.starttime == e.starttime; });
  }
  bool fresh_orphan_of_agent(const Entry& e) const;
  bool carries_mark(const Entry& e);
  std::size_t stop_new_victims();
  void say_overflow(const char* what);

  const Entry agent_;
  const std::vector<Entry> ancestors_;  // the agent and its ancestors at the start
  const std::string token_;
  const std::size_t cap_;
  const int trace_fd_;
  const long self_ = ::getpid();
  std::vector<Entry> table_;  // the processes /proc shows (no zombie, no kernel thread)
  std::unordered_map<long, std::size_t> by_pid_;
  std::vector<Entry> snapshot_, previous_;  // the agent's descendants at the last snapshot, and the one before
  std::set<Id> snapshot_ids_, previous_ids_;
  unsigned long long fresh_after_ = 0;  // processes started after this tick cannot be in the snapshot
  std::vector<Entry> victims_;
  std::set<Id> victim_ids_;
  std::size_t skipped_d_ = 0;  // fresh processes whose environ was not read (state D)
  bool overflow_said_ = false;

};

// Says once on the agent's stderr that a table is full (skipped when stderr would block,
// so a full pipe cannot hold the watchdog up).
void Watch::say_overflow(const char* what) {
  if (overflow_said_) return;
  overflow_said_ = true;
  const std::string line = fmt::format(
      "mglaunch: warning: watchdog: more than {} {}; the ones beyond are not watched and may outlive the agent\n", cap_,
      what);
  pollfd out{STDERR_FILENO, POLLOUT, 0};
  if (::poll(&out, 1, 0) == 1 && (out.revents & POLLOUT))
    [[maybe_unused]] ssize_t w = ::write(STDERR_FILENO, line.data(), line.size());
}

void Watch::scan() {
  table_.clear();
  by_pid_.clear();
  for (const auto& st : scan_processes()) {
    // pid 2 may be ours in a pid namespace: kernel threads by their flag.
    if (st.state == 'Z' || (st.flags & kPfKthread)) continue;  // dead already, or a kernel thread
    if (table_.size() >= cap_) {
      say_overflow("processes on this machine");
      break;
    }
    by_pid_[st.pid] = table_.size();
    table_.push_back(Entry{st.pid, st.ppid, st.pgrp, st.starttime, st.state});
  }
}

// The processes of the table below one of `roots` (roots excluded).
std::vector<Entry> Watch::descendants(const std::unordered_set<long>& roots) const {
  std::unordered_map<long, std::vector<std::size_t>> children;
  for (std::size_t i = 0; i < table_.size(); ++i) children[table_[i].ppid].push_back(i);
  std::vector<Entry> out;
  std::unordered_set<long> seen(roots.begin(), roots.end());
  std::vector<long> stack(roots.begin(), roots.end());
  while (!stack.empty()) {
    const long p = stack.back();
    stack.pop_back();
    auto it = children.find(p);
    if (it == children.end()) continue;
    for (std::size_t i : it->second)
      if (seen.insert(table_[i].pid).second) {
        stack.push_back(table_[i].pid);
        out.push_back(table_[i]);
      }
  }
  return out;
}

void Watch::take_snapshot() {
  scan();
  snapshot_.clear();
  snapshot_ids_.clear();
  for (const auto& e : descendants({agent_.pid}))
    if (e.pid != self_) {
      snapshot_.push_back(e);
      snapshot_ids_.insert({e.pid, e.starttime});
    }
}

// A fresh process (started after the last snapshot) may be ours only when, going up
// through fresh processes, the first one that is not fresh is where the agent's orphans
// land (one of the agent's ancestors: init or a subreaper above it). A fresh child of a
// spared stranger that copied the token (its first older ancestor is the stranger) is not.
// Descendants of snapshot processes and victims are found by descendants() anyway.
bool Watch::fresh_orphan_of_agent(const Entry& e) const {
  const Entry* cur = &e;
  for (int depth = 0; depth < 64; ++depth) {
    const Entry* parent = find_in_table(cur->ppid);
    if (!parent) return false;  // its parent is gone or was not listed (a full table)
    if (parent->starttime < fresh_after_) return is_ancestor_of_agent(*parent);
    cur = parent;
  }
  return false;
}

bool Watch::carries_mark(const Entry& e) {
  // Reading /proc/PID/environ takes the process's memory-map lock: a process in state D
  // may hold it (or wait behind a holder) for ever, and the watchdog must not hang there.
  if (e.state == 'D') {
    ++skipped_d_;
    return false;
  }
  return environ_has_mark(read_proc_environ(static_cast<pid_t>(e.pid)), token_);
}

// One pass: finds the victims /proc shows now (see the header), SIGSTOPs the new ones and
// returns how many new ones it found.
std::size_t Watch::stop_new_victims() {
  scan();
  // Known victims and the snapshot's processes (still the same ones) seed the set.
  std::unordered_set<long> marked;
  for (const auto& e : table_)
    if (e.pid != self_ && (victim_ids_.count({e.pid, e.starttime}) || in_snapshot(e))) marked.insert(e.pid);
  for (const auto& e : descendants(marked)) marked.insert(e.pid);
  // Then fresh processes that carry the token and are orphans of the agent's tree.
  std::unordered_set<long> fresh;
  for (const auto& e : table_) {
    if (e.pid == self_ || marked.count(e.pid) || e.starttime < fresh_after_) continue;
    if (fresh_orphan_of_agent(e) && carries_mark(e)) fresh.insert(e.pid);
  }
  if (!fresh.empty()) {
    marked.insert(fresh.begin(), fresh.end());
    for (const auto& e : descendants(fresh)) marked.insert(e.pid);
  }
  std::size_t found = 0;
  for (const auto& e : table_) {
    if (e.pid == self_ || !marked.count(e.pid) || victim_ids_.count({e.pid, e.starttime})) continue;
    if (victims_.size() >= cap_ || victims_.size() >= kMaxProcs) {
      say_overflow("processes to stop");
      break;
    }
    // Stopped only while it is still the process the scan saw (a pidfd pins it).
    if (signal_same_process(e.pid, e.starttime, SIGSTOP) == 0) continue;  // gone, or its pid reused
    victims_.push_back(e);
    victim_ids_.insert({e.pid, e.starttime});
    ++found;
  }
  return found;
}

unsigned long long boot_ticks(long ticks_per_second) {
  timespec ts{};
  ::clock_gettime(CLOCK_BOOTTIME, &ts);
  return static_cast<unsigned long long>(ts.tv_sec) * static_cast<unsigned long long>(ticks_per_second) +
         static_cast<unsigned long long>(ts.tv_nsec) / (1000000000ULL / static_cast<unsigned long long>(ticks_per_second));
}

void sleep_ms(long ms) {
  timespec ts{ms / 1000, (ms % 1000) * 1000000};
  ::nanosleep(&ts, nullptr);
}

bool Watch::watch_agent(int pipe_fd, bool& agent_ends) {
  long ticks_per_second = ::sysconf(_SC_CLK_TCK);
  if (ticks_per_second <= 0) ticks_per_second = 100;
  fresh_after_ = agent_.starttime;
  long generation = 0;
  int interval_ms = 1000;
  for (;;) {
    pollfd p{pipe_fd, POLLIN, 0};
    const int r = ::poll(&p, 1, interval_ms);
    if (r < 0 && errno == EINTR) continue;
    if (r > 0) {
      char buf[64];
      const ssize_t n = ::read(pipe_fd, buf, sizeof(buf));
      if (n == 0) return false;  // end of file: the agent is gone
      if (n > 0 && std::memchr(buf, kCleanExit, static_cast<std::size_t>(n))) return true;  // nothing left to kill
      if (n > 0 && std::memchr(buf, kAgentEnds, static_cast<std::size_t>(n))) agent_ends = true;
      if (n < 0 && errno != EINTR && errno != EAGAIN) sleep_ms(100);  // not a reason to kill a live run
      continue;
    }
    if (r < 0) {
      sleep_ms(100);
      continue;
    }
    // A snapshot; the next one waits at least 50 times as long as this one took.
    const unsigned long long before = boot_ticks(ticks_per_second);
    const auto t0 = std::chrono::steady_clock::now();
    previous_ = snapshot_;
    previous_ids_ = snapshot_ids_;
    take_snapshot();
    const auto took_ms = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0).count();
    // The agent may have died during the scan: its children were handed on, so this
    // snapshot would miss them. Keep the last one (and its tick) then.
    pollfd after{pipe_fd, POLLIN, 0};
    if (::poll(&after, 1, 0) > 0) {
      snapshot_ = std::move(previous_);
      snapshot_ids_ = std::move(previous_ids_);
      continue;  // the read above tells a byte from end-of-file
    }
    fresh_after_ = before > 0 ? before - 1 : 0;
    interval_ms = took_ms * 50 > 1000 ? static_cast<int>(std::min<long>(took_ms * 50, 30000)) : 1000;
    trace("snapshot", ++generation);
  }
}

void Watch::sweep() {
  // Stop every victim, rescanning until none is new (bounded), then kill them all.
  std::size_t stopped = 0;
  for (int round = 0; round < 50; ++round) {
    const std::size_t found = stop_new_victims();
    stopped += found;
    if (found == 0) break;
  }
  trace("stopped", static_cast<long>(stopped));
  if (skipped_d_ > 0) trace("environ not read (state D)", static_cast<long>(skipped_d_));
  for (int round = 0; round < 100; ++round) {
    std::size_t alive = 0;
    for (const auto& v : victims_) {
      const auto st = read_proc_stat(static_cast<pid_t>(v.pid));
      if (!st || st->starttime != v.starttime || st->state == 'Z') continue;  // gone (or its pid reused)
      ++alive;
      // Its group too, when the group's leader is a victim (e.g. a worker's group) and still
      // alive, through the leader's pidfd (ProcessGroup): the watchdog is not the leader's
      // parent and cannot keep its zombie, so a kill(-pgrp) after the check could reach a
      // group that took the id once the leader was reaped.
      if (st->pgrp > 1 && st->pgrp == v.pid)
        if (const auto group = ProcessGroup::open(st->pid, st->starttime)) group->signal(SIGKILL);
      signal_same_process(v.pid, v.starttime, SIGKILL);
    }
    trace("kill round alive", static_cast<long>(alive));
    if (alive == 0) break;
    sleep_ms(20);
  }
}

// "PID:START" -> an entry; nullopt when malformed.
std::optional<Entry> parse_id(std::string_view text) {
  const auto colon = text.find(':');
  if (colon == std::string_view::npos) return std::nullopt;
  Entry e;
  auto a = std::from_chars(text.data(), text.data() + colon, e.pid);
  auto b = std::from_chars(text.data() + colon + 1, text.data() + text.size(), e.starttime);
  if (a.ec != std::errc{} || a.ptr != text.data() + colon || b.ec != std::errc{} || b.ptr != text.data() + text.size() ||
      e.pid <= 0)
    return std::nullopt;
  return e;
}

std::string g_tree;  // the agent's temporary directory (set_temporary_tree); "" for none

}  // namespace

int watchdog_main(int argc, char** argv) {
  ::prctl(PR_SET_NAME, "mglaunch-watch");
  for (int sig : {SIGINT, SIGHUP, SIGTERM, SIGQUIT, SIGTSTP, SIGTTIN, SIGTTOU, SIGPIPE, SIGUSR1, SIGUSR2})
    ::signal(sig, SIG_IGN);
  std::optional<Entry> agent;
  std::vector<Entry> ancestors;
  std::string tree;
  for (int i = 2; i + 1 < argc; i += 2) {
    const std::string_view flag = argv[i];
    if (flag == "--agent") {
      agent = parse_id(argv[i + 1]);
    } else if (flag == "--ancestor") {
      if (auto e = parse_id(argv[i + 1])) ancestors.push_back(*e);
    } else if (flag == "--tree") {
      tree = argv[i + 1];
    }
  }
  const char* token = std::getenv(kTokenVar);
  if (!agent || !token || !*token) {
    fmt::print(stderr, "mglaunch: error: the watchdog mode is started by mglaunch itself (--agent PID:START, {})\n",
               kTokenVar);
    return 2;
  }
  int trace_fd = -1;
  if (const char* path = std::getenv("MGLAUNCH_WATCHDOG_TRACE"); path && *path)
    trace_fd = ::open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  std::size_t cap = kMaxProcs;
  if (const char* v = std::getenv("MGLAUNCH_WATCHDOG_MAX_PROCS"); v && *v) {
    char* end = nullptr;
    const unsigned long n = std::strtoul(v, &end, 10);
    if (*end == '\0' && n >= 1 && n < kMaxProcs) cap = n;
  }
  Watch watch(*agent, std::move(ancestors), token, cap, trace_fd);
  bool agent_ends = false;  // the agent said it sees to its temporary directory
  if (watch.watch_agent(STDIN_FILENO, agent_ends)) return 0;
  watch.sweep();
  // The agent died (kill -9): its temporary directory, which nobody was told of, goes too.
  // remove_all removes a symbolic link, never what it points to.
  if (!agent_ends && !tree.empty()) {
    std::error_code ec;
    std::filesystem::remove_all(tree, ec);
    watch.trace("temporary directory removed", 1);
  }
  return 0;
}

bool Watchdog::start(std::string& error, const char* program) {
  unsigned char raw[16];
  if (::getrandom(raw, sizeof(raw), 0) != static_cast<ssize_t>(sizeof(raw))) {
    error = fmt::format("getrandom: {}", std::strerror(errno));
    return false;
  }
  token_.clear();
  for (unsigned char c : raw) token_ += fmt::format("{:02x}", c);
  // The agent and its ancestors up to pid 1 (where its orphans land after it).
  std::vector<std::string> args{"mglaunch-watch", kWatchdogMode};
  for (pid_t pid = ::getpid(); pid > 0 && args.size() < 2 + 2 * 64;) {
    const auto st = read_proc_stat(pid);
    if (!st) break;
    if (pid == ::getpid()) args.insert(args.end(), {"--agent", fmt::format("{}:{}", st->pid, st->starttime)});
    args.insert(args.end(), {"--ancestor", fmt::format("{}:{}", st->pid, st->starttime)});
    if (st->pid == 1) break;
    pid = st->ppid;
  }
  if (!g_tree.empty()) args.insert(args.end(), {"--tree", g_tree});
  std::vector<const char*> argv;
  for (const auto& a : args) argv.push_back(a.c_str());
  argv.push_back(nullptr);
  const std::string token_env = fmt::format("{}={}", kTokenVar, token_);
  std::vector<const char*> envp;
  for (char** e = environ; e && *e; ++e)  // an inherited token (an outer agent's watchdog) is replaced
    if (!std::string_view(*e).starts_with(std::string(kTokenVar) + "=")) envp.push_back(*e);
  envp.push_back(token_env.c_str());
  envp.push_back(nullptr);
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) {
    error = fmt::format("pipe: {}", std::strerror(errno));
    return false;
  }
  const int devnull = ::open("/dev/null", O_WRONLY | O_CLOEXEC);
  SpawnRequest req;
  req.path = program;
  req.argv = argv.data();
  req.envp = envp.data();
  req.fds[0] = fds[0];  // its stdin: the end of file that says the agent is gone
  req.fds[1] = devnull;
  req.fds[2] = -1;  // the agent's stderr, for the one overflow warning
  req.own_group = true;          // no terminal signal reaches it
  req.die_with_parent = false;   // it outlives the agent by design
  SpawnError spawn_error;
  const pid_t pid = devnull < 0 ? -1 : spawn_process(req, spawn_error);
  if (devnull < 0) spawn_error = {"open /dev/null", errno};
  ::close(fds[0]);
  if (devnull >= 0) ::close(devnull);
  if (pid < 0) {
    ::close(fds[1]);
    error = spawn_error.message();
    return false;
  }
  pid_ = pid;
  pipe_fd_ = fds[1];
  return true;
}

std::string Watchdog::mark_value(const std::string& inherited) const {
  return inherited.empty() ? token_ : inherited + "," + token_;
}

void Watchdog::set_temporary_tree(std::string_view path) { g_tree = path; }

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
      sleep_ms(5);
    }
  }
  if (pidfd >= 0) ::close(pidfd);
  pid_ = -1;
}

}  // namespace mg
