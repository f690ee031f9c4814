#include "process/run.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "process/command.h"
#include "process/fd.h"
#include "process/reap.h"
#include "process/spawn.h"

extern char** environ;

namespace mg {

namespace {

constexpr std::chrono::seconds kReapAfterKill{2};

int wait_for(pid_t pid, int flags, int& status) {
  pid_t r;
  while ((r = ::waitpid(pid, &status, flags)) < 0 && errno == EINTR) {
  }
  return r;
}

}  // namespace

bool RunResult::ok() const { return started && !timed_out && WIFEXITED(status) && WEXITSTATUS(status) == 0; }

RunResult run_capture(const std::vector<std::string>& argv, const RunOptions& o) {
  using clock = std::chrono::steady_clock;
  const auto deadline = clock::now() + o.timeout;
  RunResult r;
  if (argv.empty() || argv.front().empty()) {
    r.error = "no command";
    return r;
  }
  const char* path_env = std::getenv("PATH");
  const std::string exe = find_executable(argv.front(), path_env ? path_env : "/usr/bin:/bin");
  if (exe.empty()) {
    r.error = "cannot find '" + argv.front() + "'" + (argv.front().find('/') == std::string::npos ? " on PATH" : "");
    return r;
  }
  int p[2];
  if (::pipe2(p, O_CLOEXEC) != 0) {
    r.error = std::string("pipe: ") + std::strerror(errno);
    return r;
  }
  Fd out(p[0]), out_w(p[1]);
  Fd null_in(::open("/dev/null", O_RDONLY | O_CLOEXEC));
  Fd null_out(o.merge_stderr ? -1 : ::open("/dev/null", O_WRONLY | O_CLOEXEC));
  if (null_in.get() < 0 || (!o.merge_stderr && null_out.get() < 0)) {
    r.error = std::string("/dev/null: ") + std::strerror(errno);
    return r;
  }
  std::vector<const char*> args;
  for (const auto& a : argv) args.push_back(a.c_str());
  args.push_back(nullptr);
  SpawnRequest req;
  req.path = exe.c_str();
  req.argv = args.data();
  req.envp = o.envp ? o.envp : environ;
  req.fds[0] = null_in.get();
  req.fds[1] = out_w.get();
  req.fds[2] = o.merge_stderr ? out_w.get() : null_out.get();
  SpawnError error;  // an exec error comes back here: nothing ran
  const pid_t pid = spawn_process(req, error);
  out_w.reset();  // EOF once the command (and whatever it started) has closed its copies
  null_in.reset();
  null_out.reset();
  if (pid < 0) {
    r.error = "cannot run " + exe + ": " + error.message();
    return r;
  }
  r.started = true;
  Fd pidfd(open_pidfd(pid));
  bool eof = false, exited = false;
  char buf[16 * 1024];
  while (!(eof && exited)) {
    const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - clock::now()).count();
    if (left <= 0) break;
    pollfd fds[2];
    nfds_t n = 0;
    int out_i = -1, exit_i = -1;
    if (!eof) out_i = static_cast<int>(n), fds[n++] = {out.get(), POLLIN, 0};
    if (!exited && pidfd.get() >= 0) exit_i = static_cast<int>(n), fds[n++] = {pidfd.get(), POLLIN, 0};
    // Without a pidfd (Linux < 5.3) the exit is looked for between slices of the wait.
    long long slice = left;
    if (!exited && pidfd.get() < 0) slice = std::min<long long>(left, eof ? 10 : 100);
    if (::poll(fds, n, static_cast<int>(std::min<long long>(slice, 1 << 30))) < 0 && errno != EINTR) break;
    if (out_i >= 0 && fds[out_i].revents) {
      const ssize_t got = ::read(out.get(), buf, sizeof(buf));
      if (got > 0) {
        const std::size_t room = o.max_output - std::min(o.max_output, r.out.size());
        r.out.append(buf, std::min(room, static_cast<std::size_t>(got)));
      } else if (got == 0 || errno != EINTR) {
        eof = true;
      }
    }
    if (!exited && (exit_i < 0 || fds[exit_i].revents)) {
      siginfo_t info{};
      if (::waitid(P_PID, static_cast<id_t>(pid), &info, WEXITED | WNOHANG | WNOWAIT) != 0) {
        if (errno != ECHILD) continue;
        // Reaped by someone else (a waitpid(-1) elsewhere in this process): it has ended.
        r.error = "its exit status was taken by another reaper in this process";
        exited = true;
        continue;
      }
      if (info.si_pid == 0) continue;
      // It has ended but is not reaped yet, so its group id is still its own: what it left
      // in its group must not hold the pipe open.
      ::killpg(pid, SIGKILL);
      wait_for(pid, 0, r.status);
      exited = true;
    }
  }
  if (!exited) {
    r.timed_out = true;
    r.error = "killed after " + std::to_string(o.timeout.count()) + " ms without finishing";
    ::killpg(pid, SIGKILL);
    ::kill(pid, SIGKILL);
    // Bounded: a process in state D, or one another process traces (its exit goes to the
    // tracer first), cannot be reaped yet, and the caller may be an event loop (#36).
    if (!reap_by(pid, clock::now() + kReapAfterKill, r.status))
      r.error += "; it could not be reaped within 2 s of SIGKILL (state D, or traced by another process): left "
                 "behind";
  }
  return r;
}

}  // namespace mg
