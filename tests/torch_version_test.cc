// Which torch a Python worker imports (launcher/torch_version.h), on made-up layouts and on
// this machine's python3.
#include <filesystem>
#include <fstream>

#include <catch2/catch.hpp>

#include "launcher/torch_version.h"
#include "support/proc.h"
#include "support/skip.h"

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

// The same question asked of Python itself (importlib's find_spec, which imports nothing):
// for each layout, our answer is the package Python would import.
TEST_CASE("the torch found without Python is the one Python's own search finds: venv, user site, .pth") {
  require_program("/usr/bin/python3", "python3");
  namespace fs = std::filesystem;
  const std::string dir = make_temp_dir();
  auto r = run({"/usr/bin/python3", "-m", "venv", "--system-site-packages", "--without-pip", dir + "/venv"}, {},
               std::chrono::seconds(120));
  REQUIRE(r.code == 0);
  const std::string xy = [] {
    const std::string p = fs::canonical("/usr/bin/python3").string();
    return p.substr(p.rfind("python") + 6);
  }();
  auto fake_torch = [](const std::string& site, const std::string& version) {
    fs::create_directories(site + "/torch");
    std::ofstream(site + "/torch/__init__.py") << "";
    std::ofstream(site + "/torch/version.py") << "__version__ = '" << version << "'\n";
  };
  const std::string venv_site = dir + "/venv/lib/python" + xy + "/site-packages";
  const std::string user_site = dir + "/ub/lib/python" + xy + "/site-packages";
  const std::string python = dir + "/venv/bin/python";
  // What Python imports: the directory holding the torch package, "" when none.
  auto python_says = [&](const std::map<std::string, std::string>& env) {
    std::map<std::string, std::string> e = env;
    for (const char* k : {"PYTHONPATH", "PYTHONHOME", "PYTHONNOUSERSITE", "PYTHONUSERBASE"})
      if (!e.count(k)) e[k] = "\x01unset";
    auto out = run({python, "-c",
                    "import importlib.util, os; s = importlib.util.find_spec('torch'); "
                    "print(os.path.dirname(os.path.dirname(s.origin)) if s else '')"},
                   e, std::chrono::seconds(60));
    REQUIRE(out.code == 0);
    return fs::weakly_canonical(out.out.substr(0, out.out.find('\n'))).string();
  };
  auto we_say = [&](const std::map<std::string, std::string>& env) {
    auto v = find_torch_version(python, env);
    return v ? fs::weakly_canonical(fs::path(v->path).parent_path().parent_path()).string() : std::string{};
  };
  auto same = [&](const std::map<std::string, std::string>& env) {
    const std::string theirs = python_says(env), ours = we_say(env);
    INFO("python: " << theirs << "  ours: " << ours);
    CHECK(theirs == ours);
    return ours;
  };
  const std::map<std::string, std::string> user{{"HOME", dir}, {"PYTHONUSERBASE", dir + "/ub"}};
  fake_torch(venv_site, "2.5.0");
  fake_torch(user_site, "2.4.0");
  CHECK(same(user) == fs::weakly_canonical(venv_site).string());  // the venv's own comes first
  fs::remove_all(venv_site + "/torch");
  CHECK(same(user) == fs::weakly_canonical(user_site).string());  // then PYTHONUSERBASE's site
  auto no_user = user;
  no_user["PYTHONNOUSERSITE"] = "1";
  CHECK(same(no_user) != fs::weakly_canonical(user_site).string());  // the system's, or none
  // A .pth file in the venv's site-packages: a relative line, an import line skipped, a
  // comment; the directory it names comes before the user's site.
  fake_torch(dir + "/editable/src", "2.7.0");
  std::ofstream(venv_site + "/a_first.pth") << "# a comment\nimport os\n../../../../editable/src\n";
  CHECK(same(user) == fs::weakly_canonical(dir + "/editable/src").string());
  fs::remove(venv_site + "/a_first.pth");
  std::ofstream(user_site + "/b.pth") << dir + "/editable/src\n";  // an absolute line, in the user's site
  fs::remove_all(user_site + "/torch");
  CHECK(same(user) == fs::weakly_canonical(dir + "/editable/src").string());
  fs::remove_all(dir);
}
