// libFuzzer target for the bare-metal parsers: hostfiles, --include/--exclude selections
// and the kernel text formats doctor reads. Any bytes must give a result or the documented
// exception (UsageError, std::invalid_argument), never a crash or a hang; results must
// keep their promises (hosts unique and within the caps, selected slots within the
// host's slots, cpu lists sorted and round-tripping through format_cpu_list).
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <set>
#include <stdexcept>
#include <string>
#include <string_view>

#include "cli/errors.h"
#include "baremetal/hostfile.h"
#include "ops/hwprobe.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace mg;
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  // The last line doubles as a selection for --include and --exclude.
  const auto nl = text.rfind('\n');
  const std::string sel(nl == std::string_view::npos ? text : text.substr(nl + 1));
  try {
    auto hosts = parse_hostfile(text, "fuzz");
    if (hosts.empty() || hosts.size() > static_cast<std::size_t>(kMaxHosts)) __builtin_trap();
    std::set<std::string> names;
    for (const auto& h : hosts) {
      if (!names.insert(h.host).second || h.slots < 0 || h.slots > kMaxSlots || h.host.empty()) __builtin_trap();
    }
    for (int mode = 0; mode < 2; ++mode) {
      try {
        auto picked = select_hosts(hosts, mode ? "" : sel, mode ? sel : "");
        for (const auto& p : picked) {
          if (!names.count(p.host)) __builtin_trap();
          for (int s : p.slot_ids)
            if (s < 0 || s >= kMaxSlots || (p.slots > 0 && s >= p.slots)) __builtin_trap();
        }
      } catch (const UsageError&) {
      }
    }
  } catch (const UsageError&) {
  }
  try {
    auto cpus = hw::parse_cpu_list(text);
    if (!std::is_sorted(cpus.begin(), cpus.end())) __builtin_trap();
    if (hw::parse_cpu_list(hw::format_cpu_list(cpus)) != cpus) __builtin_trap();
  } catch (const std::invalid_argument&) {
  }
  (void)hw::parse_cpu_max(text);
  (void)hw::parse_memory_max(text);
  (void)hw::parse_meminfo(text, "MemTotal");
  (void)hw::parse_cgroup_path(text);
  return 0;
}
