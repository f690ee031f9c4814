#include <catch2/catch.hpp>

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>

#include "cli/errors.h"
#include "launcher/options.h"
#include "process/command.h"

using namespace mg;

namespace {

const HardwareProbe kProbe{[] { return 0; }, [] { return 6; }};
const HardwareProbe kProbe8Gpus{[] { return 8; }, [] { return 6; }};

AgentOptions parse(std::vector<std::string> args, std::map<std::string, std::string> env = {},
                   const HardwareProbe& probe = kProbe) {
  args.insert(args.begin(), "mglaunch");
  auto out = parse_agent_args(args, env, probe);
  REQUIRE(out.options);
  return *out.options;
}

std::string usage_error(std::vector<std::string> args, std::map<std::string, std::string> env = {}) {
  args.insert(args.begin(), "mglaunch");
  try {
    parse_agent_args(args, env, kProbe);
  } catch (const UsageError& e) {
    return e.what();
  }
  FAIL("expected a UsageError");
  return {};
}

}  // namespace

TEST_CASE("both flag spellings set the same option") {
  CHECK(parse({"--nproc_per_node=3", "prog"}).nproc_per_node == 3);
  CHECK(parse({"--nproc-per-node", "3", "prog"}).nproc_per_node == 3);
  CHECK(parse({"--max-restarts=2", "prog"}).max_restarts == 2);
  CHECK(parse({"--max_restarts", "2", "prog"}).max_restarts == 2);
  CHECK(parse({"--no-python", "prog"}).no_python);
  CHECK(parse({"--no_python", "prog"}).no_python);
  CHECK(parse({"--log-dir", "/tmp/x", "prog"}).log_dir == "/tmp/x");
  CHECK(parse({"--local-ranks-filter=0,2", "prog"}).local_ranks_filter == std::vector<int>{0, 2});
}

TEST_CASE("parsing stops at the program and passes its arguments through untouched") {
  auto o = parse({"--nproc_per_node", "2", "train.py", "--nproc_per_node", "9", "-m", "--", "x"});
  CHECK(o.program == "train.py");
  CHECK(o.program_args == std::vector<std::string>{"--nproc_per_node", "9", "-m", "--", "x"});
  CHECK(o.nproc_per_node == 2);
  auto m = parse({"-m", "pkg.mod", "--lr", "0.1"});
  CHECK(m.module);
  CHECK(m.program == "pkg.mod");
  CHECK(m.program_args == std::vector<std::string>{"--lr", "0.1"});
  CHECK(parse({"--", "prog", "a"}).program == "prog");
}

TEST_CASE("PET_ environment variables are fallbacks that flags override") {
  CHECK(parse({"prog"}, {{"PET_NPROC_PER_NODE", "4"}}).nproc_per_node == 4);
  CHECK(parse({"--nproc_per_node=2", "prog"}, {{"PET_NPROC_PER_NODE", "4"}}).nproc_per_node == 2);
  CHECK(parse({"prog"}, {{"PET_MAX_RESTARTS", "3"}}).max_restarts == 3);
  CHECK(parse({"prog"}, {{"PET_STANDALONE", "1"}}).standalone);
  CHECK(parse({"prog"}, {}).nproc_per_node == 1);  // no PET_ leaks from an earlier parse
}

TEST_CASE("nproc_per_node accepts auto, gpu and cpu") {
  CHECK(parse({"--nproc_per_node=cpu", "prog"}).nproc_per_node == 6);
  CHECK(parse({"--nproc_per_node=auto", "prog"}).nproc_per_node == 6);
  CHECK(parse({"--nproc_per_node=auto", "prog"}, {}, kProbe8Gpus).nproc_per_node == 8);
  CHECK(parse({"--nproc_per_node=gpu", "prog"}, {}, kProbe8Gpus).nproc_per_node == 8);
  CHECK_THAT(usage_error({"--nproc_per_node=gpu", "prog"}), Catch::Contains("no GPU"));
}

TEST_CASE("bad values are usage errors that name the flag and the value") {
  CHECK_THAT(usage_error({"--nproc_per_node=0", "prog"}), Catch::Contains("--nproc_per_node '0'"));
  CHECK_THAT(usage_error({"--nproc_per_node=two", "prog"}), Catch::Contains("expected an integer"));
  CHECK_THAT(usage_error({"--nnodes=3:2", "prog"}), Catch::Contains("MIN must be <= MAX"));
  CHECK_THAT(usage_error({"--nnodes=2", "--node_rank=2", "prog"}), Catch::Contains("--node_rank"));
  CHECK_THAT(usage_error({"--redirects=7", "prog"}), Catch::Contains("--redirects"));
  CHECK_THAT(usage_error({"--bogus", "prog"}), Catch::Contains("--bogus"));
  CHECK_THAT(usage_error({"--nproc_per_node=2"}), Catch::Contains("no training program"));
  CHECK_THAT(usage_error({"--rdzv_backend=etcd-v2", "prog"}), Catch::Contains("etcd-v2"));
  CHECK_THAT(usage_error({"--nnodes=2", "--rdzv_backend=etcd", "--rdzv_endpoint=a:1,,b:2", "prog"}),
             Catch::Contains("--rdzv_endpoint") && Catch::Contains("empty etcd endpoint"));
  CHECK_THAT(usage_error({"--rdzv_backend=etcd", "--rdzv_conf=protocol=ftp", "prog"}), Catch::Contains("protocol"));
  CHECK_THAT(usage_error({"--standalone", "--nnodes=2", "prog"}), Catch::Contains("--standalone"));
  CHECK_THAT(usage_error({"--gpu_ids=0", "--nproc_per_node=2", "prog"}), Catch::Contains("one id per worker"));
  CHECK_THAT(usage_error({"--grace=-1", "prog"}), Catch::Contains("--grace"));
}

TEST_CASE("etcd settings a client cannot use are usage errors naming the fix") {
  // An unknown key is one warning naming the nearest known key (torchrun passes keys through).
  const auto unknown = parse({"--rdzv_backend=etcd", "--rdzv_endpoint=a:2379", "--rdzv_conf=prefix=/x", "prog"});
  REQUIRE(unknown.usage_warnings.size() == 1);
  CHECK_THAT(unknown.usage_warnings[0], Catch::Contains("'prefix'") && !Catch::Contains("seconds"));
  // Port 0 is no port a client can reach.
  CHECK_THAT(usage_error({"--nnodes=2", "--rdzv_backend=etcd", "--rdzv_endpoint=127.0.0.1:0", "prog"}),
             Catch::Contains("--rdzv_endpoint") && Catch::Contains("port 0"));
  // A CA certificate on a plain http endpoint would be ignored: refused, naming protocol=https.
  CHECK_THAT(usage_error({"--nnodes=2", "--rdzv_backend=etcd", "--rdzv_endpoint=127.0.0.1:2379",
                          "--rdzv_conf=cacert=/ca.pem", "prog"}),
             Catch::Contains("cacert") && Catch::Contains("protocol=https"));
  CHECK(parse({"--nnodes=2", "--rdzv_backend=etcd", "--rdzv_endpoint=127.0.0.1:2379",
               "--rdzv_conf=protocol=https,cacert=/ca.pem", "prog"}).etcd_cacert == "/ca.pem");
}

TEST_CASE("the etcd backend takes an endpoint list and its TLS, user and prefix settings") {
  auto o = parse({"--nnodes=2", "--rdzv_backend=etcd", "--rdzv_endpoint=https://a:2379,https://b",
                  "--rdzv_conf=cacert=/ca.pem,cert=/c.pem,key=/k.pem,user=me,etcd_prefix=/x,join_timeout=9", "prog"});
  CHECK(o.rdzv_backend == "etcd");
  CHECK(o.etcd_cacert == "/ca.pem");
  CHECK(o.etcd_cert == "/c.pem");
  CHECK(o.etcd_key == "/k.pem");
  CHECK(o.etcd_user == "me");
  CHECK(o.etcd_prefix == "/x");
  CHECK(o.join_timeout == std::chrono::seconds(9));
}

TEST_CASE("standalone selects a local c10d rendezvous") {
  auto o = parse({"--standalone", "prog"});
  CHECK(o.rdzv_backend == "c10d");
  CHECK(o.rdzv_endpoint == "localhost:0");
}

TEST_CASE("standalone with --nnodes=1:N runs one node as torchrun does, and a MIN above 1 is refused (#22)") {
  auto o = parse({"--standalone", "--nnodes=1:2", "prog"});
  CHECK(o.nnodes.min == 1);
  CHECK(o.nnodes.max == 1);
  CHECK_FALSE(uses_rendezvous_server(o));
  CHECK(parse({"--standalone", "--nnodes=1", "prog"}).nnodes.max == 1);
  CHECK_THAT(usage_error({"--standalone", "--nnodes=2", "prog"}), Catch::Contains("can never be reached"));
  CHECK_THAT(usage_error({"--standalone", "--nnodes=2:4", "prog"}), Catch::Contains("--nnodes=2:4"));
}

TEST_CASE("a flag with an optional value followed by a number with a space is refused with the '=' form (#22)") {
  const std::string e = usage_error({"--monitor", "2", "train.py"});
  CHECK_THAT(e, Catch::Contains("write --monitor=2") && Catch::Contains("'--monitor -- 2'"));
  CHECK(e.find('\n') == std::string::npos);
  CHECK_THAT(usage_error({"--standalone", "--monitor", "0.5", "prog"}), Catch::Contains("write --monitor=0.5"));
  // What is not a number is the program, and -- says a number is one.
  CHECK(parse({"--monitor", "train.py"}).program == "train.py");
  auto o = parse({"--monitor", "--", "2"});
  CHECK(o.program == "2");
  CHECK(o.monitor_s == 5);
  CHECK(parse({"--monitor=2", "3"}).program == "3");
  CHECK(parse({"--monitor", "--standalone", "3"}).program == "3");
}

TEST_CASE("worker counts and ranks past the documented limits are usage errors (#23 D9, D10)") {
  CHECK(parse({"--nproc_per_node=4096", "prog"}).nproc_per_node == 4096);
  CHECK_THAT(usage_error({"--nproc_per_node=4097", "prog"}), Catch::Contains("at most 4096"));
  CHECK_THAT(usage_error({"--nproc_per_node=999999999", "prog"}), Catch::Contains("--nproc_per_node"));
  CHECK_THAT(usage_error({"--nnodes=2147483647", "--node_rank=2147483646", "--nproc_per_node=2", "prog"}),
             Catch::Contains("4294967294 ranks") && Catch::Contains("2147483647"));
  CHECK(parse({"--nnodes=1073741823", "--node_rank=1073741822", "--nproc_per_node=2", "prog"}).nnodes.max ==
        1073741823);
  CHECK_THAT(usage_error({"--rdzv_backend=c10d", "--rdzv_endpoint=h:1", "--nnodes=1:2147483647",
                          "--nproc_per_node=2", "prog"}),
             Catch::Contains("ranks"));
  // A probe that finds more CPUs than a node may run workers.
  HardwareProbe many{[] { return 0; }, [] { return 5000; }};
  CHECK_THROWS_WITH(parse_agent_args({"mglaunch", "--nproc_per_node=cpu", "prog"}, {}, many),
                    Catch::Contains("at most 4096"));
}

TEST_CASE("a JSON config file supplies defaults that flags override") {
  // Per process: two suites run side by side must not share the file.
  std::string path = std::string(std::getenv("TMPDIR") ? std::getenv("TMPDIR") : "/tmp") + "/mg_config_test." +
                     std::to_string(::getpid()) + ".json";
  std::ofstream(path) << R"({"nproc_per_node": 3, "max_restarts": 4, "standalone": true})";
  auto o = parse({"--config", path, "prog"});
  CHECK(o.nproc_per_node == 3);
  CHECK(o.max_restarts == 4);
  CHECK(o.standalone);
  CHECK(parse({"--config", path, "--nproc_per_node=5", "prog"}).nproc_per_node == 5);
  std::ofstream(path) << "not json";
  CHECK_THAT(usage_error({"--config", path, "prog"}), Catch::Contains("JSON"));
  std::remove(path.c_str());
}

TEST_CASE("redirect and tee specs follow torchrun's forms") {
  auto all = parse_stream_spec("-r", "3");
  CHECK(all.covers(5, Streams::kOut));
  CHECK(all.covers(5, Streams::kErr));
  auto per = parse_stream_spec("-t", "0:1,1:2");
  CHECK(per.covers(0, Streams::kOut));
  CHECK_FALSE(per.covers(0, Streams::kErr));
  CHECK(per.covers(1, Streams::kErr));
  CHECK_FALSE(per.covers(2, Streams::kOut));
  CHECK_THROWS_AS(parse_stream_spec("-t", "0:4"), UsageError);
  CHECK_THROWS_AS(parse_stream_spec("-t", "a:1"), UsageError);
}

TEST_CASE("${local_rank} follows string.Template.safe_substitute") {
  CHECK(substitute_local_rank("--gpu=${local_rank}", 3) == "--gpu=3");
  CHECK(substitute_local_rank("$local_rank", 2) == "2");
  CHECK(substitute_local_rank("$local_ranks", 2) == "$local_ranks");
  CHECK(substitute_local_rank("$$local_rank", 2) == "$local_rank");
  CHECK(substitute_local_rank("cost $5 ${other}", 1) == "cost $5 ${other}");
  CHECK(substitute_local_rank("a$", 1) == "a$");
}

TEST_CASE("nnodes parses N and MIN:MAX") {
  CHECK(parse_nnodes("4").min == 4);
  CHECK(parse_nnodes("2:5").max == 5);
  CHECK_THROWS_AS(parse_nnodes("0"), UsageError);
  CHECK_THROWS_AS(parse_nnodes("2:"), UsageError);
  // Three parts (PyTorch's test_min_max_nodes_parse): the message names the whole value.
  try {
    parse_nnodes("2:20:30");
    FAIL("2:20:30 accepted");
  } catch (const UsageError& e) {
    CHECK(std::string(e.what()) == "bad --nnodes '2:20:30': expected N or MIN:MAX");
  }
}

TEST_CASE("exit codes map signals to 128+N") {
  CHECK(shell_exit_code(3 << 8) == 3);
  CHECK(shell_exit_code(9) == 137);
  CHECK(shell_exit_code(0) == 0);
}

TEST_CASE("an empty flag value from an unset variable never eats the next flag") {
  auto o = parse({"--rdzv_id=", "--nproc_per_node=2", "prog"});
  CHECK(o.nproc_per_node == 2);
  CHECK(o.rdzv_id == "none");  // torchrun: an empty run id is no run id
  CHECK(o.program == "prog");
  CHECK(parse({"--log_dir=", "--max_restarts=1", "prog"}).max_restarts == 1);
  CHECK(parse({"--rdzv_conf=", "--role=", "prog"}).role.empty());
  // where empty means nothing, a one-line error naming the flag
  CHECK_THAT(usage_error({"--nproc_per_node=", "--nnodes=1", "prog"}), Catch::Contains("bad --nproc_per_node ''"));
  CHECK_THAT(usage_error({"--node_rank=", "prog"}), Catch::Contains("bad --node_rank ''"));
  CHECK_THAT(usage_error({"--master_port=", "prog"}), Catch::Contains("bad --master_port ''"));
  CHECK_THAT(usage_error({"--grace=", "prog"}), Catch::Contains("bad --grace ''"));
  CHECK_THAT(usage_error({"--master_addr=", "prog"}), Catch::Contains("--master_addr"));
  CHECK_THAT(usage_error({"--rdzv_backend=", "prog"}), Catch::Contains("--rdzv_backend ''"));
  CHECK_THAT(usage_error({"--python=", "prog"}), Catch::Contains("--python"));
  CHECK_THAT(usage_error({"--cpu-bind=", "prog"}), Catch::Contains("bad --cpu-bind ''"));
  CHECK_THAT(usage_error({"--standalone=", "prog"}), Catch::Contains("--standalone"));
  CHECK_THAT(usage_error({"--config=", "prog"}), Catch::Contains("--config"));
  CHECK_THAT(usage_error({"--rdzv_id", "--nproc_per_node=2", "prog"}), Catch::Contains("needs a value"));
}

TEST_CASE("every text flag takes an explicit empty value without eating the next argument") {
  // Whatever flags are added later: `--X=` followed by --max_restarts=1 either parses with
  // max_restarts 1 or is a usage error that names --X; it never swallows the next flag.
  HardwareProbe probe = kProbe;
  probe.listen_error = [](const std::string&, int) { return std::nullopt; };
  std::string help = parse_agent_args({"mglaunch", "--help"}, {}, kProbe).message;
  std::vector<std::string> names;
  for (std::size_t at = help.find(",--"); at != std::string::npos; at = help.find(",--", at + 1)) {
    auto end = help.find_first_of(" ,\n", at + 1);
    names.push_back(help.substr(at + 1, end - at - 1));
  }
  for (std::size_t at = help.find("\n  --"); at != std::string::npos; at = help.find("\n  --", at + 1)) {
    auto end = help.find_first_of(" ,\n", at + 3);
    names.push_back(help.substr(at + 3, end - at - 3));
  }
  REQUIRE(names.size() > 30);
  for (const auto& name : names) {
    if (name == "--help" || name == "--version") continue;
    INFO(name);
    try {
      auto out = parse_agent_args({"mglaunch", name + "=", "--max_restarts=1", "prog"}, {}, probe);
      REQUIRE(out.options);
      CHECK(out.options->max_restarts == 1);
      CHECK(out.options->program == "prog");
    } catch (const UsageError& e) {
      std::string what = e.what(), bare = name.substr(2);
      std::replace(what.begin(), what.end(), '-', '_');
      std::replace(bare.begin(), bare.end(), '-', '_');
      CHECK_THAT(what, Catch::Contains(bare));
      CHECK_THAT(what, !Catch::Contains("max_restarts"));
    }
  }
}

TEST_CASE("unique prefixes of long flags are accepted and ambiguous ones list the candidates") {
  CHECK(parse({"--nproc=3", "prog"}).nproc_per_node == 3);
  CHECK(parse({"--max_re", "2", "prog"}).max_restarts == 2);
  CHECK(parse({"--stand", "prog"}).standalone);
  const auto e = usage_error({"--n=1", "prog"});
  CHECK_THAT(e, Catch::Contains("ambiguous flag '--n'"));
  CHECK_THAT(e, Catch::Contains("--nnodes"));
  CHECK_THAT(e, Catch::Contains("--nproc_per_node"));
  CHECK_THAT(e, Catch::Contains("--no_python"));
  CHECK_THAT(usage_error({"--nproc_per_nodes=2", "prog"}), Catch::Contains("did you mean '--nproc_per_node'?"));
}

TEST_CASE("endpoints and addresses are checked before anything starts") {
  CHECK_THAT(usage_error({"--nnodes=2", "--rdzv_backend=c10d", "--rdzv_endpoint=a:b:c", "prog"}),
             Catch::Contains("bad endpoint 'a:b:c'"));
  CHECK_THAT(usage_error({"--rdzv_endpoint=host:70000", "prog"}), Catch::Contains("0..65535"));
  CHECK_THAT(usage_error({"--rdzv_endpoint=[::1:5", "prog"}), Catch::Contains("']'"));
  CHECK_THAT(usage_error({"--rdzv_endpoint=[zz::q]:5", "prog"}), Catch::Contains("not an IPv6 address"));
  CHECK_THAT(usage_error({"--rdzv_endpoint=ho st:5", "prog"}), Catch::Contains("not a host name"));
  CHECK_THAT(usage_error({"--master_addr=a..b", "prog"}), Catch::Contains("bad --master_addr 'a..b'"));
  CHECK_THAT(usage_error({"--local_addr=x/y", "prog"}), Catch::Contains("bad --local_addr 'x/y'"));
  CHECK_THAT(usage_error({"--master_port=65536", "prog"}), Catch::Contains("use 0..65535"));
  CHECK(parse({"--rdzv_endpoint=[::1]:41234", "prog"}).rdzv_endpoint == "[::1]:41234");
  CHECK(parse({"--rdzv_endpoint=::1", "prog"}).rdzv_endpoint == "::1");
  CHECK(parse({"--rdzv_endpoint=node-1.example.org:41237", "prog"}).rdzv_endpoint == "node-1.example.org:41237");
}

TEST_CASE("a static rendezvous endpoint without a port takes --master_port, and the two must agree") {
  // plan.cc uses opts.master_port for HOST without a port; see plan_test for the plan itself.
  auto o = parse({"--rdzv_endpoint=127.0.0.1", "--master_port=12345", "prog"});
  CHECK(o.master_port == 12345);
  CHECK_THAT(usage_error({"--rdzv_endpoint=127.0.0.1:1000", "--master_port=2000", "prog"}),
             Catch::Contains("give the port once"));
  CHECK(parse({"--rdzv_endpoint=127.0.0.1:2000", "--master_port=2000", "prog"}).master_port == 2000);
  auto c = parse({"--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1", "--master_port=1234", "prog"});
  REQUIRE(c.warnings.size() == 1);
  CHECK_THAT(c.warnings[0], Catch::Contains("--rdzv_endpoint=127.0.0.1:1234"));
}

TEST_CASE("a config key that is no flag is an error naming the nearest flag") {
  std::string path = std::string(std::getenv("TMPDIR") ? std::getenv("TMPDIR") : "/tmp") + "/mg_config_keys." +
                     std::to_string(::getpid()) + ".json";
  std::ofstream(path) << R"({"nproc_per_nodes": 3})";
  CHECK_THAT(usage_error({"--config", path, "prog"}),
             Catch::Contains("unknown key 'nproc_per_nodes': did you mean 'nproc_per_node'?"));
  std::ofstream(path) << R"({"nproc-per-node": 2, "max_restarts": 1})";
  auto o = parse({"--config", path, "prog"});
  CHECK(o.nproc_per_node == 2);
  CHECK(o.max_restarts == 1);
  std::remove(path.c_str());
}

TEST_CASE("a bad PET_ variable is named as that variable, and PET_ beats the config") {
  CHECK_THAT(usage_error({"prog"}, {{"PET_NNODES", "x"}}), Catch::Contains("bad PET_NNODES 'x'"));
  CHECK_THAT(usage_error({"prog"}, {{"PET_MAX_RESTARTS", "-1"}}), Catch::Contains("bad PET_MAX_RESTARTS '-1'"));
  CHECK_THAT(usage_error({"prog"}, {{"PET_MASTER_PORT", "99999"}}), Catch::Contains("bad PET_MASTER_PORT '99999': use 0..65535"));
  CHECK_THAT(usage_error({"prog"}, {{"PET_STANDALONE", "maybe"}}), Catch::Contains("PET_STANDALONE"));
  CHECK_THAT(usage_error({"--nnodes=x", "prog"}, {{"PET_NNODES", "2"}}), Catch::Contains("bad --nnodes 'x'"));
  std::string path = std::string(std::getenv("TMPDIR") ? std::getenv("TMPDIR") : "/tmp") + "/mg_config_env." +
                     std::to_string(::getpid()) + ".json";
  std::ofstream(path) << R"({"max_restarts": 4})";
  CHECK(parse({"--config", path, "prog"}, {{"PET_MAX_RESTARTS", "2"}}).max_restarts == 2);
  std::ofstream(path) << R"({"max_restarts": -4})";
  CHECK_THAT(usage_error({"--config", path, "prog"}), Catch::Contains("--config key 'max_restarts'"));
  std::remove(path.c_str());
}

TEST_CASE("the rendezvous conf takes every key torchrun 2.x's rendezvous backends read") {
  // The Done-when line of #25: torch 2.x users write these.
  auto o = parse({"--rdzv_conf=use_libuv=0,read_timeout=60", "prog"});
  CHECK(o.usage_warnings.empty());
  // c10d / dynamic rendezvous, LaunchConfig, static, etcd and etcd-v2 keys, all at once.
  auto all = parse({"--nnodes=1:2", "--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:4242",
                    "--rdzv-conf=read_timeout=60,timeout=900,is_host=false,use_libuv=False,store_type=tcp,"
                    "join_timeout=7,last_call_timeout=2,close_timeout=5,heartbeat_timeout=10,keep_alive_interval=1,"
                    "keep_alive_max_attempt=4,use_agent_store=true,rank=0,protocol=https,cacert=/ca,cert=/c,key=/k,"
                    "etcd_prefix=/p,user=u,ca_cert=/a,ssl_cert=/b,ssl_cert_key=/d",
                    "prog"});
  CHECK(all.usage_warnings.empty());
  CHECK(all.join_timeout == std::chrono::seconds(7));
  CHECK(all.last_call_timeout == std::chrono::seconds(2));
  CHECK(all.keep_alive_interval == std::chrono::seconds(1));
  CHECK(all.keep_alive_max_attempt == 4);
  CHECK(all.rdzv_is_host == false);
  for (const auto& key : known_rdzv_conf_keys()) {
    INFO(key);
    const std::string value = key == "protocol" ? "http" : key == "store_type" ? "file" : "1";
    CHECK(parse({"--rdzv_conf=" + key + "=" + value, "prog"}).usage_warnings.empty());
  }
  // torch's boolean spellings (RendezvousParameters.get_as_bool)
  CHECK(parse({"--rdzv_conf=is_host=Y", "prog"}).rdzv_is_host == true);
  CHECK(parse({"--rdzv_conf=is_host=F", "prog"}).rdzv_is_host == false);
  // The environment variable torchrun's `env` action reads.
  CHECK(parse({"prog"}, {{"PET_RDZV_CONF", "join_timeout=11"}}).join_timeout == std::chrono::seconds(11));
  // Bad values of known keys stay usage errors naming the key.
  CHECK_THAT(usage_error({"--rdzv_conf=use_libuv=maybe", "prog"}), Catch::Contains("use_libuv"));
  CHECK_THAT(usage_error({"--rdzv_conf=read_timeout=soon", "prog"}), Catch::Contains("read_timeout"));
  CHECK_THAT(usage_error({"--rdzv_conf=store_type=redis", "prog"}), Catch::Contains("store_type"));
  CHECK_THAT(usage_error({"--rdzv_conf=timeout=", "prog"}), Catch::Contains("timeout"));
  CHECK_THAT(usage_error({"--rdzv_conf=join_timeout", "prog"}), Catch::Contains("KEY=VALUE"));
}

TEST_CASE("an unknown --rdzv_conf key is one warning naming the nearest known key, not an error") {
  auto o = parse({"--rdzv_conf=join_timout=5,last_call_timeout=1", "prog"});
  REQUIRE(o.usage_warnings.size() == 1);
  CHECK(o.usage_warnings[0] ==
        "--rdzv_conf key 'join_timout' is not one mglaunch or torchrun knows (did you mean 'join_timeout'?); ignored");
  CHECK(o.last_call_timeout == std::chrono::seconds(1));  // the other keys still apply
  CHECK(o.join_timeout == std::chrono::seconds(600));
  auto far = parse({"--rdzv_conf=flux_capacitor=1.21", "prog"});
  REQUIRE(far.usage_warnings.size() == 1);
  CHECK(far.usage_warnings[0] == "--rdzv_conf key 'flux_capacitor' is not one mglaunch or torchrun knows; ignored");
}

TEST_CASE("a --rdzv_conf wrapped in quotes, as PyTorch's launcher tests pass it, applies its keys") {
  // test_run.py: --rdzv-conf='join_timeout=5,last_call_timeout=1,timeout=5' (quotes in the value).
  auto o = parse({"--rdzv-conf='join_timeout=5,last_call_timeout=1,timeout=5'", "prog"});
  CHECK(o.usage_warnings.empty());
  CHECK(o.join_timeout == std::chrono::seconds(5));
  CHECK(o.last_call_timeout == std::chrono::seconds(1));
  auto dq = parse({"--rdzv_conf=\"join_timeout=6\"", "prog"});
  CHECK(dq.join_timeout == std::chrono::seconds(6));
  // Each value's quotes and spaces around keys and values go too, as torchrun strips them.
  auto each = parse({"--nnodes=2", "--rdzv_backend=etcd", "--rdzv_endpoint=127.0.0.1:2379",
                     "--rdzv_conf= join_timeout = '8' ,etcd_prefix=\"/my prefix\"", "prog"});
  CHECK(each.join_timeout == std::chrono::seconds(8));
  CHECK(each.etcd_prefix == "/my prefix");
  // Unmatched quotes are no pair: kept, and the key is then unknown.
  CHECK_THAT(parse({"--rdzv_conf='join_timeout=5", "prog"}).usage_warnings.at(0), Catch::Contains("did you mean 'join_timeout'"));
}

TEST_CASE("torch 2.x's TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE sets the prefix, and the flag and PET_ one win") {
  const std::map<std::string, std::string> torch2{{"TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", "[rank${rank}]: "}};
  CHECK(parse({"prog"}, torch2).log_line_prefix_template == "[rank${rank}]: ");
  auto both = torch2;
  both["PET_LOG_LINE_PREFIX_TEMPLATE"] = "pet ";
  CHECK(parse({"prog"}, both).log_line_prefix_template == "pet ");
  CHECK(parse({"--log-line-prefix-template=flag ", "prog"}, both).log_line_prefix_template == "flag ");
  // Empty is unset for torch's variable (torch's `if template:`), raw lines for the flag.
  CHECK_FALSE(parse({"prog"}, {{"TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", ""}}).log_line_prefix_template);
  CHECK(parse({"--log-line-prefix-template=", "prog"}, torch2).log_line_prefix_template == "");
}

TEST_CASE("shutdown timeout: --shutdown-timeout is torchrun's name for the stop grace: flag > --grace > TORCH_ELASTIC_SHUTDOWN_TIMEOUT") {
  using std::chrono::milliseconds;
  CHECK(parse({"prog"}).grace == milliseconds(30000));
  CHECK(parse({"--shutdown-timeout=7", "prog"}).grace == milliseconds(7000));
  CHECK(parse({"--shutdown_timeout", "7", "prog"}).grace == milliseconds(7000));
  CHECK(parse({"prog"}, {{"PET_SHUTDOWN_TIMEOUT", "8"}}).grace == milliseconds(8000));
  CHECK(parse({"prog"}, {{"TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "9"}}).grace == milliseconds(9000));
  CHECK(parse({"--grace=4", "prog"}, {{"TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "9"}}).grace == milliseconds(4000));
  auto both = parse({"--grace=4", "--shutdown-timeout=6", "prog"}, {{"TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "9"}});
  CHECK(both.grace == milliseconds(6000));
  REQUIRE(both.warnings.size() == 1);
  CHECK_THAT(both.warnings[0], Catch::Contains("--grace 4 has no effect"));
  CHECK_THAT(usage_error({"--shutdown-timeout=soon", "prog"}), Catch::Contains("--shutdown_timeout"));
  CHECK_THAT(usage_error({"prog"}, {{"TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "-1"}}),
             Catch::Contains("TORCH_ELASTIC_SHUTDOWN_TIMEOUT"));
}

TEST_CASE("signals to handle: --signals-to-handle is parsed into signal numbers, and a bad name is a usage error naming it") {
  CHECK(parse({"prog"}).signals_to_handle == std::vector<int>{SIGTERM, SIGINT, SIGHUP, SIGQUIT});
  CHECK(parse({"--signals-to-handle=SIGTERM,SIGUSR1,usr2", "prog"}).signals_to_handle ==
        std::vector<int>{SIGTERM, SIGUSR1, SIGUSR2});
  CHECK(parse({"prog"}, {{"PET_SIGNALS_TO_HANDLE", "SIGINT"}}).signals_to_handle == std::vector<int>{SIGINT});
  CHECK(parse({"prog"}, {{"TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGHUP"}}).signals_to_handle == std::vector<int>{SIGHUP});
  CHECK(parse({"--signals_to_handle=SIGQUIT", "prog"}, {{"TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGHUP"}})
            .signals_to_handle == std::vector<int>{SIGQUIT});
  CHECK_THAT(usage_error({"--signals-to-handle=SIGTERM,SIGFOO", "prog"}),
             Catch::Contains("--signals_to_handle") && Catch::Contains("'SIGFOO' is no signal name"));
  CHECK_THAT(usage_error({"--signals-to-handle=SIGKILL", "prog"}), Catch::Contains("SIGKILL cannot be caught"));
  CHECK_THAT(usage_error({"--signals-to-handle=SIGTERM,", "prog"}), Catch::Contains("'' is no signal name"));
  // Python's real-time names (signal.SIGRTMIN, SIGRTMAX), and an offset from them.
  CHECK(parse({"--signals-to-handle=SIGTERM,SIGRTMIN,SIGRTMAX,SIGRTMIN+2", "prog"}).signals_to_handle ==
        std::vector<int>{SIGTERM, SIGRTMIN, SIGRTMAX, SIGRTMIN + 2});
  CHECK_THAT(usage_error({"--signals-to-handle=SIGRTMIN+99", "prog"}), Catch::Contains("is no signal name"));
}

TEST_CASE("numa binding: --numa-binding binds as --cpu-bind does, torchrun's names for its policies") {
  CHECK(parse({"--numa-binding=node", "prog"}).cpu_bind == "numa");
  CHECK(parse({"--numa_binding=exclusive", "prog"}).cpu_bind == "cores");
  CHECK(parse({"--numa-binding=socket", "prog"}).cpu_bind == "socket");
  auto cc = parse({"--numa-binding=core-complex", "prog"});
  CHECK(cc.cpu_bind == "core-complex");
  CHECK(cc.numa_binding == "core-complex");
  CHECK(parse({"--cpu-bind=socket", "prog"}).cpu_bind == "socket");
  CHECK(parse({"--cpu-bind=numa", "--numa-binding=node", "prog"}).cpu_bind == "numa");  // the same: fine
  CHECK_THAT(usage_error({"--cpu-bind=cores", "--numa-binding=node", "prog"}), Catch::Contains("give one of them"));
  CHECK_THAT(usage_error({"--numa-binding=rack", "prog"}),
             Catch::Contains("bad --numa-binding 'rack': use node, socket, exclusive or core-complex"));
}

TEST_CASE("torch 2.x values: --virtual-local-rank, --event-log-handler, --logs-specs and the duplicate filters take torchrun's values") {
  CHECK(parse({"--virtual-local-rank", "prog"}).virtual_local_rank);
  CHECK(parse({"prog"}, {{"PET_VIRTUAL_LOCAL_RANK", "1"}}).virtual_local_rank);
  CHECK_THAT(usage_error({"--nproc_per_node=3", "--virtual-local-rank", "prog"}, {{"CUDA_VISIBLE_DEVICES", "4,5"}}),
             Catch::Contains("CUDA_VISIBLE_DEVICES=4,5 names 2 GPU(s)"));
  CHECK(parse({"prog"}).event_log_handler == "null");
  CHECK(parse({"--event-log-handler=console", "prog"}).event_log_handler == "console");
  CHECK(parse({"prog"}, {{"PET_EVENT_LOG_HANDLER", "console"}}).event_log_handler == "console");
  CHECK_THAT(usage_error({"--event_log_handler=scuba", "prog"}), Catch::Contains("use null or console"));
  // --help tells what console does (it prints the events; an old text said none were).
  const std::string help = parse_agent_args({"mglaunch", "--help"}, {}, kProbe).message;
  const auto at = help.find("--event_log_handler");
  REQUIRE(at != std::string::npos);
  const std::string text = help.substr(at, help.find("\n  -", at) - at);
  CHECK_THAT(text, Catch::Contains("console prints"));
  CHECK_THAT(text, !Catch::Contains("not printed") && !Catch::Contains("no event records"));
  CHECK(parse({"--logs-specs=default", "prog"}).program == "prog");
  CHECK_THAT(usage_error({"--logs_specs=mine", "prog"}),
             Catch::Contains("Could not find entrypoint under 'torchrun.logs_specs[mine]' key"));
  auto f = parse({"--duplicate-stdout-filters=apple,orange,,pear", "--duplicate_stderr_filters=x", "prog"});
  CHECK(f.duplicate_filters[0] == std::vector<std::string>{"apple", "orange,pear"});
  CHECK(f.duplicate_filters[1] == std::vector<std::string>{"x"});
  CHECK(parse({"prog"}, {{"PET_DUPLICATE_STDOUT_FILTERS", "a"}}).duplicate_filters[0] == std::vector<std::string>{"a"});
  CHECK(parse_filter_list("").empty());
  CHECK(parse_filter_list(",a,,b,,,c,") == std::vector<std::string>{"a,b,", "c"});
}
