// Test fixture: a private OpenSSH server on a free port of 127.0.0.2 and 127.0.0.3, with
// its own host key and a fresh client key, so tests reach two "hosts" over real ssh.
// RAII: the destructor stops sshd (its process group) and removes the directory, also
// when a test fails. Needs /usr/sbin/sshd (Debian openssh-server), ssh and ssh-keygen
// (openssh-client) and root (sshd's privilege separation): the constructor skips the test
// without them (fails under CI=true when a package is missing: support/skip.h), and throws
// when they are there but sshd does not start.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "support/proc.h"

namespace mgtest {

// The parts every private sshd of the tests shares (this server, and the namespace cluster's
// sshd per host in support/netns_cluster.h):
// Skips (or fails under CI=true) without sshd, ssh and ssh-keygen, or without root.
void require_sshd();
// In `dir`: a host key (hostkey), a client key (id, mode 0600) and authorized_keys for it.
// Throws when ssh-keygen fails.
void make_ssh_keys(const std::string& dir);
// Writes `path`: an sshd listening on `port` of each address in `listen`, with the keys of
// `dir`, its pid file `pid_file`, root by key only, no PAM.
void write_sshd_config(const std::string& path, const std::string& dir, int port,
                       const std::vector<std::string>& listen, const std::string& pid_file);
// The client's options for the keys of `dir`: key, port, no host-key prompts.
std::vector<std::string> ssh_client_opts(const std::string& dir, int port);

class SshServer {
 public:
  SshServer();
  ~SshServer();
  SshServer(const SshServer&) = delete;
  SshServer& operator=(const SshServer&) = delete;

  int port() const { return port_; }
  // Client options for --ssh-opts: key, port, no host-key prompts.
  std::string ssh_opts() const;
  std::vector<std::string> ssh_opts_list() const;
  const std::string& dir() const { return dir_; }
  std::string log() const;

 private:
  std::string dir_;
  int port_ = 0;
  std::optional<Proc> proc_;
};

}  // namespace mgtest
