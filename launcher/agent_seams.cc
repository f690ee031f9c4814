#include "launcher/agent_seams.h"

#include <signal.h>
#include <unistd.h>

#include <array>
#include <vector>

#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/ip/v6_only.hpp>
#include <boost/asio/signal_set.hpp>
#include <boost/asio/steady_timer.hpp>
#include <fmt/format.h>

#include "cli/errors.h"
#include "launcher/options.h"
#include "ops/monitor.h"
#include "rendezvous/endpoint.h"
#include "rendezvous/etcd_backend.h"
#include "store/server.h"

namespace mg {

namespace asio = boost::asio;

namespace {

class SystemClock final : public AgentClock {
 public:
  explicit SystemClock(asio::io_context& io) {
    for (std::size_t i = 0; i < static_cast<std::size_t>(sup::Timer::kCount); ++i) timers_.emplace_back(io);
  }
  sup::Now now() const override { return {std::chrono::steady_clock::now(), std::chrono::system_clock::now()}; }
  void arm(sup::Timer t, sup::Clock::time_point at, std::function<void()> fire) override {
    auto& timer = timers_[static_cast<std::size_t>(t)];
    timer.expires_at(at);  // cancels a wait still due
    timer.async_wait([fire = std::move(fire)](boost::system::error_code ec) {
      if (!ec) fire();
    });
  }
  void cancel(sup::Timer t) override { timers_[static_cast<std::size_t>(t)].cancel(); }

 private:
  std::vector<asio::steady_timer> timers_;  // by sup::Timer
};

class ProcessSignals final : public AgentSignals {
 public:
  explicit ProcessSignals(asio::io_context& io) : sets_{asio::signal_set(io), asio::signal_set(io), asio::signal_set(io)} {}
  void add(Set set, int sig) override { of(set).add(sig); }
  void wait(Set set, std::function<void(int)> got) override {
    of(set).async_wait([got = std::move(got)](boost::system::error_code ec, int sig) {
      if (!ec) got(sig);
    });
  }
  void cancel(Set set) override {
    boost::system::error_code ec;
    of(set).cancel(ec);
  }
  void stop_self() override { ::kill(::getpid(), SIGSTOP); }

 private:
  asio::signal_set& of(Set set) { return sets_[static_cast<std::size_t>(set)]; }
  std::array<asio::signal_set, 3> sets_;  // by Set
};

class MachineProbe final : public AgentHardware {
 public:
  explicit MachineProbe(std::string fake_gpu_json) : fake_gpu_json_(std::move(fake_gpu_json)) {}
  std::vector<hw::Binding> bind(const std::string& policy, int nproc, const std::vector<int>& gpu_ids) override {
    return hw::bind_this_machine(policy, nproc, gpu_ids);
  }
  std::unique_ptr<hw::GpuProbe> gpu_probe() override { return mon::make_gpu_probe(fake_gpu_json_); }

 private:
  std::string fake_gpu_json_;
};

}  // namespace

std::unique_ptr<AgentClock> make_system_clock(asio::io_context& io) { return std::make_unique<SystemClock>(io); }

std::unique_ptr<AgentSignals> make_process_signals(asio::io_context& io) {
  return std::make_unique<ProcessSignals>(io);
}

std::unique_ptr<AgentHardware> make_machine_hardware(std::string fake_gpu_json) {
  return std::make_unique<MachineProbe>(std::move(fake_gpu_json));
}

std::unique_ptr<rdzv::Link> make_rendezvous_link(asio::io_context& io, const AgentOptions& opts, proto::Join join,
                                                 rdzv::ClientHandlers handlers) {
  if (opts.rdzv_backend == "etcd") {  // the job lives in etcd; the same rules (rendezvous::Job) run in every agent
    rdzv::EtcdOptions eo;
    eo.endpoints = rdzv::etcd::parse_endpoints(opts.rdzv_endpoint);  // checked with the options
    for (auto& e : eo.endpoints) e.tls = e.tls || opts.etcd_https;
    eo.credentials = {opts.etcd_user, opts.etcd_password, opts.etcd_cacert, opts.etcd_cert, opts.etcd_key};
    eo.prefix = opts.etcd_prefix;
    eo.join = std::move(join);
    return std::make_unique<rdzv::EtcdLink>(io, std::move(eo), std::move(handlers));
  }
  const rdzv::Endpoint ep = rdzv::parse_endpoint(opts.rdzv_endpoint, 29400);
  rdzv::ClientOptions co;
  co.host = ep.host;
  co.port = ep.port;
  co.token = opts.rdzv_token;
  co.job_token = opts.rdzv_job_token;
  co.join = std::move(join);
  return std::make_unique<rdzv::LinkTo<rdzv::Client>>(io, std::move(co), std::move(handlers));
}

namespace {
class MachineStore final : public AgentStore {
 public:
  explicit MachineStore(std::unique_ptr<store::StoreServer> s) : s_(std::move(s)) {}
  int port() const override { return s_->port(); }
  void reset() override { s_->reset(); }
  void stop() override { s_->stop(); }
  void retire() override { s_->retire(); }
  std::size_t parked() const override { return s_->parked(); }
  std::size_t clients() const override { return s_->clients(); }
  void when_idle(std::function<void()> f) override { s_->when_idle(std::move(f)); }

 private:
  std::unique_ptr<store::StoreServer> s_;
};
}  // namespace

std::unique_ptr<AgentStore> serve_machine_store(asio::io_context& io, int port, int held_fd, std::size_t max_clients,
                                                std::function<void(const std::string&)> log) {
  namespace ip = asio::ip;
  ip::tcp::acceptor acceptor(io);
  boost::system::error_code ec;
  if (held_fd >= 0) {
    sockaddr_storage ss{};
    socklen_t len = sizeof(ss);
    const bool v6 = ::getsockname(held_fd, reinterpret_cast<sockaddr*>(&ss), &len) == 0 && ss.ss_family == AF_INET6;
    acceptor.assign(v6 ? ip::tcp::v6() : ip::tcp::v4(), held_fd, ec);
    if (ec) ::close(held_fd);
  } else {
    // As the hold (launcher/port.h): both families on [::], else 0.0.0.0.
    acceptor.open(ip::tcp::v6(), ec);
    if (!ec) acceptor.set_option(ip::v6_only(false), ec);
    if (!ec) acceptor.set_option(ip::tcp::acceptor::reuse_address(true), ec);
    if (!ec) acceptor.bind({ip::address_v6::any(), static_cast<unsigned short>(port)}, ec);
    if (ec && ec != asio::error::address_in_use) {
      acceptor.close(ec);
      ec = {};
      acceptor.open(ip::tcp::v4(), ec);
      if (!ec) acceptor.set_option(ip::tcp::acceptor::reuse_address(true), ec);
      if (!ec) acceptor.bind({ip::address_v4::any(), static_cast<unsigned short>(port)}, ec);
    }
  }
  if (!ec) acceptor.listen(asio::socket_base::max_listen_connections, ec);
  if (ec)  // the workers would talk to whatever holds the port (another job's store): stop here
    throw ResourceError(fmt::format("cannot serve the agent's store on port {}: {}; pick another --master_port, or "
                                    "set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 to have rank 0 host it",
                                    port, ec.message()));
  store::ServerOptions so;
  so.max_clients = max_clients;
  so.log = std::move(log);
  return std::make_unique<MachineStore>(std::make_unique<store::StoreServer>(io, std::move(acceptor), std::move(so)));
}

namespace {
class MachineControl final : public AgentControl {
 public:
  explicit MachineControl(std::unique_ptr<control::Server> s) : s_(std::move(s)) {}
  const std::string& address() const override { return s_->address(); }
  bool send(int local_rank, std::string line) override { return s_->send(local_rank, std::move(line)); }
  std::string ended_why(int local_rank) const override { return s_->ended_why(local_rank); }
  void forget(int local_rank) override { s_->forget(local_rank); }
  void stop() override { s_->stop(); }

 private:
  std::unique_ptr<control::Server> s_;
};
}  // namespace

std::unique_ptr<AgentControl> serve_machine_control(asio::io_context& io, control::ServerOptions opts,
                                                    control::Handlers h) {
  return std::make_unique<MachineControl>(std::make_unique<control::Server>(io, std::move(opts), std::move(h)));
}

AgentDeps machine_deps(asio::io_context& io, const EnvMap& env) {
  AgentDeps d;
  d.clock = make_system_clock(io);
  d.signals = make_process_signals(io);
  d.launcher = make_process_launcher;
  d.link = make_rendezvous_link;
  d.store = serve_machine_store;
  d.control = serve_machine_control;
  auto gpu_json = env.find("MGLAUNCH_TEST_GPU_JSON");
  d.hardware = make_machine_hardware(gpu_json == env.end() ? std::string() : gpu_json->second);
  return d;
}

}  // namespace mg
