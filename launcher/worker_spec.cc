#include "launcher/worker_spec.h"

#include <algorithm>

#include <fmt/format.h>

#include "launcher/line_splitter.h"
#include "launcher/watchdog.h"

namespace mg {

WorkerSpec make_worker_spec(const RunPlan& plan, const AgentOptions& opts, const EnvMap& base_env, const SpecInputs& in) {
  const int lr = in.local_rank;
  WorkerSpec spec;
  spec.local_rank = lr;
  spec.rank = plan.rank_offset + lr;
  spec.executable = plan.executable;
  spec.argv = build_worker_argv(plan, opts, lr);
  EnvMap env = base_env;
  for (auto& [k, v] : build_contract_env(plan, opts, base_env, lr, in.attempt, in.dir + "/error.json")) env[k] = v;
  if (!in.run_mark.empty()) env[kRunMarkVar] = in.run_mark;
  spec.env.reserve(env.size());
  for (const auto& [k, v] : env) spec.env.push_back(k + "=" + v);
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
