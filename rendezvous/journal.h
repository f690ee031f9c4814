// Journal: the daemon's --state-dir. Every job event (JobEvent, as json_of() with its
// "text" and "unix_ms") is appended as one JSON line to DIR/journal.jsonl, so that a
// restarted daemon keeps its jobs' history: the status page and /api/jobs show the jobs that
// ended (and those that ran) before the restart, /api/events their last events.
//
// It is history, not state: a running job is rebuilt from its re-registering agents as
// without a journal (rendezvous/job.h), since they, not the journal, know how far it got
// while the daemon was down; the job's new events go on in the same journal. One thing
// is kept: the job's run and epoch ("run", "epoch" of its created, round_started, takeover
// and re-registered events, once the run is settled), which a restarted daemon's Job of a job
// that has not ended goes on with, one epoch on (rdzv::Server::job_of(), review s38 M1,
// s38-late H1). A job the daemon drops without an end (Server::forget(): nobody connected)
// gets a "forgotten" event, an end like done and failed: its id used again is a new run
// (but its agents that re-register a round of it rebuild it: Job::seed_forgotten()). A new
// run's summary names the last run that ended ("ended_run", "ended_state"), so a daemon
// restarted before the new run's first round still tells that run's stragglers its end.
//
//   DIR/journal.jsonl    append-only; fdatasync'd after each event that changes a job's state
//                        (created, round started, node lost, restart, promoted, takeover, done,
//                        failed), not after each node's join, once for all of a call's events,
//                        before the frames of the call that made them go out (Server::drive), so a node that heard
//                        a job's end finds it here, and a restarted daemon tells the nodes that
//                        re-register an ended run that end (Job::seed_ended, review s38-late L1)
//   DIR/journal.1.jsonl  the previous file: past kMaxFileBytes the journal moves there (the one
//                        before is dropped), so the directory holds at most twice that
//   DIR/lock             flock()ed while a daemon uses DIR
// A last line cut short (a crash mid-write) is truncated with a warning; a bad line before
// it is an error (the journal was edited or damaged: move it away to start afresh).
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace mg::rdzv {

struct JournalError : std::runtime_error {
  enum class Kind { kBadDir, kCorrupt };  // mglaunch-rdzv exits 2 and 4
  JournalError(Kind k, const std::string& what) : std::runtime_error(what), kind(k) {}
  Kind kind;
};

// What the journal says of one job: its summary (as Job::describe() has it, from the events)
// and its last events.
struct JobHistory {
  nlohmann::json summary;                 // id, state, round, restart_count, max_restarts, ...
  std::deque<nlohmann::json> events;      // at most kMaxEventsPerJob, oldest first
  std::int64_t last_ms = 0;
};

// Folds one event into a job's summary (pure; the journal's replay and the tests use it).
void fold_event(nlohmann::json& summary, const nlohmann::json& event);

class Journal {
 public:
  static constexpr std::uint64_t kMaxFileBytes = 64ull << 20;
  static constexpr std::size_t kMaxEventsPerJob = 200;
  static constexpr std::size_t kMaxJobs = 1000;  // the most recently active are kept
  static constexpr std::size_t kMaxLineBytes = 64 << 10;

  // Opens DIR (it must exist and be writable), locks it and reads its journal. Throws
  // JournalError saying what is wrong and how to fix it. `warning` gets a line when a cut
  // tail was truncated.
  Journal(const std::string& dir, std::string& warning, std::uint64_t max_file_bytes = kMaxFileBytes);
  ~Journal();
  Journal(const Journal&) = delete;
  Journal& operator=(const Journal&) = delete;

  // Appends one event ({"event": KIND, "job": ID, "text": ..., "unix_ms": ...}). A failed
  // write is reported once through `on_error` (the daemon logs it) and never throws.
  // `sync`: flushed to disk at once when it changes a job's state; else sync() does, once
  // for all the events of a call (review s39 L3).
  void record(const nlohmann::json& event, bool sync = true);
  // Flushes what record(event, false) appended that changes a job's state (one fdatasync).
  void sync();
  // The jobs the journal knows, most recent last.
  const std::map<std::string, JobHistory>& jobs() const { return jobs_; }
  // The last `n` events of every job, oldest first (the status page's events after a restart).
  std::vector<nlohmann::json> last_events(std::size_t n) const;
  const std::string& dir() const { return dir_; }
  std::string last_error;  // the last write failure, empty when none

 private:
  void load(const std::string& path, bool tail_may_be_cut, std::string& warning);
  void remember(const nlohmann::json& event);
  void rotate();

  std::string dir_, path_, old_path_;
  int fd_ = -1, lock_fd_ = -1;
  std::uint64_t size_ = 0, max_bytes_;
  bool unsynced_ = false;  // a durable event appended, not flushed yet (record(e, false))
  std::map<std::string, JobHistory> jobs_;
  std::deque<nlohmann::json> recent_;  // every job's last events, for last_events()
};

}  // namespace mg::rdzv
