// Which torch a Python worker imports (launcher/torch_version.h), on made-up layouts and on
// this machine's python3.
#include <filesystem>
#include <fstream>

#include <catch2/catch.hpp>

#include "launcher/torch_version.h"
#include "support/proc.h"

using namespace mg;
using namespace mgtest;

TEST_CASE("the torch a Python worker imports is read from its version.py, without running Python") {
  CHECK(parse_torch_version_py("import x\n__version__ = '2.6.0+debian'\ngit_version = 'x'\n")->major == 2);
  CHECK(parse_torch_version_py("__version__ = \"1.13.1\"")->minor == 13);
  CHECK_FALSE(parse_torch_version_py("version = '2.6.0'").has_value());
  const std::string dir = make_temp_dir();
  // A virtual environment: bin/python (a link to the system's), pyvenv.cfg, its own torch.
  std::filesystem::create_directories(dir + "/venv/bin");
  const std::string sys_python = std::filesystem::canonical("/usr/bin/python3").string();
  const std::string xy = sys_python.substr(sys_python.rfind("python") + 6);  // "3.11"
  std::filesystem::create_symlink(sys_python, dir + "/venv/bin/python");
  auto write = [](const std::string& path, const std::string& text) {
    std::filesystem::create_directories(std::filesystem::path(path).parent_path());
    std::ofstream(path) << text;
  };
  write(dir + "/venv/pyvenv.cfg", "home = /usr/bin\ninclude-system-site-packages = false\nversion = " + xy + ".2\n");
  write(dir + "/venv/lib/python" + xy + "/site-packages/torch/version.py", "__version__ = '2.5.1'\n");
  auto v = find_torch_version(dir + "/venv/bin/python", {});
  REQUIRE(v.has_value());
  CHECK(v->text == "2.5.1");
  // PYTHONPATH comes first.
  write(dir + "/pp/torch/version.py", "__version__ = '2.9.0'\n");
  CHECK(find_torch_version(dir + "/venv/bin/python", {{"PYTHONPATH", "/nonexistent:" + dir + "/pp"}})->major == 2);
  CHECK(find_torch_version(dir + "/venv/bin/python", {{"PYTHONPATH", dir + "/pp"}})->text == "2.9.0");
  // No venv, no torch anywhere on the path: unknown.
  CHECK_FALSE(find_torch_version("/bin/sh", {}).has_value());
  // The system's python3 with Debian's python3-torch: what `import torch` says.
  if (python_has_torch()) {
    auto r = run({"/usr/bin/python3", "-c", "import torch; print(torch.__version__)"}, {}, std::chrono::seconds(120));
    auto sys = find_torch_version("/usr/bin/python3", {{"HOME", dir}});
    REQUIRE(sys.has_value());
    CHECK(sys->text + "\n" == r.out);
  }
  std::filesystem::remove_all(dir);
}
