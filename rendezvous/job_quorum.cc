// The quorum rules of rdzv::Job (rendezvous/job.h; docs/multinode.md, "Network partitions",
// #34): which voters are present for the next round, and whether they are a majority.
#include <algorithm>
#include <set>
#include <string_view>

#include "rendezvous/job.h"

namespace mg::rdzv {

int Job::voters_joined(const std::vector<std::string>& voters, bool heard) const {
  // The voters this host hears on its side: those that joined the next round and the
  // standbys registered with it (each heard within its keep-alive x attempts, else dropped),
  // each agent once. Not the nodes told to restart that have not joined yet: they are no
  // part of the round that would open, so nothing would notice them go, and one cut off
  // after its Restart could be counted here and by the other side's takeover too
  // (docs/multinode.md). With `heard`, those are counted too (hears_majority()).
  std::set<std::string_view> present;
  for (const auto* m : {&joined_, &standby_, &rejoining_})
    if (m != &rejoining_ || heard)
      for (const auto& [s, n] : *m)
        if (std::find(voters.begin(), voters.end(), n.join.agent_id) != voters.end()) present.insert(n.join.agent_id);
  return static_cast<int>(present.size());
}

std::optional<Job::Tally> Job::short_of_majority(bool heard) const {
  if (!quorum_ || voters_.empty() || (round_ == 0 && !took_over_)) return std::nullopt;
  for (const auto* set : {&voters_, &prev_voters_, &adopted_voters_}) {
    if (set->empty()) continue;
    const int voters = static_cast<int>(set->size());
    const int joined = voters_joined(*set, heard);
    // Two voters: no side of a cut between them has a majority. The side that kept the
    // rendezvous host goes on (the arbiter's side); a node that took the job over goes on
    // only after it saw its host's connection close (its agent is gone, its machine
    // answered), never after silence (docs/multinode.md, "Network partitions"). Not for a
    // newer epoch's voters (adopt_voters()): this host was not that epoch's host.
    const bool ok = voters <= 2 && set != &adopted_voters_ ? joined >= 1 && (!took_over_ || voters_host_closed_)
                                                           : 2 * joined > voters;
    if (!ok) return Tally{joined, voters, set == &prev_voters_};
  }
  return std::nullopt;
}

bool Job::hears_majority() const {
  // A node that took the job over waits for survivors whose own searches take up to
  // keep-alive x attempts after they noticed the loss: until the seed's deadline their places
  // are kept, and this side is not short of them yet (its shortfall, and with it the host's
  // seeking, counts from there; review s38).
  if (takeover_ && !finished()) return true;
  return !short_of_majority(/*heard=*/true);
}

void Job::adopt_voters(const proto::Join& j) {
  // Only a newer epoch of this job's run: another run's epochs count from 1 again, and its
  // voters may no longer exist (#34).
  if (!quorum_ || j.resume_round > 0 || j.voters.empty() || other_run(j) ||
      j.epoch <= std::max(last_round_epoch_, adopted_epoch_))
    return;
  adopted_voters_ = j.voters;
  adopted_epoch_ = j.epoch;
}

}  // namespace mg::rdzv
