// store_serve: the agent's store (store/, mg_store's StoreServer) on 127.0.0.1, a free port,
// for a stand-in agent (tests/inplace_agent.py) that would otherwise import torch only to
// serve a TCPStore (2.7 CPU-s a training, #36). Prints the port on one line of stdout, then
// serves until stdin, a pipe, closes (its parent's end: closed however the parent ends,
// SIGKILL included) or SIGTERM/SIGINT (the only way when stdin is no pipe or socket). Exits 0
// then, 1 with one line on stderr when it cannot listen.
#include <sys/stat.h>
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <exception>
#include <functional>
#include <string>

#include <boost/asio/io_context.hpp>
#include <boost/asio/posix/stream_descriptor.hpp>
#include <boost/asio/signal_set.hpp>

#include "store/server.h"

namespace asio = boost::asio;

int main() {
  try {
    asio::io_context io;
    mg::store::ServerOptions opts;
    opts.log = [](const std::string& line) { std::fprintf(stderr, "store_serve: %s\n", line.c_str()); };
    mg::store::StoreServer server(io, "127.0.0.1", 0, opts);
    std::printf("%d\n", server.port());
    std::fflush(stdout);

    asio::signal_set signals(io, SIGTERM, SIGINT);
    // Stdin a pipe (or socket): its end is the parent's. Anything else (/dev/null, a file)
    // reads as ended at once, so then only a signal stops the server.
    struct stat st {};
    const bool watch = ::fstat(STDIN_FILENO, &st) == 0 && (S_ISFIFO(st.st_mode) || S_ISSOCK(st.st_mode));
    asio::posix::stream_descriptor in(io);
    if (watch) in.assign(::dup(STDIN_FILENO));
    char buf[256];
    auto stop = [&] {
      server.stop();
      signals.cancel();
      in.close();
    };
    signals.async_wait([&](boost::system::error_code ec, int) {
      if (!ec) stop();
    });
    std::function<void()> read = [&] {
      in.async_read_some(asio::buffer(buf), [&](boost::system::error_code ec, std::size_t) {
        if (ec) {
          if (ec != asio::error::operation_aborted) stop();  // EOF: the parent is gone
          return;
        }
        read();
      });
    };
    if (watch) read();
    io.run();
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "store_serve: %s\n", e.what());
    return 1;
  }
}
