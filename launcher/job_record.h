// The agent's record of the job it is in (#34 H1), kept node-locally so that an agent
// restarted on this node with the same command line (systemd, a user, a Slurm requeue of
// one node) rejoins a job that went on without it instead of hosting (or joining) a fresh
// one at the endpoint: the job id, this node's identity, the job's run and epoch, and where
// the job may be hosted (rdzv::ClientMachine::job_hosts()). One small JSON file per job id
// and node, written at each assignment or standby, removed when the job ends for good.
// docs/multinode.md, "A restarted node rejoins the job".
//
// Where: $MGLAUNCH_RECORD_DIR, else $XDG_RUNTIME_DIR/mglaunch, else /tmp/mglaunch-UID; the
// directory is made 0700 and used only when it is a directory of this user that no one else
// can write (0755 will do; never through a symbolic link). Files are 0600, written whole (a
// temporary file, fsync, rename) and read back only when this user owns them.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace mg {

struct JobRecord {
  std::string job;   // the rendezvous job id (--rdzv_id)
  std::string node;  // this node: its advertised address and host name (node_identity())
  // The rendezvous: "BACKEND ENDPOINT" (job_endpoint()). Two jobs of one id (the default
  // "none") at two endpoints on one machine keep two records, and neither reads the other's.
  std::string endpoint;
  std::string run;   // the job's rendezvous run (MGLAUNCH_RUN)
  int epoch = 0;     // the last epoch assigned (or told a standby)
  std::vector<std::pair<std::string, int>> hosts;  // where to look for the job, in that order
  std::int64_t written_ms = 0;  // read: the file's modification time (ms since the Unix epoch)
};

// "ADDR@HOSTNAME": one node among the agents a user runs on one machine (tests run several
// "nodes" on loopback aliases). Pure.
std::string node_identity(const std::string& advertised, const std::string& hostname);

// "BACKEND ENDPOINT", the record's `endpoint`. Pure.
std::string job_endpoint(const std::string& backend, const std::string& endpoint);

// The directory records go to (see above). Pure.
std::string job_record_dir(const std::string& record_dir_env, const std::string& xdg_runtime_dir, uid_t uid);

// The file of (job, node, endpoint) in `dir`: job-HASH.json, HASH a 64-bit FNV-1a of the
// three (the file holds them, and a record whose job, node or endpoint differs is none). Pure.
std::string job_record_path(const std::string& dir, const std::string& job, const std::string& node,
                            const std::string& endpoint);

// Makes `dir` (0700) when missing. "" when it can be used; else why not, one line.
std::string prepare_job_record_dir(const std::string& dir);

// Writes `r` to its file in `dir` whole (temporary file, fsync, rename; 0600). "" or why not.
std::string write_job_record(const std::string& dir, const JobRecord& r);

// The record of (job, node, endpoint) in `dir`; nullopt when there is none, or (with `why`
// set) when the file cannot be used: another user's, open to others, not a regular file,
// unreadable.
std::optional<JobRecord> read_job_record(const std::string& dir, const std::string& job, const std::string& node,
                                         const std::string& endpoint, std::string* why);

// Sets the record's modification time to now (the agent is still in the job). False: none.
bool touch_job_record(const std::string& dir, const std::string& job, const std::string& node,
                      const std::string& endpoint);

void remove_job_record(const std::string& dir, const std::string& job, const std::string& node,
                       const std::string& endpoint);

}  // namespace mg
