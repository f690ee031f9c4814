// Test helpers for servers under test: a port to bind by number, and a process out of
// descriptors (a server's EMFILE path). Shared by the store, control, etcd and ssh tests.
#pragma once

#include <sys/resource.h>

#include <string>

namespace mgtest {

// A port free on `host` (an IPv4 address), for servers that bind their port by number
// (etcd, sshd, a daemon that must come back on the same endpoint, an agent hosting the
// rendezvous, rank 0's store on MASTER_PORT); everything else binds port 0 and reports it.
// Drawn from [kTestPortLo, kTestPortHi] outside the kernel's ephemeral range, so no bind(0)
// and no outgoing connection of any process takes it, and below the ports mglaunch draws
// its master ports from (20000 and up, launcher/port.h), so no agent of a test running beside
// this one takes it; and reserved for the life of this process: a lock (flock) on
// /tmp/mgtest-ports-UID/PORT, so no other test process picks it while this one may still
// hand it out. A port that does not bind now is passed over. Before, a port from the
// ephemeral range was taken by the parallel tests' own sockets between the pick and the
// child's bind (#34: an mgtrain fence case's EADDRINUSE, an agent's exit 2 in 0.05 s).
// The lock directory is used only when it is a directory of this user that no one else can
// write, never through a link (else $TMPDIR/mgtest-ports-UID, else one of this process's
// own). The old pick (the kernel's bind(0)) where that range leaves nothing, no lock
// directory can be had, or no reserved port is free; 0 only when bind(0) fails too.
inline constexpr int kTestPortLo = 10000, kTestPortHi = 19999;
int free_port_on(const std::string& host);
// The lock directory at `path` as free_port_on() checks it: made 0700 when missing, opened
// without following a link, a directory of this user that no one else can write (review s39
// L10: another user's /tmp/mgtest-ports-UID, made first, must neither starve nor steer the
// tests); its descriptor (close-on-exec), or -1.
int port_lock_dir_at(const std::string& path);

// Leaves this process no free descriptor, from construction until restore() or the
// destructor: the soft RLIMIT_NOFILE becomes the lowest free descriptor, so the next
// accept() or socket() fails with EMFILE (a server's out-of-descriptors path).
class NoFreeDescriptors {
 public:
  NoFreeDescriptors();  // throws std::runtime_error when the limit cannot be set
  ~NoFreeDescriptors() { restore(); }
  NoFreeDescriptors(const NoFreeDescriptors&) = delete;
  NoFreeDescriptors& operator=(const NoFreeDescriptors&) = delete;
  bool restore();  // the limit as it was; false when that failed

 private:
  ::rlimit saved_{};
  bool active_ = false;
};

}  // namespace mgtest
