// The torch 2.6 peer (../shared/peers/torch2) for tests that compare with it or run its
// workers, and files those tests hand to its root (which shares /tmp, not the checkout).
#pragma once

#include <sys/stat.h>

#include <cstdlib>
#include <stdexcept>
#include <string>

#include "support/proc.h"
#include "support/skip.h"

namespace mgtest {

// The torch2 script, or a skip saying why it cannot run here.
inline std::string torch2_or_skip() {
  const std::string t2 = kSourceDir + "/../shared/peers/torch2";
  struct stat st{};
  if (::stat(t2.c_str(), &st) != 0) SKIP_TEST("torch 2.6 is not at ../shared/peers/torch2 (../shared is absent beside this checkout)");
  const char* root = std::getenv("TORCH2_ROOT");
  const std::string ready = std::string(root ? root : "/var/cache/mglaunch-peers/torch2-root") + "/.ready";
  if (::stat(ready.c_str(), &st) != 0) SKIP_TEST("the torch 2.6 root is not set up: run ../shared/peers/torch2 setup once (~2 min)");
  return t2;
}

// A copy of the checkout's `relative` file in a temporary directory, removed with it when
// the test binary exits (one copy per file and binary).
class TmpCopy {
 public:
  explicit TmpCopy(const std::string& relative) : dir_(make_temp_dir()) {
    path_ = dir_ + relative.substr(relative.rfind('/'));
    auto r = run({"/bin/cp", kSourceDir + "/" + relative, path_});
    if (r.code != 0) throw std::runtime_error("cannot copy " + relative + ": " + r.err);
  }
  ~TmpCopy() { run({"/bin/rm", "-rf", dir_}); }
  TmpCopy(const TmpCopy&) = delete;
  TmpCopy& operator=(const TmpCopy&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string dir_, path_;
};

}  // namespace mgtest
