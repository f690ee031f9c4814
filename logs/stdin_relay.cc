#include "logs/stdin_relay.h"

#include <fcntl.h>
#include <limits.h>
#include <termios.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <cstring>

#include <boost/asio/posix/stream_descriptor.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/write.hpp>
#include <boost/asio/writable_pipe.hpp>
#include <fmt/format.h>

namespace mg {

namespace asio = boost::asio;

struct StdinRelay::Impl : std::enable_shared_from_this<Impl> {
  Impl(asio::io_context& io, int tty_fd) : io(io), tty(io), pipe(io), retry(io) {
    // A descriptor of our own: asio makes it non-blocking, which must not reach the
    // shell's descriptor (the same open file description as a dup would be).
    char name[PATH_MAX];
    if (::ttyname_r(tty_fd, name, sizeof(name)) == 0) fd = ::open(name, O_RDONLY | O_NOCTTY | O_CLOEXEC);
    if (fd < 0) {
      fd = ::fcntl(tty_fd, F_DUPFD_CLOEXEC, 3);
      restore_flags = fd >= 0 ? ::fcntl(fd, F_GETFL) : -1;  // shared with the shell: put back at the end
    }
    if (fd >= 0) tty.assign(fd);
  }
  ~Impl() {
    boost::system::error_code ec;
    if (restore_flags >= 0) ::fcntl(fd, F_SETFL, restore_flags);
    tty.close(ec);
  }

  bool foreground() const { return ::tcgetpgrp(fd) == ::getpgrp(); }

  void read_more() {
    if (!active || !pending.empty() || fd < 0) return;
    if (!foreground()) {
      // In the background a read would stop us (SIGTTIN) or fail (EIO): look again later.
      retry.expires_after(std::chrono::milliseconds(200));
      retry.async_wait([w = weak_from_this()](boost::system::error_code ec) {
        if (auto self = w.lock(); self && !ec) self->read_more();
      });
      return;
    }
    tty.async_read_some(asio::buffer(buf), [w = weak_from_this()](boost::system::error_code ec, std::size_t n) {
      auto self = w.lock();
      if (!self || ec == asio::error::operation_aborted || !self->active) return;
      if (n > 0) {
        if (self->on_input) self->on_input(std::string_view(self->buf.data(), n));
        self->pending.assign(self->buf.data(), n);
        self->write_pending();
        return;
      }
      if (ec == asio::error::eof) {  // Ctrl-D: the worker's stdin ends
        self->eof = true;
        self->stop();
        return;
      }
      // EIO (moved to the background meanwhile) or EAGAIN: try again shortly.
      self->retry.expires_after(std::chrono::milliseconds(200));
      self->retry.async_wait([w](boost::system::error_code ec2) {
        if (auto s = w.lock(); s && !ec2) s->read_more();
      });
    });
  }

  void write_pending() {
    asio::async_write(pipe, asio::buffer(pending), [w = weak_from_this()](boost::system::error_code ec, std::size_t) {
      auto self = w.lock();
      if (!self || ec == asio::error::operation_aborted) return;
      self->pending.clear();
      if (ec) {  // the worker closed its stdin or ended
        self->stop();
        return;
      }
      self->read_more();
    });
  }

  void stop() {
    active = false;
    pending.clear();
    boost::system::error_code ec;
    retry.cancel();
    tty.cancel(ec);
    pipe.close(ec);
  }

  asio::io_context& io;
  int fd = -1;
  int restore_flags = -1;
  asio::posix::stream_descriptor tty;
  asio::writable_pipe pipe;
  asio::steady_timer retry;
  std::array<char, 4096> buf;
  std::string pending;
  bool active = false;
  bool eof = false;
  std::function<void(std::string_view)> on_input;
};

StdinRelay::StdinRelay(asio::io_context& io, int tty_fd, std::function<void(std::string_view)> on_input)
    : impl_(std::make_shared<Impl>(io, tty_fd)) {
  impl_->on_input = std::move(on_input);
}

StdinRelay::~StdinRelay() { impl_->stop(); }

int StdinRelay::open_pipe(std::string& error) {
  impl_->stop();
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) {
    error = fmt::format("cannot make a pipe for the worker's stdin: {}", std::strerror(errno));
    return -1;
  }
  if (impl_->eof || impl_->fd < 0) {  // nothing more will come: the worker reads end of file
    ::close(fds[1]);
    return fds[0];
  }
  impl_->pipe.assign(fds[1]);
  impl_->active = true;
  impl_->read_more();
  return fds[0];
}

void StdinRelay::close_pipe() { impl_->stop(); }

}  // namespace mg
