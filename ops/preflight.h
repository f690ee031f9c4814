// Preflight (`mglaunch --preflight`, `mglaunch doctor --preflight`; issue #26): before a
// multi-node job's workers start, its nodes check the network the job will use, over TCP
// between the addresses the rendezvous advertised (what Gloo on CPU uses), and name a slow
// or broken node in one line instead of letting the job hang or crawl.
//
// One run on every node, with the round's nodes by group rank:
//  1. Every node listens on its advertised address, port 0. Group rank 0 is the
//     coordinator: it listens on MASTER_PORT (free until its workers start; the others
//     know it from the assignment), the others connect there and say which port they
//     listen on; the coordinator hands out the table (a node that never comes is named).
//     With the job's key (Options::key) both sides prove it first; connections that never
//     say a valid hello are dropped without delaying anyone (see Options::key).
//  2. Node r connects to r+s for every shift s in 1, 2, 4, ... < n (log2 n connections);
//     the coordinator hears who could not reach whom, names the node nobody reaches, and
//     stops there or says go.
//  3. A ring all-reduce (reduce-scatter, then all-gather) of `allreduce_bytes` of floats
//     over the shift-1 ring, its result checked.
//  4. log2(n) timed rounds, one per shift s: each node sends `p2p_bytes` to r+s while it
//     receives from r-s (the recursive-doubling pattern): every node meets log2(n)
//     different partners, as sender and as receiver, in O(log n) rounds. A send begins
//     once its receiver says it is ready (one byte back on the data connection).
//  5. Every node reports to the coordinator, which judges (judge(), pure) and sends the
//     verdict to all.
// Every wait is bounded by `timeout`; each transfer is timed for at most `transfer_cap`.
// run() blocks its calling thread (the agent runs it on a thread of its own; tests and
// doctor run one thread per node); `cancel_fd` turning readable ends it early.
#pragma once

#include <chrono>
#include <cstddef>
#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace mg::preflight {

struct Options {
  int rank = 0;                    // this node's group rank
  std::vector<std::string> nodes;  // every node's advertised address, by group rank
  std::string coordinator_host;    // group rank 0's address (MASTER_ADDR)
  int coordinator_port = 0;        // rank 0 listens there (SO_REUSEADDR: beside the agent's hold)
  int coordinator_fd = -1;         // rank 0: a listening socket to use instead (not closed here)
  std::string job;                 // a node of another job is refused
  // The job key K_J (rendezvous/auth.h) when the job has a token, else empty. With it,
  // every node proves the key to the coordinator and the coordinator to it (the
  // rendezvous' handshake, under a key of this check's own derived from K_J and `job`),
  // every control message carries a MAC, and a data connection shows an HMAC of the
  // check's secret. Without it, a node is still named only from what its own connection
  // did: connections that never say a valid hello are dropped (at most 64 held, 2 s each,
  // side by side) and take neither a node's place nor the check's time.
  std::string key;
  std::size_t allreduce_bytes = 256 * 1024;
  std::size_t p2p_bytes = 4 * 1024 * 1024;  // per node and round
  std::chrono::milliseconds transfer_cap{500};
  std::chrono::milliseconds timeout{15000};
  double slow_fraction = 0.25;  // slow: below this fraction of the median link
  // Test hooks (documented in docs/flags.md: MGLAUNCH_PREFLIGHT_TEST_*): this node's sends
  // are paced to `send_rate` bytes a second (0: no limit); `unreachable`: its listener is
  // closed once its port is announced, so connections to it are refused.
  double send_rate = 0;
  bool unreachable = false;
  int cancel_fd = -1;
};

// What one node measured and saw (the coordinator gathers one per node).
struct Received {
  int from = 0;
  double bytes = 0;
  double seconds = 0;  // from the first byte to the last
};
struct NodeReport {
  int rank = 0;
  bool reported = false;               // the coordinator heard this node's report
  bool reached = false;                // it reached the coordinator at all
  std::vector<int> unreachable;        // peers it could not connect to
  std::vector<int> waited_on;          // peers whose data never came (timed out or reset)
  std::vector<std::string> errors;     // what went wrong, for the verdict's details
  double allreduce_s = -1;             // -1: not completed
  long long allreduce_wrong = 0;       // elements with a wrong sum
  std::vector<Received> received;
  // Strangers flooded this node's data port ("" : not seen): its accept queue was full when
  // its peers connected, or connections were turned away for want of room (what and from
  // where). A failure between nodes then names nobody.
  std::string flooded;
};
nlohmann::json to_json(const NodeReport& r);
NodeReport node_report_from_json(const nlohmann::json& j);  // throws nlohmann::json::exception

struct Verdict {
  bool ok = false;
  std::vector<int> named;  // group ranks named slow or broken
  std::string line;        // one line: the finding, or the figures when ok
  double allreduce_s = 0;  // the slowest node's all-reduce
  double median_rate = 0;  // bytes/s of the median directed link
};

// The rules, in order (the first that names a node decides):
//  - a node that never reached the coordinator, or never reported: broken;
//  (any rule below names nobody when a node's data port was flooded: NodeReport::flooded)
//  - a node that every peer tried and failed to connect to (its listener cannot be reached);
//    then a node that could connect to none of its peers;
//  - a node whose data its peers waited for in vain (most waited on);
//  - a wrong all-reduce sum: the nodes that got it named;
//  - slow: every directed link is rated bytes/s by its receiver; with M the median over all
//    links, a node whose fastest send is below `slow_fraction`·M sends slowly; a node whose
//    fastest receive from a sender not so named is below it receives slowly (with two
//    nodes a slow link is thus blamed on its sender).
// `seconds`: how long the whole check took, for the line. Pure.
Verdict judge(const std::vector<NodeReport>& reports, const std::vector<std::string>& nodes, double slow_fraction,
              double seconds);

struct Result {
  bool ok = false;
  std::string line;        // the verdict's line (every node gets the coordinator's)
  std::vector<int> named;
  double seconds = 0;      // on this node, from run() to the verdict
  nlohmann::json reports;  // the coordinator: every node's report; others: their own
};

// Runs this node's part. Never throws for what the network does (that is the verdict);
// throws std::invalid_argument for options that cannot work (rank outside nodes).
Result run(const Options& o);

// The shifts of step 2 and 4 for n nodes: 1, 2, 4, ... < n. Pure.
std::vector<int> shifts(int n);

// Runs `nodes` nodes in this process, one thread each, node r on addresses[r % size]
// (doctor, tests); returns the coordinator's result. `tweak(rank, options)` may change a
// node's options (tests: its hooks).
Result run_local(int nodes, const std::vector<std::string>& addresses, const Options& base = {},
                 const std::function<void(int, Options&)>& tweak = {});

}  // namespace mg::preflight
