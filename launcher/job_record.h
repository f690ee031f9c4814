// The agent's record of the job it is in (#34 H1), kept node-locally so that an agent
// restarted on this node with the same command line (systemd, a user, a Slurm requeue of
// one node) rejoins a job that went on without it instead of hosting (or joining) a fresh
// one at the endpoint: the job id, this node's identity, the job's run and epoch, and where
// the job may be hosted (rdzv::ClientMachine::job_hosts()). One small JSON file per job id,
// node and agent (its slot: agents of one job on one machine that advertise one address
// keep one each, review s41-c M1), written at each assignment or standby, removed when the
// job ends for good. docs/multinode.md, "A restarted node rejoins the job".
//
// Where: $MGLAUNCH_RECORD_DIR, else $XDG_RUNTIME_DIR/mglaunch (when that directory exists:
// Slurm's --export=ALL passes the login node's), else /tmp/mglaunch-UID; the directory is
// made 0700 and used only when it is a directory of this user that no one else can write
// (0755 will do; never through a symbolic link). It is opened once (JobRecordDir) and every
// file is reached through that descriptor. Files are 0600, written whole (a temporary file,
// fsync, rename, fsync of the directory) and read back only when this user owns them. The
// agent's writes and removal run on a helper thread (JobRecordWriter), never on its io
// thread; but the io thread waits for a node's first record of the job before its first
// workers start (the heartbeats' too, so at most half the fence bound: review s41-a M1).
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "process/fd.h"

namespace mg {

struct JobRecord {
  std::string job;   // the rendezvous job id (--rdzv_id)
  std::string node;  // this node: its advertised address and host name (node_identity())
  // The rendezvous: "BACKEND ENDPOINT" (job_endpoint()). Two jobs of one id (the default
  // "none") at two endpoints on one machine keep two records, and neither reads the other's.
  std::string endpoint;
  std::string run;   // the job's rendezvous run (MGLAUNCH_RUN)
  // The newest epoch this node was told (assigned, or told as a standby; its voters' when it
  // has them): a host whose newest round is older is passed over by its recall, even the
  // one it stood by at last (review s41-b L1).
  int epoch = 0;
  std::vector<std::pair<std::string, int>> hosts;  // where to look for the job, in that order
  int takeover_port = 0;  // this node's takeover socket's (bound again there on a restart)
  int voters = 0;         // the last round's voters (rdzv::ClientMachine::job_voters()); 0: unknown
  std::vector<std::pair<std::string, int>> voter_hosts;  // their takeover addresses (job_voter_hosts())
  // This node is one of those voters (job_self_voter()): its recall counts itself only then
  // (review s40-recall M1). Absent from an older record: inferred (read(), review s41-c L1).
  bool self_voter = true;
  int slot = 0;  // the file it is in (job_record_name()); not in the file
};

// The most record slots of one (job, node, endpoint): agents of one job on one machine that
// advertise one address (JobRecordDir::claim()).
inline constexpr int kMaxJobRecordSlots = 64;

// The most bytes a record file holds: write() trims a record to it (fit_job_record()) and
// read() refuses a file over it (review s39-late L1). A record of kMaxListedNodes hosts and
// as many voters' addresses, each of proto::kMaxHostBytes, is ~550 KB.
inline constexpr std::size_t kMaxJobRecordBytes = 1 << 20;

// The text of `r` as write() writes it, at most kMaxJobRecordBytes: over that, with a voter
// count, hosts and voters' addresses are left out from the end (fewer targets or countable
// answers cost a recall only time, its majority being of all the voters); without one (the
// every-host rule) none is, and "" says it cannot fit. `r` is left as written. Pure.
std::string fit_job_record(JobRecord& r);

// "ADDR@HOSTNAME": one node among the agents a user runs on one machine (tests run several
// "nodes" on loopback aliases). Pure.
std::string node_identity(const std::string& advertised, const std::string& hostname);

// "BACKEND ENDPOINT", the record's `endpoint`. Pure.
std::string job_endpoint(const std::string& backend, const std::string& endpoint);

// The directory records go to (see above). Pure but for the check that `xdg_runtime_dir`
// is a directory (a missing one is passed over without a word).
std::string job_record_dir(const std::string& record_dir_env, const std::string& xdg_runtime_dir, uid_t uid);

// The file name of (job, node, endpoint)'s record in slot `slot`: job-HASH.json (slot 0, the
// only one before review s41-c M1), job-HASH.N.json (slot N), HASH a 64-bit FNV-1a of the
// three; `lock`: the slot's lock file, job-HASH[.N].lock (JobRecordDir::claim()). Pure.
std::string job_record_name(const std::string& job, const std::string& node, const std::string& endpoint,
                            int slot = 0, bool lock = false);

// The file of (job, node, endpoint) in `dir`: dir/job_record_name() (the file holds the
// three, and a record whose job, node or endpoint differs is none). Pure.
std::string job_record_path(const std::string& dir, const std::string& job, const std::string& node,
                            const std::string& endpoint, int slot = 0);

// Whether `err`, of opening a slot's lock file (`at_open`) or of its flock(), is the whole
// record directory's: it keeps no locks (ENOLCK, ENOSYS, EOPNOTSUPP, ...; at the open ENOSPC,
// EDQUOT, EROFS), unlike a lock held (EWOULDBLOCK) or one slot's odd file. Pure.
bool record_dir_has_no_locks(int err, bool at_open);

// The calls claim() locks a slot with: openat(dir, name, flags, mode) and flock(fd, op).
struct JobRecordLockOps {
  std::function<int(int, const char*, int, unsigned)> open;
  std::function<int(int, int)> flock;
};

// A record slot this agent holds for its whole life (an exclusive flock of its lock file):
// no other live agent reads or writes that slot's record.
struct JobRecordSlot {
  int slot = 0;
  Fd lock;
};

// The record directory, open (review s38 L1): made 0700 when missing, opened once with
// O_DIRECTORY|O_NOFOLLOW and checked by fstat; every file operation after that goes through
// its descriptor (openat, renameat, unlinkat), so a path swapped for another
// directory or a link after the check changes nothing.
class JobRecordDir {
 public:
  // `dir`, or nullptr with `why` set (one line) when it cannot be used.
  static std::shared_ptr<JobRecordDir> open(const std::string& dir, std::string* why);
  const std::string& path() const { return path_; }

  // The slot of (job, node, endpoint) this agent takes, its lock held until `lock` closes
  // (review s41-c M1): the first whose lock it gets that holds a record (its writer is dead:
  // this agent recalls it), else the first whose lock it gets. A held slot is another live
  // agent's, never read. nullopt with `why` set (one line) when none of kMaxJobRecordSlots
  // can be had, or at the first error of the whole directory (record_dir_has_no_locks()):
  // never a slot unlocked (review s41-e H1), and no lock file it made left behind. `ops`:
  // the open and flock to use (a test's injected errors); the system's when null.
  std::optional<JobRecordSlot> claim(const std::string& job, const std::string& node, const std::string& endpoint,
                                     std::string* why, const JobRecordLockOps* ops = nullptr) const;

  // Writes `r` to its file whole (temporary file, fsync, rename, fsync of the directory;
  // 0600). "" or why not.
  std::string write(const JobRecord& r) const;
  // The record of (job, node, endpoint); nullopt when there is none, or (with `why` set,
  // one printable line, "cannot use PATH: ...") when the file cannot be used: another
  // user's, open to others, not a regular file, unreadable, over kMaxJobRecordBytes, not a
  // record (a port outside 1..65535 too). The agent then ends (exit 3): it never starts
  // afresh past a record it cannot read (review s39-late L1).
  // A record without self_voter (older) is inferred one of its voters only when its takeover
  // port is 0 or its own address (`node` before the '@') with that port is a voter's (review
  // s41-c L1: an older late standby's record names only the others).
  std::optional<JobRecord> read(const std::string& job, const std::string& node, const std::string& endpoint,
                                std::string* why, int slot = 0) const;
  void remove(const std::string& job, const std::string& node, const std::string& endpoint, int slot = 0) const;
  void release(const std::string& job, const std::string& node, const std::string& endpoint, int slot) const;
  // Removes what killed agents left (review s38 L2): the temporary files of this writer's
  // own name (job-<16 hex digits>[.N].json.PID.tmp, this user's regular files) of pids `alive`
  // says are gone and last written before `now - min_age` (a pid of another pid namespace,
  // on a directory shared by pods or hosts, may still write it: review s39 L1). Never a
  // record: no record is removed for its age (a job taken over may run on for days,
  // docs/multinode.md; review s39 M1). How many were removed.
  int sweep(std::chrono::system_clock::time_point now, std::chrono::seconds min_age,
            const std::function<bool(pid_t)>& alive) const;

 private:
  JobRecordDir(Fd fd, std::string path) : fd_(std::move(fd)), path_(std::move(path)) {}
  Fd fd_;
  std::string path_;
};

// How old a dead writer's temporary file must be before a starting agent sweeps it.
inline constexpr std::chrono::seconds kJobRecordTmpMinAge = std::chrono::hours(1);

// The agent's record I/O on a helper thread of its own (review s38 L2): a write's fsync,
// the removal and the start's sweep, in the order asked, so a hung NFS or a busy disk delays
// the io thread (its heartbeats) only where it waits (drain_for()). The thread starts with the writer (docs/design.md,
// "Threads on demand"). The queue is bounded: a write asked while another waits replaces
// it (only the newest record matters); a removal drops what waits before it. remove() is
// final: the job ended, and a write asked after it is dropped, so no late write brings the record back
// (review s39 L7); discard() removes a stale record the agent recalled, and the job's own
// records follow it. An exception of an operation is caught and kept as its error (review
// s39 L3). The destructor waits at most `wait` for what is queued, then leaves the thread
// detached (its state shared with it) and says so on stderr (a hung NFS server must not
// keep the agent from exiting: review s39 L5). on_failure() tells the caller of a failure
// when it happens.
class JobRecordWriter {
 public:
  struct Ops {  // what the thread does (JobRecordDir's; a test's own to hold it)
    std::function<std::string(const JobRecord&)> write;
    std::function<void(const JobRecord&)> remove;
    std::function<void()> sweep;
    // After remove() (the job ended for good, its agent exits): the record slot's lock file
    // too (a claim checks that the file it locked is still the one at its name). May be unset.
    std::function<void(const JobRecord&)> release;
  };
  static Ops ops_of(std::shared_ptr<const JobRecordDir> dir);
  explicit JobRecordWriter(Ops ops, std::chrono::milliseconds wait = std::chrono::seconds(2));
  ~JobRecordWriter();  // finishes what waits (at most `wait`), then joins or detaches
  JobRecordWriter(const JobRecordWriter&) = delete;
  JobRecordWriter& operator=(const JobRecordWriter&) = delete;

  void write(JobRecord r);
  void remove();  // the last record written, for good: later writes are dropped
  void discard(JobRecord key);  // that record (a stale one recalled), before any write
  void sweep();
  void drain();   // returns once nothing waits or runs
  bool drain_for(std::chrono::milliseconds wait);  // drain(), at most `wait`: false if it did not
  // The newest write asked has landed (written whole and synced); false while it waits or
  // runs, and after it failed (review s41-a L1: drain_for() is true after a failure too).
  bool on_disk() const;
  std::string take_error();  // the first failure not yet taken; "" when none
  // `f` is called on the helper thread (under its lock: keep it short, e.g. a post to the
  // caller's io context) after each operation that failed, so the caller learns of a
  // failure without waiting for its next write (review s40 M2); never after the destructor
  // began (a detached thread calls nothing).
  void on_failure(std::function<void()> f);
  // Keeps the record slot's lock (JobRecordSlot::lock) as long as its thread lives: a thread
  // left detached by the destructor (a hung write or removal) still holds it, so no new agent
  // claims the slot under that thread's late rename or unlink (review s41-d L2).
  void hold(Fd lock);

 private:
  struct State;
  static void loop(const std::shared_ptr<State>& st);
  std::shared_ptr<State> st_;
  std::chrono::milliseconds wait_;
  std::thread thread_;
};

}  // namespace mg
