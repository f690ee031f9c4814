// The FileTimer watchdog of torchrun 2.x (and 1.13): with TORCHELASTIC_ENABLE_FILE_TIMER=1
// in the agent's environment, the agent creates a named pipe (TORCHELASTIC_TIMER_FILE, else
// /tmp/watchdog_timer_<uuid4>), gives its path to the workers, and reads the requests that
// torch's FileTimerClient writes there (torch/distributed/elastic/timer/
// file_based_local_timer.py): one JSON line per request,
//   {"version": 1, "pid": 1234, "scope_id": "step", "expiration_time": 1732.5, "signal": 9}
// where expiration_time is a time.time() (seconds since the epoch) and a negative one
// releases the timer. A worker whose timer expired is sent the timer's signal, as
// FileTimerServer does: per process, the expired timer due first with a signal > 0; a
// process with expired timers but no signal is not reaped; either way its timers go.
//
// parse_request() and Table are pure (tested without a pipe); Server is the pipe on the
// agent's io_context: no thread, no polling (a timer armed at the next expiry).
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include <boost/asio/io_context.hpp>

#include "process/proc.h"

namespace mg::ftimer {

struct Request {
  int version = 1;
  pid_t pid = 0;
  std::string scope_id;
  double expiration_time = 0;  // seconds since the epoch; < 0: release
  int signal = 0;
  // Not on the wire: the start time of `pid` (/proc/PID/stat) when the server admitted the
  // request. (pid, start) names the process: an expired timer reaches no later process
  // given the same pid.
  std::uint64_t start = 0;
};

// One line as FileTimerClient writes it (without its '\n'). Pure. nullopt, with `error`
// saying what is wrong, when it is not such a request.
std::optional<Request> parse_request(std::string_view line, std::string& error);

// A process whose timers expired: the one to reap it by (signal 0: none asked for a
// signal, so it is left alone) and every scope that had expired.
struct Expired {
  pid_t pid = 0;
  std::uint64_t start = 0;  // of the process that set the timers (Request::start)
  int signal = 0;
  std::string scope_id;  // the timer the signal comes from (the first expired one when none)
  double expiration_time = 0;
  std::vector<std::string> scopes;
};

// The timers by (pid, scope), as FileTimerServer keeps them, with bounds torch has not (a
// worker setting timers of ever new scopes must not grow the agent without end). Pure.
class Table {
 public:
  static constexpr std::size_t kMaxPerPid = 1024;
  static constexpr std::size_t kMaxTimers = 65536;
  explicit Table(std::size_t max_per_pid = kMaxPerPid, std::size_t max_timers = kMaxTimers)
      : max_per_pid_(max_per_pid), max_timers_(max_timers) {}
  // Sets the timer, or releases it (expiration_time < 0). false: a new timer over a bound
  // (max_per_pid timers of its pid, or max_timers in all), dropped. A request whose start
  // differs from that of the pid's timers held comes from a later process given that pid:
  // the timers of the one that ended go first.
  bool apply(const Request& r);
  // The processes with a timer due at `now` (expiration_time <= now), ordered by pid; all
  // their timers are dropped, as FileTimerServer's clear_timers does.
  std::vector<Expired> expire(double now);
  // The earliest expiration_time held, nullopt when none. O(1).
  std::optional<double> next_deadline() const;
  // Drops the timers of `pid` (the process ended: nothing to reap any more).
  void forget(pid_t pid);
  void clear() {
    timers_.clear();
    by_deadline_.clear();
    per_pid_.clear();
  }
  std::size_t size() const { return timers_.size(); }
  // The start time of the process whose timers `pid` holds; nullopt when none.
  std::optional<std::uint64_t> start_of(pid_t pid) const {
    auto it = per_pid_.find(pid);
    return it == per_pid_.end() ? std::nullopt : std::optional<std::uint64_t>(it->second.start);
  }

 private:
  void erase(std::map<std::pair<pid_t, std::string>, Request>::iterator it);
  std::size_t max_per_pid_, max_timers_;
  std::map<std::pair<pid_t, std::string>, Request> timers_;
  std::set<std::tuple<double, pid_t, std::string>> by_deadline_;  // the same timers, by expiry
  struct PerPid {
    std::size_t timers = 0;
    std::uint64_t start = 0;
  };
  std::map<pid_t, PerPid> per_pid_;
};

// The processes admitted to hold timers, by pid with their start time, so that a request
// costs one /proc/PID/stat read instead of a walk up the parent chain (the walk happens
// once per process). An entry holds while the same process lives: a request from a later
// process given the pid (another start time) misses. Bounded: when full, the entries of
// processes that ended (per `alive`) go; if none did, the oldest half. Pure.
class AdmissionCache {
 public:
  static constexpr std::size_t kMax = 4096;
  explicit AdmissionCache(std::size_t max = kMax) : max_(max) {}
  bool contains(pid_t pid, std::uint64_t start) const {
    auto it = entries_.find(pid);
    return it != entries_.end() && it->second.start == start;
  }
  // The start time of the worker leader `pid` admitted before (a leader: see add()).
  std::optional<std::uint64_t> leader_start(pid_t pid) const {
    auto it = entries_.find(pid);
    if (it == entries_.end() || !it->second.leader) return std::nullopt;
    return it->second.start;
  }
  // `leader`: a worker itself, which the agent reaps (forget() when it does); its entry is
  // found without reading /proc (leader_start).
  void add(pid_t pid, std::uint64_t start, bool leader, const std::function<bool(pid_t, std::uint64_t)>& alive);
  void forget(pid_t pid) { entries_.erase(pid); }
  void clear() { entries_.clear(); }
  std::size_t size() const { return entries_.size(); }

 private:
  struct Entry {
    std::uint64_t start = 0;
    bool leader = false;
    std::uint64_t added = 0;  // order of admission
  };
  std::size_t max_;
  std::uint64_t next_ = 0;
  std::map<pid_t, Entry> entries_;
};

struct ServerHooks {
  // Whether the process `st` may hold timers (the agent: its own workers and their process
  // trees, found up the parent chain); a new timer of any other pid is refused with a line
  // (at most one a second), so made-up pids cannot fill the table and push a real worker's
  // timer out. Asked once per process (AdmissionCache). Null: every live process.
  std::function<bool(const ProcStat& st)> admit;
  // Whether `pid` is one of the agent's workers itself, not yet reaped (cheap, no /proc):
  // its admission is then found without reading /proc. Null: none is.
  std::function<bool(pid_t pid)> is_worker;
  // Reaps `e.pid` with `e.signal` (> 0), only while it is the process (e.pid, e.start); the
  // hook decides (the agent: by pidfd, signal_same_process).
  std::function<void(const Expired& e)> reap;
  // An expired process that asked for no signal, a malformed line: one line each.
  std::function<void(const std::string& line)> log;
  // torch's watchdog events ("watchdog started", "timer expired", "kill worker process",
  // "watchdog stopped"); `r` is null for the first and the last.
  std::function<void(const std::string& name, const Request* r)> event;
};

class Server {
 public:
  // Creates the pipe at `path` and reads it. A pipe already there is replaced, unless a live
  // process reads it (another agent's FileTimer: refused); anything else is refused. Throws std::runtime_error naming the path and the fix when it cannot.
  Server(boost::asio::io_context& io, std::string path, ServerHooks hooks);
  // Removes the pipe (only if it is still the one it made).
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  const std::string& path() const;
  // A new attempt of the worker group: its timers are forgotten (torch starts a new server).
  void clear();
  // The worker `pid` ended (the agent reaped it): its timers and its admission go.
  void process_ended(pid_t pid);
  // Stops reading and removes the pipe (idempotent).
  void stop();

 private:
  struct Impl;
  std::shared_ptr<Impl> impl_;
};

// "/tmp/watchdog_timer_" + a random uuid4, as torch's agent names the pipe.
std::string default_pipe_path();

}  // namespace mg::ftimer
