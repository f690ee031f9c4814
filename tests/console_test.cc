// The console's batching: lines flushed "soon" wait for the event loop's round, then go
// to the writer in order; a console destroyed first still writes them.
#include <catch2/catch.hpp>

#include <fcntl.h>
#include <unistd.h>

#include <string>

#include <boost/asio/io_context.hpp>

#include "logs/console.h"

namespace {

struct Pipe {
  int fd[2] = {-1, -1};
  Pipe() { REQUIRE(::pipe2(fd, O_CLOEXEC) == 0); }
  ~Pipe() {
    for (int f : fd)
      if (f >= 0) ::close(f);
  }
  // Everything the pipe holds now, without blocking.
  std::string drain() const {
    ::fcntl(fd[0], F_SETFL, ::fcntl(fd[0], F_GETFL) | O_NONBLOCK);
    std::string out;
    char buf[4096];
    for (ssize_t n; (n = ::read(fd[0], buf, sizeof buf)) > 0;) out.append(buf, static_cast<std::size_t>(n));
    return out;
  }
};

}  // namespace

TEST_CASE("lines flushed soon wait for the event loop's round, then reach the pipe whole and in order") {
  Pipe out, err;
  boost::asio::io_context io;
  {
    mg::Console console(io, out.fd[1], err.fd[1], false);
    console.lines(0, "[rank0]:", "a\nbb\n", 64);
    console.flush_soon();
    console.line(0, "[rank1]:", "c", false);
    console.flush_soon();
    console.lines(0, "[rank2]:", "0123456789\n", 4);  // cut into pieces with the marker
    console.flush_soon();
    CHECK(out.drain().empty());  // nothing handed to the writer before the round ends
    io.run();
  }  // the destructor joins the writer: all is written
  CHECK(out.drain() == "[rank0]:a\n[rank0]:bb\n[rank1]:c\n[rank2]:0123" + std::string(mg::Console::kCutMarker) +
                           "\n[rank2]:4567" + std::string(mg::Console::kCutMarker) + "\n[rank2]:89\n");
  CHECK(err.drain().empty());
}

TEST_CASE("a console destroyed before its posted flush ran still writes the lines, and the late flush is harmless") {
  Pipe out, err;
  boost::asio::io_context io;
  {
    mg::Console console(io, out.fd[1], err.fd[1], false);
    console.lines(1, "[rank3]:", "late\n", 64);
    console.flush_soon();
  }
  io.run();  // the posted flush finds the console gone
  CHECK(err.drain() == "[rank3]:late\n");
  CHECK(out.drain().empty());
}
