// Trace: the run's timeline as a Chrome trace (the JSON trace event format that Perfetto
// and chrome://tracing load) for --trace FILE: rendezvous rounds, attempts, each worker
// from spawn to exit, restarts and signals. Events are formatted by pure functions and
// handed to a sink as they happen (the agent's sink queues them to the console's file
// writer thread), so the file holds everything up to a crash; close() ends the JSON array.
// Times are microseconds on the monotonic clock since the trace began.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

namespace mg {

// One trace event object (pure). ph: "X" complete (ts..ts+dur), "i" instant (thread
// scope), "M" metadata. Its keys: name, cat, ph, ts, pid, tid, and dur / s / args.
nlohmann::json trace_complete(const std::string& name, const std::string& cat, int pid, int tid, std::int64_t ts_us,
                              std::int64_t dur_us, nlohmann::json args = nlohmann::json::object());
nlohmann::json trace_instant(const std::string& name, const std::string& cat, int pid, int tid, std::int64_t ts_us,
                             nlohmann::json args = nlohmann::json::object());
// process_name / thread_name metadata.
nlohmann::json trace_process_name(int pid, const std::string& name);
nlohmann::json trace_thread_name(int pid, int tid, const std::string& name);

// Streams events to `sink` as one JSON array: "[\n" ev ",\n" ev ... "\n]\n". Called on
// one thread (the agent's io_context).
class TraceWriter {
 public:
  using Sink = std::function<void(std::string_view)>;
  using Clock = std::function<std::int64_t()>;  // microseconds, monotonic
  // `pid`: the trace's process id (the agent's pid); tid 0 is the agent itself, tid
  // 1 + local_rank a worker slot.
  TraceWriter(Sink sink, int pid, const std::string& process_name, Clock clock = {});
  ~TraceWriter();
  TraceWriter(const TraceWriter&) = delete;
  TraceWriter& operator=(const TraceWriter&) = delete;

  std::int64_t now() const;  // since the trace began
  int pid() const { return pid_; }
  static int worker_tid(int local_rank) { return 1 + local_rank; }
  void thread_name(int tid, const std::string& name);
  void complete(const std::string& name, const std::string& cat, int tid, std::int64_t start_us,
                nlohmann::json args = nlohmann::json::object());
  void instant(const std::string& name, const std::string& cat, int tid, nlohmann::json args = nlohmann::json::object());
  void event(const nlohmann::json& ev);
  // Ends the array; later events are dropped. Also done by the destructor.
  void close();

 private:
  Sink sink_;
  int pid_;
  Clock clock_;
  std::int64_t origin_ = 0;
  bool first_ = true;
  bool closed_ = false;
};

}  // namespace mg
