// The /proc reader of the process layer: the fields of /proc/PID/stat, every process, a
// process's descendants through the kernel's children lists.
#pragma once

#include <sys/types.h>

#include <optional>
#include <string_view>
#include <unordered_set>
#include <vector>

namespace mg {

// The fields of /proc/PID/stat the agent needs to find its descendants.
struct ProcStat {
  pid_t pid = 0;
  pid_t ppid = 0;
  pid_t pgrp = 0;
  char state = '?';  // 'Z': a zombie, already dead
};

// Parses one /proc/PID/stat text ("pid (comm) state ppid pgrp ..."; comm may hold spaces
// and parentheses). Pure. nullopt when malformed.
std::optional<ProcStat> parse_proc_stat(std::string_view text);

// Every process /proc shows now (those that vanish while reading are skipped).
std::vector<ProcStat> scan_processes();

// The descendants of `root` (zombies included), found through the kernel's
// /proc/PID/task/TID/children lists: the cost grows with root's tree, not with the number
// of processes on the machine (thousands on a shared one). Falls back to scan_processes()
// where those lists are absent (CONFIG_PROC_CHILDREN off). Feed it to descendants_of(.., root).
std::vector<ProcStat> scan_family(pid_t root);

// The living (non-zombie) descendants of `root` in `table`, `root` excluded. Pure; linear
// in the table's size.
std::vector<ProcStat> descendants_of(const std::vector<ProcStat>& table, pid_t root);

// The process groups that hold at least one living descendant of `root`.
std::unordered_set<pid_t> descendant_groups(const std::vector<ProcStat>& table, pid_t root);

}  // namespace mg
