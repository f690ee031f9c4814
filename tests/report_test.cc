// The reporting unit: root-cause block, --summary-json document, error-file reader.
#include <catch2/catch.hpp>

#include <signal.h>
#include <stdlib.h>
#include <sys/resource.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "launcher/report.h"
#include "support/proc.h"

using namespace mg;

namespace {

std::string temp_file(const std::string& content) {
  char path[] = "/tmp/mgreport_XXXXXX";
  int fd = ::mkstemp(path);
  REQUIRE(fd >= 0);
  ::close(fd);
  std::ofstream(path) << content;
  return path;
}

}  // namespace

TEST_CASE("the error file's message is read in both torchelastic layouts, and nothing from garbage") {
  const auto nested = temp_file(R"({"message": {"message": "boom", "extraInfo": {"timestamp": "0"}}})");
  const auto flat = temp_file(R"({"message": "flat boom"})");
  const auto other = temp_file(R"({"message": {"code": 3}})");
  const auto garbage = temp_file("not json {");
  CHECK(read_error_file_message(nested) == "boom");
  CHECK(read_error_file_message(flat) == "flat boom");
  CHECK(read_error_file_message(other) == R"({"code":3})");
  CHECK(read_error_file_message(garbage).empty());
  CHECK(read_error_file_message("/no/such/error.json").empty());
  for (const auto& p : {nested, flat, other, garbage}) ::unlink(p.c_str());
}

TEST_CASE("a root cause names its error file only when the file exists, also for a worker that never ran") {
  WorkerOutcome o;
  o.exit_code = 127;
  // A spawn failure: the message says why, and no error file was ever written.
  auto rc = worker_root_cause(o, "node-a", "/no/such/attempt_0/0/error.json", "cannot start x: execve: failed", {});
  CHECK(rc.message == "cannot start x: execve: failed");
  CHECK(rc.error_file.empty());
  CHECK_THAT(format_root_cause(rc, "x"), !Catch::Contains("error_file"));
  // A worker that wrote one: named, its message read.
  const auto written = temp_file(R"({"message": "kept"})");
  rc = worker_root_cause(o, "node-a", written, "", {});
  CHECK(rc.error_file == written);
  CHECK(rc.message == "kept");
  // Neither: nothing named.
  CHECK(worker_root_cause(o, "node-a", "/no/such/error.json", "", {}).error_file.empty());
  ::unlink(written.c_str());
}

TEST_CASE("a process limit that stops a worker from starting is named with its values and how to raise it") {
  const auto text = process_limit_text(150, 300);
  CHECK_THAT(text, Catch::Contains("RLIMIT_NPROC") && Catch::Contains("`ulimit -u`") && Catch::Contains("is 150") &&
                       Catch::Contains("hard limit 300") && Catch::Contains("pids.max") &&
                       Catch::Contains("/etc/security/limits.conf") && Catch::Contains("start fewer workers"));
  CHECK_THAT(process_limit_text(RLIM_INFINITY, RLIM_INFINITY), Catch::Contains("is unlimited and its hard limit unlimited"));
}

TEST_CASE("the root-cause block names rank, exit code, signal, error file, message and the stderr tail") {
  RootCause rc;
  rc.time = "2026-11-23_10:45:41";
  rc.host = "node7";
  rc.worker.rank = 5;
  rc.worker.local_rank = 1;
  rc.worker.pid = 4242;
  rc.worker.exit_code = 128 + SIGSEGV;
  rc.worker.signal = SIGSEGV;
  rc.error_file = "/logs/attempt_0/1/error.json";
  rc.message = "bad batch";
  rc.stderr_tail = {"line one", "line two"};
  const std::string out = format_root_cause(rc, "train.py");
  CHECK(out ==
        "============================================================\n"
        "train.py FAILED\n"
        "------------------------------------------------------------\n"
        "Root Cause (first observed failure):\n"
        "  time       : 2026-11-23_10:45:41\n"
        "  host       : node7\n"
        "  rank       : 5 (local_rank: 1)\n"
        "  exitcode   : 139 (pid: 4242)\n"
        "  signal     : SIGSEGV (11)\n"
        "  error_file : /logs/attempt_0/1/error.json\n"
        "  message    : bad batch\n"
        "  last stderr lines:\n"
        "    line one\n"
        "    line two\n"
        "============================================================\n");

  RootCause bare;  // a failure reported by another node: no pid, no file, no message
  bare.worker.exit_code = 7;
  const std::string b = format_root_cause(bare, "x");
  CHECK_THAT(b, Catch::Contains("  exitcode   : 7\n"));
  CHECK_THAT(b, Catch::Contains("  message    : <no error file written>\n"));
  CHECK_THAT(b, !Catch::Contains("signal") && !Catch::Contains("error_file") && !Catch::Contains("stderr"));
}

TEST_CASE("a node that failed as a whole is named in the root cause, never rank -1 (#22)") {
  RootCause rc;  // what the rendezvous reports for a killed, stopped or interrupted agent
  rc.time = "t";
  rc.host = "node3";
  rc.worker.rank = -1;
  rc.worker.local_rank = -1;
  rc.worker.exit_code = 1;
  rc.message = "node node3 (127.0.0.3) lost: its connection closed";
  const std::string out = format_root_cause(rc, "train.py");
  CHECK_THAT(out, Catch::Contains("  rank       : none (node node3 failed, not one of its workers)\n") &&
                      Catch::Contains("  message    : node node3 (127.0.0.3) lost: its connection closed\n"));
  CHECK_THAT(out, !Catch::Contains("-1"));
  RunRecord run;
  run.root_cause = rc;
  const auto j = summary_json(run);
  CHECK(j["root_cause"]["rank"].is_null());
  CHECK(j["root_cause"]["local_rank"].is_null());
  CHECK(j["root_cause"]["host"] == "node3");
}

TEST_CASE("the run summary sorts each attempt's workers by rank and names signals") {
  RunRecord run;
  run.run_id = "job";
  run.program = "train.py";
  run.nproc_per_node = 2;
  run.world_size = 2;
  run.max_restarts = 1;
  run.restarts = 1;
  run.exit_code = 0;
  AttemptRecord a0;
  a0.restart_count = 0;
  a0.start = std::chrono::system_clock::from_time_t(1700000000);
  a0.workers = {{1, 1, 11, 5, 0, 0.5, false}, {0, 0, 10, 143, SIGTERM, 0.6, true}};  // in the order they ended
  AttemptRecord a1;
  a1.restart_count = 1;
  a1.workers = {{0, 0, 20, 0, 0, 1.0, false}, {1, 1, 21, 0, 0, 1.0, false}};
  run.attempts = {a0, a1};
  auto j = summary_json(run);
  CHECK(j["run_id"] == "job");
  CHECK(j["restarts"] == 1);
  CHECK(j["root_cause"].is_null());
  CHECK(j["agent_signal"].is_null());
  REQUIRE(j["attempts"].size() == 2);
  CHECK(j["attempts"][0]["start_unix"] == 1700000000);
  CHECK(j["attempts"][0]["workers"][0]["rank"] == 0);
  CHECK(j["attempts"][0]["workers"][0]["signal"] == "SIGTERM");
  CHECK(j["attempts"][0]["workers"][0]["stopped_by_agent"] == true);
  CHECK(j["attempts"][0]["workers"][1]["rank"] == 1);
  CHECK(j["attempts"][0]["workers"][1]["exit_code"] == 5);
  CHECK(j["attempts"][0]["workers"][1]["signal"].is_null());

  run.agent_signal = SIGINT;
  run.root_cause = RootCause{"t", "h", {1, 1, 11, 5, 0, 0.5, false}, "", "m", {"tail"}};
  j = summary_json(run);
  CHECK(j["agent_signal"] == "SIGINT");
  CHECK(j["root_cause"]["rank"] == 1);
  CHECK(j["root_cause"]["exit_code"] == 5);
  CHECK(j["root_cause"]["stderr_tail"] == nlohmann::json::array({"tail"}));
}

TEST_CASE("a worker that cannot import a module: the module is read from its last stderr lines, Python 3's and 2's") {
  const std::vector<std::string> tail = {"Traceback (most recent call last):", "  File \"train.py\", line 1",
                                         "ModuleNotFoundError: No module named 'torch'"};
  CHECK(missing_module(tail) == "torch");
  CHECK(missing_module({"ModuleNotFoundError: No module named 'torch.distributed'"}) == "torch.distributed");
  CHECK(missing_module({"ImportError: No module named numpy"}) == "numpy");
  CHECK(missing_module({"print('No module named x')"}).empty());  // not an import error's line
  CHECK(missing_module({"ModuleNotFoundError: No module named '$(rm -rf)'"}).empty());
  CHECK(missing_module({}).empty());
}

TEST_CASE("the missing-module hint names the Python that ran, one that has the module, and how to choose it (#38)") {
  const auto with = missing_module_hint("torch", "/opt/venv/bin/python3", "python3 from PATH", "/usr/bin/python3");
  CHECK_THAT(with, Catch::Contains("ran under /opt/venv/bin/python3 (python3 from PATH), which has no module 'torch'") &&
                       Catch::Contains("/usr/bin/python3 has 'torch'") && Catch::Contains("--python /usr/bin/python3") &&
                       Catch::Contains("MGLAUNCH_PYTHON=/usr/bin/python3") && Catch::Contains("mglaunch doctor"));
  const auto without = missing_module_hint("torch.distributed", "/x/python3", "--python", "");
  CHECK_THAT(without, Catch::Contains("no module 'torch.distributed'") && Catch::Contains("nor has any other Python") &&
                          Catch::Contains("install 'torch' for /x/python3") && Catch::Contains("--python PATH"));
  CHECK(with.find('\n') == std::string::npos);
}

TEST_CASE("python_with_module finds, as doctor does, another Python whose search path has the module, never the one that ran") {
  namespace fs = std::filesystem;
  const fs::path root(mgtest::make_temp_dir());
  // Two installations laid out as Debian's: PREFIX/bin/python3.11, PREFIX/lib/python3/dist-packages.
  auto install = [&](const std::string& name, bool with_torch) {
    fs::create_directories(root / name / "bin");
    fs::create_directories(root / name / "lib" / "python3" / "dist-packages");
    std::ofstream(root / name / "bin" / "python3.11") << "#!/bin/sh\n";
    if (with_torch) fs::create_directories(root / name / "lib" / "python3" / "dist-packages" / "torch");
    return (root / name / "bin" / "python3.11").string();
  };
  const std::string bare = install("bare", false), full = install("full", true);
  const std::map<std::string, std::string> env;
  CHECK(python_with_module("torch", bare, {bare, full}, env) == full);
  CHECK(python_with_module("torch.distributed", bare, {bare, full}, env) == full);
  CHECK(python_with_module("torch", full, {full}, env).empty());  // only the one that ran
  CHECK(python_with_module("numpy", bare, {bare, full}, env).empty());
  // A virtual environment without torch whose python3 links to the interpreter that has it:
  // another Python all the same (its own site-packages).
  fs::create_directories(root / "venv" / "bin");
  fs::create_directories(root / "venv" / "lib" / "python3.11" / "site-packages");
  std::ofstream(root / "venv" / "pyvenv.cfg") << "home = " << (root / "full" / "bin").string()
                                               << "\ninclude-system-site-packages = false\nversion = 3.11.2\n";
  fs::create_symlink(full, root / "venv" / "bin" / "python3");
  const std::string venv = (root / "venv" / "bin" / "python3").string();
  CHECK(python_with_module("torch", venv, {venv, full}, env) == full);
  fs::remove_all(root);
}
