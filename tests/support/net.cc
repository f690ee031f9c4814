#include "support/net.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>

namespace mgtest {

int free_port_on(const std::string& host) {
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
