#include "support/netns_cluster.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <stdexcept>

#include "support/skip.h"
#include "support/sshd.h"

using namespace std::chrono_literals;

namespace mgtest {

namespace {

const std::string kIp = "/usr/sbin/ip";
const std::string kNft = "/usr/sbin/nft";
const std::string kNsenter = "/usr/bin/nsenter";
const std::string kSetpriv = "/usr/bin/setpriv";

std::string ns_of(pid_t pid) {
  std::error_code ec;
  return std::filesystem::read_symlink("/proc/" + std::to_string(pid) + "/ns/net", ec).string();
}

// Whether `fd` can be read within `timeout`.
bool readable(int fd, std::chrono::milliseconds timeout) {
  pollfd p{fd, POLLIN, 0};
  return ::poll(&p, 1, static_cast<int>(timeout.count())) == 1;
}

}  // namespace

NetCluster::NetCluster(int hosts) {
  require_program(kIp, "iproute2");
  require_program(kNft, "nftables");
  require_program(kNsenter, "util-linux");
  require_program(kSetpriv, "util-linux");
  require_in_ci(::geteuid() == 0, "the namespace cluster needs root (network namespaces, veths, nft), not uid " +
                                      std::to_string(::geteuid()));
  if (hosts < 1 || hosts > 200) throw std::invalid_argument("NetCluster: 1 to 200 hosts, not " + std::to_string(hosts));
  dir_ = make_temp_dir();
  std::string hosts_text = "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n";
  for (int k = 0; k < hosts; ++k) {
    hosts_.push_back({-1, "node" + std::to_string(k), "10.34.0." + std::to_string(k + 1)});
    hosts_text += hosts_.back().addr + "\t" + hosts_.back().name + "\n";
  }
  {
    std::ofstream f(dir_ + "/hosts");
    f << hosts_text;
  }
  switch_.holder = make_holder("", "");
  switch_.name = "switch";
  for (auto& h : hosts_) h.holder = make_holder(h.name, dir_ + "/hosts");
  namespaces_.push_back(ns_of(switch_.holder));
  for (const auto& h : hosts_) namespaces_.push_back(ns_of(h.holder));

  // The switch: a bridge and one veth per host, whose other end is the host's eth0.
  std::string batch = "link set lo up\nlink add br0 type bridge\nlink set br0 up\n";
  for (int k = 0; k < hosts; ++k)
    batch += "link add " + port(k) + " type veth peer name eth0 netns " +
             std::to_string(hosts_[static_cast<std::size_t>(k)].holder) + "\nlink set " + port(k) +
             " master br0\nlink set " + port(k) + " up\n";
  ip_batch(switch_.holder, batch);
  for (const auto& h : hosts_)
    ip_batch(h.holder, "link set lo up\naddr add " + h.addr + "/24 dev eth0\nlink set eth0 up\n");
  // The faults' table: frames between the bridge's ports pass its chain `faults`.
  {
    std::ofstream f(dir_ + "/table.nft");
    f << "table bridge mgnet {\n  chain faults { type filter hook forward priority 0; policy accept; }\n}\n";
  }
  in_switch({kNft, "-f", dir_ + "/table.nft"});
}

NetCluster::~NetCluster() {
  flappers_.clear();  // Proc's destructor kills each loop's process group
  sshds_.clear();
  kill_everything_inside();
  std::vector<pid_t> holders{switch_.holder};
  for (const auto& h : hosts_) holders.push_back(h.holder);
  for (pid_t p : holders) {
    if (p <= 0) continue;
    ::kill(p, SIGKILL);
    ::waitpid(p, nullptr, 0);
  }
  std::error_code ec;
  if (!dir_.empty()) std::filesystem::remove_all(dir_, ec);
}

// A child of ours that made the namespaces and holds them until it is killed (or we die:
// PR_SET_PDEATHSIG). A host's also has its host name and its /etc/hosts; the switch's
// (hostname "") only a network namespace. Only system calls between fork and pause.
pid_t NetCluster::make_holder(const std::string& hostname, const std::string& hosts_file) {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) throw std::runtime_error(std::string("pipe2: ") + std::strerror(errno));
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid < 0) throw std::runtime_error(std::string("fork: ") + std::strerror(errno));
  if (pid == 0) {
    ::close(fds[0]);
    int step = 0, err = 0;
    auto check = [&](bool ok, int s) {
      if (!ok && err == 0) step = s, err = errno;
    };
    check(::prctl(PR_SET_PDEATHSIG, SIGKILL) == 0 && ::getppid() == parent, 1);
    check(err == 0 && ::unshare(hostname.empty() ? CLONE_NEWNET : CLONE_NEWNET | CLONE_NEWUTS | CLONE_NEWNS) == 0, 2);
    if (!hostname.empty()) {
      check(err == 0 && ::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) == 0, 3);
      check(err == 0 && ::mount(hosts_file.c_str(), "/etc/hosts", nullptr, MS_BIND, nullptr) == 0, 4);
      check(err == 0 && ::sethostname(hostname.data(), hostname.size()) == 0, 5);
    }
    const int msg[2] = {step, err};
    [[maybe_unused]] auto n = ::write(fds[1], msg, sizeof msg);
    if (err != 0) ::_exit(1);
    ::close_range(3, ~0U, 0);  // hold nothing of the test's (a listening socket, a pipe's end)
    for (;;) ::pause();
  }
  ::close(fds[1]);
  int msg[2] = {-1, 0};
  const bool answered = readable(fds[0], 10s) && ::read(fds[0], msg, sizeof msg) == sizeof msg;
  ::close(fds[0]);
  if (answered && msg[0] == 0) return pid;
  ::kill(pid, SIGKILL);
  ::waitpid(pid, nullptr, 0);
  static const char* steps[] = {"", "prctl", "unshare", "mount --make-rprivate /", "mount --bind /etc/hosts",
                                "sethostname"};
  const std::string why = answered && msg[0] > 0 && msg[0] < 6
                              ? std::string(steps[msg[0]]) + ": " + std::strerror(msg[1])
                              : "the holder process gave no answer";
  require_in_ci(false, "cannot make the namespace cluster's network namespaces here (" + why + ")");
  return -1;  // not reached
}

std::vector<std::string> NetCluster::enter(pid_t holder, bool net_only) const {
  const std::string ns = "/proc/" + std::to_string(holder) + "/ns/";
  std::vector<std::string> argv{kNsenter, "--net=" + ns + "net"};
  if (!net_only) {
    std::error_code ec;
    argv.insert(argv.end(), {"--uts=" + ns + "uts", "--mount=" + ns + "mnt",
                             "--wd=" + std::filesystem::current_path(ec).string()});
  }
  argv.insert(argv.end(), {"--", kSetpriv, "--pdeathsig", "KILL", "--"});
  return argv;
}

void NetCluster::in_namespace(pid_t holder, const std::vector<std::string>& argv) const {
  std::vector<std::string> full = enter(holder, true);
  full.insert(full.end(), argv.begin(), argv.end());
  const Result r = run(full, {}, 30s);
  if (r.code != 0) {
    std::string cmd;
    for (const auto& a : argv) cmd += (cmd.empty() ? "" : " ") + a;
    throw std::runtime_error("namespace cluster: '" + cmd + "' failed (exit " + std::to_string(r.code) + "): " + r.err);
  }
}

void NetCluster::ip_batch(pid_t holder, const std::string& commands) const {
  const std::string file = dir_ + "/ip-batch";
  {
    std::ofstream f(file);
    f << commands;
  }
  std::vector<std::string> argv = enter(holder, true);
  argv.insert(argv.end(), {kIp, "-batch", file});
  const Result r = run(argv, {}, 30s);
  if (r.code != 0) throw std::runtime_error("namespace cluster: ip -batch failed: " + r.err + "\n" + commands);
}

std::string NetCluster::addr(int k) const { return hosts_.at(static_cast<std::size_t>(k)).addr; }
std::string NetCluster::name(int k) const { return hosts_.at(static_cast<std::size_t>(k)).name; }

Proc NetCluster::spawn_on(int k, const std::vector<std::string>& argv,
                          const std::map<std::string, std::string>& env) const {
  std::vector<std::string> full = enter(hosts_.at(static_cast<std::size_t>(k)).holder, false);
  full.insert(full.end(), argv.begin(), argv.end());
  return spawn(full, env);
}

Result NetCluster::run_on(int k, const std::vector<std::string>& argv, const std::map<std::string, std::string>& env,
                          std::chrono::milliseconds timeout) const {
  Proc p = spawn_on(k, argv, env);
  Result r;
  r.code = p.wait(timeout) ? p.exit_code() : -2;
  r.out = p.out();
  r.err = p.err();
  return r;
}

// Host k's veth at the switch (k checked).
std::string NetCluster::port(int k) const {
  (void)hosts_.at(static_cast<std::size_t>(k));
  return "h" + std::to_string(k);
}

void NetCluster::cut(int k) { in_switch({kIp, "link", "set", port(k), "down"}); }

void NetCluster::reconnect(int k) { in_switch({kIp, "link", "set", port(k), "up"}); }

void NetCluster::drop(int from, int to) {
  std::string rule = "iifname \"" + port(from) + "\" ";
  if (to >= 0) rule += "oifname \"" + port(to) + "\" ";
  rules_["drop " + std::to_string(from) + " " + std::to_string(to)] = rule + "ether type ip drop";
  apply_rules();
}

void NetCluster::undrop(int from, int to) {
  rules_.erase("drop " + std::to_string(from) + " " + std::to_string(to));
  apply_rules();
}

void NetCluster::loss(int k, int percent) {
  const std::string p_k = port(k);
  if (percent < 0 || percent > 100) throw std::invalid_argument("loss: a percentage, not " + std::to_string(percent));
  const std::string id = "loss " + std::to_string(k);
  if (percent == 0) {
    rules_.erase(id);
  } else {
    const std::string p = " ether type ip numgen random mod 100 < " + std::to_string(percent) + " drop";
    rules_[id] = "iifname \"" + p_k + "\"" + p + "\noifname \"" + p_k + "\"" + p;
  }
  apply_rules();
}

void NetCluster::reject(int k) {
  const Host& h = hosts_.at(static_cast<std::size_t>(k));
  unreject(k);
  const std::string file = dir_ + "/reject.nft";
  {
    std::ofstream f(file);
    f << "table inet mgreject {\n"
         "  chain in { type filter hook input priority 0; policy accept;\n"
         "    iifname != \"lo\" meta l4proto tcp reject with tcp reset\n"
         "    iifname != \"lo\" meta l4proto udp reject\n  }\n"
         // The resets and ICMP errors the input chain makes leave through this chain: not
         // rejected again (a reset is never answered).
         "  chain out { type filter hook output priority 0; policy accept;\n"
         "    oifname != \"lo\" tcp flags & rst == 0 reject with tcp reset\n"
         "    oifname != \"lo\" meta l4proto udp reject\n  }\n"
         "}\n";
  }
  in_namespace(h.holder, {kNft, "-f", file});
  rejecting_.push_back(k);
}

void NetCluster::unreject(int k) {
  const auto it = std::find(rejecting_.begin(), rejecting_.end(), k);
  if (it == rejecting_.end()) return;
  in_namespace(hosts_.at(static_cast<std::size_t>(k)).holder, {kNft, "delete", "table", "inet", "mgreject"});
  rejecting_.erase(it);
}

// The chain `faults` rewritten whole, in one nft transaction.
void NetCluster::apply_rules() {
  std::string script = "flush chain bridge mgnet faults\n";
  for (const auto& [id, rules] : rules_)
    for (const auto& r : split_lines(rules)) script += "add rule bridge mgnet faults " + r + " comment \"" + id + "\"\n";
  const std::string file = dir_ + "/rules.nft";
  {
    std::ofstream f(file);
    f << script;
  }
  in_switch({kNft, "-f", file});
}

void NetCluster::flap(int k, std::chrono::milliseconds down, std::chrono::milliseconds up) {
  stop_flap(k);
  auto secs = [](std::chrono::milliseconds d) { return std::to_string(static_cast<double>(d.count()) / 1000.0); };
  const std::string port = this->port(k);
  std::vector<std::string> argv = enter(switch_.holder, true);
  argv.insert(argv.end(), {"/bin/sh", "-c",
                           "i=0; while [ $i -lt 1000 ]; do i=$((i+1)); " + kIp + " link set " + port + " down; sleep " +
                               secs(down) + "; " + kIp + " link set " + port + " up; sleep " + secs(up) + "; done"});
  flappers_.emplace(k, spawn(argv));
}

void NetCluster::stop_flap(int k) {
  if (flappers_.erase(k) > 0) reconnect(k);
}

void NetCluster::heal() {
  flappers_.clear();
  while (!rejecting_.empty()) unreject(rejecting_.back());
  rules_.clear();
  apply_rules();
  std::string batch;
  for (int k = 0; k < size(); ++k) batch += "link set " + port(k) + " up\n";
  ip_batch(switch_.holder, batch);
}

void NetCluster::start_sshd() {
  require_sshd();
  if (!sshds_.empty()) return;
  make_ssh_keys(dir_);
  for (int k = 0; k < size(); ++k) {
    const std::string cfg = dir_ + "/sshd_config_" + std::to_string(k);
    write_sshd_config(cfg, dir_, 22, {addr(k)}, dir_ + "/sshd_" + std::to_string(k) + ".pid");
    sshds_.push_back(spawn_on(k, {"/usr/sbin/sshd", "-D", "-e", "-f", cfg}));
  }
  for (int k = 0; k < size(); ++k) {
    const bool up = eventually([&] {
      InHost in(*this, k);
      const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
      sockaddr_in a{};
      a.sin_family = AF_INET;
      a.sin_port = htons(22);
      ::inet_pton(AF_INET, addr(k).c_str(), &a.sin_addr);
      const bool ok = ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
      ::close(fd);
      return ok;
    }, 10s);
    if (!up) throw std::runtime_error("sshd did not start on " + name(k) + ": " + sshds_[static_cast<std::size_t>(k)].err());
  }
}

std::vector<std::string> NetCluster::ssh_opts() const { return ssh_client_opts(dir_, 22); }

NetCluster::InHost::InHost(const NetCluster& c, int k) {
  own_ = ::open("/proc/thread-self/ns/net", O_RDONLY | O_CLOEXEC);
  const int target =
      ::open(("/proc/" + std::to_string(c.hosts_.at(static_cast<std::size_t>(k)).holder) + "/ns/net").c_str(),
             O_RDONLY | O_CLOEXEC);
  const bool ok = own_ >= 0 && target >= 0 && ::setns(target, CLONE_NEWNET) == 0;
  const int err = errno;
  if (target >= 0) ::close(target);
  if (!ok) {
    if (own_ >= 0) ::close(own_);
    throw std::runtime_error("setns into " + c.name(k) + "'s network namespace: " + std::strerror(err));
  }
}

NetCluster::InHost::~InHost() {
  ::setns(own_, CLONE_NEWNET);
  ::close(own_);
}

std::string NetCluster::switch_links() const {
  std::vector<std::string> argv = enter(switch_.holder, true);
  argv.insert(argv.end(), {kIp, "-o", "link", "show"});
  return run(argv, {}, 30s).out;
}

std::string NetCluster::switch_rules() const {
  std::vector<std::string> argv = enter(switch_.holder, true);
  argv.insert(argv.end(), {kNft, "list", "chain", "bridge", "mgnet", "faults"});
  return run(argv, {}, 30s).out;
}

std::vector<std::string> NetCluster::namespaces() const { return namespaces_; }

// Every process in one of our namespaces but the holders, SIGKILLed by pid until none is
// left (each started here, directly or by what we started: an agent's workers, a daemon).
void NetCluster::kill_everything_inside() {
  std::vector<pid_t> holders{switch_.holder};
  for (const auto& h : hosts_) holders.push_back(h.holder);
  const auto deadline = std::chrono::steady_clock::now() + 20s;
  for (int round = 0; round < 1000 && std::chrono::steady_clock::now() < deadline; ++round) {
    int found = 0;
    std::error_code ec;
    for (const auto& e : std::filesystem::directory_iterator("/proc", ec)) {
      const std::string name = e.path().filename().string();
      if (name.find_first_not_of("0123456789") != std::string::npos) continue;
      const pid_t pid = static_cast<pid_t>(std::stol(name));
      if (std::find(holders.begin(), holders.end(), pid) != holders.end()) continue;
      const std::string ns = ns_of(pid);
      if (ns.empty() || std::find(namespaces_.begin(), namespaces_.end(), ns) == namespaces_.end()) continue;
      ::kill(pid, SIGKILL);
      ++found;
    }
    if (found == 0) return;
    // Our own children among them are reaped by their Proc handles; others by their parent.
    timespec ts{0, 20 * 1000 * 1000};
    ::nanosleep(&ts, nullptr);
  }
}

}  // namespace mgtest
