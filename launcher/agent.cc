#include "launcher/agent.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <signal.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <algorithm>
#include <type_traits>
#include <variant>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <unordered_set>

#include <boost/asio/post.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "cli/args.h"
#include "cli/errors.h"
#include "ops/doctor.h"
#include "ops/health.h"
#include "ops/monitor.h"
#include "ops/trace.h"
#include "process/watchdog.h"
#include "launcher/worker_spec.h"
#include "proto/text.h"
#include "rendezvous/auth.h"
#include "rendezvous/endpoint.h"
#include "process/command.h"
#include "process/listeners.h"
#include "process/proc.h"
#include "process/thread.h"

namespace mg {

namespace asio = boost::asio;
namespace fs = std::filesystem;

namespace {

// "; its process (pid P) still runs" (or "is exiting", "had ended"): said with a closed
// control connection, it tells a worker's exit or crash from a close while it runs.
std::string process_state(const std::vector<WorkerState>& workers, int local_rank) {
  for (const auto& w : workers) {
    if (w.exited || w.local_rank != local_rank || w.pid <= 0) continue;
    constexpr std::uint64_t kPfExiting = 0x4;  // PF_EXITING: in exit(), its descriptors closing
    const auto st = read_proc_stat(w.pid);
    const bool exiting = !st || st->state == 'Z' || (st->flags & kPfExiting);
    return fmt::format("; its process (pid {}) {}", w.pid, exiting ? "is exiting" : "still runs");
  }
  return "; its process had ended";
}

}  // namespace

Agent::Agent(asio::io_context& io, AgentOptions opts, RunPlan plan, EnvMap base_env, AgentDeps deps)
    : io_(io),
      clock_(std::move(deps.clock)),
      make_link_(std::move(deps.link)),
      hardware_(std::move(deps.hardware)),
      make_store_(std::move(deps.store)),
      opts_(std::move(opts)),
      plan_(std::move(plan)),
      base_env_(std::move(base_env)),
      out_fd_(deps.stdout_fd),
      err_fd_(deps.stderr_fd),
      console_(io, out_fd_, err_fd_, opts_.timestamps),
      signals_(io),
      job_control_(io),
      winch_(io),
      launcher_(deps.launcher(io, console_)),
      core_(core_config(opts_, plan_)) {
  // The rendezvous token authenticates this agent; a worker (user code) must not see it.
  base_env_.erase("MGLAUNCH_RDZV_TOKEN");
  base_env_.erase("MGLAUNCH_RDZV_JOB_TOKEN");
  base_env_.erase("MGLAUNCH_ETCD_PASSWORD");
}

Agent::~Agent() {
  stop_preflight();
  health_.reset();
  file_timer_.reset();  // the pipe removed (its hooks use the console)
  monitor_.reset();
  if (trace_) {
    trace_->close();
    trace_.reset();
    console_.close_file(trace_fd_);
  }
  // SIGKILLs anything still running; with nothing left, the temporary tree goes while the
  // watchdog exits (the launcher's destructor waits for it).
  if (control_) control_->stop();
  launcher_->close();
  logs_.clean_up();
  if (takeover_fd_ >= 0) ::close(takeover_fd_);
}

void Agent::check_descriptor_budget() {
  int files = 0;  // log files held open for the run
  for (int lr = 0; lr < plan_.nproc_per_node; ++lr)
    for (Streams which : {Streams::kOut, Streams::kErr})
      if (opts_.redirects.covers(lr, which) || opts_.tee.covers(lr, which)) ++files;
  int open_now = 0;
  if (DIR* d = ::opendir("/proc/self/fd")) {
    while (dirent* e = ::readdir(d))
      if (e->d_name[0] != '.') ++open_now;
    ::closedir(d);
  }
  const sup::DescriptorNeed need = sup::descriptor_need(plan_.nproc_per_node, merge_streams_, files, open_now);
  rlimit lim{};
  if (::getrlimit(RLIMIT_NOFILE, &lim) != 0) return;
  auto limit = [](const rlimit& l) {
    sup::DescriptorLimit d;
    if (l.rlim_cur != RLIM_INFINITY) d.soft = l.rlim_cur;
    if (l.rlim_max != RLIM_INFINITY) d.hard = l.rlim_max;
    return d;
  };
  if (sup::worth_raising(need, limit(lim))) {
    rlimit raised = lim;
    raised.rlim_cur = lim.rlim_max;
    if (::setrlimit(RLIMIT_NOFILE, &raised) == 0) {
      worker_nofile_ = lim;  // the workers start with the limit they would have had
      lim = raised;
    }
  }
  if (!sup::fits(need, limit(lim))) throw ResourceError(sup::descriptor_shortfall(need, limit(lim)));
  shares_ = sup::descriptor_shares(need, limit(lim));
}

void Agent::start() {
  {
    // One pipe per worker when stdout and stderr are the same file (a terminal, 2>&1):
    // nothing is lost by merging, and a worker costs one descriptor instead of two.
    struct stat out{}, err{};
    merge_streams_ = ::fstat(out_fd_, &out) == 0 && ::fstat(err_fd_, &err) == 0 &&
                     out.st_dev == err.st_dev && out.st_ino == err.st_ino && out.st_rdev == err.st_rdev;
  }
  check_descriptor_budget();
  for (const auto& note : plan_.notes) notice(note);
  const bool files_wanted = [&] {
    for (int lr = 0; lr < plan_.nproc_per_node; ++lr)
      if (opts_.redirects.for_rank(lr) != Streams::kNone || opts_.tee.for_rank(lr) != Streams::kNone) return true;
    return false;
  }();
  LogLayoutOptions lo;
  lo.log_dir = opts_.log_dir;
  lo.rdzv_id = opts_.rdzv_id;
  lo.run_id = plan_.run_id;
  lo.files_wanted = files_wanted;
  if (!opts_.log_dir.empty()) lo.time_text = now_text();  // (reads the time zone: only when used)
  if (std::string text = logs_.create(lo); !text.empty()) notice(text);
  if (plan_.set_omp_threads)
    notice("setting OMP_NUM_THREADS=1 for each worker (more than one per node); set it yourself to tune");
  for (const auto& w : opts_.warnings) notice(w);
  if (opts_.preflight != "off" && !uses_rendezvous_server(opts_))
    notice(opts_.nnodes.max <= 1 ? "preflight: one node, nothing to check between nodes"
                                 : "preflight: skipped (it needs a rendezvous, which lists the nodes: "
                                   "--rdzv_backend=c10d or etcd)");
  if (opts_.cpu_bind != "none") {
    try {
      bindings_ = hardware_->bind(opts_.cpu_bind, plan_.nproc_per_node, opts_.gpu_ids);
    } catch (const std::invalid_argument& e) {
      throw UsageError(e.what());  // it names --cpu-bind and the fix
    }
    for (int lr = 0; lr < plan_.nproc_per_node; ++lr)
      notice(hw::format_binding(lr, bindings_[static_cast<std::size_t>(lr)]));
  }

  start_file_timer();
  start_health_check();
  start_ops();
  // The agent that hosts the rendezvous listens once every start-up step that can fail has
  // passed (the log directory, --cpu-bind, the trace and metrics files) and before the rest
  // (the watchdog's fork): the agents started with it find it listening sooner, and one
  // that connects never meets a host that then gives up (a refused agent retries until
  // join_timeout; a connection reset before the welcome ends its run).
  host_rendezvous();
  for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGUSR1, SIGUSR2}) signals_.add(sig);
  // torchrun's --signals-to-handle (default SIGTERM,SIGINT,SIGHUP,SIGQUIT): each one listed
  // stops the workers with that signal and ends the run with 128+S, as the ones above do.
  for (int sig : opts_.signals_to_handle) signals_.add(sig);
  wait_signal();
  job_control_.add(SIGTSTP);
  job_control_.add(SIGCONT);
  wait_job_control();
  if (console_.live(0) || console_.live(1)) {
    winch_.add(SIGWINCH);
    wait_winch();
  }
  python_run_ = opts_.module || (!opts_.no_python && (opts_.run_path || opts_.program.ends_with(".py")));
  stdin_terminal_ = opts_.stdin_rank >= 0 && ::isatty(STDIN_FILENO) == 1;
  // The subreaper, the reaper and the watchdog; a temporary tree nobody was told of goes
  // with the watchdog when the agent is killed.
  launcher_->prepare(logs_.kept() ? std::string() : logs_.root(), [this](const std::string& text) { notice(text); });
  start_control();
  // The core holds the master port (HoldMasterPort) only now: the watchdog (a fork that
  // closes what it inherited once it runs, which on a busy machine may be after the first
  // worker's bind) gets no copy of it.
  run(core_.start(now()));
  if (monitor_) monitor_->start();
}

void Agent::host_rendezvous() {
  if (hosting_decided_) return;
  hosting_decided_ = true;
  std::optional<rdzv::Endpoint> parsed;  // (an etcd endpoint list is not one)
  auto endpoint = [&]() -> const rdzv::Endpoint& {
    if (!parsed) parsed = rdzv::parse_endpoint(opts_.rdzv_endpoint, 29400);
    return *parsed;
  };
  const bool meant =
      sup::meant_to_host(uses_rendezvous_server(opts_), opts_.rdzv_backend == "etcd", opts_.rdzv_is_host, [&] {
        // A loopback endpoint is this machine, as for torchrun (a host name on 127.0.1.1, as
        // Debian's hosts file has it, is not the same address as "localhost").
        return rdzv::is_loopback_host(endpoint().host) ||
               (rdzv::is_local_host(endpoint().host) && rdzv::same_address(endpoint().host, plan_.master_addr));
      });
  // Only while nothing listens there, and only for this job.
  if (!meant || rdzv::probe_listen(endpoint().host, endpoint().port)) return;
  const rdzv::Endpoint& ep = endpoint();
  try {
    rdzv::ServerOptions so = server_options();
    so.host = ep.host;
    so.port = ep.port;
    embedded_server_ = std::make_unique<rdzv::Server>(io_, so);
    notice(fmt::format("hosting the rendezvous for job '{}' on {}", plan_.run_id, embedded_server_->address()));
  } catch (const std::exception&) {
    // Another local agent got there first: join it as a client.
  }
}

rdzv::ServerOptions Agent::server_options() {
  rdzv::ServerOptions so;
  so.token = opts_.rdzv_token;
  so.only_job = plan_.run_id;
  so.host_agent = local_hostname();
  so.log = [this](const std::string& line) {
    if (line.starts_with("warning:")) notice("rendezvous server: " + line);
  };
  if (so.token.empty() && !opts_.rdzv_job_token.empty()) so.job_tokens[plan_.run_id] = opts_.rdzv_job_token;
  return so;
}

void Agent::bind_takeover_socket() {
  if (embedded_server_ || takeover_fd_ >= 0 || takeover_refused_) return;
  // Only on the advertised address, where the others will look for this node (its Join's
  // addr): a name is resolved here, and the first of its IPv4 addresses that is this
  // machine's is bound. None: this node cannot take over, and says so once.
  std::string why;
  auto try_bind = [&](in_addr_t addr) {
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
      why = std::strerror(errno);
      return false;
    }
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    sa.sin_addr.s_addr = addr;
    socklen_t len = sizeof sa;
    if (::bind(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa) != 0 ||
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&sa), &len) != 0) {
      why = std::strerror(errno);
      ::close(fd);
      return false;
    }
    char text[INET_ADDRSTRLEN] = {};
    ::inet_ntop(AF_INET, &sa.sin_addr, text, sizeof text);
    takeover_fd_ = fd;
    takeover_port_ = ntohs(sa.sin_port);
    takeover_host_ = text;
    return true;
  };
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  auto ipv4_of = [&](const std::string& host, std::vector<in_addr_t>& out) {
    addrinfo* found = nullptr;
    const int rc = ::getaddrinfo(host.c_str(), nullptr, &hints, &found);
    if (rc != 0) return rc;
    for (const addrinfo* ai = found; ai; ai = ai->ai_next)
      out.push_back(reinterpret_cast<const sockaddr_in*>(ai->ai_addr)->sin_addr.s_addr);
    ::freeaddrinfo(found);
    return 0;
  };
  auto in_loopback_net = [](in_addr_t a) { return (ntohl(a) >> 24) == 127; };
  // A job whose endpoint is off this machine's loopback net is reached over a real network:
  // a loopback address of the name (Debian's hosts file maps the host name to 127.0.1.1) is
  // then no address the others can reach, and the address this machine reaches the endpoint
  // from is bound instead (the route's source address: a UDP connect sends nothing).
  std::vector<in_addr_t> endpoint_ips, own;
  if (!opts_.rdzv_endpoint.empty() && opts_.rdzv_backend != "etcd") {
    try {
      ipv4_of(rdzv::parse_endpoint(opts_.rdzv_endpoint, 29400).host, endpoint_ips);
    } catch (const std::exception&) {
    }
  }
  const bool over_network = !endpoint_ips.empty() && !in_loopback_net(endpoint_ips.front());
  if (const int rc = ipv4_of(plan_.master_addr, own); rc != 0) {
    why = ::gai_strerror(rc);
  } else {
    bool bound = false, skipped = false;
    for (const in_addr_t a : own) {
      if (bound) break;
      if (over_network && in_loopback_net(a)) {
        skipped = true;
        continue;
      }
      bound = try_bind(a);
    }
    if (!bound && skipped) {
      const int u = ::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
      sockaddr_in to{};
      to.sin_family = AF_INET;
      to.sin_port = htons(9);
      to.sin_addr.s_addr = endpoint_ips.front();
      sockaddr_in from{};
      socklen_t len = sizeof from;
      if (u >= 0 && ::connect(u, reinterpret_cast<sockaddr*>(&to), sizeof to) == 0 &&
          ::getsockname(u, reinterpret_cast<sockaddr*>(&from), &len) == 0)
        bound = try_bind(from.sin_addr.s_addr);
      if (u >= 0) ::close(u);
      if (!bound && why.empty()) why = "it resolves here only to loopback addresses, which the others cannot reach";
    }
    if (bound) return;
    if (why.empty()) why = "no IPv4 address";
  }
  takeover_refused_ = true;
  notice(fmt::format("this node cannot take the rendezvous over if its host is lost: its advertised address '{}' "
                     "cannot be bound here ({}); give --local_addr an IPv4 address of this machine",
                     plan_.master_addr, why));
}

rdzv::TakeoverHost Agent::take_over(const rdzv::TakeoverSeed& seed) {
  if (embedded_server_ || takeover_fd_ < 0) return {};
  try {
    rdzv::ServerOptions so = server_options();
    so.host = takeover_host_;
    so.adopt_fd = std::exchange(takeover_fd_, -1);
    embedded_server_ = std::make_unique<rdzv::Server>(io_, so);
    embedded_server_->take_over(plan_.run_id, seed);
  } catch (const std::exception& e) {
    embedded_server_.reset();
    notice(fmt::format("cannot take the rendezvous over: {}", e.what()));
    return {};
  }
  notice(fmt::format("hosting the rendezvous for job '{}' on {}, taking over from {}", plan_.run_id,
                     embedded_server_->address(), seed.lost_host));
  return {takeover_host_, embedded_server_->port()};
}

void Agent::guarded(const std::function<void()>& work) {
  int code = exit_code::kInternal;
  std::string line;
  try {
    work();
    return;
  } catch (const UsageError& e) {
    code = exit_code::kUsage, line = e.what();
  } catch (const ResourceError& e) {
    code = exit_code::kResource, line = e.what();
  } catch (const ProgramNotFound& e) {
    code = exit_code::kNotFound, line = e.what();
  } catch (const std::exception& e) {
    line = fmt::format("internal error: {}", e.what());
  }
  run(core_.fatal(code, line, now()));
}

void Agent::start_rendezvous() {
  if (trace_) rdzv_since_us_ = trace_->now();
  rdzv_began_ = std::chrono::steady_clock::now();
  host_rendezvous();  // done at start() already
  proto::Join j;
  j.job_id = plan_.run_id;
  j.host = local_hostname();
  j.addr = plan_.master_addr;  // the address this node advertises
  j.agent_id = fmt::format("{}:{}", local_hostname(), ::getpid());
  j.nproc = plan_.nproc_per_node;
  j.node_rank = opts_.node_rank_given ? opts_.node_rank : -1;
  j.min_nodes = opts_.nnodes.min;
  j.max_nodes = opts_.nnodes.max;
  j.max_restarts = opts_.max_restarts;
  j.master_port = plan_.master_port;
  j.last_call_ms = static_cast<int>(opts_.last_call_timeout.count());
  j.join_timeout_ms = static_cast<int>(opts_.join_timeout.count());
  j.keep_alive_ms = static_cast<int>(opts_.keep_alive_interval.count());
  j.keep_alive_max_attempt = opts_.keep_alive_max_attempt;
  // Every node that does not host can take the job over if its host is lost (#26).
  if (opts_.rdzv_backend != "etcd") bind_takeover_socket();
  j.takeover_port = embedded_server_ ? 0 : takeover_port_;
  rdzv::ClientHandlers h;
  h.on_assignment = [this](const proto::Assignment& a) { guarded([&] { on_assignment(a); }); };
  // During the preflight check the rendezvous' word waits for its verdict (a node that
  // leaves on a failed check must not make the others end on the rendezvous instead).
  auto after_preflight = [this](std::function<void()> f) {
    if (preflight_thread_.joinable()) deferred_by_preflight_.push_back([this, f = std::move(f)] { guarded(f); });
    else guarded(f);
  };
  h.on_restart = [this, after_preflight](const proto::Restart& r) {
    after_preflight([this, r] { run(core_.restart(r, now())); });
  };
  h.on_abort = [this, after_preflight](const proto::Abort& a) {
    after_preflight([this, a] { run(core_.abort(a, now())); });
  };
  h.on_done = [this, after_preflight] { after_preflight([this] { run(core_.rendezvous_done(now())); }); };
  h.on_standby = [this](const proto::Standby& s) {
    guarded([&] {
      run(core_.standby(s, now()));
      prestart_workers();
    });
  };
  h.on_lost = [this, after_preflight](const std::string& why) {
    after_preflight([this, why] { run(core_.rendezvous_lost(why, now())); });
  };
  h.on_notice = [this](const std::string& text) { notice("rendezvous: " + text); };
  h.on_take_over = [this](const rdzv::TakeoverSeed& seed) { return take_over(seed); };
  // etcd proves nothing with the rendezvous token: say so rather than let its holder think
  // the decisions it reads are authenticated.
  if (opts_.rdzv_backend == "etcd" && (!opts_.rdzv_token.empty() || !opts_.rdzv_job_token.empty()))
    notice("warning: --rdzv_backend=etcd does not use the rendezvous token: whoever can write this job's keys in "
           "etcd decides for it; protect them with etcd's own authentication (--rdzv_conf user=, cert=, https)");
  client_ = make_link_(io_, opts_, std::move(j), std::move(h));
  client_->start();
}

void Agent::on_assignment(const proto::Assignment& a) {
  if (opts_.preflight != "off" && !preflight_tried_ && core_.state() == sup::State::kWaiting) {
    preflight_tried_ = true;  // once: before the job's first workers
    if (a.round != 1) {  // a standby or a late node: the others checked (or not) at round 1 and will not again
      notice(fmt::format("preflight: skipped (this node joins the job at round {}, the check is at round 1)", a.round));
      run(core_.assignment(a, now()));
      return;
    }
    if (a.group_world_size > 1 && static_cast<int>(a.nodes.size()) == a.group_world_size && a.master_port > 0) {
      start_preflight(a);
      return;
    }
    notice(a.group_world_size > 1 ? "preflight: skipped (the rendezvous gave no master port, or too many nodes to list)"
                                  : "preflight: one node, nothing to check between nodes");
  }
  run(core_.assignment(a, now()));
}

void Agent::start_preflight(const proto::Assignment& a) {
  preflight::Options o;
  o.rank = a.group_rank;
  o.nodes = a.nodes;
  o.coordinator_host = a.master_addr;
  o.coordinator_port = a.master_port;
  o.job = fmt::format("{}/{}", plan_.run_id, a.round);
  // With a token the check is authenticated with the job's key, as the rendezvous is.
  o.key = !opts_.rdzv_job_token.empty() ? opts_.rdzv_job_token
          : opts_.rdzv_token.empty()    ? std::string()
                                        : rdzv::auth::job_key(opts_.rdzv_token, plan_.run_id);
  // Test hooks (docs/flags.md): this node's sends paced to N bytes/s; its listener refusing.
  if (auto it = base_env_.find("MGLAUNCH_PREFLIGHT_TEST_SEND_RATE"); it != base_env_.end())
    o.send_rate = std::strtod(it->second.c_str(), nullptr);
  if (auto it = base_env_.find("MGLAUNCH_PREFLIGHT_TEST_UNREACHABLE"); it != base_env_.end())
    o.unreachable = it->second == "1";
  if (::pipe2(preflight_cancel_, O_CLOEXEC) != 0) {
    notice(fmt::format("preflight: skipped (pipe: {})", std::strerror(errno)));
    run(core_.assignment(a, now()));
    return;
  }
  o.cancel_fd = preflight_cancel_[0];
  // Group rank 0 coordinates on the master port it holds listening: on a copy of that socket.
  if (a.group_rank == 0 && port_hold_ && port_hold_->listening() && port_hold_->port() == a.master_port)
    o.coordinator_fd = preflight_coord_fd_ = ::fcntl(port_hold_->fd(), F_DUPFD_CLOEXEC, 0);
  notice(fmt::format("preflight: checking the network between the {} nodes (--preflight={})", a.group_world_size,
                     opts_.preflight));
  const std::uint64_t gen = ++preflight_gen_;
  preflight_end_ = std::make_shared<PreflightEnd>();
  preflight_thread_ = signal_free_thread([this, o = std::move(o), a, gen, end = preflight_end_] {
    preflight::Result r = preflight::run(o);
    std::lock_guard lk(end->m);
    end->ended = true;
    end->cv.notify_all();
    if (!end->abandoned)  // else the agent may be gone
      asio::post(io_, [this, a, gen, r = std::move(r)]() mutable { preflight_done(a, gen, std::move(r)); });
  });
}

void Agent::stop_preflight() {
  if (!preflight_thread_.joinable()) return;
  ++preflight_gen_;  // its verdict, if already posted, is dropped
  ::close(std::exchange(preflight_cancel_[1], -1));  // the check sees its end of the pipe readable
  bool ended = false;
  {
    std::unique_lock lk(preflight_end_->m);
    ended = preflight_end_->cv.wait_for(lk, kThreadStop, [&] { return preflight_end_->ended; });
    if (!ended) preflight_end_->abandoned = true;
  }
  if (!ended) {
    preflight_thread_.detach();
    notice(fmt::format("the preflight check did not stop within {} s of being told to (a name lookup that hangs?): "
                       "left behind",
                       kThreadStop.count()));
    preflight_cancel_[0] = preflight_coord_fd_ = -1;  // its descriptors stay open: it may still use them
    return;
  }
  preflight_thread_.join();
  ::close(std::exchange(preflight_cancel_[0], -1));
  if (preflight_coord_fd_ >= 0) ::close(std::exchange(preflight_coord_fd_, -1));
}

void Agent::preflight_done(const proto::Assignment& a, std::uint64_t gen, preflight::Result r) {
  if (gen != preflight_gen_) return;
  stop_preflight();  // (the thread has ended: this joins it)
  trace_instant("preflight", "rendezvous",
                {{"ok", r.ok}, {"seconds", r.seconds}, {"line", r.line}, {"named", r.named}});
  if (core_.state() != sup::State::kWaiting) return;
  if (r.ok) {
    notice(r.line);
  } else if (opts_.preflight == "warn") {
    notice("warning: " + r.line + "; going on (--preflight=warn)");
  } else {
    run(core_.preflight_failed(r.line, now()));
    return;
  }
  if (!deferred_by_preflight_.empty()) {  // the round is over already: what the rendezvous said instead
    auto deferred = std::move(deferred_by_preflight_);
    for (auto& f : deferred) f();
    return;
  }
  run(core_.assignment(a, now()));
}

void Agent::apply_assignment(const proto::Assignment& a) {
  plan_.nnodes = a.group_world_size;
  plan_.node_rank = a.group_rank;
  plan_.rank_offset = a.rank_offset;
  plan_.world_size = a.world_size;
  plan_.master_addr = a.master_addr;
  plan_.master_port = a.master_port;
  plan_.nodes = a.nodes;
  if (trace_)
    trace_->complete(fmt::format("rendezvous round {}", a.round), "rendezvous", 0, rdzv_since_us_,
                     {{"round", a.round}, {"node_rank", a.group_rank}, {"nnodes", a.group_world_size},
                      {"world_size", a.world_size}, {"restart_count", a.restart_count},
                      {"master", fmt::format("{}:{}", a.master_addr, a.master_port)}});
}

std::string Agent::attempt_dir(int local_rank) const {
  return logs_.attempt_dir(core_.restart_count(), local_rank);
}

WorkerSpec Agent::attempt_spec(int lr) {
  SpecInputs in;
  in.local_rank = lr;
  in.attempt = core_.restart_count();
  in.dir = attempt_dir(lr);
  in.merge_streams = merge_streams_;
  std::error_code ec;
  fs::create_directories(in.dir, ec);
  auto inherited = base_env_.find(kRunMarkVar);
  in.run_mark = launcher_->run_mark(inherited == base_env_.end() ? std::string() : inherited->second);
  return make_worker_spec(plan_, opts_, base_env_, in);
}

void Agent::spawn_worker(int lr) {
  // Before the first worker of an attempt can connect to it. A store that cannot serve
  // fails the worker before it starts, from the event loop (as a spawn that failed).
  if (std::string why = serve_store(); !why.empty()) {
    WorkerEnd end;
    end.rank = plan_.rank_offset + lr;
    end.local_rank = lr;
    end.wait_status = exit_code::kResource << 8;
    end.spawn_error = std::move(why);
    asio::post(io_, [this, end = std::move(end)] { on_worker_done(end); });
    return;
  }
  {
    WorkerSpec spec = attempt_spec(lr);
    std::error_code ec;
    fs::remove(attempt_dir(lr) + "/error.json", ec);  // a stale file from an earlier run must not be taken as this one's
    if (lr == opts_.stdin_rank) {
      // A file or a pipe is passed on as it is; a terminal too, and the worker joins the
      // agent's process group, the terminal's foreground job when the agent is in it.
      spec.stdin_fd = STDIN_FILENO;
      spec.in_agent_group = stdin_terminal_;
    }
    if (worker_nofile_) spec.nofile = &*worker_nofile_;
    if (!bindings_.empty()) spec.cpus = bindings_[static_cast<std::size_t>(lr)].cpus;
    const pid_t pid = launcher_->start(std::move(spec), [this](const WorkerEnd& done) { on_worker_done(done); });
    if (trace_)
      trace_->instant(fmt::format("spawn rank {}", plan_.rank_offset + lr), "worker", TraceWriter::worker_tid(lr),
                      {{"rank", plan_.rank_offset + lr}, {"local_rank", lr}, {"pid", pid},
                       {"attempt", core_.restart_count()}});
  }
}

void Agent::rejoin(bool offer_port) {
  // The core held a fresh master port for the new round (when the port is ours).
  if (offer_port) client_->set_master_port(plan_.master_port);
  if (trace_) rdzv_since_us_ = trace_->now();
  rdzv_began_ = std::chrono::steady_clock::now();
  client_->rejoin();
}

std::string Agent::serve_store() {
  if (!plan_.agent_store || plan_.node_rank != 0) {
    retire_store();
    // The workers (rank 0's TCPStore) bind the port themselves: the hold must not listen.
    if (port_hold_ && port_hold_->listening() && !port_hold_->stop_listening()) {
      notice(fmt::format("the master port {} could not be held again for the workers: {}; something else may take it "
                         "before rank 0 binds it",
                         port_hold_->port(), std::strerror(errno)));
      port_hold_.reset();
    }
    if (plan_.node_rank == 0) watch_master_port();
    return {};
  }
  if (store_ && store_->port() == plan_.master_port) {
    // Each attempt starts from an empty store, as torch's agent gives every attempt a fresh
    // one (torch 2.6 and later no longer put /worker/attempt_N before their keys).
    if (store_attempt_ != core_.restart_count()) store_->reset();
    store_attempt_ = core_.restart_count();
    return {};
  }
  if (store_error_attempt_ == core_.restart_count()) return store_error_;  // tried for this attempt already
  retire_store();
  store_attempt_ = core_.restart_count();
  int held = -1;
  if (port_hold_ && port_hold_->port() == plan_.master_port) {
    held = port_hold_->release();  // the port held (listening) since the plan or the restart
    port_hold_.reset();
  }
  try {
    store_ = make_store_(io_, plan_.master_port, held, shares_.store, [this](const std::string& line) { notice(line); });
  } catch (const ResourceError& e) {
    store_error_ = e.what();
    store_error_attempt_ = core_.restart_count();
    return store_error_;
  }
  return {};
}

void Agent::watch_master_port() {
  if (!port_watch_) port_watch_ = std::make_unique<asio::steady_timer>(io_);
  port_watch_warned_ = false;
  check_master_port(++port_watch_round_, std::chrono::steady_clock::now() + std::chrono::seconds(60));
}

void Agent::check_master_port(int round, std::chrono::steady_clock::time_point until) {
  if (round != port_watch_round_ || core_.state() == sup::State::kDone) return;
  const int port = plan_.master_port;
  const unsigned me = ::geteuid();
  bool ours = false;
  const auto listeners = tcp_listeners_on(port);
  for (const auto& l : listeners) {
    if (l.uid == me) continue;
    // Another user listens where this run's workers will connect: they would talk to it.
    ++port_watch_round_;
    run(core_.fatal(
        exit_code::kResource,
        fmt::format("MASTER_PORT {} was taken by a process of uid {} (socket inode {}), not by this run's rank 0: "
                    "where rank 0's TCPStore hosts the store (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, torch 2.0 and "
                    "2.1, torch 1.x's c10d), the port is only bound from just before the workers start until it "
                    "listens, and that process listened there meanwhile; find it (ss -ltnp 'sport = :{}') and run again",
                    port, l.uid, l.inode, port),
        now()));
    return;
  }
  if (!listeners.empty()) {  // all of this user: rank 0's, or another process of this user's
    std::unordered_set<std::uint64_t> mine;  // the sockets of this agent's descendants
    bool unreadable = false;
    for (const auto& p : descendants_of(scan_family(::getpid()), ::getpid()))
      for (auto inode : socket_inodes_of(p.pid, &unreadable)) mine.insert(inode);
    for (const auto& l : listeners) ours = ours || mine.contains(l.inode);
    if (!ours && !port_watch_warned_) {
      port_watch_warned_ = true;
      notice(unreadable ? fmt::format("MASTER_PORT {}: a process of this user listens there (socket inode {}); some of "
                                      "this run's processes do not let their descriptors be read (not dumpable), so "
                                      "it may be rank 0's",
                                      port, listeners.front().inode)
                        : fmt::format("MASTER_PORT {}: a process of this user that is not of this run listens there "
                                      "(socket inode {}); rank 0 will find the port in use",
                                      port, listeners.front().inode));
    }
  }
  if (ours || std::chrono::steady_clock::now() >= until) return;  // rank 0 listens: nobody else can any more
  port_watch_->expires_after(std::chrono::milliseconds(100));
  port_watch_->async_wait([this, round, until](boost::system::error_code ec) {
    if (!ec) check_master_port(round, until);
  });
}

void Agent::retire_store() {
  std::erase_if(retired_stores_, [](const auto& s) { return s->parked() == 0; });
  if (!store_) return;
  store_->retire();
  if (store_->parked() > 0) retired_stores_.push_back(std::move(store_));
  store_.reset();
}

void Agent::hold_master_port(bool fresh) {
  launcher_->drop_exec_fence();  // a release still waiting was for the port this one replaces
  if (!fresh && store_ && store_->port() == plan_.master_port) return;  // the store holds it
  if (!fresh) {
    if (auto r = PortReservation::try_hold(plan_.master_port)) {
      port_hold_ = std::move(r);
      return;
    }
  }
  port_hold_ = reserve_master_port();
  plan_.master_port = port_hold_->port();
}

WorkerOutcome Agent::outcome_of(const WorkerEnd& w) {
  WorkerOutcome o;
  o.rank = w.rank;
  o.local_rank = w.local_rank;
  o.pid = w.pid;
  o.exit_code = shell_exit_code(w.wait_status);
  o.signal = WIFSIGNALED(w.wait_status) ? WTERMSIG(w.wait_status) : 0;
  o.duration_s = w.duration_s;
  return o;
}

void Agent::start_control() {
  control::ServerOptions co;
  co.worker_of = [this](pid_t pid) { return worker_of(pid); };
  co.worker_pid = [this](int lr) -> pid_t {
    for (const auto& w : launcher_->workers())
      if (!w.exited && w.local_rank == lr) return w.pid;
    return 0;
  };
  co.log = [this](const std::string& line) { notice(line); };
  co.max_sessions = shares_.control;
  control::Handlers h;
  h.hello = [this](int lr, const control::Hello& m) {
    if (prestart_pending(lr)) prestart_hello(lr, m);
    else run(core_.worker_hello(lr, m.in_place, now()));
  };
  h.closed = [this](int lr, const std::string& why) {
    if (prestart_pending(lr)) {
      prestart_fall_back(lr, "closed its control connection", /*closed=*/true);
      return;
    }
    run(core_.control_closed(lr, why + process_state(launcher_->workers(), lr), now()));
  };
  h.paused = [this](int lr, const control::Paused& p) {
    trace_instant("paused", "restart", {{"local_rank", lr}, {"step", p.step}});
    run(core_.worker_paused(lr, now()));  // it answered: alive, its Assign may go
  };
  try {
    control_ = std::make_unique<control::Server>(io_, std::move(co), std::move(h));
    base_env_[control::kSocketVar] = control_->address();
  } catch (const std::runtime_error& e) {
    notice(std::string(e.what()) + ": no worker can opt in to in-place recovery in this run");
  }
}

int Agent::worker_of(pid_t pid) const {
  const std::vector<WorkerState> ws = launcher_->workers();
  auto of = [&](pid_t leader) {
    for (const auto& w : ws)
      if (!w.exited && w.pid == leader) return w.local_rank;
    return -1;
  };
  // Up the parent chain (bounded) to a worker, or a process in a worker's process group.
  for (int hop = 0; hop < 64 && pid > 1 && pid != ::getpid(); ++hop) {
    if (int lr = of(pid); lr >= 0) return lr;
    const auto st = read_proc_stat(pid);
    if (!st) return -1;
    if (int lr = of(st->pgrp); lr >= 0) return lr;
    pid = st->ppid;
  }
  return -1;
}

void Agent::assign_worker(const sup::act::Assign& a) {
  const int lr = a.local_rank;
  if (std::string why = serve_store(); !why.empty()) {  // the new attempt's (emptied) store
    notice(fmt::format("local rank {} was paused but the attempt's store cannot serve ({}): killing it", lr, why));
    launcher_->signal_some(SIGKILL, {lr});
    return;
  }
  const std::string dir = attempt_dir(lr);
  std::error_code ec;
  fs::create_directories(dir, ec);
  fs::remove(dir + "/error.json", ec);
  // The same environment a spawned worker of this attempt gets (launcher/plan).
  const EnvMap env = build_contract_env(plan_, opts_, base_env_, lr, a.restart_count, dir + "/error.json");
  launcher_->reassign(lr, plan_.rank_offset + lr, worker_line_prefix(plan_, opts_, lr));
  if (trace_)
    trace_->instant(fmt::format("assign rank {}", plan_.rank_offset + lr), "worker", TraceWriter::worker_tid(lr),
                    {{"rank", plan_.rank_offset + lr}, {"local_rank", lr}, {"attempt", a.restart_count}});
  if (!control_ || !control_->send(lr, control::assign(a.round, a.restart_count, env))) {
    // It can no longer hear of the round: its end is a failure of this attempt.
    notice(fmt::format("local rank {} was paused but its control connection is gone: killing it", lr));
    launcher_->signal_some(SIGKILL, {lr});
  }
}

// ---- --prestart-standby (docs/in-place-recovery.md, "Pre-started workers") ----

void Agent::prestart_workers() {
  if (!opts_.prestart_standby || !prestart_.empty() || !core_.is_standby() || core_.state() != sup::State::kWaiting)
    return;
  if (!control_) {
    notice("--prestart-standby: no control channel (see above): the workers start when this node is given a place");
    return;
  }
  prestart_.assign(static_cast<std::size_t>(plan_.nproc_per_node), {});
  for (int lr = 0; lr < plan_.nproc_per_node; ++lr) prestart_one(lr);
  notice(fmt::format("standby: {} worker(s) started ahead with {}=1 (--prestart-standby); they load and wait for "
                     "this node's place",
                     plan_.nproc_per_node, control::kStandbyVar));
}

void Agent::prestart_one(int lr) {
  WorkerSpec spec = attempt_spec(lr);
  // The round's variables are unknown yet: left out, so that a worker that ignores the
  // marker fails to join any group rather than join a wrong one.
  static const char* const kRoundVars[] = {"RANK",           "GROUP_RANK",      "ROLE_RANK",   "WORLD_SIZE",
                                           "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                                           "TORCHELASTIC_RESTART_COUNT"};
  std::erase_if(spec.env, [](const std::string& kv) {
    const std::string_view name = std::string_view(kv).substr(0, kv.find('='));
    if (name == control::kStandbyVar) return true;
    for (const char* v : kRoundVars)
      if (name == v) return true;
    return false;
  });
  spec.env.push_back(std::string(control::kStandbyVar) + "=1");
  spec.rank = -1;  // none yet
  spec.prefix = fmt::format("[standby{}]:", lr);
  if (worker_nofile_) spec.nofile = &*worker_nofile_;
  if (!bindings_.empty()) spec.cpus = bindings_[static_cast<std::size_t>(lr)].cpus;
  auto placed = std::make_shared<bool>(false);
  const pid_t pid = launcher_->start(std::move(spec), [this, placed](const WorkerEnd& w) {
    if (*placed) on_worker_done(w);
    else prestart_ended(w);
  });
  Prestarted& e = prestart_[static_cast<std::size_t>(lr)];
  e = {};
  e.pid = pid;
  e.started = std::chrono::steady_clock::now();
  e.hello_by = e.started + kPrestartHello;
  e.placed = std::move(placed);
  trace_instant("prestart", "worker", {{"local_rank", lr}, {"pid", pid}});
  prestart_arm();
}

void Agent::prestart_arm() {
  auto next = std::chrono::steady_clock::time_point::max();
  for (const Prestarted& e : prestart_)
    if (e.pid) next = std::min(next, e.stopping ? e.kill_at : e.ready ? next : e.hello_by);
  if (!prestart_timer_) prestart_timer_ = std::make_unique<asio::steady_timer>(io_);
  if (next == std::chrono::steady_clock::time_point::max()) {
    prestart_timer_->cancel();
    return;
  }
  prestart_timer_->expires_at(next);  // (cancels the wait before it)
  prestart_timer_->async_wait([this](boost::system::error_code ec) {
    if (!ec) prestart_due();
  });
}

void Agent::prestart_due() {
  const auto t = std::chrono::steady_clock::now();
  std::vector<int> late;
  bool within_grace = false;  // a worker being stopped whose SIGKILL is not due yet
  for (int lr = 0; lr < static_cast<int>(prestart_.size()); ++lr) {
    Prestarted& e = prestart_[static_cast<std::size_t>(lr)];
    if (!e.pid) continue;
    if (e.stopping && e.kill_at <= t) {
      late.push_back(lr);
      e.kill_at = std::chrono::steady_clock::time_point::max();  // once
    } else if (e.stopping && e.kill_at != std::chrono::steady_clock::time_point::max()) {
      within_grace = true;
    } else if (!e.stopping && !e.ready && e.hello_by <= t) {
      prestart_fall_back(lr, fmt::format("said no hello with \"standby\" within {} s", kPrestartHello.count()));
      within_grace = true;
    }
  }
  if (!late.empty()) {
    notice(fmt::format("pre-started worker(s) of local rank(s) {} still running {:.1f}s after SIGTERM: sending SIGKILL",
                       fmt::join(late, ","), std::chrono::duration<double>(opts_.grace).count()));
    if (finish_after_prestart_ && !within_grace) {
      finish(*finish_after_prestart_);  // SIGKILLs and reaps what is left
      return;
    }
    launcher_->signal_some(SIGKILL, late);
  }
  prestart_arm();
}

bool Agent::prestart_pending(int lr) const {
  return lr >= 0 && lr < static_cast<int>(prestart_.size()) && prestart_[static_cast<std::size_t>(lr)].pid != 0;
}

void Agent::prestart_hello(int lr, const control::Hello& m) {
  Prestarted& e = prestart_[static_cast<std::size_t>(lr)];
  if (e.stopping) return;
  if (!m.in_place || !m.standby) {
    prestart_fall_back(lr, m.in_place ? "said hello without \"standby\" (it cannot wait for a place)"
                                      : "said hello without \"in_place\"");
    return;
  }
  e.ready = true;
  trace_instant("prestart ready", "worker", {{"local_rank", lr}, {"pid", e.pid}});
  prestart_arm();
}

void Agent::prestart_fall_back(int lr, const std::string& why, bool closed) {
  Prestarted& e = prestart_[static_cast<std::size_t>(lr)];
  if (!e.pid || e.stopping) return;
  e.stopping = true;
  e.closed = closed;
  e.ready = false;
  e.kill_at = std::chrono::steady_clock::now() + opts_.grace;  // its own: an earlier one's SIGKILL is not put off
  // (A worker that exits closes its connection first: what follows is said at its end.)
  notice(fmt::format("--prestart-standby: local rank {}'s pre-started worker (pid {}) {}: stopping it{}", lr, e.pid,
                     why, closed ? "" : "; a fresh worker starts when this node is given a place"));
  signal_workers({SIGTERM, false, std::vector<int>{lr}, /*cont=*/true});
  prestart_arm();
}

void Agent::prestart_ended(const WorkerEnd& w) {
  if (file_timer_) file_timer_->process_ended(w.pid);  // its pid is free: its timers and admission go
  for (int lr = 0; lr < static_cast<int>(prestart_.size()); ++lr) {
    Prestarted& e = prestart_[static_cast<std::size_t>(lr)];
    if (e.pid != w.pid) continue;
    const std::string how = WIFSIGNALED(w.wait_status) ? fmt::format("signal {}", signal_name(WTERMSIG(w.wait_status)))
                                                       : fmt::format("exit code {}", shell_exit_code(w.wait_status));
    // Stopped by the agent, for a reason of the agent's (one that closed its connection was
    // most likely ending on its own).
    const bool stopped = e.stopping && (!e.closed || finish_after_prestart_);
    const double lived = std::chrono::duration<double>(std::chrono::steady_clock::now() - e.started).count();
    e = {};
    if (control_) control_->forget(lr);  // no other worker of this local rank runs
    if (stopped) continue;
    // Ended on its own while the node waits (a worker that bounds its wait, a crash): another
    // takes its place ahead, unless it ended soon after its start (it would again).
    if (lived >= std::chrono::duration<double>(kPrestartMinLife).count() && !finish_after_prestart_ &&
        core_.is_standby() && core_.state() == sup::State::kWaiting) {
      notice(fmt::format("--prestart-standby: local rank {}'s pre-started worker (pid {}) ended ({}) after {:.0f} s "
                         "before this node was given a place: starting another",
                         lr, w.pid, how, lived));
      prestart_one(lr);
      continue;
    }
    notice(fmt::format("--prestart-standby: local rank {}'s pre-started worker (pid {}) ended ({}) before this node "
                       "was given a place: a fresh worker starts then",
                       lr, w.pid, how));
  }
  if (finish_after_prestart_ &&
      std::none_of(prestart_.begin(), prestart_.end(), [](const Prestarted& e) { return e.pid != 0; }))
    finish(*finish_after_prestart_);
  else
    prestart_arm();
}

void Agent::prestart_retire(std::vector<int>& keep) {
  for (int lr = 0; lr < static_cast<int>(prestart_.size()); ++lr) {
    Prestarted& e = prestart_[static_cast<std::size_t>(lr)];
    if (!e.pid) continue;
    if (e.ready) {
      keep.push_back(lr);  // handed its place at the core's Spawn
      continue;
    }
    if (!e.stopping)
      notice(fmt::format("--prestart-standby: local rank {}'s pre-started worker (pid {}) said no hello with "
                         "\"standby\" before this node was given a place: killed; a fresh worker takes it",
                         lr, e.pid));
    // Killed, but its handle stays until it ended and its output drained (not dropped live
    // by RetireWorkers); its end finds no entry (prestart_ended) and its `placed` stays
    // false: it is no worker's.
    launcher_->signal_some(SIGKILL, {lr});
    keep.push_back(lr);
    e = {};
  }
  prestart_arm();
}

bool Agent::adopt_prestarted(int lr) {
  if (!prestart_pending(lr)) return false;
  Prestarted& e = prestart_[static_cast<std::size_t>(lr)];
  const pid_t pid = e.pid;
  std::shared_ptr<bool> placed = e.placed;
  e = {};
  prestart_arm();
  if (std::string why = serve_store(); !why.empty()) {  // the attempt's store, as for a spawned worker
    notice(fmt::format("--prestart-standby: local rank {}'s pre-started worker (pid {}) killed: {}", lr, pid, why));
    launcher_->signal_some(SIGKILL, {lr});  // its end finds no entry (prestart_ended): no worker's
    return false;  // a spawn in its place fails with the same reason
  }
  const std::string dir = attempt_dir(lr);
  std::error_code ec;
  fs::create_directories(dir, ec);
  fs::remove(dir + "/error.json", ec);
  const EnvMap env = build_contract_env(plan_, opts_, base_env_, lr, core_.restart_count(), dir + "/error.json");
  if (!control_ || !control_->send(lr, control::assign(core_.round(), core_.restart_count(), env))) {
    notice(fmt::format("--prestart-standby: local rank {}'s pre-started worker (pid {}) lost its control connection: "
                       "killed; a fresh worker takes the place",
                       lr, pid));
    launcher_->signal_some(SIGKILL, {lr});  // its end finds no entry (prestart_ended): no worker's
    return false;
  }
  if (placed) *placed = true;  // from now on a worker of the attempt
  launcher_->reassign(lr, plan_.rank_offset + lr, worker_line_prefix(plan_, opts_, lr));
  notice(fmt::format("local rank {}: the pre-started worker (pid {}) takes rank {}", lr, pid, plan_.rank_offset + lr));
  if (trace_)
    trace_->instant(fmt::format("assign rank {}", plan_.rank_offset + lr), "worker", TraceWriter::worker_tid(lr),
                    {{"rank", plan_.rank_offset + lr}, {"local_rank", lr}, {"pid", pid}, {"prestarted", true},
                     {"attempt", core_.restart_count()}});
  run(core_.worker_hello(lr, /*in_place=*/true, now()));  // it opted in with its hello
  return true;
}

bool Agent::prestart_stop_before_finish(int code) {
  std::vector<int> running, to_stop;
  const auto kill_at = std::chrono::steady_clock::now() + opts_.grace;
  for (int lr = 0; lr < static_cast<int>(prestart_.size()); ++lr) {
    Prestarted& e = prestart_[static_cast<std::size_t>(lr)];
    if (!e.pid) continue;
    running.push_back(lr);
    if (e.stopping) continue;  // stopped already, by its own deadline
    e.stopping = true;
    e.kill_at = kill_at;
    to_stop.push_back(lr);
  }
  if (running.empty()) return true;
  notice(fmt::format("stopping this standby's {} pre-started worker(s): SIGTERM, SIGKILL after {:.1f}s",
                     running.size(), std::chrono::duration<double>(opts_.grace).count()));
  if (!to_stop.empty()) signal_workers({SIGTERM, false, to_stop, /*cont=*/true});
  finish_after_prestart_ = code;
  prestart_arm();
  return false;
}

void Agent::on_worker_done(const WorkerEnd& w) {
  if (file_timer_) file_timer_->process_ended(w.pid);  // its pid is free: its timers and admission go
  if (control_) control_->forget(w.local_rank);  // (its connection ended with it)
  const WorkerOutcome o = outcome_of(w);
  // The core says whether this exit is the root cause (act::WorkerEnded) and asks for its
  // details only then.
  run(core_.worker_ended(o, now(), [&] {
    RootCause rc = worker_root_cause(o, local_hostname(), attempt_dir(o.local_rank) + "/error.json", w.spawn_error,
                                     w.stderr_tail);
    // A module the worker's Python lacks (torch, typically: another python3 first on PATH):
    // which Python ran, and one that has the module, as doctor finds them.
    if (const std::string module = python_run_ ? missing_module(rc.stderr_tail) : std::string(); !module.empty()) {
      const std::string hint = missing_module_hint(
          module, plan_.executable, opts_.python_source,
          python_with_module(module, plan_.executable, python_candidates(base_env_), base_env_));
      rc.message = rc.message.empty() ? hint : hint + "; " + rc.message;
    }
    if (auto hint = libuv_hint(rc.stderr_tail); !hint.empty())
      rc.message = rc.message.empty() ? hint : hint + "; " + rc.message;
    if (auto k = timer_kills_.find(o.local_rank); k != timer_kills_.end()) {
      const std::string why =
          fmt::format("its FileTimer '{}' expired: the agent sent {} to pid {} (TORCHELASTIC_ENABLE_FILE_TIMER)",
                      k->second.scope_id, signal_name(k->second.signal), k->second.pid);
      rc.message = rc.message.empty() ? why : why + "; " + rc.message;
    }
    return rc;
  }));
}

sup::Config Agent::core_config(const AgentOptions& opts, const RunPlan& plan) {
  sup::Config c;
  c.nproc = plan.nproc_per_node;
  c.max_restarts = opts.max_restarts;
  c.grace = opts.grace;
  c.rdzv = uses_rendezvous_server(opts);
  c.port_is_ours = opts.rdzv_backend != "static" || opts.master_port == 0;
  c.master_port = plan.master_port;
  c.node_rank = plan.node_rank;
  c.host = local_hostname();
  c.program = opts.program;
  c.rdzv_where = opts.rdzv_backend == "etcd" ? "etcd at " + opts.rdzv_endpoint : opts.rdzv_endpoint;
  c.join_timeout = opts.join_timeout;
  c.job_id = plan.run_id;
  return c;
}

void Agent::run(sup::Actions actions) {
  for (auto& action : actions) {
    std::visit(
        [&](auto& a) {
          using A = std::decay_t<decltype(a)>;
          if constexpr (std::is_same_v<A, sup::act::Notice>) {
            notice(a.text);
          } else if constexpr (std::is_same_v<A, sup::act::ErrorLine>) {
            error_line(a.text);
          } else if constexpr (std::is_same_v<A, sup::act::PrintRootCause>) {
            console_.write(1, format_root_cause(a.rc, opts_.program));
          } else if constexpr (std::is_same_v<A, sup::act::Trace>) {
            trace_instant(a.name, a.cat, std::move(a.args));
          } else if constexpr (std::is_same_v<A, sup::act::JoinRendezvous>) {
            start_rendezvous();
          } else if constexpr (std::is_same_v<A, sup::act::ApplyAssignment>) {
            apply_assignment(a.a);
          } else if constexpr (std::is_same_v<A, sup::act::AttemptStarted>) {
            if (trace_) attempt_since_us_ = trace_->now();
            if (file_timer_) file_timer_->clear();  // a new attempt starts without timers, as torch's
            timer_kills_.clear();
            last_outcomes_.clear();
            elastic_event("RENDEZVOUS", false, nullptr, nullptr,
                          rdzv_began_ ? std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() -
                                                                                  *rdzv_began_)
                                            .count()
                                      : 0.0);
            rdzv_began_.reset();
          } else if constexpr (std::is_same_v<A, sup::act::AttemptEnded>) {
            if (trace_)
              trace_->complete(fmt::format("attempt {}", a.attempt), "attempt", 0, attempt_since_us_,
                               {{"attempt", a.attempt}, {"failed", a.failed}});
          } else if constexpr (std::is_same_v<A, sup::act::Spawn>) {
            if (!adopt_prestarted(a.local_rank)) spawn_worker(a.local_rank);
          } else if constexpr (std::is_same_v<A, sup::act::OpenExecFence>) {
            launcher_->open_exec_fence();
          } else if constexpr (std::is_same_v<A, sup::act::WatchExecs>) {
            launcher_->watch_execs([this] { run(core_.execs_settled(now())); });
          } else if constexpr (std::is_same_v<A, sup::act::WorkerEnded>) {
            const WorkerOutcome& o = a.o;
            last_outcomes_.push_back(o);
            if (trace_)
              trace_->complete(fmt::format("rank {}", o.rank), "worker", TraceWriter::worker_tid(o.local_rank),
                               trace_->now() - static_cast<std::int64_t>(o.duration_s * 1e6),
                               {{"rank", o.rank}, {"local_rank", o.local_rank}, {"pid", o.pid}, {"attempt", a.attempt},
                                {"exit_code", o.exit_code}, {"signal", o.signal},
                                {"stopped_by_agent", o.stopped_by_agent}});
          } else if constexpr (std::is_same_v<A, sup::act::SpawnMoreLater>) {
            asio::post(io_, [this, gen = a.gen] { run(core_.spawn_batch_due(gen, now())); });
          } else if constexpr (std::is_same_v<A, sup::act::SignalWorkers>) {
            signal_workers(a);
          } else if constexpr (std::is_same_v<A, sup::act::PauseOutputDrains>) {
            launcher_->pause_drains();
          } else if constexpr (std::is_same_v<A, sup::act::ResumeOutputDrains>) {
            launcher_->resume_drains();
          } else if constexpr (std::is_same_v<A, sup::act::StopSelf>) {
            ::kill(::getpid(), SIGSTOP);
          } else if constexpr (std::is_same_v<A, sup::act::ArmTimer>) {
            const sup::Timer t = a.timer;
            clock_->arm(t, a.at, [this, t] { run(core_.timer_fired(t, now())); });
          } else if constexpr (std::is_same_v<A, sup::act::CancelTimer>) {
            clock_->cancel(a.timer);
          } else if constexpr (std::is_same_v<A, sup::act::RetireWorkers>) {
            prestart_retire(a.keep);
            launcher_->retire(a.keep);
          } else if constexpr (std::is_same_v<A, sup::act::AttemptDue>) {
            asio::post(io_, [this] { run(core_.attempt_due(now())); });
          } else if constexpr (std::is_same_v<A, sup::act::HoldMasterPort>) {
            hold_master_port(a.fresh);
          } else if constexpr (std::is_same_v<A, sup::act::ReleaseMasterPort>) {
            launcher_->drop_exec_fence();
            port_hold_.reset();  // the workers may bind the master port now
          } else if constexpr (std::is_same_v<A, sup::act::Rejoin>) {
            rejoin(a.offer_port);
          } else if constexpr (std::is_same_v<A, sup::act::SendWorkerFailed>) {
            client_->worker_failed(a.f);
          } else if constexpr (std::is_same_v<A, sup::act::SendNodeDone>) {
            client_->node_done(a.round);
          } else if constexpr (std::is_same_v<A, sup::act::Pause>) {
            if (!control_ || !control_->send(a.local_rank, control::pause(a.round, a.reason, a.lost))) {
              const int lr = a.local_rank;
              std::string why = "the agent could not send its pause: ";
              if (!control_) why += "no control channel";
              else if (const std::string ended = control_->ended_why(lr); !ended.empty())
                why += "its session had ended (" + ended + ")";
              else why += "it has no session";
              why += process_state(launcher_->workers(), lr);
              asio::post(io_, [this, lr, why] { run(core_.control_closed(lr, why, now())); });
            }
          } else if constexpr (std::is_same_v<A, sup::act::Assign>) {
            assign_worker(a);
          } else if constexpr (std::is_same_v<A, sup::act::CheckStopped>) {
            asio::post(io_, [this] {
              std::vector<int> stopped;  // state T: stopped by a signal (t, a tracer's stop, is not)
              for (const auto& w : launcher_->workers())
                if (const auto st = w.exited || w.pid <= 0 ? std::nullopt : read_proc_stat(w.pid); st && st->state == 'T')
                  stopped.push_back(w.local_rank);
              run(core_.workers_stopped(stopped, now()));
            });
          } else if constexpr (std::is_same_v<A, sup::act::Finish>) {
            if (prestart_stop_before_finish(a.code)) finish(a.code);
          }
        },
        action);
  }
}

void Agent::signal_workers(const sup::act::SignalWorkers& a) {
  for (int sig : {a.sig, a.cont ? SIGCONT : 0}) {  // SIGCONT: a SIGSTOPped worker gets the stop signal now
    if (sig == 0) continue;
    if (a.only) launcher_->signal_some(sig, *a.only);
    else launcher_->signal(sig, a.escaped);
  }
}

void Agent::finish(int code) {
  finish_after_prestart_.reset();
  if (prestart_timer_) prestart_timer_->cancel();
  stop_preflight();
  final_events(code);
  if (monitor_) monitor_->stop();
  boost::system::error_code ec;
  signals_.cancel(ec);
  job_control_.cancel(ec);
  winch_.cancel(ec);
  if (client_) client_->close();
  // The other nodes still hear the decision already queued for them.
  if (embedded_server_) embedded_server_->stop(/*flush=*/true);
  for (auto& s : retired_stores_) s->stop();
  retired_stores_.clear();
  // Its clients are gone with the workers, but for the static form's other nodes: there
  // no rendezvous says when they are done, so the store outlives this node's workers until
  // the others' leave it (torchrun's exit barrier; a rendezvous' "done" waits for every node).
  if (store_ && code == 0 && opts_.rdzv_backend == "static" && opts_.nnodes.max > 1) {
    signals_.async_wait([this](boost::system::error_code e, int) {
      if (e || !store_ || lingering_done_) return;
      lingering_done_ = true;
      clock_->cancel(sup::Timer::kStoreLinger);
      store_->stop();
    });
    linger_store();
  } else if (store_) {
    store_->stop();
  }
  if (file_timer_) file_timer_->stop();  // the pipe removed
  if (health_) health_->stop();
  if (control_) control_->stop();
  // Every worker and what they started killed and reaped; the exec fence dropped.
  launcher_->finish();
  if (std::string text = logs_.finish(code); !text.empty()) notice(text);
  if (!opts_.summary_json.empty()) {
    std::ofstream out(opts_.summary_json);
    out << proto::dump_json(summary(), 2) << "\n";
    if (!out) error_line(fmt::format("cannot write --summary-json '{}'; pick a file you can write", opts_.summary_json));
  }
  if (trace_) {
    trace_instant("exit", "agent", {{"exit_code", code}, {"restarts", core_.restart_count()}});
    trace_->close();
    console_.close_file(trace_fd_);
    trace_.reset();
  }
}

void Agent::start_file_timer() {
  // As torch's LocalElasticAgent: on with TORCHELASTIC_ENABLE_FILE_TIMER=1; the pipe is
  // TORCHELASTIC_TIMER_FILE, else one of its own, and the workers get its path.
  const auto on = base_env_.find("TORCHELASTIC_ENABLE_FILE_TIMER");
  if (on == base_env_.end() || on->second != "1") return;
  auto path = base_env_.find("TORCHELASTIC_TIMER_FILE");
  if (path == base_env_.end() || path->second.empty())
    path = base_env_.insert_or_assign("TORCHELASTIC_TIMER_FILE", ftimer::default_pipe_path()).first;
  ftimer::ServerHooks h;
  h.admit = [this](const ProcStat& st) { return worker_of(st.pid) >= 0; };  // its workers' process trees only
  h.is_worker = [this](pid_t pid) {
    for (const WorkerState& w : launcher_->workers())
      if (w.pid == pid && !w.exited) return true;
    return false;
  };
  h.reap = [this](const ftimer::Expired& e) { reap_expired(e); };
  h.log = [this](const std::string& line) { notice(line); };
  h.event = [this](const std::string& name, const ftimer::Request* r) { watchdog_event(name, r); };
  try {
    file_timer_ = std::make_unique<ftimer::Server>(io_, path->second, std::move(h));
  } catch (const std::runtime_error& e) {
    throw UsageError(e.what());  // it names the variable, the path and the fix
  }
}

void Agent::start_health_check() {
  const auto var = base_env_.find("TORCHELASTIC_HEALTH_CHECK_PORT");
  if (var == base_env_.end()) return;
  int port = 0;
  try {
    port = mon::parse_health_port(var->second);
  } catch (const std::invalid_argument& e) {
    throw UsageError(e.what());  // names the variable and the fix
  }
  try {
    health_ = std::make_unique<mon::HealthServer>(io_, opts_.metrics_host, port, [this] { return monitor_facts(); },
                                                  shares_.health);
  } catch (const std::exception& e) {
    // torchrun never fails a run for its health-check server (the stock one listens on
    // nothing; another program may serve the port, as a cluster's own checker does).
    notice(fmt::format("warning: no health check: {}", e.what()));
    return;
  }
  notice(fmt::format("health check on {}", health_->url()));
}

void Agent::reap_expired(const ftimer::Expired& e) {
  // The timer was admitted for one of this agent's workers or a process of its tree (a
  // setsid() daemon of a worker included: its own group, but still below the agent, a
  // subreaper). As torch's FileTimerServer, the signal goes to that process only (what it
  // started goes with the worker group, at the latest when the attempt ends), and only
  // while it is still the same process: through a pidfd, after checking its start time.
  const int lr = worker_of(e.pid);  // -1: its worker ended since (it lives on below the agent)
  const std::string who = lr >= 0 ? fmt::format("rank {}: ", plan_.rank_offset + lr) : std::string();
  notice(fmt::format("{}FileTimer '{}' expired; sending {} to pid {}", who, e.scope_id, signal_name(e.signal), e.pid));
  if (const int sent = signal_same_process(e.pid, e.start, e.signal); sent != 1) {
    notice(fmt::format("FileTimer '{}': pid {} {}: nothing sent", e.scope_id, e.pid,
                       sent == 0 ? std::string("has ended") : std::string("cannot be signalled: ") + std::strerror(errno)));
    return;
  }
  if (lr >= 0) timer_kills_[lr] = {e.pid, e.signal, e.scope_id};
  ftimer::Request r;
  r.pid = e.pid;
  r.scope_id = e.scope_id;
  r.expiration_time = e.expiration_time;
  r.signal = e.signal;
  watchdog_event("kill worker process", &r);
}

namespace {
// Python's json.dumps of `j` (", " and ": " between items, as torch's Event.serialize()).
std::string python_json(const nlohmann::ordered_json& j) {
  if (j.is_object()) {
    std::string out = "{";
    for (auto it = j.begin(); it != j.end(); ++it) {
      if (it != j.begin()) out += ", ";
      out += nlohmann::json(it.key()).dump() + ": " + python_json(it.value());
    }
    return out + "}";
  }
  if (j.is_array()) {
    std::string out = "[";
    for (std::size_t i = 0; i < j.size(); ++i) out += (i ? ", " : "") + python_json(j[i]);
    return out + "]";
  }
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}
}  // namespace

void Agent::elastic_event(const std::string& state, bool from_worker, const WorkerOutcome* w,
                          nlohmann::json raw_error, std::optional<double> duration_ms,
                          const nlohmann::ordered_json* md_given, const std::string& name) {
  if (opts_.event_log_handler != "console") return;
  // torch's _construct_event: the inner "metadata" is itself a JSON string.
  nlohmann::ordered_json md;
  md["group_world_size"] = plan_.nnodes;
  md["entry_point"] = opts_.program;
  if (w) {
    md["local_rank"] = nlohmann::json::array({w->local_rank});
    md["role_rank"] = nlohmann::json::array({w->rank});
    md["role_world_size"] = nlohmann::json::array({plan_.world_size});
  }
  if (md_given) md = *md_given;
  nlohmann::ordered_json m;
  m["run_id"] = plan_.run_id;
  m["global_rank"] = w ? nlohmann::json(w->rank) : nlohmann::json();
  m["group_rank"] = plan_.node_rank;
  m["worker_id"] = w ? nlohmann::json(std::to_string(w->pid)) : nlohmann::json();
  m["role"] = opts_.role;
  m["hostname"] = local_hostname();
  m["state"] = state;
  m["total_run_time"] =
      std::chrono::duration_cast<std::chrono::seconds>(std::chrono::steady_clock::now() - started_at_).count();
  m["rdzv_backend"] = opts_.rdzv_backend;
  m["raw_error"] = raw_error;
  m["metadata"] = python_json(md);
  m["agent_restarts"] = core_.restart_count();
  m["duration_ms"] = duration_ms ? nlohmann::json(*duration_ms) : nlohmann::json();
  nlohmann::ordered_json e;
  e["name"] = name.empty() ? "torchelastic.worker.status." + state : name;
  e["source"] = from_worker ? "WORKER" : "AGENT";
  e["timestamp"] = std::chrono::duration_cast<std::chrono::milliseconds>(
                       std::chrono::system_clock::now().time_since_epoch())
                       .count();
  e["metadata"] = m;
  console_.write(1, python_json(e) + "\n");
}

void Agent::watchdog_event(const std::string& name, const ftimer::Request* r) {
  // torch's _log_watchdog_event: the event's name is the watchdog's, its state RUNNING.
  nlohmann::ordered_json md;
  md["watchdog_event"] = name;
  if (r) {
    md["worker_pid"] = std::to_string(r->pid);
    md["scope_id"] = r->scope_id;
    md["expiration_time"] = fmt::format("{}", r->expiration_time);
    md["signal"] = std::to_string(r->signal);
  }
  elastic_event("RUNNING", false, nullptr, nullptr, std::nullopt, &md, name);
}

void Agent::final_events(int code) {
  (void)code;
  std::sort(last_outcomes_.begin(), last_outcomes_.end(),
            [](const WorkerOutcome& a, const WorkerOutcome& b) { return a.rank < b.rank; });  // torch's order
  for (const WorkerOutcome& o : last_outcomes_) {
    const std::string state = o.stopped_by_agent ? "TERMINATED" : o.exit_code == 0 ? "SUCCEEDED" : "FAILED";
    nlohmann::json raw = nullptr;
    if (state == "FAILED") {
      std::ifstream in(logs_.attempt_dir(core_.restart_count(), o.local_rank) + "/error.json");
      std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      if (!text.empty()) raw = text;
    }
    elastic_event(state, true, &o, raw, std::nullopt);
  }
  // As torchrun's launcher: SUCCEEDED says the agent's run() returned (its workers may have
  // failed), FAILED that it was stopped (by a signal).
  if (stop_signal_)
    elastic_event("FAILED", false, nullptr, fmt::format("stopped by {}", signal_name(stop_signal_)), std::nullopt);
  else
    elastic_event("SUCCEEDED", false, nullptr, nullptr, std::nullopt);
}

void Agent::linger_store() {
  // Event-driven: the store says when its last client left; one timer for the notice after
  // 2 s, then for the bound.
  const auto t = now().steady;
  clock_->arm(sup::Timer::kStoreLinger, t + std::chrono::seconds(2), [this, t] {
    if (!store_ || lingering_done_) return;
    lingering_said_ = true;
    notice(fmt::format("this node's workers are done; serving the store on port {} until the other nodes' workers "
                       "leave it ({} connections; at most {} s)",
                       store_->port(), store_->clients(), kStoreLingerLimit.count()));
    clock_->arm(sup::Timer::kStoreLinger, t + kStoreLingerLimit, [this] { end_linger(/*timed_out=*/true); });
  });
  store_->when_idle([this] { end_linger(/*timed_out=*/false); });
}

void Agent::end_linger(bool timed_out) {
  if (!store_ || lingering_done_) return;
  lingering_done_ = true;
  if (timed_out && store_->clients() > 0)
    notice(fmt::format("stopping the store on port {} with {} clients of other nodes still connected, after {} s",
                       store_->port(), store_->clients(), kStoreLingerLimit.count()));
  clock_->cancel(sup::Timer::kStoreLinger);
  store_->stop();
  boost::system::error_code ec;
  signals_.cancel(ec);
}

void Agent::wait_signal() {
  signals_.async_wait([this](boost::system::error_code ec, int sig) {
    if (ec) return;
    const bool stops = sig != SIGUSR1 && sig != SIGUSR2;  // the others stop the run
    if (finish_after_prestart_) {
      // The run is over but for the standby's pre-started workers being stopped: another
      // signal does not wait for them (as a second Ctrl-C does not wait for the workers).
      if (!stops) {
        wait_signal();
        return;
      }
      notice(fmt::format("got {} while stopping this standby's pre-started workers: killing them now (SIGKILL)",
                         signal_name(sig)));
      finish(*finish_after_prestart_);  // SIGKILLs and reaps them
      return;
    }
    if (stops && !stop_signal_) stop_signal_ = sig;
    run(core_.signal(sig, now()));
    if (core_.state() != sup::State::kDone || finish_after_prestart_) wait_signal();
  });
}

void Agent::notice(const std::string& text) { console_.write(1, "[mglaunch] " + text + "\n"); }

void Agent::error_line(const std::string& text) { console_.write(1, "mglaunch: error: " + cli::one_line(text) + "\n"); }

void Agent::start_ops() {
  if (!opts_.trace_file.empty()) {
    trace_fd_ = open_output_file(opts_.trace_file, O_TRUNC);
    if (trace_fd_ < 0)
      throw UsageError(fmt::format("--trace '{}' cannot be written: {}; pick a file you can write", opts_.trace_file,
                                   errno == ENXIO ? "a FIFO that no process reads" : std::strerror(errno)));
    trace_ = std::make_unique<TraceWriter>([this](std::string_view text) { console_.write_file(trace_fd_, text); },
                                           ::getpid(), fmt::format("mglaunch {} {}", local_hostname(), plan_.run_id));
    for (int lr = 0; lr < plan_.nproc_per_node; ++lr)
      trace_->thread_name(TraceWriter::worker_tid(lr), fmt::format("local_rank {}", lr));
  }
  const bool sampling = opts_.monitor_s > 0 || !opts_.metrics_json.empty() || opts_.metrics_port >= 0;
  if (!sampling) return;
  mon::MonitorOptions mo;
  mo.interval_s = opts_.monitor_s > 0 ? opts_.monitor_s : 5.0;
  mo.console_line = opts_.monitor_s > 0;
  mo.json_file = opts_.metrics_json;
  mo.metrics_port = opts_.metrics_port;
  mo.metrics_host = opts_.metrics_host;
  mo.metrics_max_connections = shares_.metrics;
  mo.host = local_hostname();
  mo.run_id = plan_.run_id;
  mo.gpu_probe = hardware_->gpu_probe();
  try {
    monitor_ = std::make_unique<mon::AgentMonitor>(io_, console_, std::move(mo), [this] { return monitor_facts(); },
                                                   [this](const std::string& line) { notice(line); });
  } catch (const std::runtime_error& e) {
    throw UsageError(e.what());
  }
  if (monitor_->metrics_port() >= 0) notice(fmt::format("metrics on {}", monitor_->metrics_url()));
}

mon::AgentFacts Agent::monitor_facts() const {
  mon::AgentFacts f;
  f.host = local_hostname();
  f.run_id = plan_.run_id;
  f.node_rank = plan_.node_rank;
  f.round = core_.round();
  f.restarts = core_.restart_count();
  f.max_restarts = opts_.max_restarts;
  for (const WorkerState& w : launcher_->workers()) {
    mon::RankTarget t;
    t.rank = w.rank;
    t.local_rank = w.local_rank;
    t.pid = w.pid;
    t.reaped = w.exited;
    if (!w.exited) t.state = core_.state() == sup::State::kStopping ? "stopping" : "running";
    else t.state = w.wait_status == 0 ? "exited" : "failed";
    f.ranks.push_back(std::move(t));
  }
  return f;
}

void Agent::trace_instant(const std::string& name, const std::string& cat, nlohmann::json args) {
  if (trace_) trace_->instant(name, cat, 0, std::move(args));
}

void Agent::wait_job_control() {
  job_control_.async_wait([this](boost::system::error_code ec, int sig) {
    if (ec) return;
    // SIGTSTP (Ctrl-Z): the workers, then the agent stop; SIGCONT (fg, bg, anyone's): they
    // go on, and the time stopped counts neither against the grace nor the output drains.
    run(core_.job_control(sig, now()));
    if (core_.state() != sup::State::kDone) wait_job_control();
  });
}

void Agent::wait_winch() {
  winch_.async_wait([this](boost::system::error_code ec, int) {
    if (ec) return;
    launcher_->window_changed();
    if (core_.state() != sup::State::kDone) wait_winch();
  });
}

nlohmann::json Agent::summary() const {
  RunRecord run;
  run.run_id = plan_.run_id;
  run.program = opts_.program;
  run.nnodes = plan_.nnodes;
  run.node_rank = plan_.node_rank;
  run.nproc_per_node = plan_.nproc_per_node;
  run.world_size = plan_.world_size;
  run.max_restarts = opts_.max_restarts;
  run.restarts = core_.restart_count();
  run.exit_code = core_.exit_code();
  run.agent_signal = core_.agent_signal();
  run.root_cause = core_.root_cause();
  run.attempts = core_.attempts();
  return summary_json(run);
}

}  // namespace mg
