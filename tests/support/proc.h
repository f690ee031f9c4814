// Test helper: run real processes (mglaunch, torchrun, fake_worker) with their output in
// temporary files, every wait bounded. Kills only what it started, by process group.
// Nothing is left behind: each process gets a TMPDIR of its own (unless the test names
// one), removed with its handle, so an agent's kept log tree or torchrun's directories go
// with it; make_temp_dir's directories lie under one root per test process
// ($TMPDIR/mgtest-<pid>-<start>-<pidns>-<boot>-XXXXXX), removed at its exit or, if it was
// killed, by the next one of the same boot and pid namespace.
// A test of mglaunch's own default (TMPDIR unset: its log tree in /dev/shm) asks for it:
// spawn(argv, {{"TMPDIR", kUnset}}).
#pragma once

#include <sys/types.h>

#include <chrono>
#include <functional>
#include <map>
#include <string>
#include <vector>

namespace mgtest {

struct Proc {
  pid_t pid = -1;
  std::string out_path, err_path;
  int status = -1;  // raw wait status once reaped

  // Waits up to `timeout`; on timeout kills the process group and returns false.
  bool wait(std::chrono::milliseconds timeout);
  int exit_code() const;  // shell style: N or 128+signal
  std::string out() const;
  std::string err() const;
  Proc() = default;
  Proc(Proc&& o) noexcept : pid(o.pid), out_path(std::move(o.out_path)), err_path(std::move(o.err_path)), status(o.status) {
    o.pid = -1;  // the moved-from handle no longer owns (or kills) the process, nor its files
    o.out_path.clear();
    o.err_path.clear();
  }
  Proc(const Proc&) = delete;
  Proc& operator=(const Proc&) = delete;
  ~Proc();
};

// A value of env_add that removes the variable.
inline const std::string kUnset = "\x01unset";

// Starts argv in its own process group with `env_add` on top of our environment (a value
// of kUnset removes the variable; TMPDIR, unless named, is the handle's own directory).
Proc spawn(const std::vector<std::string>& argv, const std::map<std::string, std::string>& env_add = {});

struct Result {
  int code = -1;
  std::string out, err;
};
Result run(const std::vector<std::string>& argv, const std::map<std::string, std::string>& env_add = {},
           std::chrono::milliseconds timeout = std::chrono::seconds(60));

// Polls `pred` every 10 ms until true or timeout; returns its last value.
bool eventually(const std::function<bool()>& pred, std::chrono::milliseconds timeout);

std::vector<std::string> split_lines(const std::string& text);
// How many times `what` occurs in `text` (overlapping ones too).
int count_of(const std::string& text, const std::string& what);
std::string read_file(const std::string& path);
std::string make_temp_dir();
// A test process's root directory name up to its random tail, for `pid` (a live process):
// "mgtest-<pid>-<start>-<pidns>-<boot>-"; and whether a directory `name` in $TMPDIR is the
// root of a test process of this boot and pid namespace that is gone (what is swept).
std::string test_root_name_for(pid_t pid);
bool test_root_is_dead(const std::string& name);
bool pid_alive(pid_t pid);  // zombies count as gone
bool python_has_torch();    // /usr/bin/python3 finds the torch package (checked once, nothing imported)
int connect_loopback(int port);  // a connected TCP socket to 127.0.0.1:port, or -1
// A TCP connection from `source` (127.0.0.x) to 127.0.0.1:port, or -1.
int connect_from(const std::string& source, int port);

// One HTTP/1.1 request to 127.0.0.1:port (Connection: close): the whole response, head and
// body, "" when it cannot connect; reads for at most 10 s.
std::string http_request(int port, const std::string& path, const std::string& authorization = "",
                         const std::string& method = "GET");
// The body of a whole HTTP response, "" when it has none.
std::string body_of(const std::string& response);

// The port of the agent's "health check on http://127.0.0.1:PORT/health" line in `p`'s
// stderr, 0 until printed.
int health_port_of(const Proc& p);

// The pids listed in `path`, one per line (fake_worker's pidfile); other lines are skipped.
std::vector<pid_t> read_pids(const std::string& path);

// argv of mglaunch with `flags` running tests/fake_worker with `worker_cmds`.
std::vector<std::string> launch(std::vector<std::string> flags, std::vector<std::string> worker_cmds);
// free_port_on("127.0.0.1") (support/net.h): a port outside the kernel's ephemeral range and
// mglaunch's master ports, reserved for this test process, for servers that bind a number (a
// restarted daemon, an agent hosting the rendezvous); everything else binds port 0 and
// reports it.
int free_loopback_port();
// run(argv_of(port)) for a port of free_loopback_port(), again with another one (5 tries at
// most) while mglaunch ends with exit 2 saying that its --master_port "cannot be used" (node
// 0's check: the port was taken meanwhile by a process outside the tests' reservation).
Result run_on_free_port(const std::function<std::vector<std::string>(int port)>& argv_of,
                        const std::map<std::string, std::string>& env_add, std::chrono::milliseconds timeout);
// A socket listening on 127.0.0.1 at a port the kernel picked (`port` set to it), or -1.
int listen_on_loopback(int& port, int backlog);

// A process of the test's own that traces `pid` (PTRACE_SEIZE) and never waits for it:
// once `pid` dies, the kernel reports its exit to this tracer first, so its parent cannot
// reap it meanwhile (a blocking waitpid there waits as long as the tracer lives). The
// tracer is SIGKILLed and reaped by release() or on destruction; `pid` can be reaped then.
class ForeignTracer {
 public:
  explicit ForeignTracer(pid_t pid);
  ~ForeignTracer() { release(); }
  ForeignTracer(const ForeignTracer&) = delete;
  ForeignTracer& operator=(const ForeignTracer&) = delete;
  bool attached() const { return attached_; }
  void release();

 private:
  pid_t tracer_ = -1;
  bool attached_ = false;
};

inline const std::string kMglaunch = MGLAUNCH_BIN;
inline const std::string kFakeWorker = FAKE_WORKER_BIN;
inline const std::string kRdzvDaemon = MGLAUNCH_RDZV_BIN;
inline const std::string kSourceDir = SOURCE_DIR;

}  // namespace mgtest
