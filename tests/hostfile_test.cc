// Hostfile and --include/--exclude parsing, and the fan-out's pure pieces (flag split,
// quoting, exports, per-host commands, output prefixes).
#include <catch2/catch.hpp>

#include "cli/errors.h"
#include "baremetal/hostfile.h"
#include "baremetal/multihost.h"
#include "process/command.h"

using namespace mg;

namespace {

std::vector<std::string> names(const std::vector<HostEntry>& hosts) {
  std::vector<std::string> out;
  for (const auto& h : hosts) out.push_back(h.host);
  return out;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const UsageError& e) {
    return e.what();
  }
  return "no error";
}

}  // namespace

TEST_CASE("a hostfile gives hosts in order with their slots, skipping comments and blank lines") {
  auto hosts = parse_hostfile("# rack 1\n\nnode-a slots=4\n  node-b   slots=8  # big one\r\nnode-c\n", "hf");
  REQUIRE(names(hosts) == std::vector<std::string>{"node-a", "node-b", "node-c"});
  CHECK(hosts[0].slots == 4);
  CHECK(hosts[1].slots == 8);
  CHECK(hosts[2].slots == 0);  // the host decides
  CHECK(hosts[2].workers() == 0);
  CHECK(hosts[1].line == 4);
}

TEST_CASE("bad hostfile lines are refused naming the file and line") {
  CHECK_THAT(error_of([] { parse_hostfile("a slots=2\nb slots=x\n", "my.hosts"); }),
             Catch::Contains("my.hosts:2") && Catch::Contains("slots must be a whole number"));
  CHECK_THAT(error_of([] { parse_hostfile("a slots=0\n", "f"); }), Catch::Contains("f:1"));
  CHECK_THAT(error_of([] { parse_hostfile("a gpus=2\n", "f"); }), Catch::Contains("unexpected 'gpus=2'"));
  CHECK_THAT(error_of([] { parse_hostfile("a\na slots=2\n", "f"); }), Catch::Contains("listed twice"));
  CHECK_THAT(error_of([] { parse_hostfile("-oProxyCommand=x\n", "f"); }), Catch::Contains("not a host name"));
  CHECK_THAT(error_of([] { parse_hostfile("# only a comment\n\n", "f"); }), Catch::Contains("lists no host"));
  CHECK_THAT(error_of([] { parse_hostfile("a slots=2 slots=3\n", "f"); }), Catch::Contains("unexpected"));
  CHECK_THAT(error_of([] { parse_hostfile("root@a slots=2\n", "f"); }),
             Catch::Contains("f:1: 'root@a' names a user") && Catch::Contains("-l root"));
}

TEST_CASE("a malformed hostfile line says file:line, what is wrong and how to fix it, in one line") {
  auto one_line = [](const std::string& e) { return !e.empty() && e.find('\n') == std::string::npos; };
  const std::string spaced = error_of([] { parse_hostfile("a slots=2\n\nb slots = 4\n", "hosts.txt"); });
  CHECK_THAT(spaced, Catch::StartsWith("hosts.txt:3: ") && Catch::Contains("without spaces"));
  const std::string zero = error_of([] { parse_hostfile("a slots=0\n", "f"); });
  CHECK_THAT(zero, Catch::StartsWith("f:1: ") && Catch::Contains("1..4096") && Catch::Contains("leave slots= out"));
  const std::string bad = error_of([] { parse_hostfile("# c\nbad/host\n", "f"); });
  CHECK_THAT(bad, Catch::StartsWith("f:2: ") && Catch::Contains("letters, digits"));
  const std::string huge = error_of([] { parse_hostfile("a slots=" + std::string(5000, '9') + "\n", "f"); });
  CHECK(huge.size() < 300);  // a hostile value is cut, not echoed whole
  for (const auto& e : {spaced, zero, bad, huge}) CHECK(one_line(e));
}

TEST_CASE("including hosts with --include keeps only the named hosts and slots, DeepSpeed style") {
  auto all = parse_hostfile("w0 slots=4\nw1 slots=4\nw2 slots=4\n", "hf");
  auto sel = select_hosts(all, "w2@w0:0,2", "");
  REQUIRE(names(sel) == std::vector<std::string>{"w0", "w2"});  // hostfile order
  CHECK(sel[0].slot_ids == std::vector<int>{0, 2});
  CHECK(sel[0].workers() == 2);
  CHECK(sel[1].slot_ids.empty());
  CHECK(sel[1].workers() == 4);
}

TEST_CASE("excluding with --exclude drops whole hosts or single slots, and hosts left empty") {
  auto all = parse_hostfile("w0 slots=2\nw1 slots=4\nw2 slots=1\n", "hf");
  auto sel = select_hosts(all, "", "w0@w1:1,3@w2:0");
  REQUIRE(names(sel) == std::vector<std::string>{"w1"});
  CHECK(sel[0].slot_ids == std::vector<int>{0, 2});
}

TEST_CASE("bad selections name the host or slot at fault") {
  auto all = parse_hostfile("w0 slots=2\nw1\n", "hf");
  CHECK_THAT(error_of([&] { select_hosts(all, "w9", ""); }), Catch::Contains("w9") && Catch::Contains("not in the hostfile"));
  CHECK_THAT(error_of([&] { select_hosts(all, "w0:2", ""); }), Catch::Contains("slot 2 of w0") && Catch::Contains("slots=2"));
  CHECK_THAT(error_of([&] { select_hosts(all, "", "w1:0"); }), Catch::Contains("slot count is unknown"));
  CHECK_THAT(error_of([&] { select_hosts(all, "w0", "w1"); }), Catch::Contains("cannot be used together"));
  CHECK_THAT(error_of([&] { select_hosts(all, "", "w0@w1"); }), Catch::Contains("leaves no host"));
  CHECK_THAT(error_of([&] { select_hosts(all, "w0:a", ""); }), Catch::Contains("slot 'a' of w0"));
  CHECK_THAT(error_of([&] { select_hosts(all, "w0@w0", ""); }), Catch::Contains("named twice"));
  // Including slots of a host with unknown slots is fine: that many workers on those GPUs.
  auto sel = select_hosts(all, "w1:1,3", "");
  CHECK(sel[0].workers() == 2);
}

TEST_CASE("the fan-out takes its own flags and forwards the rest and the program verbatim") {
  auto o = parse_multihost_args({"mglaunch", "--hostfile", "hf", "--max_restarts", "2", "--include=a@b",
                                 "--ssh-opts", "-p 2222 -o 'ProxyJump=gw host'", "--export", "NCCL_*", "--grace=5",
                                 "--dry-run", "-m", "train", "--lr", "0.1", "--hostfile", "x"});
  REQUIRE(o);
  CHECK(o->hostfile == "hf");
  CHECK(o->include == "a@b");
  CHECK(o->ssh_opts == std::vector<std::string>{"-p", "2222", "-o", "ProxyJump=gw host"});
  CHECK(o->exports == std::vector<std::string>{"NCCL_*"});
  CHECK(o->dry_run);
  CHECK(o->grace == std::chrono::milliseconds(5000));
  // By their canonical names, as the agents will check them.
  CHECK(o->forwarded == std::vector<std::string>{"--max_restarts=2", "--grace=5", "--module"});
  CHECK(o->program == std::vector<std::string>{"train", "--lr", "0.1", "--hostfile", "x"});
}

TEST_CASE("flags the fan-out sets itself are refused with --hostfile") {
  CHECK_THAT(error_of([] { parse_multihost_args({"mglaunch", "--hostfile", "hf", "--nnodes=2", "p"}); }),
             Catch::Contains("--nnodes is set by mglaunch"));
  CHECK_THAT(error_of([] { parse_multihost_args({"mglaunch", "--hostfile", "hf", "--rdzv_endpoint", "x:1", "p"}); }),
             Catch::Contains("--rdzv_endpoint"));
  CHECK_THAT(error_of([] { parse_multihost_args({"mglaunch", "--hostfile", "hf"}); }),
             Catch::Contains("no training program"));
  CHECK_THAT(error_of([] { parse_multihost_args({"mglaunch", "--hostfile"}); }), Catch::Contains("needs a value"));
}

TEST_CASE("the fan-out judges flags by the main CLI's rules: unknown, prefix, ambiguous, empty") {
  // Unknown flags are errors naming the nearest valid one, the fan-out's own included.
  CHECK_THAT(error_of([] { parse_multihost_args({"mglaunch", "--hostfile", "hf", "--max_restars=2", "p"}); }),
             Catch::Contains("unknown flag '--max_restars'") && Catch::Contains("did you mean '--max_restarts'?"));
  CHECK_THAT(error_of([] { parse_multihost_args({"mglaunch", "--hostfile", "hf", "--exlude=a", "p"}); }),
             Catch::Contains("did you mean '--exclude'?"));
  // Unique prefixes name the flag; the agents get the full name.
  auto o = parse_multihost_args({"mglaunch", "--hostf=hf", "--incl", "a", "--max_r=3", "p"});
  REQUIRE(o);
  CHECK(o->hostfile == "hf");
  CHECK(o->include == "a");
  CHECK(o->forwarded == std::vector<std::string>{"--max_restarts=3"});
  // Ambiguous ones list the candidates.
  CHECK_THAT(error_of([] { parse_multihost_args({"mglaunch", "--hostfile", "hf", "--ex=a", "p"}); }),
             Catch::Contains("ambiguous") && Catch::Contains("--exclude") && Catch::Contains("--export"));
  // An empty value is an empty value: it never takes the next argument.
  CHECK_THAT(error_of([] { parse_multihost_args({"mglaunch", "--hostfile=", "--nproc_per_node=2", "p"}); }),
             Catch::Contains("empty value in '--hostfile='"));
  CHECK_THAT(error_of([] { parse_multihost_args({"mglaunch", "--hostfile", "hf", "--include", "--dry-run", "p"}); }),
             Catch::Contains("followed by the flag '--dry-run'"));
  CHECK_THAT(error_of([] { parse_multihost_args({"mglaunch", "--hostfile", "hf", "--grace=soon", "p"}); }),
             Catch::Contains("bad --grace 'soon'"));
  CHECK_THAT(error_of([] { parse_multihost_args({"mglaunch", "--hostfile", "hf", "--rdzv-id=x", "p"}); }),
             Catch::Contains("--rdzv_id is set by mglaunch"));
  CHECK(wants_multihost({"mglaunch", "--hostf=h", "p"}));
}

TEST_CASE("a --hostfile flag is noticed only before the program") {
  CHECK(wants_multihost({"mglaunch", "--nproc_per_node", "2", "--hostfile=h", "p"}));
  CHECK(wants_multihost({"mglaunch", "--standalone", "--hostfile", "h", "p"}));
  CHECK_FALSE(wants_multihost({"mglaunch", "--nproc_per_node=2", "p", "--hostfile", "h"}));
  CHECK_FALSE(wants_multihost({"mglaunch", "--log_dir", "--hostfile", "p"}));  // a value, not a flag
}

TEST_CASE("shell quoting survives a round trip through sh") {
  for (std::string s : {std::string("plain"), std::string("it's"), std::string("a b\tc"), std::string("$HOME `x` \"q\""),
                        std::string(""), std::string("new\nline"), std::string("${local_rank}")}) {
    std::string cmd = "printf %s " + shell_quote(s);
    FILE* f = ::popen(cmd.c_str(), "r");
    REQUIRE(f);
    std::string out;
    char buf[256];
    for (std::size_t n; (n = std::fread(buf, 1, sizeof(buf), f)) > 0;) out.append(buf, n);
    ::pclose(f);
    CHECK(out == s);
  }
}

TEST_CASE("the --ssh-opts text is split like a shell splits words") {
  CHECK(split_shell_words("  -i ~/k  -o \"A=b c\" x\\ y '' ") ==
        std::vector<std::string>{"-i", "~/k", "-o", "A=b c", "x y", ""});
  CHECK_THAT(error_of([] { split_shell_words("-o 'open"); }), Catch::Contains("unterminated"));
}

TEST_CASE("exporting with --export takes names, NAME=VALUE and globs, never the rendezvous token") {
  EnvMap env{{"NCCL_DEBUG", "INFO"}, {"NCCL_IB_HCA", "mlx5"}, {"HOME", "/root"}, {"MGLAUNCH_RDZV_TOKEN", "s"}};
  auto e = resolve_exports({"NCCL_*", "HOME", "X=1 2", "MGLAUNCH_*"}, env);
  CHECK(e == EnvMap{{"NCCL_DEBUG", "INFO"}, {"NCCL_IB_HCA", "mlx5"}, {"HOME", "/root"}, {"X", "1 2"}});
  CHECK_THAT(error_of([&] { resolve_exports({"NOPE"}, env); }), Catch::Contains("NOPE is not set here"));
  CHECK_THAT(error_of([&] { resolve_exports({"A B"}, env); }), Catch::Contains("bad --export"));
}

TEST_CASE("no rendezvous secret is ever exported, whatever --export says, and each one left out is named (#23 D8)") {
  const std::string key(64, 'a');
  EnvMap env{{"MGLAUNCH_RDZV_TOKEN", "s"}, {"MGLAUNCH_RDZV_JOB_TOKEN", key}, {"MGLAUNCH_ETCD_PASSWORD", "pw"},
             {"MGLAUNCH_PYTHON", "python3"}};
  std::vector<std::string> left_out;
  auto e = resolve_exports({"MGLAUNCH_*", "MGLAUNCH_RDZV_JOB_TOKEN", "MGLAUNCH_RDZV_X=1"}, env, &left_out);
  CHECK(e == EnvMap{{"MGLAUNCH_PYTHON", "python3"}});
  std::sort(left_out.begin(), left_out.end());
  CHECK(left_out == std::vector<std::string>{"MGLAUNCH_ETCD_PASSWORD", "MGLAUNCH_RDZV_JOB_TOKEN", "MGLAUNCH_RDZV_TOKEN",
                                             "MGLAUNCH_RDZV_X"});
}

TEST_CASE("each host gets one agent command with its node rank, slots and the shared rendezvous") {
  MultiHostOptions o;
  o.remote_mglaunch = "/opt/mg/mglaunch";
  o.forwarded = {"--max_restarts", "1"};
  o.program = {"train.py", "--name", "it's"};
  auto hosts = select_hosts(parse_hostfile("a slots=2\nb slots=4\nc\n", "hf"), "a@b:1,3@c", "");
  OpenSshRunner ssh({"-p", "2222"});
  auto plan = make_multihost_plan(o, hosts, {{"NCCL_DEBUG", "INFO"}}, "127.0.0.9:4000", "job1", ssh);
  REQUIRE(plan.hosts.size() == 3);
  CHECK(plan.hosts[0].agent_argv ==
        std::vector<std::string>{"/opt/mg/mglaunch", "--nnodes=3", "--nproc_per_node=2", "--node_rank=0",
                                 "--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.9:4000", "--rdzv_id=job1",
                                 "--max_restarts", "1", "train.py", "--name", "it's"});
  CHECK(plan.hosts[1].agent_argv[2] == "--nproc_per_node=2");
  CHECK(plan.hosts[1].agent_argv[3] == "--gpu_ids=1,3");
  CHECK(plan.hosts[2].agent_argv[2] == "--nproc_per_node=auto");
  const auto& argv = plan.hosts[1].argv;
  CHECK(std::vector<std::string>(argv.begin(), argv.begin() + 9) ==
        std::vector<std::string>{"ssh", "-T", "-o", "BatchMode=yes", "-p", "2222", "-o", "ConnectTimeout=30", "b"});
  CHECK(argv[9] == "--");
  CHECK_THAT(argv[10], Catch::Contains("env NCCL_DEBUG=INFO /opt/mg/mglaunch") &&
                          Catch::Contains("'it'\\''s'") && !Catch::Contains("MGLAUNCH_RDZV_TOKEN="));
  auto j = multihost_plan_json(plan);
  CHECK(j["nnodes"] == 3);
  CHECK(j["nodes"][1]["host"] == "b");
  CHECK(j["nodes"][1]["gpu_ids"] == nlohmann::json::array({1, 3}));
  CHECK(j["nodes"][2]["slots"] == "auto");
  CHECK(j["nodes"][0]["ssh"][10] == plan.hosts[0].remote_command);
}

TEST_CASE("relayed lines get [host:rankN] for worker lines and [host] for the rest") {
  std::string_view l = "[rank12]:loss 0.5";
  CHECK(relay_prefix("n1", l) == "[n1:rank12]:");
  CHECK(l == "loss 0.5");
  std::string_view m = "[mglaunch] round 1";
  CHECK(relay_prefix("n1", m) == "[n1]:");
  CHECK(m == "[mglaunch] round 1");
  std::string_view r = "[rankx]:y";
  CHECK(relay_prefix("n1", r) == "[n1]:");
}

TEST_CASE("identical root-cause blocks from several hosts are shown once, different ones in full") {
  const std::string rule(60, '=');
  auto block = [&](const std::string& time, const std::string& rank) {
    return std::vector<std::string>{rule, "train.py FAILED", std::string(60, '-'), "Root Cause (first observed failure):",
                                    "  time       : " + time, "  rank       : " + rank, rule};
  };
  RootCauseFilter f;
  auto feed_all = [&](const std::string& host, const std::vector<std::string>& lines) {
    std::vector<std::string> out;
    for (const auto& l : lines)
      for (auto& x : f.feed(host, l)) out.push_back(x);
    return out;
  };
  CHECK(feed_all("a", {"[rank1]:boom", "[mglaunch] notice"}) == std::vector<std::string>{"[rank1]:boom", "[mglaunch] notice"});
  CHECK(feed_all("a", block("10:00:01", "3")) == block("10:00:01", "3"));
  CHECK(feed_all("b", block("10:00:02", "3")) ==
        std::vector<std::string>{"[mglaunch] the same root cause as a reported above"});
  CHECK(feed_all("c", block("10:00:02", "5")) == block("10:00:02", "5"));
  // A block cut short by the end of the stream still comes out.
  CHECK(feed_all("d", {rule, "x FAILED"}).empty());
  CHECK(f.finish("d") == std::vector<std::string>{rule, "x FAILED"});
  CHECK(f.finish("d").empty());
}

TEST_CASE("after the user stopped a --hostfile run no root-cause block is shown (#22)") {
  const std::string rule(60, '=');
  const std::vector<std::string> block{rule, "train.py FAILED", "  rank       : none (node a failed, not one of its workers)",
                                       rule};
  RootCauseFilter f;
  f.drop_blocks();
  std::vector<std::string> out;
  for (const auto& l : block)
    for (auto& x : f.feed("a", l)) out.push_back(x);
  for (auto& x : f.feed("a", "[mglaunch] stopped")) out.push_back(x);
  CHECK(out == std::vector<std::string>{"[mglaunch] stopped"});
  for (const auto& l : {rule, std::string("x FAILED")}) CHECK(f.feed("b", l).empty());
  CHECK(f.finish("b").empty());
}
