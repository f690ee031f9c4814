#include "ops/trace.h"

#include <chrono>

namespace mg {

nlohmann::json trace_complete(const std::string& name, const std::string& cat, int pid, int tid, std::int64_t ts_us,
                              std::int64_t dur_us, nlohmann::json args) {
  return {{"name", name}, {"cat", cat},           {"ph", "X"},          {"ts", ts_us},
          {"dur", dur_us < 0 ? 0 : dur_us}, {"pid", pid}, {"tid", tid}, {"args", std::move(args)}};
}

nlohmann::json trace_instant(const std::string& name, const std::string& cat, int pid, int tid, std::int64_t ts_us,
                             nlohmann::json args) {
  return {{"name", name}, {"cat", cat}, {"ph", "i"}, {"s", "t"}, {"ts", ts_us}, {"pid", pid}, {"tid", tid},
          {"args", std::move(args)}};
}

nlohmann::json trace_process_name(int pid, const std::string& name) {
  return {{"name", "process_name"}, {"ph", "M"}, {"pid", pid}, {"tid", 0}, {"args", {{"name", name}}}};
}

nlohmann::json trace_thread_name(int pid, int tid, const std::string& name) {
  return {{"name", "thread_name"}, {"ph", "M"}, {"pid", pid}, {"tid", tid}, {"args", {{"name", name}}}};
}

TraceWriter::TraceWriter(Sink sink, int pid, const std::string& process_name, Clock clock)
    : sink_(std::move(sink)), pid_(pid), clock_(std::move(clock)) {
  if (!clock_)
    clock_ = [] {
      return std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now().time_since_epoch())
          .count();
    };
  origin_ = clock_();
  event(trace_process_name(pid_, process_name));
  thread_name(0, "agent");
}

TraceWriter::~TraceWriter() { close(); }

std::int64_t TraceWriter::now() const { return clock_() - origin_; }

void TraceWriter::thread_name(int tid, const std::string& name) { event(trace_thread_name(pid_, tid, name)); }

void TraceWriter::complete(const std::string& name, const std::string& cat, int tid, std::int64_t start_us,
                           nlohmann::json args) {
  const std::int64_t end = now();
  event(trace_complete(name, cat, pid_, tid, start_us, end - start_us, std::move(args)));
}

void TraceWriter::instant(const std::string& name, const std::string& cat, int tid, nlohmann::json args) {
  event(trace_instant(name, cat, pid_, tid, now(), std::move(args)));
}

void TraceWriter::event(const nlohmann::json& ev) {
  if (closed_) return;
  std::string text = first_ ? "[\n" : ",\n";
  first_ = false;
  text += ev.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  sink_(text);
}

void TraceWriter::close() {
  if (closed_) return;
  if (first_) sink_("[");
  sink_("\n]\n");
  closed_ = true;
}

}  // namespace mg
