// Workers as mglaunch starts them (the spawner itself: process_spawn_test.cc): an exec
// failure is the run's root cause with exit 127, and a large run ends with every worker
// reaped. Real processes, every wait bounded.
#include <catch2/catch.hpp>

#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "support/proc.h"
#include "support/skip.h"

using namespace mgtest;
using namespace std::chrono_literals;

namespace {

// pid is alive or a zombie, and its command name is `comm` (not a pid that came round to
// another program). A zombie keeps its name in stat (its cmdline is empty).
bool runs(pid_t pid, const std::string& comm) {
  return read_file("/proc/" + std::to_string(pid) + "/stat").find("(" + comm + ")") != std::string::npos;
}

}  // namespace

TEST_CASE("a worker whose program cannot be exec'd fails the run with exit 127 and one root cause naming the exec "
          "error") {
  const std::string dir = make_temp_dir();
  const std::string garbage = dir + "/garbage";
  std::ofstream(garbage) << std::string("\x01\x02\x03 not a program\n");
  REQUIRE(::chmod(garbage.c_str(), 0755) == 0);
  auto r = run({kMglaunch, "--standalone", "--nproc_per_node=3", "--no_python", garbage}, {}, 60s);
  INFO(r.out << r.err);
  CHECK(r.code == 127);
  CHECK(r.err.find("message    : cannot start " + garbage + ": execve: Exec format error") != std::string::npos);
  CHECK(r.err.find("exitcode   : 127") != std::string::npos);
  CHECK(r.err.find("error_file") == std::string::npos);  // it never ran: no error file to name
}

TEST_CASE("a run of 1000 workers starts every one and ends with every one reaped") {
  const std::string dir = make_temp_dir();
  const std::string pids = dir + "/pids";
  auto r = run({kMglaunch, "--standalone", "--nproc_per_node=1000", "--no_python", kFakeWorker, "pidfile", pids}, {},
               300s);
  INFO(r.err.substr(0, 2000));
  REQUIRE(r.code == 0);
  const auto started = read_pids(pids);
  CHECK(started.size() == 1000);
  CHECK(std::set<pid_t>(started.begin(), started.end()).size() == 1000);
  // The agent exits 0 only once it has reaped each (it counts the exits it reaped), and
  // none is left behind: no worker still runs, none is a zombie (a pid that came round to
  // another program does not count).
  std::vector<pid_t> left;
  const bool none_left = eventually(
      [&] {
        left.clear();
        for (pid_t p : started)
          if (runs(p, "fake_worker")) left.push_back(p);
        return left.empty();
      },
      30s);
  INFO(left.size() << " workers still present, the first " << (left.empty() ? 0 : left.front()) << ": "
                   << (left.empty() ? "" : read_file("/proc/" + std::to_string(left.front()) + "/stat")));
  CHECK(none_left);
  CHECK(r.err.find("Too many open files") == std::string::npos);
}

TEST_CASE("a standalone run with a rendezvous token completes (OpenSSL linked as usual)") {
  auto r = run({kMglaunch, "--standalone", "--nproc_per_node=1", "--no_python", "/bin/true"},
               {{"MGLAUNCH_RDZV_TOKEN", "a-secret"}}, 60s);
  INFO(r.out << r.err);
  CHECK(r.code == 0);
}

TEST_CASE("a test's process handle removes its output files and their directory when it goes, leaving $TMPDIR as it was") {
  std::string dir;
  {
    Proc p = spawn({kFakeWorker, "print", "hello"});
    REQUIRE(p.wait(30s));
    CHECK_THAT(p.out(), Catch::Contains("hello"));
    dir = p.out_path.substr(0, p.out_path.rfind('/'));
    struct stat st{};
    REQUIRE(::stat(dir.c_str(), &st) == 0);
    Proc moved(std::move(p));  // one owner: the moved-from handle removes nothing
  }
  struct stat st{};
  CHECK(::stat(dir.c_str(), &st) != 0);
}

TEST_CASE("a failed run's log tree, kept by mglaunch in the TMPDIR of the test's process handle, goes with the handle: nothing in /dev/shm or /tmp") {
  std::string kept;
  {
    // A failed run keeps its error files (logs/log_layout.h) and says where.
    Proc p = spawn(launch({"--standalone", "--nproc_per_node=1"}, {"error-file", "boom", "exit", "3"}));
    REQUIRE(p.wait(60s));
    CHECK(p.exit_code() == 3);
    const std::string err = p.err();
    INFO(err);
    const auto at = err.find("kept in ");
    REQUIRE(at != std::string::npos);
    kept = err.substr(at + 8, err.find_first_of(" \n", at + 8) - at - 8);
    struct stat st{};
    REQUIRE(::stat(kept.c_str(), &st) == 0);
  }
  INFO(kept);
  struct stat st{};
  CHECK(::stat(kept.c_str(), &st) != 0);
}

// The helper the next test runs in a process of its own (hidden: not part of the suite).
TEST_CASE("test helper: make a temporary directory and a process handle, and print the directory", "[.helper]") {
  const std::string dir = make_temp_dir();
  std::ofstream(dir + "/a-file") << "x";
  Proc p = spawn({kFakeWorker, "exit", "0"});
  REQUIRE(p.wait(30s));
  std::cout << "dir=" << dir << std::endl;
}

TEST_CASE("a test process's temporary directories go when it exits, and a dead test process's are removed by the "
          "next one, but a root of another pid namespace or boot, or of another name, is never touched") {
  const std::string base = make_temp_dir();  // the child's TMPDIR
  // A root of a test process that is gone (its pid reaped), and one of a live process (ours).
  Proc gone = spawn({kFakeWorker, "hang", "30"});
  const std::string gone_name = test_root_name_for(gone.pid);
  ::kill(gone.pid, SIGKILL);
  REQUIRE(gone.wait(30s));
  const std::string dead_root = base + "/" + gone_name + "AbCdEf";
  const std::string live_root = base + "/" + test_root_name_for(::getpid()) + "AbCdEf";
  // A pid that is gone here, in another container's root (another pid namespace) or
  // another boot's, or in a name of the old form (no realm): none of them provably ours.
  const std::string realm = gone_name.substr(gone_name.find('-', gone_name.find('-', 7) + 1) + 1);  // NS-BOOT-
  const std::string pid_start = gone_name.substr(0, gone_name.size() - realm.size());          // mgtest-PID-START-
  const std::string other_ns = base + "/" + pid_start + "1" + realm.substr(realm.find('-')) + "AbCdEf";
  const std::string other_boot = base + "/" + pid_start + realm.substr(0, realm.find('-')) + "-00000000-AbCdEf";
  const std::string old_form = base + "/mgtest-" + std::to_string(gone.pid) + "-AbCdEf";
  CHECK(test_root_is_dead(std::filesystem::path(dead_root).filename().string()));
  for (const auto& d : {dead_root, live_root, other_ns, other_boot, old_form}) {
    std::filesystem::create_directories(d + "/mgtest_x");
    std::ofstream(d + "/mgtest_x/f") << "x";
  }
  char self[4096] = {};
  const ssize_t n = ::readlink("/proc/self/exe", self, sizeof(self) - 1);
  REQUIRE(n > 0);
  auto child = run({std::string(self, static_cast<std::size_t>(n)), "test helper: make a temporary directory*"},
                   {{"TMPDIR", base}}, 60s);
  INFO(child.out << child.err);
  REQUIRE(child.code == 0);
  const auto at = child.out.find("dir=");
  REQUIRE(at != std::string::npos);
  const std::string made = child.out.substr(at + 4, child.out.find('\n', at) - at - 4);
  CHECK(made.rfind(base + "/mgtest-", 0) == 0);
  struct stat st{};
  CHECK(::stat(made.c_str(), &st) != 0);      // gone with its process
  CHECK(::stat(dead_root.c_str(), &st) != 0);  // swept: its process is gone
  CHECK(::stat(live_root.c_str(), &st) == 0);  // kept: its process runs
  std::set<std::string> left;
  for (const auto& e : std::filesystem::directory_iterator(base)) left.insert(e.path().filename().string());
  std::set<std::string> kept;
  for (const auto& d : {live_root, other_ns, other_boot, old_form}) kept.insert(std::filesystem::path(d).filename().string());
  CHECK(left == kept);
}
