// mgtrain's checkpoints: rank 0 writes model (parameters and buffers), optimizer state,
// position and RNG state atomically (temp file, fsync, rename, fsync of the directory);
// on start the ranks compare what their checkpoints hold (run, epoch, step: from the small
// key file beside each, checkpoint_key_file) and the rank with the newest alone reads it
// and broadcasts its bytes, so every rank resumes from the same state even when the
// directory is node-local or stale elsewhere. Under a rendezvous epoch (MGLAUNCH_EPOCH) a
// write is fenced: only the newest epoch writes.
// Included only by torch units.
#pragma once

#include <optional>
#include <string>

#include <torch/torch.h>

#include "worker/comm.h"

namespace mg::train {

struct Position {
  std::int64_t step = 0;            // optimizer steps done
  std::int64_t epoch = 0;           // epoch in progress
  std::int64_t batch_in_epoch = 0;  // micro-batches of `epoch` already consumed (at `world`, from `epoch_offset`)
  // In-place recovery into another world size (docs/mgtrain.md): the permutation positions
  // of `epoch` consumed before the current world took over (0: none), and the world size
  // batch_in_epoch counts in (0: not recorded, an older checkpoint's: the current one).
  std::int64_t epoch_offset = 0;
  std::int64_t world = 0;
};

// `path` with "{rank}" in it replaced by `rank` (node-local checkpoint directories, one per rank).
std::string with_rank(std::string path, int rank);
std::string checkpoint_file(const std::string& dir);
// The fence's lock file beside the checkpoint: flock()ed around a fenced check-and-write;
// it holds the newest epoch that wrote, or is writing, there (a decimal line).
std::string checkpoint_lock_file(const std::string& dir);
// The checkpoint's key file beside it: one line, "step=S epoch=E run=R size=BYTES
// mtime_ns=NS ino=INODE", what the checkpoint holds and the identity of the file it
// describes; written (temp file, fsync, rename) after the checkpoint's rename and trusted
// only while stat() of the checkpoint gives that identity (docs/mgtrain.md).
std::string checkpoint_key_file(const std::string& dir);

// Fencing for data (docs/mgtrain.md, Checkpoints): the rendezvous gives every round an
// epoch, monotonic per job (MGLAUNCH_EPOCH). A checkpoint records its epoch, and a writer
// whose epoch is lower than the one that wrote (or is writing) the path writes nothing:
// it is the stale side of a job that split.
//
// Epochs count from 1 again in every run of the job (a rerun, a Slurm requeue, the same
// --rdzv_id used again): MGLAUNCH_RUN names the rendezvous run, "MS-HEX" (ms since the Unix
// epoch when the run's rendezvous job was made, random hex), and epochs compare only within
// one run (#37). A checkpoint of another run: an older one's (or one recorded without a run)
// is this run's start, and this run's first write replaces its record; a newer one's refuses
// this run (a stale run cannot overwrite a newer run's checkpoint). Runs are ordered by the
// wall clocks of the hosts that made them; `take_over` (--checkpoint-take-over, or inherited
// from the checkpoint this run resumed from) names a run this run counts as older than itself
// (one minted on a clock that ran ahead). The take-over is recorded ("E R ~T" in the lock,
// supersedes=T in the key and the archive): a writer of run T is refused from then on.
struct Fence {
  std::optional<std::int64_t> epoch;  // this round's; nullopt: no fence (torchrun, older agents)
  std::string run;                    // this round's run; empty: none (an mglaunch before #37)
  int lock_timeout_s = 300;           // the longest wait for another writer's lock
  std::string take_over;              // a newer run's record this run overwrites; empty: none
  std::string taken_by;               // a run that took this run over (the census): every write refused
};
// Who holds a checkpoint path: the epoch and run recorded (run empty: none recorded).
struct Owner {
  std::int64_t epoch = -1;
  std::string run;
  std::string superseded;  // a run `run` took over (whose writers are refused); empty: none
};
// Whether a writer under `fence` must leave the path `owner` holds alone (the rule above).
bool refuses(const Owner& owner, const Fence& fence);
struct Saved {
  bool written = true;
  std::int64_t owner = -1;  // not written: the epoch that holds the path
  std::string owner_run;    // and its run, when that is another run than this writer's
  std::string taken_over;   // written over the record of fence.take_over, a run dated after this one
  bool superseded = false;  // not written: owner_run took this writer's run over
};
// The one line of a refused write (`saved`) at `step` of `path` under `fence`: who holds it,
// who this is, and how to go on; `now_ms` (this host's clock, ms since the Unix epoch) dates
// a holding run minted on a clock that ran ahead.
std::string refusal(const Saved& saved, const Fence& fence, std::int64_t step, const std::string& path,
                    std::int64_t now_ms);

// Rank 0 only. Writes the checkpoint, then its key file (a failure there is a warning line:
// the checkpoint is written, and the next start reads its archive). With fence.epoch: under an
// exclusive flock of checkpoint_lock_file(dir) (waited for at most lock_timeout_s),
// compares with the epoch it holds (else the one the checkpoint records), writes nothing
// when that one is newer, else records this epoch there and writes. A file system without
// locks (flock's ENOSYS, ENOLCK, EOPNOTSUPP, EINVAL) does the same unlocked, the record
// replaced by rename, after one warning line per process. Throws std::runtime_error naming
// the path and the failing call (lock, write, fsync, rename) with errno's text.
Saved save_checkpoint(const std::string& dir, torch::nn::Module& model, torch::optim::Optimizer& opt, const Position& pos,
                      const Fence& fence = {});

// The whole training state as a checkpoint file holds it (parameters, buffers, optimizer
// state, position, CPU RNG state), in memory: in-place recovery broadcasts it.
std::string state_bytes(torch::nn::Module& model, torch::optim::Optimizer& opt, const Position& pos);
// Loads state_bytes() into `model` and `opt` and sets the CPU RNG; returns the position.
Position load_state(const std::string& bytes, const torch::Device& device, torch::nn::Module& model,
                    torch::optim::Optimizer& opt);
// Every rank calls it: `bytes` of rank `root` reach every rank (size first, then the bytes).
std::string broadcast_bytes(const Comm& comm, int root, std::string bytes);

// The newest checkpoint among the ranks' (older_checkpoint's order for this run).
struct Newest {
  int rank = -1;                     // the rank that holds it (the lowest on ties); -1: no rank has one
  CheckpointKey key;                 // what it holds
  std::optional<CheckpointKey> own;  // this rank's checkpoint, when it has one
  std::string taken_by;              // a run that took this fence's run over (a checkpoint records it)
  std::string path;                  // its file (rank `rank`'s)
  // The order it was picked by (the fence's: checkpoint_order, and the take-overs the
  // checkpoints and this run record): in-place recovery places the live states by it too.
  Supersessions taken;
  CheckpointOrder order = CheckpointOrder::kByStep;
};

// In-place recovery (docs/mgtrain.md): every rank's live state as a key, the run and epoch
// of the round that last held it and its step (0: none, a fresh process), so that a cut-off
// side's state or checkpoint of an older epoch never beats the newer epoch's (review s38 M3);
// and how many ranks have their control channel.
struct LiveStates {
  std::vector<CheckpointKey> keys;  // by rank
  int channels = 0;
  // The rank of the newest state in `newest`'s order (the lowest on ties); -1: no rank has trained.
  int newest(const Newest& order) const;
};
// Every rank calls it (one sum all-reduce): `mine` and `channel` of every rank.
LiveStates gather_live_states(const Comm& comm, const CheckpointKey& mine, bool channel);
// Every rank calls it first, before the live states and the census (one MAX all-reduce of
// {v, -v}): the ranks compare the version of those collectives' shapes; on a mismatch (ranks
// of different mgtrain builds) every rank throws SetupError (exit 3).
// MGTRAIN_TEST_CENSUS_VERSION replaces this rank's version: for tests only.
void check_census_version(const Comm& comm);

// Every rank calls it (a collective in ddp mode; none when `dir` is empty): each reads its
// checkpoint's run, epoch and step in `dir` (from checkpoint_key_file when that describes
// the checkpoint, else from the archive, every tensor loaded) and all learn every rank's.
// A run a checkpoint records as taken over (supersedes=T) ranks just below the run that took
// it over; in a job with no run (fence.run empty) checkpoints order by epoch, then step, under
// MGLAUNCH_EPOCH, else by step alone. `dirs` is --checkpoint-dir (with_rank() of it: each rank's).
// A rank's checkpoint that cannot be read may be the newest: SetupError (exit 3) on every
// rank, each line naming it ("remove rank k's D/checkpoint.pt (the next newest is then
// used), or restore it"); with `live` (in-place recovery, some rank holds a live state) one
// read whole that does not parse is left out instead, and its rank says so in one warning
// line (review s38 M4); an I/O error stays exit 3 (review s39 M2).
Newest newest_checkpoint(const std::string& dirs, const Comm& comm, const Fence& fence, bool live = false);

// Every rank calls it (a collective in ddp mode). Returns the position to resume from, or
// nullopt for a fresh start (no checkpoint on any rank). Rank `newest.rank` (from
// newest_checkpoint) alone reads its checkpoint (newest.path); its bytes reach every rank.
// Throws SetupError (exit 3) when that checkpoint cannot be read, or when the ranks end up
// at different steps. With `unreadable` (in-place recovery with live states): a checkpoint
// read whole that does not parse (before any rank's model took part of it) is nullopt on
// every rank with *unreadable set, after one warning line of its rank, instead (an I/O
// error stays SetupError).
std::optional<Position> resume(const Comm& comm, torch::nn::Module& model, torch::optim::Optimizer& opt,
                               const Newest& newest, bool* unreadable = nullptr);

// Rank 0's line of a resume at `pos` from `newest` (`dirs`: --checkpoint-dir): from its own
// checkpoint, or from another rank's (where rank 0 has none, or an older one).
void say_resumed(const std::string& dirs, const Newest& newest, const Position& pos);

}  // namespace mg::train
