#include "launcher/worker_launcher.h"

#include <fcntl.h>
#include <signal.h>
#include <string.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <cstdint>
#include <optional>

#include <boost/asio/post.hpp>
#include <boost/asio/posix/stream_descriptor.hpp>
#include <boost/asio/signal_set.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "process/watchdog.h"
#include "launcher/worker_group.h"

namespace mg {

namespace asio = boost::asio;

namespace {

// The real processes: the WorkerGroup's handles, the agent's one reaper (SIGCHLD), the
// watchdog, and the exec fence: until its exec a worker holds a copy of every descriptor
// of the agent (a held master port too). The workers started after open_exec_fence()
// inherit the write end of a pipe (close-on-exec): once the agent closed its own,
// end-of-file says every one has exec'd or exited, without stopping the event loop.
class ProcessLauncher final : public WorkerLauncher {
 public:
  ProcessLauncher(asio::io_context& io, Console& console)
      : io_(io), children_(io), group_(io, console, watchdog_) {}

  ~ProcessLauncher() override { close(); }

  void close() override {
    if (closed_) return;
    closed_ = true;
    drop_exec_fence();
    const bool clean = group_.close();  // SIGKILLs anything still running
    say_left_behind();
    // It kills whatever still carries this run's mark, unless nothing is left to kill. With
    // nothing left, the temporary tree goes while the watchdog exits (~Watchdog waits for it).
    if (clean) {
      watchdog_.let_go(true);
    } else {
      watchdog_.release(false);
    }
  }

  void prepare(const std::string& temporary_tree, Notice notice) override {
    notice_ = std::move(notice);
    if (::prctl(PR_SET_CHILD_SUBREAPER, 1) != 0)
      notice_(fmt::format("cannot become a child subreaper ({}): daemonised worker processes may outlive the run",
                          std::strerror(errno)));
    if (!pidfd_available())
      notice_("this kernel has no pidfd_open (Linux < 5.3): what the workers leave behind is signalled by pid after a "
              "/proc start-time check, so a pid reused in between could receive the signal");
    children_.add(SIGCHLD);
    wait_child();
    if (!temporary_tree.empty()) Watchdog::set_temporary_tree(temporary_tree);  // a tree nobody was told of
    if (std::string error; !watchdog_.start(error))
      notice_(fmt::format("cannot start the watchdog ({}): after kill -9 of mglaunch, processes the workers "
                          "started may outlive it",
                          error));
  }

  std::string run_mark(const std::string& inherited) const override {
    return watchdog_.token().empty() ? std::string() : watchdog_.mark_value(inherited);
  }

  pid_t start(WorkerSpec spec, Ended ended) override {
    if (fence_wanted_ && exec_fence_w_ < 0 && !exec_fence_) {
      int fds[2];
      if (::pipe2(fds, O_CLOEXEC) == 0) {
        exec_fence_ = std::make_unique<asio::posix::stream_descriptor>(io_, fds[0]);
        exec_fence_w_ = fds[1];
      }
    }
    WorkerProcess& w = group_.spawn(std::move(spec), [ended = std::move(ended)](WorkerProcess& done) {
      WorkerEnd e;
      e.rank = done.spec().rank;
      e.local_rank = done.spec().local_rank;
      e.pid = done.pid();
      e.wait_status = done.wait_status();
      e.duration_s = done.duration_s();
      e.spawn_error = done.spawn_error();
      e.stderr_tail.assign(done.stderr_tail().begin(), done.stderr_tail().end());
      ended(e);
    });
    return w.pid();
  }

  void signal(int sig, bool escaped) override { group_.signal(sig, escaped); }
  void signal_some(int sig, const std::vector<int>& local_ranks) override { group_.signal_some(sig, local_ranks); }
  void retire(const std::vector<int>& keep) override { group_.retire(keep); }
  void reassign(int local_rank, int rank, const std::string& prefix) override {
    for (const auto& w : group_.workers())
      if (w->spec().local_rank == local_rank && !w->exited()) w->reassign(rank, prefix);
  }
  void pause_drains() override { group_.pause_drains(); }
  void resume_drains() override { group_.resume_drains(); }
  void window_changed() override {
    for (const auto& w : group_.workers()) w->window_changed();
  }

  std::vector<WorkerState> workers() const override {
    std::vector<WorkerState> out;
    out.reserve(group_.workers().size());
    for (const auto& w : group_.workers())
      out.push_back({w->spec().rank, w->spec().local_rank, w->pid(), w->exited(), w->wait_status()});
    return out;
  }

  void open_exec_fence() override {
    drop_exec_fence();
    fence_wanted_ = true;
  }

  void watch_execs(std::function<void()> settled) override {
    fence_wanted_ = false;
    const std::uint64_t gen = ++fence_gen_;
    if (exec_fence_w_ < 0 || !exec_fence_) {
      // Without the pipe (pipe2 failed): spawn_process returned after each child's exec,
      // whose close-on-exec follows at once.
      asio::post(io_, [this, gen, settled = std::move(settled)] {
        if (gen == fence_gen_) settled();
      });
      return;
    }
    ::close(exec_fence_w_);
    exec_fence_w_ = -1;
    exec_fence_->async_wait(asio::posix::stream_descriptor::wait_read,
                            [this, gen, settled = std::move(settled)](boost::system::error_code ec) {
                              if (!ec && gen == fence_gen_) settled();
                            });
  }

  void drop_exec_fence() override {
    ++fence_gen_;  // a wait still pending finds nothing to do
    fence_wanted_ = false;
    exec_fence_.reset();
    if (exec_fence_w_ >= 0) ::close(exec_fence_w_);
    exec_fence_w_ = -1;
  }

  void finish() override {
    drop_exec_fence();
    finished_ = true;
    boost::system::error_code ec;
    children_.cancel(ec);
    // Nothing below the agent alive any more: the watchdog may go now, while the agent
    // finishes (its exit is waited for last, in ~Watchdog).
    if (group_.kill_all()) watchdog_.let_go(/*clean=*/true);
    say_left_behind();
  }

 private:
  // The processes the end of the run could not reap (WorkerGroup::left_behind), said once.
  void say_left_behind() {
    const auto& left = group_.left_behind();
    if (left.size() <= said_left_ || !notice_) return;
    said_left_ = left.size();
    notice_(fmt::format("{} process(es) SIGKILLed at the end of the run could not be reaped within {} s: {}; "
                        "mglaunch exits without them (a process in state D waits on the kernel, a disk or a network "
                        "file system; one traced by another process is reaped once its tracer lets it go)",
                        left.size(), kReapBound.count(), fmt::join(left, ", ")));
  }

  void wait_child() {
    children_.async_wait([this](boost::system::error_code ec, int) {
      if (ec) return;
      if (!group_.reap() && notice_)
        notice_("the watchdog process died: after kill -9 of mglaunch, processes the workers started may outlive it");
      if (!finished_) wait_child();
    });
  }

  asio::io_context& io_;
  Notice notice_;
  asio::signal_set children_;  // SIGCHLD: reaps orphans handed to the subreaper
  Watchdog watchdog_;  // kills what the workers left behind once the agent is gone, even by kill -9
  WorkerGroup group_;  // the workers of the attempt: spawn, signals, reaping (launcher/worker_group.h)
  bool finished_ = false;
  std::size_t said_left_ = 0;  // left_behind() entries said already
  bool closed_ = false;
  bool fence_wanted_ = false;  // open_exec_fence() came: the next start opens the pipe
  int exec_fence_w_ = -1;
  std::unique_ptr<asio::posix::stream_descriptor> exec_fence_;
  std::uint64_t fence_gen_ = 0;
};

}  // namespace

std::unique_ptr<WorkerLauncher> make_process_launcher(asio::io_context& io, Console& console) {
  return std::make_unique<ProcessLauncher>(io, console);
}

}  // namespace mg
