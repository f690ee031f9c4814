// Where a run keeps its files (logs/log_layout.h), in a temporary directory of the test's own.
#include <catch2/catch.hpp>

#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>

#include "cli/errors.h"
#include "logs/filtered_copy.h"
#include "logs/log_layout.h"
#include "support/proc.h"

using namespace mg;
namespace fs = std::filesystem;

namespace {

struct TempDir {
  std::string path;
  TempDir() : path(mgtest::make_temp_dir()) {}
  ~TempDir() {
    std::error_code ec;
    fs::permissions(path, fs::perms::owner_all, fs::perm_options::add, ec);
    fs::remove_all(path, ec);
  }
};

LogLayoutOptions options(const std::string& log_dir, const std::string& rdzv_id = "job7") {
  LogLayoutOptions o;
  o.log_dir = log_dir;
  o.rdzv_id = rdzv_id;
  o.run_id = rdzv_id == "none" ? "abc123" : rdzv_id;
  o.time_text = "2026-11-23_16:40:00";
  return o;
}

void touch(const std::string& path) {
  fs::create_directories(fs::path(path).parent_path());
  std::ofstream(path) << "x";
}

}  // namespace

TEST_CASE("a named run keeps its files under the log directory by run id and attempt") {
  TempDir t;
  LogLayout l;
  const std::string notice = l.create(options(t.path + "/logs"));
  CHECK(notice == "log directory: " + l.run_dir() + " (newest run of job7: " + t.path + "/logs/job7)");
  CHECK(fs::path(l.run_dir()).parent_path() == t.path + "/logs");
  CHECK(fs::path(l.run_dir()).filename().string().starts_with("job7_2026-11-23_16:40:00_"));
  CHECK(fs::is_directory(l.run_dir()));
  CHECK(l.attempt_dir(2, 5) == l.run_dir() + "/attempt_2/5");
  CHECK(l.kept());
  CHECK(l.finish(1).empty());
}

TEST_CASE("a reused run id gets a new directory per run and its name links to the newest (#22)") {
  TempDir t;
  const std::string logs = t.path + "/logs";
  std::string first;
  {
    LogLayout a;
    a.create(options(logs));
    first = a.run_dir();
    touch(a.attempt_dir(0, 0) + "/stdout.log");
    touch(a.attempt_dir(2, 0) + "/stdout.log");
  }
  LogLayout b;
  b.create(options(logs));
  CHECK(b.run_dir() != first);
  // The last run's files are untouched and apart from the new run's.
  CHECK(fs::exists(first + "/attempt_0/0/stdout.log"));
  CHECK(fs::exists(first + "/attempt_2/0/stdout.log"));
  CHECK_FALSE(fs::exists(b.run_dir() + "/attempt_2"));
  // {log_dir}/{id} is a relative link to the newest run (the documented path keeps working).
  CHECK(fs::is_symlink(logs + "/job7"));
  CHECK(fs::read_symlink(logs + "/job7") == fs::path(b.run_dir()).filename());
  CHECK(fs::equivalent(logs + "/job7", b.run_dir()));
  // No temporary link is left behind.
  int entries = 0;
  for ([[maybe_unused]] const auto& e : fs::directory_iterator(logs)) ++entries;
  CHECK(entries == 3);
  // An id with '/' in it gets its directories made.
  LogLayout c;
  c.create(options(logs, "team/exp1"));
  CHECK(fs::equivalent(logs + "/team/exp1", c.run_dir()));
}

TEST_CASE("a directory named as the run id (an older mglaunch's run) is left as it is") {
  TempDir t;
  touch(t.path + "/job7/attempt_0/0/stdout.log");
  LogLayout l;
  CHECK_THAT(l.create(options(t.path)), Catch::Contains("is not a link"));
  CHECK(fs::exists(t.path + "/job7/attempt_0/0/stdout.log"));
  CHECK(fs::is_directory(l.run_dir()));
}

TEST_CASE("the default run id gets a directory of its own per run so a re-run never overwrites the last") {
  TempDir t;
  LogLayout a, b;
  const std::string na = a.create(options(t.path, "none"));
  const std::string nb = b.create(options(t.path, "none"));
  CHECK(a.run_dir() != b.run_dir());
  CHECK(fs::path(a.run_dir()).filename().string().starts_with("abc123_2026-11-23_16:40:00_"));
  CHECK(na == "log directory: " + a.run_dir());
  CHECK(nb == "log directory: " + b.run_dir());
}

TEST_CASE("a log directory that cannot be written is a usage error naming --log_dir") {
  if (::geteuid() == 0) {
    // root writes anywhere: a path under a regular file cannot be created by anyone.
    TempDir t;
    touch(t.path + "/file");
    LogLayout l;
    CHECK_THROWS_WITH(l.create(options(t.path + "/file/logs")), Catch::Contains("--log_dir") &&
                                                                     Catch::Contains("pick a directory you can write to"));
    return;
  }
  TempDir t;
  fs::permissions(t.path, fs::perms::owner_read | fs::perms::owner_exec);
  LogLayout l;
  CHECK_THROWS_AS(l.create(options(t.path + "/logs")), UsageError);
}

TEST_CASE("without a log directory the files go to a temporary one removed at the end of a good run") {
  TempDir t;
  auto o = options("");
  o.tmpdir = t.path;
  std::string root;
  {
    LogLayout l;
    CHECK(l.create(o).empty());  // nothing to show: nothing goes to files
    root = l.root();
    CHECK(fs::path(root).parent_path() == t.path);
    CHECK(l.run_dir() == root + "/job7");
    CHECK_FALSE(l.kept());
    touch(l.attempt_dir(0, 0) + "/stdout.log");
    CHECK(l.finish(0).empty());
  }
  CHECK_FALSE(fs::exists(root));
}

TEST_CASE("a failed run keeps its temporary directory when a worker left a file there") {
  TempDir t;
  auto o = options("");
  o.tmpdir = t.path;
  std::string root;
  {
    LogLayout l;
    l.create(o);
    root = l.root();
    touch(l.attempt_dir(0, 1) + "/error.json");
    CHECK(l.finish(3) == "this run failed: its error files and logs are kept in " + root);
    CHECK(l.kept());
  }
  CHECK(fs::exists(root + "/job7/attempt_0/1/error.json"));
}

TEST_CASE("a failed run that left no file removes its temporary directory") {
  TempDir t;
  auto o = options("");
  o.tmpdir = t.path;
  std::string root;
  {
    LogLayout l;
    l.create(o);
    root = l.root();
    fs::create_directories(l.attempt_dir(0, 0));
    CHECK(l.finish(1).empty());
  }
  CHECK_FALSE(fs::exists(root));
}

TEST_CASE("output redirected to files keeps the temporary directory and says where it is") {
  TempDir t;
  auto o = options("");
  o.tmpdir = t.path;
  o.files_wanted = true;
  std::string root;
  {
    LogLayout l;
    const std::string text = l.create(o);
    root = l.root();
    CHECK(text == "log directory: " + root);
    CHECK(l.kept());
  }
  CHECK(fs::exists(root));
}

namespace {

// TMPDIR unset for one test, restored after it (the defaults below depend on it).
struct NoTmpdirEnv {
  std::optional<std::string> saved;
  NoTmpdirEnv() {
    if (const char* v = std::getenv("TMPDIR")) saved = v;
    ::unsetenv("TMPDIR");
  }
  ~NoTmpdirEnv() {
    if (saved) ::setenv("TMPDIR", saved->c_str(), 1);
    else ::unsetenv("TMPDIR");  // a test that set it leaves no TMPDIR behind (its directory is gone)
  }
};

}  // namespace

TEST_CASE("with TMPDIR unset a run without output files keeps its error files in memory, under the shm directory") {
  TempDir t;
  NoTmpdirEnv no_tmpdir;
  auto o = options("");
  o.shm_dir = t.path;  // stands in for /dev/shm
  std::string root;
  {
    LogLayout l;
    CHECK(l.create(o).empty());
    root = l.root();
    CHECK(fs::path(root).parent_path() == t.path);
    CHECK(fs::path(root).filename().string().starts_with("mglaunch_"));
    touch(l.attempt_dir(0, 0) + "/error.json");
    CHECK(l.finish(1) == "this run failed: its error files and logs are kept in " + root);
  }
  CHECK(fs::exists(root + "/job7/attempt_0/0/error.json"));
}

TEST_CASE("with TMPDIR unset and no usable shm directory the temporary directory goes to /tmp") {
  TempDir t;
  NoTmpdirEnv no_tmpdir;
  auto o = options("");
  o.shm_dir = t.path + "/missing";
  std::string root;
  {
    LogLayout l;
    l.create(o);
    root = l.root();
    CHECK(fs::path(root).parent_path() == "/tmp");
    CHECK(l.finish(0).empty());
  }
  CHECK_FALSE(fs::exists(root));
}

TEST_CASE("with TMPDIR unset output redirected to files goes to /tmp, not to memory") {
  TempDir t;
  NoTmpdirEnv no_tmpdir;
  auto o = options("");
  o.shm_dir = t.path;
  o.files_wanted = true;
  LogLayout l;
  l.create(o);
  const std::string root = l.root();
  CHECK(fs::path(root).parent_path() == "/tmp");
  CHECK(l.kept());
  std::error_code ec;
  fs::remove_all(root, ec);
}

TEST_CASE("a TMPDIR that is set wins over the shm directory") {
  TempDir t, shm;
  NoTmpdirEnv no_tmpdir;
  ::setenv("TMPDIR", t.path.c_str(), 1);
  auto o = options("");
  o.shm_dir = shm.path;
  LogLayout l;
  l.create(o);
  CHECK(fs::path(l.root()).parent_path() == t.path);
}

TEST_CASE("the filtered copy holds the matching lines of every rank that feeds it, prefixed, each whole") {
  TempDir tmp;
  const std::string file = tmp.path + "/filtered_stdout.log";
  {
    FilteredCopy r0(file, {"apple", "orange,pear"}, "[rank0]:", 64);
    FilteredCopy r1(file, {"apple", "orange,pear"}, "[rank1]:", 64);
    r0.feed("no fruit\n");
    CHECK_FALSE(fs::exists(file));  // nothing matched yet: no file
    r0.feed("an apple a day\nno fruit\nhalf an ap");
    r1.feed("orange,pear juice\n");
    r0.feed("ple\n");  // the line completes across reads
    r1.feed("last apple, no newline");
    r1.finish();
    r0.finish();
    CHECK(r0.error().empty());
  }
  std::ifstream in(file);
  std::stringstream got;
  got << in.rdbuf();
  CHECK(got.str() ==
        "[rank0]:an apple a day\n[rank1]:orange,pear juice\n[rank0]:half an apple\n[rank1]:last apple, no newline\n");
  FilteredCopy bad(tmp.path + "/no/such/dir/f.log", {"x"}, "", 64);
  bad.feed("x\n");
  CHECK_THAT(bad.error(), Catch::Contains("cannot open"));
}

TEST_CASE("a run under the shm directory removes the empty trees of dead agents of its pid namespace, nothing else") {
  TempDir t;
  NoTmpdirEnv no_tmpdir;
  // A pid that was ours and is gone (an agent SIGKILLed together with its watchdog).
  struct {
    pid_t pid = -1;
  } gone;
  gone.pid = ::fork();
  REQUIRE(gone.pid >= 0);
  if (gone.pid == 0) ::_exit(0);
  int status = 0;
  REQUIRE(::waitpid(gone.pid, &status, 0) == gone.pid);
  const std::string ns = fs::read_symlink("/proc/self/ns/pid").string();
  auto tree = [&](const std::string& name, const std::string& owner) {
    const std::string root = t.path + "/" + name;
    fs::create_directories(root + "/recovery/attempt_0/0");
    if (!owner.empty()) std::ofstream(root + "/.mglaunch-agent") << owner << "\n";
    return root;
  };
  const std::string dead = tree("mglaunch_dead01", std::to_string(gone.pid) + " " + ns);
  const std::string alive = tree("mglaunch_live01", std::to_string(::getpid()) + " " + ns);
  const std::string files = tree("mglaunch_file01", std::to_string(gone.pid) + " " + ns);
  touch(files + "/recovery/attempt_0/0/error.json");  // a failed run's error file: kept
  const std::string other_ns = tree("mglaunch_ns0001", std::to_string(gone.pid) + " pid:[1]");
  const std::string no_owner = tree("mglaunch_old001", "");
  const std::string not_ours = tree("other_dead01", std::to_string(gone.pid) + " " + ns);
  auto o = options("");
  o.shm_dir = t.path;
  std::string root;
  {
    LogLayout l;
    CHECK(l.create(o).empty());
    root = l.root();
    CHECK_FALSE(fs::exists(dead));
    for (const auto& kept : {alive, files, other_ns, no_owner, not_ours}) CHECK(fs::exists(kept));
    // Its own tree names it, and a failed run without files still leaves nothing behind.
    std::ifstream owner(root + "/.mglaunch-agent");
    long long pid = 0;
    std::string their_ns;
    REQUIRE(owner >> pid >> their_ns);
    CHECK(pid == ::getpid());
    CHECK(their_ns == ns);
    CHECK(l.finish(1).empty());
  }
  CHECK_FALSE(fs::exists(root));
}
