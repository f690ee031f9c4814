#include "launcher/worker_spec.h"

#include <algorithm>

#include <fmt/format.h>

#include "logs/line_splitter.h"
#include "launcher/watchdog.h"

namespace mg {

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
    spec.console[s] = shown && !opts.redirects.covers(lr, which[s]);
    if (opts.redirects.covers(lr, which[s]) || opts.tee.covers(lr, which[s])) spec.log_file[s] = in.dir + "/" + names[s];
  }
  spec.max_line_bytes = opts.max_line_bytes;
  spec.merge_streams = in.merge_streams && spec.console[0] == spec.console[1] && spec.log_file[0].empty() &&
                       spec.log_file[1].empty();
  spec.prefix = opts.log_line_prefix_template
                    ? expand_line_prefix(*opts.log_line_prefix_template, opts.role, spec.rank, lr)
                    : fmt::format("[rank{}]:", spec.rank);
  return spec;
}

}  // namespace mg
