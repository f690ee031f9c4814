// Rendezvous messages: one struct per message type, each with its wire type and
// nlohmann to_json/from_json (missing fields take their defaults, so an added field does
// not break an older peer of the same protocol version). to_frame()/from_frame() are
// pure; from_frame() throws ProtocolError on a wrong type, a malformed payload, a number
// that is not a 32-bit integer, or a field outside its range (validate(), limits.h), so
// nothing a peer sends reaches the state machines unchecked.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "proto/frame.h"
#include "proto/limits.h"

namespace mg::proto {

struct ProtocolError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

enum class MsgType : std::uint8_t {
  kHello = 1,       // client -> server, first message: job id and the client's nonce
  kChallenge = 2,   // server -> client when a token is configured: nonce and server proof
  kAuth = 3,        // client -> server: the client's proof
  kWelcome = 4,     // server -> client: handshake done
  kJoin = 5,        // client -> server: join (or re-join) a job's next round
  kAssignment = 6,  // server -> client: this node's place in the round
  kHeartbeat = 7,   // client -> server every keep_alive_interval; the server echoes it
  kWorkerFailed = 8,
  kNodeDone = 9,    // client -> server: every local worker exited 0
  kRestart = 10,    // server -> client: stop workers and re-join
  kAbort = 11,      // server -> client: stop workers, exit with the root cause
  kDone = 12,       // server -> client: every node finished
  kError = 13,      // either way: a refusal; the sender closes
  kStandby = 14,    // server -> client: the round is full; wait registered for a place
  kNotHosting = 15,  // a takeover socket -> client, for its Hello: alive, hosting nothing; it closes
};

struct Hello {
  static constexpr MsgType kType = MsgType::kHello;
  std::string agent_id;
  std::string job_id;  // the session serves this job only; its key is derived from it
  std::string nonce;   // hex, 32 random bytes
  // The client reads NotHosting (review s39-listen M3). A takeover socket that does not
  // host answers NotHosting only to such a Hello; an older client's (false: the field is
  // absent) waits unanswered until the socket hosts, for the client's one keep-alive
  // interval at most (60 s: ServerOptions::held_timeout); its refused connect was retried
  // to the search's deadline, interval x attempts, and let it wait to rejoin (review
  // s40-tidy M1: docs/multinode.md says what an older survivor loses).
  bool reads_not_hosting = false;
};
struct Challenge {
  static constexpr MsgType kType = MsgType::kChallenge;
  std::string nonce;  // hex, 32 random bytes
  std::string proof;  // hex: the server knows the job key (rendezvous/auth.h)
};
struct Auth {
  static constexpr MsgType kType = MsgType::kAuth;
  std::string mac;  // hex: the client knows the job key
};
struct Welcome {
  static constexpr MsgType kType = MsgType::kWelcome;
  std::string server;
  // The host name of the agent whose built-in server this is (c10d-style hosting); empty
  // for the mglaunch-rdzv daemon. A daemon that goes away may come back (its clients wait
  // for it until join_timeout); an agent that goes away does not.
  std::string host_agent;
  // The job on this server (#34), for a host without a majority that looks for the job
  // elsewhere (rendezvous/client_machine.h, "Seeking"): the epoch of the round it runs now
  // (0: none runs: joining, restarting, waiting for a majority) and its epoch as it stands
  // (Job::epoch(): a node that took the job over counts from its own block). 0 from a server
  // before this field, or for a job it does not know yet. Not signed (as host_agent).
  int round_epoch = 0;
  int epoch = 0;
  // The epoch of the last round this host opened or took over (Job::last_round_epoch()): a
  // host without a majority leaves for one that "precedes" it only when both lead the same
  // last round (review s36 H1). 0 from a server before this field.
  int last_round_epoch = 0;
  // The job's rendezvous run (Assignment::run; empty: the server knows no such job yet, or
  // it is before this field): an agent restarted on a node of the job joins a server its
  // record names only when that server runs the same run (launcher/job_record.h, #34 H1).
  // Not signed (as host_agent).
  std::string run{};
};
struct Join {
  static constexpr MsgType kType = MsgType::kJoin;
  std::string job_id;
  std::string agent_id;
  std::string host;
  std::string addr;      // advertised address (MASTER_ADDR if this node gets group rank 0)
  int nproc = 1;
  int node_rank = -1;    // explicit --node_rank, -1 when not given
  int min_nodes = 1;
  int max_nodes = 1;
  int max_restarts = 0;
  int master_port = 0;   // a port this node found free
  int last_call_ms = 30000;
  int join_timeout_ms = 600000;
  int keep_alive_ms = 5000;
  int keep_alive_max_attempt = 3;
  // Re-registration after the server restarted: the round this node is running (0: none).
  int resume_round = 0;
  int resume_group_rank = -1;
  int resume_group_world_size = 0;
  int resume_restart_count = 0;
  bool resume_done = false;  // this node's workers already finished the round
  // Re-registration of a standby (no round of its own) after the server restarted.
  bool resume_standby = false;
  // The port this node would host the job on if its hosting agent were lost (bound, not
  // listening, until then); 0: none (the node hosts already, or cannot).
  int takeover_port = 0;
  // The vote socket of a node that hosts (its takeover socket, bound on while it hosts and
  // answering "not hosting" as any node's does): where a restarted node's recall counts the
  // host among the voters (review s40-recall M1). 0: none (not hosting, or an older agent).
  int vote_port = 0;
  // Joining the node that took a job over after its host was lost: this node's group rank
  // in the last round (-1: none), which the new host keeps (Job::keep_places).
  int last_group_rank = -1;
  // The highest epoch this node was told (Assignment::epoch; 0: none): a node that takes a
  // job over, or a restarted daemon rebuilding a round, goes on from the highest (#34).
  int epoch = 0;
  // The voters of that epoch as this node was told them (Assignment::voters; empty: none,
  // or left out of a join sent before the welcome that would not fit its frame). A host
  // whose last round is older counts a majority of them too (Job, review s36 H1).
  std::vector<std::string> voters;
  // The rendezvous run of that epoch (Assignment::run; empty: none told): a restarted
  // daemon rebuilding a round keeps the run its nodes ran (#37).
  std::string run;
};
struct Assignment {
  static constexpr MsgType kType = MsgType::kAssignment;
  int round = 0;
  int group_rank = 0;
  int group_world_size = 1;
  int rank_offset = 0;
  int world_size = 1;
  std::string master_addr;
  int master_port = 0;
  int restart_count = 0;
  std::vector<std::string> nodes;  // advertised addresses by group rank
  std::vector<int> takeover_ports;  // by group rank, as nodes (Join::takeover_port); empty: none listed
  int standbys = 0;  // the job's standby nodes when the round closed (Heartbeat::standbys keeps it current)
  // The round's epoch: monotonic per job, also across a takeover and a daemon restart (#34);
  // workers see it as MGLAUNCH_EPOCH. 0: not told (a server before #34).
  int epoch = 0;
  // The job's voters for this epoch (agent ids): the round's nodes by group rank, then the
  // standbys registered when it closed. A new round after a node was lost, and a takeover,
  // need a majority of them (docs/multinode.md, "Network partitions"). Empty: not listed
  // (more than kMaxListedNodes, or a server before #34).
  std::vector<std::string> voters;
  // The standbys among those voters (after the nodes, in order): their advertised addresses
  // and takeover ports (Join::addr, Join::takeover_port), so that a node's record names every
  // voter that can answer a restarted node's recall (review s39-late M1). Listed with the
  // voters only; empty: none, or a server before them (older clients ignore both).
  std::vector<std::string> standby_nodes;
  std::vector<int> standby_takeover_ports;
  // The hosting agent's vote address among the voters (Join::vote_port of a voter that
  // offers no takeover port), so that a recall can count the host; never a takeover
  // candidate (takeover_ports keeps 0 for it). Empty/0: none (an older host or server).
  std::string host_vote_addr;
  int host_vote_port = 0;
  // The rendezvous run (run_problem()): minted once when the job's rdzv::Job was created,
  // kept through a takeover and a daemon restart, new for a new run of the same job id (a
  // rerun, a requeue). Workers see it as MGLAUNCH_RUN beside MGLAUNCH_EPOCH: epochs compare
  // only within one run (#37). Empty: not told (a server before #37).
  std::string run;
};
struct Heartbeat {
  static constexpr MsgType kType = MsgType::kHeartbeat;
  int round = 0;
  // Server -> client only: the job's standby nodes, in the echo and pushed to the running
  // nodes when the count changes, so that a survivor of its host's loss counts them (#26).
  int standbys = 0;
};
struct WorkerFailed {
  static constexpr MsgType kType = MsgType::kWorkerFailed;
  int round = 0;
  std::string host;
  int rank = 0;
  int local_rank = 0;
  int exit_code = 1;
  int signal = 0;
  std::string message;
  std::vector<std::string> last_lines;
};
struct NodeDone {
  static constexpr MsgType kType = MsgType::kNodeDone;
  int round = 0;
};
struct Restart {
  static constexpr MsgType kType = MsgType::kRestart;
  int restart_count = 0;
  std::string reason;
};
struct Abort {
  static constexpr MsgType kType = MsgType::kAbort;
  WorkerFailed root_cause;
  std::string reason;
  // The job ends for good. False where the job may go on elsewhere: a minority's "no
  // majority within join_timeout" (the majority's side goes on), a takeover's shortfall
  // (the host lost may be only cut off). Agents keep their record of the job then
  // (launcher/job_record.h). Absent (an older server): true.
  bool final = true;
};
struct Done {
  static constexpr MsgType kType = MsgType::kDone;
};
struct Error {
  static constexpr MsgType kType = MsgType::kError;
  std::string message;
};
// The round is full: this node stays registered (heartbeats) as a standby until a place
// frees (then an Assignment comes, at once) or the job ends (Done or Abort). Sent again
// whenever a round closes without it, so that it always holds the running round's
// takeover candidates: a standby follows a takeover of its lost hosting agent (#26).
struct Standby {
  static constexpr MsgType kType = MsgType::kStandby;
  int active_nodes = 0;  // nodes in the running round
  int position = 1;      // this node's place among the standbys (1: taken first)
  int round = 0;         // the running (or last) round; 0: none yet
  int restart_count = 0;  // of that round
  std::vector<std::string> nodes;   // that round's advertised addresses by group rank (Assignment::nodes)
  std::vector<int> takeover_ports;  // by group rank, as nodes (Assignment::takeover_ports)
  int epoch = 0;                     // that round's (Assignment::epoch)
  std::vector<std::string> voters;   // that round's (Assignment::voters)
  std::string run;                   // the job's (Assignment::run)
  std::vector<std::string> standby_nodes;    // that round's (Assignment::standby_nodes)
  std::vector<int> standby_takeover_ports;   // that round's (Assignment::standby_takeover_ports)
  std::string host_vote_addr;                // that round's (Assignment::host_vote_addr)
  int host_vote_port = 0;                    // that round's (Assignment::host_vote_port)
};

// The answer of an agent's takeover socket that does not host (#34, review s38 M2): the
// agent lives, and it is a node of `job_id` in `run` ("": no round yet), hosting nothing. Sent
// for a Hello, then the socket closes. `proof` (with a token): HMAC of the job's key over the
// client's nonce and the run (auth::not_hosting_proof), so that only an agent that holds the
// key can tell a restarted node "no host of your run here". An agent before this message
// sees a message of an unexpected type before the welcome: a failed try of that target.
struct NotHosting {
  static constexpr MsgType kType = MsgType::kNotHosting;
  std::string job_id;
  std::string run;
  std::string host_agent;  // its host name
  std::string proof;       // hex; empty without a token
  // An agent restarted with a record of `run` that looks for it (its recall): the record's
  // epoch, the last round it was in (review s39 H1). Its proof covers both.
  bool recalling = false;
  int epoch = 0;
};

NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE_WITH_DEFAULT(NotHosting, job_id, run, host_agent, proof, recalling, epoch)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE_WITH_DEFAULT(Hello, agent_id, job_id, nonce, reads_not_hosting)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE_WITH_DEFAULT(Challenge, nonce, proof)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE_WITH_DEFAULT(Auth, mac)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE_WITH_DEFAULT(Welcome, server, host_agent, round_epoch, epoch, last_round_epoch, run)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE_WITH_DEFAULT(Join, job_id, agent_id, host, addr, nproc, node_rank, min_nodes,
                                                max_nodes, max_restarts, master_port, last_call_ms, join_timeout_ms,
                                                keep_alive_ms, keep_alive_max_attempt, resume_round, resume_group_rank, resume_group_world_size,
                                                resume_restart_count, resume_done, resume_standby, takeover_port,
                                                last_group_rank, epoch, voters, run, vote_port)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE_WITH_DEFAULT(Assignment, round, group_rank, group_world_size, rank_offset,
                                                world_size, master_addr, master_port, restart_count, nodes,
                                                takeover_ports, standbys, epoch, voters, run, standby_nodes,
                                                standby_takeover_ports, host_vote_addr, host_vote_port)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE_WITH_DEFAULT(Heartbeat, round, standbys)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE_WITH_DEFAULT(WorkerFailed, round, host, rank, local_rank, exit_code, signal,
                                                message, last_lines)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE_WITH_DEFAULT(NodeDone, round)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE_WITH_DEFAULT(Restart, restart_count, reason)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE_WITH_DEFAULT(Abort, root_cause, reason, final)
inline void to_json(nlohmann::json& j, const Done&) { j = nlohmann::json::object(); }
inline void from_json(const nlohmann::json&, Done&) {}
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE_WITH_DEFAULT(Error, message)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE_WITH_DEFAULT(Standby, active_nodes, position, round, restart_count, nodes,
                                                takeover_ports, epoch, voters, run, standby_nodes,
                                                standby_takeover_ports, host_vote_addr, host_vote_port)

// A rendezvous run (Assignment::run): "MS-HEX", the wall clock in ms since the Unix epoch
// when the job's rdzv::Job was created, then 16 random hex digits; runs order by MS, then
// HEX. "" when `run` is one (or empty: none), else what is wrong with it.
inline constexpr std::size_t kMaxRunBytes = 64;
std::string run_problem(const std::string& run);

// Field checks; an empty string means valid. Ranges and lengths are in limits.h; every
// text is valid UTF-8 without control characters (text_problem() in text.h).
std::string validate(const Hello& m);
std::string validate(const Challenge& m);
std::string validate(const Auth& m);
std::string validate(const Welcome& m);
std::string validate(const Join& m);
std::string validate(const Assignment& m);
std::string validate(const Heartbeat& m);
std::string validate(const WorkerFailed& m);
std::string validate(const NodeDone& m);
std::string validate(const Restart& m);
std::string validate(const Abort& m);
std::string validate(const Done& m);
std::string validate(const Error& m);
std::string validate(const Standby& m);
std::string validate(const NotHosting& m);

// Makes the free-text fields of a failure report valid for validate() (the sender's side
// of "cap every string"): message, last lines and host made printable() (a worker's stderr
// may hold any bytes) and cut to their limits.
void truncate_to_limits(WorkerFailed& m);
std::string truncate_text(std::string text, std::size_t max_bytes);

// Throws ProtocolError unless every number in `j` is an integer that fits in 32 bits
// (our messages carry no floats), so that no conversion below is out of range.
void check_numbers(const nlohmann::json& j);

template <typename T>
Frame to_frame(const T& msg) {
  return Frame{static_cast<std::uint8_t>(T::kType), nlohmann::json(msg)};
}

inline MsgType type_of(const Frame& f) { return static_cast<MsgType>(f.type); }

template <typename T>
T from_frame(const Frame& f) {
  if (type_of(f) != T::kType)
    throw ProtocolError("unexpected message type " + std::to_string(f.type) + ", expected " +
                        std::to_string(static_cast<int>(T::kType)));
  if (!f.payload.is_object()) throw ProtocolError("malformed message: the payload is not a map");
  check_numbers(f.payload);
  T msg;
  try {
    msg = f.payload.get<T>();
  } catch (const nlohmann::json::exception& e) {
    throw ProtocolError(std::string("malformed message: ") + e.what());
  }
  if (auto bad = validate(msg); !bad.empty()) throw ProtocolError("invalid message: " + bad);
  return msg;
}

}  // namespace mg::proto
