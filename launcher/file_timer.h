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

namespace mg::ftimer {

struct Request {
  int version = 1;
  pid_t pid = 0;
  std::string scope_id;
  double expiration_time = 0;  // seconds since the epoch; < 0: release
  int signal = 0;
};

// One line as FileTimerClient writes it (without its '\n'). Pure. nullopt, with `error`
// saying what is wrong, when it is not such a request.
std::optional<Request> parse_request(std::string_view line, std::string& error);

// A process whose timers expired: the one to reap it by (signal 0: none asked for a
// signal, so it is left alone) and every scope that had expired.
struct Expired {
  pid_t pid = 0;
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
  // (max_per_pid timers of its pid, or max_timers in all), dropped.
  bool apply(const Request& r);
  // The processes with a timer due at `now` (expiration_time <= now), ordered by pid; all
  // their timers are dropped, as FileTimerServer's clear_timers does.
  std::vector<Expired> expire(double now);
  // The earliest expiration_time held, nullopt when none. O(1).
  std::optional<double> next_deadline() const;
  void clear() {
    timers_.clear();
    by_deadline_.clear();
    per_pid_.clear();
  }
  std::size_t size() const { return timers_.size(); }

 private:
  void erase(std::map<std::pair<pid_t, std::string>, Request>::iterator it);
  std::size_t max_per_pid_, max_timers_;
  std::map<std::pair<pid_t, std::string>, Request> timers_;
  std::set<std::tuple<double, pid_t, std::string>> by_deadline_;  // the same timers, by expiry
  std::map<pid_t, std::size_t> per_pid_;
};

struct ServerHooks {
  // Whether `pid` may hold timers (the agent: its own workers and their process trees);
  // a new timer of any other pid is refused with a line (at most one a second), so made-up
  // pids cannot fill the table and push a real worker's timer out. Null: every pid.
  std::function<bool(pid_t pid)> admit;
  // Reaps `e.pid` with `e.signal` (> 0); the hook decides (the agent only signals its own
  // workers' processes).
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
  // Stops reading and removes the pipe (idempotent).
  void stop();

 private:
  struct Impl;
  std::shared_ptr<Impl> impl_;
};

// "/tmp/watchdog_timer_" + a random uuid4, as torch's agent names the pipe.
std::string default_pipe_path();

}  // namespace mg::ftimer
