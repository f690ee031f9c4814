// Which torch a Python worker will import, found without starting Python (a `python -c
// "import torch"` costs seconds): the torch/version.py of the first torch package on the
// module search path that interpreter builds: PYTHONPATH, a virtual environment's
// site-packages (pyvenv.cfg beside its bin/), the user's site-packages (PYTHONUSERBASE,
// PYTHONNOUSERSITE), then the installation's (Debian's dist-packages and the upstream
// site-packages), each site directory followed by what its .pth files add. The worker's
// environment follows it (torch 2.x reads TORCH_NCCL_ASYNC_ERROR_HANDLING and warns about
// the 1.x name). A heuristic by nature: nullopt when nothing is found.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <string_view>

namespace mg {

struct TorchVersion {
  int major = 0, minor = 0;
  std::string text;  // "2.6.0+debian", as version.py says it
  std::string path;  // the version.py read
};

// "__version__ = '2.6.0'" (version.py's line) -> 2, 6. nullopt when absent or malformed.
std::optional<TorchVersion> parse_torch_version_py(std::string_view text);

// `python`: the interpreter's absolute path, as the plan will exec it. `env`: the workers'
// environment (PYTHONPATH, HOME, PYTHONUSERBASE, PYTHONNOUSERSITE).
std::optional<TorchVersion> find_torch_version(const std::string& python, const std::map<std::string, std::string>& env);

// Where `python` would import `module` from (its top-level package: "torch" of
// "torch.distributed"), by the same search: a package directory, a .py file or an
// extension module (.so). nullopt when not found.
std::optional<std::string> find_python_module(const std::string& python, const std::map<std::string, std::string>& env,
                                              std::string_view module);

}  // namespace mg
