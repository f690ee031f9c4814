// mgtrain's short synthetic runs under mglaunch, shared by the tests of the LibTorch the
// build found (mgtrain_ddp_test.cc) and those of LibTorch 2.6 inside the torch 2.6 peer's
// root (mgtrain_torch2_test.cc).
#pragma once

#include <catch2/catch.hpp>

#include <chrono>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "support/proc.h"
#include "support/skip.h"

namespace mgtest {

// mglaunch --standalone with `nproc` workers of `mgtrain` (512 synthetic samples, batch 16,
// seed 7) and `args`; `prefix` goes first (a peer root's `torch2 run`).
inline Result train_with(const std::vector<std::string>& prefix, const std::string& mgtrain, int nproc,
                         const std::vector<std::string>& args) {
  std::vector<std::string> argv = prefix;
  for (const std::string& a : std::vector<std::string>{kMglaunch, "--standalone", "--nproc_per_node=" + std::to_string(nproc),
                                                       mgtrain, "--dataset", "synthetic", "--synthetic-size", "512",
                                                       "--batch-size", "16", "--log-every", "0", "--seed", "7"})
    argv.push_back(a);
  argv.insert(argv.end(), args.begin(), args.end());
  auto r = run(argv, {}, std::chrono::seconds(240));
  INFO(r.err);
  return r;
}

// c10d::Reducer (--reducer c10d, Python DDP's engine) and ours train a rank-dependent branch
// on 2 ranks to bit-identical weights, equal on both ranks. With `may_skip`, skips where
// this mgtrain was built without --reducer c10d (a 2.x release its code does not fit).
inline void check_reducers_agree(const std::vector<std::string>& prefix, const std::string& mgtrain, bool may_skip) {
  std::string dir = make_temp_dir();
  const std::vector<std::string> common{"--model", "mlp-rank-branch", "--max-steps", "6", "--find-unused-parameters"};
  auto with = [&](std::vector<std::string> more) {
    more.insert(more.begin(), common.begin(), common.end());
    return more;
  };
  auto theirs = train_with(prefix, mgtrain, 2, with({"--reducer", "c10d", "--summary-json", dir + "/c{rank}.json"}));
  if (may_skip && theirs.code == 3 && theirs.err.find("--reducer c10d is not built into this mgtrain") != std::string::npos) {
    SKIP_TEST("this mgtrain is built without --reducer c10d (-DMGLAUNCH_C10D_REDUCER_V2=OFF)");
  }
  INFO(theirs.err);
  REQUIRE(theirs.code == 0);
  auto ours = train_with(prefix, mgtrain, 2, with({"--summary-json", dir + "/s{rank}.json"}));
  INFO(ours.err);
  REQUIRE(ours.code == 0);
  auto summary = [&](const std::string& name) { return nlohmann::json::parse(read_file(dir + "/" + name + ".json")); };
  CHECK(summary("c0")["weights_sha256"] == summary("s0")["weights_sha256"]);
  CHECK(summary("c1")["weights_sha256"] == summary("c0")["weights_sha256"]);
  CHECK(summary("s1")["weights_sha256"] == summary("s0")["weights_sha256"]);
}

}  // namespace mgtest
