// mglaunch-sbatch's flags and batch script, and the quoting that carries arguments
// through it (checked by running the quoted words through a real /bin/sh).
#include <catch2/catch.hpp>

#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <tuple>

#include "slurm/sbatch.h"
#include "slurm/sbatch_check.h"
#include "process/command.h"
#include "support/proc.h"

using namespace mg::slurm;
using mg::shell_quote;

namespace {

SbatchOptions parse(std::vector<std::string> args) {
  args.insert(args.begin(), "mglaunch-sbatch");
  auto out = parse_sbatch_args(args);
  REQUIRE(out.options);
  out.options->mglaunch = "/opt/mg/bin/mglaunch";
  return *out.options;
}

std::string usage_error(std::vector<std::string> args) {
  args.insert(args.begin(), "mglaunch-sbatch");
  try {
    parse_sbatch_args(args);
  } catch (const SbatchUsageError& e) {
    return e.what();
  }
  FAIL("expected a SbatchUsageError");
  return {};
}

// Runs `printf '%s\n' WORDS` through /bin/sh and returns what it printed.
std::string through_shell(const std::string& words) {
  std::string cmd = "printf '%s\\n' " + words;
  std::string quoted_cmd = "/bin/sh -c " + shell_quote(cmd);
  FILE* f = ::popen(quoted_cmd.c_str(), "r");
  REQUIRE(f);
  std::string out;
  char buf[4096];
  for (std::size_t n; (n = std::fread(buf, 1, sizeof(buf), f)) > 0;) out.append(buf, n);
  ::pclose(f);
  return out;
}

bool has_line(const std::string& text, const std::string& line) {
  return ("\n" + text).find("\n" + line + "\n") != std::string::npos;
}

}  // namespace

TEST_CASE("mglaunch-sbatch writes #SBATCH lines for every flag given, one task per node and the signal") {
  auto o = parse({"--nodes", "2", "--gpus-per-node", "4", "--partition", "gpu", "--time", "1:00:00", "--account",
                  "proj", "--output", "run-%j.out", "--signal-before", "300", "--", "train.py", "--lr", "0.1"});
  const std::string s = make_batch_script(o);
  CHECK(s.starts_with("#!/bin/bash\n"));
  for (const char* line : {"#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=4",
                           "#SBATCH --partition=gpu", "#SBATCH --time=1:00:00", "#SBATCH --account=proj",
                           "#SBATCH --output=run-%j.out", "#SBATCH --signal=B:USR1@300", "#SBATCH --no-requeue"}) {
    INFO(line);
    CHECK(has_line(s, line));
  }
  CHECK(has_line(s, "srun --kill-on-bad-exit=1 --ntasks-per-node=1 /opt/mg/bin/mglaunch train.py --lr 0.1 &"));
  CHECK_THAT(s, !Catch::Contains("scontrol requeue"));
  CHECK(has_line(s, "exit \"$rc\""));
}

TEST_CASE("with --requeue the script requeues the job when the step stopped with 75") {
  auto o = parse({"--nodes", "3", "--requeue", "--", "--max_restarts=1", "prog"});
  const std::string s = make_batch_script(o);
  CHECK(has_line(s, "#SBATCH --requeue"));
  CHECK(has_line(s, "#SBATCH --signal=B:USR1@120"));  // the default warning time
  CHECK(has_line(s, "trap forward USR1"));
  CHECK_THAT(s, Catch::Contains("if [ \"$rc\" -eq 75 ] || { [ \"$preempted\" = 1 ] && [ \"$rc\" -eq 143 ]; }") &&
                   Catch::Contains("scontrol requeue \"$SLURM_JOB_ID\""));
  CHECK_THAT(s, Catch::Contains("/opt/mg/bin/mglaunch --max_restarts=1 prog &"));
}

TEST_CASE("arguments with spaces, quotes and shell characters survive the batch script") {
  const std::vector<std::string> args = {"a b", "it's", "\"q\"", "$HOME", "`id`", "x;y", "", "tab\there", "new\nline",
                                         "back\\slash", "*", "~"};
  std::string words;
  std::string expected;
  for (const auto& a : args) {
    words += " " + shell_quote(a);
    expected += a + "\n";
  }
  CHECK(through_shell(words) == expected);
  CHECK(shell_quote("plain-word_1.2:/x=y@z%,+") == "plain-word_1.2:/x=y@z%,+");
  // Random bytes too (no NUL: argv cannot hold it).
  std::mt19937 rng(11);
  for (int i = 0; i < 50; ++i) {
    std::string a;
    for (int k = 0; k < 12; ++k) a += static_cast<char>(1 + rng() % 126);
    CHECK(through_shell(shell_quote(a)) == a + "\n");
  }
}

TEST_CASE("bad mglaunch-sbatch flags are one clear line each") {
  CHECK_THAT(usage_error({"--nodes", "0", "--", "p"}), Catch::Contains("--nodes"));
  CHECK_THAT(usage_error({"--gpus-per-node", "0", "--", "p"}), Catch::Contains("--gpus-per-node"));
  CHECK_THAT(usage_error({"--nodes", "2"}), Catch::Contains("no program given"));
  CHECK_THAT(usage_error({"--partition", "a b", "--", "p"}), Catch::Contains("#SBATCH"));
  CHECK_THAT(usage_error({"--signal-before", "0", "--", "p"}), Catch::Contains("--signal-before"));
  CHECK_THAT(usage_error({"--mglaunch", "bin/mglaunch", "--", "p"}), Catch::Contains("absolute"));
  CHECK_THAT(usage_error({"--bogus", "--", "p"}), Catch::Contains("--bogus"));
  for (const auto& e : {usage_error({"--nodes", "x", "--", "p"}), usage_error({"--time", "1\n2", "--", "p"})})
    CHECK(e.find('\n') == std::string::npos);
}

TEST_CASE("mglaunch-sbatch's --help and --version print and do not submit") {
  auto help = parse_sbatch_args({"mglaunch-sbatch", "--help"});
  CHECK_FALSE(help.options);
  CHECK_THAT(help.message, Catch::Contains("--requeue") && Catch::Contains("Exit codes"));
  CHECK_THAT(parse_sbatch_args({"mglaunch-sbatch", "--version"}).message, Catch::Contains("mglaunch-sbatch"));
}

TEST_CASE("an empty mglaunch-sbatch flag value never eats the next argument") {
  // `--partition=$UNSET --nodes=2`: no partition, two nodes (not partition '--nodes=2').
  auto o = parse({"--partition=", "--nodes=2", "--", "p"});
  CHECK(o.partition.empty());
  CHECK(o.nodes == 2);
  CHECK(o.command == std::vector<std::string>{"p"});
  CHECK_THAT(usage_error({"--nodes=", "--", "p"}), Catch::Contains("empty value in '--nodes='"));
  CHECK_THAT(usage_error({"--job-name=", "--", "p"}), Catch::Contains("--job-name"));
  CHECK_THAT(usage_error({"--partition", "--nodes=2", "--", "p"}), Catch::Contains("--partition needs a value"));
}

TEST_CASE("mglaunch-sbatch takes unique prefixes of its long flags") {
  CHECK(parse({"--part=gpu", "--", "p"}).partition == "gpu");
  CHECK(parse({"--signal-b", "60", "--", "p"}).signal_before == 60);
  CHECK(parse({"--re", "--", "p"}).requeue);
  CHECK_THAT(usage_error({"--nodez=2", "--", "p"}), Catch::Contains("did you mean '--nodes'?"));
}

TEST_CASE("mglaunch-sbatch writes --cpus-per-task, --mem, --exclusive, --qos, --gres and any --sbatch option") {
  auto o = parse({"--nodes=2", "-c", "16", "--mem", "64G", "--exclusive", "--qos=high", "--gres=gpu:a100:4",
                  "--sbatch=--constraint=a100", "--sbatch=--mail-type=END", "--", "train.py"});
  const std::string s = make_batch_script(o);
  for (const char* line : {"#SBATCH --cpus-per-task=16", "#SBATCH --mem=64G", "#SBATCH --exclusive", "#SBATCH --qos=high",
                           "#SBATCH --gres=gpu:a100:4", "#SBATCH --constraint=a100", "#SBATCH --mail-type=END"}) {
    INFO(line);
    CHECK(has_line(s, line));
  }
  CHECK(has_line(s, "#SBATCH --ntasks-per-node=1"));
  // Slurm >= 22.05: the step does not inherit the job's --cpus-per-task, so srun says it too.
  CHECK_THAT(s, Catch::Contains("srun --kill-on-bad-exit=1 --ntasks-per-node=1 --cpus-per-task=16 /opt/mg/bin/mglaunch"));
  // Not given: not written.
  const std::string plain = make_batch_script(parse({"--", "train.py"}));
  CHECK_THAT(plain, !Catch::Contains("--mem") && !Catch::Contains("--exclusive") && !Catch::Contains("--cpus-per-task"));
  CHECK_THAT(usage_error({"--cpus-per-task=0", "--", "p"}), Catch::Contains("--cpus-per-task"));
  CHECK_THAT(usage_error({"--mem", "8 G", "--", "p"}), Catch::Contains("#SBATCH"));
  CHECK_THAT(usage_error({"--sbatch", "--constraint=a100", "--", "p"}), Catch::Contains("--sbatch=VALUE"));
  CHECK_THAT(usage_error({"--sbatch=constraint", "--", "p"}), Catch::Contains("one sbatch option"));
  // What the script sets itself is not overridden behind its back.
  CHECK_THAT(usage_error({"--sbatch=--ntasks-per-node=4", "--", "p"}), Catch::Contains("--nproc_per_node"));
  CHECK_THAT(usage_error({"--sbatch=-N3", "--", "p"}), Catch::Contains("use mglaunch-sbatch's --nodes"));
  CHECK_THAT(usage_error({"--sbatch=--signal=USR2@60", "--", "p"}), Catch::Contains("--signal-before"));
  // sbatch takes a long name's unambiguous start: so does the refusal.
  CHECK_THAT(usage_error({"--sbatch=--ntasks-per-nod=4", "--", "p"}), Catch::Contains("--nproc_per_node"));
  CHECK_THAT(usage_error({"--sbatch=--sig=B:USR2@60", "--", "p"}), Catch::Contains("--signal-before"));
  CHECK_THAT(usage_error({"--sbatch=--job=x", "--", "p"}), Catch::Contains("--job-name"));
  CHECK_NOTHROW(parse({"--sbatch=--wait-all-nodes=1", "--sbatch=--nice=5", "--", "p"}));
  // No name at all: a usage error, not a crash.
  for (const char* bad : {"--sbatch=--", "--sbatch=---", "--sbatch=--=4"})
    CHECK_THAT(usage_error({bad, "--", "p"}), Catch::Contains("one sbatch option"));
}

TEST_CASE("the mglaunch flags after -- go through mglaunch's own parser as node 0 of the job sees them") {
  CHECK_FALSE(mglaunch_usage_error(parse({"--nodes=2", "--", "--nproc_per_node=4", "--max_restarts=2", "train.py"}), {}));
  CHECK_FALSE(mglaunch_usage_error(parse({"--nodes=3", "--gpus-per-node=8", "--", "train.py", "--lr", "0.1"}), {}));
  auto typo = mglaunch_usage_error(parse({"--nodes=2", "--", "--nprocs_per_node=4", "train.py"}), {});
  REQUIRE(typo);
  CHECK_THAT(*typo, Catch::Contains("--nprocs_per_node") && Catch::Contains("did you mean"));
  CHECK(mglaunch_usage_error(parse({"--", "--max_restarts=x", "train.py"}), {}));
  CHECK(mglaunch_usage_error(parse({"--", "--nproc_per_node=4"}), {}));  // no program
  // The submitting shell's PET_* variables reach the job (sbatch exports them): checked too.
  CHECK(mglaunch_usage_error(parse({"--", "train.py"}), {{"PET_MAX_RESTARTS", "many"}}));
  // Its own SLURM_* variables (mglaunch-sbatch run inside an allocation) are not the job's.
  const auto env = simulated_step_env(parse({"--nodes=4", "--", "p"}), {{"SLURM_NODEID", "3"}, {"HOME", "/h"}});
  CHECK(env.at("SLURM_NODEID") == "0");
  CHECK(env.at("SLURM_NNODES") == "4");
  CHECK(env.at("HOME") == "/h");
}

TEST_CASE("mglaunch-sbatch refuses a typo in the mglaunch flags before it runs sbatch (one line, exit 2)") {
  const std::string dir = mgtest::make_temp_dir();
  const std::string marker = dir + "/sbatch_ran";
  {  // a fake sbatch on PATH that says whether it ran
    FILE* f = std::fopen((dir + "/sbatch").c_str(), "w");
    REQUIRE(f);
    std::fprintf(f, "#!/bin/sh\ncat > %s\necho 'Submitted batch job 7'\n", marker.c_str());
    std::fclose(f);
    REQUIRE(::chmod((dir + "/sbatch").c_str(), 0755) == 0);
  }
  auto run = [&](const std::string& args) {
    const std::string cmd = "PATH=" + dir + ":/usr/bin:/bin " + std::string(MGLAUNCH_SBATCH_BIN) + " " + args + " 2>&1";
    FILE* f = ::popen(cmd.c_str(), "r");
    REQUIRE(f);
    std::string out;
    char buf[4096];
    for (std::size_t n; (n = std::fread(buf, 1, sizeof(buf), f)) > 0;) out.append(buf, n);
    const int status = ::pclose(f);
    return std::pair<int, std::string>{WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
  };
  auto [code, out] = run("--mglaunch=/bin/true --nodes 2 -- --nproc-per-nod=4 --max_restars=1 train.py");
  CHECK(code == 2);
  CHECK_THAT(out, Catch::StartsWith("mglaunch-sbatch: error: the mglaunch flags after '--': ") &&
                      Catch::Contains("--max_restars") && Catch::Contains("nothing was submitted"));
  CHECK(std::count(out.begin(), out.end(), '\n') == 1);
  CHECK(::access(marker.c_str(), F_OK) != 0);
  // The same command without the typo is submitted, the script on sbatch's stdin.
  std::tie(code, out) = run("--mglaunch=/bin/true --nodes 2 --mem=8G -- --nproc-per-nod=4 --max_restarts=1 train.py");
  CHECK(code == 0);
  CHECK_THAT(out, Catch::Contains("Submitted batch job 7"));
  CHECK(::access(marker.c_str(), F_OK) == 0);
  std::remove(marker.c_str());
  std::remove((dir + "/sbatch").c_str());
  ::rmdir(dir.c_str());
}

TEST_CASE("the check of the mglaunch flags counts the GPUs of --gres and --sbatch=--gpus*, and only warns when it cannot") {
  CHECK(job_gpus_per_node(parse({"--gres=gpu:a100:4", "--", "p"})).count == 4);
  CHECK(job_gpus_per_node(parse({"--gres=nvme:1,gpu:2,gpu:v100:2", "--", "p"})).count == 4);
  CHECK(job_gpus_per_node(parse({"--gres=gpu", "--", "p"})).count == 1);
  CHECK(job_gpus_per_node(parse({"--sbatch=--gpus-per-node=a100:8", "--", "p"})).count == 8);
  CHECK(job_gpus_per_node(parse({"--", "p"})).count == 0);
  CHECK(job_gpus_per_node(parse({"--", "p"})).known);
  CHECK_FALSE(job_gpus_per_node(parse({"--nodes=2", "--sbatch=--gpus=8", "--", "p"})).known);
  // Valid GPU jobs pass.
  CHECK_FALSE(mglaunch_usage_error(parse({"--nodes", "2", "--gres=gpu:4", "--", "--nproc_per_node=gpu", "train.py"}), {}));
  CHECK_FALSE(mglaunch_usage_error(parse({"--sbatch=--gpus-per-node=4", "--", "--nproc_per_node=gpu", "train.py"}), {}));
  CHECK_FALSE(mglaunch_usage_error(parse({"--gres=gpu:4", "--", "--stdin-rank=2", "train.py"}), {}));
  // What the count makes wrong is still refused when the count is known.
  CHECK(mglaunch_usage_error(parse({"--gres=gpu:2", "--", "--stdin-rank=2", "train.py"}), {}));
  CHECK(mglaunch_usage_error(parse({"--", "--nproc_per_node=gpu", "train.py"}), {}));
  // Not known: a warning, not a refusal; a typo is still refused.
  std::string warning;
  CHECK_FALSE(mglaunch_usage_error(parse({"--nodes=2", "--sbatch=--gpus=8", "--", "--stdin-rank=9", "train.py"}), {},
                                   &warning));
  CHECK_THAT(warning, Catch::Contains("--stdin-rank") && Catch::Contains("--gpus-per-node"));
  CHECK(mglaunch_usage_error(parse({"--nodes=2", "--sbatch=--gpus=8", "--", "--nprocs_per_node=4", "train.py"}), {}));
}

namespace {

// Runs mglaunch-sbatch with PATH=path_dirs and stdout, stderr apart: {exit code, stdout, stderr}.
struct SbatchRun {
  int code = -1;
  std::string out, err;
};
SbatchRun run_sbatch_main(const std::string& dir, const std::string& path_dirs, const std::string& args) {
  const std::string err_path = dir + "/stderr";
  const std::string cmd = "PATH=" + path_dirs + " " + std::string(MGLAUNCH_SBATCH_BIN) + " " + args + " 2>" + err_path;
  FILE* f = ::popen(cmd.c_str(), "r");
  REQUIRE(f);
  SbatchRun r;
  char buf[4096];
  for (std::size_t n; (n = std::fread(buf, 1, sizeof(buf), f)) > 0;) r.out.append(buf, n);
  const int status = ::pclose(f);
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  std::ifstream in(err_path);
  r.err.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  return r;
}

}  // namespace

TEST_CASE("mglaunch-sbatch passes sbatch's stdout, stderr and exit code through, the script on its stdin") {
  const std::string dir = mgtest::make_temp_dir();
  {  // a fake sbatch that keeps its stdin and arguments and fails its own way
    std::ofstream(dir + "/sbatch") << "#!/bin/sh\ncat > " << dir << "/script\necho \"$@\" > " << dir
                                   << "/args\necho 'Submitted batch job 9'\necho 'sbatch: warning: odd' >&2\nexit 3\n";
    REQUIRE(::chmod((dir + "/sbatch").c_str(), 0755) == 0);
  }
  auto r = run_sbatch_main(dir, dir + ":/usr/bin:/bin", "--mglaunch=/bin/true --wait --nodes 2 -- train.py");
  CHECK(r.code == 3);
  CHECK(r.out == "Submitted batch job 9\n");
  CHECK(r.err == "sbatch: warning: odd\n");
  std::ifstream args(dir + "/args"), script(dir + "/script");
  std::string a((std::istreambuf_iterator<char>(args)), std::istreambuf_iterator<char>());
  std::string s((std::istreambuf_iterator<char>(script)), std::istreambuf_iterator<char>());
  CHECK(a == "--wait\n");
  CHECK_THAT(s, Catch::StartsWith("#!") && Catch::Contains("#SBATCH") && Catch::Contains("train.py"));
  std::filesystem::remove_all(dir);
}

TEST_CASE("mglaunch-sbatch without a runnable sbatch is one line and exit 127") {
  const std::string dir = mgtest::make_temp_dir();
  auto r = run_sbatch_main(dir, dir, "--mglaunch=/bin/true -- train.py");  // no sbatch on PATH
  CHECK(r.code == 127);
  CHECK_THAT(r.err, Catch::StartsWith("mglaunch-sbatch: error: cannot run sbatch: not found on PATH;"));
  CHECK(std::count(r.err.begin(), r.err.end(), '\n') == 1);
  std::ofstream(dir + "/sbatch") << "not a program\n";  // executable, but no #! and no ELF
  REQUIRE(::chmod((dir + "/sbatch").c_str(), 0755) == 0);
  r = run_sbatch_main(dir, dir, "--mglaunch=/bin/true -- train.py");
  CHECK(r.code == 127);
  CHECK_THAT(r.err, Catch::StartsWith("mglaunch-sbatch: error: cannot run sbatch: ") &&
                        Catch::Contains("Exec format error"));
  CHECK(std::count(r.err.begin(), r.err.end(), '\n') == 1);
  std::filesystem::remove_all(dir);
}
