// The spawner of the process layer (process/spawn.h): what a child gets (descriptors, its
// process group, CPU set, descriptor limit, every signal at its default action, an empty
// mask, death with its parent) and exec errors returned by spawn_process itself. Real
// processes, every wait bounded.
#include <catch2/catch.hpp>

#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "process/listeners.h"
#include "process/proc.h"
#include "process/spawn.h"
#include "support/proc.h"

using namespace mgtest;
using namespace std::chrono_literals;

namespace {

// A child started by spawn_process and reaped by the test (or killed and reaped on the way
// out, even when a check failed), with what it wrote to stdout.
struct Child {
  pid_t pid = -1;
  int status = -1;
  mg::SpawnError error;
  std::string out_path;

  explicit Child(const std::vector<std::string>& args, const std::string& dir,
                 const std::function<void(mg::SpawnRequest&)>& adjust = {})
      : out_path(dir + "/out") {
    std::vector<const char*> argv, envp;
    for (const auto& a : args) argv.push_back(a.c_str());
    argv.push_back(nullptr);
    envp.push_back(nullptr);
    const int out = ::open(out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    const int in = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
    mg::SpawnRequest req;
    req.path = argv[0];
    req.argv = argv.data();
    req.envp = envp.data();
    req.fds[0] = in;
    req.fds[1] = out;
    req.fds[2] = out;
    if (adjust) adjust(req);
    pid = mg::spawn_process(req, error);  // argv and envp need only outlive the call
    ::close(out);
    ::close(in);
  }
  ~Child() {
    if (pid > 0 && status == -1) {
      ::kill(pid, SIGKILL);
      int st = 0;
      ::waitpid(pid, &st, 0);
    }
  }
  bool wait(std::chrono::milliseconds timeout) {
    return eventually([&] { return ::waitpid(pid, &status, WNOHANG) == pid; }, timeout);
  }
  std::string out() const { return read_file(out_path); }
};

std::set<std::string> fd_numbers(const std::string& json_line) {
  std::set<std::string> s;
  const auto j = nlohmann::json::parse(json_line);
  for (const auto& [k, v] : j["fds"].items()) s.insert(k);
  return s;
}

// The hexadecimal mask of `field` ("SigIgn") in a /proc/PID/status text.
unsigned long long status_mask(const std::string& status, const std::string& field) {
  for (const auto& line : split_lines(status))
    if (line.starts_with(field + ":")) return std::stoull(line.substr(field.size() + 1), nullptr, 16);
  return ~0ULL;
}

// Our children that are zombies now (exited, not reaped).
std::vector<pid_t> zombie_children() {
  std::vector<pid_t> z;
  for (const auto& p : mg::scan_family(::getpid()))
    if (p.ppid == ::getpid() && p.state == 'Z') z.push_back(p.pid);
  return z;
}

}  // namespace

TEST_CASE("a spawned child gets only stdin, stdout and stderr, its own process group, and the CPU set and "
          "descriptor limit asked for") {
  const std::string dir = make_temp_dir();
  int leak[2];
  REQUIRE(::pipe(leak) == 0);  // no O_CLOEXEC: inherited unless the child marks it
  {
    Child c({kFakeWorker, "fds"}, dir);
    REQUIRE(c.pid > 0);
    CHECK(::getpgid(c.pid) == c.pid);
    REQUIRE(c.wait(30s));
    REQUIRE(WIFEXITED(c.status));
    CHECK(WEXITSTATUS(c.status) == 0);
    INFO(c.out());
    CHECK(fd_numbers(c.out()) == std::set<std::string>{"0", "1", "2"});
  }
  ::close(leak[0]);
  ::close(leak[1]);

  cpu_set_t one;
  CPU_ZERO(&one);
  CPU_SET(0, &one);
  rlimit nofile{};
  REQUIRE(::getrlimit(RLIMIT_NOFILE, &nofile) == 0);
  nofile.rlim_cur = std::min<rlim_t>(nofile.rlim_cur, 77);
  Child c({"/bin/sh", "-c", "ulimit -n; grep Cpus_allowed_list /proc/self/status"}, dir, [&](mg::SpawnRequest& r) {
    r.cpus = &one;
    r.nofile = &nofile;
  });
  REQUIRE(c.pid > 0);
  REQUIRE(c.wait(30s));
  const auto lines = split_lines(c.out());
  REQUIRE(lines.size() == 2);
  CHECK(lines[0] == std::to_string(nofile.rlim_cur));
  CHECK(lines[1].ends_with("\t0"));
}

TEST_CASE("a spawned child may stay in the parent's process group and inherit the parent's stderr") {
  const std::string dir = make_temp_dir();
  Child c({"/bin/sh", "-c", "exit 0"}, dir, [](mg::SpawnRequest& r) {
    r.own_group = false;
    r.fds[2] = -1;
  });
  REQUIRE(c.pid > 0);
  CHECK(::getpgid(c.pid) == ::getpgrp());
  REQUIRE(c.wait(30s));
  CHECK(WIFEXITED(c.status));
}

TEST_CASE("a spawned child starts with every signal at its default action and an empty signal mask, whatever the "
          "parent had") {
  const std::string dir = make_temp_dir();
  // The parent ignores signals of every kind (none of them in any list of the agent's), catches
  // others and blocks SIGUSR1; the child must see none of it.
  const std::vector<int> ignored{SIGPWR, SIGVTALRM, SIGSYS, SIGRTMIN + 3, SIGRTMAX};
  const std::vector<int> caught{SIGTERM, SIGPROF, SIGRTMIN + 5};
  std::vector<struct sigaction> saved(ignored.size() + caught.size());
  struct sigaction ign {}, handler {};
  ign.sa_handler = SIG_IGN;
  handler.sa_handler = [](int) {};
  std::size_t k = 0;
  for (int sig : ignored) REQUIRE(::sigaction(sig, &ign, &saved[k++]) == 0);
  for (int sig : caught) REQUIRE(::sigaction(sig, &handler, &saved[k++]) == 0);
  sigset_t usr1, old_mask;
  sigemptyset(&usr1);
  sigaddset(&usr1, SIGUSR1);
  REQUIRE(::pthread_sigmask(SIG_BLOCK, &usr1, &old_mask) == 0);
  struct Restore {
    const std::vector<int>& ignored;
    const std::vector<int>& caught;
    std::vector<struct sigaction>& saved;
    sigset_t& mask;
    ~Restore() {
      std::size_t i = 0;
      for (int sig : ignored) ::sigaction(sig, &saved[i++], nullptr);
      for (int sig : caught) ::sigaction(sig, &saved[i++], nullptr);
      ::pthread_sigmask(SIG_SETMASK, &mask, nullptr);
    }
  } restore{ignored, caught, saved, old_mask};

  {
    Child c({"/bin/cat", "/proc/self/status"}, dir);
    REQUIRE(c.pid > 0);
    REQUIRE(c.wait(30s));
    const std::string status = c.out();
    INFO(status);
    CHECK(status_mask(status, "SigIgn") == 0);
    CHECK(status_mask(status, "SigBlk") == 0);
    CHECK(status_mask(status, "SigCgt") == 0);
  }
  // And they act: a caught one and the blocked one kill the child, sent at once.
  for (int sig : {SIGTERM, SIGUSR1, SIGPWR}) {
    INFO("signal " << sig);
    Child c({kFakeWorker, "hang", "30"}, dir);
    REQUIRE(c.pid > 0);
    REQUIRE(::killpg(c.pid, sig) == 0);
    REQUIRE(c.wait(30s));
    REQUIRE(WIFSIGNALED(c.status));
    CHECK(WTERMSIG(c.status) == sig);
  }
}

TEST_CASE("a failed exec is returned by spawn_process itself, with the step and its errno, and leaves no child") {
  const std::string dir = make_temp_dir();
  {
    Child c({dir + "/no-such-program"}, dir);
    CHECK(c.pid == -1);
    CHECK(c.error.message() == "execve: No such file or directory");
    CHECK(c.error.code == ENOENT);
    CHECK_FALSE(c.error.no_child());
  }
  const std::string garbage = dir + "/garbage";
  std::ofstream(garbage) << std::string("\x01\x02\x03 not a program\n");
  REQUIRE(::chmod(garbage.c_str(), 0755) == 0);
  Child c({garbage}, dir);
  CHECK(c.pid == -1);
  CHECK(c.error.message() == "execve: Exec format error");
  // The child that could not exec was reaped by spawn_process.
  CHECK(zombie_children().empty());
}

TEST_CASE("when spawn_process returns the child has exec'd: a port the parent then lets go is free for a plain bind") {
  const std::string dir = make_temp_dir();
  auto bound = [](int port, bool reuse) {
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    const int one = 1;
    if (reuse) ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(static_cast<uint16_t>(port));
    if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
      ::close(fd);
      return -1;
    }
    return fd;
  };
  // Held as the agent holds a master port: SO_REUSEADDR, bound, not listening, close-on-exec.
  int held = bound(0, true);
  REQUIRE(held >= 0);
  sockaddr_in a{};
  socklen_t len = sizeof(a);
  REQUIRE(::getsockname(held, reinterpret_cast<sockaddr*>(&a), &len) == 0);
  const int port = ntohs(a.sin_port);
  for (int i = 0; i < 20; ++i) {  // each spawn returns only after its child's exec
    Child c({kFakeWorker, "hang", "30"}, dir);
    REQUIRE(c.pid > 0);
    ::close(held);
    // No SO_REUSEADDR: fails while any copy is open. The kernel closes the child's copy in
    // the same execve, just after it let the parent go on (exec_mmap, then close-on-exec).
    int plain = -1;
    CHECK(eventually([&] { return (plain = bound(port, false)) >= 0; }, 30s));
    if (plain >= 0) ::close(plain);
    held = bound(port, true);
    REQUIRE(held >= 0);
  }
  ::close(held);
}

TEST_CASE("a spawned child dies with the process that spawned it") {
  // A middle process spawns a child that would hang for 30 s, tells us its pid, and exits.
  int pipefd[2];
  REQUIRE(::pipe2(pipefd, O_CLOEXEC) == 0);
  const pid_t middle = ::fork();
  REQUIRE(middle >= 0);
  if (middle == 0) {
    const std::string hang = kFakeWorker;
    const char* argv[] = {hang.c_str(), "hang", "30", nullptr};
    const char* envp[] = {nullptr};
    mg::SpawnRequest req;
    req.path = argv[0];
    req.argv = argv;
    req.envp = envp;
    mg::SpawnError error;
    const pid_t pid = mg::spawn_process(req, error);
    [[maybe_unused]] ssize_t w = ::write(pipefd[1], &pid, sizeof(pid));
    ::_exit(0);
  }
  ::close(pipefd[1]);
  pid_t child = -1;
  REQUIRE(::read(pipefd[0], &child, sizeof(child)) == static_cast<ssize_t>(sizeof(child)));
  ::close(pipefd[0]);
  int st = 0;
  REQUIRE(::waitpid(middle, &st, 0) == middle);
  REQUIRE(child > 0);
  const bool gone = eventually([&] { return !pid_alive(child); }, 30s);
  if (!gone) ::kill(child, SIGKILL);
  CHECK(gone);
}

TEST_CASE("tcp_listeners_on names the sockets listening on a port, IPv4 and IPv6, with their owner and inode, and "
          "no connection of that port (#35)") {
  int port = 0;
  const int listener = listen_on_loopback(port, 16);
  REQUIRE(listener >= 0);
  const int client = connect_loopback(port);
  REQUIRE(client >= 0);
  const int accepted = ::accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
  REQUIRE(accepted >= 0);
  const auto mine = mg::socket_inodes_of(::getpid());
  const auto found = mg::tcp_listeners_on(port);
  REQUIRE(found.size() == 1);  // the two ends of the connection are not listed
  CHECK(found[0].uid == ::geteuid());
  CHECK(mine.contains(found[0].inode));
  // An IPv6 listener on the same port number (another address family) is listed too.
  const int v6 = ::socket(AF_INET6, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in6 a{};
  a.sin6_family = AF_INET6;
  a.sin6_addr = in6addr_loopback;
  a.sin6_port = htons(static_cast<std::uint16_t>(port));
  const bool v6_listens = v6 >= 0 && ::bind(v6, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 && ::listen(v6, 1) == 0;
  if (v6_listens) CHECK(mg::tcp_listeners_on(port).size() == 2);
  for (int fd : {listener, client, accepted, v6}) ::close(fd);
  CHECK(mg::tcp_listeners_on(port).empty());
}
