// Epochs and runs of rdzv::Job (rendezvous/job.h; docs/multinode.md, "Network partitions" and
// "Runs", #34): the epoch block a takeover starts, the run identity minted where a job is
// first created and learnt from newer joiners, and the takeover seed that carries both.
#include <algorithm>
#include <chrono>
#include <map>
#include <random>
#include <set>
#include <string_view>
#include <tuple>

#include <fmt/format.h>

#include "rendezvous/job.h"

namespace mg::rdzv {

int takeover_epoch(int seed_epoch, int host_rank) {
  const long long rank = std::clamp<long long>(host_rank, 0, static_cast<long long>(proto::kMaxListedNodes) - 1);
  const long long e = (std::max(0, seed_epoch) / kEpochBlock + 2LL) * kEpochBlock + rank + 1;
  return static_cast<int>(std::min<long long>(e, INT32_MAX));
}

std::string mint_run(std::int64_t unix_ms, std::uint64_t random) {
  return fmt::format("{}-{:016x}", std::max<std::int64_t>(0, unix_ms), random);
}

std::string new_run() {
  std::random_device rd;
  const std::uint64_t random = (std::uint64_t{rd()} << 32) ^ rd();
  return mint_run(std::chrono::duration_cast<std::chrono::milliseconds>(
                      std::chrono::system_clock::now().time_since_epoch()).count(),
                  random);
}

bool run_older(const std::string& a, const std::string& b) {
  const auto key = [](const std::string& r) {
    const auto dash = std::min(r.find('-'), r.size());
    std::string_view ms = std::string_view(r).substr(0, dash), hex = std::string_view(r).substr(dash);
    ms.remove_prefix(std::min(ms.find_first_not_of('0'), ms.size()));  // numbers: by length, then digits
    return std::tuple{ms.size(), ms, hex.size(), hex};
  };
  return key(a) < key(b);
}

void Job::settle_run(const std::vector<std::pair<SessionId, Node>>& nodes) {
  // Its nodes ran the job before this server knew it (a daemon restarted between rounds,
  // without a journal): their run goes on, at their epochs (learn_epoch() in close_round()),
  // not one minted here (on a clock behind theirs it would be older than all of them, and
  // mgtrain exits 4 for a writer of an older run than its checkpoint's). When they disagree,
  // the nodes of the other runs are leftovers: the run most of them name goes on, the newest
  // by its MS only among as many, since a leftover's run minted on a clock that ran ahead is
  // newest by MS (review s38-late L2).
  run_open_ = false;
  std::map<std::string_view, int> named;
  for (const auto& [s, n] : nodes)
    if (!n.join.run.empty()) ++named[n.join.run];
  const std::pair<const std::string_view, int>* best = nullptr;
  for (const auto& r : named)
    if (!best || r.second > best->second || (r.second == best->second && run_older(std::string(best->first), std::string(r.first))))
      best = &r;
  if (best) run_ = std::string(best->first);
}

void Job::learn_epoch(const proto::Join& j) {
  // Epochs compare only within one run: a leftover agent of an earlier run of the job id
  // (epochs count from 1 again in each run) neither raises this run's epoch nor switches the
  // job to its own run (#34, docs/multinode.md "Runs").
  if (other_run(j)) return;
  if (j.epoch > epoch_ && run_.empty()) run_ = j.run;
  epoch_ = std::max(epoch_, j.epoch);
}

std::optional<Actions> Job::join_of_other_run(SessionId s, const proto::Join& j, Clock::time_point now) {
  // The run a restarted daemon's journal says ended: a node that re-registers it missed the
  // end (the daemon died after it journaled it, before the node heard it) and hears it now.
  if (!ended_run_.empty() && j.run == ended_run_ && (j.resume_round > 0 || j.resume_standby))
    return Actions{{s, ended_abort_ ? proto::to_wire(*ended_abort_) : proto::to_wire(proto::Done{})}};
  if (j.resume_round > 0) return std::nullopt;  // weighed whole: check_resume(), resume_after_outage()
  // A fresh job an agent hosts (no round closed, nothing taken over) and a node that ran
  // rounds of another run: the agent that hosted that run was started again at its endpoint.
  // Folded in, the node would make this server's new run the job's, newer than the one
  // the majority runs on elsewhere (mgtrain refuses the older run's writes): refused
  // (review s38 L2). A restarted node finds that run from its record (launcher/job_record.h).
  if (quorum_ && round_ == 0 && !takeover_ && j.epoch > 0)
    return Actions{{s, proto::to_wire(proto::Error{fmt::format(
                    "job '{}': this node ran epoch {} of run {}, and the agent hosting here was started again "
                    "and hosts a new run ({}) that ran no round: the job goes on elsewhere; start this node's "
                    "agent again to rejoin it",
                    id_, j.epoch, j.run, run_)})}};
  // Else it joins as a plain newcomer: its epoch, voters and group rank are that run's, and
  // compare with none of this one's (#34).
  proto::Join plain = j;
  plain.epoch = 0;
  plain.voters.clear();
  plain.last_group_rank = -1;
  plain.run.clear();
  return join(s, plain, now);
}

void Job::rebuild_run(const proto::Join& j) {
  // No round ran with the run this server minted (a round re-registers only with a job that
  // has none, check_resume()): the job is its nodes' run, and its epochs theirs.
  // One that claims none (an agent before #37) leaves the run open: the first named is taken.
  if (!j.run.empty()) {
    run_ = j.run;
    run_open_ = false;
  }
  learn_epoch(j);
  last_round_epoch_ = epoch_;
}

bool Job::newer_than_rebuild(const proto::Join& j) const {
  if (!rebuilding_ || state_ != State::kRunning || members_.empty()) return false;
  if (other_run(j)) return false;  // rounds compare within one run: hold_other_run()
  return std::pair(j.resume_restart_count, j.resume_round) > std::pair(restart_count_, round_);
}

Actions Job::drop_rebuild(const proto::Join& j) {
  const auto why = proto::to_wire(proto::Error{
      fmt::format("job '{}': round {} (restart {}) is over: the job went on to round {} (restart {}) without this node",
                  id_, round_, restart_count_, j.resume_round, j.resume_restart_count)});
  Actions out;
  for (const auto& [m, n] : members_) out.push_back({m, why});
  members_.clear();
  placed_.clear();
  state_ = State::kJoining;
  round_ = 0;
  expected_members_ = 0;
  rebuilding_ = false;
  return out;
}

std::optional<Actions> Job::hold_other_run(SessionId s, const proto::Join& j, Clock::time_point now) {
  // A daemon's live rebuild of run R (the first re-registration named it) and a node that
  // re-registers run T: one of them is a leftover of an earlier run (first back, or late).
  // The run more nodes claim wins, so the claim waits (held_) and is counted; it replaces the
  // rebuild only once more nodes claim T than R's rebuild holds (as many: the newer by its
  // MS), never for one node (review s38-late L2: a clock-ahead leftover's newer MS dropped a
  // live rebuild, every member told Error). Still held when the rebuild is over: refused.
  if (quorum_ || !rebuilding_ || state_ != State::kRunning || members_.empty() || !other_run(j) ||
      held_.size() >= static_cast<std::size_t>(proto::kMaxNodes))
    return std::nullopt;
  held_[s] = {j, now};
  std::set<std::string_view> claims;
  for (const auto& [h, n] : held_)
    if (n.join.run == j.run) claims.insert(n.join.agent_id);
  const std::size_t live = members_.size();
  if (claims.size() < 2 || claims.size() < live || (claims.size() == live && !run_older(run_, j.run))) return Actions{};
  Actions out = drop_rebuild(j);
  run_ = j.run;  // and its epochs: the dropped run's compare with none of these
  epoch_ = last_round_epoch_ = 0;
  std::vector<std::pair<SessionId, Node>> take;
  for (auto it = held_.begin(); it != held_.end();)
    if (it->second.join.run == j.run) {
      take.emplace_back(it->first, std::move(it->second));
      it = held_.erase(it);
    } else {
      ++it;
    }
  for (const auto& [h, n] : take) {
    auto more = join(h, n.join, now);
    out.insert(out.end(), std::make_move_iterator(more.begin()), std::make_move_iterator(more.end()));
  }
  return out;
}

Actions Job::refuse_held(Actions out) {
  for (const auto& [s, n] : held_)
    out.push_back({s, proto::to_wire(proto::Error{fmt::format(
                          "job '{}': re-registration refused: its run {} is not the rebuilt round's ({}), which more "
                          "of the job's nodes re-registered",
                          id_, n.join.run, run_)})});
  held_.clear();
  return out;
}

void Job::take_over(const TakeoverSeed& seed, Clock::time_point now) {
  round_ = seed.round;
  restart_count_ = seed.restart_count;
  restart_reason_ = seed.reason;
  restart_host_ = lost_host_ = seed.lost_host;
  state_ = State::kRestarting;
  first_join_ = last_activity_ = now;
  takeover_ = seed;
  takeover_reserved_ = std::max(0, seed.survivors);
  // close_round() adds one: the first epoch of this host is takeover_epoch(), never one the
  // lost host (or another node that took the same round over) mints.
  epoch_ = std::max(epoch_, takeover_epoch(seed.epoch, seed.host_rank) - 1);
  last_round_epoch_ = seed.epoch;
  if (!seed.run.empty()) run_ = seed.run;  // one run on both sides of a split
  run_open_ = false;
  voters_ = seed.voters;
  prev_voters_ = seed.prev_voters;
  adopted_voters_.clear();
  adopted_epoch_ = 0;
  took_over_ = true;
  voters_host_closed_ = seed.host_closed;
  auto& e = emit(JobEvent::Kind::kTakeover);
  e.host = seed.lost_host;
  e.why = seed.reason;
}

}  // namespace mg::rdzv
