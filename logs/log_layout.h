// LogLayout: where one node's run keeps its files, and whether they outlive it.
//   --log_dir D, --rdzv_id ID:   D/ID_{time}_XXXXXX/attempt_{N}/{local_rank}/{stdout,stderr}.log, error.json
//                                and D/ID a link to the newest run of ID (a re-run never overwrites)
//   --log_dir D, default id:     D/{run_id}_{time}_XXXXXX/attempt_{N}/... (a re-run never overwrites)
//   no --log_dir:                $TMPDIR/mglaunch_XXXXXX/{run_id}/attempt_{N}/..., removed at the end
//                                unless output is redirected to files or a failed run left files;
//                                with TMPDIR unset: /dev/shm (a tmpfs, when it can be written) for a
//                                run without output files, else /tmp
#pragma once

#include <cstddef>
#include <string>

namespace mg {

struct LogLayoutOptions {
  std::string log_dir;          // --log_dir ("" = a temporary directory)
  std::string rdzv_id;          // "none": the default run id
  std::string run_id;
  bool files_wanted = false;    // --redirects/--tee send some output to files
  std::string time_text;        // for the default id's directory name (now_text())
  std::string tmpdir;           // "" = $TMPDIR, else shm_dir (no files wanted), else /tmp
  // Holds only the error files when no output goes to files: a directory in memory. On an
  // ext4 root without a journal and with discard (as on the benchmark VM) each directory
  // made and removed there cost ~0.1 ms of CPU plus a synchronous trim at removal, 7 of
  // them per run of 4 workers: 0.9 of the agent's 3.2 ms of CPU.
  std::string shm_dir = "/dev/shm";
};

// Removes the mglaunch_* trees under `dir` (the shm directory) that a dead agent of this
// user and pid namespace left with nothing but directories in them (its owner file names
// it); returns how many. Called by create() before it makes a tree there.
std::size_t sweep_dead_trees(const std::string& dir);

class LogLayout {
 public:
  LogLayout() = default;
  LogLayout(const LogLayout&) = delete;
  LogLayout& operator=(const LogLayout&) = delete;
  ~LogLayout();

  // Creates the run's directory. Throws UsageError (naming --log_dir and the fix) when it
  // cannot be created or written. Returns the notice to print ("log directory: ..."), or "".
  std::string create(const LogLayoutOptions& o);
  // The directory of local rank `local_rank` in attempt `attempt` (created by the caller).
  std::string attempt_dir(int attempt, int local_rank) const;
  const std::string& root() const { return root_; }
  const std::string& run_dir() const { return run_dir_; }
  bool kept() const { return !is_temp_ || keep_; }
  // The run ended with `code`: a failed run's temporary directory is kept when it holds a
  // file (the error files the root cause names, logs). Returns the notice to print, or "".
  std::string finish(int code);
  // Removes a temporary directory that is not kept (also done by the destructor).
  void clean_up();

 private:
  std::string root_;     // {log_dir} or a temporary directory
  std::string run_dir_;  // this run's files
  bool is_temp_ = false;
  bool keep_ = true;
};

}  // namespace mg
