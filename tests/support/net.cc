#include "support/net.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <mutex>
#include <random>
#include <utility>
#include <vector>
#include <stdexcept>

namespace mgtest {

namespace {

// Whether a TCP socket binds host:port now (no SO_REUSEADDR: a port in TIME_WAIT is passed
// over too).
bool binds(const std::string& host, int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  const bool ok = ::inet_pton(AF_INET, host.c_str(), &a.sin_addr) == 1 &&
                  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
  ::close(fd);
  return ok;
}

// The kernel's ephemeral range, Linux's default when it cannot be read.
std::pair<int, int> ephemeral_range() {
  std::ifstream in("/proc/sys/net/ipv4/ip_local_port_range");
  int lo = 0, hi = 0;
  if (in >> lo >> hi && lo > 0 && lo <= hi) return {lo, hi};
  return {32768, 60999};
}

// The old pick: a port the kernel's bind(0) hands out (its ephemeral range).
int ephemeral_port_on(const std::string& host) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return 0;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  int port = 0;
  socklen_t len = sizeof(a);
  if (::inet_pton(AF_INET, host.c_str(), &a.sin_addr) == 1 &&
      ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0)
    port = ntohs(a.sin_port);
  ::close(fd);
  return port;
}

}  // namespace

int port_lock_dir_at(const std::string& path) {
  if (::mkdir(path.c_str(), 0700) != 0 && errno != EEXIST) return -1;
  const int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) return -1;
  struct stat st{};
  if (::fstat(fd, &st) != 0 || !S_ISDIR(st.st_mode) || st.st_uid != ::geteuid() || (st.st_mode & 022) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

namespace {

// The lock directory, for the life of this process: /tmp/mgtest-ports-UID (shared by every
// test process of this user, C++ and Python), else $TMPDIR/mgtest-ports-UID, else a
// directory of this process's own (mkdtemp: its picks exclude each other only); -1: none.
int lock_dir() {
  static const int fd = [] {
    const std::string leaf = "/mgtest-ports-" + std::to_string(::getuid());
    int d = port_lock_dir_at("/tmp" + leaf);
    const char* tmpdir = std::getenv("TMPDIR");
    if (d < 0 && tmpdir && *tmpdir && std::string(tmpdir) != "/tmp") d = port_lock_dir_at(tmpdir + leaf);
    if (d < 0) {
      std::string own = std::string(tmpdir && *tmpdir ? tmpdir : "/tmp") + "/mgtest-ports-XXXXXX";
      if (::mkdtemp(own.data())) d = port_lock_dir_at(own);
    }
    return d;
  }();
  return fd;
}

}  // namespace

int free_port_on(const std::string& host) {
  std::vector<int> range;
  const auto [eph_lo, eph_hi] = ephemeral_range();
  for (int p = kTestPortLo; p <= kTestPortHi; ++p)
    if (p < eph_lo || p > eph_hi) range.push_back(p);
  const int dir = lock_dir();
  if (range.empty() || dir < 0) return ephemeral_port_on(host);
  static std::mutex mu;  // the held locks, for the life of this process (close-on-exec: no child holds one)
  static std::vector<int> held;
  std::lock_guard lock(mu);
  std::mt19937 rng(std::random_device{}());
  for (int attempt = 0; attempt < 1000; ++attempt) {
    const int port = range[rng() % range.size()];
    const int fd = ::openat(dir, std::to_string(port).c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600);
    if (fd < 0) continue;
    if (::flock(fd, LOCK_EX | LOCK_NB) != 0 || !binds(host, port)) {
      ::close(fd);  // another test process holds it, or something is bound there
      continue;
    }
    held.push_back(fd);
    return port;
  }
  return ephemeral_port_on(host);  // (never 0)
}
NoFreeDescriptors::NoFreeDescriptors() {
  const int lowest = ::dup(0);  // the lowest free descriptor
  if (lowest < 0) throw std::runtime_error(std::string("dup: ") + std::strerror(errno));
  ::close(lowest);
  if (::getrlimit(RLIMIT_NOFILE, &saved_) != 0) throw std::runtime_error(std::string("getrlimit: ") + std::strerror(errno));
  ::rlimit low = saved_;
  low.rlim_cur = static_cast<rlim_t>(lowest);
  if (::setrlimit(RLIMIT_NOFILE, &low) != 0) throw std::runtime_error(std::string("setrlimit: ") + std::strerror(errno));
  active_ = true;
}

bool NoFreeDescriptors::restore() {
  if (!active_) return true;
  active_ = false;
  return ::setrlimit(RLIMIT_NOFILE, &saved_) == 0;
}

}  // namespace mgtest
