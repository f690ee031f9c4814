// The Agent's master port and store (launcher/agent.h): holding the port, serving the
// agent's store on it or watching it for rank 0's own store, retiring stores of earlier
// ports, and the static form's node 0 serving the store until the other nodes leave it.
#include "launcher/agent.h"

#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <unordered_set>

#include <fmt/format.h>

#include "cli/errors.h"
#include "process/listeners.h"
#include "process/proc.h"

namespace mg {

namespace asio = boost::asio;

std::string Agent::serve_store() {
  if (!plan_.agent_store || plan_.node_rank != 0) {
    retire_store();
    unlisten_hold();  // the workers (rank 0's TCPStore) bind the port themselves: the hold must not listen
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

void Agent::unlisten_hold() {
  if (port_hold_ && port_hold_->listening() && !port_hold_->stop_listening()) {
    notice(fmt::format("the master port {} could not be held again for the workers: {}; something else may take it "
                       "before rank 0 binds it",
                       port_hold_->port(), std::strerror(errno)));
    port_hold_.reset();
  }
}

void Agent::watch_master_port(bool until_assigned) {
  port_watch_warned_ = false;
  check_master_port(++port_watch_round_, until_assigned ? sup::Clock::time_point::max()
                                                        : now().steady + std::chrono::seconds(60));
}

// Each look runs on the event loop, on the agent's clock (every 100 ms for 60 s): the
// listeners come from the kernel's socket diagnostics (tcp_listeners_on: netlink, the
// listening sockets of this port only), which took 0.1-0.2 ms with 10,000 sockets open, where
// reading /proc/net/tcp and tcp6 (1.5 MB of text) took 265-295 ms (a loaded 2-core machine),
// so a thread would cost more than the look. Only while a listener of this user is not yet
// known to be this run's does it scan the process tree.
void Agent::check_master_port(int round, sup::Clock::time_point until) {
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
                    "2.1, torch 1.x's c10d), the port is only bound from the re-join or just before the workers start "
                    "until it listens, and that process listened there meanwhile; find it (ss -ltnp 'sport = :{}') and run again",
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
  const auto t = now().steady;
  if (ours || t >= until) return;  // rank 0 listens: nobody else can any more
  clock_->arm(sup::Timer::kPortWatch, t + std::chrono::milliseconds(100), [this, round, until] { check_master_port(round, until); });
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
  signals_->cancel(AgentSignals::Set::kStop);
}

}  // namespace mg
