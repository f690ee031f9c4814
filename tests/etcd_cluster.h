// Test helper: a real etcd (Debian's etcd-server) of 1 or 3 members on 127.0.0.1..3, free
// ports, a temporary data directory; every member is SIGKILLed and reaped and the data
// removed when the cluster goes out of scope, whatever the test did.
#pragma once

#include <unistd.h>

#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "support/net.h"
#include "support/proc.h"
#include "support/skip.h"

namespace mgtest {

inline const std::string kEtcd = "/usr/bin/etcd";
inline const std::string kEtcdctl = "/usr/bin/etcdctl";

struct EtcdMember {
  std::string name, host;
  int client_port = 0, peer_port = 0;
  std::optional<Proc> proc;  // Proc cannot be assigned
  std::string endpoint() const { return host + ":" + std::to_string(client_port); }
};

class EtcdCluster {
 public:
  // Returns when every program the cluster calls is installed; else the test skips, or
  // fails under CI=true (support/skip.h). Call it before anything else in the test.
  static void require_programs() {
    require_program(kEtcd, "etcd-server");
    require_program(kEtcdctl, "etcd-client");
    require_program("/usr/bin/openssl", "openssl");  // the TLS clusters' certificates
  }

  // With `tls`, a CA and a certificate for 127.0.0.1-3 are made (openssl) and the members
  // serve https only; ca() is the CA's PEM file. With `client_certs` too, etcd asks every
  // client for a certificate signed by that CA (client_cert(), client_key()).
  explicit EtcdCluster(int size, bool tls = false, bool client_certs = false)
      : dir_(make_temp_dir()), tls_(tls || client_certs), client_certs_(client_certs) {
    using namespace std::chrono_literals;
    if (tls_) make_certificates();
    // A port taken between the probe and etcd's bind makes a member die: start again.
    for (int attempt = 0; attempt < 3; ++attempt) {
      members_.clear();
      std::string initial;
      for (int i = 1; i <= size; ++i) {
        EtcdMember m;
        m.name = "m" + std::to_string(i);
        m.host = "127.0.0." + std::to_string(i);
        m.client_port = free_port_on(m.host);
        m.peer_port = free_port_on(m.host);
        initial += (initial.empty() ? "" : ",") + m.name + "=http://" + m.host + ":" + std::to_string(m.peer_port);
        members_.push_back(std::move(m));
      }
      const std::string token = "mgtest-" + std::to_string(::getpid()) + "-" + std::to_string(attempt);
      for (auto& m : members_) {
        const std::string client = (tls_ ? "https://" : "http://") + m.endpoint();
        const std::string peer = "http://" + m.host + ":" + std::to_string(m.peer_port);
        std::vector<std::string> argv{kEtcd, "--name", m.name, "--data-dir",
                                      dir_ + "/" + m.name + "-" + std::to_string(attempt), "--listen-client-urls",
                                      client, "--advertise-client-urls", client, "--listen-peer-urls", peer,
                                      "--initial-advertise-peer-urls", peer, "--initial-cluster", initial,
                                      "--initial-cluster-state", "new", "--initial-cluster-token", token,
                                      "--log-level", "warn"};
        if (tls_)
          argv.insert(argv.end(), {"--cert-file", dir_ + "/server.pem", "--key-file", dir_ + "/server.key"});
        if (client_certs_) argv.insert(argv.end(), {"--client-cert-auth", "--trusted-ca-file", ca()});
        m.proc.emplace(spawn(argv));
      }
      if (eventually([&] { return healthy() || !all_alive(); }, 60s) && healthy()) return;
      for (auto& m : members_) {
        ::kill(m.proc->pid, SIGKILL);
        m.proc->wait(10s);
      }
    }
    FAIL("etcd did not start: " << members_.front().proc->err());
  }

  ~EtcdCluster() {
    using namespace std::chrono_literals;
    members_.clear();  // Proc's destructor SIGKILLs and reaps
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }

  std::string ca() const { return dir_ + "/ca.pem"; }
  std::string client_cert() const { return dir_ + "/client.pem"; }
  std::string client_key() const { return dir_ + "/client.key"; }
  // etcdctl against this cluster (its CA when TLS), e.g. {"user", "add", "root:pw"}.
  Result ctl(std::vector<std::string> args) const {
    std::vector<std::string> argv{kEtcdctl, "--endpoints=" + endpoints(), "--command-timeout=5s"};
    if (tls_) argv.push_back("--cacert=" + ca());
    if (client_certs_) argv.insert(argv.end(), {"--cert=" + client_cert(), "--key=" + client_key()});
    argv.insert(argv.end(), args.begin(), args.end());
    return run(argv, {}, std::chrono::seconds(20));
  }
  std::string endpoints(int first = 0) const {
    std::string out;
    for (std::size_t i = 0; i < members_.size(); ++i) {
      const auto& m = members_[(i + static_cast<std::size_t>(first)) % members_.size()];
      out += (out.empty() ? "" : ",") + m.endpoint();
    }
    return out;
  }
  EtcdMember& member(int i) { return members_.at(static_cast<std::size_t>(i)); }
  // Keys under `prefix` (etcdctl get --prefix --keys-only), one per line.
  std::vector<std::string> keys(const std::string& prefix) const {
    std::vector<std::string> out;
    for (const auto& l : split_lines(ctl({"get", "--prefix", "--keys-only", prefix}).out))
      if (!l.empty()) out.push_back(l);
    return out;
  }

 private:
  bool all_alive() const {
    for (const auto& m : members_)
      if (!pid_alive(m.proc->pid)) return false;
    return true;
  }
  bool healthy() const { return ctl({"endpoint", "health"}).code == 0; }
  void make_certificates() const {
    const std::string script =
        "set -e; cd '" + dir_ + "'; "
        "openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout ca.key -out ca.pem "
        "-days 2 -subj /CN=mgtest-ca 2>/dev/null; "
        "openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout server.key -out server.csr "
        "-subj /CN=127.0.0.1 2>/dev/null; "
        "printf 'subjectAltName=IP:127.0.0.1,IP:127.0.0.2,IP:127.0.0.3\\n' > ext.cnf; "
        "openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out server.pem -days 2 "
        "-extfile ext.cnf 2>/dev/null; "
        "openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout client.key -out client.csr "
        "-subj /CN=mgtest-client 2>/dev/null; "
        "openssl x509 -req -in client.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out client.pem -days 2 2>/dev/null";
    auto r = run({"/bin/sh", "-c", script});
    REQUIRE(r.code == 0);
  }

  std::string dir_;
  bool tls_ = false, client_certs_ = false;
  std::vector<EtcdMember> members_;
};

}  // namespace mgtest
