// Test helpers for servers under test: a port to bind by number, and a process out of
// descriptors (a server's EMFILE path). Shared by the store, control, etcd and ssh tests.
#pragma once

#include <sys/resource.h>

#include <string>

namespace mgtest {

// A port that was free on `host` (an IPv4 address) a moment ago, for servers that bind
// their port by number (etcd, sshd, a daemon that must come back on the same endpoint);
// everything else binds port 0 and reports it. 0 when no port could be had there.
int free_port_on(const std::string& host);

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
