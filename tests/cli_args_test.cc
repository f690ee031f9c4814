// cli/args.h: argparse's rules in front of CLI11 (empty values, abbreviations, nearest names).
#include <catch2/catch.hpp>

#include "cli/args.h"

using namespace mg::cli;

namespace {

const std::vector<FlagSpec> kSpecs = {
    {{"nnodes"}, {}, true, false},
    {{"nproc_per_node", "nproc-per-node"}, {}, true, true},
    {{"node_rank", "node-rank"}, {}, true, false},
    {{"rdzv_id", "rdzv-id"}, {}, true, true},
    {{"rdzv_endpoint", "rdzv-endpoint"}, {}, true, true},
    {{"standalone"}, {}, false, false},
    {{"module"}, {"m"}, false, false},
    {{"redirects"}, {"r"}, true, true},
};

std::vector<std::string> norm(std::vector<std::string> args, bool stop = true) {
  return normalize_args(args, kSpecs, stop).args;
}

std::string error_of(std::vector<std::string> args) {
  try {
    normalize_args(args, kSpecs, true);
  } catch (const ArgsError& e) {
    return e.what();
  }
  FAIL("expected an ArgsError");
  return {};
}

}  // namespace

TEST_CASE("an empty flag value is an empty value and never takes the next argument") {
  auto n = normalize_args({"--rdzv_id=", "--nproc_per_node=2", "prog"}, kSpecs, true);
  CHECK(n.args == std::vector<std::string>{"--rdzv_id", "", "--nproc_per_node=2", "prog"});
  CHECK(n.rest == 3);
  CHECK(norm({"--rdzv_id", "", "prog"}) == std::vector<std::string>{"--rdzv_id", "", "prog"});
  CHECK(norm({"-r", "", "prog"}) == std::vector<std::string>{"--redirects", "", "prog"});
}

TEST_CASE("an empty value where none makes sense is an error naming the flag") {
  CHECK_THAT(error_of({"--node_rank=", "prog"}), Catch::Contains("empty value in '--node_rank='"));
  CHECK_THAT(error_of({"--nnodes", "", "prog"}), Catch::Contains("--nnodes"));
  CHECK_THAT(error_of({"--standalone=", "prog"}), Catch::Contains("write --standalone alone"));
}

TEST_CASE("a flag that needs a value refuses the next flag as its value") {
  CHECK_THAT(error_of({"--rdzv_id", "--nproc_per_node=2", "prog"}),
             Catch::Contains("--rdzv_id needs a value but is followed by the flag '--nproc_per_node=2'"));
  CHECK_THAT(error_of({"--rdzv_id"}), Catch::Contains("--rdzv_id needs a value"));
  CHECK(norm({"--node_rank", "-1", "prog"}) == std::vector<std::string>{"--node_rank=-1", "prog"});  // a number
}

TEST_CASE("a unique prefix of a long flag names that flag, as argparse") {
  CHECK(norm({"--nproc=1", "prog"}) == std::vector<std::string>{"--nproc_per_node=1", "prog"});
  CHECK(norm({"--nproc-per", "3", "prog"}) == std::vector<std::string>{"--nproc_per_node=3", "prog"});
  CHECK(norm({"--stand", "prog"}) == std::vector<std::string>{"--standalone", "prog"});
  CHECK(norm({"--rdzv_e=h:1", "prog"}) == std::vector<std::string>{"--rdzv_endpoint=h:1", "prog"});
  // an exact name wins over a longer one it is a prefix of
  const std::vector<FlagSpec> specs = {{{"tee"}, {}, true, true}, {{"teeth"}, {}, true, true}};
  CHECK(normalize_args({"--tee=1", "p"}, specs, true).args.front() == "--tee=1");
}

TEST_CASE("an ambiguous prefix is refused with every candidate listed") {
  const auto e = error_of({"--n=1", "prog"});
  CHECK_THAT(e, Catch::Contains("ambiguous flag '--n'"));
  CHECK_THAT(e, Catch::Contains("--nnodes"));
  CHECK_THAT(e, Catch::Contains("--node_rank"));
  CHECK_THAT(error_of({"--rdzv=x", "prog"}), Catch::Contains("--rdzv_id, --rdzv_endpoint"));
}

TEST_CASE("an unknown flag names the nearest known one") {
  CHECK_THAT(error_of({"--nproc_per_nodes=2", "prog"}), Catch::Contains("did you mean '--nproc_per_node'?"));
  CHECK(error_of({"--zzzzzz", "prog"}) == "unknown flag '--zzzzzz'");
  CHECK_THAT(error_of({"-x", "prog"}), Catch::Contains("unknown flag '-x'"));
}

TEST_CASE("flags end at the program, whose arguments pass untouched") {
  auto n = normalize_args({"-m", "pkg.mod", "--nproc=9", "--rdzv_id="}, kSpecs, true);
  CHECK(n.args == std::vector<std::string>{"--module", "pkg.mod", "--nproc=9", "--rdzv_id="});
  CHECK(n.rest == 1);
  auto d = normalize_args({"--stand", "--", "--x"}, kSpecs, true);
  CHECK(d.rest == 1);
  CHECK(d.args[1] == "--");
  CHECK(norm({"-r3", "p"}) == std::vector<std::string>{"--redirects=3", "p"});
  CHECK(norm({"--stand", "a", "--nnodes=2"}, false) == std::vector<std::string>{"--standalone", "a", "--nnodes=2"});
}

TEST_CASE("nearest_name finds a likely typo and nothing for a stranger") {
  CHECK(nearest_name("nproc_per_nodes", {"nnodes", "nproc_per_node"}) == "nproc_per_node");
  CHECK(nearest_name("max-restart", {"max_restarts", "role"}) == "max_restarts");
  CHECK_FALSE(nearest_name("banana", {"nnodes", "role"}));
}

TEST_CASE("a value that starts with '-' but holds a space is a value, as argparse") {
  auto n = normalize_args({"--rdzv_id", "-p 2222", "prog"}, kSpecs, true);
  CHECK(n.args == std::vector<std::string>{"--rdzv_id=-p 2222", "prog"});
  CHECK(error_of({"--rdzv_id", "-p2222", "prog"}).find("followed by the flag '-p2222'") != std::string::npos);
}

TEST_CASE("each given flag's value is kept beside it, nothing for a switch") {
  auto n = normalize_args({"--nproc=2", "--standalone", "--rdzv_id=", "-m", "prog"}, kSpecs, true);
  REQUIRE(n.given.size() == 4);
  REQUIRE(n.values.size() == 4);
  CHECK(n.values[0] == std::optional<std::string>("2"));
  CHECK_FALSE(n.values[1]);
  CHECK(n.values[2] == std::optional<std::string>(""));
  CHECK_FALSE(n.values[3]);
}

TEST_CASE("one_line keeps an error on one line whatever the value holds, and cuts a huge one") {
  CHECK(one_line("bad --rdzv_id 'a\nb'") == "bad --rdzv_id 'a\\nb'");
  CHECK(one_line("tab\there\r, bell\x07, del\x7f") == "tab\\there\\r, bell\\x07, del\\x7f");
  CHECK(one_line("trailing newline\n") == "trailing newline");
  CHECK(one_line("caf\xc3\xa9") == "caf\xc3\xa9");  // UTF-8 passes as it is
  const std::string cut = one_line(std::string(5000, 'x'), 100);
  CHECK(cut == std::string(100, 'x') + "...");
}
