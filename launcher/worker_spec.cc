#include "launcher/worker_spec.h"

#include <algorithm>

#include <fmt/format.h>

#include "logs/filtered_copy.h"
#include "logs/line_splitter.h"
#include "process/watchdog.h"

namespace mg {

std::string worker_line_prefix(const RunPlan& plan, const AgentOptions& opts, int lr) {
  const int rank = plan.rank_offset + lr;
  if (!opts.log_line_prefix_template) return fmt::format("[rank{}]:", rank);
  const std::string& t = *opts.log_line_prefix_template;
  return expand_line_prefix(t, opts.role, rank, lr,
                            t.find("hostname") != std::string::npos ? local_hostname() : std::string());
}

WorkerSpec make_worker_spec(const RunPlan& plan, const AgentOptions& opts, const EnvMap& base_env, const SpecInputs& in) {
  const int lr = in.local_rank;
  WorkerSpec spec;
  spec.local_rank = lr;
  spec.rank = plan.rank_offset + lr;
  spec.executable = plan.executable;
  spec.argv = build_worker_argv(plan, opts, lr);
  // The base environment with the contract's variables (and the run mark) over it, in
  // key order: one merge of the two sorted maps, without copying the base map per worker.
  EnvMap contract = build_contract_env(plan, opts, base_env, lr, in.attempt, in.dir + "/error.json");
  if (!in.run_mark.empty()) contract[kRunMarkVar] = in.run_mark;
  spec.env.reserve(base_env.size() + contract.size());
  auto add = [&spec](const std::string& k, const std::string& v) {
    std::string kv;
    kv.reserve(k.size() + 1 + v.size());
    kv.append(k).append(1, '=').append(v);
    spec.env.push_back(std::move(kv));
  };
  auto b = base_env.begin();
  for (const auto& [k, v] : contract) {
    for (; b != base_env.end() && b->first < k; ++b) add(b->first, b->second);
    if (b != base_env.end() && b->first == k) ++b;  // the contract's value wins
    add(k, v);
  }
  for (; b != base_env.end(); ++b) add(b->first, b->second);
  const bool shown = opts.local_ranks_filter.empty() ||
                     std::find(opts.local_ranks_filter.begin(), opts.local_ranks_filter.end(), lr) !=
                         opts.local_ranks_filter.end();
  const Streams which[2] = {Streams::kOut, Streams::kErr};
  const char* names[2] = {"stdout.log", "stderr.log"};
  for (int s = 0; s < 2; ++s) {
    // torchrun: tee is a redirect plus a copy to the console, so a stream both redirected
    // and tee'd reaches the console and its file.
    spec.console[s] = shown && (!opts.redirects.covers(lr, which[s]) || opts.tee.covers(lr, which[s]));
    if (opts.redirects.covers(lr, which[s]) || opts.tee.covers(lr, which[s])) spec.log_file[s] = in.dir + "/" + names[s];
  }
  spec.max_line_bytes = opts.max_line_bytes;
  spec.merge_streams = in.merge_streams && spec.console[0] == spec.console[1] && spec.log_file[0].empty() &&
                       spec.log_file[1].empty();
  spec.prefix = worker_line_prefix(plan, opts, lr);
  // --duplicate-*-filters: the matching lines of tee'd ranks shown on the console also go
  // to one file of the attempt, shared by the node's ranks (torch's DefaultLogsSpecs).
  const char* filtered[2] = {"filtered_stdout.log", "filtered_stderr.log"};
  const auto slash = in.dir.find_last_of('/');
  const std::string attempt_dir = slash == std::string::npos ? "." : in.dir.substr(0, slash);
  for (int s = 0; s < 2; ++s) {
    if (opts.duplicate_filters[s].empty() || !shown || !opts.tee.covers(lr, which[s])) continue;
    std::string prefix = spec.prefix;  // ${pid} is unknown here: left out of the copy's prefix
    for (auto at = prefix.find(kPrefixPidMark); at != std::string::npos; at = prefix.find(kPrefixPidMark))
      prefix.erase(at, kPrefixPidMark.size());
    auto copy = std::make_shared<FilteredCopy>(attempt_dir + "/" + filtered[s], opts.duplicate_filters[s],
                                               std::move(prefix), spec.max_line_bytes);
    spec.tap[s] = [copy](std::string_view data, bool end) {
      if (end) copy->finish();
      else copy->feed(data);
    };
  }
  return spec;
}

}  // namespace mg
