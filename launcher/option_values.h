// The grammars of mglaunch's flag values that other flags' checks share: whole numbers,
// seconds and lists, each error naming where the text came from ("--node_rank",
// "PET_NODE_RANK" or a --config key) and the valid range. The values with a grammar of
// their own (--nnodes, --redirects/--tee, --rdzv_conf, the signal and filter lists, the
// ${local_rank} placeholder) are declared in launcher/options.h; all are defined in
// option_values.cc. Internal to launcher/.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace mg {

// An integer >= min_value (<= max_value when given); throws UsageError.
int parse_int(const std::string& flag, std::string_view text, int min_value,
              std::optional<int> max_value = std::nullopt);
// Seconds in [min_s, max_s] (a decimal number); throws UsageError.
double parse_seconds(const std::string& flag, std::string_view text, double min_s, double max_s);
// "0,3,5": integers >= 0; throws UsageError.
std::vector<int> parse_int_list(const std::string& flag, const std::string& text);

}  // namespace mg
