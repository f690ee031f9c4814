// The Agent's rendezvous side (launcher/agent.h): hosting the rendezvous or joining it,
// the takeover socket and taking the job over, the rendezvous' handlers, and the
// preflight network check that the first assignment waits for.
#include "launcher/agent.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <map>
#include <thread>
#include <utility>

#include <boost/asio/post.hpp>
#include <fmt/format.h>

#include "cli/errors.h"
#include "ops/trace.h"
#include "process/thread.h"
#include "proto/wire.h"
#include "rendezvous/auth.h"
#include "rendezvous/endpoint.h"

namespace mg {

namespace asio = boost::asio;

namespace {

// The most a node's first record of a job may hold its first workers back: the io thread
// waits, and sends no heartbeat and (hosting) answers none meanwhile, so at most half the
// bound a node fences itself after (rdzv::fence_after; keep_alive_interval x attempts where
// it does not fence), and 2 s (review s41-a M1: keep_alive_interval=0.5 fenced after 1.25 s).
constexpr std::chrono::milliseconds kFirstRecordWait{2000};
std::chrono::milliseconds first_record_wait(std::chrono::milliseconds keep_alive, int attempts) {
  const std::chrono::milliseconds fence = rdzv::fence_after(static_cast<int>(keep_alive.count()), attempts);
  return std::min(kFirstRecordWait, (fence.count() > 0 ? fence : keep_alive * attempts) / 2);
}

// Test hooks (docs/flags.md): each record write takes MGLAUNCH_RECORD_TEST_WRITE_DELAY_MS more
// (a slow disk, on its helper thread), and the first MGLAUNCH_RECORD_TEST_FAIL_WRITES fail.
JobRecordWriter::Ops with_test_hooks(JobRecordWriter::Ops ops, const std::map<std::string, std::string>& env) {
  auto number = [&](const char* name) {
    const auto it = env.find(name);
    return it == env.end() ? 0 : std::atoi(it->second.c_str());
  };
  const int delay_ms = number("MGLAUNCH_RECORD_TEST_WRITE_DELAY_MS"), fail = number("MGLAUNCH_RECORD_TEST_FAIL_WRITES");
  if (delay_ms <= 0 && fail <= 0) return ops;
  ops.write = [write = ops.write, delay_ms, failing = std::make_shared<int>(fail)](const JobRecord& r) {
    // (On the record's helper thread, never the io thread: a slow fsync blocks there the same way.)
    std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
    if (*failing > 0 && (*failing)-- > 0) return std::string("a test hook's failure (MGLAUNCH_RECORD_TEST_FAIL_WRITES)");
    return write(r);
  };
  return ops;
}

// The line of an agent that could not bind its record's takeover port again (`why`) and bound
// `port` instead. The other nodes' records name the old port, which refuses from now on, and
// a refusal never counts: in a whole job's rerun a node that needs this one's answer for a
// majority waits until join_timeout (review s40-recall M2: 3 voters, the host's port 0).
std::string takeover_port_lost(const std::string& job, const std::string& host, int recorded, const std::string& why,
                               int port) {
  return fmt::format("warning: this node cannot bind its record's takeover port {}:{} again ({}) and listens on {}:{} "
                     "instead: the other nodes' records of job '{}' name the old port, which now refuses, so in a "
                     "rerun of the whole job a node that needs this node's answer to find its record stale waits until "
                     "join_timeout (exit 3); their next records name the new port",
                     host, recorded, why, host, port, job);
}

}  // namespace

void Agent::host_rendezvous() {
  // A record of this job: the link looks for it at the record's hosts first, and this node
  // hosts only once none runs it (rdzv::ClientHandlers::on_recall_ended).
  if (hosting_decided_ || recall_pending_) return;
  hosting_decided_ = true;
  const std::optional<rdzv::Endpoint> hosted = endpoint_to_host();
  if (!hosted) return;
  const rdzv::Endpoint& ep = *hosted;
  try {
    rdzv::ServerOptions so = server_options();
    so.host = ep.host;
    so.port = ep.port;
    so.before_send = [this](const rdzv::Actions& actions, rdzv::SessionId own) { record_ahead(actions, own); };
    embedded_server_ = std::make_unique<rdzv::Server>(io_, so);
    notice(fmt::format("hosting the rendezvous for job '{}' on {}", plan_.run_id, embedded_server_->address()));
    // Its takeover socket (kept after a stale recall) answers "not hosting" only: not the
    // descriptor share that the hosting server holds again (review s39-listen L3).
    if (takeover_server_) vote_socket_only();
  } catch (const std::exception&) {
    // Another local agent got there first: join it as a client.
  }
}

std::optional<rdzv::Endpoint> Agent::endpoint_to_host() const {
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
  if (!meant || rdzv::probe_listen(endpoint().host, endpoint().port)) return std::nullopt;
  return endpoint();
}

const std::string& Agent::agent_id() {
  if (agent_id_.empty()) agent_id_ = new_agent_id(local_hostname(), ::getpid());
  return agent_id_;
}

rdzv::ServerOptions Agent::server_options() {
  rdzv::ServerOptions so;
  so.token = opts_.rdzv_token;
  so.only_job = plan_.run_id;
  so.host_agent = local_hostname();
  so.host_agent_id = agent_id();  // only its own Join's vote port is listed (review s41-b M1)
  so.max_connections = shares_.rendezvous;  // its share of the agent's descriptors (check_descriptor_budget)
  so.log = [this](const std::string& line) {
    // Warnings, and a round that waits for a majority of the voters (#34: this side of a
    // partition runs nothing until then), reach the run's output.
    if (line.starts_with("warning:") || line.find(" waits for a majority of the job's ") != std::string::npos)
      notice("rendezvous server: " + line);
  };
  // The round this node's server opens waits for a majority of the voters, and the server
  // hears no majority (the nodes told to restart that still beat count: their workers may
  // be slow to stop): its link looks for the job at the other hosts after a grace
  // (rdzv::ClientMachine, "Seeking", #34). Asked again whenever the answer may turn: at
  // each node lost (a node told to restart too, silent or closed) and each standby lost
  // (review s36 M1); posted, not from within the server's own call. And every K while this
  // node waits for a next round (ClientHandlers::hears_majority, review s37 M).
  so.on_event = [this](const rdzv::JobEvent& e) {
    using K = rdzv::JobEvent::Kind;
    if (e.kind == K::kNoQuorum || e.kind == K::kNodeLost || e.kind == K::kStandbyLost)
      asio::post(io_, [this] {
        if (client_ && embedded_server_ && !embedded_server_->hears_majority(plan_.run_id))
          client_->host_short_of_majority();
      });
  };
  if (so.token.empty() && !opts_.rdzv_job_token.empty()) so.job_tokens[plan_.run_id] = opts_.rdzv_job_token;
  return so;
}

void Agent::bind_takeover_socket() {
  // (Hosting, too: its vote socket, where another node's recall counts this one: review
  // s40-recall M1. It answers "not hosting" only, in its share of handshakes.)
  if (takeover_server_ || takeover_refused_) return;
  // Only on the advertised address, where the others will look for this node (its Join's
  // addr): a name is resolved here, and the first of its IPv4 addresses that is this
  // machine's is bound. None: this node cannot take over, and says so once.
  std::string why;
  // The port of this node's record first (its last run's): the record of every other node of
  // the job names it, and a whole job rerun at once finds this node alive there (review s38
  // M2); taken (or none): any free port.
  const int recorded_port = recalled_ ? recalled_->takeover_port : 0;
  auto bind_at = [&](in_addr_t addr, int port) {
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
      why = std::strerror(errno);
      return -1;
    }
    // (The last run's connections in TIME_WAIT do not hold its port: Linux lets a socket
    // bind over them only when theirs had SO_REUSEADDR too, so every takeover socket sets it,
    // the first one on a port of the kernel's choice as well.)
    const int on = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &on, sizeof on);
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    sa.sin_addr.s_addr = addr;
    sa.sin_port = htons(static_cast<std::uint16_t>(port));
    socklen_t len = sizeof sa;
    if (::bind(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa) != 0 ||
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&sa), &len) != 0) {
      why = std::strerror(errno);
      ::close(fd);
      return -1;
    }
    char text[INET_ADDRSTRLEN] = {};
    ::inet_ntop(AF_INET, &sa.sin_addr, text, sizeof text);
    takeover_port_ = ntohs(sa.sin_port);
    takeover_host_ = text;
    return fd;
  };
  // It listens from now on, answering "alive, not hosting" (proto::NotHosting) until it hosts.
  auto try_bind = [&](in_addr_t addr) {
    int fd = recorded_port > 0 && recorded_port < 65536 ? bind_at(addr, recorded_port) : -1;
    const std::string lost = fd < 0 && recorded_port > 0 ? why : "";  // the recorded port's error
    if (fd < 0) fd = bind_at(addr, 0);
    if (fd < 0) return false;
    // Said once the socket listens (review s41-a L3: a server that failed to start here said
    // "listens on" a port it never did, and the next address said it again).
    const std::string lost_line =
        lost.empty() ? "" : takeover_port_lost(plan_.run_id, takeover_host_, recorded_port, lost, takeover_port_);
    try {
      rdzv::ServerOptions so = server_options();
      so.host = takeover_host_;
      so.adopt_fd = fd;
      so.not_hosting = true;
      takeover_server_ = std::make_unique<rdzv::Server>(io_, so);
      if (embedded_server_) vote_socket_only();
      // Recalling: its answers say so, with the record's run and epoch, never "in no run"
      // (another node's recall counts it as in no round after that epoch; review s39 H1).
      if (recall_pending_ && recalled_) takeover_server_->tell_recalling(recalled_->run, recalled_->epoch);
    } catch (const std::exception& e) {
      why = e.what();
      takeover_port_ = 0;
      return false;
    }
    if (!lost_line.empty()) notice(lost_line);
    return true;
  };
  auto ipv4_of = [](const rdzv::Addresses& found) {
    std::vector<in_addr_t> out;
    for (const auto& ep : found.found)
      if (ep.address().is_v4()) out.push_back(htonl(ep.address().to_v4().to_uint()));
    return out;
  };
  auto in_loopback_net = [](in_addr_t a) { return (ntohl(a) >> 24) == 127; };
  // A job whose endpoint is off this machine's loopback net is reached over a real network:
  // a loopback address of the name (Debian's hosts file maps the host name to 127.0.1.1) is
  // then no address the others can reach, and the address this machine reaches the endpoint
  // from is bound instead (the route's source address: a UDP connect sends nothing). The
  // addresses were looked up before (look_up_takeover_addresses).
  const std::vector<in_addr_t> endpoint_ips = ipv4_of(takeover_addresses_->endpoint), own = ipv4_of(takeover_addresses_->own);
  const bool over_network = !endpoint_ips.empty() && !in_loopback_net(endpoint_ips.front());
  if (own.empty() && !takeover_addresses_->own.error.empty()) {
    why = takeover_addresses_->own.error;
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
  if (!embedded_server_)
    notice(fmt::format("this node cannot take the rendezvous over if its host is lost: its advertised address '{}' "
                       "cannot be bound here ({}); give --local_addr an IPv4 address of this machine",
                       plan_.master_addr, why));
  else  // (the host's vote socket, review s41-c L3: said, not silent)
    notice(fmt::format("warning: this node hosts job '{}' but cannot bind its vote socket on its advertised address "
                       "'{}' ({}): the recalls of restarted nodes cannot count this host, so in a rerun of the whole "
                       "job a node that needs its answer waits until join_timeout (exit 3), and if this node stops "
                       "hosting it cannot take the job over; give --local_addr an IPv4 address of this machine",
                       plan_.run_id, plan_.master_addr, why));
}

rdzv::TakeoverHost Agent::take_over(const rdzv::TakeoverSeed& seed) {
  if (embedded_server_ || !takeover_server_) return {};
  try {
    // The socket listening since the start serves the job from now on: no connect refused.
    embedded_server_ = std::move(takeover_server_);
    embedded_server_->take_over(plan_.run_id, seed);
  } catch (const std::exception& e) {
    // The server has accepted since the start: its aborted handlers still run on io_, so it
    // is stopped now and freed after them, as on_stop_hosting does (review s39 L6).
    embedded_server_->stop();
    asio::post(io_, [server = std::shared_ptr<rdzv::Server>(std::move(embedded_server_))] {});
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

bool Agent::look_up_takeover_addresses() {
  if (opts_.rdzv_backend == "etcd" || takeover_server_ || takeover_refused_ || takeover_addresses_)
    return false;
  if (!lookups_) lookups_ = std::make_unique<rdzv::Lookups>(io_);
  if (lookups_->pending() > 0) return true;  // under way: start_rendezvous() follows
  auto got = std::make_shared<TakeoverAddresses>();
  auto step = [this, got] {
    if (--got->left > 0 || core_.state() == sup::State::kDone) return;
    takeover_addresses_ = *got;
    start_rendezvous();
  };
  std::string endpoint_host;
  if (!opts_.rdzv_endpoint.empty()) {
    try {
      endpoint_host = rdzv::parse_endpoint(opts_.rdzv_endpoint, 29400).host;
    } catch (const std::exception&) {
    }
  }
  got->left = endpoint_host.empty() ? 1 : 2;
  if (!endpoint_host.empty())
    lookups_->start(endpoint_host, 0, rdzv::kLookupBound, [got, step](rdzv::Addresses a) {
      got->endpoint = std::move(a);
      step();
    }, AF_INET);
  lookups_->start(plan_.master_addr, 0, rdzv::kLookupBound, [got, step](rdzv::Addresses a) {
    got->own = std::move(a);
    step();
  }, AF_INET);
  return true;
}

void Agent::start_rendezvous() {
  // First the takeover socket's addresses, off the io thread; this runs again once they are in.
  if (look_up_takeover_addresses()) return;
  if (trace_) rdzv_since_us_ = trace_->now();
  rdzv_began_ = now().steady;
  host_rendezvous();  // done at start() already
  proto::Join j;
  j.job_id = plan_.run_id;
  j.host = local_hostname();
  j.addr = plan_.master_addr;  // the address this node advertises
  j.agent_id = agent_id();
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
  // Every node that does not host can take the job over if its host is lost (#26); the host's
  // socket is its vote socket only (never a takeover candidate: its takeover port is 0).
  if (opts_.rdzv_backend != "etcd") bind_takeover_socket();
  settle_recall();
  j.takeover_port = embedded_server_ ? 0 : takeover_port_;
  j.vote_port = embedded_server_ ? takeover_port_ : 0;
  rdzv::ClientHandlers h;
  h.on_assignment = [this](const proto::Assignment& a) {
    guarded([&] {
      end_recall();
      // This node's first record of the job is written before its first workers start (an
      // agent killed in between would restart with none and host a fresh job beside the
      // survivors: #34); every later one after they start, off a restart's path (643b029: an
      // older record is still a sound majority rule, so a later write lost costs nothing).
      const bool later = record_on_disk_ || record_hung_;
      if (!later) remember_job(a.epoch, a.run);
      on_assignment(a);
      if (later) remember_job(a.epoch, a.run);
    });
  };
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
      end_recall();
      run(core_.standby(s, now()));
      remember_job(s.epoch, s.run);
      if (opts_.prestart_standby)
        run_prestart(prestart_.begin(core_.is_standby() && core_.state() == sup::State::kWaiting, control_ != nullptr,
                                     now()));
    });
  };
  h.on_lost = [this, after_preflight](const std::string& why) {
    after_preflight([this, why] { run(core_.rendezvous_lost(why, now())); });
  };
  h.on_notice = [this](const std::string& text) { notice("rendezvous: " + text); };
  h.on_take_over = [this](const rdzv::TakeoverSeed& seed) { return take_over(seed); };
  // The job runs elsewhere with a majority: this node's server stops at once (no round of
  // its own can open from now on) and is destroyed once the calls on the stack returned.
  h.hears_majority = [this] { return !embedded_server_ || embedded_server_->hears_majority(plan_.run_id); };
  h.on_stop_hosting = [this](const std::string&) {
    if (!embedded_server_) return;
    embedded_server_->stop();
    asio::post(io_, [this] { embedded_server_.reset(); });
  };
  // etcd proves nothing with the rendezvous token: say so rather than let its holder think
  // the decisions it reads are authenticated.
  if (opts_.rdzv_backend == "etcd" && (!opts_.rdzv_token.empty() || !opts_.rdzv_job_token.empty()))
    notice("warning: --rdzv_backend=etcd does not use the rendezvous token: whoever can write this job's keys in "
           "etcd decides for it; protect them with etcd's own authentication (--rdzv_conf user=, cert=, https)");
  h.on_recall_ended = [this] {
    recall_pending_ = false;
    if (record_io_ && recalled_) record_io_->discard(*recalled_);  // stale: this node starts afresh (review s39 M1)
    if (takeover_server_) takeover_server_->tell_run({});  // a fresh node now, in no run yet
    host_rendezvous();
    // Hosting now, it offers no takeover port (its Join's is 0); the takeover socket stays,
    // answering "alive, not hosting" (in this run, or none): the recall of another node of
    // the last run may still count on it (a loopback endpoint that this node got first).
    return embedded_server_ != nullptr;
  };
  // Welcomed by the run's host, this node is a node of that run from now on: its takeover
  // socket says so, not "recalling" (another restarted node's recall must not count it as in
  // no round of the run, review s39-late H3).
  h.on_recall_welcomed = [this](const std::string& run) {
    if (takeover_server_) takeover_server_->tell_run(run);
  };
  client_ = make_link_(io_, opts_, std::move(j), std::move(h));
  recall_job();
  client_->start();
}

void Agent::load_job_record() {
  if (!uses_rendezvous_server(opts_) || opts_.rdzv_backend == "etcd") return;  // etcd: no host to lose
  auto env = [this](const char* name) {
    const auto it = base_env_.find(name);
    return it == base_env_.end() ? std::string() : it->second;
  };
  const std::string dir = job_record_dir(env("MGLAUNCH_RECORD_DIR"), env("XDG_RUNTIME_DIR"), ::geteuid());
  record_node_ = node_identity(plan_.master_addr, local_hostname());  // (master_addr: this node's, until assigned)
  record_endpoint_ = job_endpoint(opts_.rdzv_backend, opts_.rdzv_endpoint);
  std::string why;
  record_dir_ = JobRecordDir::open(dir, &why);
  if (!record_dir_) {
    notice(fmt::format("warning: this node keeps no record of job '{}' ({}): an agent restarted here while the job "
                       "runs on elsewhere cannot find it again; set MGLAUNCH_RECORD_DIR to a directory of your own",
                       plan_.run_id, why));
    return;
  }
  // Its own slot (review s41-c M1): agents of this job on this machine that advertise one
  // address keep one record each, and a slot held is a live agent's, never recalled.
  record_slot_ = record_dir_->claim(plan_.run_id, record_node_, record_endpoint_, &why);
  if (!record_slot_)
    throw RendezvousError(fmt::format("this node cannot keep its record of job '{}': {}", plan_.run_id, why));
  recalled_ = record_dir_->read(plan_.run_id, record_node_, record_endpoint_, &why, record_slot_->slot);
  // A record it cannot read may be of a job that runs on elsewhere: a fresh start could fork
  // it, so this node ends instead (review s39-late L1).
  if (!why.empty())
    throw RendezvousError(fmt::format(
        "this node has a record of job '{}' that it cannot use ({}), and without it a fresh start could fork a job "
        "that runs on elsewhere; if the job is over (or to start afresh), remove that file and start again",
        plan_.run_id, why));
  auto ops = with_test_hooks(JobRecordWriter::ops_of(record_dir_), base_env_);
  if (record_slot_->lock.get() < 0) ops.release = nullptr;  // (never a lock file it does not hold)
  record_io_ = std::make_unique<JobRecordWriter>(std::move(ops));
  record_io_->hold(std::move(record_slot_->lock));  // (as long as its thread: review s41-d L2)
  // A failed write is told when it fails, not at the next write, which may never come (a
  // round that runs for days): the fork guard is off, and the operator hears it (review s40 M2).
  record_io_->on_failure([this] { asio::post(io_, [this] { warn_record_failure(); }); });
  record_io_->sweep();  // what killed agents left: their temporary files (never a record, review s39 M1)
  // The endpoint, where this node is to host and nothing listens: this node itself, which
  // hosts no run of the job now (a whole job rerun at once: review s38 M2). Its own takeover
  // address is settled once bound (settle_recall()).
  if (const auto own = endpoint_to_host(); recalled_ && own)
    std::erase(recalled_->hosts, std::pair<std::string, int>{own->host, own->port});
  if (recalled_ && recalled_->hosts.empty()) say_record_names_only_self();
  recall_pending_ = recalled_ && !recalled_->hosts.empty() && !recalled_->run.empty();
}

void Agent::say_record_names_only_self() {
  notice(fmt::format("this node's record of job '{}' (run {}), {}, names only this node itself (its endpoint, where "
                     "nothing listens, or its own takeover address): starting afresh",
                     plan_.run_id, recalled_->run, record_path()));
}

std::string Agent::record_path() const {
  return job_record_path(record_dir_->path(), plan_.run_id, record_node_, record_endpoint_,
                         record_slot_ ? record_slot_->slot : 0);
}

void Agent::vote_socket_only() {
  // The takeover socket of a hosting agent never hosts: a few handshakes at once, and an older
  // client's Hello answered at once, never held (review s41-c L2).
  takeover_server_->limit_connections(sup::kRendezvousHandshakes);
  takeover_server_->answer_older_hellos();
}

void Agent::settle_recall() {
  if (!recall_pending_) return;
  // This node's own takeover address answers "recalling" and would count twice (review
  // s39-late H1): never a target. Its record's port bound again, this node is that record's
  // writer's successor (a live writer holds it) and counts itself when the record says it
  // was a voter; else not, and the recorded address stays a target: whoever holds it may be
  // a live node of the run, whose "a node of R" must be heard (review s41-c M1).
  const bool rebound = recalled_->takeover_port == 0 || takeover_port_ == recalled_->takeover_port;
  recalled_->self_voter = recalled_->self_voter && rebound;
  if (takeover_port_ > 0)
    for (auto* l : {&recalled_->hosts, &recalled_->voter_hosts})
      std::erase(*l, std::pair<std::string, int>{plan_.master_addr, takeover_port_});
  if (!recalled_->hosts.empty()) return;
  say_record_names_only_self();
  recall_pending_ = false;
  if (takeover_server_) takeover_server_->tell_run({});  // a fresh node, in no run yet
  host_rendezvous();
}

void Agent::recall_job() {
  if (!recall_pending_) return;
  // The hosts are tried in passes until one runs the job (joined), or every one answered in
  // one pass that no host of the run is there (a fresh start), or join_timeout (exit 3):
  // silence and refusals prove nothing (rdzv::ClientMachine's Recall, review s38 H1b).
  const std::string path = record_path();
  notice(fmt::format("this node has a record of job '{}' (run {}) from its agent's last run, {}: looking for the job "
                     "at the {} host(s) it names before starting afresh, until each answers that the run is over (at "
                     "most join_timeout, {} s, then exit 3); remove that file to start afresh at once",
                     plan_.run_id, recalled_->run, path, recalled_->hosts.size(), opts_.join_timeout.count() / 1000.0));
  client_->recall(recalled_->hosts, recalled_->run, now().steady + opts_.join_timeout, recalled_->epoch, path,
                  recalled_->voters, recalled_->voter_hosts, recalled_->self_voter);
}

void Agent::end_recall() {
  // A recall under way ends with an assignment or standby: the job was found where it runs,
  // so this agent never hosts it at the endpoint (review s38 L4: the recall's block on
  // host_rendezvous() was never lifted; now it is, and hosting is decided: not here).
  if (std::exchange(recall_pending_, false)) hosting_decided_ = true;
}

void Agent::remember_job(int epoch, const std::string& run) {
  if (takeover_server_ && !run.empty()) takeover_server_->tell_run(run);  // its NotHosting names the run
  if (!record_io_ || !client_ || run.empty()) return;
  write_record(epoch, run,
               {client_->job_hosts(), client_->job_voters(), client_->job_voters_epoch(), client_->job_self_voter(),
                client_->job_voter_hosts(), client_->job_epoch()});
}

void Agent::record_ahead(const rdzv::Actions& actions, rdzv::SessionId own) {
  // The hosting agent's first record, from its own Assignment (the one to its own agent id),
  // before its server sends the round to the others (review s41-a M2): else the others' workers
  // may run while this node, killed, would restart with no record and host a fresh job. Or from
  // its own Standby (to its own session, `own`): others that filled the round before its own
  // Join run workers as well (review s41-d M1).
  if (record_on_disk_ || record_hung_ || !record_io_ || !client_ || agent_id_.empty()) return;
  for (const auto& o : actions) {
    if (own != 0 && o.session == own && proto::type_of(o.frame) == proto::MsgType::kStandby) {
      const auto s = proto::from_frame<proto::Standby>(proto::frame_of(o.frame));
      if (s.run.empty()) continue;
      if (const auto fields = client_->record_after(s)) write_record(s.epoch, s.run, *fields);
      return;
    }
    if (proto::type_of(o.frame) != proto::MsgType::kAssignment) continue;
    const auto a = proto::from_frame<proto::Assignment>(proto::frame_of(o.frame));
    if (a.run.empty() || a.group_rank < 0 || a.group_rank >= static_cast<int>(a.voters.size()) ||
        a.voters[a.group_rank] != agent_id_)
      continue;  // another node's (or unlisted voters: this node's own Assignment writes it, after)
    if (const auto fields = client_->record_after(a)) write_record(a.epoch, a.run, *fields);
    return;
  }
}

void Agent::write_record(int epoch, const std::string& run, rdzv::RecordFields f) {
  // Every field named, in order (clang 18+ warns on a missing one: -Wmissing-field-initializers).
  JobRecord r{.job = plan_.run_id,
              .node = record_node_,
              .endpoint = record_endpoint_,
              .run = run,
              // The newest epoch this node was told (the voters' with them: review s40 L1): a
              // Standby of an older one told since lowers it never (review s41-b L3).
              .epoch = std::max(epoch, f.epoch),
              .hosts = std::move(f.hosts),
              .takeover_port = takeover_port_,
              .voters = f.voters,
              .voter_hosts = std::move(f.voter_hosts),
              .self_voter = f.self_voter,
              .slot = record_slot_ ? record_slot_->slot : 0};
  if (r.hosts.empty()) return;  // a daemon's job: found again at its address
  record_io_->write(std::move(r));  // (its helper thread)
  // Until one record is on disk, each is waited for before the workers start (a few ms; at
  // most first_record_wait(), then one warning line): this node killed meanwhile would restart
  // as a fresh one. A write that failed is said now, before the workers (review s41-a L1).
  // After one that did not land in time (a hung file system) no more waits: they would each
  // cost as much.
  if (record_on_disk_ || record_hung_) return;
  const auto wait = first_record_wait(opts_.keep_alive_interval, opts_.keep_alive_max_attempt);
  if (!record_io_->drain_for(wait)) {
    record_hung_ = true;
    return notice(fmt::format("warning: this node's first record of job '{}' is not written after {} s (a hung file "
                              "system?): going on, though this node's fork guard is off until it is written: an "
                              "agent restarted here before then starts afresh",
                              plan_.run_id, wait.count() / 1000.0));
  }
  record_on_disk_ = record_io_->on_disk();
  if (!record_on_disk_) warn_record_failure();
}

void Agent::warn_record_failure() {
  if (!record_io_) return;
  if (std::string why = record_io_->take_error(); !why.empty() && !std::exchange(record_warned_, true))
    notice(fmt::format("warning: cannot keep this node's record of job '{}' ({}): an agent restarted here while the "
                       "job runs on elsewhere may not find it again",
                       plan_.run_id, why));
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
    notice(fmt::format("the preflight check did not stop within {} s of being told to: "
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
  // The re-join's watch (rejoin()) is node 0's of its own port; serve_store() starts the spawn's.
  if (a.group_rank != 0 || a.master_port != plan_.master_port) ++port_watch_round_;
  plan_.nnodes = a.group_world_size;
  plan_.node_rank = a.group_rank;
  plan_.rank_offset = a.rank_offset;
  plan_.world_size = a.world_size;
  plan_.master_addr = a.master_addr;
  plan_.master_port = a.master_port;
  plan_.nodes = a.nodes;
  plan_.epoch = a.epoch;
  plan_.run = a.run;
  if (trace_)
    trace_->complete(fmt::format("rendezvous round {}", a.round), "rendezvous", 0, rdzv_since_us_,
                     {{"round", a.round}, {"node_rank", a.group_rank}, {"nnodes", a.group_world_size},
                      {"world_size", a.world_size}, {"restart_count", a.restart_count},
                      {"master", fmt::format("{}:{}", a.master_addr, a.master_port)}});
}

void Agent::rejoin(bool offer_port) {
  // The core held a fresh master port for the new round (when the port is ours). Where the
  // workers host the store, the hold stops listening before the port is offered: once the
  // round is decided another node's worker (a pre-started standby's, placed at once) may
  // connect before this node's paused worker answered, and stop_listening() then (at the
  // assign) reset every connection queued on it: torch 1.13's store thread aborted (exit
  // 134). Refused instead, a store client retries until rank 0's TCPStore listens.
  // Bound but not listening, another user can bind and listen beside it until rank 0's
  // TCPStore listens: watched from now, not only from the spawn (review s41-e M3).
  if (offer_port && !plan_.agent_store) {
    unlisten_hold();
    watch_master_port(/*until_assigned=*/true);
  }
  if (offer_port) client_->set_master_port(plan_.master_port);
  if (trace_) rdzv_since_us_ = trace_->now();
  rdzv_began_ = now().steady;
  client_->rejoin();
}

}  // namespace mg
