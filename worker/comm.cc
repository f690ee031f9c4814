#include "worker/comm.h"

#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <fmt/format.h>
#include <condition_variable>
#include <cstdlib>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#ifdef MGLAUNCH_WITH_GLOO
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#endif
#ifdef MGLAUNCH_WITH_NCCL
#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

namespace mg::train {
namespace {

// Calls pg.shutdown() on LibTorch versions whose backend has it (NCCL in torch >= 2.4).
template <typename T>
void shutdown_if_supported(T& pg) {
  if constexpr (requires { pg.shutdown(); }) pg.shutdown();
}

// Calls pg.abort() where the backend has one (NCCL).
template <typename T>
void abort_if_supported(T& pg) {
  if constexpr (requires { pg.abort(); }) pg.abort();
}

// A hook that aborts `pg` while it lives. A weak reference: the Interrupt lives in a
// static slot, and a group it owned would be destroyed after CUDA at exit (the process
// then aborts with "driver shutting down", seen on an H100).
template <typename T>
std::function<void()> abort_while_alive(const c10::intrusive_ptr<T>& pg) {
  return [weak = c10::weak_intrusive_ptr<T>(pg)] {
    if (auto p = weak.lock()) abort_if_supported(*p);
  };
}

std::shared_ptr<Interrupt>& interrupt_slot() {
  static std::shared_ptr<Interrupt> slot;
  return slot;
}

// Groups and stores let go of by abandon(): never destroyed (see Comm::abandon). Also the
// connections given up by connect_interruptible() (their threads may still run).
struct Graveyard {
  std::mutex m;
  std::vector<c10::intrusive_ptr<PG>> groups;
  std::vector<c10::intrusive_ptr<c10d::Store>> stores;
  std::vector<std::shared_ptr<void>> connections;
};
Graveyard& graveyard() {
  static auto* g = new Graveyard;  // leaked on purpose: no destructor at exit
  return *g;
}

// Sets TCPStoreOptions::useLibUV where this LibTorch has it (2.2 on; true by default there);
// false where it has none (1.x: the classic store only).
template <typename O>
bool set_libuv(O& so, bool on) {
  if constexpr (requires { so.useLibUV; }) {
    so.useLibUV = on;
    return true;
  }
  return false;
}

// Until something listens at host:port (at most timeout_s; then the store's own connect
// reports the failure). c10d's client waits a whole second before it retries a refused
// connection, and a new round's store may open a few milliseconds after the assignment
// reached a worker that was already running (in-place recovery, a pre-started standby):
// that second was most of the recovery.
void wait_until_listening(const std::string& host, int port, int timeout_s) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found) != 0 || !found) return;
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(timeout_s);
  for (bool up = false; !up && std::chrono::steady_clock::now() < until;) {
    const int fd = ::socket(found->ai_family, found->ai_socktype | SOCK_CLOEXEC, found->ai_protocol);
    if (fd < 0) break;
    up = ::connect(fd, found->ai_addr, found->ai_addrlen) == 0;
    ::close(fd);
    if (!up) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ::freeaddrinfo(found);
}

bool cuda_visible() {
#ifdef MGLAUNCH_WITH_NCCL
  return torch::cuda::is_available();
#else
  return false;
#endif
}

}  // namespace

void set_interrupt(std::shared_ptr<Interrupt> interrupt) { interrupt_slot() = std::move(interrupt); }

void wait_work(const c10::intrusive_ptr<c10d::Work>& work) {
  const auto interrupt = interrupt_slot();
  if (interrupt) {
    auto fut = work->getFuture();
    // Completion or the pause, whichever first. The callback takes the lock before it
    // notifies, so no wake-up is lost between the predicate and the wait.
    fut->addCallback([interrupt](c10::ivalue::Future&) {
      std::lock_guard lk(interrupt->m);
      interrupt->cv.notify_all();
    });
    std::unique_lock lk(interrupt->m);
    interrupt->cv.wait(lk, [&] { return fut->completed() || interrupt->fired.load(); });
    if (!fut->completed()) throw Interrupted("the agent paused this worker during a collective");
  }
  try {
    work->wait();
  } catch (const std::exception& e) {
    std::string what = e.what();
    throw CollectiveError(what.substr(0, what.find('\n')));
  }
}

std::size_t abandoned_groups() {
  auto& g = graveyard();
  std::lock_guard lk(g.m);
  return g.groups.size() + g.connections.size();
}

void Comm::abandon() {
  abort();
  auto& g = graveyard();
  std::lock_guard lk(g.m);
  if (pg) g.groups.push_back(std::move(pg));
  if (store) g.stores.push_back(std::move(store));
  pg.reset();
  store.reset();
  shutdown = [] {};
  abort = [] {};
}

void Comm::allreduce_sum(torch::Tensor& t) const {
  if (!pg) return;
  std::vector<torch::Tensor> v{t};
  wait_work(pg->allreduce(v));
}

void Comm::broadcast_coalesced(const std::vector<torch::Tensor>& tensors) const {
  if (!pg || tensors.empty()) return;
  torch::NoGradGuard ng;
  std::map<c10::ScalarType, std::vector<torch::Tensor>> by_dtype;
  for (const auto& t : tensors) by_dtype[t.scalar_type()].push_back(t);
  for (auto& [dtype, group] : by_dtype) {
    std::vector<torch::Tensor> flat_parts;
    for (const auto& t : group) flat_parts.push_back(t.reshape({-1}));
    std::vector<torch::Tensor> v{torch::cat(flat_parts)};
    wait_work(pg->broadcast(v));
    std::int64_t off = 0;
    for (auto& t : group) {
      t.copy_(v[0].narrow(0, off, t.numel()).view(t.sizes()));
      off += t.numel();
    }
  }
}

c10::intrusive_ptr<PG> make_gloo(const c10::intrusive_ptr<c10d::Store>& store, int rank, int world, int timeout_s) {
#ifndef MGLAUNCH_WITH_GLOO
  (void)store, (void)rank, (void)world, (void)timeout_s;
  throw SetupError("this mgtrain was built without Gloo headers (pip/conda LibTorch); use --backend nccl");
#else
  auto opts = c10d::ProcessGroupGloo::Options::create();
  opts->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
  opts->timeout = std::chrono::seconds(timeout_s);
  return c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, world, opts);
#endif
}

namespace {

// connect() without installing the group's hook (connect_interruptible's thread).
Comm connect_group(const Options& o, const Env& env);

// The group's hook becomes the Interrupt's (an empty one for Gloo replaces an older group's).
void install_pause_hook(const Comm& c) {
  if (const auto& interrupt = interrupt_slot()) {
    std::lock_guard lk(interrupt->m);
    interrupt->on_fire = c.on_pause;
  }
}

}  // namespace

Comm connect_interruptible(const Options& o, const Env& env, const std::function<bool()>& give_up) {
  struct Slot {
    std::mutex m;
    std::condition_variable cv;
    bool done = false;
    std::optional<Comm> comm;
    std::exception_ptr error;
  };
  auto slot = std::make_shared<Slot>();
  std::thread([slot, o, env] {
    std::optional<Comm> c;
    std::exception_ptr error;
    try {
      c.emplace(connect_group(o, env));  // its hook is installed below, if this attempt is kept
    } catch (...) {
      error = std::current_exception();
    }
    std::lock_guard lk(slot->m);
    slot->comm = std::move(c);
    slot->error = error;
    slot->done = true;
    slot->cv.notify_all();
  }).detach();
  std::unique_lock lk(slot->m);
  while (!slot->cv.wait_for(lk, std::chrono::milliseconds(50), [&] { return slot->done; })) {
    if (!give_up()) continue;
    lk.unlock();
    auto& g = graveyard();
    std::lock_guard glk(g.m);
    g.connections.push_back(slot);
    throw Interrupted("the agent paused this worker again while the new process group formed");
  }
  if (slot->error) std::rethrow_exception(slot->error);
#ifdef MGLAUNCH_WITH_NCCL
  if (slot->comm->device.is_cuda()) c10::cuda::set_device(slot->comm->device.index());  // thread-local
#endif
  install_pause_hook(*slot->comm);
  return std::move(*slot->comm);
}

Comm unplaced_comm(const Options& o, const Env& env) {
  Comm c;
  const bool cuda = cuda_visible();
  if (o.backend == "nccl" && !cuda)
    throw SetupError("--backend nccl needs a CUDA build of mgtrain and a visible GPU; use --backend gloo");
#ifdef MGLAUNCH_WITH_NCCL
  if (o.backend != "gloo" && cuda) {
    const int devices = static_cast<int>(torch::cuda::device_count());
    const int dev = env.local_rank % std::max(1, devices);
    c10::cuda::set_device(dev);
    c.device = torch::Device(torch::kCUDA, dev);
  }
#else
  (void)env;
#endif
  return c;
}

Comm local_comm(const Options& o) {
  Comm c;
  if (cuda_visible() && o.backend != "gloo") c.device = torch::Device(torch::kCUDA, 0);
  return c;
}

Comm connect(const Options& o, const Env& env) {
  Comm c = connect_group(o, env);
  install_pause_hook(c);
  return c;
}

namespace {

Comm connect_group(const Options& o, const Env& env) {
  Comm c;
  c.rank = env.rank;
  c.world = env.world;
  const bool cuda = cuda_visible();
  if (o.backend == "nccl" && !cuda)
    throw SetupError("--backend nccl needs a CUDA build of mgtrain and a visible GPU; use --backend gloo");
  c.backend = o.backend == "auto" ? (cuda ? "nccl" : "gloo") : o.backend;
  c10d::TCPStoreOptions so;
  so.port = static_cast<std::uint16_t>(env.master_port);
  so.isServer = env.rank == 0 && !env.agent_store;
  so.numWorkers = env.world;
  so.waitWorkers = false;
  so.timeout = std::chrono::seconds(o.timeout_s);
  const bool libuv_option = set_libuv(so, env.use_libuv.value_or(true));
  if (!so.isServer) wait_until_listening(env.master_addr, env.master_port, o.timeout_s);
  try {
    try {
      c.store = c10::make_intrusive<c10d::TCPStore>(env.master_addr, so);
    } catch (const std::exception& e) {
      // A LibTorch built without libuv (Debian's 2.x) refuses its own default before it
      // binds or connects: unless USE_LIBUV=1 asked for libuv, the classic store (the same
      // protocol) serves instead, as USE_LIBUV=0 would.
      if (!libuv_option || env.use_libuv.has_value() || std::string(e.what()).find("libuv") == std::string::npos) throw;
      set_libuv(so, false);
      c.store = c10::make_intrusive<c10d::TCPStore>(env.master_addr, so);
    }
    // The agent's store outlives a restart: each attempt keeps to its own keys.
    if (env.agent_store)
      c.store = c10::make_intrusive<c10d::PrefixStore>(fmt::format("/worker/attempt_{}", env.restart_count), c.store);
  } catch (const std::exception& e) {
    std::string what = e.what();
    throw SetupError(fmt::format("cannot {} the c10d store at {}:{} within {} s: {}", so.isServer ? "serve" : "reach",
                                 env.master_addr, env.master_port, o.timeout_s, what.substr(0, what.find('\n'))));
  }
  if (c.backend == "gloo") {
    c.pg = make_gloo(c.store, env.rank, env.world, o.timeout_s);
  } else {
#ifdef MGLAUNCH_WITH_NCCL
    const int devices = static_cast<int>(torch::cuda::device_count());
    const int dev = env.local_rank % std::max(1, devices);
    c10::cuda::set_device(dev);
    c.device = torch::Device(torch::kCUDA, dev);
    // With --in-place-recovery, mgtrain started with TORCH_NCCL_ASYNC_ERROR_HANDLING=2
    // (environment_to_reexec). The group waits --timeout, as Gloo's does, not NCCL's 10 minutes.
    auto opts = c10d::ProcessGroupNCCL::Options::create();
    opts->timeout = std::chrono::seconds(o.timeout_s);
    auto nccl = c10::make_intrusive<c10d::ProcessGroupNCCL>(c.store, env.rank, env.world, opts);
    c.shutdown = [nccl] { shutdown_if_supported(*nccl); };
    c.abort = [nccl] { abort_if_supported(*nccl); };
    c.on_pause = abort_while_alive(nccl);  // --in-place-recovery: a pause aborts this group at once
    c.pg = nccl;
#endif
  }
  return c;
}

}  // namespace

}  // namespace mg::train
