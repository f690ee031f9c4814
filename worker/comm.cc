#include "worker/comm.h"

#include <dirent.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>
#include <algorithm>
#include <condition_variable>
#include <cstdio>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <map>
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

// ---- An abandoned store client made quiet ----
//
// Torch 1.13's store client keeps a thread that polls its connection and peeks at it. Once
// the store's host is gone (SIGKILLed: the kernel closes the connection), poll() says it is
// readable and the peek returns 0 at once, for ever: a core spins for the process's life
// (the chaos soak's daemon run took 1,403 s for a 720 s plan). A store let go of is never
// destroyed (Comm::abandon), so that thread stays: each of the store's connections is
// replaced (dup3) by one end of a socket pair of its own, whose other end is kept and never
// written; the thread's poll() then sleeps for good (a pipe would fail its peek). The
// Python package does the same (python/mglaunch_recovery, _GroupSockets).
//
// A store's connections are recorded when its TCPStore is made: the TCP sockets new since
// just before the constructor (descriptor and inode) whose peer is MASTER_ADDR:MASTER_PORT;
// never another socket of the process. A formation left behind by connect_interruptible
// may make a store to the same address while the next one does: each may record the
// other's connections. So the connections recorded by a group not let go of are claimed,
// and none of them is made quiet for another group's sake; and nothing is made quiet while
// a formation not let go of is between its look before the store and its record (its new
// connections are not claimed yet): that formation's record does it.
struct StoreSockets {
  std::vector<std::pair<int, ino_t>> sockets;  // this group's store connections
  c10::intrusive_ptr<c10d::Store> store;       // kept: a destroyed store's descriptors may be another's by then
  bool let_go = false;
  bool forming = false;  // counted in Quiet::forming
};

namespace {

struct Quiet {
  std::mutex m;
  std::map<std::pair<int, ino_t>, int> claimed;       // recorded by groups not let go of
  std::vector<std::shared_ptr<StoreSockets>> let_go;  // never destroyed
  std::vector<int> kept_ends;                         // the pairs' other ends: never written nor closed
  int forming = 0;
};
Quiet& quiet() {
  static auto* q = new Quiet;  // leaked on purpose, as the graveyard
  return *q;
}

// This process's sockets now: descriptor -> inode.
std::map<int, ino_t> open_sockets() {
  std::map<int, ino_t> out;
  DIR* d = ::opendir("/proc/self/fd");
  if (!d) return out;
  while (const dirent* e = ::readdir(d)) {
    char link[64];
    const ssize_t n = ::readlinkat(::dirfd(d), e->d_name, link, sizeof link - 1);
    if (n <= 0) continue;
    link[n] = '\0';
    unsigned long long ino = 0;
    if (std::sscanf(link, "socket:[%llu]", &ino) == 1) out[std::atoi(e->d_name)] = static_cast<ino_t>(ino);
  }
  ::closedir(d);
  return out;
}

// `a` with an IPv4-mapped IPv6 address (::ffff:a.b.c.d, how torch 1.13's client connects
// to an IPv4 address) as its IPv4 address.
sockaddr_storage unmapped(const sockaddr_storage& a) {
  const auto& v6 = reinterpret_cast<const sockaddr_in6&>(a);
  if (a.ss_family != AF_INET6 || !IN6_IS_ADDR_V4MAPPED(&v6.sin6_addr)) return a;
  sockaddr_storage out{};
  auto& v4 = reinterpret_cast<sockaddr_in&>(out);
  v4.sin_family = AF_INET;
  v4.sin_port = v6.sin6_port;
  std::memcpy(&v4.sin_addr, v6.sin6_addr.s6_addr + 12, sizeof v4.sin_addr);
  return out;
}

// The same address and port (IPv4-mapped IPv6 taken as IPv4).
bool same_endpoint(const sockaddr_storage& x, const sockaddr_storage& y) {
  const sockaddr_storage a = unmapped(x), b = unmapped(y);
  if (a.ss_family != b.ss_family) return false;
  if (a.ss_family == AF_INET) {
    const auto &p = reinterpret_cast<const sockaddr_in&>(a), &q = reinterpret_cast<const sockaddr_in&>(b);
    return p.sin_port == q.sin_port && p.sin_addr.s_addr == q.sin_addr.s_addr;
  }
  if (a.ss_family == AF_INET6) {
    const auto &p = reinterpret_cast<const sockaddr_in6&>(a), &q = reinterpret_cast<const sockaddr_in6&>(b);
    return p.sin6_port == q.sin6_port && std::memcmp(&p.sin6_addr, &q.sin6_addr, sizeof p.sin6_addr) == 0;
  }
  return false;
}

// The connections of `before`'s complement whose peer is one of `store` (the store's
// addresses, all with its port).
std::vector<std::pair<int, ino_t>> new_store_connections(const std::map<int, ino_t>& before,
                                                          const std::vector<sockaddr_storage>& store) {
  std::vector<std::pair<int, ino_t>> out;
  for (const auto& [fd, ino] : open_sockets()) {
    if (auto it = before.find(fd); it != before.end() && it->second == ino) continue;
    sockaddr_storage peer{};
    socklen_t len = sizeof peer;
    if (::getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &len) != 0) continue;  // listening, not connected
    const bool ours =
        std::any_of(store.begin(), store.end(), [&](const sockaddr_storage& s) { return same_endpoint(peer, s); });
    struct stat st {};
    if (ours && ::fstat(fd, &st) == 0 && st.st_ino == ino) out.emplace_back(fd, ino);
  }
  return out;
}

// Makes quiet every connection of a group let go of that no other group claims (under q.m).
void quiet_let_go(Quiet& q) {
  if (q.forming > 0) return;  // that formation's record does it
  for (const auto& group : q.let_go) {
    for (const auto& id : group->sockets) {
      struct stat st {};
      if (q.claimed.count(id) || ::fstat(id.first, &st) != 0 || st.st_ino != id.second || !S_ISSOCK(st.st_mode))
        continue;  // another group's too, or quiet already
      int pair[2];
      if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair) != 0) continue;
      if (::dup3(pair[0], id.first, O_CLOEXEC) >= 0) q.kept_ends.push_back(pair[1]);
      else ::close(pair[1]);
      ::close(pair[0]);
    }
  }
}

// The sockets before a store is made; a formation not let go of counts as forming until its record.
std::map<int, ino_t> before_store(StoreSockets& s) {
  auto& q = quiet();
  std::lock_guard lk(q.m);
  if (!s.let_go && !s.forming) {
    s.forming = true;
    ++q.forming;
  }
  return open_sockets();
}

// Records the connections `store` made since `before` (none when it was not made: null).
void record_store(StoreSockets& s, const std::map<int, ino_t>& before, const c10::intrusive_ptr<c10d::Store>& store,
                  const std::vector<sockaddr_storage>& addresses) {
  auto found = store ? new_store_connections(before, addresses) : std::vector<std::pair<int, ino_t>>{};
  auto& q = quiet();
  std::lock_guard lk(q.m);
  s.store = store;
  s.sockets = std::move(found);
  if (!s.let_go)
    for (const auto& id : s.sockets) ++q.claimed[id];
  if (s.forming) {
    s.forming = false;
    --q.forming;
  }
  quiet_let_go(q);
}

// The group of `s` is let go of: its connections no longer claimed, made quiet.
void let_go(const std::shared_ptr<StoreSockets>& s) {
  if (!s) return;
  auto& q = quiet();
  std::lock_guard lk(q.m);
  if (s->let_go) return;
  s->let_go = true;
  for (const auto& id : s->sockets)
    if (auto it = q.claimed.find(id); it != q.claimed.end() && --it->second == 0) q.claimed.erase(it);
  if (s->forming) {
    s->forming = false;
    --q.forming;
  }
  q.let_go.push_back(s);
  quiet_let_go(q);
}

}  // namespace

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

// The store's addresses: MASTER_ADDR's, each with MASTER_PORT. glibc's getaddrinfo has no
// deadline of its own (a name server that never answers holds it for resolv.conf's
// attempts x timeout: 90 s with 3 x 30 s, more with several servers), so it runs on a thread
// of its own, waited for at most `timeout_s` (--timeout); a lookup past it is left to finish
// there, and mgtrain ends with exit 3 (SetupError).
std::vector<sockaddr_storage> store_addresses(const std::string& host, int port, int timeout_s) {
  struct Lookup {
    std::mutex m;
    std::condition_variable cv;
    bool done = false;
    int rc = 0, error = 0;  // getaddrinfo's, and its errno for EAI_SYSTEM
    std::vector<sockaddr_storage> found;
  };
  auto l = std::make_shared<Lookup>();
  std::thread([l, host, port] {
    addrinfo hints{};
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* res = nullptr;
    const int rc = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res);
    const int error = errno;
    std::vector<sockaddr_storage> found;
    for (const addrinfo* a = rc == 0 ? res : nullptr; a; a = a->ai_next) {
      sockaddr_storage s{};
      std::memcpy(&s, a->ai_addr, std::min<std::size_t>(a->ai_addrlen, sizeof s));
      found.push_back(s);
    }
    if (res) ::freeaddrinfo(res);
    std::lock_guard lk(l->m);
    l->rc = rc;
    l->error = error;
    l->found = std::move(found);
    l->done = true;
    l->cv.notify_all();
  }).detach();
  std::unique_lock lk(l->m);
  if (!l->cv.wait_for(lk, std::chrono::seconds(timeout_s), [&] { return l->done; }))
    throw SetupError(fmt::format("cannot look up MASTER_ADDR '{}' within {} s (--timeout): its name server does not "
                                 "answer; set MASTER_ADDR to an IP address or fix this host's resolver",
                                 host, timeout_s));
  if (l->rc != 0 || l->found.empty())
    throw SetupError(fmt::format("cannot look up MASTER_ADDR '{}': {}; set MASTER_ADDR to the store host's name or "
                                 "IP address", host, l->rc == EAI_SYSTEM ? std::strerror(l->error) : ::gai_strerror(l->rc)));
  return std::move(l->found);
}

socklen_t length_of(const sockaddr_storage& a) {
  return a.ss_family == AF_INET6 ? sizeof(sockaddr_in6) : sizeof(sockaddr_in);
}

// `a` as a numeric host ("10.0.0.1", "::1"): what the store is given, so that its own
// lookup of MASTER_ADDR (unbounded, as glibc's) never runs.
std::string numeric_host(const sockaddr_storage& a) {
  char host[NI_MAXHOST] = "";
  if (::getnameinfo(reinterpret_cast<const sockaddr*>(&a), length_of(a), host, sizeof host, nullptr, 0,
                    NI_NUMERICHOST) != 0)
    return {};
  return host;
}

// The first of the store's addresses this host can bind (rank 0 serving the store: its own
// client connects there; "localhost" may list ::1 first on a host without IPv6); the first
// address when none binds.
const sockaddr_storage& own_address(const std::vector<sockaddr_storage>& store) {
  for (const auto& a : store) {
    const int fd = ::socket(a.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) continue;
    sockaddr_storage any_port = a;
    if (any_port.ss_family == AF_INET) reinterpret_cast<sockaddr_in&>(any_port).sin_port = 0;
    if (any_port.ss_family == AF_INET6) reinterpret_cast<sockaddr_in6&>(any_port).sin6_port = 0;
    const bool local = ::bind(fd, reinterpret_cast<const sockaddr*>(&any_port), length_of(any_port)) == 0;
    ::close(fd);
    if (local) return a;
  }
  return store.front();
}

// One connect to `a`, bounded by `until` (a blocking connect to a host that drops packets
// waits for the kernel's SYN retries, about 2 minutes): whether it was accepted.
bool connects(const sockaddr_storage& a, std::chrono::steady_clock::time_point until) {
  const int fd = ::socket(a.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return false;
  bool up = ::connect(fd, reinterpret_cast<const sockaddr*>(&a), length_of(a)) == 0;
  if (!up && errno == EINPROGRESS) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - std::chrono::steady_clock::now());
    pollfd pf{fd, POLLOUT, 0};
    int err = 0;
    socklen_t len = sizeof err;
    up = ::poll(&pf, 1, static_cast<int>(std::max<std::int64_t>(left.count(), 0))) == 1 &&
         ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) == 0 && err == 0;
  }
  ::close(fd);
  return up;
}

// Until something listens at one of the store's addresses (at most timeout_s): the one that
// answered; the first when none did (the store's own connect then reports the failure).
// c10d's client waits a whole second before it retries a refused connection, and a new
// round's store may open a few milliseconds after the assignment reached a worker that was
// already running (in-place recovery, a pre-started standby): that second was most of the
// recovery.
const sockaddr_storage& wait_until_listening(const std::vector<sockaddr_storage>& store, int timeout_s) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(timeout_s);
  while (std::chrono::steady_clock::now() < until) {
    for (const auto& a : store)  // each at most 2 s, so that a silent address leaves time for the next
      if (connects(a, std::min(until, std::chrono::steady_clock::now() + std::chrono::seconds(2)))) return a;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return store.front();
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
  {
    auto& g = graveyard();
    std::lock_guard lk(g.m);
    if (pg) g.groups.push_back(std::move(pg));
    if (store) g.stores.push_back(std::move(store));
  }
  let_go(store_sockets);
  pg.reset();
  store.reset();
  store_sockets.reset();
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

// connect() without installing the group's hook (connect_interruptible's thread); the
// store's connections are recorded in `sockets`.
Comm connect_group(const Options& o, const Env& env, const std::shared_ptr<StoreSockets>& sockets);
void make_group(Comm& c, const Options& o, const Env& env);

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
  auto sockets = std::make_shared<StoreSockets>();
  std::thread([slot, sockets, o, env] {
    std::optional<Comm> c;
    std::exception_ptr error;
    try {
      c.emplace(connect_group(o, env, sockets));  // its hook is installed below, if this attempt is kept
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
    let_go(sockets);  // its store's connections are made quiet once made, if they are
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
  Comm c = connect_group(o, env, std::make_shared<StoreSockets>());
  install_pause_hook(c);
  return c;
}

namespace {

Comm connect_group(const Options& o, const Env& env, const std::shared_ptr<StoreSockets>& sockets) {
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
  const auto addresses = store_addresses(env.master_addr, env.master_port, o.timeout_s);
  const std::string host =
      numeric_host(so.isServer ? own_address(addresses) : wait_until_listening(addresses, o.timeout_s));
  const auto before = before_store(*sockets);
  c10::intrusive_ptr<c10d::Store> tcp;
  try {
    try {
      tcp = c10::make_intrusive<c10d::TCPStore>(host.empty() ? env.master_addr : host, so);
    } catch (const std::exception& e) {
      // A LibTorch built without libuv (Debian's 2.x) refuses its own default before it
      // binds or connects: unless USE_LIBUV=1 asked for libuv, the classic store (the same
      // protocol) serves instead, as USE_LIBUV=0 would.
      if (!libuv_option || env.use_libuv.has_value() || std::string(e.what()).find("libuv") == std::string::npos) throw;
      set_libuv(so, false);
      tcp = c10::make_intrusive<c10d::TCPStore>(host.empty() ? env.master_addr : host, so);
    }
  } catch (const std::exception& e) {
    record_store(*sockets, before, {}, addresses);
    std::string what = e.what();
    throw SetupError(fmt::format("cannot {} the c10d store at {}:{} within {} s: {}", so.isServer ? "serve" : "reach",
                                 env.master_addr, env.master_port, o.timeout_s, what.substr(0, what.find('\n'))));
  }
  record_store(*sockets, before, tcp, addresses);
  c.store_sockets = sockets;
  // The agent's store outlives a restart: each attempt keeps to its own keys.
  c.store = tcp;
  if (env.agent_store)
    c.store = c10::make_intrusive<c10d::PrefixStore>(fmt::format("/worker/attempt_{}", env.restart_count), tcp);
  try {
    make_group(c, o, env);
  } catch (...) {
    let_go(sockets);  // the store is kept, never destroyed: its connections are made quiet
    throw;
  }
  return c;
}

// The process group over c.store (connect_group).
void make_group(Comm& c, const Options& o, const Env& env) {
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
}

}  // namespace

}  // namespace mg::train
