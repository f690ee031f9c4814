#include "support/sshd.h"
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

int free_port_on(const char* addr) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  ::inet_pton(AF_INET, addr, &a.sin_addr);
  int port = 0;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0) {
    socklen_t len = sizeof(a);
    ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
    port = ntohs(a.sin_port);
  }
  ::close(fd);
  return port;
}

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

SshServer::SshServer() {
  require_program("/usr/sbin/sshd", "openssh-server");
  require_program("/usr/bin/ssh", "openssh-client");
  require_program("/usr/bin/ssh-keygen", "openssh-client");
  if (::geteuid() != 0) SKIP_TEST("the sshd fixture needs root (privilege separation directory, PermitRootLogin)");
  std::error_code ec;
  std::filesystem::create_directories("/run/sshd", ec);  // sshd's privilege separation directory
  dir_ = make_temp_dir();
  // Installed but not working is a failure, never a skip: clean up, then throw.
  auto fail = [&](const std::string& why) {
    proc_.reset();
    std::filesystem::remove_all(dir_, ec);
    throw std::runtime_error(why);
  };
  for (const char* key : {"hostkey", "id"}) {
    auto r = run({"/usr/bin/ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", dir_ + "/" + key}, {}, 30s);
    if (r.code != 0) fail("ssh-keygen failed: " + r.err);
  }
  std::filesystem::copy_file(dir_ + "/id.pub", dir_ + "/authorized_keys", ec);
  // sshd refuses keys readable by others only with StrictModes; keep the client key private anyway.
  ::chmod((dir_ + "/id").c_str(), 0600);
  for (int attempt = 0; attempt < 5; ++attempt) {
    port_ = free_port_on("127.0.0.2");
    {
      std::ofstream cfg(dir_ + "/sshd_config");
      cfg << "Port " << port_ << "\nListenAddress 127.0.0.2\nListenAddress 127.0.0.3\n"
          << "HostKey " << dir_ << "/hostkey\nAuthorizedKeysFile " << dir_ << "/authorized_keys\n"
          << "PidFile " << dir_ << "/sshd.pid\nUsePAM no\nStrictModes no\nPermitRootLogin yes\n"
          << "PasswordAuthentication no\nKbdInteractiveAuthentication no\nPubkeyAuthentication yes\n"
          << "MaxStartups 100:30:200\nMaxSessions 100\nLogLevel ERROR\n";
    }
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

std::vector<std::string> SshServer::ssh_opts_list() const {
  return {"-i", dir_ + "/id", "-p", std::to_string(port_), "-o", "StrictHostKeyChecking=no", "-o",
          "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR", "-o", "ConnectTimeout=10"};
}

std::string SshServer::ssh_opts() const {
  std::string out;
  for (const auto& o : ssh_opts_list()) out += (out.empty() ? "" : " ") + o;
  return out;
}

std::string SshServer::log() const { return proc_ ? proc_->err() : std::string(); }

}  // namespace mgtest
