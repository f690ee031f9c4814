// Test fixture: a cluster of N hosts made of network namespaces (#34), for faults that
// loopback aliases cannot have (a lost packet, a link down one way).
//
// Each host is a process of ours (a "holder") in a network, UTS and mount namespace of its
// own: its own address 10.34.0.(k+1)/24 on eth0, its host name node<k>, and an /etc/hosts
// (bind-mounted in its mount namespace only) that names every host. The hosts' veths meet
// on a bridge inside one more namespace the fixture made (the switch), which has no other
// link: traffic can never leave the cluster, and tests running side by side, each with its
// cluster, share no name, address or port (so fixed ports inside a cluster are safe).
// Faults are made at the switch: a host's port down (cut), IPv4 frames dropped one way or
// both between two hosts (nft rules in a bridge table), a link that flaps, random loss.
//
// Nothing is left behind: the destructor kills every process that runs in one of the
// cluster's namespaces (found by namespace in /proc, not by name) and the holders; the
// namespaces, the veths, the bridge and the rules go with their last process. Holders and
// every process started on a host get SIGKILL when the test process dies (PR_SET_PDEATHSIG).
//
// Needs root (CAP_SYS_ADMIN), `ip` (iproute2), `nft` (nftables), `nsenter` and `setpriv`
// (util-linux). Where namespaces cannot be made the constructor skips the test (exit 77,
// one line saying why); under CI=true that is a failure (support/skip.h). A missing package
// skips, or fails under CI=true. Something that is there but does not work throws.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <map>
#include <string>
#include <vector>

#include "support/proc.h"

namespace mgtest {

class NetCluster {
 public:
  explicit NetCluster(int hosts);
  ~NetCluster();
  NetCluster(const NetCluster&) = delete;
  NetCluster& operator=(const NetCluster&) = delete;

  int size() const { return static_cast<int>(hosts_.size()); }
  std::string addr(int k) const;   // "10.34.0.<k+1>"
  std::string name(int k) const;   // "node<k>"

  // argv run on host k (its network, UTS and mount namespaces, this process's working
  // directory), as spawn() and run() of support/proc.h run it here.
  Proc spawn_on(int k, const std::vector<std::string>& argv, const std::map<std::string, std::string>& env = {}) const;
  Result run_on(int k, const std::vector<std::string>& argv, const std::map<std::string, std::string>& env = {},
                std::chrono::milliseconds timeout = std::chrono::seconds(60)) const;

  // Faults, each taking effect before it returns.
  void cut(int k);                   // host k's switch port down: nothing in or out
  void reconnect(int k);             // its port up again
  void drop(int from, int to);       // IPv4 from `from` to `to` dropped (one way); to = -1: to every host
  void undrop(int from, int to);
  void cut_between(int a, int b) { drop(a, b), drop(b, a); }
  void loss(int k, int percent);     // that share of IPv4 frames into and out of host k dropped at random; 0 ends it
  // A REJECT firewall on host k (an nft inet table in its own namespace): every TCP segment
  // to or from another host is answered with a reset (a connect is refused, a connection
  // reset), UDP with ICMP port-unreachable. Not at the switch: the kernel's bridge
  // family cannot reject everywhere (nft_reject_bridge), a host's firewall can.
  void reject(int k);
  void unreject(int k);
  // Host k's port goes down for `down`, up for `up`, again and again (at most 1,000 times)
  // until stop_flap(k) or heal(), which leave it up.
  void flap(int k, std::chrono::milliseconds down, std::chrono::milliseconds up);
  void stop_flap(int k);
  void heal();                       // every fault ended: ports up, no rule, no flapping

  // An sshd on every host (port 22 of its address, one host key, one client key), e.g. for
  // a fan-out over ssh between hosts; ssh_opts() are the client's options.
  void start_sshd();
  std::vector<std::string> ssh_opts() const;

  // The calling thread's network namespace is host k's while this lives: a socket made then
  // stays in host k's namespace, so a test can listen and connect as any host in-process.
  class InHost {
   public:
    InHost(const NetCluster& c, int k);
    ~InHost();
    InHost(const InHost&) = delete;
    InHost& operator=(const InHost&) = delete;

   private:
    int own_ = -1;
  };

  // The switch's state, for the fixture's own tests: `ip -o link show` there, and the nft
  // rules in force.
  std::string switch_links() const;
  std::string switch_rules() const;
  // "net:[inode]" of every namespace of the cluster (switch first), for the check that
  // nothing is left once the fixture is gone.
  std::vector<std::string> namespaces() const;

 private:
  struct Host {
    pid_t holder = -1;
    std::string name, addr;
  };
  std::string port(int k) const;
  pid_t make_holder(const std::string& hostname, const std::string& hosts_file);
  std::vector<std::string> enter(pid_t holder, bool net_only) const;
  void in_switch(const std::vector<std::string>& argv) const { in_namespace(switch_.holder, argv); }
  // argv in the network namespace of `holder`; a failure throws, naming the command.
  void in_namespace(pid_t holder, const std::vector<std::string>& argv) const;
  void ip_batch(pid_t holder, const std::string& commands) const;
  void apply_rules();
  void kill_everything_inside();

  std::string dir_;
  Host switch_;
  std::vector<Host> hosts_;
  std::map<std::string, std::string> rules_;  // fault id -> nft rule
  std::map<int, Proc> flappers_;
  std::vector<int> rejecting_;  // hosts with a REJECT firewall (reject())
  std::vector<Proc> sshds_;
  std::vector<std::string> namespaces_;
};

}  // namespace mgtest
