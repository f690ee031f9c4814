// The pure half of the preflight check: judge() and the reports' JSON (declared in
// ops/preflight.h) live in preflight_verdict.cc; this header holds the wording that the
// verdict and a node's own failure lines share. Internal to ops/.
#pragma once

#include <string>
#include <vector>

namespace mg::preflight {

// "1.25 GB/s", "12 MB/s", "0.50 MB/s".
std::string rate_text(double bytes_per_s);
// "node 2 (10.0.0.3)" (its address when `nodes` has it), else "node 2".
std::string node_name(int r, const std::vector<std::string>& nodes);
// "node 1 (a), node 2 (b) and node 3 (c)".
std::string names(const std::vector<int>& rs, const std::vector<std::string>& nodes);
// Appends x to v unless v has it.
void add_unique(std::vector<int>& v, int x);

}  // namespace mg::preflight
