#include "support/proc.h"

#include "support/net.h"

#include <fcntl.h>
#include <poll.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/ptrace.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <dirent.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <regex>
#include <sstream>
#include <stdexcept>

extern char** environ;

namespace mgtest {
namespace {

// Every directory a test makes (make_temp_dir) and every process's own TMPDIR (spawn) lie
// under one root per test process, removed when the process exits. What the processes a
// test starts leave in their TMPDIR (an agent's kept log tree of a failed run, torchrun's
// torchelastic_* directories) goes with its handle, and the directories a test made with
// the root: before, every run of the suite left thousands of mgtest_* directories in /tmp
// and mglaunch_* trees in /dev/shm. A root whose process died without exiting (killed at a
// timeout) is removed by the next test process that makes one.
//
// The root's name proves whose it is: $TMPDIR/mgtest-<pid>-<start>-<pidns>-<boot>-XXXXXX
// (the pid's start time in clock ticks since boot, the pid namespace's inode, the first 8
// characters of the boot id). Only a root of this boot and pid namespace whose pid is gone,
// or is now another process (another start time), is swept: a /tmp shared with another
// container (other pids) or a root of another name is never touched.
constexpr const char* kRootPrefix = "mgtest-";

std::string tmp_base() {
  const char* base = std::getenv("TMPDIR");
  return base && *base ? base : "/tmp";
}

// Field 22 of /proc/PID/stat (after the command's closing parenthesis), "" if unreadable.
std::string start_time_of(pid_t pid) {
  const std::string stat = read_file("/proc/" + std::to_string(pid) + "/stat");
  const auto close = stat.rfind(')');
  if (close == std::string::npos) return {};
  std::istringstream rest(stat.substr(close + 2));
  std::string field;
  for (int i = 3; i <= 22 && rest >> field; ++i)
    if (i == 22) return field;
  return {};
}

// "<pidns inode>-<boot id's first 8 characters>": where a pid and a start time mean something.
std::string pid_realm() {
  std::error_code ec;
  const std::string ns = std::filesystem::read_symlink("/proc/self/ns/pid", ec).string();  // pid:[4026531836]
  const auto a = ns.find('['), b = ns.find(']');
  std::ifstream f("/proc/sys/kernel/random/boot_id");
  std::string boot;
  f >> boot;
  if (ec || a == std::string::npos || b == std::string::npos || b <= a + 1 || boot.size() < 8) return {};
  return ns.substr(a + 1, b - a - 1) + "-" + boot.substr(0, 8);
}

}  // namespace

bool test_root_is_dead(const std::string& name) {
  // mgtest-<pid>-<start>-<realm>-XXXXXX, the realm ours.
  const std::string realm = pid_realm();
  if (realm.empty() || name.rfind(kRootPrefix, 0) != 0) return false;
  const std::string rest = name.substr(std::strlen(kRootPrefix));
  const auto d1 = rest.find('-');
  const auto d2 = d1 == std::string::npos ? d1 : rest.find('-', d1 + 1);
  if (d2 == std::string::npos || d1 == 0 || d1 > 9 || d2 == d1 + 1) return false;
  const std::string pid_text = rest.substr(0, d1), start = rest.substr(d1 + 1, d2 - d1 - 1);
  if (pid_text.find_first_not_of("0123456789") != std::string::npos ||
      start.find_first_not_of("0123456789") != std::string::npos)
    return false;
  const std::string tail = rest.substr(d2 + 1);  // <realm>-XXXXXX
  if (tail.size() != realm.size() + 7 || tail.compare(0, realm.size(), realm) != 0 || tail[realm.size()] != '-')
    return false;
  const auto pid = static_cast<pid_t>(std::stol(pid_text));
  if (::kill(pid, 0) != 0 && errno == ESRCH) return true;
  const std::string now = start_time_of(pid);
  return !now.empty() && now != start;  // the pid was taken by another process since
}

std::string test_root_name_for(pid_t pid) {
  return kRootPrefix + std::to_string(pid) + "-" + start_time_of(pid) + "-" + pid_realm() + "-";
}

namespace {

void sweep_dead_roots(const std::string& base) {
  DIR* d = ::opendir(base.c_str());
  if (!d) return;
  std::vector<std::string> dead;
  for (dirent* e; (e = ::readdir(d)) != nullptr;) {
    const std::string name = e->d_name;
    struct stat st {};
    const std::string path = base + "/" + name;
    // Ours (same user, our boot and pid namespace) and its process gone.
    if (test_root_is_dead(name) && ::lstat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode) && st.st_uid == ::getuid())
      dead.push_back(path);
  }
  ::closedir(d);
  for (const auto& p : dead) {
    std::error_code ec;
    std::filesystem::remove_all(p, ec);
  }
}

struct Root {
  std::string path;
  pid_t owner = 0;
  Root() {
    const std::string base = tmp_base();
    sweep_dead_roots(base);
    std::string templ = base + "/" + test_root_name_for(::getpid()) + "XXXXXX";
    if (!::mkdtemp(templ.data())) throw std::runtime_error("mkdtemp " + templ + " failed: " + std::strerror(errno));
    path = templ;
    owner = ::getpid();
  }
};

// Never destroyed: a static fixture's destructor (the Slurm cluster's) still spawns
// processes at exit, after the clean-up below; the root is then made again (and swept by a
// later test process). A destroyed Root there gave mkdtemp a freed path: terminate.
const std::string& root_dir() {
  static Root* root = [] {
    auto* r = new Root;
    std::atexit([] {
      if (::getpid() != root->owner) return;
      std::error_code ec;
      std::filesystem::remove_all(root->path, ec);
    });
    return r;
  }();
  if (::access(root->path.c_str(), F_OK) != 0) ::mkdir(root->path.c_str(), 0700);
  return root->path;
}

}  // namespace

// With read(2), not a stream: libstdc++'s filebuf throws when read fails, and reading
// /proc/PID/... of a process that exits meanwhile fails with ESRCH (a flake of CI's).
std::string read_file(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return {};
  std::string out;
  char buf[65536];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    out.append(buf, static_cast<std::size_t>(n));
  }
  ::close(fd);
  return out;
}

std::string make_temp_dir() {
  std::string templ = root_dir() + "/mgtest_XXXXXX";
  if (!::mkdtemp(templ.data())) throw std::runtime_error("mkdtemp " + templ + " failed: " + std::strerror(errno));
  return templ;
}

Proc spawn(const std::vector<std::string>& argv, const std::map<std::string, std::string>& env_add) {
  Proc p;
  std::string dir = make_temp_dir();
  p.out_path = dir + "/stdout";
  p.err_path = dir + "/stderr";
  std::map<std::string, std::string> env;
  for (char** e = environ; *e; ++e) {
    std::string kv = *e;
    auto eq = kv.find('=');
    if (eq != std::string::npos) env[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  // A TMPDIR of its own (unless the test names one), removed with the handle.
  const std::string own_tmp = dir + "/tmp";
  if (!env_add.contains("TMPDIR") && ::mkdir(own_tmp.c_str(), 0700) == 0) env["TMPDIR"] = own_tmp;
  // The agents' records of their jobs (launcher/job_record.h): the test case's own directory
  // (MGLAUNCH_RECORD_DIR, set per case by catch_main.cc's listener), else one per test
  // process, unless the test names one (or an XDG_RUNTIME_DIR): what an agent killed in one
  // case recorded never reaches another case or the next run of the suite.
  if (!env_add.contains("MGLAUNCH_RECORD_DIR")) {
    if (env_add.contains("XDG_RUNTIME_DIR")) env.erase("MGLAUNCH_RECORD_DIR");
    else if (!env.contains("MGLAUNCH_RECORD_DIR")) env["MGLAUNCH_RECORD_DIR"] = root_dir() + "/records";
  }
  for (const auto& [k, v] : env_add) {
    if (v == "\x01unset")
      env.erase(k);
    else
      env[k] = v;
  }
  std::vector<std::string> envs;
  for (const auto& [k, v] : env) envs.push_back(k + "=" + v);
  std::vector<char*> cargv, cenv;
  for (const auto& a : argv) cargv.push_back(const_cast<char*>(a.c_str()));
  cargv.push_back(nullptr);
  for (const auto& e : envs) cenv.push_back(const_cast<char*>(e.c_str()));
  cenv.push_back(nullptr);
  pid_t pid = ::fork();
  if (pid == 0) {
    ::setpgid(0, 0);
    int in = ::open("/dev/null", O_RDONLY);
    int out = ::open(p.out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    int err = ::open(p.err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ::dup2(in, 0);
    ::dup2(out, 1);
    ::dup2(err, 2);
    ::execve(cargv[0], cargv.data(), cenv.data());
    ::_exit(126);
  }
  ::setpgid(pid, pid);
  p.pid = pid;
  return p;
}

bool Proc::wait(std::chrono::milliseconds timeout) {
  if (status != -1) return true;
  bool ok = eventually([&] { return ::waitpid(pid, &status, WNOHANG) == pid; }, timeout);
  if (!ok) {
    ::killpg(pid, SIGKILL);
    ::waitpid(pid, &status, 0);
  }
  return ok;
}

int Proc::exit_code() const {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return -1;
}

std::string Proc::out() const { return read_file(out_path); }
std::string Proc::err() const { return read_file(err_path); }

Proc::~Proc() {
  if (pid > 0 && status == -1) {
    ::killpg(pid, SIGKILL);
    ::waitpid(pid, &status, 0);
  }
  // The output files and their directory (make_temp_dir) go with the handle: left behind,
  // every test run added a directory to $TMPDIR, and a /tmp of 170,000 entries slowed every
  // mkdir and rmdir there (the agents' temporary log directories among them).
  // Its TMPDIR goes too, with whatever the process and its children left there.
  if (!out_path.empty()) {
    std::error_code ec;
    std::filesystem::remove_all(out_path.substr(0, out_path.rfind('/')), ec);
  }
}

Result run(const std::vector<std::string>& argv, const std::map<std::string, std::string>& env_add,
           std::chrono::milliseconds timeout) {
  Proc p = spawn(argv, env_add);
  Result r;
  if (!p.wait(timeout)) r.code = -2;  // timed out
  else r.code = p.exit_code();
  r.out = p.out();
  r.err = p.err();
  return r;
}

bool eventually(const std::function<bool()>& pred, std::chrono::milliseconds timeout) {
  auto deadline = std::chrono::steady_clock::now() + timeout;
  for (int i = 0; i < 100000; ++i) {
    if (pred()) return true;
    if (std::chrono::steady_clock::now() >= deadline) break;
    timespec ts{0, 10 * 1000 * 1000};
    ::nanosleep(&ts, nullptr);
  }
  return pred();
}

std::vector<std::string> split_lines(const std::string& text) {
  std::vector<std::string> out;
  std::size_t pos = 0;
  while (pos < text.size()) {
    auto nl = text.find('\n', pos);
    if (nl == std::string::npos) {
      out.push_back(text.substr(pos));
      break;
    }
    out.push_back(text.substr(pos, nl - pos));
    pos = nl + 1;
  }
  return out;
}

// importlib's find_spec finds the package without importing it: `import torch` took 2.6 s of
// CPU (13 s at load 16), paid by every test that asks, each in a process of its own.
bool python_has_torch() {
  static const bool has =
      run({"/usr/bin/python3", "-c", "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is None)"}, {},
          std::chrono::seconds(120)).code == 0;
  return has;
}

bool pid_alive(pid_t pid) {
  const std::string content = read_file("/proc/" + std::to_string(pid) + "/stat");
  auto close = content.rfind(')');
  return close != std::string::npos && close + 2 < content.size() && content[close + 2] != 'Z';
}

int free_loopback_port() { return free_port_on("127.0.0.1"); }

Result run_on_free_port(const std::function<std::vector<std::string>(int port)>& argv_of,
                        const std::map<std::string, std::string>& env_add, std::chrono::milliseconds timeout) {
  for (int attempt = 1;; ++attempt) {
    Result r = run(argv_of(free_loopback_port()), env_add, timeout);
    if (r.code != 2 || r.err.find("--master_port") == std::string::npos ||
        r.err.find("cannot be used") == std::string::npos || attempt == 5)
      return r;
  }
}

int listen_on_loopback(int& port, int backlog) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 || ::listen(fd, backlog) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    if (fd >= 0) ::close(fd);
    return -1;
  }
  port = ntohs(a.sin_port);
  return fd;
}

int connect_loopback(int port) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

int connect_from(const std::string& source, int port) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  sockaddr_in src{};
  src.sin_family = AF_INET;
  ::inet_pton(AF_INET, source.c_str(), &src.sin_addr);
  sockaddr_in dst{};
  dst.sin_family = AF_INET;
  dst.sin_port = htons(static_cast<uint16_t>(port));
  dst.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&src), sizeof src) != 0 ||
      ::connect(fd, reinterpret_cast<sockaddr*>(&dst), sizeof dst) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

std::string http_request(int port, const std::string& path, const std::string& authorization, const std::string& method) {
  int fd = connect_loopback(port);
  if (fd < 0) return "";
  const std::string req = method + " " + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\n" +
                          (authorization.empty() ? "" : "Authorization: " + authorization + "\r\n") +
                          "Connection: close\r\n\r\n";
  if (::write(fd, req.data(), req.size()) != static_cast<ssize_t>(req.size())) {
    ::close(fd);
    return "";
  }
  std::string out;
  char buf[8192];
  const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (std::chrono::steady_clock::now() < end) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 100) <= 0) continue;
    ssize_t n = ::read(fd, buf, sizeof buf);
    if (n <= 0) break;
    out.append(buf, static_cast<std::size_t>(n));
  }
  ::close(fd);
  return out;
}

std::string body_of(const std::string& response) {
  auto at = response.find("\r\n\r\n");
  return at == std::string::npos ? "" : response.substr(at + 4);
}

std::vector<std::string> launch(std::vector<std::string> flags, std::vector<std::string> worker_cmds) {
  std::vector<std::string> argv{kMglaunch};
  argv.insert(argv.end(), flags.begin(), flags.end());
  argv.push_back(kFakeWorker);
  argv.insert(argv.end(), worker_cmds.begin(), worker_cmds.end());
  return argv;
}

std::vector<pid_t> read_pids(const std::string& path) {
  std::vector<pid_t> pids;
  for (const auto& l : split_lines(read_file(path)))
    if (!l.empty() && l.find_first_not_of("0123456789") == std::string::npos) pids.push_back(std::stoi(l));
  return pids;
}

int count_of(const std::string& text, const std::string& what) {
  int n = 0;
  for (auto pos = text.find(what); pos != std::string::npos; pos = text.find(what, pos + 1)) ++n;
  return n;
}

ForeignTracer::ForeignTracer(pid_t pid) {
  int ready[2];
  if (::pipe2(ready, O_CLOEXEC) != 0) return;
  tracer_ = ::fork();
  if (tracer_ == 0) {  // only async-signal-safe calls here: the test may run threads
    const char ok = ::ptrace(PTRACE_SEIZE, pid, nullptr, nullptr) == 0 ? '1' : '0';
    (void)!::write(ready[1], &ok, 1);
    for (;;) ::pause();
  }
  ::close(ready[1]);
  char ok = '0';
  if (tracer_ > 0) (void)!::read(ready[0], &ok, 1);
  ::close(ready[0]);
  attached_ = ok == '1';
}

void ForeignTracer::release() {
  if (tracer_ <= 0) return;
  ::kill(tracer_, SIGKILL);
  int status = 0;
  while (::waitpid(tracer_, &status, 0) < 0 && errno == EINTR) {
  }
  tracer_ = -1;
}

int health_port_of(const Proc& p) {
  static const std::regex re(R"(health check on http://127\.0\.0\.1:([0-9]+)/health)");
  std::smatch m;
  const std::string err = p.err();
  return std::regex_search(err, m, re) ? std::stoi(m[1]) : 0;
}

}  // namespace mgtest
