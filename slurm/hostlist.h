// Slurm hostlist expressions ("node[01-03,7],login1") expanded into host names, as
// `scontrol show hostnames` does. Zero-padding width comes from the lower bound; the
// expansion is capped so a typo like "n[1-999999999]" fails instead of eating memory.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

namespace mg::slurm {

inline constexpr std::size_t kMaxHosts = 1 << 20;

// Throws std::invalid_argument with the offending text on malformed input or when the
// expansion would exceed max_hosts.
std::vector<std::string> expand_hostlist(std::string_view expr, std::size_t max_hosts = kMaxHosts);

}  // namespace mg::slurm
