// The text and JSON of rdzv::Job's events (JobEvent, rendezvous/job.h): the server's log
// lines, the agent's notices and the daemon's journal (rendezvous/journal.h).
#include <cstddef>
#include <string>

#include <fmt/format.h>

#include "rendezvous/job.h"

namespace mg::rdzv {

namespace {
constexpr const char* kKindNames[] = {"created", "joined", "standby", "round_started", "worker_failed", "node_lost",
                                      "standby_lost", "restart", "promoted", "takeover", "done", "failed", "no_quorum"};

// "HOST (ADDR, agent ID)", or what of it is known.
std::string node_text(const JobEvent& e) {
  std::string s = e.host.empty() ? "a node" : "node " + e.host;
  if (!e.addr.empty() && !e.agent.empty()) s += fmt::format(" ({}, agent {})", e.addr, e.agent);
  else if (!e.addr.empty()) s += fmt::format(" ({})", e.addr);
  return s;
}
}  // namespace

const char* kind_name(JobEvent::Kind k) { return kKindNames[static_cast<int>(k)]; }

std::string text_of(const JobEvent& e) {
  using K = JobEvent::Kind;
  const std::string job = fmt::format("job '{}'", e.job);
  switch (e.kind) {
    case K::kCreated:
      return fmt::format("{} created by {}: --nnodes={}:{}, --max_restarts={}{}", job, node_text(e), e.min_nodes,
                         e.max_nodes, e.max_restarts,
                         e.how == "re-registered" ? fmt::format(" (re-registered its round {})", e.round) : "");
    case K::kJoined:
      if (e.how == "re-registered")
        return fmt::format("{}: {} re-registered round {} (restart {})", job, node_text(e), e.round, e.restart_count);
      if (e.how == "reconnected")
        return fmt::format("{}: {} re-registered round {} after losing its connection", job, node_text(e), e.round);
      if (e.how == "survivor")
        return fmt::format("{}: {} re-joined for round {} (restart {})", job, node_text(e), e.round + 1, e.restart_count);
      return fmt::format("{}: {} joined, active, for round {}", job, node_text(e), e.round + 1);
    case K::kStandby:
      return fmt::format("{}: {} joined as standby {} (the round is full)", job, node_text(e), e.position);
    case K::kRoundStarted: {
      std::string listed;
      for (const auto& [host, addr] : e.members) listed += fmt::format("{}{} ({})", listed.empty() ? "" : ", ", host, addr);
      if (static_cast<std::size_t>(e.nodes) > e.members.size())
        listed += fmt::format(" and {} more", static_cast<std::size_t>(e.nodes) - e.members.size());
      return fmt::format("{}: round {} started (restart {} of {}): {} node{}, world size {}: {}", job, e.round,
                         e.restart_count, e.max_restarts, e.nodes, e.nodes == 1 ? "" : "s", e.world_size, listed);
    }
    case K::kWorkerFailed:
      // A node that failed as a whole (stopped by a signal) has no rank (#35).
      return fmt::format("{}: {}{} failed with exit code {}{}: {}", job,
                         e.rank >= 0 ? fmt::format("rank {} on ", e.rank) : std::string(), node_text(e), e.exit_code,
                         e.signal > 0 ? fmt::format(" (signal {})", e.signal) : "", e.why);
    case K::kNodeLost:
      return fmt::format("{}: {} lost ({}): {}", job, node_text(e), e.cause, e.why);
    case K::kStandbyLost:
      return fmt::format("{}: standby {} left: {}", job, node_text(e).substr(5), e.why);
    case K::kRestart:
      if (e.cause == "scale-up")
        return fmt::format("{}: restart without spending one (restarts {} of {}): {}", job, e.restart_count,
                           e.max_restarts, e.why);
      return fmt::format("{}: restart {} of {}: {}", job, e.restart_count, e.max_restarts, e.why);
    case K::kPromoted:
      return fmt::format("{}: standby {} promoted into round {}{}", job, node_text(e).substr(5), e.round + 1,
                         e.replaces.empty() ? "" : fmt::format(" in place of lost node {}", e.replaces));
    case K::kTakeover:
      return fmt::format("{} taken over after round {} (restart {} of {} next): {}", job, e.round, e.restart_count,
                         e.max_restarts, e.why);
    case K::kDone:
      return fmt::format("{} done: round {}, {} node{}, {} restart{} spent", job, e.round, e.nodes,
                         e.nodes == 1 ? "" : "s", e.restart_count, e.restart_count == 1 ? "" : "s");
    case K::kFailed:
      return fmt::format("{} failed at round {} (restart {} of {}): root cause: {}", job, e.round, e.restart_count,
                         e.max_restarts, e.why);
    case K::kNoQuorum:
      return fmt::format("{}: round {} waits for a majority of the job's {} voters{}: {} of them joined or standing by, {} needed (the "
                         "others are lost or cut off; no round runs without a majority{})",
                         job, e.round + 1, e.voters, e.previous_voters ? " of the epoch before" : "", e.nodes, e.voters / 2 + 1,
                         e.previous_voters ? "; the voters changed, so the old set's majority is needed too" : "");
  }
  return job;
}

nlohmann::json json_of(const JobEvent& e) {
  using K = JobEvent::Kind;
  nlohmann::json j = {{"event", kind_name(e.kind)}, {"job", e.job}, {"round", e.round}, {"restart_count", e.restart_count}};
  if (!e.host.empty()) j["host"] = e.host;
  if (!e.addr.empty()) j["addr"] = e.addr;
  if (!e.agent.empty()) j["agent"] = e.agent;
  if (!e.run.empty() && (e.kind == K::kCreated || e.kind == K::kRoundStarted || e.kind == K::kTakeover ||
                         (e.kind == K::kJoined && e.how == "re-registered"))) {
    j["run"] = e.run;
    if (e.epoch > 0) j["epoch"] = e.epoch;
  }
  switch (e.kind) {
    case K::kCreated:
      j["min_nodes"] = e.min_nodes;
      j["max_nodes"] = e.max_nodes;
      j["max_restarts"] = e.max_restarts;
      j["how"] = e.how.empty() ? "new" : e.how;
      break;
    case K::kJoined: j["how"] = e.how; j["role"] = "active"; break;
    case K::kStandby: j["position"] = e.position; j["role"] = "standby"; break;
    case K::kRoundStarted:
      j["nodes"] = e.nodes;
      j["world_size"] = e.world_size;
      j["members"] = nlohmann::json::array();
      for (const auto& [host, addr] : e.members) j["members"].push_back({{"host", host}, {"addr", addr}});
      break;
    case K::kWorkerFailed:
      j["rank"] = e.rank >= 0 ? nlohmann::json(e.rank) : nlohmann::json();  // none: the node as a whole
      j["exit_code"] = e.exit_code;
      j["signal"] = e.signal;
      j["why"] = e.why;
      break;
    case K::kNodeLost: j["cause"] = e.cause; j["why"] = e.why; break;
    case K::kStandbyLost: j["why"] = e.why; break;
    case K::kRestart: j["max_restarts"] = e.max_restarts; j["cause"] = e.cause; j["why"] = e.why; break;
    case K::kPromoted: j["replaces"] = e.replaces; break;
    case K::kTakeover: j["max_restarts"] = e.max_restarts; j["why"] = e.why; break;
    case K::kDone: j["nodes"] = e.nodes; break;
    case K::kNoQuorum:
      j["nodes"] = e.nodes;
      j["voters"] = e.voters;
      j["previous_voters"] = e.previous_voters;
      break;
    case K::kFailed:
      j["max_restarts"] = e.max_restarts;
      j["rank"] = e.rank >= 0 ? nlohmann::json(e.rank) : nlohmann::json();
      j["exit_code"] = e.exit_code;
      j["why"] = e.why;
      break;
  }
  return j;
}

}  // namespace mg::rdzv
