// Slurm hostlist expressions ("rack[1-2]-node[08-10],login1") expanded into host names as
// `scontrol show hostnames` does, and host names compressed back into the expression
// `scontrol show hostlist` prints. Pure functions, no I/O.
//
// Grammar (Slurm's): terms separated by ',' or whitespace outside brackets; a term is
// literal text with any number of bracket groups, each group a comma list of N or LO-HI;
// several groups expand as a cartesian product, the leftmost group varying slowest. A
// range keeps the zero padding of its lower bound ("n[008-010]", "n[01-100]" -> n01..n100).
// The expansion is capped so a typo like "n[1-999999999]" fails instead of eating memory.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

namespace mg::slurm {

inline constexpr std::size_t kMaxHosts = 1 << 20;

// Throws std::invalid_argument naming the expression and the bad part on malformed input
// or when the expansion would exceed max_hosts. Duplicates are kept, order is preserved.
std::vector<std::string> expand_hostlist(std::string_view expr, std::size_t max_hosts = kMaxHosts);

// The shortest expression Slurm writes for `hosts`, in their order: runs of consecutive
// numbers with the same prefix and padding become ranges, and neighbouring hosts with
// the same prefix share one bracket ("n[1-3,7],login1"). expand_hostlist(compress) ==
// hosts for every list of names without brackets, commas or spaces.
std::string compress_hostlist(const std::vector<std::string>& hosts);

}  // namespace mg::slurm
