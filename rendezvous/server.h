// Server: the rendezvous daemon's core, embeddable in an agent. One acceptor, a session
// per connection (handshake: Hello names the job, then with a token a mutual HMAC proof of
// the job's key and MACs on every later frame), many jobs keyed by rdzv id, and a 100 ms
// tick that drives the jobs' timers and the per-connection deadlines. Runs on the caller's
// io_context; stop() closes everything. Nothing a peer sends ends the server: every
// message is validated, each session's failure closes that session only, and
// connections, frames, per-address use, authentication failures and memory are bounded.
#pragma once

#include <algorithm>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>

#include <deque>

#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/steady_timer.hpp>

#include "proto/accept_backoff.h"
#include "rendezvous/challenge_rate.h"
#include "rendezvous/connection.h"
#include "rendezvous/job.h"
#include "rendezvous/journal.h"

namespace mg::rdzv {

struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 0;
  std::string token;  // the daemon token; empty (and no job_tokens): no authentication
  // Without a daemon token: the keys of the only jobs served (an agent that holds just its
  // job's key and hosts the rendezvous).
  std::map<std::string, std::string> job_tokens;
  // Non-empty: serve this job only (an agent's built-in server).
  std::string only_job;
  // Non-empty: the host name of the agent this server is built into, told to every client
  // in its Welcome (proto::Welcome::host_agent).
  std::string host_agent;
  // The agent id (proto::Join::agent_id) of that agent: only its Join's vote_port is listed as
  // the host's vote socket (rdzv::Job::set_host_agent_id, review s41-b M1).
  std::string host_agent_id;
  // >= 0: a bound IPv4 socket, not listening yet, to listen on instead of binding
  // host:port (an agent taking over a lost host's job binds one at start); the server
  // owns it from the constructor on, even when that throws.
  int adopt_fd = -1;
  // An agent's takeover socket (#34, review s38 M2): it listens from the agent's start and
  // answers every Hello with proto::NotHosting (only_job, the run told by tell_run(), a proof
  // with the job's key) and closes, until host() or take_over(): then it serves the job on
  // the same socket, with no moment where a connect is refused. An older client's Hello
  // (without proto::Hello::reads_not_hosting) gets no answer until then (review s39-listen M3).
  bool not_hosting = false;
  std::size_t max_connections = 0;  // 0: what the descriptor limit allows; clamped below it
  std::size_t max_connections_per_address = 256;
  int max_nodes_per_job = 100000;
  std::size_t max_frame = proto::kDefaultMaxFrame;
  std::size_t max_memory = std::size_t{512} << 20;  // buffers and job state, bytes
  std::chrono::milliseconds handshake_timeout{10000};  // connect -> Welcome, and Welcome -> Join
  std::chrono::milliseconds frame_timeout{10000};      // first byte of a frame -> its last
  // An older client's Hello held unanswered by a takeover socket that does not host yet
  // (not_hosting) is closed this long after its connect (handshake_timeout if longer): its
  // client waits its keep_alive_interval for an answer, often longer than the handshake's
  // 10 s, and a close passes this node over sooner (review s40 L1). Its bytes are charged to
  // max_memory, its connection to the per-address cap.
  std::chrono::milliseconds held_timeout{60000};
  std::chrono::milliseconds idle_job_expiry{3600 * 1000};
  std::chrono::milliseconds orphan_job_expiry{60000};  // a job nobody is connected to
  std::chrono::milliseconds tick{100};
  std::function<void(const std::string&)> log;  // one line per event; may be empty
  // When set, every line goes here instead, as an object: {"event": KIND, "text": LINE, ...}.
  // A job's events (JobEvent) carry json_of()'s fields; every other line is {"event": "log"},
  // with "job" when it is about one.
  std::function<void(const nlohmann::json&)> log_json;
  // Every job event as recorded (beside the log line): an agent hosting its job watches for
  // the round that waits for a majority (JobEvent::Kind::kNoQuorum, #34). May be empty.
  std::function<void(const JobEvent&)> on_event;
  // Each frame a job's decision sends, just before it goes out (the tests check there that
  // its events are journaled first: the write-ahead, review s39 L4). May be empty.
  std::function<void(const proto::Wire&)> on_send;
  // Every decision's frames, after its events are journaled and before any goes out: the
  // hosting agent writes its first record of the job there, from its own Assignment, before
  // the other nodes hear the round (review s41-a M2), or from its own Standby (its session,
  // the second argument, Job::host_agent_session(): review s41-d M1). May be empty.
  std::function<void(const Actions&, SessionId)> before_send;
  // --state-dir: every job event is journaled there, and the jobs and events it holds from
  // before a restart are shown (jobs_json(), events_json(), history_json()).
  std::shared_ptr<Journal> journal;
};

class Server {
 public:
  // Binds and listens at once; throws std::runtime_error naming the address on failure.
  // Logs a warning when it listens beyond loopback without authentication.
  // Raises the descriptor soft limit to the hard one when max_connections (0: all it allows)
  // does not fit under it, and clamps max_connections below the limit.
  Server(boost::asio::io_context& io, ServerOptions opts);
  ~Server();
  int port() const { return port_; }
  std::string address() const;
  std::size_t max_connections() const { return opts_.max_connections; }
  // The Prometheus text exposition of the daemon's state and counters (/metrics); the
  // series that name jobs (job_nodes, job_standby_nodes, job_round, job_restarts) only with
  // `job_ids`.
  std::string metrics(bool job_ids = true) const;
  // For the status page: every job (Job::describe), and the events (log lines) after
  // sequence number `since`, oldest first, from a ring of the last 1000.
  // With a journal, jobs_json() also lists the jobs it holds that are not served now
  // ("journal": true: ended, or forgotten), and history_json(JOB) is that job's journaled
  // events (the last Journal::kMaxEventsPerJob), null when it has none.
  nlohmann::json jobs_json() const;
  nlohmann::json events_json(std::uint64_t since) const;
  nlohmann::json history_json(const std::string& job) const;
  // Serves `job_id` from now on as the survivors of its lost hosting agent left it (see
  // Job::take_over); before any of them joins.
  void take_over(const std::string& job_id, const TakeoverSeed& seed);
  // ServerOptions::not_hosting: the run its answers name (the agent's, at each assignment),
  // and the end of that mode (it serves only_job from now on).
  void tell_run(std::string run) {
    not_hosting_run_ = std::move(run);
    recalling_epoch_ = -1;
  }
  // Its answers say that this agent recalls `run` (its record's, at `epoch`), in no round yet.
  void tell_recalling(std::string run, int epoch) {
    not_hosting_run_ = std::move(run);
    recalling_epoch_ = std::max(0, epoch);
  }
  // ServerOptions::not_hosting for a socket that never hosts (the hosting agent's vote
  // socket): an older client's Hello is answered NotHosting at once, as a newer one's, and
  // those held until now too; never held (review s41-c L2: 8 held connections, renewed each
  // held_timeout, kept every recall from counting the host).
  void answer_older_hellos();
  void host();
  // From now on at most `n` connections open (those open stay; one more is refused as at
  // max_connections): an agent's takeover socket once the agent hosts at the endpoint too
  // (review s39-listen L3).
  void limit_connections(std::size_t n) { opts_.max_connections = std::min(opts_.max_connections, n); }
  // Job::hears_majority() of `job_id` (true for a job not served here).
  bool hears_majority(const std::string& job_id) const {
    const auto it = jobs_.find(job_id);
    return it == jobs_.end() || it->second.hears_majority();
  }
  // Stops accepting and closes every connection; with `flush`, after its queued frames
  // (a decision just broadcast) are written.
  void stop(bool flush = false);

 private:
  struct Session;
  // The sessions of one address in authentication: those whose challenge is out (at most
  // a few) and those waiting for their turn, in order of arrival. The timer wakes the
  // queue when the address's back-off ends.
  struct AuthGate {
    std::size_t outstanding = 0;
    std::deque<std::weak_ptr<Session>> waiting;
    std::unique_ptr<boost::asio::steady_timer> timer;
    bool busy = false;  // next_challenges() runs for it
  };
  struct Failures {
    int count = 0;
    Clock::time_point last;  // the latest failure
  };
  void accept();
  void admit_socket(boost::asio::ip::tcp::socket socket, const boost::asio::ip::tcp::endpoint& peer);
  bool admit(const std::string& address);
  void refused(const char* reason) { ++refused_[reason]; }
  // Drops a job; `why` (logged) says why one that did not end is dropped, which the journal
  // records as its end ("forgotten").
  void forget(std::map<std::string, Job>::iterator job, const std::string& why = {});
  void on_frame(const std::shared_ptr<Session>& s, const proto::Frame& f);
  void handshake(const std::shared_ptr<Session>& s, const proto::Frame& f);
  void answer_not_hosting(Session& s);  // ServerOptions::not_hosting, for its Hello
  void resume_held();  // host(): the held Hellos (Session::held) are read again
  // Keeps `f` (an older client's Hello or Join) as its bytes, charged to budget_; refuses the
  // session when it does not fit.
  void hold(Session& s, const proto::Frame& f);
  void warn_if_open() const;            // beyond loopback without a token
  std::string not_hosting_run_;
  bool answer_older_ = false;  // answer_older_hellos()
  int recalling_epoch_ = -1;  // tell_recalling()'s; -1: not recalling
  // Logs `why` (after the peer's address with `name_peer`), sends it as an Error and closes.
  void refuse(Session& s, const std::string& why, bool name_peer = true);
  // The line for an agent that joined without proving the token the server requires.
  std::string no_proof(const Session& s, const proto::Frame& join) const;
  void on_close(const std::shared_ptr<Session>& s, const std::string& why);
  void auth_failed(const std::string& address);
  // Sends the challenges `address` may have out now (kMaxChallengesPerAddress at most, none
  // during its back-off); answered() frees a session's turn.
  void next_challenges(const std::string& address);
  void answered(Session& s);
  void apply(const Actions& actions);
  // Applies a job's actions, then logs the events it recorded (JobEvent).
  void drive(Job& job, const Actions& actions);
  void tick();
  void check_deadlines(Clock::time_point now);
  void account_jobs();
  // `fields`: an object ({"event": ..., "job": ...}) or null for a plain line.
  void log(const std::string& line, nlohmann::json fields = nullptr) const;

  boost::asio::io_context& io_;
  ServerOptions opts_;
  boost::asio::ip::tcp::acceptor acceptor_;
  boost::asio::ip::tcp::endpoint accept_peer_;  // filled by the pending async_accept
  boost::asio::steady_timer ticker_, accept_pause_;
  proto::PauseEpisode pauses_;  // accepts paused for want of descriptors (one log line each way)
  int port_ = 0;
  bool stopped_ = false;
  SessionId next_id_ = 1;
  std::map<SessionId, std::shared_ptr<Session>> sessions_;
  std::map<std::string, Job> jobs_;
  // The job `job_id`, made (with a new run, rdzv::new_run()) when it is not there yet.
  Job& job_of(const std::string& job_id);
  // The journal says job `job_id` ended (done, failed, forgotten).
  bool ended_in_journal(const std::string& job_id) const;
  // The Abort a failed job's agents heard, from its journaled "failed" event (review s38-late L1).
  static proto::Abort journaled_abort(const JobHistory& h);
  std::map<std::string, std::size_t> per_address_;  // open connections by peer address
  std::map<std::string, Failures> failures_;        // authentication failures by peer address
  std::map<std::string, AuthGate> gates_;           // sessions in authentication by peer address
  ChallengeRate rate_;                              // challenges by peer address (D7)
  std::shared_ptr<MemoryBudget> budget_ = std::make_shared<MemoryBudget>();
  std::size_t jobs_bytes_ = 0;  // charged to budget_ at each tick
  std::size_t peak_used_ = 0;   // budget use since the last malloc_trim
  // Counters for metrics(); those of forgotten jobs are kept in the totals.
  std::shared_ptr<Traffic> traffic_ = std::make_shared<Traffic>();
  std::map<std::string, std::uint64_t> refused_;
  std::uint64_t accepted_ = 0, auth_failures_ = 0, refusals_ = 0, jobs_created_ = 0;
  std::uint64_t forgotten_disconnects_ = 0, forgotten_missed_heartbeats_ = 0;
  struct Event {
    std::uint64_t seq;
    std::int64_t unix_ms;
    std::string text;
    std::string kind;  // JobEvent's kind name, "log" for other lines
    std::string job;   // empty: not about one job
  };
  mutable std::deque<Event> events_;  // log() is const; the ring is not part of the state
  mutable std::uint64_t next_event_ = 1;
  std::string journal_error_;  // the journal's last write failure, logged once
  // Agents (job, agent id) whose join carried no epoch (before #34), each said once; at most
  // kMaxOldPeersNamed remembered.
  std::set<std::pair<std::string, std::string>> old_peers_;
  static constexpr std::size_t kMaxOldPeersNamed = 4096;
};

}  // namespace mg::rdzv
