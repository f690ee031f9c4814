// EtcdLink: the agent's rendezvous on etcd (--rdzv_backend=etcd). Storage and transport
// only; the rules are rendezvous::Job's, replayed from the job's event log (etcd_log.h).
//
// Threads: the agent's io_context owns the replay and every handler call; a request thread
// grants this agent's lease, appends events; a keep-alive thread renews this agent's lease
// and the job lease on its own connection (a slow append never starves it); a watch thread streams
// the job's keys (/v3/watch) and posts each change to the io_context. Start: lease, then
// a txn that clears a stale log (no agent alive), the job lease (made or read), and one txn
// that puts this agent's alive key and its join only while the job's lease key still names
// that lease (another agent starting at once may have cleared and replaced it), then a
// range of the job read in revision order, then the watch from the next revision. A vanished alive key becomes a "lost" event and a due deadline a "tick" event,
// each appended by a txn that holds only if the log did not move since this agent last
// looked (so the first agent to notice appends it once). close() revokes the lease and the
// last agent deletes the job's keys.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <mutex>
#include <set>
#include <string>
#include <thread>

#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/steady_timer.hpp>

#include "rendezvous/client.h"
#include "rendezvous/etcd_client.h"
#include "rendezvous/etcd_lease.h"
#include "rendezvous/etcd_log.h"
#include "rendezvous/link.h"

namespace mg::rdzv {

struct EtcdOptions {
  std::vector<etcd::Endpoint> endpoints;
  etcd::Credentials credentials;
  std::string prefix = "/mglaunch";
  proto::Join join;
};

class EtcdLink : public Link {
 public:
  EtcdLink(boost::asio::io_context& io, EtcdOptions opts, ClientHandlers handlers);
  ~EtcdLink() override;
  void start() override;
  void rejoin() override;
  void set_master_port(int port) override { opts_.join.master_port = port; }
  void worker_failed(proto::WorkerFailed f) override;
  void node_done(int round) override;
  void close() override;

 private:
  using Clock = std::chrono::steady_clock;
  struct Change {
    bool put = true;
    std::string key, value;
    std::int64_t revision = 0;
  };
  // io thread
  void on_changes(const std::vector<Change>& changes);
  void deliver(const proto::Frame& f);
  void append(etcd::Event e, bool conditional);
  void check();  // every 100 ms: a lost agent or a deadline to record, an etcd outage
  void lost(const std::string& why);
  void carry_out(const etcd::LeaseCommands& cmds);  // the lease guard's commands
  void append_join();  // under the current identity
  void resync(const std::vector<Change>& kvs);  // the job's keys as read at one revision
  std::int64_t now_ms() const;
  // request thread
  void request_loop();
  void request_steps();  // request_loop() but for saying that it ended
  bool start_sequence(etcd::Http& http);
  // Ranges the job's keys, posts them to resync(); returns the revision read (either thread).
  std::int64_t read_job(etcd::Http& http);
  void finish_job(etcd::Http& http);
  // The job lease (PREFIX/JOB/lease): created by the first agent, renewed by every one.
  void ensure_job_lease(etcd::Http& http);
  // Only this agent is alive and nobody live is left in the replayed job (a dead run's
  // log): delete the log and join a fresh one (request thread).
  void fresh_start(etcd::Http& http, etcd::Event join);
  void reset_replay(std::int64_t revision);  // io thread
  // A new lease and identity `id` (its lease gone): its alive key and its join in one txn.
  void reenter(etcd::Http& http, const std::string& id, const etcd::Event& join);
  std::int64_t grant_lease(etcd::Http& http);  // sets lease_ and ttl_s_; returns the new lease
  // keep-alive thread: both leases, on their own connection and timer
  void keep_alive_loop();
  // watch thread
  void watch_loop(std::int64_t from_revision);
  void post(std::function<void()> f);

  boost::asio::io_context& io_;
  EtcdOptions opts_;
  ClientHandlers h_;
  etcd::Keys keys_;
  std::string agent_;  // the agent's id: its log keys' component, whatever its identity
  // io thread: the identity in the job (agent_, then agent_~N after each re-entry: the job's
  // log keeps a lost agent lost) and the policy of its lease
  std::string self_;
  // This agent's new run, in every event it appends: the job's is the log's first (#37).
  const std::string run_ = new_run();
  std::string record(etcd::Event e) const;  // `e` as a log value (JSON), with run_
  int reentries_ = 0;
  etcd::LeaseGuard guard_;
  etcd::JobReplay replay_;
  boost::asio::steady_timer ticker_;
  std::optional<boost::asio::executor_work_guard<boost::asio::io_context::executor_type>> work_;
  std::set<std::string> alive_, pending_lost_, joined_agents_;
  bool conditional_in_flight_ = false;
  bool assigned_ = false;        // an assignment came since this agent's (last) join
  bool fresh_in_flight_ = false;
  std::int64_t seen_revision_ = 0;  // the last log revision applied
  bool started_ = false, closed_ = false, lost_ = false;
  std::shared_ptr<int> alive_token_ = std::make_shared<int>(0);

  // shared with the threads (mutex_)
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::function<void(etcd::Http&)>> queue_;
  bool stopping_ = false;  // finish the queue, then end
  bool requests_ended_ = false;  // the request thread is done (close() waits for it, kFlushBound at most)
  std::int64_t lease_ = 0;
  std::int64_t job_lease_ = 0;
  std::int64_t ttl_s_ = 0;
  std::atomic<std::int64_t> last_ok_ms_{0};  // steady clock: the last answer from etcd
  bool watch_stop_ = false;
  std::int64_t next_seq_ = 1;       // request thread only
  std::unique_ptr<etcd::Http> http_, watch_http_, keep_http_;
  std::thread requests_, watcher_, keeper_;
  bool keeper_stop_ = false;
};

}  // namespace mg::rdzv
