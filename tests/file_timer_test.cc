// The FileTimer watchdog (launcher/file_timer.h, TORCHELASTIC_ENABLE_FILE_TIMER): its parser
// and timer table against torch's own FileTimerRequest, and whole runs whose workers use
// torch's FileTimerClient: torch 1.13 here, torch 2.6 inside ../shared/peers/torch2's root
// (skipped when it is not set up).
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <functional>
#include <memory>

#include <catch2/catch.hpp>
#include <fmt/format.h>

#include "launcher/file_timer.h"
#include "support/proc.h"
#include "support/skip.h"
#include "support/torch2.h"

using namespace mgtest;
using namespace std::chrono_literals;

namespace {

std::string worker_script() {
  static const TmpCopy copy("tests/file_timer_worker.py");
  return copy.path();
}

bool exists(const std::string& path) {
  struct stat st{};
  return ::lstat(path.c_str(), &st) == 0;
}

// The value after "pipe " in a worker's "pipe PATH fifo True" line ("" when none).
std::string pipe_of(const std::string& out) {
  for (const auto& l : split_lines(out))
    if (auto at = l.find("pipe "); at != std::string::npos) return l.substr(at + 5, l.find(" fifo") - at - 5);
  return {};
}

}  // namespace

TEST_CASE("FileTimer: a request as torch's FileTimerRequest writes it is read, and a release is told apart") {
  require_installed(python_has_torch(), "torch for /usr/bin/python3", "python3-torch");
  auto r = run({"/usr/bin/python3", "-c",
                "from torch.distributed.elastic.timer.file_based_local_timer import FileTimerRequest as R\n"
                "print(R(4242, 'step 3', 1732666666.25, 9).to_json())\n"
                "print(R(4242, 'step 3', -1, 0).to_json())\n"});
  REQUIRE(r.code == 0);
  const auto lines = split_lines(r.out);
  REQUIRE(lines.size() == 2);
  std::string error;
  auto set = mg::ftimer::parse_request(lines[0], error);
  REQUIRE(set);
  CHECK(set->pid == 4242);
  CHECK(set->scope_id == "step 3");
  CHECK(set->expiration_time == 1732666666.25);
  CHECK(set->signal == 9);
  auto release = mg::ftimer::parse_request(lines[1], error);
  REQUIRE(release);
  CHECK(release->expiration_time < 0);

  for (const char* bad : {"", "[]", "{\"pid\": 1}", "{\"pid\": \"1\", \"scope_id\": \"a\", \"expiration_time\": 1, "
                          "\"signal\": 9}", "{\"pid\": 1, \"scope_id\": \"a\", \"expiration_time\": 1, \"signal\": 1.5}"}) {
    INFO(bad);
    CHECK_FALSE(mg::ftimer::parse_request(bad, error));
    CHECK_FALSE(error.empty());
  }
}

TEST_CASE("FileTimer: per process the first expired timer with a signal reaps it, one without is left alone, and "
          "both lose their timers, as torch's FileTimerServer") {
  mg::ftimer::Table t;
  auto req = [](pid_t pid, const char* scope, double at, int sig) {
    mg::ftimer::Request r;
    r.pid = pid;
    r.scope_id = scope;
    r.expiration_time = at;
    r.signal = sig;
    return r;
  };
  t.apply(req(10, "a", 5, 0));   // expired first, but no signal
  t.apply(req(10, "b", 7, 15));  // the one that reaps 10
  t.apply(req(10, "c", 8, 9));
  t.apply(req(10, "later", 50, 9));
  t.apply(req(20, "x", 6, 0));   // 20 asked for no signal
  t.apply(req(30, "y", 9, 9));
  t.apply(req(30, "y", -1, 0));  // released
  CHECK(t.next_deadline() == 5.0);
  const auto due = t.expire(10);
  REQUIRE(due.size() == 2);
  CHECK(due[0].pid == 10);
  CHECK(due[0].signal == 15);
  CHECK(due[0].scope_id == "b");
  CHECK(due[0].scopes == std::vector<std::string>{"a", "b", "c"});
  CHECK(due[1].pid == 20);
  CHECK(due[1].signal == 0);
  CHECK(t.size() == 0);  // "later" went with its process, as clear_timers does
  CHECK_FALSE(t.next_deadline());
}

TEST_CASE("FileTimer: torch 1.13 workers' FileTimerClient reaches the agent's pipe, an expired timer kills its "
          "worker with the timer's signal and is the root cause, the pipe is gone at exit") {
  require_installed(python_has_torch(), "torch for /usr/bin/python3", "python3-torch");
  const std::string dir = make_temp_dir();
  const std::string pipe = dir + "/timer.pipe";
  auto r = run({kMglaunch, "--nproc_per_node=2", "--event-log-handler=console", "--python=/usr/bin/python3",
                worker_script(), "hang"},
               {{"TORCHELASTIC_ENABLE_FILE_TIMER", "1"}, {"TORCHELASTIC_TIMER_FILE", pipe}}, 200s);
  INFO(r.out << r.err);
  CHECK(r.code == 128 + 9);  // SIGKILL, FileTimerClient's default
  // torch's watchdog events, with --event-log-handler console
  for (const char* name : {"watchdog started", "timer expired", "kill worker process", "watchdog stopped"})
    CHECK_THAT(r.err, Catch::Contains(std::string("{\"name\": \"") + name + "\", \"source\": \"AGENT\""));
  CHECK_THAT(r.err, Catch::Contains("\\\"scope_id\\\": \\\"step\\\""));
  CHECK(count_of(r.out, "pipe " + pipe + " fifo True") == 2);
  CHECK(count_of(r.out, "done") == 1);  // rank 0's
  CHECK_THAT(r.err, Catch::Contains("rank 1: FileTimer 'step' expired; sending SIGKILL to pid"));
  CHECK_THAT(r.err, Catch::Contains("message    : its FileTimer 'step' expired: the agent sent SIGKILL to pid"));
  CHECK_FALSE(exists(pipe));
  run({"/bin/rm", "-rf", dir});
}

TEST_CASE("FileTimer: timers kept and released run to the end, the agent names its own pipe and removes it, a "
          "request naming a process that is not a worker kills nothing") {
  require_installed(python_has_torch(), "torch for /usr/bin/python3", "python3-torch");
  auto r = run({kMglaunch, "--nproc_per_node=2", "--python=/usr/bin/python3", worker_script(), "forge"},
               {{"TORCHELASTIC_ENABLE_FILE_TIMER", "1"}, {"TORCHELASTIC_TIMER_FILE", "\x01unset"}}, 200s);
  INFO(r.out << r.err);
  CHECK(r.code == 0);
  CHECK(count_of(r.out, "done") == 2);
  const std::string pipe = pipe_of(r.out);
  CHECK(pipe.starts_with("/tmp/watchdog_timer_"));  // torch's name: a uuid4 after it
  CHECK(pipe.size() == std::string("/tmp/watchdog_timer_").size() + 36);
  CHECK_FALSE(exists(pipe));
  CHECK_THAT(r.err, Catch::Contains("dropped timer 'forged' of pid"));
  CHECK_THAT(r.err, Catch::Contains("that process is not one of this agent's workers or their descendants"));

  // Off (the default): no pipe, no variable.
  auto off = run({kMglaunch, "--nproc_per_node=1", "--python=/usr/bin/python3", worker_script()},
                 {{"TORCHELASTIC_ENABLE_FILE_TIMER", "\x01unset"}, {"TORCHELASTIC_TIMER_FILE", "\x01unset"}}, 200s);
  CHECK(off.code == 0);
  CHECK_THAT(off.out, Catch::Contains("no timer file"));
}

TEST_CASE("FileTimer: timers of made-up pids are refused, so 64 x 1,024 of them cannot push out a real worker's "
          "timer, which still reaps it") {
  // The worker (python's stdlib, no torch) writes 65,536 timers of 64 pids that are not
  // processes (the table's bound in all), then its own 1 s timer, then sleeps 30 s.
  const std::string dir = make_temp_dir();
  const std::string pipe = dir + "/timer.pipe";
  auto r = run({kMglaunch, "--nproc_per_node=1", "--python=/usr/bin/python3", worker_script(), "flood"},
               {{"TORCHELASTIC_ENABLE_FILE_TIMER", "1"}, {"TORCHELASTIC_TIMER_FILE", pipe}}, 200s);
  INFO(r.out << r.err);
  CHECK(r.code == 128 + 9);  // reaped by its own timer's SIGKILL (before: it slept on, exit 0)
  CHECK_THAT(r.out, Catch::Contains("flooded"));
  CHECK_THAT(r.out, !Catch::Contains("not reaped"));
  CHECK_THAT(r.err, Catch::Contains("dropped timer 's0' of pid 900000000: that process is not one of this agent's "
                                    "workers or their descendants"));
  CHECK_THAT(r.err, Catch::Contains("rank 0: FileTimer 'step' expired; sending SIGKILL to pid"));
  CHECK(count_of(r.err, "dropped timer") < 100);  // one line a second at most
  run({"/bin/rm", "-rf", dir});
}

TEST_CASE("FileTimer: a TORCHELASTIC_TIMER_FILE that is not a pipe is refused before any worker starts") {
  const std::string dir = make_temp_dir();
  const std::string file = dir + "/notes.txt";
  run({"/bin/sh", "-c", "echo keep > " + file});
  auto r = run({kMglaunch, "--nproc_per_node=1", "/bin/true"},
               {{"TORCHELASTIC_ENABLE_FILE_TIMER", "1"}, {"TORCHELASTIC_TIMER_FILE", file}});
  CHECK(r.code == 2);
  CHECK_THAT(r.err, Catch::Contains("exists and is not a named pipe"));
  CHECK(read_file(file) == "keep\n");  // not removed
  auto missing = run({kMglaunch, "--nproc_per_node=1", "/bin/true"},
                     {{"TORCHELASTIC_ENABLE_FILE_TIMER", "1"}, {"TORCHELASTIC_TIMER_FILE", dir + "/no/such/dir/p"}});
  CHECK(missing.code == 2);
  CHECK_THAT(missing.err, Catch::Contains("cannot create the named pipe"));
  run({"/bin/rm", "-rf", dir});
}

TEST_CASE("FileTimer: torch 2.6 workers' FileTimerClient reaches the agent's pipe, and an expired timer kills its "
          "worker") {
  const std::string t2 = torch2_or_skip();
  const std::string dir = make_temp_dir();  // under /tmp, which the root shares
  const std::string pipe = dir + "/timer.pipe";
  auto r = run({t2, "run", kMglaunch, "--nproc_per_node=2", worker_script(), "hang"},
               {{"TORCHELASTIC_ENABLE_FILE_TIMER", "1"}, {"TORCHELASTIC_TIMER_FILE", pipe}}, 300s);
  INFO(r.out << r.err);
  CHECK(r.code == 128 + 9);
  CHECK(count_of(r.out, "pipe " + pipe + " fifo True") == 2);
  CHECK_THAT(r.err, Catch::Contains("message    : its FileTimer 'step' expired: the agent sent SIGKILL to pid"));
  CHECK_FALSE(exists(pipe));
  run({"/bin/rm", "-rf", dir});
}

TEST_CASE("FileTimer: the table keeps at most its bound of timers per process and in all, and finds the next "
          "deadline by expiry") {
  mg::ftimer::Table t(/*max_per_pid=*/3, /*max_timers=*/5);
  auto req = [](pid_t pid, std::string scope, double at) {
    mg::ftimer::Request r;
    r.pid = pid;
    r.scope_id = std::move(scope);
    r.expiration_time = at;
    r.signal = 9;
    return r;
  };
  CHECK(t.apply(req(1, "a", 30)));
  CHECK(t.apply(req(1, "b", 20)));
  CHECK(t.apply(req(1, "c", 40)));
  CHECK_FALSE(t.apply(req(1, "d", 5)));  // a fourth scope of pid 1: dropped
  CHECK(t.apply(req(1, "a", 10)));       // a new deadline for one held is no new timer
  CHECK(t.next_deadline() == 10.0);
  CHECK(t.apply(req(2, "x", 50)));
  CHECK(t.apply(req(3, "y", 60)));
  CHECK_FALSE(t.apply(req(4, "z", 1)));  // five in all
  CHECK(t.size() == 5);
  CHECK(t.apply(req(1, "a", -1)));  // released: room again
  CHECK(t.next_deadline() == 20.0);
  CHECK(t.apply(req(4, "z", 1)));
  CHECK(t.next_deadline() == 1.0);
  const auto due = t.expire(25);
  REQUIRE(due.size() == 2);
  CHECK(due[0].pid == 1);
  CHECK(due[1].pid == 4);
  CHECK(t.size() == 2);  // pid 1's "c" went with it
  CHECK(t.next_deadline() == 50.0);
}

TEST_CASE("FileTimer: a TORCHELASTIC_TIMER_FILE pipe that a live agent reads is refused, not taken over - a "
          "stopped one's pipe is replaced") {
  const std::string dir = make_temp_dir();
  const std::string path = dir + "/timer";
  boost::asio::io_context io;
  auto first = std::make_unique<mg::ftimer::Server>(io, path, mg::ftimer::ServerHooks{});
  struct stat before{};
  REQUIRE(::lstat(path.c_str(), &before) == 0);
  try {
    mg::ftimer::Server second(io, path, {});
    FAIL("the second server took the live pipe");
  } catch (const std::runtime_error& e) {
    CHECK_THAT(e.what(), Catch::Contains("a named pipe that a live process reads"));
  }
  struct stat after{};
  REQUIRE(::lstat(path.c_str(), &after) == 0);
  CHECK(after.st_ino == before.st_ino);  // still the first one's
  first.reset();  // stopped: its pipe removed
  CHECK_FALSE(exists(path));
  REQUIRE(::mkfifo(path.c_str(), 0600) == 0);  // one left by a dead run: nobody reads it
  mg::ftimer::Server third(io, path, {});
  CHECK(exists(path));
}

TEST_CASE("FileTimer: a worker's child in a session of its own (setsid) that lets its timer expire is killed, not "
          "left to run") {
  // The child left the worker's process group, so a kill by group never reached it: its
  // timer was admitted (it descends from the worker) and then never reaped.
  const std::string dir = make_temp_dir();
  const std::string pipe = dir + "/timer.pipe";
  auto r = run({kMglaunch, "--nproc_per_node=1", "--python=/usr/bin/python3", worker_script(), "setsid"},
               {{"TORCHELASTIC_ENABLE_FILE_TIMER", "1"}, {"TORCHELASTIC_TIMER_FILE", pipe}}, 200s);
  INFO(r.out << r.err);
  CHECK(r.code == 0);  // the worker itself was not the one named
  CHECK_THAT(r.out, Catch::Contains("child ended -9"));  // before: "child ended 0", after 30 s
  CHECK_THAT(r.out, !Catch::Contains("child not reaped"));
  CHECK_THAT(r.err, Catch::Contains("rank 0: FileTimer 'child' expired; sending SIGKILL to pid"));
  run({"/bin/rm", "-rf", dir});
}

namespace {

// A Server on `path` whose admission walk is counted, and what it reaped.
struct CountingServer {
  boost::asio::io_context io;
  int walks = 0;
  std::vector<mg::ftimer::Expired> reaped;
  std::unique_ptr<mg::ftimer::Server> server;
  explicit CountingServer(const std::string& path) {
    mg::ftimer::ServerHooks h;
    h.admit = [this](const mg::ProcStat&) { return ++walks, true; };
    h.reap = [this](const mg::ftimer::Expired& e) { reaped.push_back(e); };
    server = std::make_unique<mg::ftimer::Server>(io, path, std::move(h));
  }
  bool run_until(const std::function<bool()>& done) {
    for (int i = 0; i < 400 && !done(); ++i) io.run_for(50ms);  // at most 20 s
    return done();
  }
};

std::string request_line(pid_t pid, const std::string& scope, double expiration, int sig) {
  return fmt::format("{{\"version\": 1, \"pid\": {}, \"scope_id\": \"{}\", \"expiration_time\": {}, \"signal\": {}}}\n",
                     pid, scope, expiration, sig);
}

double epoch_now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

}  // namespace

TEST_CASE("FileTimer: a process's admission walk runs once, not per request, and a timer reaps only the process "
          "that set it") {
  const std::string dir = make_temp_dir();
  const std::string path = dir + "/timer";
  CountingServer s(path);
  Proc child = spawn({"/bin/sleep", "60"});
  const auto st = mg::read_proc_stat(child.pid);
  REQUIRE(st);
  const int w = ::open(path.c_str(), O_WRONLY | O_CLOEXEC);
  REQUIRE(w >= 0);
  std::string lines;
  for (int i = 0; i < 200; ++i) {  // torch's client: acquire and release, step after step (~40 KiB: the pipe holds it)
    lines += request_line(child.pid, "step", epoch_now() + 3600, 9);
    lines += request_line(child.pid, "step", -1, 0);
  }
  lines += request_line(child.pid, "last", epoch_now() - 1, 9);  // due at once
  REQUIRE(::write(w, lines.data(), lines.size()) == static_cast<ssize_t>(lines.size()));
  REQUIRE(s.run_until([&] { return !s.reaped.empty(); }));
  CHECK(s.walks == 1);  // before: one walk up the parent chain per new deadline (201)
  REQUIRE(s.reaped.size() == 1);
  CHECK(s.reaped[0].pid == child.pid);
  CHECK(s.reaped[0].start == st->starttime);  // the reap hook checks it is still this process
  // A request naming no live process is refused without a walk; the one after it (read
  // after it) is the child's again, admitted from the cache.
  const std::string more = request_line(0x3ffffff0, "x", epoch_now() - 1, 9) +
                           request_line(child.pid, "again", epoch_now() - 1, 9);
  REQUIRE(::write(w, more.data(), more.size()) == static_cast<ssize_t>(more.size()));
  REQUIRE(s.run_until([&] { return s.reaped.size() == 2; }));
  CHECK(s.walks == 1);
  CHECK(s.reaped[1].pid == child.pid);
  ::close(w);
  ::kill(child.pid, SIGKILL);
  run({"/bin/rm", "-rf", dir});
}

TEST_CASE("FileTimer: timers of an ended process go when a later process given its pid sets one, and the admission "
          "cache forgets ended processes first when full") {
  mg::ftimer::Table t;
  mg::ftimer::Request r;
  r.pid = 77;
  r.scope_id = "old";
  r.expiration_time = 10;
  r.signal = 9;
  r.start = 1000;
  CHECK(t.apply(r));
  r.scope_id = "new";
  r.expiration_time = 20;
  r.start = 2000;  // the same pid, another process
  CHECK(t.apply(r));
  CHECK(t.size() == 1);
  const auto due = t.expire(30);
  REQUIRE(due.size() == 1);
  CHECK(due[0].scope_id == "new");
  CHECK(due[0].start == 2000);

  mg::ftimer::AdmissionCache c(/*max=*/4);
  auto alive = [](pid_t pid, std::uint64_t) { return pid % 2 == 0; };
  for (pid_t p = 1; p <= 4; ++p) c.add(p, 100 + static_cast<std::uint64_t>(p), false, alive);
  CHECK(c.contains(3, 103));
  CHECK_FALSE(c.contains(3, 999));  // a later process given pid 3
  c.add(5, 105, false, alive);      // full: the ended ones (1, 3) go
  CHECK(c.size() == 3);
  CHECK_FALSE(c.contains(1, 101));
  CHECK(c.contains(2, 102));
  CHECK(c.contains(5, 105));
  c.add(6, 106, true, alive);
  CHECK(c.leader_start(6) == 106u);
  CHECK_FALSE(c.leader_start(2));  // not a worker itself
  c.forget(6);
  CHECK_FALSE(c.leader_start(6));
}
