#include <catch2/catch.hpp>

#include <random>

#include "slurm/hostlist.h"

using mg::slurm::compress_hostlist;
using mg::slurm::expand_hostlist;
using V = std::vector<std::string>;

TEST_CASE("hostlists expand ranges and lists, with each range keeping its zero padding") {
  CHECK(expand_hostlist("node[01-03,7]") == V{"node01", "node02", "node03", "node7"});
  CHECK(expand_hostlist("a,b[1-2],c") == V{"a", "b1", "b2", "c"});
  CHECK(expand_hostlist("gpu[1-2]-ib[0-1]") == V{"gpu1-ib0", "gpu1-ib1", "gpu2-ib0", "gpu2-ib1"});
  CHECK(expand_hostlist("n[008-010]") == V{"n008", "n009", "n010"});
  CHECK(expand_hostlist("n[8-10]") == V{"n8", "n9", "n10"});
  CHECK(expand_hostlist("n[098-100]") == V{"n098", "n099", "n100"});
  CHECK(expand_hostlist("login1") == V{"login1"});
}

TEST_CASE("several bracket groups expand as a product with the leftmost group slowest") {
  CHECK(expand_hostlist("rack[1-2]-node[08-10]") ==
        V{"rack1-node08", "rack1-node09", "rack1-node10", "rack2-node08", "rack2-node09", "rack2-node10"});
  CHECK(expand_hostlist("r[1,3]n[1-2]x") == V{"r1n1x", "r1n2x", "r3n1x", "r3n2x"});
}

TEST_CASE("hostlist terms are separated by commas or whitespace outside brackets, and duplicates stay") {
  CHECK(expand_hostlist("a b\tc\nd") == V{"a", "b", "c", "d"});
  CHECK(expand_hostlist("n1,,n1") == V{"n1", "n1"});
  CHECK(expand_hostlist("").empty());
}

TEST_CASE("malformed or huge hostlists are rejected with the expression in the message") {
  for (const char* bad : {"n[1-", "n[3-1]", "n[a-b]", "n[]", "n]1[", "n[[1]]", "n[1-2", "n[-1]", "n[1,]",
                          "n[1-99999999999999999999]"}) {
    INFO(bad);
    CHECK_THROWS_AS(expand_hostlist(bad), std::invalid_argument);
    try {
      expand_hostlist(bad);
    } catch (const std::invalid_argument& e) {
      CHECK_THAT(e.what(), Catch::Contains(bad));
    }
  }
  CHECK_THROWS_WITH(expand_hostlist("n[1-999999999]", 1000), Catch::Contains("more than 1000 hosts"));
  // The cap holds for products and for many terms, before any memory is spent.
  CHECK_THROWS_WITH(expand_hostlist("a[1-100]b[1-100]c[1-100]", 100000), Catch::Contains("more than"));
  CHECK_THROWS_WITH(expand_hostlist("a[1-600],b[1-600]", 1000), Catch::Contains("more than"));
  CHECK(expand_hostlist("a[1-500],b[1-500]", 1000).size() == 1000);
}

TEST_CASE("host names compress to the expression scontrol show hostlist writes") {
  CHECK(compress_hostlist({"n1", "n2", "n3"}) == "n[1-3]");
  CHECK(compress_hostlist({"n3", "n1", "n2"}) == "n[3,1-2]");  // order kept, as Slurm does
  CHECK(compress_hostlist({"n1", "n2", "n3", "n5", "a", "n9", "n10", "n09", "n010", "b1"}) ==
        "n[1-3,5],a,n[9-10,09,010],b1");
  CHECK(compress_hostlist({"node08", "node09", "node10"}) == "node[08-10]");
  CHECK(compress_hostlist({"login"}) == "login");
  CHECK(compress_hostlist({"x7"}) == "x7");
  CHECK(compress_hostlist({"x7", "x7"}) == "x[7,7]");
  CHECK(compress_hostlist({"rack1-node1", "rack1-node2", "rack2-node1"}) == "rack1-node[1-2],rack2-node1");
  CHECK(compress_hostlist({}).empty());
}

TEST_CASE("compressing then expanding random host lists gives the same hosts back") {
  std::mt19937 rng(42);
  const V prefixes = {"n", "node", "gpu-", "r1n", "login", ""};
  for (int round = 0; round < 500; ++round) {
    V hosts;
    const int n = 1 + static_cast<int>(rng() % 20);
    for (int i = 0; i < n; ++i) {
      std::string p = prefixes[rng() % prefixes.size()];
      const int width = 1 + static_cast<int>(rng() % 3);
      const unsigned num = rng() % 130;
      if (p == "login" && rng() % 2) {
        hosts.push_back(p);
        continue;
      }
      std::string digits = std::to_string(num);
      if (static_cast<int>(digits.size()) < width) digits.insert(0, static_cast<std::size_t>(width) - digits.size(), '0');
      hosts.push_back(p + digits);
    }
    INFO(compress_hostlist(hosts));
    CHECK(expand_hostlist(compress_hostlist(hosts)) == hosts);
  }
}

TEST_CASE("garbage hostlists never crash: they expand or throw invalid_argument") {
  std::mt19937 rng(7);
  const std::string alphabet = "n0123456789[]-, x\t";
  for (int i = 0; i < 20000; ++i) {
    std::string s;
    const int len = static_cast<int>(rng() % 24);
    for (int k = 0; k < len; ++k) s += alphabet[rng() % alphabet.size()];
    try {
      auto hosts = expand_hostlist(s, 5000);
      CHECK(hosts.size() <= 5000);
    } catch (const std::invalid_argument&) {
    }
  }
}
