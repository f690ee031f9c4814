// The agent's record of its job (launcher/job_record.h, #34 H1): where it goes, written whole
// and read back, one per job and node, and never another user's (a temporary directory of
// the test's own).
#include <catch2/catch.hpp>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <future>
#include <vector>

#include "launcher/job_record.h"
#include "support/proc.h"

using namespace mg;
namespace fs = std::filesystem;

namespace {

// Ports picked at run time (never a well-known one), though nothing here opens a socket.
const int kPort = mgtest::free_loopback_port();
const std::string kEndpoint = "c10d localhost:" + std::to_string(kPort);

JobRecord sample(const std::string& job = "job7", const std::string& node = "127.0.0.2@hostA") {
  JobRecord r;
  r.job = job;
  r.node = node;
  r.endpoint = kEndpoint;
  r.run = "1764500000000-0123456789abcdef";
  r.epoch = 131075;
  r.hosts = {{"127.0.0.2", kPort}, {"127.0.0.3", kPort + 1}, {"127.0.0.4", kPort + 2}};
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
  CHECK(r->written_ms > 0);
  // Another node of the same job on this machine, another job: no record, and no complaint.
  CHECK(!d->read("job7", "127.0.0.3@hostA", kEndpoint, &why));
  CHECK(!d->read("job8", "127.0.0.2@hostA", kEndpoint, &why));
  // The same job id and node at another endpoint or backend (two jobs of the default id
  // "none" on one machine, review M1): another file, never this one.
  CHECK(job_record_path(dir, "job7", "127.0.0.2@hostA", "c10d localhost:29600") != path);
  CHECK(!d->read("job7", "127.0.0.2@hostA", "c10d localhost:29600", &why));
  CHECK(!d->read("job7", "127.0.0.2@hostA", "static localhost:" + std::to_string(kPort), &why));
  CHECK(r->endpoint == kEndpoint);
  CHECK(why.empty());
  // A record of another endpoint found at this one's file (the hash's collision): none.
  const std::string other = job_record_path(dir, "job7", "127.0.0.2@hostA", "c10d localhost:29600");
  REQUIRE(::link(path.c_str(), other.c_str()) == 0);
  CHECK(!d->read("job7", "127.0.0.2@hostA", "c10d localhost:29600", &why));
  CHECK(why.empty());
  ::unlink(other.c_str());
  // Written again (the next round): the newer one.
  JobRecord next = sample();
  next.epoch = 131076;
  next.hosts.resize(1);
  REQUIRE(d->write(next) == "");
  CHECK(d->read("job7", "127.0.0.2@hostA", kEndpoint, &why)->epoch == 131076);
  // Touched: still there, its time moved; removed (the job ended): gone.
  CHECK(d->touch("job7", "127.0.0.2@hostA", kEndpoint));
  d->remove("job7", "127.0.0.2@hostA", kEndpoint);
  CHECK(!d->read("job7", "127.0.0.2@hostA", kEndpoint, &why));
  CHECK(!d->touch("job7", "127.0.0.2@hostA", kEndpoint));
  CHECK(why.empty());
}

TEST_CASE("a record that is not one, or is open to other users, is ignored with a reason, and job ids of any text map "
          "to file names") {
  std::string dir, why;
  const auto d = open_fresh(dir);
  const std::string path = job_record_path(dir, "job7", "n", kEndpoint);
  std::ofstream(path) << "{\"job\": \"job7\"";
  ::chmod(path.c_str(), 0600);
  CHECK(!d->read("job7", "n", kEndpoint, &why));
  CHECK_THAT(why, Catch::Contains("ignoring " + path) && Catch::Contains("not a record"));
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
  CHECK(d->touch("job7", "127.0.0.2@hostA", kEndpoint));
  d->remove("job7", "127.0.0.2@hostA", kEndpoint);
  CHECK(fs::is_empty(moved));
  CHECK(why.empty());
}

TEST_CASE("a record with raw bytes or a port outside 1..65535 is ignored with one printable line") {
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
  CHECK_THAT(why, Catch::Contains("ignoring " + path) && Catch::Contains("not a record"));
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
}

TEST_CASE("the sweep removes this user's records older than its bound and temporary files of dead pids, nothing "
          "else") {
  std::string dir, why;
  const auto d = open_fresh(dir);
  const auto now = std::chrono::system_clock::now();
  auto put = [&](const std::string& name, std::chrono::hours age) {
    const std::string p = dir + "/" + name;
    std::ofstream(p) << "{}";
    const auto t = std::chrono::duration_cast<std::chrono::seconds>((now - age).time_since_epoch()).count();
    const timespec times[2] = {{t, 0}, {t, 0}};
    REQUIRE(::utimensat(AT_FDCWD, p.c_str(), times, 0) == 0);
  };
  const std::string old_one = job_record_name("old", "n", kEndpoint), fresh = job_record_name("fresh", "n", kEndpoint);
  put(old_one, std::chrono::hours(24 * 8));
  put(fresh, std::chrono::hours(24 * 6));
  put(fresh + ".4000001.tmp", std::chrono::hours(0));   // a dead pid's
  put(fresh + ".4000002.tmp", std::chrono::hours(0));   // a live one's (writing now)
  put("notes.txt", std::chrono::hours(24 * 30));         // not a record: never touched
  put(old_one + ".x.tmp", std::chrono::hours(24 * 30));  // no pid
  const int removed = d->sweep(now, kJobRecordMaxAge, [](pid_t pid) { return pid == 4000002; });
  CHECK(removed == 2);
  CHECK(!fs::exists(dir + "/" + old_one));
  CHECK(!fs::exists(dir + "/" + fresh + ".4000001.tmp"));
  for (const auto& kept : {fresh, fresh + ".4000002.tmp", std::string("notes.txt"), old_one + ".x.tmp"})
    CHECK(fs::exists(dir + "/" + kept));
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
  ops.touch = [&](const JobRecord&) { std::lock_guard lock(mu); after.push_back("touch"); };
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
  w.touch();  // a write waits: its own time is the touch
  CHECK(w.take_error().empty());
  release.set_value();
  w.drain();
  CHECK(written == std::vector<int>{1, 4});
  CHECK(after.empty());
  CHECK(w.take_error() == "cannot write: disk full");
  CHECK(w.take_error().empty());  // told once
  w.touch();
  w.drain();
  w.remove();
  w.drain();
  CHECK(after == std::vector<std::string>{"touch", "remove"});
}
