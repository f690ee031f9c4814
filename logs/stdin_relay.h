// StdinRelay: gives one worker the agent's terminal input. Workers run in process groups
// of their own, so a worker that read the terminal itself would get SIGTTIN and stop for
// good; instead the agent, which is in the terminal's foreground job, reads the terminal
// and writes what it reads into a pipe that is the worker's stdin (input(), pdb and
// breakpoint() work; the terminal's own line editing applies as in any cooked-mode read).
//
// The terminal is read through a descriptor of its own (opened anew from ttyname(), so the
// shell's descriptor keeps its flags; the terminal's modes are never changed) and only
// while this job is in the foreground: in the background (after Ctrl-Z and `bg`) the agent
// ignores SIGTTIN and looks again every 200 ms. Ctrl-D (end of file) closes the worker's
// stdin. The terminal is read only while the worker lives, so input typed after it ended
// goes to the shell. Only the agent's thread touches it.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include <boost/asio/io_context.hpp>

namespace mg {

class StdinRelay {
 public:
  // `tty_fd`: the agent's stdin, a terminal. `on_input` sees each piece read from it (the
  // console learns that the terminal echoed a newline: the cursor is on a new line).
  StdinRelay(boost::asio::io_context& io, int tty_fd, std::function<void(std::string_view)> on_input = {});
  ~StdinRelay();
  StdinRelay(const StdinRelay&) = delete;
  StdinRelay& operator=(const StdinRelay&) = delete;

  // A fresh pipe for the next worker that gets stdin: returns its read end (the caller
  // closes it once the worker started), or -1 with `error` set. Ends any earlier one.
  int open_pipe(std::string& error);
  // The worker that reads the pipe has exited: stop reading the terminal.
  void close_pipe();

 private:
  struct Impl;
  std::shared_ptr<Impl> impl_;  // shared with pending handlers
};

}  // namespace mg
