#include "support/slurm_cluster.h"
#include "support/net.h"
#include "support/skip.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <pwd.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <set>
#include <sstream>
#include <stdexcept>

extern char** environ;

namespace mgtest {
namespace {

namespace fs = std::filesystem;

std::string find_on_path(const std::string& name) {
  for (const char* dir : {"/usr/bin", "/usr/sbin", "/usr/local/bin", "/usr/local/sbin", "/bin", "/sbin"}) {
    std::string p = std::string(dir) + "/" + name;
    if (::access(p.c_str(), X_OK) == 0) return p;
  }
  const char* path = std::getenv("PATH");
  std::stringstream ss(path ? path : "");
  for (std::string dir; std::getline(ss, dir, ':');)
    if (!dir.empty() && ::access((dir + "/" + name).c_str(), X_OK) == 0) return dir + "/" + name;
  return {};
}

// A port for a Slurm daemon (it binds every address): from the tests' reserved range, free on
// every address and held for the life of this process (support/net.h), so neither a test
// beside this one nor an agent's master port (20000 and up) takes it (review s39 L11).
int free_port(std::set<int>& taken) {
  for (int attempt = 0; attempt < 100; ++attempt) {
    const int port = mgtest::free_port_on("0.0.0.0");
    if (port > 0 && taken.insert(port).second) return port;
  }
  throw std::runtime_error("cannot find a free port");
}

std::string user_name() {
  passwd* pw = ::getpwuid(::getuid());
  return pw ? pw->pw_name : "root";
}

std::string host_name() {
  char h[256] = {};
  ::gethostname(h, sizeof(h) - 1);
  return h;
}

// Starts a daemon in the foreground as our child, in its own process group, killed when
// this process dies.
pid_t start_daemon(const std::vector<std::string>& argv, const std::string& conf, const std::string& log) {
  const pid_t parent = ::getpid();
  pid_t pid = ::fork();
  if (pid < 0) throw std::runtime_error("fork failed");
  if (pid == 0) {
    ::setpgid(0, 0);
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(1);
    ::setenv("SLURM_CONF", conf.c_str(), 1);
    int in = ::open("/dev/null", O_RDONLY);
    int out = ::open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
    ::dup2(in, 0);
    ::dup2(out, 1);
    ::dup2(out, 2);
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    ::execv(args[0], args.data());
    ::_exit(127);
  }
  ::setpgid(pid, pid);
  return pid;
}

std::string tail(const std::string& path, std::size_t lines) {
  auto all = split_lines(read_file(path));
  std::string out;
  for (std::size_t i = all.size() > lines ? all.size() - lines : 0; i < all.size(); ++i) out += all[i] + "\n";
  return out;
}

std::string g_start_error;

}  // namespace

std::string SlurmCluster::command(const std::string& name) { return find_on_path(name); }

void SlurmCluster::require_programs() {
  for (const char* name : {"slurmctld", "slurmd", "srun", "sbatch", "scontrol", "squeue", "scancel"}) {
    const std::string path = command(name);
    require_program(path.empty() ? name : path, "slurm-wlm");
  }
}
const std::string& SlurmCluster::start_error() { return g_start_error; }

SlurmCluster* SlurmCluster::shared() {
  static std::unique_ptr<SlurmCluster> cluster;
  static bool tried = false;
  if (!tried) {
    tried = true;
    require_programs();
    try {
      cluster = std::make_unique<SlurmCluster>(3);
    } catch (const std::exception& e) {
      g_start_error = std::string("the test Slurm cluster did not start: ") + e.what();
    }
  }
  return cluster.get();
}

SlurmCluster::SlurmCluster(int nodes) : nodes_(nodes), dir_(make_temp_dir()) {
  conf_ = dir_ + "/slurm.conf";
  // A port picked free can still be taken before a daemon binds it: try afresh a few times.
  for (int attempt = 1;; ++attempt) {
    try {
      start(attempt);
      return;
    } catch (const std::exception& e) {
      std::string why = e.what();
      stop_daemons();
      if (attempt == 3) {
        std::error_code ec;
        fs::remove_all(dir_, ec);
        throw std::runtime_error(why);
      }
    }
  }
}

void SlurmCluster::start(int attempt) {
  const std::string run = dir_ + "/try" + std::to_string(attempt);
  fs::create_directories(run + "/state");
  fs::create_directories(run + "/spool");
  const std::string user = user_name(), host = host_name();
  std::set<int> ports;
  std::ofstream c(conf_, std::ios::trunc);
  c << "ClusterName=mgtest\n"
    << "SlurmctldHost=" << host << "(127.0.0.1)\n"
    << "SlurmctldPort=" << free_port(ports) << "\n"
    << "SlurmUser=" << user << "\nSlurmdUser=" << user << "\n"
    << "AuthType=auth/none\nCredType=cred/none\n"
    << "ProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\n"
    << "SelectType=select/cons_tres\nSelectTypeParameters=CR_Core\n"
    << "SlurmdParameters=config_overrides\nMpiDefault=none\n"
    << "AccountingStorageType=accounting_storage/none\nJobAcctGatherType=jobacct_gather/none\n"
    << "JobCompType=jobcomp/none\nReturnToService=2\nInactiveLimit=0\nKillWait=10\nMinJobAge=600\n"
    // Job ids of their own, so that test clusters running side by side do not hash their
    // steps to the same rendezvous ports.
    << "FirstJobId=" << 1000 + std::random_device{}() % 1000000 << "\n"
    << "StateSaveLocation=" << run << "/state\n"
    << "SlurmdSpoolDir=" << run << "/spool/%n\n"
    << "SlurmctldPidFile=" << run << "/slurmctld.pid\n"
    << "SlurmdPidFile=" << run << "/slurmd.%n.pid\n"
    << "SlurmctldLogFile=" << dir_ << "/slurmctld.log\n"
    << "SlurmdLogFile=" << dir_ << "/slurmd.%n.log\n";
  for (int i = 1; i <= nodes_; ++i)
    c << "NodeName=n" << i << " NodeHostname=" << host << " NodeAddr=127.0.0.1 Port=" << free_port(ports)
      << " CPUs=4 RealMemory=2000 State=UNKNOWN\n";
  c << "PartitionName=debug Nodes=n[1-" << nodes_ << "] Default=YES MaxTime=INFINITE State=UP\n";
  c.close();

  daemons_.push_back(start_daemon({command("slurmctld"), "-D", "-f", conf_}, conf_, dir_ + "/slurmctld.out"));
  for (int i = 1; i <= nodes_; ++i)
    daemons_.push_back(start_daemon({command("slurmd"), "-D", "-N", "n" + std::to_string(i), "-f", conf_}, conf_,
                                    dir_ + "/slurmd.n" + std::to_string(i) + ".out"));
  bool died = false;
  const bool up = eventually(
      [&] {
        for (pid_t& pid : daemons_) {
          int status = 0;
          if (pid > 0 && ::waitpid(pid, &status, WNOHANG) == pid) {
            died = true;
            pid = -1;  // reaped: never signal that number again
          }
        }
        return died || all_nodes_idle();
      },
      std::chrono::seconds(60));
  if (died || !up)
    throw std::runtime_error(std::string(died ? "a daemon exited" : "nodes not idle after 60 s") + "; logs:\n" +
                             log_tail());
}

void SlurmCluster::stop_daemons() {
  for (pid_t pid : daemons_)
    if (pid > 0) ::kill(pid, SIGTERM);
  for (pid_t pid : daemons_) {
    if (pid <= 0) continue;
    int status = 0;
    if (!eventually([&] { return ::waitpid(pid, &status, WNOHANG) != 0; }, std::chrono::seconds(15))) {
      ::killpg(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
    }
  }
  daemons_.clear();
}

SlurmCluster::~SlurmCluster() {
  if (daemons_.empty()) return;
  cancel_all_jobs();
  stop_daemons();
  if (!std::getenv("MGTEST_KEEP_SLURM")) {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
}

void SlurmCluster::cancel_all_jobs() {
  auto ids = [&] {
    auto r = run({"squeue", "-h", "-o", "%i"}, std::chrono::seconds(20));
    std::vector<std::string> out;
    for (const auto& l : split_lines(r.out))
      if (!l.empty()) out.push_back(l);
    return out;
  };
  auto jobs = ids();
  if (jobs.empty()) return;
  std::vector<std::string> argv{"scancel"};
  argv.insert(argv.end(), jobs.begin(), jobs.end());
  run(argv, std::chrono::seconds(20));
  eventually([&] { return ids().empty(); }, std::chrono::seconds(40));
}

bool SlurmCluster::all_nodes_idle() const {
  auto r = run({"sinfo", "-h", "-N", "-o", "%t"}, std::chrono::seconds(10));
  int idle = 0;
  for (const auto& l : split_lines(r.out)) idle += l == "idle";
  return r.code == 0 && idle == nodes_;
}

// Our cluster's config, and none of the SLURM_* of a job the tests themselves may run in.
std::map<std::string, std::string> SlurmCluster::client_env(std::map<std::string, std::string> env) const {
  for (char** e = environ; *e; ++e) {
    std::string_view kv = *e;
    if (kv.starts_with("SLURM_") || kv.starts_with("SLURMD_"))
      env.emplace(std::string(kv.substr(0, kv.find('='))), "\x01unset");
  }
  env["SLURM_CONF"] = conf_;
  return env;
}

Result SlurmCluster::run(std::vector<std::string> argv, std::chrono::milliseconds timeout,
                         std::map<std::string, std::string> env) const {
  if (argv.at(0).find('/') == std::string::npos) argv[0] = command(argv[0]);
  return mgtest::run(argv, client_env(std::move(env)), timeout);
}

Proc SlurmCluster::spawn(std::vector<std::string> argv, std::map<std::string, std::string> env) const {
  if (argv.at(0).find('/') == std::string::npos) argv[0] = command(argv[0]);
  return mgtest::spawn(argv, client_env(std::move(env)));
}

std::map<std::string, std::string> SlurmCluster::job(const std::string& id) const {
  std::map<std::string, std::string> out;
  auto r = run({"scontrol", "show", "job", id, "-o"}, std::chrono::seconds(20));
  if (r.code != 0) return out;
  std::stringstream ss(r.out);
  for (std::string kv; ss >> kv;) {
    auto eq = kv.find('=');
    if (eq != std::string::npos) out.emplace(kv.substr(0, eq), kv.substr(eq + 1));
  }
  return out;
}

std::string SlurmCluster::log_tail() const {
  std::string out = "--- slurmctld.log\n" + tail(dir_ + "/slurmctld.log", 15) + tail(dir_ + "/slurmctld.out", 5);
  for (int i = 1; i <= nodes_; ++i)
    out += "--- slurmd.n" + std::to_string(i) + ".log\n" + tail(dir_ + "/slurmd.n" + std::to_string(i) + ".log", 5);
  return out;
}

}  // namespace mgtest
