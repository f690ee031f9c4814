// The agent (launcher/agent.h) driven through whole runs with fakes for its seams
// (launcher/agent_seams.h, launcher/worker_launcher.h): a launcher whose workers exit when
// the test says, a clock whose timers fire when the test moves it, a store that listens on
// nothing. No process is started, the agent serves no port (tests run side by side on one
// machine: a real store on torchrun's default master port made them fail each other) and nothing sleeps:
// the grace before SIGKILL is a step of the test, not a wait.
#include <catch2/catch.hpp>

#include <signal.h>
#include <stdlib.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>
#include <fmt/format.h>

#include "cli/errors.h"
#include <nlohmann/json.hpp>

#include "launcher/agent.h"
#include "launcher/agent_seams.h"
#include "launcher/options.h"
#include "launcher/plan.h"
#include "support/proc.h"

using namespace mg;
using namespace std::chrono_literals;
namespace asio = boost::asio;

namespace {

// Time moves only when the test says so; a timer fires when the time reaches it.
class FakeClock final : public AgentClock {
 public:
  sup::Now now() const override { return now_; }
  void arm(sup::Timer t, sup::Clock::time_point at, std::function<void()> fire) override {
    armed_[t] = {at, std::move(fire)};
  }
  void cancel(sup::Timer t) override { armed_.erase(t); }

  bool armed(sup::Timer t) const { return armed_.contains(t); }
  // How long from now timer `t` fires (it must be armed).
  sup::Clock::duration due_in(sup::Timer t) const { return armed_.at(t).at - now_.steady; }
  // Moves the time to the earliest timer and fires it; false when none is armed.
  bool fire_next() {
    if (armed_.empty()) return false;
    auto next = std::min_element(armed_.begin(), armed_.end(),
                                 [](const auto& a, const auto& b) { return a.second.at < b.second.at; });
    const auto dt = next->second.at - now_.steady;
    if (dt > sup::Clock::duration::zero()) {
      now_.steady += dt;
      now_.wall += std::chrono::duration_cast<std::chrono::system_clock::duration>(dt);
    }
    auto fire = std::move(next->second.fire);
    armed_.erase(next);
    fire();
    return true;
  }
  void advance(std::chrono::milliseconds d) {
    now_.steady += d;
    now_.wall += d;
  }
  // Fires timer `t` now, whatever its time (it must be armed).
  void fire(sup::Timer t) {
    auto f = std::move(armed_.at(t).fire);
    armed_.erase(t);
    f();
  }

 private:
  struct Due {
    sup::Clock::time_point at;
    std::function<void()> fire;
  };
  sup::Now now_{sup::Clock::time_point{} + 1000h, std::chrono::system_clock::time_point{} + 500000h};
  std::map<sup::Timer, Due> armed_;
};

// The agent's signals as the test delivers them (from the event loop, as a real one's):
// a signal of a set with no wait pending is kept for the next wait, as asio's signal_set does.
class FakeSignals final : public AgentSignals {
 public:
  explicit FakeSignals(asio::io_context& io) : io_(io) {}
  void add(Set set, int sig) override { added[set].push_back(sig); }
  void wait(Set set, std::function<void(int)> got) override {
    waiting_[set] = std::move(got);
    pass_on(set);
  }
  void cancel(Set set) override { waiting_.erase(set); }
  void stop_self() override { ++stopped_self; }

  // `sig` comes to the agent; a signal of no set it added is not its to handle.
  void deliver(int sig) {
    for (const auto& [set, sigs] : added)
      if (std::find(sigs.begin(), sigs.end(), sig) != sigs.end()) {
        queued_[set].push_back(sig);
        asio::post(io_, [this, set = set] { pass_on(set); });
        return;
      }
    FAIL("the agent does not handle signal " << sig);
  }

  std::map<Set, std::vector<int>> added;
  int stopped_self = 0;

 private:
  void pass_on(Set set) {
    auto w = waiting_.find(set);
    auto& q = queued_[set];
    if (w == waiting_.end() || q.empty()) return;
    auto got = std::move(w->second);
    waiting_.erase(w);
    const int sig = q.front();
    q.erase(q.begin());
    got(sig);
  }
  asio::io_context& io_;
  std::map<Set, std::function<void(int)>> waiting_;
  std::map<Set, std::vector<int>> queued_;
};

// Workers that run until the test ends them; what the agent asked for is recorded.
class FakeLauncher final : public WorkerLauncher {
 public:
  struct Worker {
    WorkerSpec spec;
    pid_t pid = 0;
    Ended ended;
    bool exited = false;
    int status = 0;
  };

  explicit FakeLauncher(asio::io_context& io) : io_(io) {}

  void prepare(const std::string&, Notice) override { prepared = true; }
  std::string run_mark(const std::string&) const override { return {}; }
  pid_t start(WorkerSpec spec, Ended ended) override {
    REQUIRE(prepared);
    started.push_back(spec);
    all_.push_back(std::make_unique<Worker>(Worker{std::move(spec), next_pid_++, std::move(ended)}));
    current_.push_back(all_.back().get());
    return all_.back()->pid;
  }
  void signal(int sig, bool) override { signals.push_back(sig); }
  void signal_some(int sig, const std::vector<int>&) override { signals.push_back(sig); }
  void retire(const std::vector<int>& keep) override {
    ++retired;
    // (the handles stay: the agent may be inside their callbacks)
    std::erase_if(current_, [&](const Worker* w) {
      return std::find(keep.begin(), keep.end(), w->spec.local_rank) == keep.end();
    });
  }
  void reassign(int local_rank, int rank, const std::string&) override {
    for (Worker* w : current_)
      if (w->spec.local_rank == local_rank) w->spec.rank = rank;
  }
  void pause_drains() override {}
  void resume_drains() override {}
  void window_changed() override {}
  std::vector<WorkerState> workers() const override {
    std::vector<WorkerState> out;
    for (const Worker* w : current_) out.push_back({w->spec.rank, w->spec.local_rank, w->pid, w->exited, w->status});
    return out;
  }
  void open_exec_fence() override {}
  void watch_execs(std::function<void()> settled) override { asio::post(io_, std::move(settled)); }
  void drop_exec_fence() override {}
  void finish() override { finished = true; }
  void close() override { closed = true; }

  // Worker `local_rank` of the attempt running now ends with raw wait status `status`
  // (from the event loop, as a real one would).
  void end(int local_rank, int status, std::vector<std::string> tail = {}) {
    auto it = std::find_if(current_.begin(), current_.end(),
                           [&](const Worker* w) { return w->spec.local_rank == local_rank && !w->exited; });
    REQUIRE(it != current_.end());
    Worker& w = **it;
    REQUIRE_FALSE(w.exited);
    w.exited = true;
    w.status = status;
    WorkerEnd e;
    e.rank = w.spec.rank;
    e.local_rank = w.spec.local_rank;
    e.pid = w.pid;
    e.wait_status = status;
    e.duration_s = 0.5;
    e.stderr_tail = std::move(tail);
    asio::post(io_, [ended = w.ended, e] { ended(e); });
  }
  std::size_t running() const { return current_.size(); }

  bool prepared = false, finished = false, closed = false;
  int retired = 0;
  std::vector<WorkerSpec> started;
  std::vector<int> signals;

 private:
  asio::io_context& io_;
  pid_t next_pid_ = 4000;
  std::vector<std::unique_ptr<Worker>> all_;
  std::vector<Worker*> current_;
};

class FakeHardware final : public AgentHardware {
 public:
  std::vector<hw::Binding> bind(const std::string&, int nproc, const std::vector<int>&) override {
    std::vector<hw::Binding> b(static_cast<std::size_t>(nproc));
    for (int lr = 0; lr < nproc; ++lr) b[static_cast<std::size_t>(lr)].cpus = {100 + lr};
    return b;
  }
  std::unique_ptr<hw::GpuProbe> gpu_probe() override { return nullptr; }
};

// The agent's store without a socket: what the agent asked of it is recorded.
class FakeStore final : public AgentStore {
 public:
  struct Record {
    std::vector<int> served;  // the port of each store made, in order
    int resets = 0, stops = 0;
    bool held = false;  // the last one was given the agent's held socket
  };
  FakeStore(Record& r, int port) : r_(r), port_(port) {}
  int port() const override { return port_; }
  void reset() override { ++r_.resets; }
  void stop() override { ++r_.stops; }
  std::size_t clients() const override { return 0; }
  void when_idle(std::function<void()> f) override { f(); }  // never a client

 private:
  Record& r_;
  int port_;
};

// The control channel as the test plays the workers' side: what the agent sent each local
// rank is recorded; hello and paused come through the handlers the agent gave (from the
// event loop, as a real server's do).
class FakeControl final : public AgentControl {
 public:
  FakeControl(asio::io_context& io, control::Handlers h) : io_(io), h_(std::move(h)) {}
  const std::string& address() const override { return address_; }
  bool send(int local_rank, std::string line) override {
    if (ended.contains(local_rank)) return false;
    sent[local_rank].push_back(nlohmann::json::parse(line));
    return true;
  }
  std::string ended_why(int local_rank) const override {
    auto it = ended.find(local_rank);
    return it == ended.end() ? std::string() : it->second;
  }
  void forget(int) override {}
  void stop() override { stopped = true; }

  void hello(int local_rank, bool in_place) {
    control::Hello m;
    m.in_place = in_place;
    asio::post(io_, [this, local_rank, m] { h_.hello(local_rank, m); });
  }
  void paused(int local_rank, long long step) {
    asio::post(io_, [this, local_rank, step] { h_.paused(local_rank, control::Paused{step}); });
  }

  std::map<int, std::vector<nlohmann::json>> sent;  // by local rank
  std::map<int, std::string> ended;  // local ranks whose session ended, and why (the agent has not heard yet)
  bool stopped = false;

 private:
  asio::io_context& io_;
  control::Handlers h_;
  std::string address_ = "@fake-control";
};

// The rendezvous as the test plays it: what the agent sent is recorded, the decisions come
// through the handlers the agent gave (from the event loop, as a real link's do).
class FakeLink final : public rdzv::Link {
 public:
  FakeLink(asio::io_context& io, proto::Join j, rdzv::ClientHandlers h) : join(std::move(j)), io_(io), h_(std::move(h)) {}
  void start() override { ++joins; }
  void rejoin() override { ++joins; }
  void set_master_port(int port) override { offered_ports.push_back(port); }
  void worker_failed(proto::WorkerFailed f) override { failures.push_back(std::move(f)); }
  void node_done(int round) override { done_rounds.push_back(round); }
  void close() override { closed = true; }

  void assign(proto::Assignment a) {
    asio::post(io_, [this, a] { h_.on_assignment(a); });
  }
  void restart(proto::Restart r) {
    asio::post(io_, [this, r] { h_.on_restart(r); });
  }
  void abort(proto::Abort a) {
    asio::post(io_, [this, a] { h_.on_abort(a); });
  }
  void done() {
    asio::post(io_, [this] { h_.on_done(); });
  }
  void standby(proto::Standby s) {
    asio::post(io_, [this, s] { h_.on_standby(s); });
  }
  // What the client machine would have learnt, for the record (remember_job).
  std::vector<std::pair<std::string, int>> job_hosts() const override { return hosts; }
  int job_epoch() const override { return epoch; }

  proto::Join join;
  std::vector<std::pair<std::string, int>> hosts;
  int epoch = 0;
  int joins = 0;
  bool closed = false;
  std::vector<int> offered_ports, done_rounds;
  std::vector<proto::WorkerFailed> failures;

 private:
  asio::io_context& io_;
  rdzv::ClientHandlers h_;
};

// PYTHONPATH of a torch 2.6 that is only its version.py: the plan then takes the workers'
// torch for 2.x, whose agent shares its store with them for every backend (as torchrun's).
// Removed at exit.
EnvMap torch2_env() {
  static const struct Dir {
    std::string path;
    Dir() {
      path = mgtest::make_temp_dir();
      REQUIRE(::mkdir((path + "/torch").c_str(), 0755) == 0);
      std::ofstream(path + "/torch/version.py") << "__version__ = '2.6.0'\n";
    }
    ~Dir() {
      std::error_code ec;
      std::filesystem::remove_all(path, ec);
    }
  } dir;
  return {{"PYTHONPATH", dir.path}};
}

int exited(int code) { return code << 8; }
int killed(int sig) { return sig; }

std::string env_of(const WorkerSpec& spec, const std::string& key) {
  for (const auto& kv : spec.env)
    if (kv.starts_with(key + "=")) return kv.substr(key.size() + 1);
  return "<unset>";
}

// One agent run with fakes: the console goes to a file the test reads at the end.
struct Run {
  asio::io_context io{1};
  FakeClock* clock = nullptr;
  FakeSignals* signals = nullptr;
  FakeLauncher* launcher = nullptr;
  FakeLink* link = nullptr;  // made when the agent joins a rendezvous
  FakeControl* control = nullptr;
  FakeStore::Record store;
  std::string out_path;
  int out_fd = -1;
  std::unique_ptr<Agent> agent;

  // `store_made`: runs as the store factory is called (it may throw, as the real one does).
  explicit Run(std::vector<std::string> flags, EnvMap extra_env = {}, std::function<void(int port)> store_made = {}) {
    char path[] = "/tmp/mg_agent_seams_XXXXXX";
    out_fd = ::mkstemp(path);
    REQUIRE(out_fd >= 0);
    out_path = path;
    std::vector<std::string> argv = {"mglaunch", "--stdin-rank=none"};
    argv.insert(argv.end(), flags.begin(), flags.end());
    argv.push_back("/bin/true");  // never run: the launcher is a fake
    EnvMap env = {{"PATH", "/bin:/usr/bin"}};
    // No fixed port: the plan's check of a given master port binds it for a moment, and a
    // run of mglaunch elsewhere on this machine may hold torchrun's default master port.
    if (std::none_of(flags.begin(), flags.end(), [](const std::string& f) { return f.starts_with("--master_port"); }))
      env["PET_MASTER_PORT"] = "0";
    env.merge(extra_env);
    auto parsed = parse_agent_args(argv, env, HardwareProbe{[] { return 0; }, [] { return 2; }});
    REQUIRE(parsed.options);
    RunPlan plan = make_plan(*parsed.options, env);
    AgentDeps deps;
    auto c = std::make_unique<FakeClock>();
    clock = c.get();
    deps.clock = std::move(c);
    auto sigs = std::make_unique<FakeSignals>(io);
    signals = sigs.get();
    deps.signals = std::move(sigs);
    deps.launcher = [this](asio::io_context& io, Console&) {
      auto l = std::make_unique<FakeLauncher>(io);
      launcher = l.get();
      return l;
    };
    deps.link = [this](asio::io_context& io, const AgentOptions&, proto::Join join, rdzv::ClientHandlers h) {
      REQUIRE(link == nullptr);  // one link for the run
      auto l = std::make_unique<FakeLink>(io, std::move(join), std::move(h));
      link = l.get();
      return std::unique_ptr<rdzv::Link>(std::move(l));
    };
    deps.hardware = std::make_unique<FakeHardware>();
    deps.store = [this, store_made](asio::io_context&, int port, int held_fd, std::size_t, std::function<void(const std::string&)>) {
      store.held = held_fd >= 0;
      if (held_fd >= 0) ::close(held_fd);
      if (store_made) store_made(port);
      store.served.push_back(port);
      return std::unique_ptr<AgentStore>(std::make_unique<FakeStore>(store, port));
    };
    deps.control = [this](asio::io_context& io, control::ServerOptions, control::Handlers h) {
      auto c = std::make_unique<FakeControl>(io, std::move(h));
      control = c.get();
      return std::unique_ptr<AgentControl>(std::move(c));
    };
    deps.stdout_fd = out_fd;
    deps.stderr_fd = out_fd;
    agent = std::make_unique<Agent>(io, std::move(*parsed.options), std::move(plan), env, std::move(deps));
    agent->start();
    settle();
    // A node that joins a c10d rendezvous first looks up its takeover addresses on a thread of
    // their own (#35: no lookup on the io thread); its link is made when the answers are posted.
    if (std::any_of(flags.begin(), flags.end(), [](const std::string& f) { return f == "--rdzv_backend=c10d"; }))
      await_link();
  }
  // Runs the loop (bounded: 20 s) until the rendezvous link is made or the run ended.
  void await_link() {
    for (int i = 0; i < 4000 && link == nullptr && !agent->done(); ++i) {
      io.restart();
      io.run_for(std::chrono::milliseconds(5));
    }
    settle();
  }
  ~Run() {
    agent.reset();
    if (out_fd >= 0) ::close(out_fd);
    ::unlink(out_path.c_str());
  }

  // Runs what is ready until nothing is (bounded); the timers wait for the test.
  void settle() {
    for (int i = 0; i < 10000; ++i) {
      io.restart();
      if (io.poll() == 0) return;
    }
    FAIL("the event loop never settled");
  }
  void end(int local_rank, int status, std::vector<std::string> tail = {}) {
    launcher->end(local_rank, status, std::move(tail));
    settle();
  }
  void signal(int sig) {
    signals->deliver(sig);
    settle();
  }
  // This node as group rank `group_rank` of two nodes of two workers each.
  void assign(int round, int restart_count, int master_port, int group_rank = 1) {
    proto::Assignment a;
    a.round = round;
    a.group_rank = group_rank;
    a.group_world_size = 2;
    a.rank_offset = 2 * group_rank;
    a.world_size = 4;
    a.master_addr = "127.0.0.1";
    a.master_port = master_port;
    a.restart_count = restart_count;
    a.nodes = {"127.0.0.1", "127.0.0.1"};
    link->assign(a);
    settle();
  }
  // Everything the agent wrote (once it is gone: the console flushed).
  std::string output() {
    agent.reset();
    std::ifstream in(out_path);
    return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  }
};

}  // namespace

TEST_CASE("agent with fakes: a failed worker restarts the group and the run ends with 0 once both succeed") {
  Run run({"--nproc_per_node=2", "--max_restarts=1"});
  REQUIRE(run.launcher->started.size() == 2);
  CHECK(env_of(run.launcher->started[0], "RANK") == "0");
  CHECK(env_of(run.launcher->started[1], "RANK") == "1");
  CHECK(env_of(run.launcher->started[1], "TORCHELASTIC_RESTART_COUNT") == "0");
  CHECK(run.launcher->started[1].cpus.empty());  // no --cpu-bind

  run.end(1, exited(3), {"ValueError: bad batch"});
  CHECK(run.launcher->signals == std::vector<int>{SIGTERM, SIGCONT});  // SIGCONT: a SIGSTOPped worker gets it now
  CHECK(run.clock->armed(sup::Timer::kGrace));
  CHECK(run.launcher->started.size() == 2);  // nothing restarts before the group stopped
  run.end(0, killed(SIGTERM));
  // Restart 1: both ranks again, the attempt's number in their environment.
  CHECK_FALSE(run.clock->armed(sup::Timer::kGrace));
  CHECK(run.launcher->retired == 1);
  REQUIRE(run.launcher->started.size() == 4);
  CHECK(env_of(run.launcher->started[2], "TORCHELASTIC_RESTART_COUNT") == "1");
  CHECK(env_of(run.launcher->started[3], "RANK") == "1");
  CHECK_FALSE(run.agent->done());

  run.end(0, exited(0));
  CHECK_FALSE(run.agent->done());
  run.end(1, exited(0));
  REQUIRE(run.agent->done());
  CHECK(run.agent->exit_code() == 0);
  CHECK(run.launcher->finished);
  CHECK(run.link == nullptr);  // a single node joins no rendezvous
  const auto summary = run.agent->summary();
  INFO(summary.dump(2));
  CHECK(summary["restarts"] == 1);
  CHECK(summary["exit_code"] == 0);
  REQUIRE(summary["attempts"].size() == 2);
  CHECK(summary["attempts"][0]["workers"][1]["exit_code"] == 3);
  CHECK(summary["attempts"][0]["workers"][0]["stopped_by_agent"] == true);
  CHECK(summary["attempts"][1]["workers"][1]["exit_code"] == 0);
  const std::string out = run.output();
  INFO(out);
  CHECK_THAT(out, Catch::Contains("rank 1 (local_rank 1) failed with exit code 3; restarting the worker group (1 of 1)"));
  CHECK_THAT(out, !Catch::Contains("Root Cause"));
}

TEST_CASE("agent with fakes: restarts spent, a worker that ignores SIGTERM is killed after the grace and the run "
          "exits with the failed worker's code") {
  Run run({"--nproc_per_node=2", "--max_restarts=1", "--grace=7"});
  run.end(0, exited(5));
  run.end(1, killed(SIGTERM));
  REQUIRE(run.launcher->started.size() == 4);
  // Attempt 1: rank 1 fails; rank 0 ignores SIGTERM.
  run.end(1, exited(9), {"Traceback (most recent call last):", "RuntimeError: out of patience"});
  CHECK(run.launcher->signals == std::vector<int>{SIGTERM, SIGCONT, SIGTERM, SIGCONT});
  CHECK_FALSE(run.agent->done());
  // The grace runs out when the clock says so, not after 7 real seconds.
  REQUIRE(run.clock->fire_next());
  run.settle();
  CHECK(run.launcher->signals == std::vector<int>{SIGTERM, SIGCONT, SIGTERM, SIGCONT, SIGKILL});
  CHECK_FALSE(run.agent->done());
  run.end(0, killed(SIGKILL));
  REQUIRE(run.agent->done());
  CHECK(run.agent->exit_code() == 9);
  const auto summary = run.agent->summary();
  INFO(summary.dump(2));
  CHECK(summary["restarts"] == 1);
  CHECK(summary["root_cause"]["rank"] == 1);
  CHECK(summary["root_cause"]["exit_code"] == 9);
  const std::string out = run.output();
  INFO(out);
  CHECK_THAT(out, Catch::Contains("workers still running 7.0s after SIGTERM: sending SIGKILL"));
  CHECK_THAT(out, Catch::Contains("Root Cause (first observed failure):"));
  CHECK_THAT(out, Catch::Contains("rank       : 1 (local_rank: 1)"));
  CHECK_THAT(out, Catch::Contains("exitcode   : 9 (pid: 4003)"));
  CHECK_THAT(out, Catch::Contains("    RuntimeError: out of patience"));
  // Only the first failure of each attempt is a root cause: rank 0's SIGKILL is not in it.
  CHECK_THAT(out, !Catch::Contains("exitcode   : 137"));
}

TEST_CASE("agent with fakes: --cpu-bind takes its CPUs from the hardware probe it was given") {
  Run run({"--nproc_per_node=2", "--cpu-bind=cores"});
  REQUIRE(run.launcher->started.size() == 2);
  CHECK(run.launcher->started[0].cpus == std::vector<int>{100});
  CHECK(run.launcher->started[1].cpus == std::vector<int>{101});
  run.end(0, exited(0));
  run.end(1, exited(0));
  REQUIRE(run.agent->done());
  CHECK(run.agent->exit_code() == 0);
  CHECK_THAT(run.output(), Catch::Contains("local_rank 1: cpus 101"));
}

TEST_CASE("agent with fakes: the node-0 agent serves its store through the seam, on MASTER_PORT, emptied for each attempt") {
  // Something else on this machine listens on the master port (on another loopback address,
  // so the plan's own check on 127.0.0.1 passes): a faked agent does not care, as it serves
  // no socket. (A real store here could not listen: the flake of the agent tests under load.)
  const int listener = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  REQUIRE(listener >= 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(0x7f000002);  // 127.0.0.2, port 0: the kernel's choice
  REQUIRE(::bind(listener, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0);
  REQUIRE(::listen(listener, 1) == 0);
  socklen_t len = sizeof(a);
  REQUIRE(::getsockname(listener, reinterpret_cast<sockaddr*>(&a), &len) == 0);
  const int port = ntohs(a.sin_port);
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{listener};

  Run run({"--nproc_per_node=2", "--max_restarts=1", "--master_port=" + std::to_string(port)});
  REQUIRE(run.launcher->started.size() == 2);
  CHECK(env_of(run.launcher->started[0], "TORCHELASTIC_USE_AGENT_STORE") == "True");
  CHECK(env_of(run.launcher->started[0], "MASTER_PORT") == std::to_string(port));
  CHECK(run.store.served == std::vector<int>{port});  // one store, before the first worker
  CHECK(run.store.resets == 0);
  run.end(0, exited(1));
  run.end(1, killed(SIGTERM));
  // The restart keeps the store and its port, and empties it.
  REQUIRE(run.launcher->started.size() == 4);
  CHECK(run.store.served == std::vector<int>{port});
  CHECK(run.store.resets == 1);
  run.end(0, exited(0));
  run.end(1, exited(0));
  REQUIRE(run.agent->done());
  CHECK(run.agent->exit_code() == 0);
  CHECK(run.store.stops == 1);
}

TEST_CASE("agent with fakes: a store that cannot serve fails the attempt's workers before any starts, exit 4 with "
          "its reason, and the run ends (#35)") {
  // Before: the factory's exception left the agent mid-way through its actions (inside a
  // rendezvous handler, where the connection took it for a lost link): the core counted
  // workers never started, and waited for them for ever, signals or not.
  int tries = 0;
  auto fails = [&](int port) {
    ++tries;
    throw ResourceError(fmt::format("cannot serve the agent's store on port {}: Address already in use", port));
  };
  SECTION("one node") {
    Run run({"--nproc_per_node=2"}, {}, fails);
    CHECK(run.launcher->started.empty());
    REQUIRE(run.agent->done());
    CHECK(run.agent->exit_code() == 4);
    CHECK(tries == 1);  // once for the attempt, not once per worker
    const std::string out = run.output();
    INFO(out);
    CHECK_THAT(out, Catch::Contains("Root Cause") && Catch::Contains("exitcode   : 4") &&
                        Catch::Contains("cannot serve the agent's store on port"));
  }
  SECTION("node 0 of two: the rendezvous hears the reason, not a lost connection") {
    Run run({"--nnodes=2", "--nproc_per_node=2", "--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:1",
             "--rdzv_conf=is_host=false"},
            torch2_env(), fails);
    run.assign(1, 0, run.link->join.master_port, /*group_rank=*/0);
    CHECK(run.launcher->started.empty());
    REQUIRE(run.link->failures.size() == 1);
    CHECK(run.link->failures[0].exit_code == 4);
    CHECK(run.link->failures[0].rank == 0);
    CHECK_THAT(run.link->failures[0].message, Catch::Contains("cannot serve the agent's store on port"));
    proto::Abort ab;
    ab.root_cause = run.link->failures[0];
    ab.reason = "rank 0 failed";
    run.link->abort(ab);
    run.settle();
    REQUIRE(run.agent->done());
    CHECK(run.agent->exit_code() == 4);
  }
}

TEST_CASE("agent with fakes: an error while carrying out a rendezvous decision ends the run with one line and its "
          "code, instead of leaving the agent half-way for ever (#35)") {
  Run run({"--nnodes=2", "--nproc_per_node=2", "--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:1",
           "--rdzv_conf=is_host=false"},
          torch2_env(), [](int) { throw std::runtime_error("the store broke"); });
  // Before: the exception left the event loop (a real link took it for a lost connection).
  run.assign(1, 0, run.link->join.master_port, /*group_rank=*/0);
  REQUIRE(run.agent->done());
  CHECK(run.agent->exit_code() == 1);
  CHECK(run.launcher->finished);
  CHECK(run.link->closed);
  CHECK_THAT(run.output(), Catch::Contains("mglaunch: error: internal error: the store broke"));
}

TEST_CASE("agent with fakes: TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 leaves the store unserved") {
  Run run({"--nproc_per_node=1"}, {{"TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1"}});
  REQUIRE(run.launcher->started.size() == 1);
  CHECK(env_of(run.launcher->started[0], "TORCHELASTIC_USE_AGENT_STORE") == "False");
  CHECK(run.store.served.empty());
  run.end(0, exited(0));
  CHECK(run.agent->exit_code() == 0);
}

TEST_CASE("agent with fakes: where the workers host the store, the watch on MASTER_PORT looks every 100 ms of the "
          "agent's clock and stops after 60 s of it (#35)") {
  Run run({"--nproc_per_node=1"}, {{"TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1"}});
  REQUIRE(run.launcher->started.size() == 1);
  REQUIRE(run.clock->armed(sup::Timer::kPortWatch));
  CHECK(run.clock->due_in(sup::Timer::kPortWatch) == std::chrono::milliseconds(100));
  // Nobody listens on the port: it looks again until 60 s have passed on the fake clock.
  int looks = 0;
  while (run.clock->armed(sup::Timer::kPortWatch) && looks < 1000) {
    run.clock->advance(std::chrono::milliseconds(100));
    run.clock->fire(sup::Timer::kPortWatch);
    run.settle();
    ++looks;
  }
  CHECK(looks >= 590);
  CHECK(looks <= 600);
  run.end(0, exited(0));
  CHECK(run.agent->exit_code() == 0);
}

TEST_CASE("agent with fakes: torch's events tell the rendezvous' time and their own on the agent's clock (#36)") {
  Run run({"--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:1",
           "--rdzv_conf=is_host=false", "--event_log_handler=console"});
  REQUIRE(run.link != nullptr);
  // The round takes 3 s of the fake clock (before: the real clock's, well under a second).
  run.clock->advance(std::chrono::seconds(3));
  const auto wall_ms =
      std::chrono::duration_cast<std::chrono::milliseconds>(run.clock->now().wall.time_since_epoch()).count();
  run.assign(1, 0, run.link->join.master_port, /*group_rank=*/1);
  REQUIRE(run.launcher->started.size() == 1);
  run.end(0, exited(0));
  run.link->done();
  run.settle();
  const std::string out = run.output();
  std::string line;
  for (const auto& l : mgtest::split_lines(out))
    if (l.find("torchelastic.worker.status.RENDEZVOUS") != std::string::npos) line = l;
  INFO(out);
  REQUIRE(!line.empty());
  CHECK_THAT(line, Catch::Contains("\"duration_ms\": 3000.0"));
  CHECK_THAT(line, Catch::Contains("\"timestamp\": " + std::to_string(wall_ms)));
  CHECK_THAT(line, Catch::Contains("\"total_run_time\": 3"));
}

TEST_CASE("agent with fakes: a master port the agent chose is let go once the workers exec'd") {
  // --master_port=0: the agent picks a port outside the ephemeral range and holds it.
  Run run({"--nproc_per_node=1", "--master_port=0"});
  REQUIRE(run.launcher->started.size() == 1);
  // The fake's workers exec at once: the exec fence settled, its timer is gone.
  CHECK_FALSE(run.clock->armed(sup::Timer::kFence));
  run.end(0, exited(0));
  REQUIRE(run.agent->done());
  CHECK(run.agent->exit_code() == 0);
}

TEST_CASE("agent with fakes: a node of a multi-node job runs the rounds its rendezvous link decides") {
  // is_host=false: this agent hosts nothing, so nothing listens and no port is touched but
  // the master port it holds for the job.
  Run run({"--nnodes=2", "--nproc_per_node=2", "--max_restarts=3", "--rdzv_backend=c10d",
           "--rdzv_endpoint=127.0.0.1:1", "--rdzv_conf=is_host=false"});
  REQUIRE(run.link != nullptr);
  CHECK(run.link->joins == 1);
  CHECK(run.link->join.nproc == 2);
  CHECK(run.link->join.max_restarts == 3);
  CHECK(run.launcher->started.empty());  // nothing runs before the assignment

  run.assign(1, 0, 45001);
  REQUIRE(run.launcher->started.size() == 2);
  CHECK(env_of(run.launcher->started[0], "RANK") == "2");
  CHECK(env_of(run.launcher->started[1], "RANK") == "3");
  CHECK(env_of(run.launcher->started[1], "WORLD_SIZE") == "4");
  CHECK(env_of(run.launcher->started[1], "MASTER_PORT") == "45001");

  // Our rank 3 fails: the link hears it, with its last lines, and the job decides.
  run.end(1, exited(6), {"RuntimeError: shard 3 is corrupt"});
  run.end(0, killed(SIGTERM));
  REQUIRE(run.link->failures.size() == 1);
  CHECK(run.link->failures[0].rank == 3);
  CHECK(run.link->failures[0].exit_code == 6);
  CHECK(run.link->failures[0].round == 1);
  CHECK(run.link->failures[0].last_lines == std::vector<std::string>{"RuntimeError: shard 3 is corrupt"});
  CHECK_FALSE(run.agent->done());

  // The rendezvous restarts every node: this one joins the next round offering a fresh port.
  proto::Restart r;
  r.restart_count = 1;
  r.reason = "rank 3 failed";
  run.link->restart(r);
  run.settle();
  CHECK(run.link->joins == 2);
  REQUIRE(run.link->offered_ports.size() == 1);
  CHECK(run.link->offered_ports[0] > 0);
  run.assign(2, 1, 45002);
  REQUIRE(run.launcher->started.size() == 4);
  CHECK(env_of(run.launcher->started[2], "TORCHELASTIC_RESTART_COUNT") == "1");
  CHECK(env_of(run.launcher->started[3], "MASTER_PORT") == "45002");

  // Both end well: the node is done, the job ends when the rendezvous says so.
  run.end(0, exited(0));
  run.end(1, exited(0));
  CHECK(run.link->done_rounds == std::vector<int>{2});
  CHECK_FALSE(run.agent->done());
  run.link->done();
  run.settle();
  REQUIRE(run.agent->done());
  CHECK(run.agent->exit_code() == 0);
  CHECK(run.link->closed);
  const std::string out = run.output();
  INFO(out);
  CHECK_THAT(out, Catch::Contains("restart 1 decided by the rendezvous: rank 3 failed"));
}

TEST_CASE("agent with fakes: a job aborted by the rendezvous prints the job's root cause and exits with its code") {
  Run run({"--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:1",
           "--rdzv_conf=is_host=false"});
  REQUIRE(run.link != nullptr);
  run.assign(1, 0, 45001);
  REQUIRE(run.launcher->started.size() == 1);
  // Another node's worker failed: the job is aborted while ours still runs.
  proto::Abort a;
  a.reason = "restarts spent";
  a.root_cause.host = "node-b";
  a.root_cause.rank = 0;
  a.root_cause.exit_code = 42;
  a.root_cause.message = "the other node's failure";
  run.link->abort(a);
  run.settle();
  CHECK(run.launcher->signals == std::vector<int>{SIGTERM, SIGCONT});
  run.end(0, killed(SIGTERM));
  REQUIRE(run.agent->done());
  CHECK(run.agent->exit_code() == 42);
  CHECK(run.link->failures.empty());  // our worker was stopped: nothing of ours to report
  const std::string out = run.output();
  INFO(out);
  CHECK_THAT(out, Catch::Contains("host       : node-b"));
  CHECK_THAT(out, Catch::Contains("message    : the other node's failure"));
}

TEST_CASE("agent with fakes: a SIGTERM while the restart is due ends the run with 143 and no restart starts") {
  Run run({"--nproc_per_node=2", "--max_restarts=1"});
  REQUIRE(run.launcher->started.size() == 2);
  using Set = AgentSignals::Set;
  CHECK(run.signals->added[Set::kStop] == std::vector<int>{SIGINT, SIGTERM, SIGHUP, SIGUSR1, SIGUSR2, SIGTERM, SIGINT,
                                                           SIGHUP, SIGQUIT});
  CHECK(run.signals->added[Set::kJobControl] == std::vector<int>{SIGTSTP, SIGCONT});
  CHECK_FALSE(run.signals->added.contains(Set::kWinch));  // the console is a file, no terminal
  run.end(1, exited(3));
  // The last worker of the failed attempt ends: the restart is due (posted), and SIGTERM
  // comes before it starts. A real signal can hit this window only by chance.
  run.launcher->end(0, killed(SIGTERM));
  run.signals->deliver(SIGTERM);
  run.settle();
  CHECK(run.launcher->started.size() == 2);  // restart 1 never started
  REQUIRE(run.agent->done());
  CHECK(run.agent->exit_code() == 128 + SIGTERM);
  CHECK(run.launcher->finished);
  const auto summary = run.agent->summary();
  INFO(summary.dump(2));
  CHECK(summary["restarts"] == 0);
  CHECK_THAT(run.output(), Catch::Contains("got SIGTERM before restart 1 started: not restarting"));
}

TEST_CASE("agent with fakes: a SIGTERM while the failed group stops keeps the grace, SIGKILLs after it, starts no "
          "restart and exits with the failure's code") {
  Run run({"--nproc_per_node=2", "--max_restarts=1", "--grace=7"});
  run.end(1, exited(3));
  CHECK(run.launcher->signals == std::vector<int>{SIGTERM, SIGCONT});
  REQUIRE(run.clock->armed(sup::Timer::kGrace));
  run.signal(SIGTERM);  // rank 0 ignores SIGTERM; the agent is told to stop meanwhile
  CHECK_FALSE(run.agent->done());
  REQUIRE(run.clock->fire_next());  // the grace runs out: SIGKILL
  run.settle();
  CHECK(run.launcher->signals.back() == SIGKILL);
  run.end(0, killed(SIGKILL));
  CHECK(run.launcher->started.size() == 2);  // the signal cancelled the restart
  REQUIRE(run.agent->done());
  CHECK(run.agent->exit_code() == 3);  // the failure came first: a later signal does not change its code
  const std::string out = run.output();
  INFO(out);
  CHECK_THAT(out, Catch::Contains("workers still running 7.0s after SIGTERM: sending SIGKILL"));
}

TEST_CASE("agent with fakes: Ctrl-Z stops the workers, then the agent, and the grace starts over when it goes on") {
  Run run({"--nproc_per_node=2", "--max_restarts=0", "--grace=7"});
  run.end(1, exited(3));
  REQUIRE(run.clock->armed(sup::Timer::kGrace));
  run.launcher->signals.clear();
  run.signal(SIGTSTP);
  CHECK(run.launcher->signals == std::vector<int>{SIGSTOP});
  CHECK(run.signals->stopped_self == 1);  // after its workers (before: a SIGSTOP to the test itself)
  CHECK_FALSE(run.clock->armed(sup::Timer::kGrace));  // the time stopped does not count against it
  run.clock->advance(std::chrono::hours(1));
  run.signal(SIGCONT);
  CHECK(run.launcher->signals == std::vector<int>{SIGSTOP, SIGCONT});
  REQUIRE(run.clock->armed(sup::Timer::kGrace));
  CHECK(run.clock->due_in(sup::Timer::kGrace) == std::chrono::seconds(7));  // from the SIGCONT
  REQUIRE(run.clock->fire_next());
  run.settle();
  CHECK(run.launcher->signals.back() == SIGKILL);
  run.end(0, killed(SIGKILL));
  REQUIRE(run.agent->done());
  CHECK(run.agent->exit_code() == 3);
}

TEST_CASE("agent with fakes: a worker that opted in is paused when another fails, and assigned its place in the "
          "restart once it answered") {
  Run run({"--nproc_per_node=2", "--max_restarts=1"});
  REQUIRE(run.launcher->started.size() == 2);
  CHECK(env_of(run.launcher->started[1], "MGLAUNCH_CONTROL_SOCKET") == "@fake-control");
  run.control->hello(1, /*in_place=*/true);
  run.settle();
  run.end(0, exited(5));
  REQUIRE(run.control->sent[1].size() == 1);
  const auto& pause = run.control->sent[1][0];
  CHECK(pause["type"] == "pause");
  CHECK(pause["lost"] == "worker");
  CHECK(pause["reason"] == "rank 0 (local_rank 0) on " + local_hostname() + " failed with exit code 5");
  CHECK(run.launcher->signals.empty());  // the failed one is gone, the paused one spared
  REQUIRE(run.launcher->started.size() == 3);  // restart 1: local rank 0 anew, local rank 1 kept
  CHECK(run.launcher->started[2].local_rank == 0);
  CHECK(env_of(run.launcher->started[2], "TORCHELASTIC_RESTART_COUNT") == "1");
  CHECK(run.control->sent[1].size() == 1);  // its assign waits for its answer
  run.control->paused(1, 7);
  run.settle();
  CHECK(run.launcher->started.size() == 3);
  REQUIRE(run.control->sent[1].size() == 2);
  const auto& assign = run.control->sent[1][1];
  CHECK(assign["type"] == "assign");
  CHECK(assign["restart_count"] == 1);
  CHECK(assign["env"]["RANK"] == "1");
  CHECK(assign["env"]["TORCHELASTIC_RESTART_COUNT"] == "1");
  run.end(0, exited(0));
  run.end(1, exited(0));
  REQUIRE(run.agent->done());
  CHECK(run.agent->exit_code() == 0);
  CHECK(run.control->stopped);
}

TEST_CASE("agent with fakes: a pause the agent cannot send (the worker's session ended unheard) stops that worker and "
          "starts it anew instead of waiting for an answer that cannot come") {
  Run run({"--nproc_per_node=2", "--max_restarts=1", "--grace=7"});
  run.control->hello(1, /*in_place=*/true);
  run.settle();
  run.control->ended[1] = "the worker closed it (end of file)";  // the agent has not heard yet
  run.end(0, exited(5));
  CHECK(run.control->sent[1].empty());
  CHECK(run.launcher->signals == std::vector<int>{SIGTERM, SIGCONT});  // stopped as a worker that did not opt in
  run.end(1, killed(SIGTERM));
  REQUIRE(run.launcher->started.size() == 4);  // both anew: nothing to assign
  CHECK(run.control->sent[1].empty());
  run.end(0, exited(0));
  run.end(1, exited(0));
  REQUIRE(run.agent->done());
  CHECK(run.agent->exit_code() == 0);
  const std::string out = run.output();
  INFO(out);
  CHECK_THAT(out, Catch::Contains("local rank 1's control connection closed while paused (the agent could not send its "
                                  "pause: its session had ended (the worker closed it (end of file))"));
}

// Review s41-b L2/L3: the record's epoch is the newest this node was told (the link's), never
// an older Standby's: a node whose record is older answers "recalling at" that older epoch,
// which another node's record counts as "in no round after it" although this node was in a
// newer one. No test failed with remember_job's epoch line reverted to the message's.
TEST_CASE("agent with fakes: a Standby of an older epoch than this node was told writes the newer epoch in its record "
          "(review s41-b L2, L3)") {
  const std::string records = mgtest::make_temp_dir();
  const std::string kRunOfSeams = "1764500000000-00000000000000aa";
  Run run({"--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:1",
           "--rdzv_conf=is_host=false"},
          {{"MGLAUNCH_RECORD_DIR", records}});
  REQUIRE(run.link != nullptr);
  run.link->hosts = {{"127.0.0.2", 7002}};
  run.link->epoch = 2;  // it was in round 2 (voters unknown: the every-host rule)
  proto::Standby s;
  s.position = 1;
  s.round = 1;
  s.epoch = 1;  // a host that missed round 2
  s.run = kRunOfSeams;
  run.link->standby(s);
  run.settle();
  int seen = 0;
  for (const auto& f : std::filesystem::directory_iterator(records)) {
    if (f.path().extension() != ".json") continue;
    std::ifstream in(f.path());
    const auto j = nlohmann::json::parse(in);
    INFO(j.dump());
    CHECK(j.value("epoch", 0) == 2);  // main: 1
    CHECK(j.value("run", "") == kRunOfSeams);
    ++seen;
  }
  CHECK(seen == 1);
  run.agent.reset();
  std::filesystem::remove_all(records);
}
