// The etcd agent's lease policy (rendezvous/etcd_lease.h), driven with a fake clock: a
// running round fences before etcd may expire the lease, and after the heal the node joins
// again, under its id if the lease lived, as a newcomer if it is gone (#34).
#include <catch2/catch.hpp>

#include "rendezvous/etcd_lease.h"

using namespace mg::rdzv::etcd;
using namespace std::chrono_literals;

namespace {

using Clock = LeaseGuard::Clock;
const Clock::time_point T0{};
const std::string kEtcd = "http://10.0.0.4:2379";

template <class T>
std::vector<T> all(const LeaseCommands& cs) {
  std::vector<T> out;
  for (const auto& c : cs)
    if (const auto* x = std::get_if<T>(&c)) out.push_back(*x);
  return out;
}

// keep_alive_interval=1 (s), x 3: etcd's TTL 3 s; the guard fences 0.5 s before it.
LeaseGuard running(int round = 4) {
  LeaseGuard g(1000, kEtcd);
  CHECK(g.granted(7, 3, T0).empty());
  g.assigned(round);
  return g;
}

}  // namespace

TEST_CASE("etcd lease: a running round fences TTL minus half a keep-alive interval after its last renewal was sent") {
  LeaseGuard g = running();
  REQUIRE(g.fence_at() == T0 + 2500ms);
  CHECK(g.tick(T0 + 2499ms).empty());
  // A renewal answered moves the fence from its send time, never back.
  CHECK(g.renewed(7, 3, T0 + 1000ms).empty());
  CHECK(g.renewed(7, 3, T0 + 400ms).empty());  // sent earlier, answered later
  CHECK(g.fence_at() == T0 + 3500ms);
  CHECK(g.tick(T0 + 3499ms).empty());
  const auto out = g.tick(T0 + 3500ms);
  const auto stops = all<lease_cmd::Stop>(out);
  REQUIRE(stops.size() == 1);
  CHECK(stops[0].report_round == 4);
  CHECK_THAT(stops[0].why, Catch::StartsWith("this node fenced itself: its etcd lease was last renewed 2.5 s ago") &&
                               Catch::Contains(kEtcd) && Catch::Contains("after 3 s") &&
                               Catch::Contains("waiting to rejoin"));
  CHECK(g.fenced());
  CHECK(g.tick(T0 + 10s).empty());  // once
  // The defaults (keep-alive 5 s x 3): 12.5 s, as a daemon's fence.
  LeaseGuard d(5000, kEtcd);
  d.granted(1, 15, T0);
  d.assigned(1);
  CHECK(d.fence_at() == T0 + 12500ms);
  // A TTL etcd made shorter than asked: at most half of it is the margin.
  LeaseGuard s(5000, kEtcd);
  s.granted(1, 2, T0);
  s.assigned(1);
  CHECK(s.fence_at() == T0 + 1000ms);
}

TEST_CASE("etcd lease: no fence without workers: joining, a standby, after the job's restart and after its end") {
  LeaseGuard g(1000, kEtcd);
  g.granted(7, 3, T0);
  CHECK(!g.fence_at());
  CHECK(g.tick(T0 + 1h).empty());
  g.waiting();
  CHECK(g.tick(T0 + 1h).empty());
  g.assigned(1);
  g.restarted();
  CHECK(g.tick(T0 + 1h).empty());
  g.assigned(2);
  g.ended();
  CHECK(g.tick(T0 + 1h).empty());
  CHECK(g.rejoin().empty());
}

TEST_CASE("etcd lease: fenced, the node's rejoin waits for a word on its lease, and renewed, it joins under its id once") {
  LeaseGuard g = running();
  REQUIRE(all<lease_cmd::Stop>(g.tick(T0 + 3s)).size() == 1);
  CHECK(g.rejoin().empty());  // the lease may be gone: no join yet
  CHECK(g.renewed(99, 3, T0 + 20s).empty());  // another lease's answer: stale
  const auto out = g.renewed(7, 3, T0 + 20s);
  CHECK(all<lease_cmd::Join>(out).size() == 1);
  CHECK(all<lease_cmd::Reenter>(out).empty());
  CHECK(!g.fenced());
  CHECK(g.renewed(7, 3, T0 + 21s).empty());
  // The job's restart (its failure report) comes: the agent's next rejoin joins at once.
  g.restarted();
  CHECK(all<lease_cmd::Join>(g.rejoin()).size() == 1);
}

TEST_CASE("etcd lease: fenced and its lease found gone, the node re-enters as a newcomer, once, whichever comes first") {
  SECTION("TTL 0 in a keep-alive's answer, before the agent's rejoin") {
    LeaseGuard g = running();
    g.tick(T0 + 3s);
    CHECK(g.renewed(7, 0, T0 + 20s).empty());  // its workers still stop: the rejoin re-enters
    CHECK(all<lease_cmd::Reenter>(g.rejoin()).size() == 1);
    CHECK(g.rejoin().empty());  // under way
    CHECK(g.granted(8, 3, T0 + 21s).empty());
    CHECK(!g.fenced());
    CHECK(all<lease_cmd::Join>(g.rejoin()).size() == 1);  // the new identity's lease lives
  }
  SECTION("its loss in the job's log, after the agent's rejoin waited") {
    LeaseGuard g = running();
    g.tick(T0 + 3s);
    CHECK(g.rejoin().empty());
    CHECK(all<lease_cmd::Reenter>(g.gone("declared lost by the job")).size() == 1);
    CHECK(g.gone("etcd deleted its alive key").empty());
    CHECK(g.renewed(7, 0, T0 + 21s).empty());
    // The new lease fences the next round as the first did.
    g.granted(8, 3, T0 + 22s);
    g.assigned(6);
    CHECK(g.fence_at() == T0 + 24500ms);
  }
}

TEST_CASE("etcd lease: a lease gone while the workers run (no fence fired) stops them, and the rejoin re-enters") {
  LeaseGuard g = running();
  const auto stops = all<lease_cmd::Stop>(g.gone("declared lost by the job: its etcd lease expired"));
  REQUIRE(stops.size() == 1);
  CHECK(stops[0].report_round == 0);  // the job knows already
  CHECK_THAT(stops[0].why, Catch::StartsWith("this node's etcd lease expired (declared lost by the job") &&
                               Catch::Contains("joins again"));
  CHECK(g.tick(T0 + 1h).empty());
  CHECK(all<lease_cmd::Reenter>(g.rejoin()).size() == 1);
}

TEST_CASE("etcd lease: a lease gone while waiting (joining or a standby) re-enters at once") {
  LeaseGuard g(1000, kEtcd);
  g.granted(7, 3, T0);
  g.waiting();
  CHECK(all<lease_cmd::Reenter>(g.renewed(7, 0, T0 + 5s)).size() == 1);
}
