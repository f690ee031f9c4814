#include <catch2/catch.hpp>

#include "slurm/hostlist.h"

using mg::slurm::expand_hostlist;
using V = std::vector<std::string>;

TEST_CASE("hostlists expand ranges and lists, with each range keeping its zero padding") {
  CHECK(expand_hostlist("node[01-03,7]") == V{"node01", "node02", "node03", "node7"});
  CHECK(expand_hostlist("a,b[1-2],c") == V{"a", "b1", "b2", "c"});
  CHECK(expand_hostlist("gpu[1-2]-ib[0-1]") == V{"gpu1-ib0", "gpu1-ib1", "gpu2-ib0", "gpu2-ib1"});
  CHECK(expand_hostlist("n[008-010]") == V{"n008", "n009", "n010"});
  CHECK(expand_hostlist("login1") == V{"login1"});
}

TEST_CASE("malformed or huge hostlists are rejected") {
  CHECK_THROWS_AS(expand_hostlist("n[1-"), std::invalid_argument);
  CHECK_THROWS_AS(expand_hostlist("n[3-1]"), std::invalid_argument);
  CHECK_THROWS_AS(expand_hostlist("n[a-b]"), std::invalid_argument);
  CHECK_THROWS_AS(expand_hostlist("n[1-999999999]", 1000), std::invalid_argument);
}
