// The agent's record of its job (launcher/job_record.h, #34 H1): where it goes, written whole
// and read back, one per job and node, and never another user's (a temporary directory of
// the test's own).
#include <catch2/catch.hpp>

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <mutex>
#include <stdexcept>
#include <tuple>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "launcher/job_record.h"
#include "support/net.h"
#include "support/proc.h"

using namespace mg;
namespace fs = std::filesystem;

namespace {

// Ports picked at run time (never a well-known one, each a real port: no kPort + 2 past
// 65535 under the bind(0) fallback, review s39 L13), though nothing here opens a socket.
const int kPort = mgtest::free_loopback_port(), kPort2 = mgtest::free_loopback_port(),
          kPort3 = mgtest::free_loopback_port();
const std::string kEndpoint = "c10d localhost:" + std::to_string(kPort);
const std::string kOtherEndpoint = "c10d localhost:" + std::to_string(kPort2);

JobRecord sample(const std::string& job = "job7", const std::string& node = "127.0.0.2@hostA") {
  JobRecord r;
  r.job = job;
  r.node = node;
  r.endpoint = kEndpoint;
  r.run = "1764500000000-0123456789abcdef";
  r.epoch = 131075;
  r.hosts = {{"127.0.0.2", kPort}, {"127.0.0.3", kPort2}, {"127.0.0.4", kPort3}};
  r.voters = 3;
  r.voter_hosts = {{"127.0.0.3", kPort2}, {"127.0.0.4", kPort3}};
  return r;
}

// A record directory of the test's own (`dir` set to its path), opened.
std::shared_ptr<JobRecordDir> open_fresh(std::string& dir) {
  dir = mgtest::make_temp_dir() + "/mglaunch";
  std::string why;
  auto d = JobRecordDir::open(dir, &why);
  REQUIRE(d);
  return d;
}

}  // namespace

TEST_CASE("the record directory: MGLAUNCH_RECORD_DIR, else XDG_RUNTIME_DIR/mglaunch, else /tmp/mglaunch-UID") {
  const std::string xdg = mgtest::make_temp_dir();
  CHECK(job_record_dir("/srv/rec", xdg, 1000) == "/srv/rec");
  CHECK(job_record_dir("", xdg, 1000) == xdg + "/mglaunch");
  CHECK(job_record_dir("", "", 1000) == "/tmp/mglaunch-1000");
  // An XDG_RUNTIME_DIR that does not exist here (Slurm's --export=ALL passes the login
  // node's): passed over, without a warning.
  CHECK(job_record_dir("", xdg + "/no-such-dir", 1000) == "/tmp/mglaunch-1000");
  CHECK(node_identity("127.0.0.2", "hostA") == "127.0.0.2@hostA");
  CHECK(job_endpoint("c10d", "localhost:" + std::to_string(kPort)) == kEndpoint);
}

TEST_CASE("a record is written whole (0600, in a directory made 0700) and read back for its job and node only") {
  std::string dir, why;
  const auto d = open_fresh(dir);
  struct stat st{};
  REQUIRE(::stat(dir.c_str(), &st) == 0);
  CHECK((st.st_mode & 0777) == 0700);
  REQUIRE(d->write(sample()) == "");
  const std::string path = job_record_path(dir, "job7", "127.0.0.2@hostA", kEndpoint);
  REQUIRE(::stat(path.c_str(), &st) == 0);
  CHECK((st.st_mode & 0777) == 0600);
  // Nothing else is left beside it (the temporary file was renamed).
  CHECK(std::distance(fs::directory_iterator(dir), fs::directory_iterator()) == 1);
  const auto r = d->read("job7", "127.0.0.2@hostA", kEndpoint, &why);
  REQUIRE(r);
  CHECK(why.empty());
  CHECK(r->run == sample().run);
  CHECK(r->epoch == 131075);
  CHECK(r->hosts == sample().hosts);
  CHECK(r->voters == 3);
  CHECK(r->voter_hosts == sample().voter_hosts);
  // Another node of the same job on this machine, another job: no record, and no complaint.
  CHECK(!d->read("job7", "127.0.0.3@hostA", kEndpoint, &why));
  CHECK(!d->read("job8", "127.0.0.2@hostA", kEndpoint, &why));
  // The same job id and node at another endpoint or backend (two jobs of the default id
  // "none" on one machine, review M1): another file, never this one.
  CHECK(job_record_path(dir, "job7", "127.0.0.2@hostA", kOtherEndpoint) != path);
  CHECK(!d->read("job7", "127.0.0.2@hostA", kOtherEndpoint, &why));
  CHECK(!d->read("job7", "127.0.0.2@hostA", "static localhost:" + std::to_string(kPort), &why));
  CHECK(r->endpoint == kEndpoint);
  CHECK(why.empty());
  // A record of another endpoint found at this one's file (the hash's collision): none.
  const std::string other = job_record_path(dir, "job7", "127.0.0.2@hostA", kOtherEndpoint);
  REQUIRE(::link(path.c_str(), other.c_str()) == 0);
  CHECK(!d->read("job7", "127.0.0.2@hostA", kOtherEndpoint, &why));
  CHECK(why.empty());
  ::unlink(other.c_str());
  // Written again (the next round): the newer one.
  JobRecord next = sample();
  next.epoch = 131076;
  next.hosts.resize(1);
  REQUIRE(d->write(next) == "");
  CHECK(d->read("job7", "127.0.0.2@hostA", kEndpoint, &why)->epoch == 131076);
  // Removed (the job ended): gone.
  d->remove("job7", "127.0.0.2@hostA", kEndpoint);
  CHECK(!d->read("job7", "127.0.0.2@hostA", kEndpoint, &why));
  CHECK(why.empty());
}

// Review s40 L1: a count and addresses of two epochs (a record of an older agent) would count
// the older epoch's answers against too few voters.
TEST_CASE("a record with fewer voters than voters' addresses is read with voters 0, the every-host rule") {
  std::string dir, why;
  const auto d = open_fresh(dir);
  for (const int voters : {1, 2, 3}) {
    JobRecord r = sample();
    r.voters = voters;  // its 2 voter_hosts: 1 is fewer, 2 and 3 are not
    REQUIRE(d->write(r) == "");
    const auto back = d->read("job7", "127.0.0.2@hostA", kEndpoint, &why);
    REQUIRE(back);
    CHECK(back->voters == (voters < 2 ? 0 : voters));
    CHECK(back->voter_hosts == sample().voter_hosts);
  }
}

TEST_CASE("a record that is not one, or is open to other users, is refused with a reason, and job ids of any text map "
          "to file names") {
  std::string dir, why;
  const auto d = open_fresh(dir);
  const std::string path = job_record_path(dir, "job7", "n", kEndpoint);
  std::ofstream(path) << "{\"job\": \"job7\"";
  ::chmod(path.c_str(), 0600);
  CHECK(!d->read("job7", "n", kEndpoint, &why));
  CHECK_THAT(why, Catch::Contains("cannot use " + path) && Catch::Contains("not a record"));
  REQUIRE(d->write(sample("job7", "n")) == "");
  ::chmod(path.c_str(), 0644);
  why.clear();
  CHECK(!d->read("job7", "n", kEndpoint, &why));
  CHECK_THAT(why, Catch::Contains("open to other users"));
  // A job id with slashes and dots stays one file inside the directory.
  const std::string odd = job_record_path(dir, "../../etc/x/slurm-12.0", "n", kEndpoint);
  CHECK(fs::path(odd).parent_path() == fs::path(dir));
}

TEST_CASE("the record directory is refused when it is not this user's alone: another user's, open to others, a "
          "symbolic link") {
  auto why_not = [](const std::string& dir) {
    std::string why;
    return JobRecordDir::open(dir, &why) ? std::string() : why;
  };
  const std::string root = mgtest::make_temp_dir();
  const std::string open_dir = root + "/open";
  REQUIRE(::mkdir(open_dir.c_str(), 0700) == 0);
  ::chmod(open_dir.c_str(), 0777);
  CHECK_THAT(why_not(open_dir), Catch::Contains("open to other users"));
  ::chmod(open_dir.c_str(), 0770);  // the group may write: refused too
  CHECK_THAT(why_not(open_dir), Catch::Contains("open to other users"));
  // Others may read and enter it (a mkdir under umask 022, review M4): used (the files are 0600).
  ::chmod(open_dir.c_str(), 0755);
  CHECK(why_not(open_dir) == "");
  const std::string link = root + "/link";
  const std::string ok = root + "/ok";
  REQUIRE(::mkdir(ok.c_str(), 0700) == 0);
  REQUIRE(::symlink(ok.c_str(), link.c_str()) == 0);
  CHECK_THAT(why_not(link), Catch::Contains("not a directory"));
  // Another user's: as root, a directory given to nobody; otherwise one root owns.
  std::string theirs = "/";
  if (::geteuid() == 0) {
    theirs = root + "/theirs";
    REQUIRE(::mkdir(theirs.c_str(), 0700) == 0);
    REQUIRE(::chown(theirs.c_str(), 65534, 65534) == 0);
  }
  CHECK_THAT(why_not(theirs), Catch::Contains("belongs to uid") && Catch::Contains("not to this user"));
  // Nothing is written where the directory was refused: the agent keeps no record then.
  CHECK(why_not(root + "/ok") == "");
}

TEST_CASE("a record's file operations go through the directory opened once: a path swapped for a link afterwards "
          "changes nothing") {
  const std::string root = mgtest::make_temp_dir();
  const std::string dir = root + "/mglaunch", elsewhere = root + "/elsewhere", moved = root + "/moved";
  std::string why;
  const auto d = JobRecordDir::open(dir, &why);
  REQUIRE(d);
  REQUIRE(::mkdir(elsewhere.c_str(), 0700) == 0);
  // Someone renames the checked directory away and puts a link to another in its place.
  REQUIRE(::rename(dir.c_str(), moved.c_str()) == 0);
  REQUIRE(::symlink(elsewhere.c_str(), dir.c_str()) == 0);
  REQUIRE(d->write(sample()) == "");
  CHECK(fs::is_regular_file(job_record_path(moved, "job7", "127.0.0.2@hostA", kEndpoint)));
  CHECK(fs::is_empty(elsewhere));
  CHECK(d->read("job7", "127.0.0.2@hostA", kEndpoint, &why));
  d->remove("job7", "127.0.0.2@hostA", kEndpoint);
  CHECK(fs::is_empty(moved));
  CHECK(why.empty());
}

TEST_CASE("a record with raw bytes or a port outside 1..65535 is refused with one printable line") {
  std::string dir, why;
  const auto d = open_fresh(dir);
  const std::string path = job_record_path(dir, "job7", "n", kEndpoint);
  auto put = [&](const std::string& text) {
    std::ofstream(path, std::ios::trunc) << text;
    ::chmod(path.c_str(), 0600);
  };
  // The parser quotes the bytes it stopped at: an escape sequence and a line break here.
  put(std::string("{\"job\": \"job7\"\x1b[2J\nfake: line\xff\x01"));
  CHECK(!d->read("job7", "n", kEndpoint, &why));
  CHECK_THAT(why, Catch::Contains("cannot use " + path) && Catch::Contains("not a record"));
  CHECK(why.find('\n') == std::string::npos);
  for (unsigned char c : why) CHECK((c >= 0x20 && c < 0x7f));
  for (int port : {0, 70000, -1}) {
    JobRecord r = sample("job7", "n");
    r.hosts.emplace_back("127.0.0.9", port);
    REQUIRE(d->write(r) == "");
    why.clear();
    CHECK(!d->read("job7", "n", kEndpoint, &why));
    CHECK_THAT(why, Catch::Contains("port " + std::to_string(port) + " outside 1..65535"));
  }
  // Numbers that an int would narrow (2^32 + P was read as P) or that are no whole number:
  // refused, never taken as a port or an epoch (review s39 L4). P: a port picked at run time.
  const std::string p = std::to_string(kPort2), narrowed = std::to_string((1LL << 32) + kPort2);
  const std::string head = fmt::format(R"({{"job":"job7","node":"n","endpoint":"{}","run":"r",)", kEndpoint);
  for (const auto& [hosts, epoch, what] : std::vector<std::tuple<std::string, std::string, std::string>>{
           {R"([["127.0.0.2",)" + narrowed + "]]", "1", "port " + narrowed + " outside 1..65535"},
           {R"([["127.0.0.2",18446744073709551615]])", "1", "outside 1..65535"},
           {R"([["127.0.0.2",1e10]])", "1", "not a whole number"},
           {R"([["127.0.0.2",)" + p + ".5]]", "1", "not a whole number"},
           {R"([["127.0.0.2",)" + p + "]]", "4294967297", "epoch 4294967297 outside"}}) {
    put(head + R"("epoch":)" + epoch + R"(,"hosts":)" + hosts + "}\n");
    why.clear();
    CHECK(!d->read("job7", "n", kEndpoint, &why));
    CHECK_THAT(why, Catch::Contains("not a record") && Catch::Contains(what));
  }
  put(head + R"("epoch":1,"hosts":[["127.0.0.2",)" + p + "]]}\n");  // (the same, in range: read)
  REQUIRE(d->read("job7", "n", kEndpoint, &why));
  CHECK(d->read("job7", "n", kEndpoint, &why)->hosts.at(0).second == kPort2);
}

TEST_CASE("a record of text that is not UTF-8 is written (its bad bytes replaced), never thrown on") {
  std::string dir, why;
  const auto d = open_fresh(dir);
  JobRecord r = sample("job7", "n");
  r.run = "run-\xff\xfe";
  CHECK(d->write(r) == "");  // (nlohmann's dump() threw type_error.316 here, review s39 L3)
  const auto back = d->read("job7", "n", kEndpoint, &why);
  REQUIRE(back);
  CHECK(back->run == "run-\xef\xbf\xbd\xef\xbf\xbd");
}

TEST_CASE("the sweep removes only this writer's temporary files of dead pids an hour old: never a record, however "
          "old, nor a file of another name") {
  std::string dir, why;
  const auto d = open_fresh(dir);
  const auto now = std::chrono::system_clock::now();
  auto put = [&](const std::string& name, std::chrono::hours age) {
    const std::string p = dir + "/" + name;
    std::ofstream(p) << "{}";
    ::chmod(p.c_str(), 0600);
    const auto t = std::chrono::duration_cast<std::chrono::seconds>((now - age).time_since_epoch()).count();
    const timespec times[2] = {{t, 0}, {t, 0}};
    REQUIRE(::utimensat(AT_FDCWD, p.c_str(), times, 0) == 0);
  };
  const std::string rec = job_record_name("old", "n", kEndpoint);
  REQUIRE(d->write(sample("old", "n")) == "");
  const std::string rec_path = dir + "/" + job_record_name("old", "n", kEndpoint);
  const auto t = std::chrono::duration_cast<std::chrono::seconds>((now - std::chrono::hours(24 * 30)).time_since_epoch()).count();
  const timespec month_ago[2] = {{t, 0}, {t, 0}};
  REQUIRE(::utimensat(AT_FDCWD, rec_path.c_str(), month_ago, 0) == 0);
  REQUIRE(d->read("old", "n", kEndpoint, &why));  // (the file an agent just read: a month old)
  const std::string upper = "job-0123456789ABCDEF.json";  // capitals: not a name write() makes
  put(rec + ".4000001.tmp", std::chrono::hours(2));     // a dead pid's, two hours old: removed
  put(rec + ".4000003.tmp", std::chrono::hours(0));     // a dead pid's now (another pid namespace's?)
  put(rec + ".4000002.tmp", std::chrono::hours(2));     // a live one's
  put("notes.txt", std::chrono::hours(24 * 30));         // not a record: never touched
  put("job-llama70b_run_042.json", std::chrono::hours(24 * 30));      // a user's file of the shape
  put("job-llama70b_run_042.json.4000001.tmp", std::chrono::hours(24 * 30));
  put(upper + ".4000001.tmp", std::chrono::hours(24 * 30));
  put(rec + ".x.tmp", std::chrono::hours(24 * 30));       // no pid
  put(rec + ".04000001.tmp", std::chrono::hours(24 * 30));  // not a pid as write() prints it
  const std::string slot = job_record_name("old", "n", kEndpoint, 12);  // (review s41-c M1)
  put(slot + ".4000001.tmp", std::chrono::hours(2));  // a dead pid's of another slot: removed
  const std::string zero = rec.substr(0, 20) + ".012.json";  // not a slot as write() prints it
  put(zero + ".4000001.tmp", std::chrono::hours(2));
  const int removed = d->sweep(now, kJobRecordTmpMinAge, [](pid_t pid) { return pid == 4000002; });
  CHECK(removed == 2);
  CHECK(!fs::exists(dir + "/" + rec + ".4000001.tmp"));
  CHECK(!fs::exists(dir + "/" + slot + ".4000001.tmp"));
  CHECK(fs::exists(dir + "/" + zero + ".4000001.tmp"));
  for (const auto& kept : {rec, rec + ".4000003.tmp", rec + ".4000002.tmp", std::string("notes.txt"),
                           std::string("job-llama70b_run_042.json"), std::string("job-llama70b_run_042.json.4000001.tmp"),
                           upper + ".4000001.tmp", rec + ".x.tmp", rec + ".04000001.tmp"})
    CHECK(fs::exists(dir + "/" + kept));
  // The month-old record is still the agent's (docs/multinode.md: none is ignored for its age).
  CHECK(d->read("old", "n", kEndpoint, &why));
}

TEST_CASE("the record's writes run on a helper thread: the caller never waits for the disk, and of the writes "
          "asked meanwhile only the newest is done") {
  std::promise<void> entered, release;
  std::shared_future<void> go = release.get_future().share();
  std::vector<int> written;  // epochs, in the order the thread wrote them
  std::vector<std::string> after;
  std::mutex mu;
  JobRecordWriter::Ops ops;
  bool first = true;
  ops.write = [&](const JobRecord& r) {
    if (std::exchange(first, false)) {
      entered.set_value();
      go.wait();  // a hung disk, until the test releases it
    }
    std::lock_guard lock(mu);
    written.push_back(r.epoch);
    return std::string(r.epoch == 4 ? "cannot write: disk full" : "");
  };
  ops.remove = [&](const JobRecord&) { std::lock_guard lock(mu); after.push_back("remove"); };
  ops.sweep = [&] { std::lock_guard lock(mu); after.push_back("sweep"); };
  JobRecordWriter w(ops);
  JobRecord r = sample();
  r.epoch = 1;
  w.write(r);
  entered.get_future().wait();  // the thread holds write 1 and the disk does not answer
  for (int e : {2, 3, 4}) {      // the caller goes on: each returns at once
    r.epoch = e;
    w.write(r);
  }
  CHECK(w.take_error().empty());
  release.set_value();
  w.drain();
  CHECK(written == std::vector<int>{1, 4});
  CHECK(after.empty());
  CHECK(w.take_error() == "cannot write: disk full");
  CHECK(w.take_error().empty());  // told once
  w.remove();
  w.drain();
  CHECK(after == std::vector<std::string>{"remove"});
}

namespace {

// Ops that log what the thread did, in order.
struct LoggedOps {
  std::mutex mu;
  std::vector<std::string> log;
  void add(std::string what) {
    std::lock_guard lock(mu);
    log.push_back(std::move(what));
  }
  std::vector<std::string> taken() {
    std::lock_guard lock(mu);
    return log;
  }
  JobRecordWriter::Ops ops() {
    JobRecordWriter::Ops o;
    o.write = [this](const JobRecord& r) { return add("write " + std::to_string(r.epoch)), std::string(); };
    o.remove = [this](const JobRecord& r) { add("remove " + r.job); };
    o.sweep = [this] { add("sweep"); };
    return o;
  }
};

}  // namespace

TEST_CASE("the record's removal at the job's end is final: a write asked after it brings nothing back") {
  LoggedOps logged;
  JobRecordWriter w(logged.ops());
  JobRecord r = sample();
  r.epoch = 1;
  w.write(r);
  w.drain();
  w.remove();  // the job ended
  r.epoch = 2;
  w.write(r);  // (a late remember_job: review s39 L7)
  w.drain();
  CHECK(logged.taken() == std::vector<std::string>{"write 1", "remove job7"});
}

TEST_CASE("a stale record recalled is discarded, and the job's own records follow it") {
  LoggedOps logged;
  JobRecordWriter w(logged.ops());
  w.discard(sample("stale"));
  w.drain();
  JobRecord r = sample();
  r.epoch = 5;
  w.write(r);
  w.drain();
  w.discard(sample("stale"));  // (after a write: nothing, the file was written anew)
  w.drain();
  CHECK(logged.taken() == std::vector<std::string>{"remove stale", "write 5"});
}

TEST_CASE("an exception on the record's helper thread is kept as its error, and the thread goes on") {
  LoggedOps logged;
  JobRecordWriter::Ops ops = logged.ops();
  ops.write = [&](const JobRecord& r) -> std::string {
    if (r.epoch == 1) throw std::runtime_error("bad\nbytes");
    logged.add("write " + std::to_string(r.epoch));
    return {};
  };
  JobRecordWriter w(ops);
  JobRecord r = sample();
  r.epoch = 1;
  w.write(r);
  w.drain();
  CHECK(w.take_error() == "the record's helper thread: bad bytes");
  r.epoch = 2;
  w.write(r);
  w.drain();
  CHECK(logged.taken() == std::vector<std::string>{"write 2"});
}

TEST_CASE("a failed write is told on the helper thread when it fails, without a second write (review s40 M2)") {
  LoggedOps logged;
  JobRecordWriter::Ops ops = logged.ops();
  ops.write = [](const JobRecord&) { return std::string("cannot write: disk full"); };
  JobRecordWriter w(ops);
  std::promise<std::string> told;
  w.on_failure([&told] { told.set_value("told"); });
  w.write(sample());
  auto f = told.get_future();
  REQUIRE(f.wait_for(std::chrono::seconds(60)) == std::future_status::ready);  // (a bound on a hang, no timing)
  CHECK(f.get() == "told");
  w.drain();
  CHECK(w.take_error() == "cannot write: disk full");
}

TEST_CASE("on_disk(): the newest write asked landed, not while it is held (drain_for() is false then), nor after "
          "it failed (drain_for() is true then: review s41-a L1)") {
  using namespace std::chrono_literals;
  std::promise<void> release;
  std::shared_future<void> go = release.get_future().share();
  bool fail = false;
  JobRecordWriter::Ops ops;
  ops.write = [go, &fail](const JobRecord&) {
    go.wait();  // a slow disk, until the test releases it
    return fail ? std::string("cannot write: disk full") : std::string();
  };
  ops.remove = [](const JobRecord&) {};
  ops.sweep = [] {};
  JobRecordWriter w(ops);
  CHECK_FALSE(w.on_disk());  // nothing asked
  w.write(sample());
  CHECK_FALSE(w.drain_for(50ms));
  CHECK_FALSE(w.on_disk());
  release.set_value();
  w.drain();
  CHECK(w.on_disk());
  fail = true;  // (read on the helper thread after the drain: ordered by the writer's lock)
  w.write(sample());
  CHECK(w.drain_for(60s));  // (a bound on a hang, no timing)
  CHECK_FALSE(w.on_disk());
  CHECK(w.take_error() == "cannot write: disk full");
}

// Ops whose write hangs (a hung NFS server) until `go` is released, `entered` set when it begins.
JobRecordWriter::Ops hung_write_ops(std::promise<void>& entered, std::shared_future<void> go) {
  JobRecordWriter::Ops ops;
  ops.write = [&entered, go](const JobRecord&) {
    entered.set_value();
    go.wait();
    return std::string();
  };
  ops.remove = [](const JobRecord&) {};
  ops.sweep = [] {};
  return ops;
}

TEST_CASE("the writer's destructor waits a bounded time for a hung write, then goes on") {
  using namespace std::chrono_literals;
  std::promise<void> entered, release;
  std::shared_future<void> go = release.get_future().share();
  const JobRecordWriter::Ops ops = hung_write_ops(entered, go);
  auto w = std::make_unique<JobRecordWriter>(ops, 50ms);
  w->write(sample());
  entered.get_future().wait();
  auto gone = std::async(std::launch::async, [&w] { w.reset(); });
  const bool returned = gone.wait_for(60s) == std::future_status::ready;  // (a bound on a hang, no timing)
  release.set_value();  // the detached thread ends now
  gone.wait();
  CHECK(returned);
}

TEST_CASE("the tests' port-lock directory is used only when it is this user's alone and no link") {
  const std::string root = mgtest::make_temp_dir();
  auto usable = [](const std::string& path) {
    const int fd = mgtest::port_lock_dir_at(path);
    if (fd >= 0) ::close(fd);
    return fd >= 0;
  };
  CHECK(usable(root + "/made"));  // made 0700 when missing
  const std::string open_dir = root + "/open", link = root + "/link";
  REQUIRE(::mkdir(open_dir.c_str(), 0700) == 0);
  ::chmod(open_dir.c_str(), 0777);  // anyone could flock every port, or plant a link
  CHECK(!usable(open_dir));
  ::chmod(open_dir.c_str(), 0755);
  CHECK(usable(open_dir));
  REQUIRE(::symlink((root + "/made").c_str(), link.c_str()) == 0);
  CHECK(!usable(link));
  const std::string file = root + "/file";
  std::ofstream(file) << "x";
  CHECK(!usable(file));
  if (::geteuid() != 0) CHECK(!usable("/"));  // another user's (root's)
  // And a port is still had, never 0.
  CHECK(mgtest::free_loopback_port() > 0);
}

// Review s39-late L1: records were written at any size and read only up to 256 KiB, and a
// record refused on a restart meant a fresh start (a fork of a job that runs on). Now one
// bound, kMaxJobRecordBytes, holds for both: the largest record the agent makes (1,024 hosts
// and 1,024 voters' addresses of 255 bytes) fits whole; past it a record with a voter count
// loses hosts from its end, and one without (the every-host rule) is not written.
TEST_CASE("a record of 1,024 hosts and 1,024 voters' addresses of 255 bytes each is written and read back whole, and "
          "one past the bound is trimmed to it with a voter count or refused without one (review s39-late L1)") {
  std::string dir, why;
  const auto d = open_fresh(dir);
  JobRecord r = sample("big", "n");
  r.hosts.clear();
  r.voter_hosts.clear();
  for (int i = 0; i < 1024; ++i) {
    const std::string h = fmt::format("{:04}", i) + std::string(251, 'h');
    r.hosts.emplace_back(h, kPort);
    r.voter_hosts.emplace_back(h, kPort2);
  }
  r.voters = 1024;
  REQUIRE(d->write(r) == "");
  const std::string path = job_record_path(dir, "big", "n", kEndpoint);
  CHECK(fs::file_size(path) > 256 * 1024);
  auto back = d->read("big", "n", kEndpoint, &why);
  INFO(why);
  REQUIRE(back);  // main: "ignoring PATH: 5... bytes"
  CHECK(back->hosts == r.hosts);
  CHECK(back->voter_hosts == r.voter_hosts);
  // Past the bound (names longer than any message carries): trimmed, and read back.
  for (auto* l : {&r.hosts, &r.voter_hosts})
    for (auto& [h, p] : *l) h += std::string(400, 'x');
  REQUIRE(d->write(r) == "");
  CHECK(fs::file_size(path) <= kMaxJobRecordBytes);
  back = d->read("big", "n", kEndpoint, &why);
  REQUIRE(back);
  CHECK(back->voters == 1024);
  CHECK(!back->hosts.empty());
  CHECK(back->hosts.size() < r.hosts.size());
  CHECK(std::equal(back->hosts.begin(), back->hosts.end(), r.hosts.begin()));  // the first ones kept
  // Without a voter count every host must answer: none is left out, the write fails, and
  // the record before it stays.
  JobRecord every = r;
  every.voters = 0;
  for (auto& [h, p] : every.hosts) h += std::string(500, 'y');
  CHECK_THAT(d->write(every), Catch::Contains("cannot write " + path) && Catch::Contains("would exceed"));
  back = d->read("big", "n", kEndpoint, &why);
  REQUIRE(back);
  CHECK(back->voters == 1024);
  // A file past the bound is refused, naming it (the agent then ends with exit 3).
  std::ofstream(path, std::ios::trunc) << std::string(kMaxJobRecordBytes + 1, ' ');
  CHECK(!d->read("big", "n", kEndpoint, &why));
  CHECK_THAT(why, Catch::Contains("cannot use " + path) && Catch::Contains("over the 1048576 a record holds"));
}

TEST_CASE("a record keeps whether this node is one of its epoch's voters, and one written before that field is one "
          "only when its own takeover address is a voter's or it had none (review s40-recall M1, s41-c L1)") {
  std::string dir, why;
  const auto d = open_fresh(dir);
  JobRecord r = sample();
  r.self_voter = false;  // a standby that registered after the round closed
  REQUIRE(d->write(r) == "");
  auto back = d->read("job7", "127.0.0.2@hostA", kEndpoint, &why);
  REQUIRE(back);
  CHECK_FALSE(back->self_voter);
  const std::string path = job_record_path(dir, "job7", "127.0.0.2@hostA", kEndpoint);
  // An older record (no self_voter): as an older node wrote it, its own address (127.0.0.2,
  // kPort) among the voters' when it was one.
  auto older = [&](int takeover_port, bool listed) {
    JobRecord o = sample();
    o.takeover_port = takeover_port;
    if (listed) o.voter_hosts.emplace_back("127.0.0.2", takeover_port);
    REQUIRE(d->write(o) == "");
    auto j = nlohmann::json::parse(mgtest::read_file(path));
    j.erase("self_voter");
    std::ofstream(path, std::ios::trunc) << j.dump();
    auto got = d->read("job7", "127.0.0.2@hostA", kEndpoint, &why);
    REQUIRE(got);
    CHECK(why.empty());
    return got->self_voter;
  };
  CHECK(older(0, false));       // an older host, or a socket never bound: the old rule
  CHECK(older(kPort, true));    // a voter
  CHECK_FALSE(older(kPort, false));  // a late standby: none (before: counted itself)
}

TEST_CASE("agents of one job and node take one record slot each, locked for their life, and a slot whose agent is gone "
          "is the next one's, its record first (review s41-c M1)") {
  std::string dir, why;
  const auto d = open_fresh(dir);
  auto claim = [&] {
    auto s = d->claim("job7", "127.0.0.2@hostA", kEndpoint, &why);
    REQUIRE(s);
    CHECK(why.empty());
    return std::move(*s);
  };
  JobRecordSlot a = claim(), b = claim();
  CHECK(a.slot == 0);
  CHECK(b.slot == 1);
  CHECK(job_record_name("job7", "n", kEndpoint, 1) == job_record_name("job7", "n", kEndpoint).substr(0, 20) + ".1.json");
  JobRecord r = sample();
  r.slot = 1;
  REQUIRE(d->write(r) == "");
  CHECK(fs::exists(job_record_path(dir, "job7", "127.0.0.2@hostA", kEndpoint, 1)));
  CHECK_FALSE(fs::exists(job_record_path(dir, "job7", "127.0.0.2@hostA", kEndpoint)));
  CHECK(d->read("job7", "127.0.0.2@hostA", kEndpoint, &why, 1));
  CHECK_FALSE(d->read("job7", "127.0.0.2@hostA", kEndpoint, &why, 0));
  JobRecordSlot c = claim();  // both held: a new one
  CHECK(c.slot == 2);
  // Slot 0's agent and slot 1's (which wrote) are gone: the next one takes slot 1, its record
  // to recall, before the empty slot 0; the one after takes slot 0.
  a.lock.reset();
  b.lock.reset();
  JobRecordSlot b2 = claim();
  CHECK(b2.slot == 1);
  JobRecordSlot a2 = claim();
  CHECK(a2.slot == 0);
  // A lock file is this user's alone (0600), and not a record.
  struct stat st{};
  REQUIRE(::stat((dir + "/" + job_record_name("job7", "127.0.0.2@hostA", kEndpoint, 0, true)).c_str(), &st) == 0);
  CHECK((st.st_mode & 0777) == 0600);
}

TEST_CASE("the job's end removes the record slot's lock file with its record, and a stale record discarded leaves "
          "the slot's lock in place (review s41-c M1)") {
  std::string dir, why;
  const auto d = open_fresh(dir);
  const std::string lock = dir + "/" + job_record_name("job7", "127.0.0.2@hostA", kEndpoint, 0, true);
  auto slot = d->claim("job7", "127.0.0.2@hostA", kEndpoint, &why);
  REQUIRE(slot);
  REQUIRE(d->write(sample()) == "");
  {
    JobRecordWriter w(JobRecordWriter::ops_of(d));
    w.discard(sample());  // stale: this agent starts afresh in its slot
    w.drain();
  }
  CHECK_FALSE(fs::exists(job_record_path(dir, "job7", "127.0.0.2@hostA", kEndpoint)));
  CHECK(fs::exists(lock));
  {
    JobRecordWriter w(JobRecordWriter::ops_of(d));
    w.write(sample());
    w.drain();
    w.remove();  // the job ended for good
    w.drain();
  }
  CHECK_FALSE(fs::exists(job_record_path(dir, "job7", "127.0.0.2@hostA", kEndpoint)));
  CHECK_FALSE(fs::exists(lock));
  // The next agent locks a new file there, not the one this agent still holds.
  auto next = d->claim("job7", "127.0.0.2@hostA", kEndpoint, &why);
  REQUIRE(next);
  CHECK(next->slot == 0);
  CHECK(fs::exists(lock));
}

TEST_CASE("a stale record recalled from slot 1 and discarded, then the job's end, leave slot 0's record and lock in "
          "place (review s41-d H1)") {
  std::string dir, why;
  const auto d = open_fresh(dir);
  const std::string lock0 = dir + "/" + job_record_name("job7", "127.0.0.2@hostA", kEndpoint, 0, true);
  const std::string lock1 = dir + "/" + job_record_name("job7", "127.0.0.2@hostA", kEndpoint, 1, true);
  auto a = d->claim("job7", "127.0.0.2@hostA", kEndpoint, &why);
  auto b = d->claim("job7", "127.0.0.2@hostA", kEndpoint, &why);
  REQUIRE(a);
  REQUIRE(b);
  REQUIRE(b->slot == 1);
  JobRecord r0 = sample(), r1 = sample();
  r1.slot = 1;
  r1.run = "old-run";
  REQUIRE(d->write(r0) == "");
  REQUIRE(d->write(r1) == "");
  const auto recalled = d->read("job7", "127.0.0.2@hostA", kEndpoint, &why, 1);
  REQUIRE(recalled);
  CHECK(recalled->slot == 1);
  {
    JobRecordWriter w(JobRecordWriter::ops_of(d));
    w.discard(*recalled);  // stale
    w.drain();
    w.remove();  // the job ended before this agent wrote
    w.drain();
  }
  CHECK(fs::exists(job_record_path(dir, "job7", "127.0.0.2@hostA", kEndpoint)));
  CHECK(fs::exists(lock0));
  CHECK_FALSE(fs::exists(job_record_path(dir, "job7", "127.0.0.2@hostA", kEndpoint, 1)));
  CHECK_FALSE(fs::exists(lock1));
}

TEST_CASE("a record directory that keeps no locks is told from a lock held: the whole directory's errors, not one "
          "slot's (review s41-d M2)") {
  for (int err : {ENOLCK, ENOSYS, EOPNOTSUPP, EINVAL, EIO}) CHECK(record_dir_has_no_locks(err, false));
  for (int err : {EWOULDBLOCK, EAGAIN, EINTR}) CHECK_FALSE(record_dir_has_no_locks(err, false));
  for (int err : {ENOSPC, EDQUOT, EROFS}) CHECK(record_dir_has_no_locks(err, true));
  for (int err : {ELOOP, EISDIR, EACCES, ENXIO}) CHECK_FALSE(record_dir_has_no_locks(err, true));
}

TEST_CASE("a lock error of the whole record directory beside a live agent's slot 0 ends the claim, never slot 0 "
          "unlocked, and leaves no lock file it made (review s41-e H1)") {
  std::string dir, why;
  const auto d = open_fresh(dir);
  auto a = d->claim("job7", "127.0.0.2@hostA", kEndpoint, &why);  // the live agent: slot 0, held
  REQUIRE(a);
  REQUIRE(a->slot == 0);
  const std::string lock1 = dir + "/" + job_record_name("job7", "127.0.0.2@hostA", kEndpoint, 1, true);
  for (const int err : {ENOSPC, EDQUOT}) {  // a full disk, an inode quota: at a new file's open
    JobRecordLockOps ops;
    ops.open = [err](int at, const char* name, int flags, unsigned mode) {
      if (flags & O_CREAT) return errno = err, -1;
      return ::openat(at, name, flags, mode);
    };
    why.clear();
    const auto b = d->claim("job7", "127.0.0.2@hostA", kEndpoint, &why, &ops);
    CHECK_FALSE(b);  // (279e59c: slot 0, unlocked, the live agent's)
    CHECK(why.find(std::strerror(err)) != std::string::npos);
    CHECK(why.find("MGLAUNCH_RECORD_DIR") != std::string::npos);
  }
  {  // ENOLCK at the flock of slot 1 (slot 0: held): the file it made is gone, slot 0's stays
    JobRecordLockOps ops;
    ops.flock = [](int fd, int op) {
      if (::flock(fd, op) != 0) return -1;  // (slot 0: EWOULDBLOCK)
      ::flock(fd, LOCK_UN);
      return errno = ENOLCK, -1;
    };
    why.clear();
    CHECK_FALSE(d->claim("job7", "127.0.0.2@hostA", kEndpoint, &why, &ops));
    CHECK(why.find(std::strerror(ENOLCK)) != std::string::npos);
  }
  CHECK_FALSE(fs::exists(lock1));
  CHECK(fs::exists(dir + "/" + job_record_name("job7", "127.0.0.2@hostA", kEndpoint, 0, true)));
}

TEST_CASE("a slot whose lock file is a directory or a link is that slot's alone: the next slot is taken, locked "
          "(review s41-d M2)") {
  std::string dir, why;
  const auto d = open_fresh(dir);
  fs::create_directory(dir + "/" + job_record_name("job7", "127.0.0.2@hostA", kEndpoint, 0, true));
  fs::create_symlink("/dev/null", dir + "/" + job_record_name("job7", "127.0.0.2@hostA", kEndpoint, 1, true));
  auto s = d->claim("job7", "127.0.0.2@hostA", kEndpoint, &why);
  REQUIRE(s);
  CHECK(why.empty());
  CHECK(s->slot == 2);
  CHECK(s->lock.get() >= 0);
}

TEST_CASE("a writer's thread left hung by its destructor keeps the record slot's lock until it ends: no new agent "
          "claims that slot meanwhile (review s41-d L2)") {
  using namespace std::chrono_literals;
  std::string dir, why;
  const auto d = open_fresh(dir);
  auto slot = d->claim("job7", "127.0.0.2@hostA", kEndpoint, &why);
  REQUIRE(slot);
  REQUIRE(slot->slot == 0);
  std::promise<void> entered, release;
  std::shared_future<void> go = release.get_future().share();
  const JobRecordWriter::Ops ops = hung_write_ops(entered, go);
  auto w = std::make_unique<JobRecordWriter>(ops, 50ms);
  w->hold(std::move(slot->lock));
  w->write(sample());
  entered.get_future().wait();
  auto gone = std::async(std::launch::async, [&w] { w.reset(); });
  const bool returned = gone.wait_for(60s) == std::future_status::ready;  // (a bound on a hang, no timing)
  auto during = d->claim("job7", "127.0.0.2@hostA", kEndpoint, &why);  // main: slot 0, under the thread
  release.set_value();  // the detached thread ends now, and its lock with it
  gone.wait();
  CHECK(returned);
  REQUIRE(during);
  CHECK(during->slot == 1);
  std::optional<JobRecordSlot> after;
  CHECK(mgtest::eventually(
      [&] {
        after = d->claim("job7", "127.0.0.2@hostA", kEndpoint, &why);
        return after && after->slot == 0;
      },
      60s));
}
