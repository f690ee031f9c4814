// mgtrain's communication setup: the c10d store and process group (Gloo on CPU, NCCL on
// CUDA builds) from the torchrun contract, or no process group at all in single mode,
// plus the few collectives the trainer needs outside the gradient reducer. Included only
// by mgtrain's torch units.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/torch.h>
#include <torch/version.h>
#if __has_include(<gloo/algorithm.h>)  // pip/conda LibTorch ships no Gloo headers (NCCL only)
#define MGLAUNCH_WITH_GLOO 1
#endif
#if TORCH_VERSION_MAJOR >= 2
#include <torch/csrc/distributed/c10d/Backend.hpp>
#else
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#endif

#include "worker/control.h"
#include "worker/options.h"

namespace mg::train {

#if TORCH_VERSION_MAJOR >= 2
using PG = c10d::Backend;
#else
using PG = c10d::ProcessGroup;
#endif

// The connections of one group's store client, recorded when its store was made, made
// quiet once the group is let go of (comm.cc).
struct StoreSockets;

// Owns the store and the process group of one rank. `pg` is null in single mode: every
// collective below is then the identity.
struct Comm {
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<PG> pg;
  std::shared_ptr<StoreSockets> store_sockets;  // null without a store
  std::string backend = "none";
  torch::Device device{torch::kCPU};
  int rank = 0, world = 1;
  std::function<void()> shutdown = [] {};  // orderly teardown where the backend has one
  std::function<void()> abort = [] {};     // NCCL: abort the communicators (in-place recovery)
  // What the agent's pause runs for this group (the Interrupt's on_fire, installed by
  // connect() and connect_interruptible() on the calling thread): NCCL aborts its
  // communicators (held weakly); empty for Gloo, whose waits end through the Interrupt.
  std::function<void()> on_pause;

  bool distributed() const { return static_cast<bool>(pg); }
  // In-place recovery: lets go of the process group and the store without waiting for
  // anything. A Gloo group whose peer is gone may have a thread blocked in a collective,
  // which its destructor would join: the group is kept, unused, for the process's life
  // (run() then ends with _Exit). NCCL's communicators are aborted. The store's
  // connections are made quiet: torch 1.13's store client thread spins a core on one whose
  // server is gone (its host SIGKILLed); on a quiet one it sleeps.
  void abandon();
  void allreduce_sum(torch::Tensor& t) const;
  // Broadcasts every tensor from rank 0 in place, coalesced: one collective per dtype.
  void broadcast_coalesced(const std::vector<torch::Tensor>& tensors) const;
};

// A collective failed (a peer gone, a timeout): a worker with in-place recovery waits for
// the agent's pause; any other rethrows it (exit 1).
struct CollectiveError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
// The agent's pause came first: the collective was left unfinished.
struct Interrupted : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Waits for `work`; its failure is a CollectiveError. Once set_interrupt() installed an
// Interrupt, a wait it fires before the work completes throws Interrupted instead.
void wait_work(const c10::intrusive_ptr<c10d::Work>& work);
void set_interrupt(std::shared_ptr<Interrupt> interrupt);
// How many process groups abandon() kept alive (0: none).
std::size_t abandoned_groups();

// Joins the process group of the launcher (throws SetupError naming the master); with an
// Interrupt set (set_interrupt), the group's on_pause becomes its on_fire.
Comm connect(const Options& o, const Env& env);
// connect() on a thread of its own, for a recovery: `give_up` is asked every 50 ms and,
// once it says true before the group formed (the agent paused again: a peer lost while the
// new group forms; a stop signal), Interrupted is thrown at once. The thread is left to
// finish or time out by itself (within --timeout); what it builds is kept, never used nor
// destroyed (as abandon() keeps a group), and never installed as the Interrupt's hook:
// only the group returned is, on the calling thread. connect()'s own errors are rethrown.
// In-place recovery's TORCH_NCCL_ASYNC_ERROR_HANDLING=2 is in the environment mgtrain started
// with (main re-executes it with the variable: environment_to_reexec in options.h).
Comm connect_interruptible(const Options& o, const Env& env, const std::function<bool()>& give_up);
// A standby's pre-started worker (MGLAUNCH_STANDBY=1) before its place: no store, no
// process group, the device connect() will use (NCCL: GPU LOCAL_RANK mod the GPU count).
Comm unplaced_comm(const Options& o, const Env& env);
// One process, no store, no process group; the device is the first GPU on CUDA builds.
Comm local_comm(const Options& o);
// A Gloo process group over an existing store (the reducer's tests: ranks as threads
// over a c10d::HashStore). Throws SetupError on builds without Gloo.
c10::intrusive_ptr<PG> make_gloo(const c10::intrusive_ptr<c10d::Store>& store, int rank, int world, int timeout_s);

}  // namespace mg::train
