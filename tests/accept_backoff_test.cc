// proto/accept_backoff.h: the accept pause and the once-a-second log limiter that the agent's
// store and the control socket share (their EMFILE tests: store_tests, control_tests).
#include <catch2/catch.hpp>

#include <boost/asio/io_context.hpp>
#include <boost/asio/steady_timer.hpp>

#include "proto/accept_backoff.h"

using mg::proto::LogLimiter;
using namespace std::chrono_literals;

TEST_CASE("the log limiter lets one line a second through and counts the ones it left out on the next") {
  LogLimiter l;
  const auto t0 = LogLimiter::Clock::time_point{} + 1h;
  CHECK(l.admit("a", t0) == "a");
  CHECK_FALSE(l.admit("b", t0 + 10ms).has_value());
  CHECK_FALSE(l.admit("c", t0 + 999ms).has_value());
  CHECK(l.admit("d", t0 + 1s) == "d (and 2 more in the second before)");
  CHECK(l.admit("e", t0 + 2500ms) == "e");  // none left out since
  // The first line is never held back, whatever the clock says.
  LogLimiter fresh;
  CHECK(fresh.admit("x", LogLimiter::Clock::time_point{}) == "x");
}

TEST_CASE("pause_accepts resumes after the pause, and not at all when the timer is cancelled") {
  boost::asio::io_context io;
  boost::asio::steady_timer timer(io);
  int resumed = 0;
  mg::proto::pause_accepts(timer, [&] { ++resumed; });
  io.run_for(10s);
  CHECK(resumed == 1);
  CHECK(mg::proto::kAcceptPause == 100ms);
  io.restart();
  mg::proto::pause_accepts(timer, [&] { ++resumed; });
  timer.cancel();  // the server stopping
  io.run_for(10s);
  CHECK(resumed == 1);
}

TEST_CASE("an episode of accept pauses is two lines: its first pause, and its end with the count") {
  mg::proto::PauseEpisode e;
  CHECK_FALSE(e.accepted().has_value());  // no episode under way
  const auto first = e.paused("Too many open files");
  REQUIRE(first.has_value());
  CHECK(first->starts_with("accept failed: Too many open files; pausing accepts for 100 ms"));
  for (int i = 0; i < 49; ++i) CHECK_FALSE(e.paused("Too many open files").has_value());
  CHECK(e.pauses() == 50);
  CHECK(e.accepted() == "accepts resumed after 50 pauses of 100 ms");
  CHECK_FALSE(e.accepted().has_value());
  // The next episode starts afresh.
  CHECK(e.paused("Too many open files").has_value());
  CHECK(e.accepted() == "accepts resumed after 1 pause of 100 ms");
}
