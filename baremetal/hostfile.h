// Hostfiles and DeepSpeed's --include/--exclude host selection, as pure functions: text
// in, hosts out, UsageError (naming the file and line, or the bad item) on bad input.
//
// Hostfile lines: `HOST slots=N` or a plain `HOST` (that host detects its own worker
// count, like --nproc_per_node=auto); `#` starts a comment; blank lines are skipped.
// Selection: "h1@h2:0,2" keeps only h1 (all slots) and slots 0 and 2 of h2 (include), or
// removes them (exclude); hosts left with no slot are dropped. Order is the hostfile's.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace mg {

struct HostEntry {
  std::string host;
  int slots = 0;               // 0: unknown, the host decides (--nproc_per_node=auto)
  std::vector<int> slot_ids;   // chosen slots (GPU ids) when a subset; empty: all of them
  int line = 0;                // hostfile line, for messages

  // Workers this host runs: slot_ids.size() when a subset, else slots (0: auto).
  int workers() const { return slot_ids.empty() ? slots : static_cast<int>(slot_ids.size()); }
};

// Caps that keep a hostile or mistaken file from exhausting memory.
inline constexpr int kMaxHosts = 65536;
inline constexpr int kMaxSlots = 4096;

// `source` names the file in messages. Throws UsageError on a bad line, a duplicate
// host, or an empty result.
std::vector<HostEntry> parse_hostfile(std::string_view text, const std::string& source);

// Applies DeepSpeed's --include or --exclude (at most one non-empty). Throws UsageError
// for an unknown host, a slot out of range, a slot list on a host with unknown slots
// (exclude only), or when nothing is left.
std::vector<HostEntry> select_hosts(std::vector<HostEntry> hosts, const std::string& include,
                                    const std::string& exclude);

}  // namespace mg
