// The pre-started standby's rules (launcher/prestart.h, --prestart-standby) driven with a
// fake clock: the time is passed in, the commands are read back as the agent would carry
// them out. tests/inplace_test.cc runs the same rules with real agents and workers.
#include <catch2/catch.hpp>

#include <signal.h>
#include <sys/wait.h>

#include "launcher/prestart.h"

using namespace mg;
using namespace mg::sup;
using namespace std::chrono_literals;

namespace {

Now at(std::chrono::milliseconds t) {
  return {Clock::time_point{} + t, std::chrono::system_clock::time_point{} + t};
}

template <class C>
std::vector<C> all(const PreCommands& out) {
  std::vector<C> v;
  for (const auto& c : out)
    if (const C* p = std::get_if<C>(&c)) v.push_back(*p);
  return v;
}

template <class C>
bool has(const PreCommands& out) {
  return !all<C>(out).empty();
}

// The time the one timer is armed for after `out` (nullopt: cancelled; throws when neither).
std::optional<Clock::time_point> timer(const PreCommands& out) {
  for (auto it = out.rbegin(); it != out.rend(); ++it) {
    if (const auto* a = std::get_if<pre::ArmTimer>(&*it)) return a->at;
    if (std::holds_alternative<pre::CancelTimer>(*it)) return std::nullopt;
  }
  throw std::runtime_error("the timer is neither armed nor cancelled");
}

bool notice_has(const PreCommands& out, const std::string& text) {
  for (const auto& n : all<pre::Notice>(out))
    if (n.text.find(text) != std::string::npos) return true;
  return false;
}

std::optional<int> finished(const PreCommands& out) {
  const auto f = all<pre::Finish>(out);
  if (f.empty()) return std::nullopt;
  return f.front().code;
}

int exited(int code) { return code << 8; }
int killed_by(int sig) { return sig; }

// Two local ranks started ahead at t=0 as pids 101 and 102, grace 3 s.
struct Standby {
  Prestart p{2, 3000ms};
  Standby() {
    const PreCommands out = p.begin(/*standby_waiting=*/true, /*control=*/true, at(0ms));
    REQUIRE(all<pre::Start>(out).size() == 2);
    p.started(0, 101, at(0ms));
    p.started(1, 102, at(0ms));
  }
};

}  // namespace

TEST_CASE("prestart: a standby starts one worker per local rank ahead, once, and waits 30 s for each hello") {
  Prestart p(3, 3000ms);
  CHECK(p.begin(/*standby_waiting=*/false, true, at(0ms)).empty());  // not a waiting standby: nothing
  const PreCommands out = p.begin(true, true, at(0ms));
  const auto starts = all<pre::Start>(out);
  REQUIRE(starts.size() == 3);
  CHECK(starts[2].local_rank == 2);
  CHECK(notice_has(out, "3 worker(s) started ahead with MGLAUNCH_STANDBY=1"));
  CHECK(p.begin(true, true, at(1000ms)).empty());  // once
  const PreCommands s = p.started(1, 4242, at(1000ms));
  CHECK(p.pending(1));
  CHECK_FALSE(p.pending(0));  // started() not told yet
  CHECK(timer(s) == at(1000ms + Prestart::kHello).steady);
  REQUIRE(all<pre::Trace>(s).size() == 1);
  CHECK(all<pre::Trace>(s)[0].args["pid"] == 4242);
}

TEST_CASE("prestart: without a control channel nothing starts ahead and the line says so") {
  Prestart p(2, 3000ms);
  const PreCommands out = p.begin(true, /*control=*/false, at(0ms));
  CHECK_FALSE(has<pre::Start>(out));
  CHECK(notice_has(out, "no control channel"));
}

TEST_CASE("prestart: a hello with in_place and standby makes a worker ready, without a deadline") {
  Standby s;
  PreCommands out = s.p.hello(0, true, true, at(2000ms));
  CHECK(s.p.ready(0));
  CHECK(timer(out) == at(Prestart::kHello).steady);  // local rank 1's hello is still due
  out = s.p.hello(1, true, true, at(2500ms));
  CHECK(timer(out) == std::nullopt);  // nothing left to wait for
  CHECK(s.p.timer_fired(at(Prestart::kHello)).size() == 1);  // a stale fire: the timer cancelled again only
}

TEST_CASE("prestart: a hello without standby or without in_place stops the worker: SIGTERM and SIGCONT, SIGKILL "
          "after the grace") {
  Standby s;
  const bool standby_missing = GENERATE(true, false);
  PreCommands out = s.p.hello(1, /*in_place=*/standby_missing, /*standby=*/!standby_missing, at(1000ms));
  CHECK(notice_has(out, standby_missing ? "without \"standby\"" : "without \"in_place\""));
  CHECK(notice_has(out, "a fresh worker starts when this node is given a place"));
  auto sig = all<pre::Signal>(out);
  REQUIRE(sig.size() == 1);
  CHECK(sig[0].sig == SIGTERM);
  CHECK(sig[0].cont);
  CHECK(sig[0].local_ranks == std::vector<int>{1});
  CHECK(s.p.stopping(1));
  CHECK(timer(out) == at(4000ms).steady);  // its SIGKILL before local rank 0's hello deadline
  CHECK(s.p.hello(1, true, true, at(1500ms)).empty());  // being stopped: a later hello changes nothing
  CHECK_FALSE(has<pre::Signal>(s.p.timer_fired(at(3999ms))));  // not yet
  out = s.p.timer_fired(at(4000ms));
  sig = all<pre::Signal>(out);
  REQUIRE(sig.size() == 1);
  CHECK(sig[0].sig == SIGKILL);
  CHECK(sig[0].local_ranks == std::vector<int>{1});
  CHECK(notice_has(out, "local rank(s) 1 still running 3.0s after SIGTERM"));
  CHECK(timer(out) == at(Prestart::kHello).steady);
  CHECK_FALSE(has<pre::Signal>(s.p.timer_fired(at(5000ms))));  // SIGKILL once
  // Its end, stopped by the agent: not replaced.
  out = s.p.ended(102, killed_by(SIGKILL), /*standby_waiting=*/true, at(6000ms));
  CHECK_FALSE(has<pre::Start>(out));
  CHECK(all<pre::Forget>(out).at(0).local_rank == 1);
  CHECK_FALSE(s.p.pending(1));
}

TEST_CASE("prestart: a worker without a hello within 30 s is stopped, and killed after the grace") {
  Standby s;
  s.p.hello(0, true, true, at(1000ms));
  PreCommands out = s.p.timer_fired(at(Prestart::kHello));
  CHECK(notice_has(out, "local rank 1's pre-started worker (pid 102) said no hello with \"standby\" within 30 s"));
  REQUIRE(all<pre::Signal>(out).size() == 1);
  CHECK(all<pre::Signal>(out)[0].sig == SIGTERM);
  CHECK(timer(out) == at(Prestart::kHello + 3000ms).steady);
  out = s.p.timer_fired(at(Prestart::kHello + 3000ms));
  CHECK(all<pre::Signal>(out).at(0).sig == SIGKILL);
  CHECK(s.p.ready(0));  // the ready one is left alone
}

TEST_CASE("prestart: a closed control connection stops the worker without the fresh-worker promise") {
  Standby s;
  PreCommands out = s.p.closed(0, at(1000ms));
  CHECK(notice_has(out, "closed its control connection: stopping it"));
  CHECK_FALSE(notice_has(out, "a fresh worker starts"));
  CHECK(all<pre::Signal>(out).at(0).sig == SIGTERM);
  SECTION("it most likely ended on its own: its end is one, replaced when it lived long enough") {
    out = s.p.ended(101, exited(1), true, at(6000ms));
    CHECK(notice_has(out, "ended (exit code 1) after 6 s before this node was given a place: starting another"));
    CHECK(all<pre::Start>(out).at(0).local_rank == 0);
  }
  SECTION("ended soon after its start: not replaced") {
    out = s.p.ended(101, exited(1), true, at(4000ms));
    CHECK_FALSE(has<pre::Start>(out));
    CHECK(notice_has(out, "ended (exit code 1) before this node was given a place: a fresh worker starts then"));
  }
}

TEST_CASE("prestart: a worker that ends on its own after 5 s while the node waits is replaced, sooner, or once the "
          "node has a place, it is not") {
  Standby s;
  PreCommands out = s.p.ended(101, killed_by(SIGSEGV), /*standby_waiting=*/true, at(Prestart::kMinLife));
  CHECK(notice_has(out, "ended (signal SIGSEGV) after 5 s"));
  CHECK(all<pre::Start>(out).at(0).local_rank == 0);
  CHECK(all<pre::Forget>(out).at(0).local_rank == 0);
  out = s.p.ended(102, exited(0), /*standby_waiting=*/true, at(Prestart::kMinLife - 1ms));
  CHECK_FALSE(has<pre::Start>(out));
  Standby t;
  out = t.p.ended(101, exited(0), /*standby_waiting=*/false, at(60000ms));
  CHECK_FALSE(has<pre::Start>(out));
  CHECK(t.p.ended(999, exited(0), true, at(60000ms)).size() == 1);  // a pid of none: the timer only
}

TEST_CASE("prestart: the node's place keeps the ready workers for their local ranks and kills the others") {
  Standby s;
  s.p.hello(0, true, true, at(1000ms));
  PreCommands out = s.p.retire(at(2000ms));
  std::vector<int> kept;
  for (const auto& k : all<pre::Keep>(out)) kept.push_back(k.local_rank);
  CHECK(kept == std::vector<int>{0, 1});  // local rank 1's handle stays until it ended
  auto sig = all<pre::Signal>(out);
  REQUIRE(sig.size() == 1);
  CHECK(sig[0].sig == SIGKILL);
  CHECK(sig[0].local_ranks == std::vector<int>{1});
  CHECK(notice_has(out, "local rank 1's pre-started worker (pid 102) said no hello with \"standby\" before this node "
                        "was given a place: killed"));
  CHECK(timer(out) == std::nullopt);
  CHECK_FALSE(s.p.pending(1));
  PreCommands took;
  CHECK(s.p.take(0, took) == 101);
  CHECK_FALSE(s.p.pending(0));
  CHECK(s.p.take(1, took) == 0);  // none: a fresh worker
  // The killed one's end finds no entry: nothing said, nothing started.
  out = s.p.ended(102, killed_by(SIGKILL), false, at(2100ms));
  CHECK_FALSE(has<pre::Notice>(out));
  CHECK_FALSE(has<pre::Start>(out));
}

TEST_CASE("prestart: a worker being stopped at the place is killed without a second line") {
  Standby s;
  s.p.hello(1, true, false, at(1000ms));  // stopping
  PreCommands out = s.p.retire(at(2000ms));
  CHECK_FALSE(notice_has(out, "local rank 1"));
  CHECK(all<pre::Signal>(out).size() == 2);  // both SIGKILLed (rank 0 never said hello)
}

TEST_CASE("prestart: the job's end stops the pre-started workers first: SIGTERM, SIGKILL after the grace, then the "
          "run finishes") {
  Standby s;
  s.p.hello(0, true, true, at(1000ms));
  PreCommands out = s.p.stop_all(0, at(2000ms));
  CHECK(s.p.finishing());
  CHECK(notice_has(out, "stopping this standby's 2 pre-started worker(s): SIGTERM, SIGKILL after 3.0s"));
  auto sig = all<pre::Signal>(out);
  REQUIRE(sig.size() == 1);
  CHECK(sig[0].sig == SIGTERM);
  CHECK(sig[0].cont);
  CHECK(sig[0].local_ranks == std::vector<int>{0, 1});
  CHECK_FALSE(finished(out));
  CHECK(timer(out) == at(5000ms).steady);
  SECTION("both end within the grace: the run finishes with the code at the last end, not replaced") {
    out = s.p.ended(101, killed_by(SIGTERM), true, at(2500ms));
    CHECK_FALSE(finished(out));
    CHECK_FALSE(has<pre::Start>(out));
    out = s.p.ended(102, killed_by(SIGTERM), true, at(2600ms));
    CHECK(finished(out) == 0);
    CHECK_FALSE(s.p.finishing());
  }
  SECTION("one outlives the grace: at the grace the run finishes (the agent's finish SIGKILLs what is left)") {
    s.p.ended(101, killed_by(SIGTERM), true, at(2500ms));
    out = s.p.timer_fired(at(5000ms));
    CHECK(notice_has(out, "local rank(s) 1 still running 3.0s after SIGTERM"));
    CHECK(finished(out) == 0);
  }
  SECTION("a second stop signal meanwhile finishes at once; SIGUSR1 does not") {
    CHECK(s.p.signal(SIGUSR1, at(2100ms)).empty());
    CHECK(s.p.finishing());
    out = s.p.signal(SIGINT, at(2200ms));
    CHECK(notice_has(out, "got SIGINT while stopping this standby's pre-started workers: killing them now"));
    CHECK(finished(out) == 0);
    CHECK_FALSE(s.p.finishing());
  }
}

TEST_CASE("prestart: a worker stopped earlier by its own deadline keeps that deadline at the job's end") {
  Standby s;
  s.p.hello(1, false, false, at(1000ms));  // stopping: SIGKILL at 4 s
  PreCommands out = s.p.stop_all(7, at(2000ms));
  CHECK(all<pre::Signal>(out).at(0).local_ranks == std::vector<int>{0});  // only the other one gets SIGTERM
  CHECK(timer(out) == at(4000ms).steady);
  out = s.p.timer_fired(at(4000ms));  // rank 1's SIGKILL; rank 0's grace runs until 5 s
  CHECK(all<pre::Signal>(out).at(0).sig == SIGKILL);
  CHECK_FALSE(finished(out));
  CHECK(timer(out) == at(5000ms).steady);
  s.p.ended(102, killed_by(SIGKILL), true, at(4100ms));
  out = s.p.ended(101, exited(0), true, at(4200ms));
  CHECK(finished(out) == 7);
}

TEST_CASE("prestart: the job's end with no pre-started worker left finishes at once") {
  Prestart p(2, 3000ms);
  CHECK(finished(p.stop_all(3, at(0ms))) == 3);
  Standby s;
  PreCommands took;
  s.p.take(0, took);
  s.p.take(1, took);
  CHECK(timer(took) == std::nullopt);
  CHECK(finished(s.p.stop_all(0, at(1000ms))) == 0);
  CHECK(s.p.signal(SIGTERM, at(1100ms)).empty());  // nothing waited for any more
}
