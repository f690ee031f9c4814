// Descriptors, as several rooms use them: an owning `Fd` and `write_fully`. Low on purpose
// (docs/design.md: what two rooms share moves down): logs/, slurm/ and ops/ use it.
#pragma once

#include <sys/types.h>
#include <unistd.h>

#include <string_view>
#include <utility>

namespace mg {

// A file descriptor closed when it goes; movable, not copyable.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(Fd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  Fd& operator=(Fd&& o) noexcept {
    if (this != &o) {
      reset();
      fd_ = std::exchange(o.fd_, -1);
    }
    return *this;
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() { reset(); }
  void reset() {
    if (fd_ >= 0) ::close(std::exchange(fd_, -1));
  }
  int get() const { return fd_; }
  explicit operator bool() const { return fd_ >= 0; }

 private:
  int fd_ = -1;
};

// Writes all of `data` to fd, retrying on EINTR and partial writes; whether everything was
// written (errno set when not).
bool write_fully(int fd, std::string_view data);

// A descriptor that becomes readable when `pid` exits and signals only that process
// (pidfd_open, Linux >= 5.3); -1 with errno elsewhere (ENOSYS where the kernel lacks it).
int open_pidfd(pid_t pid);

}  // namespace mg
