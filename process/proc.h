// The one /proc reader of the process layer (the agent's process hygiene, the watchdog,
// the monitor): a process's stat, status fields, children and environment, every process,
// a process's descendants through the kernel's children lists, the ephemeral port range.
// The parsers are pure; the readers return nothing (nullopt, "") for a process that is gone.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_set>
#include <utility>
#include <vector>

#include "process/fd.h"

namespace mg {

// The fields of /proc/PID/stat the product uses (numbered as in proc(5)).
struct ProcStat {
  pid_t pid = 0;
  pid_t ppid = 0;                    // 4
  pid_t pgrp = 0;                    // 5
  char state = '?';                  // 3; 'Z': a zombie, already dead; 'D': uninterruptible
  std::uint64_t flags = 0;           // 9: PF_* (PF_KTHREAD marks a kernel thread)
  std::uint64_t cpu_ticks = 0;       // 14 + 15: utime + stime, in clock ticks
  std::uint64_t starttime = 0;       // 22: clock ticks after boot; with pid, names a process
};
inline constexpr std::uint64_t kPfKthread = 0x00200000;

// Parses one /proc/PID/stat text ("pid (comm) state ppid pgrp ... starttime ..."; comm may
// hold spaces and parentheses: it ends at the LAST ')'). Pure. nullopt when malformed or
// cut short before the start time.
std::optional<ProcStat> parse_proc_stat(std::string_view text);

// The value of field `name` in a /proc/PID/status text ("VmRSS:\t  123 kB" -> "123 kB"),
// blanks trimmed. Pure.
std::optional<std::string_view> proc_status_field(std::string_view status, std::string_view name);
// A "N kB" field of /proc/PID/status in bytes; nullopt when absent or in another unit. Pure.
std::optional<std::uint64_t> proc_status_bytes(std::string_view status, std::string_view name);

// /proc/PID/LEAF (pid 0: /proc/self), at most `max` bytes; "" when it cannot be read (gone).
// `proc_root` replaces "/proc" (tests).
std::string read_proc_file(pid_t pid, std::string_view leaf, std::size_t max = 64 * 1024,
                           std::string_view proc_root = "/proc");
std::optional<ProcStat> read_proc_stat(pid_t pid, std::string_view proc_root = "/proc");
// The children of thread `tid` of `pid` (/proc/PID/task/TID/children; CONFIG_PROC_CHILDREN).
std::vector<pid_t> read_proc_children(pid_t pid, pid_t tid);
// The NUL-separated environment block of `pid` (at most `max` bytes). Reading it takes the
// process's memory-map lock: do not read that of a process in state D (it may block).
std::string read_proc_environ(pid_t pid, std::size_t max = 1 << 20);

// The kernel's ephemeral port range (/proc/sys/net/ipv4/ip_local_port_range,
// "32768\t60999\n"); nullopt when it cannot be read or parsed.
std::optional<std::pair<int, int>> parse_port_range_text(std::string_view text);
std::optional<std::pair<int, int>> ephemeral_port_range_of_kernel();

// Every process /proc shows now, zombies and kernel threads included (those that vanish
// while reading are skipped). `proc_root` replaces "/proc" (tests).
std::vector<ProcStat> scan_processes(std::string_view proc_root = "/proc");

// The descendants of `root` (zombies included), found through the kernel's
// /proc/PID/task/TID/children lists: the cost grows with root's tree, not with the number
// of processes on the machine (thousands on a shared one). Falls back to scan_processes()
// where those lists are absent (CONFIG_PROC_CHILDREN off). Feed it to descendants_of(.., root).
std::vector<ProcStat> scan_family(pid_t root);

// Sends `sig` (0: only checks) to `pid` only while it is still the process that started
// at `starttime`: a pidfd is opened first (pidfd_open), the start time read after it, and
// the signal sent through it (pidfd_send_signal), so a pid reused between the check and
// the signal is never hit. Falls back to kill() after the same check when the kernel has
// no pidfd (ENOSYS: Linux < 5.3, see pidfd_available()) or `use_pidfd` is false (tests);
// only that fallback leaves a reuse window between the check and the kill(). Returns 1
// sent, 0 gone, a zombie or not the same process, -1 another error (EPERM, EMFILE).
int signal_same_process(long pid, unsigned long long starttime, int sig, bool use_pidfd = true);
inline int signal_same_process(const ProcStat& p, int sig) { return signal_same_process(p.pid, p.starttime, sig); }

// A process group named by its leader as it was when looked at, so that a signal reaches
// that group and never a later one given the same id. open() takes the leader's pidfd
// first, then checks that `pid` is still the process that started at `starttime`, alive,
// and leads its group; signal() sends through that pidfd to the group
// (pidfd_send_signal's PIDFD_SIGNAL_PROCESS_GROUP, Linux >= 6.9): the group of that very
// process, also once it ended, was reaped and its pid recycled (then ESRCH, nothing sent).
// Older kernels: kill(-pid), which leaves a window from open() on.
class ProcessGroup {
 public:
  // nullopt: not that process any more, a zombie, or no group leader.
  static std::optional<ProcessGroup> open(long pid, unsigned long long starttime);
  // 1 sent, 0 the group is gone, -1 another error.
  int signal(int sig) const;
  // Tests: signal() as on a kernel without the group flag (kill(-pid)).
  void without_group_pidfd() { use_pidfd_ = false; }

 private:
  ProcessGroup(Fd pidfd, pid_t pid) : pidfd_(std::move(pidfd)), pid_(pid) {}
  Fd pidfd_;
  pid_t pid_ = 0;
  bool use_pidfd_ = true;
};

// Whether this kernel has pidfd_open and pidfd_send_signal (Linux >= 5.3); probed once.
bool pidfd_available();

// The living (non-zombie) descendants of `root` in `table`, `root` excluded. Pure; linear
// in the table's size.
std::vector<ProcStat> descendants_of(const std::vector<ProcStat>& table, pid_t root);

// The process groups that hold at least one living descendant of `root`.
std::unordered_set<pid_t> descendant_groups(const std::vector<ProcStat>& table, pid_t root);

}  // namespace mg
