#include "launcher/torch_version.h"

#include <algorithm>
#include <cctype>
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

// The directories a site directory's .pth files add, in site.addpackage's order.
std::vector<fs::path> pth_dirs(const fs::path& site) {
  std::error_code ec;
  std::vector<fs::path> pth;
  for (fs::directory_iterator it(site, ec), end; !ec && it != end && pth.size() < 256; it.increment(ec))
    if (it->path().extension() == ".pth") pth.push_back(it->path());
  std::sort(pth.begin(), pth.end());
  std::vector<fs::path> out;
  for (const fs::path& f : pth) {
    std::istringstream lines(read_small(f));
    for (std::string line; std::getline(lines, line) && out.size() < 256;) {
      while (!line.empty() && std::isspace(static_cast<unsigned char>(line.back()))) line.pop_back();
      if (line.empty() || line.front() == '#' || line.rfind("import ", 0) == 0 || line.rfind("import\t", 0) == 0)
        continue;
      const fs::path d = site / line;  // an absolute line stays absolute
      if (fs::exists(d, ec)) out.push_back(d);
    }
  }
  return out;
}

}  // namespace

namespace {

// The directories `python` searches for modules, in order (see the header), each given to
// `visit` until it returns a value.
template <typename T, typename Visit>
std::optional<T> first_on_search_path(const std::string& python, const std::map<std::string, std::string>& env,
                                      Visit&& visit) {
  std::vector<fs::path> dirs;
  if (auto it = env.find("PYTHONPATH"); it != env.end()) {
    std::string_view rest = it->second;
    while (!rest.empty()) {
      const auto colon = rest.find(':');
      if (auto d = rest.substr(0, colon); !d.empty()) dirs.emplace_back(d);
      rest = colon == std::string_view::npos ? std::string_view{} : rest.substr(colon + 1);
    }
  }
  const std::size_t pythonpath_dirs = dirs.size();
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
    // site.py: the user's site-packages under PYTHONUSERBASE (default ~/.local), unless
    // PYTHONNOUSERSITE is set to a non-empty value.
    auto get = [&env](const char* k) {
      auto it = env.find(k);
      return it == env.end() ? std::string{} : it->second;
    };
    if (get("PYTHONNOUSERSITE").empty()) {
      fs::path base = get("PYTHONUSERBASE");
      if (base.empty() && !get("HOME").empty()) base = fs::path(get("HOME")) / ".local";
      if (!base.empty()) dirs.push_back(base / "lib" / lib / "site-packages");
    }
    std::error_code ec;
    const fs::path real = fs::canonical(given, ec);
    const fs::path prefix = (ec ? given : real).parent_path().parent_path();  // /usr of /usr/bin/python3.11
    for (const fs::path& d : {prefix / "local" / "lib" / lib / "dist-packages", prefix / "lib" / "python3" / "dist-packages",
                              prefix / "lib" / lib / "dist-packages", prefix / "lib" / lib / "site-packages"})
      dirs.push_back(d);
  }
  // A site directory's .pth files add directories right after it (site.addsitedir: the
  // files in name order, a line per directory relative to the site directory; lines
  // starting with "import" run code, which is not followed: a modern editable install's
  // finder is not seen).
  for (std::size_t i = 0; i < dirs.size() && i < 4096; ++i) {
    if (auto v = visit(dirs[i])) return v;
    if (i < pythonpath_dirs) continue;  // PYTHONPATH entries are not site directories
    const std::vector<fs::path> extra = pth_dirs(dirs[i]);
    dirs.insert(dirs.begin() + static_cast<std::ptrdiff_t>(i) + 1, extra.begin(), extra.end());
  }
  return std::nullopt;
}

}  // namespace

std::optional<TorchVersion> find_torch_version(const std::string& python, const std::map<std::string, std::string>& env) {
  return first_on_search_path<TorchVersion>(python, env, [](const fs::path& d) { return in_dir(d); });
}

std::optional<std::string> find_python_module(const std::string& python, const std::map<std::string, std::string>& env,
                                              std::string_view module) {
  const std::string top(module.substr(0, module.find('.')));
  if (top.empty()) return std::nullopt;
  return first_on_search_path<std::string>(python, env, [&](const fs::path& d) -> std::optional<std::string> {
    std::error_code ec;
    if (fs::is_directory(d / top, ec)) return (d / top).string();  // a package (a namespace package too)
    if (fs::is_regular_file(d / (top + ".py"), ec)) return (d / (top + ".py")).string();
    for (fs::directory_iterator it(d, ec), end; !ec && it != end; it.increment(ec)) {  // an extension module
      const std::string name = it->path().filename().string();
      if (name.starts_with(top + ".") && name.ends_with(".so")) return it->path().string();
    }
    return std::nullopt;
  });
}

}  // namespace mg
