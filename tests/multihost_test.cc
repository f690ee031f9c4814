// `mglaunch --hostfile`: the fan-out with a local runner (the remote command runs with
// /bin/sh -c here, as sshd would run it) and for real through a private sshd reached as
// 127.0.0.2 and 127.0.0.3. The workers are tests/fake_worker; "no process behind" is
// checked by scanning /proc for anything whose command line names the test's directory.
#include <catch2/catch.hpp>

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sched.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <future>
#include <set>

#include <nlohmann/json.hpp>

#include "cli/errors.h"
#include "baremetal/multihost.h"
#include "support/proc.h"
#include "support/skip.h"
#include "support/sshd.h"

using namespace mgtest;
using namespace std::chrono_literals;
namespace fs = std::filesystem;

namespace {

// Pids of live processes whose command line contains `needle` (zombies excluded).
std::vector<pid_t> procs_mentioning(const std::string& needle) {
  std::vector<pid_t> out;
  std::error_code ec;
  for (auto it = fs::directory_iterator("/proc", ec); !ec && it != fs::directory_iterator(); it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.empty() || !std::isdigit(static_cast<unsigned char>(name[0]))) continue;
    const pid_t pid = std::stoi(name);
    if (pid == ::getpid()) continue;
    std::string cmd = read_file(it->path().string() + "/cmdline");
    if (cmd.find(needle) != std::string::npos && pid_alive(pid)) out.push_back(pid);
  }
  return out;
}

std::string write_hostfile(const std::string& dir, const std::string& text) {
  const std::string path = dir + "/hostfile";
  std::ofstream(path) << text;
  return path;
}

// The worker lines "[host:rankN]:{json}" of a run's stdout, by rank.
std::map<int, std::pair<std::string, nlohmann::json>> worker_envs(const std::string& out) {
  std::map<int, std::pair<std::string, nlohmann::json>> by_rank;
  for (const auto& l : split_lines(out)) {
    auto b = l.find("]:{");
    if (l.empty() || l[0] != '[' || b == std::string::npos) continue;
    auto j = nlohmann::json::parse(l.substr(b + 2));
    by_rank[std::stoi(j["RANK"].get<std::string>())] = {l.substr(1, l.find(":rank") - 1), j};
  }
  return by_rank;
}

struct Captured {
  int code = -1;
  std::string out, err;
};

// Runs the fan-out in this process with the local runner; output goes to temp files.
Captured run_local(const std::string& dir, const std::string& hostfile, std::vector<std::string> worker,
                   std::vector<std::string> unreachable = {}, std::vector<std::string> forwarded = {},
                   std::string workdir = "", std::string remote_mglaunch = kMglaunch,
                   std::vector<std::string> exports = {}) {
  mg::MultiHostOptions o;
  o.exports = std::move(exports);
  o.workdir = std::move(workdir);
  o.hostfile = hostfile;
  o.rdzv_host = "127.0.0.1";
  o.remote_mglaunch = std::move(remote_mglaunch);
  o.forwarded = forwarded;
  o.program = std::move(worker);
  const std::string out_path = dir + "/fan.out", err_path = dir + "/fan.err";
  int out = ::open(out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  int err = ::open(err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  mg::LocalShellRunner runner(unreachable);
  Captured c;
  c.code = mg::run_multihost(o, {}, runner, mg::FanoutIo{out, err, false});
  ::close(out);
  ::close(err);
  c.out = read_file(out_path);
  c.err = read_file(err_path);
  return c;
}

std::vector<std::string> launcher_argv(const SshServer& sshd, const std::string& hostfile,
                                       std::vector<std::string> worker, std::vector<std::string> flags = {}) {
  std::vector<std::string> argv{kMglaunch, "--hostfile", hostfile, "--ssh-opts", sshd.ssh_opts()};
  argv.insert(argv.end(), flags.begin(), flags.end());
  argv.insert(argv.end(), worker.begin(), worker.end());
  return argv;
}

// fake_worker with these commands.
std::vector<std::string> fw(std::vector<std::string> cmds) {
  cmds.insert(cmds.begin(), kFakeWorker);
  return cmds;
}

// A worker that records its pid; rank `rank` exits with `code` once all `n` workers have
// recorded theirs (bounded: 60 s), the others sleep. So the failure always finds every
// host's workers running, however loaded the machine. ("$$$$": the agent turns "$$" into
// "$", Python string.Template style.)
std::vector<std::string> fail_when_all_up(const std::string& pids, int n, int rank, int code) {
  const std::string script =
      "echo $$$$ >> \"$0\"; if [ \"$RANK\" = " + std::to_string(rank) + " ]; then i=0; "
      "while [ \"$(wc -l < \"$0\")\" -lt " + std::to_string(n) + " ] && [ $i -lt 1200 ]; do sleep 0.05; i=$((i+1)); done; "
      "echo 'bad batch' >&2; exit " + std::to_string(code) + "; fi; exec sleep 120";
  return {"/bin/sh", "-c", script, pids};
}

}  // namespace

TEST_CASE("two hosts with two slots each get ranks 0..3 and [host:rankN] prefixes (local runner)") {
  const std::string dir = make_temp_dir();
  auto r = run_local(dir, write_hostfile(dir, "127.0.0.2 slots=2\n127.0.0.3 slots=2\n"), fw({"env"}));
  INFO(r.err);
  CHECK(r.code == 0);
  auto envs = worker_envs(r.out);
  REQUIRE(envs.size() == 4);
  CHECK(envs[0].first == "127.0.0.2");
  CHECK(envs[1].first == "127.0.0.2");
  CHECK(envs[2].first == "127.0.0.3");
  CHECK(envs[3].first == "127.0.0.3");
  for (auto& [rank, e] : envs) {
    CHECK(e.second["WORLD_SIZE"] == "4");
    CHECK(e.second["LOCAL_RANK"] == std::to_string(rank % 2));
    CHECK_FALSE(e.second.contains("MGLAUNCH_RDZV_TOKEN"));
  }
  CHECK(procs_mentioning(dir).empty());
}

TEST_CASE("a worker failure on one host ends every host with that worker's exit code (local runner)") {
  const std::string dir = make_temp_dir();
  const std::string pids = dir + "/pids";
  auto r = run_local(dir, write_hostfile(dir, "127.0.0.2 slots=2\n127.0.0.3 slots=2\n"),
                     fail_when_all_up(pids, 4, 3, 7), {}, {"--grace=5"});
  INFO(r.err);
  CHECK(r.code == 7);
  CHECK(read_pids(pids).size() == 4);
  CHECK_THAT(r.err, Catch::Contains("[127.0.0.3]:") && Catch::Contains("exitcode   : 7"));
  CHECK(eventually([&] { return procs_mentioning(dir).empty(); }, 20s));
}

TEST_CASE("the fan-out reaps only its own ssh children: a child of the program embedding it stays its own") {
  const std::string dir = make_temp_dir();
  // Ended before the fan-out starts: a reaper that took any child (waitpid(-1)) would take it.
  Proc mine = spawn({"/bin/sh", "-c", "exit 5"});
  REQUIRE(eventually([&] { return !pid_alive(mine.pid); }, 10s));
  auto r = run_local(dir, write_hostfile(dir, "127.0.0.2 slots=1\n127.0.0.3 slots=1\n"), fw({"env"}));
  INFO(r.err);
  CHECK(r.code == 0);
  CHECK(worker_envs(r.out).size() == 2);
  int status = 0;
  CHECK(::waitpid(mine.pid, &status, WNOHANG) == mine.pid);
  CHECK((WIFEXITED(status) && WEXITSTATUS(status) == 5));
  mine.status = status;
}

TEST_CASE("an unreachable host is one error naming it, and the other host is stopped (local runner)") {
  const std::string dir = make_temp_dir();
  auto r = run_local(dir, write_hostfile(dir, "127.0.0.2 slots=1\n127.0.0.3 slots=1\n"),
                     fw({"pidfile", dir + "/pids", "hang", "60"}), {"127.0.0.3"});
  INFO(r.err);
  CHECK(r.code == mg::kExitSshFailed);
  int naming = 0;
  for (const auto& l : split_lines(r.err)) naming += l.find("cannot reach host 127.0.0.3") != std::string::npos;
  CHECK(naming == 1);
  // The launcher's own error: one line of the promised form.
  CHECK_THAT(r.err, Catch::Contains("\nmglaunch: error: cannot reach host 127.0.0.3 over ssh") ||
                        Catch::StartsWith("mglaunch: error: cannot reach host 127.0.0.3 over ssh"));
  CHECK(read_pids(dir + "/pids").empty());  // host 2 never got past the rendezvous
  CHECK(eventually([&] { return procs_mentioning(dir).empty(); }, 20s));
}

TEST_CASE("an unreachable host's ssh error is one clean line: no carriage return left from ssh's CRLF, no 'Terminated' from the other host's shell (#38)") {
  const std::string dir = make_temp_dir();
  // An "agent" that dies of the SIGTERM the wrapper sends when the launcher stops the host
  // (as mglaunch does when stopped before it handles signals): its shell used to report
  // "Terminated", relayed as a line of that host.
  const std::string agent = dir + "/agent.sh";
  std::ofstream(agent) << "#!/bin/sh\nexec sleep 60\n";
  fs::permissions(agent, fs::perms::owner_all);
  auto r = run_local(dir, write_hostfile(dir, "127.0.0.2 slots=1\n127.0.0.3 slots=1\n"), fw({"hang", "60"}),
                     {"127.0.0.3"}, {}, "", agent);
  INFO(r.err);
  CHECK(r.code == mg::kExitSshFailed);
  CHECK_THAT(r.err, Catch::Contains("port 22: Connection refused); check the name"));
  CHECK(r.err.find("\\r") == std::string::npos);
  CHECK(r.err.find('\r') == std::string::npos);
  for (const auto& l : split_lines(r.err)) CHECK_THAT(l, !Catch::Contains("Terminated"));
  CHECK(eventually([&] { return procs_mentioning(dir).empty(); }, 20s));
}

TEST_CASE("over --hostfile a Python worker whose python3 lacks torch gets the root cause naming both interpreters (#38)") {
  require_installed(python_has_torch(), "torch for /usr/bin/python3", "python3-torch");
  const std::string dir = make_temp_dir();
  std::ofstream(dir + "/python3") << "#!/bin/sh\nexec /usr/bin/python3 -I -S \"$@\"\n";
  fs::permissions(dir + "/python3", fs::perms::owner_all);
  std::ofstream(dir + "/train.py") << "import torch\n";
  // The host's agent finds that python3 first on its PATH (exported as a host's own would be).
  auto r = run_local(dir, write_hostfile(dir, "127.0.0.2 slots=1\n"), {dir + "/train.py"}, {}, {}, "", kMglaunch,
                     {"PATH=" + dir + ":/usr/bin:/bin"});
  INFO(r.err);
  CHECK(r.code == 1);
  CHECK_THAT(r.err, Catch::Contains("the worker ran under " + dir + "/python3 (python3 from PATH), which has no module "
                                    "'torch'; /usr/bin/python3 has 'torch'"));
}

TEST_CASE("a dry run prints the nodes and the exact ssh command per host and starts nothing") {
  const std::string dir = make_temp_dir();
  const std::string hf = write_hostfile(dir, "127.0.0.2 slots=2\n127.0.0.3\n127.0.0.4 slots=8\n");
  auto r = run({kMglaunch, "--hostfile", hf, "--exclude", "127.0.0.4", "--ssh-opts", "-p 2222", "--export", "A=1",
                "--dry-run", "--max_restarts=1", kFakeWorker, "env"},
               {{"MGLAUNCH_RDZV_TOKEN", "sekrit"}});
  INFO(r.err);
  REQUIRE(r.code == 0);
  auto j = nlohmann::json::parse(r.out);
  CHECK(j["nnodes"] == 2);
  REQUIRE(j["nodes"].size() == 2);
  CHECK(j["nodes"][0]["host"] == "127.0.0.2");
  CHECK(j["nodes"][1]["nproc_per_node"] == "auto");
  auto ssh = j["nodes"][1]["ssh"].get<std::vector<std::string>>();
  CHECK(std::vector<std::string>(ssh.begin(), ssh.begin() + 8) ==
        std::vector<std::string>{"ssh", "-T", "-o", "BatchMode=yes", "-p", "2222", "-o", "ConnectTimeout=30"});
  CHECK(ssh[8] == "127.0.0.3");
  CHECK_THAT(ssh.back(), Catch::Contains("--node_rank=1") && Catch::Contains("--max_restarts=1") &&
                             Catch::Contains("env A=1 ") && Catch::Contains(kFakeWorker));
  CHECK(r.out.find("sekrit") == std::string::npos);
}

TEST_CASE("exporting 'MGLAUNCH_*' never puts a rendezvous secret on an ssh command line and says so once (#23 D8)") {
  const std::string dir = make_temp_dir();
  const std::string key(64, 'b');
  auto r = run({kMglaunch, "--hostfile", write_hostfile(dir, "127.0.0.2 slots=1\n127.0.0.3 slots=1\n"), "--rdzv-host",
                "127.0.0.1", "--export", "MGLAUNCH_*", "--dry-run", kFakeWorker, "env"},
               {{"MGLAUNCH_RDZV_JOB_TOKEN", key}, {"MGLAUNCH_RDZV_TOKEN", "sekrit"}, {"MGLAUNCH_KEEP", "1"}});
  INFO(r.err);
  REQUIRE(r.code == 0);
  CHECK(r.out.find(key) == std::string::npos);
  CHECK(r.out.find("sekrit") == std::string::npos);
  CHECK(r.out.find("MGLAUNCH_RDZV_JOB_TOKEN=") == std::string::npos);
  CHECK_THAT(r.out, Catch::Contains("MGLAUNCH_KEEP=1"));
  const auto lines = split_lines(r.err);
  REQUIRE(lines.size() == 1);
  CHECK_THAT(lines[0], Catch::StartsWith("mglaunch: warning: --export: left out ") &&
                           Catch::Contains("MGLAUNCH_RDZV_JOB_TOKEN") && Catch::Contains("MGLAUNCH_RDZV_TOKEN"));
}

TEST_CASE("a working directory missing on a host is one error naming it, exit 2, and the other host is stopped (#22)") {
  const std::string dir = make_temp_dir();
  auto r = run_local(dir, write_hostfile(dir, "127.0.0.2 slots=1\n127.0.0.3 slots=1\n"),
                     fw({"pidfile", dir + "/pids", "hang", "60"}), {}, {}, dir + "/not here");
  INFO(r.err);
  CHECK(r.code == 2);
  CHECK_THAT(r.err, Catch::Contains("]:mglaunch: error: the working directory " + dir +
                                    "/not here does not exist on this host"));
  CHECK(read_pids(dir + "/pids").empty());
  CHECK(eventually([&] { return procs_mentioning(dir).empty(); }, 20s));
}

TEST_CASE("a dry run names the working directory every host starts in (#22)") {
  const std::string dir = make_temp_dir();
  (void)write_hostfile(dir, "127.0.0.2\n");
  auto r = run({"/bin/sh", "-c", "cd \"$0\" && exec \"$@\"", dir, kMglaunch, "--hostfile", "hostfile", "--rdzv-host",
           "127.0.0.1", "--dry-run", "./train.py"});
  INFO(r.err);
  REQUIRE(r.code == 0);
  auto j = nlohmann::json::parse(r.out);
  CHECK(j["workdir"] == fs::canonical(dir).string());
  CHECK_THAT(j["nodes"][0]["ssh"].back().get<std::string>(),
             Catch::Contains("mglaunch-host -C " + fs::canonical(dir).string() + " "));
}

TEST_CASE("an --rdzv-host address this machine lacks: a dry run binds nothing, a real run is one line naming it (#22)") {
  const std::string dir = make_temp_dir();
  const std::string hf = write_hostfile(dir, "127.0.0.2 slots=1\n");
  // TEST-NET-1 (RFC 5737): no machine has it; binding it fails without sending anything.
  auto dry = run({kMglaunch, "--hostfile", hf, "--rdzv-host", "192.0.2.1", "--dry-run", kFakeWorker, "env"});
  INFO(dry.err);
  REQUIRE(dry.code == 0);
  auto j = nlohmann::json::parse(dry.out);
  CHECK(j["rdzv_endpoint"] == "192.0.2.1:PORT");
  CHECK_THAT(j["nodes"][0]["ssh"].back().get<std::string>(), Catch::Contains("--rdzv_endpoint=192.0.2.1:PORT"));
  if (read_file("/proc/sys/net/ipv4/ip_nonlocal_bind").starts_with("1")) {
    SKIP_TEST("the real run: net.ipv4.ip_nonlocal_bind=1 lets this machine bind any address");
  }
  // ssh is /bin/false: even if the address could be bound, nothing would leave this machine.
  auto real = run({kMglaunch, "--hostfile", hf, "--rdzv-host", "192.0.2.1", kFakeWorker, "env"},
                  {{"MGLAUNCH_SSH", "/bin/false"}});
  INFO(real.err);
  CHECK(real.code == 2);
  const auto lines = split_lines(real.err);
  REQUIRE(lines.size() == 1);
  CHECK_THAT(lines[0], Catch::StartsWith("mglaunch: error: cannot host the rendezvous on 192.0.2.1 (--rdzv-host)"));
}

TEST_CASE("a bad hostfile or flag is one line and exit code 2") {
  const std::string dir = make_temp_dir();
  auto r = run({kMglaunch, "--hostfile", write_hostfile(dir, "a slots=two\n"), kFakeWorker});
  CHECK(r.code == 2);
  CHECK(split_lines(r.err).size() == 1);
  CHECK_THAT(r.err, Catch::Contains("hostfile:1"));
  auto missing = run({kMglaunch, "--hostfile", dir + "/nope", kFakeWorker});
  CHECK(missing.code == 2);
  CHECK_THAT(missing.err, Catch::Contains("cannot be read"));
  auto bad_flag = run({kMglaunch, "--hostfile", write_hostfile(dir, "a\n"), "--rdzv_host", "127.0.0.1",
                       "--max_restarts=x", kFakeWorker});
  CHECK(bad_flag.code == 2);
  CHECK_THAT(bad_flag.err, Catch::Contains("--max_restarts"));
}

// ----------------------------------------------------------------------------------------
// Real ssh

TEST_CASE("over real ssh two hosts with two workers each get ranks 0..3") {
  SshServer sshd;
  const std::string dir = make_temp_dir();
  auto r = run(launcher_argv(sshd, write_hostfile(dir, "127.0.0.2 slots=2\n127.0.0.3 slots=2\n"), fw({"env"})),
               {{"MGLAUNCH_RDZV_TOKEN", "\x01unset"}}, 60s);
  INFO(r.err << sshd.log());
  CHECK(r.code == 0);
  auto envs = worker_envs(r.out);
  REQUIRE(envs.size() == 4);
  std::set<std::string> hosts;
  for (auto& [rank, e] : envs) {
    hosts.insert(e.first);
    CHECK(e.second["WORLD_SIZE"] == "4");
    CHECK(e.second["GROUP_WORLD_SIZE"] == "2");
    CHECK_FALSE(e.second.contains("MGLAUNCH_RDZV_TOKEN"));
    CHECK(e.second.contains("SSH_CONNECTION"));  // really started through sshd
  }
  CHECK(envs[0].first == "127.0.0.2");
  CHECK(envs[3].first == "127.0.0.3");
  CHECK(hosts == std::set<std::string>{"127.0.0.2", "127.0.0.3"});
  CHECK(eventually([&] { return procs_mentioning(dir).empty(); }, 20s));
}

TEST_CASE("over real ssh a relative program path runs from the launcher's directory on every host (#22)") {
  SshServer sshd;
  const std::string dir = make_temp_dir();
  fs::create_symlink(kFakeWorker, dir + "/worker");
  const std::string hf = write_hostfile(dir, "127.0.0.2 slots=1\n127.0.0.3 slots=1\n");
  // The remote shell starts in $HOME; "./worker" exists only in `dir`.
  std::vector<std::string> argv{"/bin/sh", "-c", "cd \"$0\" && exec \"$@\"", dir};
  for (const auto& a : launcher_argv(sshd, "hostfile", {"./worker", "env"}, {"--no_python"})) argv.push_back(a);
  auto r = run(argv, {}, 60s);
  INFO(r.err << sshd.log());
  CHECK(r.code == 0);
  auto envs = worker_envs(r.out);
  REQUIRE(envs.size() == 2);
  CHECK(envs[0].first == "127.0.0.2");
  CHECK(envs[1].first == "127.0.0.3");
  CHECK(eventually([&] { return procs_mentioning(dir).empty(); }, 20s));
}

TEST_CASE("over real ssh a worker failure on one host stops the other with the failing worker's code") {
  SshServer sshd;
  const std::string dir = make_temp_dir();
  const std::string pids = dir + "/pids";
  auto r = run(launcher_argv(sshd, write_hostfile(dir, "127.0.0.2 slots=2\n127.0.0.3 slots=2\n"),
                             fail_when_all_up(pids, 4, 1, 9), {"--grace=5"}),
               {}, 90s);
  INFO(r.err << sshd.log());
  CHECK(r.code == 9);
  CHECK(read_pids(pids).size() == 4);
  CHECK_THAT(r.err, Catch::Contains("[127.0.0.2]:") && Catch::Contains("exitcode   : 9"));
  for (pid_t p : read_pids(pids)) CHECK(eventually([&] { return !pid_alive(p); }, 20s));
  CHECK(eventually([&] { return procs_mentioning(dir).empty(); }, 20s));
}

namespace {

// A launcher whose workers (`slots` per host on 127.0.0.2 and .3) wrote their pids and
// hang; the tests then stop it in some way and check that nothing is left.
struct HungJob {
  std::string dir, pids;
  Proc launcher;
};

HungJob start_hung_job(const SshServer& sshd, int slots) {
  const std::string dir = make_temp_dir(), pids = dir + "/pids";
  const std::string hosts =
      "127.0.0.2 slots=" + std::to_string(slots) + "\n127.0.0.3 slots=" + std::to_string(slots) + "\n";
  HungJob h{dir, pids, spawn(launcher_argv(sshd, write_hostfile(dir, hosts), fw({"print", "up", "pidfile", pids, "hang", "120"}),
                                           {"--grace=5"}))};
  REQUIRE(eventually([&] { return read_pids(h.pids).size() == static_cast<std::size_t>(2 * slots); }, 60s));
  return h;
}

void check_nothing_left(const HungJob& h) {
  for (pid_t p : read_pids(h.pids)) CHECK(eventually([&] { return !pid_alive(p); }, 30s));
  CHECK(eventually([&] { return procs_mentioning(h.dir).empty(); }, 30s));
}

}  // namespace

TEST_CASE("over real ssh SIGINT to the launcher leaves no process behind on either host") {
  SshServer sshd;
  HungJob h = start_hung_job(sshd, 2);
  ::kill(h.launcher.pid, SIGINT);
  REQUIRE(h.launcher.wait(60s));
  INFO(h.launcher.err() << sshd.log());
  CHECK(h.launcher.exit_code() == 128 + SIGINT);
  // The user stopped it: no FAILED block, and no rank -1 anywhere (#22).
  CHECK_THAT(h.launcher.err(), !Catch::Contains("FAILED") && !Catch::Contains("rank       : -1") &&
                                   !Catch::Contains("local_rank: -1"));
  check_nothing_left(h);
}

TEST_CASE("over real ssh a launcher killed with SIGKILL still leaves no process behind") {
  SshServer sshd;
  HungJob h = start_hung_job(sshd, 1);
  ::kill(h.launcher.pid, SIGKILL);  // no chance to clean up: the hosts see their stdin close
  REQUIRE(h.launcher.wait(10s));
  check_nothing_left(h);
}

TEST_CASE("over real ssh a dropped connection stops that host's agent and every other host") {
  SshServer sshd;
  HungJob h = start_hung_job(sshd, 1);
  // Output from both hosts came back: the launcher knows each connection was up (without
  // it, a drop reads as "cannot reach", which a loaded machine made happen once).
  REQUIRE(eventually([&] { return split_lines(h.launcher.out()).size() >= 2; }, 60s));
  // The remote wrapper of node 1 runs under our sshd's session process for that
  // connection: killing that process drops the connection as a network failure would.
  pid_t session = -1;
  for (pid_t p : procs_mentioning(h.dir)) {
    const std::string cmd = read_file("/proc/" + std::to_string(p) + "/cmdline");
    if (cmd.rfind(std::string("sh\0-c\0", 6), 0) != 0 || cmd.find("--node_rank=1") == std::string::npos) continue;
    std::string stat = read_file("/proc/" + std::to_string(p) + "/stat");
    const pid_t parent = std::stoi(stat.substr(stat.rfind(')') + 4));
    if (read_file("/proc/" + std::to_string(parent) + "/cmdline").rfind("sshd", 0) == 0) session = parent;
  }
  REQUIRE(session > 0);
  ::kill(session, SIGKILL);
  REQUIRE(h.launcher.wait(60s));
  INFO(h.launcher.err());
  CHECK(h.launcher.exit_code() == 255);
  CHECK_THAT(h.launcher.err(), Catch::Contains("lost the connection to host 127.0.0.3"));
  check_nothing_left(h);
}

TEST_CASE("over real ssh an unreachable host is one clear error naming it") {
  SshServer sshd;
  const std::string dir = make_temp_dir();
  // Nothing listens on 127.0.0.4 at the fixture's port: connection refused.
  auto r = run(launcher_argv(sshd, write_hostfile(dir, "127.0.0.2 slots=1\n127.0.0.4 slots=1\n"),
                             fw({"pidfile", dir + "/pids", "hang", "60"})),
               {}, 90s);
  INFO(r.err);
  CHECK(r.code == 255);
  int naming = 0;
  for (const auto& l : split_lines(r.err)) {
    naming += l.rfind("mglaunch: error: cannot reach host 127.0.0.4", 0) == 0;
    CHECK_THAT(l, !Catch::Contains("Terminated"));  // the other host's shell said so (#38)
  }
  CHECK(naming == 1);
  CHECK_THAT(r.err, Catch::Contains("Connection refused); check the name"));  // not "refused\r)" (#38)
  CHECK(eventually([&] { return procs_mentioning(dir).empty(); }, 20s));
}

TEST_CASE("over real ssh a host whose ssh port accepts but never speaks is one error naming it within ssh's "
          "connect timeout, not a run that waits for ever (#35)") {
  SshServer sshd;
  const std::string dir = make_temp_dir();
  // 127.0.0.5 at the fixture's port: a listener that never accepts. The kernel completes
  // the TCP handshake, and ssh waits for sshd's banner. Before, mglaunch gave ssh no
  // ConnectTimeout (the fixture's own 10 s is left out here): the run waited for ever.
  const int silent = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<std::uint16_t>(sshd.port()));
  a.sin_addr.s_addr = htonl(0x7f000005);
  const bool listening = ::bind(silent, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 && ::listen(silent, 8) == 0;
  std::string opts;
  const auto list = sshd.ssh_opts_list();
  for (std::size_t i = 0; i < list.size(); ++i) {
    if (list[i] == "-o" && i + 1 < list.size() && list[i + 1].starts_with("ConnectTimeout=")) {
      ++i;
      continue;
    }
    opts += (opts.empty() ? "" : " ") + list[i];
  }
  Proc launcher = spawn({kMglaunch, "--hostfile", write_hostfile(dir, "127.0.0.2 slots=1\n127.0.0.5 slots=1\n"),
                         "--ssh-opts", opts, kFakeWorker, "pidfile", dir + "/pids", "hang", "120"});
  const bool ended = launcher.wait(120s);  // ssh's 30 s and margin (else its group is killed)
  ::close(silent);
  INFO(launcher.err() << sshd.log());
  REQUIRE(listening);
  CHECK(ended);
  CHECK(launcher.exit_code() == 255);
  CHECK_THAT(launcher.err(), Catch::Contains("mglaunch: error: cannot reach host 127.0.0.5") &&
                                 Catch::Contains("timed out"));
  CHECK(eventually([&] { return procs_mentioning(dir).empty(); }, 20s));
}

// ----------------------------------------------------------------------------------------
// mglaunch doctor, the real binary against what this process sees itself

TEST_CASE("doctor --json reports the CPUs, affinity and memory this process sees") {
  auto r = run({kMglaunch, "doctor", "--json", "--no-python", "--master_addr", "127.0.0.1", "--port", "0"});
  INFO(r.err);
  REQUIRE(r.code == 0);
  auto j = nlohmann::json::parse(r.out);
  cpu_set_t set;
  CPU_ZERO(&set);
  REQUIRE(::sched_getaffinity(0, sizeof(set), &set) == 0);
  CHECK(j["cpus"]["online"] == ::sysconf(_SC_NPROCESSORS_ONLN));
  CHECK(j["cpus"]["affinity_count"] == CPU_COUNT(&set));
  std::uint64_t kb = 0;
  for (const auto& l : split_lines(read_file("/proc/meminfo")))
    if (l.rfind("MemTotal:", 0) == 0) kb = std::stoull(l.substr(9));
  CHECK(j["memory"]["total_bytes"] == kb * 1024);
  CHECK(j["master"]["interface"] == "lo");
  CHECK(j["port"]["free"] == true);
  CHECK(j["suggestions"].size() >= 2);
  for (const auto& s : j["suggestions"]) CHECK_FALSE(s["reason"].get<std::string>().empty());
}

TEST_CASE("doctor with a bad flag is one line and exit code 2") {
  auto r = run({kMglaunch, "doctor", "--port", "99999"});
  CHECK(r.code == 2);
  CHECK(split_lines(r.err).size() == 1);
  CHECK_THAT(r.err, Catch::Contains("bad --port '99999'"));
  auto u = run({kMglaunch, "doctor", "--gpus"});
  CHECK(u.code == 2);
  CHECK_THAT(u.err, Catch::Contains("unknown flag '--gpus'"));
}

TEST_CASE("the fan-out's end returns within 2 s of its SIGKILL when a host's ssh cannot be reaped (traced by "
          "another process), and names what it left behind (#36)") {
  // Before: ~Fanout SIGKILLed the host's ssh and waited for it with a blocking waitpid,
  // which waits as long as the tracer does (a process in state D holds it the same way).
  const std::string dir = make_temp_dir();
  mg::HostCommand stuck;
  stuck.host.host = "stuck";
  stuck.argv = {"/bin/sh", "-c", "echo $$ > " + dir + "/pid; exec sleep 600"};
  mg::MultiHostPlan plan;
  plan.hosts.push_back(stuck);
  const std::string err_path = dir + "/fan.err";
  const int out = ::open("/dev/null", O_WRONLY | O_CLOEXEC);
  const int err = ::open(err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  boost::asio::io_context io;
  auto fan = std::make_unique<mg::Fanout>(io, plan, "token", mg::MultiHostOptions{}, mg::FanoutIo{out, err, false});
  fan->start();
  pid_t target = -1;
  REQUIRE(eventually([&] { return (target = std::atoi(read_file(dir + "/pid").c_str())) > 0; }, 30s));
  struct Reap {  // the ssh left behind, once the tracer let it go (even when a check fails)
    pid_t pid;
    ~Reap() {
      int status = 0;
      eventually([&] { return ::waitpid(pid, &status, WNOHANG) != 0; }, 10s);
    }
  } reap{target};
  ForeignTracer tracer(target);
  if (!tracer.attached()) {
    fan.reset();
    SKIP_TEST("cannot trace the host's ssh (ptrace)");
  }
  auto ended = std::async(std::launch::async, [&] { fan.reset(); });
  const bool returned = ended.wait_for(60s) == std::future_status::ready;  // 2 s, on a loaded machine
  tracer.release();  // (before: the end returns only now)
  ended.wait();
  ::close(out);
  ::close(err);
  CHECK(returned);
  CHECK_THAT(read_file(err_path), Catch::Contains("the ssh of host stuck (pid " + std::to_string(target) +
                                                  ") could not be reaped within 2 s of SIGKILL"));
}
