// Link: what the agent needs from a rendezvous backend, whatever stores the job: the own
// daemon (rendezvous/client.h, through LinkTo<Client>) or etcd (rendezvous/etcd_backend.h).
// Both report through the same ClientHandlers on the agent's io_context.
#pragma once

#include <chrono>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "proto/messages.h"
#include "rendezvous/record_fields.h"

namespace mg::rdzv {

// What a node that fenced itself reports for its round (`why` ends the message "node H (A)
// fenced itself: ..."): a node failure without a rank, so the job restarts or says it went on.
inline proto::WorkerFailed fence_failure(int round, const proto::Join& join, const std::string& why) {
  proto::WorkerFailed f;
  f.round = round;
  f.host = join.host;
  f.rank = -1;
  f.exit_code = 1;
  f.message = "node " + join.host + " (" + join.addr + ") fenced itself: " + why;
  return f;
}

class Link {
 public:
  virtual ~Link() = default;
  virtual void start() = 0;
  virtual void rejoin() = 0;
  virtual void set_master_port(int port) = 0;  // offered in later joins
  virtual void worker_failed(proto::WorkerFailed f) = 0;
  virtual void node_done(int round) = 0;
  virtual void close() = 0;  // flushes what is queued (a "done") first
  // The agent hosts the job and its server's next round waits for a majority (#34): the own
  // daemon's link looks for the job elsewhere (rdzv::Client); etcd has no host to leave.
  virtual void host_short_of_majority() {}
  // This node's record of an agent-hosted job (launcher/job_record.h, #34 H1): before
  // start(), the hosts to look for the job at first and its run (rdzv::ClientMachine's
  // Recall); job_hosts(), what a record names now (empty: nothing to record, as for a
  // daemon or etcd, which the agent finds again at their own address); job_decided(), the
  // job cannot go on (its end heard, Done or a final Abort, or its host lost with no
  // survivor able to take over), when the record goes; why_no_takeover_of_self(), why no
  // survivor could take over from this node, its host, if it stopped now ("": one could).
  virtual void recall(std::vector<std::pair<std::string, int>>, std::string, std::chrono::steady_clock::time_point,
                      int /*epoch*/, std::string /*record*/, int /*voters*/,
                      std::vector<std::pair<std::string, int>> /*voter_hosts*/, bool /*self_voter*/) {}
  virtual std::vector<std::pair<std::string, int>> job_hosts() const { return {}; }
  virtual int job_voters() const { return 0; }  // the last round's voters, for the record
  virtual int job_voters_epoch() const { return 0; }  // their epoch
  virtual int job_epoch() const { return 0; }  // the newest epoch this node was told (the record's)
  virtual bool job_self_voter() const { return true; }  // this node one of them
  virtual std::vector<std::pair<std::string, int>> job_voter_hosts() const { return {}; }  // their takeover addresses
  // What job_hosts() and the voters' getters would say once this node took `a`, its own
  // Assignment not heard yet: the hosting agent's first record is written from its own
  // server's round before that round goes out (review s41-a M2). nullopt: nothing to record.
  virtual std::optional<RecordFields> record_after(const proto::Assignment&) const { return std::nullopt; }
  virtual std::optional<RecordFields> record_after(const proto::Standby&) const { return std::nullopt; }  // (s41-d M1)
  virtual bool job_decided() const { return false; }
  virtual std::string why_no_takeover_of_self() const { return {}; }
};

// Adapts a backend with the same member functions (rdzv::Client) to Link.
template <class T>
class LinkTo : public Link {
 public:
  template <class... Args>
  explicit LinkTo(Args&&... args) : impl_(std::forward<Args>(args)...) {}
  void start() override { impl_.start(); }
  void rejoin() override { impl_.rejoin(); }
  void set_master_port(int port) override { impl_.set_master_port(port); }
  void worker_failed(proto::WorkerFailed f) override { impl_.worker_failed(std::move(f)); }
  void node_done(int round) override { impl_.node_done(round); }
  void close() override { impl_.close(); }
  void host_short_of_majority() override { impl_.host_short_of_majority(); }
  void recall(std::vector<std::pair<std::string, int>> hosts, std::string run,
              std::chrono::steady_clock::time_point until, int epoch, std::string record, int voters,
              std::vector<std::pair<std::string, int>> voter_hosts, bool self_voter) override {
    impl_.recall(std::move(hosts), std::move(run), until, epoch, std::move(record), voters, std::move(voter_hosts),
                 self_voter);
  }
  std::vector<std::pair<std::string, int>> job_hosts() const override { return impl_.job_hosts(); }
  int job_voters() const override { return impl_.job_voters(); }
  int job_voters_epoch() const override { return impl_.job_voters_epoch(); }
  int job_epoch() const override { return impl_.job_epoch(); }
  bool job_self_voter() const override { return impl_.job_self_voter(); }
  std::vector<std::pair<std::string, int>> job_voter_hosts() const override { return impl_.job_voter_hosts(); }
  std::optional<RecordFields> record_after(const proto::Assignment& a) const override { return impl_.record_after(a); }
  std::optional<RecordFields> record_after(const proto::Standby& s) const override { return impl_.record_after(s); }
  bool job_decided() const override { return impl_.job_decided(); }
  std::string why_no_takeover_of_self() const override { return impl_.why_no_takeover_of_self(); }

 private:
  T impl_;
};

}  // namespace mg::rdzv
