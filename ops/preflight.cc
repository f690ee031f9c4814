#include "ops/preflight.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <optional>
#include <set>
#include <stdexcept>
#include <thread>
#include <utility>

#include <fmt/format.h>

#include "ops/preflight_net.h"
#include "ops/preflight_verdict.h"
#include "process/fd.h"
#include "process/thread.h"
#include "rendezvous/auth.h"
#include "rendezvous/lookup.h"

namespace mg::preflight {

namespace {

using std::chrono::milliseconds;
namespace auth = mg::rdzv::auth;

// How much longer than the coordinator a node waits for its word: the coordinator's own
// time-out (a node that never came) must reach the others before theirs.
constexpr std::chrono::milliseconds kGrace{2000};
// How long the coordinator's lookups of the nodes' names may take in all (of_node).
constexpr std::chrono::milliseconds kNamesBound{2000};

// One node's run; see the header for the steps.
class Node {
 public:
  explicit Node(const Options& o) : o_(o), n_(static_cast<int>(o.nodes.size())), t0_(Clock::now()) {
    deadline_ = t0_ + o.timeout;
    data_deadline_ = t0_ + o.timeout * 7 / 10;  // the data steps end first: reports still arrive
    report_.rank = o.rank;
    report_.reached = true;
    // The check's own key, bound to its job and round: its proofs can never stand in for
    // the rendezvous' (the same functions over K_J), nor for another round's check.
    if (!o.key.empty()) key_ = auth::hmac_sha256_hex(o.key, "mglaunch-preflight:" + o.job);
  }

  Result run() {
    try {
      steps();
    } catch (const nlohmann::json::exception& e) {  // a field of the wrong type from a peer
      local_failure(fmt::format("{} got a malformed message: {}", node_name(o_.rank, o_.nodes), e.what()));
    }
    // Whatever happened, the verdict says something (an empty one read "error: ; fix ...").
    if (result_.line.empty()) local_failure(fmt::format("{} ended the check without a verdict", node_name(o_.rank, o_.nodes)));
    return std::move(result_);
  }

 private:
  double elapsed() const { return std::chrono::duration<double>(Clock::now() - t0_).count(); }

  void steps() {
    if (!listen()) {
      local_failure(fmt::format("{} cannot listen for its peers: {}", node_name(o_.rank, o_.nodes), error_));
      return;
    }
    if (o_.rank == 0 ? !gather_hellos() : !hello()) return;
    connect_peers();
    if (!settle_connections()) return;
    accept_peers();
    if (report_.errors.empty()) allreduce();
    if (report_.errors.empty()) bandwidth();
    report_.reported = true;
    finish();
  }

  void local_failure(const std::string& what) {
    result_.ok = false;
    result_.line = fmt::format("preflight failed after {:.2f} s: {}", elapsed(), what);
    result_.seconds = elapsed();
    result_.reports = nlohmann::json::array({to_json(report_)});
  }

  bool listen() {
    data_listener_ = listen_on(o_.nodes[static_cast<std::size_t>(o_.rank)], 0, false, data_port_, error_, deadline_,
                               o_.cancel_fd);
    if (!data_listener_) return false;
    if (o_.unreachable) data_listener_.reset();  // test hook: the port it announces refuses
    if (o_.rank == 0) {
      if (o_.coordinator_fd >= 0) {
        coord_fd_ = o_.coordinator_fd;
        ::listen(coord_fd_, kBacklog);  // its queue as long as our own listeners', whoever made it
      } else {
        int port = 0;
        coord_listener_ = listen_on("", o_.coordinator_port, /*reuse=*/true, port, error_, deadline_, o_.cancel_fd);
        if (!coord_listener_) {
          error_ = fmt::format("MASTER_PORT {}: {}", o_.coordinator_port, error_);
          return false;
        }
        coord_fd_ = coord_listener_.get();
      }
    }
    return true;
  }

  // Rank 0: every other node's hello (job, rank, data port; with a key, then its proof of
  // it), then the port table. Connections are served side by side (admit()): one that
  // never says a valid hello, or fails the proof, is dropped and takes no node's place.
  bool gather_hellos() {
    ports_.assign(static_cast<std::size_t>(n_), 0);
    ports_[0] = data_port_;
    ctl_.resize(static_cast<std::size_t>(n_));
    secret_ = auth::random_hex(kTagBytes / 2);
    int missing = n_ - 1;
    auto step = [&](Pending& p) {
      bool bad = false;
      auto m = pending_msg(p, bad);
      if (bad) return Step::kDrop;
      if (!m) return Step::kMore;
      if (p.stage == 0) {
        if (m->value("t", "") != "hello" || m->value("job", "") != o_.job) return Step::kDrop;  // not one of ours
        p.rank = m->value("rank", -1);
        p.port = m->value("port", 0);
        if (p.rank <= 0 || p.rank >= n_) return Step::kDrop;
        if (key_.empty()) return claim(p, missing);
        if (ctl_[static_cast<std::size_t>(p.rank)]) return Step::kDrop;
        // The rendezvous' handshake (rendezvous/auth.h) under the check's key: our proof
        // over both nonces, then theirs.
        p.client_nonce = m->value("nonce", "");
        if (p.client_nonce.size() != 64) return Step::kDrop;
        p.server_nonce = auth::random_hex(32);
        std::string err;
        p.stage = 1;
        return p.in.empty() && send_msg(p.fd.get(), nullptr,
                                        {{"t", "challenge"}, {"nonce", p.server_nonce},
                                         {"proof", auth::server_proof(key_, p.client_nonce, p.server_nonce)}},
                                        Clock::now() + milliseconds(100), -1, err)
                   ? Step::kMore
                   : Step::kDrop;
      }
      if (m->value("t", "") != "proof" || ctl_[static_cast<std::size_t>(p.rank)] ||
          !auth::equal_ct(m->value("proof", ""), hello_proof(p.client_nonce, p.server_nonce, p.rank, p.port)))
        return Step::kDrop;  // a wrong key: not this job's node, whatever rank it claimed
      return take_node(p, auth::session_key(key_, p.client_nonce, p.server_nonce), missing);
    };
    Flood flood;
    if (admit(coord_fd_, 4, deadline_, o_.cancel_fd, step, [&] { return missing == 0; }, of_node(), flood) < 0)
      return cancelled();
    coord_listener_.reset();  // MASTER_PORT is the workers' again (the agent's hold stays)
    if (missing > 0) {
      std::vector<NodeReport> reports;
      for (int r = 0; r < n_; ++r) {
        NodeReport x;
        x.rank = r;
        x.reached = r == 0 || ctl_[static_cast<std::size_t>(r)];
        reports.push_back(x);
      }
      Verdict v = judge(reports, o_.nodes, o_.slow_fraction, elapsed());
      if (flood.turned_away > 0) {
        // The missing node may be one of those turned away: whose fault it is, nobody knows.
        std::vector<int> absent;
        for (const auto& x : reports)
          if (!x.reached) absent.push_back(x.rank);
        v.named.clear();
        v.line = fmt::format("preflight failed after {:.2f} s: MASTER_PORT {} was flooded ({}) while {} had not come; "
                             "nobody is named (find what connects to that port; a token, --token-file, lets nodes "
                             "prove they belong)",
                             elapsed(), o_.coordinator_port, flood.text(), names(absent, o_.nodes));
      }
      broadcast_verdict(v, reports);
      return false;
    }
    std::string err;
    for (int r = 1; r < n_; ++r)
      send_msg(ctl_[static_cast<std::size_t>(r)], {{"t", "peers"}, {"ports", ports_}, {"secret", secret_}}, deadline_,
               o_.cancel_fd, err);
    return true;
  }

  // Whether an address is one of the nodes' (resolved once). The lookups get 2 s in all,
  // not the check's deadline: a name that gets no answer then has no addresses (any claim
  // for its rank is taken), and the nodes are still admitted in time. Before, a DNS server
  // that did not answer held the coordinator here until the deadline, and it named a node
  // that had come as one that never reached it (#35).
  std::function<bool(const std::string&)> of_node() {
    if (node_addrs_.empty()) {
      const TimePoint by = std::min(deadline_, Clock::now() + kNamesBound);
      for (const auto& h : o_.nodes) node_addrs_.push_back(addresses_of(h, by, o_.cancel_fd));
    }
    return [this](const std::string& a) {
      return std::any_of(node_addrs_.begin(), node_addrs_.end(), [&](const auto& s) { return s.count(a) > 0; });
    };
  }

  // Without a key, a hello is all a node shows, and where it comes from: a claim for rank r
  // is taken only from one of node r's addresses (nodes connect from their own; any claim
  // when they cannot be resolved). Others are refused, and the rank marked contested
  // (contested_): a verdict that would name it names nobody, since the node's own hello
  // may be the one refused.
  Step claim(Pending& p, int& missing) {
    of_node();
    const auto r = static_cast<std::size_t>(p.rank);
    if (ctl_[r] || (!node_addrs_[r].empty() && !node_addrs_[r].count(p.from))) {
      contested_[p.rank].insert(p.from);
      return Step::kDrop;
    }
    return take_node(p, {}, missing);
  }

  // A node's control connection, admitted: its place, its data port, its MACs (with a key).
  Step take_node(Pending& p, const std::string& session, int& missing) {
    Link& l = ctl_[static_cast<std::size_t>(p.rank)];
    l.fd = std::move(p.fd);
    if (!session.empty()) {
      l.out.emplace(session, 's');
      l.in.emplace(session, 'c');
    }
    ports_[static_cast<std::size_t>(p.rank)] = p.port;
    --missing;
    return Step::kAdmitted;
  }

  // Others: reach the coordinator (it may not listen yet), say hello (with a key, prove it
  // and check the coordinator's proof), get the port table. A connection closed before the
  // table came (the coordinator turned it away to keep room in a flood) is made again,
  // until the deadline.
  bool hello() {
    for (;;) {
      bool again = false;
      const bool ok = hello_once(again);
      if (!again) return ok;
      if (Clock::now() + milliseconds(50) >= deadline_) return lost_coordinator();
      if (o_.cancel_fd >= 0 ? wait_fd(o_.cancel_fd, POLLIN, Clock::now() + milliseconds(50), -1) != 0
                            : (std::this_thread::sleep_for(milliseconds(50)), false))
        return cancelled();
    }
  }

  // One try of hello(); `again` set when the connection closed before the port table came.
  bool hello_once(bool& again) {
    coord_ = Link();
    coord_.fd = connect_to(o_.coordinator_host, o_.coordinator_port, deadline_, /*retry_refused=*/true, o_.cancel_fd,
                           error_, o_.nodes[static_cast<std::size_t>(o_.rank)]);
    if (!coord_) {
      if (error_ == "cancelled") return cancelled();
      local_failure(fmt::format("{} cannot reach the coordinator, {}, at {}:{}: {}", node_name(o_.rank, o_.nodes),
                                node_name(0, o_.nodes), o_.coordinator_host, o_.coordinator_port, error_));
      result_.named = {0};
      return false;
    }
    auto closed = [&] {
      again = error_ == "the peer closed the connection" || error_.starts_with("recv: ") || error_.starts_with("send: ");
      return again ? false : lost_coordinator();
    };
    nlohmann::json h = {{"t", "hello"}, {"job", o_.job}, {"rank", o_.rank}, {"port", data_port_}};
    const std::string nonce = key_.empty() ? std::string() : auth::random_hex(32);
    if (!key_.empty()) h["nonce"] = nonce;
    if (!send_msg(coord_, h, deadline_, o_.cancel_fd, error_)) return closed();
    if (!key_.empty()) {
      auto c = recv_msg(coord_, deadline_ + kGrace, o_.cancel_fd, error_);
      if (!c) return error_ == "cancelled" ? cancelled() : closed();
      const std::string sn = c->value("nonce", "");
      if (c->value("t", "") != "challenge" || sn.size() != 64 ||
          !auth::equal_ct(c->value("proof", ""), auth::server_proof(key_, nonce, sn))) {
        // Not node 0's agent (it would know the key): whoever listens there is named by no one.
        local_failure(fmt::format("{}: whatever answers at MASTER_ADDR:MASTER_PORT ({}:{}) cannot prove this job's key "
                                  "(another process on that port?); the check cannot run",
                                  node_name(o_.rank, o_.nodes), o_.coordinator_host, o_.coordinator_port));
        return false;
      }
      if (!send_msg(coord_, {{"t", "proof"}, {"proof", hello_proof(nonce, sn, o_.rank, data_port_)}}, deadline_,
                    o_.cancel_fd, error_))
        return closed();
      const std::string session = auth::session_key(key_, nonce, sn);
      coord_.out.emplace(session, 'c');
      coord_.in.emplace(session, 's');
    }
    auto m = recv_msg(coord_, deadline_ + kGrace, o_.cancel_fd, error_);
    if (!m) return error_ == "cancelled" ? cancelled() : closed();
    if ((*m)["t"] == "verdict") return take_verdict(*m);
    ports_ = m->value("ports", std::vector<int>{});
    secret_ = m->value("secret", "");
    if (static_cast<int>(ports_.size()) != n_ || secret_.size() != kTagBytes) {
      error_ = "a malformed port table";
      return lost_coordinator();
    }
    if (!key_.empty() && ports_[static_cast<std::size_t>(o_.rank)] != data_port_) {
      // The table came under the session's MAC, so the coordinator itself said so.
      local_failure(fmt::format("{}: the coordinator's port table gives it port {}, not its own {}; the check cannot run",
                                node_name(o_.rank, o_.nodes), ports_[static_cast<std::size_t>(o_.rank)], data_port_));
      return false;
    }
    return true;
  }

  // A node's proof of the key, bound to what its hello said (the job, its rank and data
  // port) as well as to both nonces: a hello altered on the way fails it.
  std::string hello_proof(const std::string& cn, const std::string& sn, int rank, int port) const {
    return auth::client_proof(key_, cn, fmt::format("{}|{}|{}|{}", sn, o_.job, rank, port));
  }

  // What a data connection from `from` to `to` shows: the coordinator's secret of this
  // check (only its nodes have it), with a key an HMAC of it under the check's key.
  std::string data_tag(int from, int to) const {
    return key_.empty() ? secret_
                        : auth::hmac_sha256_hex(key_, fmt::format("mglaunch-preflight-data|{}|{}|{}", secret_, from, to));
  }

  void connect_peers() {
    for (int s : shifts(n_)) {
      const int peer = (o_.rank + s) % n_;
      std::string err;
      Fd fd = connect_to(o_.nodes[static_cast<std::size_t>(peer)], ports_[static_cast<std::size_t>(peer)],
                         std::min(data_deadline_, Clock::now() + milliseconds(3000)), false, o_.cancel_fd, err);
      const std::uint32_t words[2] = {htonl(kMagic), htonl(static_cast<std::uint32_t>(o_.rank))};
      std::string header(reinterpret_cast<const char*>(words), sizeof(words));
      header += data_tag(o_.rank, peer);
      if (fd && !send_all(fd.get(), header.data(), header.size(), data_deadline_, o_.cancel_fd, err)) fd.reset();
      if (!fd) {
        add_unique(report_.unreachable, peer);
        report_.errors.push_back(fmt::format("node {} -> node {}: {}", o_.rank, peer, err));
        continue;
      }
      out_[s] = std::move(fd);
    }
  }

  // Everyone says whom it could not reach; the coordinator stops the check there or says go.
  bool settle_connections() {
    note_full_queue();
    const nlohmann::json mine = {{"t", "connected"},
                                 {"unreachable", report_.unreachable},
                                 {"errors", report_.errors},
                                 {"flooded", report_.flooded}};
    if (o_.rank != 0) {
      if (!send_msg(coord_, mine, deadline_, o_.cancel_fd, error_)) return lost_coordinator();
      auto m = await_coordinator(deadline_ + kGrace);
      if (!m) return false;
      if ((*m)["t"] == "verdict") return take_verdict(*m);
      return true;
    }
    std::vector<NodeReport> reports(static_cast<std::size_t>(n_));
    bool any_failed = !report_.unreachable.empty();
    for (int r = 0; r < n_; ++r) {
      auto& x = reports[static_cast<std::size_t>(r)];
      x.rank = r;
      x.reached = true;
      x.reported = true;
      if (r == 0) {
        x.unreachable = report_.unreachable;
        x.errors = report_.errors;
        x.flooded = report_.flooded;
        continue;
      }
      std::string err;
      auto m = recv_msg(ctl_[static_cast<std::size_t>(r)], deadline_, o_.cancel_fd, err);
      if (err == "cancelled") return cancelled();
      if (!m || m->value("t", "") != "connected") {
        x.reported = false;
        any_failed = true;
        continue;
      }
      x.unreachable = m->value("unreachable", std::vector<int>{});
      x.errors = m->value("errors", std::vector<std::string>{});
      x.flooded = m->value("flooded", std::string());
      any_failed = any_failed || !x.unreachable.empty();
    }
    if (any_failed) {
      broadcast_verdict(judge(reports, o_.nodes, o_.slow_fraction, elapsed()), reports);
      return false;
    }
    std::string err;
    for (int r = 1; r < n_; ++r) send_msg(ctl_[static_cast<std::size_t>(r)], {{"t", "go"}}, deadline_, o_.cancel_fd, err);
    return true;
  }

  // This node's data port, once its peers have connected (or failed to): an accept queue
  // that is full refused their connections, and its peers would name this node for it.
  // TCP_INFO of a listener: tcpi_unacked is the queue's length, tcpi_sacked its bound.
  void note_full_queue() {
    if (!data_listener_) return;
    tcp_info ti{};
    socklen_t len = sizeof(ti);
    if (::getsockopt(data_listener_.get(), IPPROTO_TCP, TCP_INFO, &ti, &len) != 0 || ti.tcpi_sacked == 0) return;
    if (ti.tcpi_unacked >= ti.tcpi_sacked)
      report_.flooded = fmt::format("its accept queue was full ({} connections waiting) when its peers connected",
                                    ti.tcpi_unacked);
  }

  // The peers' data connections, each showing its tag (data_tag()); served side by side
  // like the hellos, so a stranger's connection to this port delays no peer's.
  void accept_peers() {
    std::size_t want = shifts(n_).size();
    const auto sh = shifts(n_);
    auto step = [&](Pending& p) {
      if (p.in.size() < kHeaderBytes) return Step::kMore;
      std::uint32_t words[2];
      std::memcpy(words, p.in.data(), sizeof(words));
      const int from = static_cast<int>(ntohl(words[1]));
      const int s = ((o_.rank - from) % n_ + n_) % n_;
      if (ntohl(words[0]) != kMagic || from < 0 || from >= n_ || std::find(sh.begin(), sh.end(), s) == sh.end() ||
          in_.count(s) || !auth::equal_ct(p.in.substr(sizeof(words)), data_tag(from, o_.rank)))
        return Step::kDrop;
      in_[s] = std::move(p.fd);
      --want;
      return Step::kAdmitted;
    };
    Flood flood;
    if (data_listener_)
      admit(data_listener_.get(), kHeaderBytes, data_deadline_, o_.cancel_fd, step, [&] { return want == 0; }, of_node(),
            flood);
    if (flood.turned_away > 0 && want > 0 && report_.flooded.empty()) report_.flooded = flood.text();
    for (int s : shifts(n_))
      if (!in_.count(s)) {
        const int from = ((o_.rank - s) % n_ + n_) % n_;
        add_unique(report_.waited_on, from);
        report_.errors.push_back(fmt::format("node {} never connected to node {}", from, o_.rank));
      }
  }

  // Reduce-scatter then all-gather over the shift-1 ring; each element's sum is checked.
  void allreduce() {
    const std::size_t count = std::max<std::size_t>(o_.allreduce_bytes / sizeof(float), static_cast<std::size_t>(n_));
    std::vector<float> data(count);
    for (std::size_t i = 0; i < count; ++i) data[i] = static_cast<float>((o_.rank + 1) * static_cast<int>(i % 7 + 1));
    auto begin = [&](int c) { return count * static_cast<std::size_t>(c) / static_cast<std::size_t>(n_); };
    std::vector<float> tmp(count / static_cast<std::size_t>(n_) + 1);
    const int out = out_.at(1).get(), in = in_.at(1).get();
    const int prev = (o_.rank - 1 + n_) % n_;
    const TimePoint start = Clock::now();
    for (int phase = 0; phase < 2; ++phase)
      for (int k = 0; k < n_ - 1; ++k) {
        // reduce-scatter: send chunk r-k, add into chunk r-k-1; all-gather: send r+1-k, copy r-k.
        const int sc = ((phase == 0 ? o_.rank - k : o_.rank + 1 - k) % n_ + n_) % n_;
        const int rc = ((phase == 0 ? o_.rank - k - 1 : o_.rank - k) % n_ + n_) % n_;
        const std::size_t sn = (begin(sc + 1) - begin(sc)) * sizeof(float);
        const std::size_t rn = (begin(rc + 1) - begin(rc)) * sizeof(float);
        Xfer x = exchange(out, reinterpret_cast<const char*>(data.data() + begin(sc)), sn, in,
                          reinterpret_cast<char*>(tmp.data()), rn, data_deadline_, milliseconds(0), o_.send_rate,
                          o_.cancel_fd);
        if (!x.recv_error.empty() || x.received < rn) {
          add_unique(report_.waited_on, prev);
          report_.errors.push_back(fmt::format("all-reduce: node {} from node {}: {}", o_.rank, prev,
                                               x.recv_error.empty() ? "short" : x.recv_error));
          return;
        }
        if (!x.send_error.empty()) {
          report_.errors.push_back(fmt::format("all-reduce: node {} to node {}: {}", o_.rank, (o_.rank + 1) % n_,
                                               x.send_error));
          return;
        }
        for (std::size_t i = 0; i < rn / sizeof(float); ++i)
          data[begin(rc) + i] = phase == 0 ? data[begin(rc) + i] + tmp[i] : tmp[i];
      }
    report_.allreduce_s = std::chrono::duration<double>(Clock::now() - start).count();
    const int ranks_sum = n_ * (n_ + 1) / 2;
    for (std::size_t i = 0; i < count; ++i)
      if (data[i] != static_cast<float>(ranks_sum * static_cast<int>(i % 7 + 1))) ++report_.allreduce_wrong;
  }

  // One timed round per shift: send to r+s while receiving from r-s.
  void bandwidth() {
    std::vector<char> buf(o_.p2p_bytes, '\x5a');
    for (int s : shifts(n_)) {
      const int from = ((o_.rank - s) % n_ + n_) % n_;
      Xfer x = exchange(out_.at(s).get(), buf.data(), buf.size(), in_.at(s).get(), nullptr, buf.size(), data_deadline_,
                        o_.transfer_cap, o_.send_rate, o_.cancel_fd);
      if (x.received == 0) {
        add_unique(report_.waited_on, from);
        report_.errors.push_back(fmt::format("point-to-point: node {} from node {}: {}", o_.rank, from,
                                             x.recv_error.empty() ? "nothing came" : x.recv_error));
        return;
      }
      report_.received.push_back({from, static_cast<double>(x.received), x.seconds()});
      out_.at(s).reset();  // used once
    }
  }

  // Reports go to the coordinator, which judges; everyone takes its verdict.
  void finish() {
    if (o_.rank != 0) {
      nlohmann::json m = to_json(report_);
      m["t"] = "report";
      if (!send_msg(coord_, m, deadline_, o_.cancel_fd, error_)) {
        lost_coordinator();
        return;
      }
      auto v = await_coordinator(deadline_ + kGrace);
      if (v) take_verdict(*v);
      return;
    }
    std::vector<NodeReport> reports;
    reports.push_back(report_);
    for (int r = 1; r < n_; ++r) {
      std::string err;
      auto m = recv_msg(ctl_[static_cast<std::size_t>(r)], deadline_, o_.cancel_fd, err);
      if (err == "cancelled") {
        cancelled();
        return;
      }
      NodeReport x;
      x.rank = r;
      x.reached = true;
      if (m && m->value("t", "") == "report") {
        try {
          x = node_report_from_json(*m);
          x.reached = x.reported = true;
        } catch (const nlohmann::json::exception&) {
          x = NodeReport{};
          x.rank = r;
          x.reached = true;
        }
        x.rank = r;
      }
      reports.push_back(std::move(x));
    }
    broadcast_verdict(judge(reports, o_.nodes, o_.slow_fraction, elapsed()), reports);
  }

  void broadcast_verdict(Verdict v, const std::vector<NodeReport>& reports) {
    std::string err;
    if (!v.ok && std::any_of(v.named.begin(), v.named.end(), [&](int r) { return contested_.count(r) > 0; })) {
      std::string claims;
      for (const auto& [r, from] : contested_) {
        std::string list;
        for (const auto& a : from) list += (list.empty() ? "" : ", ") + a;
        claims += fmt::format("{}rank {} from {}", claims.empty() ? "" : "; ", r, list);
      }
      v.named.clear();
      v.line += fmt::format("; but nobody is named: without a token anyone who knows the run id can pose as a node, "
                            "and a hello was refused for {} (a second claim, or not from the node's address; "
                            "use a token: --token-file)",
                            claims);
    }
    const nlohmann::json m = {{"t", "verdict"}, {"ok", v.ok}, {"line", v.line}, {"named", v.named}};
    for (int r = 1; r < static_cast<int>(ctl_.size()); ++r)
      if (ctl_[static_cast<std::size_t>(r)])
        send_msg(ctl_[static_cast<std::size_t>(r)], m, std::min(deadline_ + milliseconds(1000),
                                                                      Clock::now() + milliseconds(1000)),
                 o_.cancel_fd, err);
    result_.ok = v.ok;
    result_.line = v.line;
    result_.named = v.named;
    result_.seconds = elapsed();
    result_.reports = nlohmann::json::array();
    for (const auto& r : reports) {
      nlohmann::json j = to_json(r);
      j["reached"] = r.reached;
      j["reported"] = r.reported;
      result_.reports.push_back(std::move(j));
    }
  }

  std::optional<nlohmann::json> await_coordinator(TimePoint until) {
    auto m = recv_msg(coord_, until, o_.cancel_fd, error_);
    if (!m) {
      if (error_ == "cancelled") cancelled();
      else lost_coordinator();
    }
    return m;
  }

  bool take_verdict(const nlohmann::json& m) {
    result_.ok = m.value("ok", false);
    result_.line = m.value("line", std::string("preflight failed: the coordinator sent no reason"));
    result_.named = m.value("named", std::vector<int>{});
    result_.seconds = elapsed();
    result_.reports = nlohmann::json::array({to_json(report_)});
    return false;
  }

  bool lost_coordinator() {
    local_failure(fmt::format("{} lost the coordinator, {}: {}", node_name(o_.rank, o_.nodes), node_name(0, o_.nodes),
                              error_));
    result_.named = {0};
    return false;
  }

  bool cancelled() {
    result_.ok = false;
    result_.line = "preflight cancelled";
    result_.seconds = elapsed();
    return false;
  }

  const Options& o_;
  const int n_;
  const TimePoint t0_;
  TimePoint deadline_, data_deadline_;
  NodeReport report_;
  Result result_;
  std::string error_;
  std::string key_;     // the check's key (from the job key), empty without a token
  std::string secret_;  // the coordinator's secret of this check (data_tag())
  Fd data_listener_, coord_listener_;
  Link coord_;  // others: the control connection to the coordinator
  int data_port_ = 0;
  int coord_fd_ = -1;
  std::vector<Link> ctl_;       // rank 0: each node's control connection
  std::vector<int> ports_;      // each node's data port
  std::vector<std::set<std::string>> node_addrs_;  // each node's addresses (of_node())
  std::map<int, std::set<std::string>> contested_;  // rank 0, no key: ranks claimed twice, by whom
  std::map<int, Fd> out_, in_;  // data connections by shift
};

}  // namespace

Result run(const Options& o) {
  if (o.rank < 0 || o.rank >= static_cast<int>(o.nodes.size()))
    throw std::invalid_argument(fmt::format("preflight: rank {} outside the {} nodes", o.rank, o.nodes.size()));
  Node node(o);
  return node.run();
}

Result run_local(int nodes, const std::vector<std::string>& addresses, const Options& base,
                 const std::function<void(int, Options&)>& tweak) {
  if (nodes < 1 || addresses.empty()) throw std::invalid_argument("preflight: no nodes");
  std::vector<std::string> where;
  for (int r = 0; r < nodes; ++r) where.push_back(addresses[static_cast<std::size_t>(r) % addresses.size()]);
  int port = 0;
  std::string error;
  Fd coord = listen_on(where[0], 0, true, port, error, Clock::now() + rdzv::kLookupBound, base.cancel_fd);
  if (!coord) {
    Result r;
    r.line = fmt::format("preflight failed: {}", error);
    return r;
  }
  std::vector<Options> opts(static_cast<std::size_t>(nodes), base);
  std::vector<Result> results(static_cast<std::size_t>(nodes));
  for (int r = 0; r < nodes; ++r) {
    Options& o = opts[static_cast<std::size_t>(r)];
    o.rank = r;
    o.nodes = where;
    o.coordinator_host = where[0];
    o.coordinator_port = port;
    o.coordinator_fd = r == 0 ? coord.get() : -1;
    if (o.job.empty()) o.job = "local";
    if (tweak) tweak(r, o);
  }
  std::vector<std::thread> threads;
  for (int r = 0; r < nodes; ++r)
    threads.push_back(signal_free_thread([&, r] { results[static_cast<std::size_t>(r)] = run(opts[static_cast<std::size_t>(r)]); }));
  for (auto& t : threads) t.join();
  return results.front();
}

}  // namespace mg::preflight
