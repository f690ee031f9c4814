#include "launcher/torch_version.h"

#include <charconv>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <vector>

namespace mg {

namespace fs = std::filesystem;

std::optional<TorchVersion> parse_torch_version_py(std::string_view text) {
  static const std::regex kLine(R"(^__version__\s*=\s*['"]((\d+)\.(\d+)[^'"]*)['"])", std::regex::multiline);
  std::match_results<std::string_view::const_iterator> m;
  if (!std::regex_search(text.begin(), text.end(), m, kLine)) return std::nullopt;
  TorchVersion v;
  v.text = m[1].str();
  const std::string major = m[2].str(), minor = m[3].str();
  std::from_chars(major.data(), major.data() + major.size(), v.major);
  std::from_chars(minor.data(), minor.data() + minor.size(), v.minor);
  return v;
}

namespace {

std::string read_small(const fs::path& p) {
  std::ifstream f(p);
  std::ostringstream s;
  if (f) s << f.rdbuf();
  return s.str().substr(0, 1 << 16);
}

std::optional<TorchVersion> in_dir(const fs::path& dir) {
  std::error_code ec;
  const fs::path v = dir / "torch" / "version.py";
  if (!fs::is_regular_file(v, ec)) return std::nullopt;
  auto t = parse_torch_version_py(read_small(v));
  if (t) t->path = v.string();
  return t;
}

// "X.Y" of the interpreter: from its resolved file name (python3.11) or a venv's pyvenv.cfg.
std::string python_xy(const fs::path& python, const std::string& venv_cfg) {
  std::error_code ec;
  const std::string name = fs::canonical(python, ec).filename().string();
  static const std::regex kName(R"(^python(\d+\.\d+))");
  std::smatch m;
  if (std::regex_search(name, m, kName)) return m[1].str();
  static const std::regex kCfg(R"((?:^|\n)\s*version(?:_info)?\s*=\s*(\d+\.\d+))");
  if (std::regex_search(venv_cfg, m, kCfg)) return m[1].str();
  return {};
}

}  // namespace

std::optional<TorchVersion> find_torch_version(const std::string& python, const std::map<std::string, std::string>& env) {
  std::vector<fs::path> dirs;
  if (auto it = env.find("PYTHONPATH"); it != env.end()) {
    std::string_view rest = it->second;
    while (!rest.empty()) {
      const auto colon = rest.find(':');
      if (auto d = rest.substr(0, colon); !d.empty()) dirs.emplace_back(d);
      rest = colon == std::string_view::npos ? std::string_view{} : rest.substr(colon + 1);
    }
  }
  const fs::path given(python);
  const fs::path venv = given.parent_path().parent_path();
  const std::string cfg = read_small(venv / "pyvenv.cfg");
  const std::string xy = python_xy(given, cfg);
  if (xy.empty()) return std::nullopt;
  const std::string lib = "python" + xy;
  bool system_site = true;
  if (!cfg.empty()) {
    dirs.push_back(venv / "lib" / lib / "site-packages");
    system_site = cfg.find("include-system-site-packages = true") != std::string::npos;
  }
  if (system_site) {
    if (auto home = env.find("HOME"); home != env.end() && !env.count("PYTHONNOUSERSITE"))
      dirs.push_back(fs::path(home->second) / ".local" / "lib" / lib / "site-packages");
    std::error_code ec;
    const fs::path real = fs::canonical(given, ec);
    const fs::path prefix = (ec ? given : real).parent_path().parent_path();  // /usr of /usr/bin/python3.11
    for (const fs::path& d : {prefix / "local" / "lib" / lib / "dist-packages", prefix / "lib" / "python3" / "dist-packages",
                              prefix / "lib" / lib / "dist-packages", prefix / "lib" / lib / "site-packages"})
      dirs.push_back(d);
  }
  for (const auto& d : dirs)
    if (auto v = in_dir(d)) return v;
  return std::nullopt;
}

}  // namespace mg
