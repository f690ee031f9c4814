#include "support/sshd.h"
#include "support/net.h"
#include "support/skip.h"

#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <arpa/inet.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <stdexcept>

using namespace std::chrono_literals;

namespace mgtest {

namespace {

bool can_connect(const char* addr, int port) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  ::inet_pton(AF_INET, addr, &a.sin_addr);
  bool ok = ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
  ::close(fd);
  return ok;
}

}  // namespace

void require_sshd() {
  require_program("/usr/sbin/sshd", "openssh-server");
  require_program("/usr/bin/ssh", "openssh-client");
  require_program("/usr/bin/ssh-keygen", "openssh-client");
  if (::geteuid() != 0) SKIP_TEST("the sshd fixture needs root (privilege separation directory, PermitRootLogin)");
  std::error_code ec;
  std::filesystem::create_directories("/run/sshd", ec);  // sshd's privilege separation directory
}

void make_ssh_keys(const std::string& dir) {
  for (const char* key : {"hostkey", "id"}) {
    auto r = run({"/usr/bin/ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", dir + "/" + key}, {}, 30s);
    if (r.code != 0) throw std::runtime_error("ssh-keygen failed: " + r.err);
  }
  std::error_code ec;
  std::filesystem::copy_file(dir + "/id.pub", dir + "/authorized_keys", ec);
  // sshd refuses keys readable by others only with StrictModes; keep the client key private anyway.
  ::chmod((dir + "/id").c_str(), 0600);
}

void write_sshd_config(const std::string& path, const std::string& dir, int port,
                       const std::vector<std::string>& listen, const std::string& pid_file) {
  std::ofstream cfg(path);
  cfg << "Port " << port << "\n";
  for (const auto& a : listen) cfg << "ListenAddress " << a << "\n";
  cfg << "HostKey " << dir << "/hostkey\nAuthorizedKeysFile " << dir << "/authorized_keys\n"
      << "PidFile " << pid_file << "\nUsePAM no\nStrictModes no\nPermitRootLogin yes\n"
      << "PasswordAuthentication no\nKbdInteractiveAuthentication no\nPubkeyAuthentication yes\n"
      << "MaxStartups 100:30:200\nMaxSessions 100\nLogLevel ERROR\n";
}

std::vector<std::string> ssh_client_opts(const std::string& dir, int port) {
  return {"-i", dir + "/id", "-p", std::to_string(port), "-o", "StrictHostKeyChecking=no", "-o",
          "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR", "-o", "ConnectTimeout=10"};
}

SshServer::SshServer() {
  require_sshd();
  dir_ = make_temp_dir();
  std::error_code ec;
  // Installed but not working is a failure, never a skip: clean up, then throw.
  auto fail = [&](const std::string& why) {
    proc_.reset();
    std::filesystem::remove_all(dir_, ec);
    throw std::runtime_error(why);
  };
  try {
    make_ssh_keys(dir_);
  } catch (const std::exception& e) {
    fail(e.what());
  }
  for (int attempt = 0; attempt < 5; ++attempt) {
    port_ = free_port_on("127.0.0.2");
    write_sshd_config(dir_ + "/sshd_config", dir_, port_, {"127.0.0.2", "127.0.0.3"}, dir_ + "/sshd.pid");
    proc_.reset();
    proc_.emplace(spawn({"/usr/sbin/sshd", "-D", "-e", "-f", dir_ + "/sshd_config"}));
    if (eventually([&] { return can_connect("127.0.0.2", port_) && can_connect("127.0.0.3", port_); }, 10s)) return;
    // Not listening: sshd exited (the port was taken meanwhile: retry) or hangs (give up).
    const bool exited = proc_->wait(1s);
    if (!exited || attempt == 4) fail("sshd did not start: " + log());
  }
}

SshServer::~SshServer() {
  if (proc_ && proc_->pid > 0 && proc_->status == -1) {
    ::killpg(proc_->pid, SIGTERM);
    proc_->wait(5s);  // SIGKILLs the group when SIGTERM was not enough
  }
  if (!dir_.empty()) {
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
}

std::vector<std::string> SshServer::ssh_opts_list() const { return ssh_client_opts(dir_, port_); }

std::string SshServer::ssh_opts() const {
  std::string out;
  for (const auto& o : ssh_opts_list()) out += (out.empty() ? "" : " ") + o;
  return out;
}

std::string SshServer::log() const { return proc_ ? proc_->err() : std::string(); }

}  // namespace mgtest
