// HungDns: a DNS server that never answers (or answers one lookup), for a process run in a
// mount namespace of its own (wrap()): a hung name lookup, as the #35 tests need.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cctype>
#include <chrono>
#include <fstream>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "support/proc.h"
#include "support/skip.h"

namespace mgtest {

// A machine whose DNS server never answers, for the agent only: a mount namespace of its
// own whose resolv.conf names a UDP socket of the test's on 127.0.0.x:53 (resolv.conf
// cannot name another port; needs root, else the test is skipped), nsswitch.conf "files
// dns", and a hosts file the test may change while the agent runs (the bind mount sees the
// same file). glibc waits 3 x 30 s on that server.
struct HungDns {
  std::string dir = make_temp_dir();
  int dns = -1;
  std::string dns_ip;
  explicit HungDns(const std::string& hosts) {
    for (int i = 0; i < 40 && dns < 0; ++i) {  // a loopback address of our own for port 53
      dns_ip = "127.0.0." + std::to_string(200 + (::getpid() + i) % 50);
      dns = ::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
      sockaddr_in a{};
      a.sin_family = AF_INET;
      a.sin_port = htons(53);
      ::inet_pton(AF_INET, dns_ip.c_str(), &a.sin_addr);
      if (::bind(dns, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
        ::close(dns);
        dns = -1;
      }
    }
    if (dns < 0) SKIP_TEST("cannot bind a DNS socket on 127.0.0.x:53 (needs root)");
    std::ofstream(dir + "/resolv.conf") << "nameserver " << dns_ip << "\noptions timeout:30 attempts:3\n";
    std::ofstream(dir + "/nsswitch.conf") << "hosts: files dns\n";
    set_hosts(hosts);
    if (run({"/usr/bin/unshare", "-m", "/bin/true"}).code != 0)
      SKIP_TEST("cannot make a mount namespace (unshare -m needs root)");
  }
  ~HungDns() {
    stop = true;
    if (responder.joinable()) responder.join();
    if (dns >= 0) ::close(dns);
  }
  void set_hosts(const std::string& hosts) { std::ofstream(dir + "/hosts", std::ios::trunc) << hosts; }
  // `argv` run in the namespace.
  std::vector<std::string> wrap(const std::vector<std::string>& argv) const {
    std::vector<std::string> out{"/usr/bin/unshare", "-m", "/bin/sh", "-c",
                                 "mount --bind \"$1/resolv.conf\" /etc/resolv.conf && mount --bind \"$1/nsswitch.conf\" "
                                 "/etc/nsswitch.conf && mount --bind \"$1/hosts\" /etc/hosts && shift && exec \"$@\"",
                                 "sh", dir};
    out.insert(out.end(), argv.begin(), argv.end());
    return out;
  }
  void forget_queries() const {
    char drop[512];
    while (::recv(dns, drop, sizeof drop, MSG_DONTWAIT) > 0) {
    }
  }
  // A query for `name` reached the server (and is not answered), or `p` ended. Queries for
  // other names (the machine's own, looked up first) are read and left unanswered too.
  bool queried(const Proc& p, const std::string& name) const {
    return eventually([&] {
      unsigned char q[512];
      for (ssize_t n; (n = ::recv(dns, q, sizeof q, MSG_DONTWAIT)) > 0;)
        if (question(q, static_cast<std::size_t>(n)).first == name) return true;
      return !pid_alive(p.pid);
    }, std::chrono::seconds(30));
  }
  // A query's name ("a.b", lower case) and type (1 A, 28 AAAA); an empty name if malformed.
  static std::pair<std::string, int> question(const unsigned char* q, std::size_t n) {
    std::string name;
    std::size_t i = 12;
    while (i < n && q[i] != 0) {
      const std::size_t len = q[i++];
      if (len > 63 || i + len > n) return {};
      if (!name.empty()) name += '.';
      for (std::size_t k = 0; k < len; ++k) name += static_cast<char>(std::tolower(q[i + k]));
      i += len;
    }
    if (i + 5 > n) return {};
    return {name, q[i + 1] << 8 | q[i + 2]};
  }
  // Answers on a thread of its own: every A query for `name` with `ipv4`, and the AAAA
  // queries for it of the first lookup that asks (one source port: its retransmissions too)
  // with no address, unless `aaaa` is false; later lookups' AAAA queries and every other
  // query are not answered. So one lookup of `name` (A and AAAA) succeeds, and a second one
  // of both families hangs. Each answer goes `delay` after its query. Every query is kept in
  // log().
  void answer_once(const std::string& name, const std::string& ipv4, bool aaaa = true,
                   std::chrono::milliseconds delay = {}) {
    responder = std::thread([this, name, ipv4, aaaa, delay] {
      in_addr addr{};
      ::inet_pton(AF_INET, ipv4.c_str(), &addr);
      std::optional<int> aaaa_asker;  // the source port of the AAAA queries answered
      const auto t0 = std::chrono::steady_clock::now();
      while (!stop) {
        pollfd pf{dns, POLLIN, 0};
        if (::poll(&pf, 1, 100) <= 0) continue;
        unsigned char q[512];
        sockaddr_storage from{};
        socklen_t len = sizeof from;
        const ssize_t n = ::recvfrom(dns, q, sizeof q, 0, reinterpret_cast<sockaddr*>(&from), &len);
        if (n <= 12) continue;
        const auto [qname, type] = question(q, static_cast<std::size_t>(n));
        const int source = ntohs(reinterpret_cast<const sockaddr_in*>(&from)->sin_port);
        const bool answer =
            qname == name && (type == 1 || (type == 28 && aaaa && aaaa_asker.value_or(source) == source));
        {
          std::lock_guard g(log_m_);
          log_ += fmt::format("{:.3f} s {} type {} from port {}{}\n",
                              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), qname,
                              type, source, answer ? " answered" : "");
        }
        if (!answer) continue;
        if (type == 28) aaaa_asker = source;
        const std::size_t qend = 12 + qname.size() + 2 + 4;  // the question: labels, root, type, class
        std::vector<unsigned char> r(q, q + qend);
        r[2] = 0x81, r[3] = 0x80;            // a response, recursion desired and available, no error
        r[6] = 0, r[7] = type == 1 ? 1 : 0;  // answers
        r[8] = r[9] = r[10] = r[11] = 0;     // no authority, no additional records
        if (type == 1) {
          const unsigned char rr[] = {0xc0, 12, 0, 1, 0, 1, 0, 0, 0, 0, 0, 4};  // the name, A, IN, TTL 0, 4 bytes
          r.insert(r.end(), std::begin(rr), std::end(rr));
          const auto* a = reinterpret_cast<const unsigned char*>(&addr.s_addr);
          r.insert(r.end(), a, a + 4);
        }
        std::this_thread::sleep_for(delay);
        ::sendto(dns, r.data(), r.size(), 0, reinterpret_cast<sockaddr*>(&from), len);
      }
    });
  }
  // The queries answer_once() saw, one line each (for a failing test's report).
  std::string log() {
    std::lock_guard g(log_m_);
    return log_;
  }
  std::mutex log_m_;
  std::string log_;
  std::atomic<bool> stop{false};
  std::thread responder;
};

}  // namespace mgtest
