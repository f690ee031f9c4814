// The agent's record of its job (launcher/job_record.h, #34 H1): where it goes, written whole
// and read back, one per job and node, and never another user's (a temporary directory of
// the test's own).
#include <catch2/catch.hpp>

#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

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

}  // namespace

TEST_CASE("the record directory: MGLAUNCH_RECORD_DIR, else XDG_RUNTIME_DIR/mglaunch, else /tmp/mglaunch-UID") {
  CHECK(job_record_dir("/srv/rec", "/run/user/1000", 1000) == "/srv/rec");
  CHECK(job_record_dir("", "/run/user/1000", 1000) == "/run/user/1000/mglaunch");
  CHECK(job_record_dir("", "", 1000) == "/tmp/mglaunch-1000");
  CHECK(node_identity("127.0.0.2", "hostA") == "127.0.0.2@hostA");
  CHECK(job_endpoint("c10d", "localhost:" + std::to_string(kPort)) == kEndpoint);
}

TEST_CASE("a record is written whole (0600, in a directory made 0700) and read back for its job and node only") {
  const std::string dir = mgtest::make_temp_dir() + "/mglaunch";
  REQUIRE(prepare_job_record_dir(dir) == "");
  struct stat st{};
  REQUIRE(::stat(dir.c_str(), &st) == 0);
  CHECK((st.st_mode & 0777) == 0700);
  REQUIRE(write_job_record(dir, sample()) == "");
  const std::string path = job_record_path(dir, "job7", "127.0.0.2@hostA", kEndpoint);
  REQUIRE(::stat(path.c_str(), &st) == 0);
  CHECK((st.st_mode & 0777) == 0600);
  // Nothing else is left beside it (the temporary file was renamed).
  CHECK(std::distance(fs::directory_iterator(dir), fs::directory_iterator()) == 1);
  std::string why;
  const auto r = read_job_record(dir, "job7", "127.0.0.2@hostA", kEndpoint, &why);
  REQUIRE(r);
  CHECK(why.empty());
  CHECK(r->run == sample().run);
  CHECK(r->epoch == 131075);
  CHECK(r->hosts == sample().hosts);
  CHECK(r->written_ms > 0);
  // Another node of the same job on this machine, another job: no record, and no complaint.
  CHECK(!read_job_record(dir, "job7", "127.0.0.3@hostA", kEndpoint, &why));
  CHECK(!read_job_record(dir, "job8", "127.0.0.2@hostA", kEndpoint, &why));
  // The same job id and node at another endpoint or backend (two jobs of the default id
  // "none" on one machine, review M1): another file, never this one.
  CHECK(job_record_path(dir, "job7", "127.0.0.2@hostA", "c10d localhost:29600") != path);
  CHECK(!read_job_record(dir, "job7", "127.0.0.2@hostA", "c10d localhost:29600", &why));
  CHECK(!read_job_record(dir, "job7", "127.0.0.2@hostA", "static localhost:" + std::to_string(kPort), &why));
  CHECK(r->endpoint == kEndpoint);
  CHECK(why.empty());
  // A record of another endpoint found at this one's file (the hash's collision): none.
  const std::string other = job_record_path(dir, "job7", "127.0.0.2@hostA", "c10d localhost:29600");
  REQUIRE(::link(path.c_str(), other.c_str()) == 0);
  CHECK(!read_job_record(dir, "job7", "127.0.0.2@hostA", "c10d localhost:29600", &why));
  CHECK(why.empty());
  ::unlink(other.c_str());
  // Written again (the next round): the newer one.
  JobRecord next = sample();
  next.epoch = 131076;
  next.hosts.resize(1);
  REQUIRE(write_job_record(dir, next) == "");
  CHECK(read_job_record(dir, "job7", "127.0.0.2@hostA", kEndpoint, &why)->epoch == 131076);
  // Touched: still there, its time moved; removed (the job ended): gone.
  CHECK(touch_job_record(dir, "job7", "127.0.0.2@hostA", kEndpoint));
  remove_job_record(dir, "job7", "127.0.0.2@hostA", kEndpoint);
  CHECK(!read_job_record(dir, "job7", "127.0.0.2@hostA", kEndpoint, &why));
  CHECK(!touch_job_record(dir, "job7", "127.0.0.2@hostA", kEndpoint));
  CHECK(why.empty());
}

TEST_CASE("a record that is not one, or is open to other users, is ignored with a reason, and job ids of any text map "
          "to file names") {
  const std::string dir = mgtest::make_temp_dir() + "/mglaunch";
  REQUIRE(prepare_job_record_dir(dir) == "");
  const std::string path = job_record_path(dir, "job7", "n", kEndpoint);
  std::ofstream(path) << "{\"job\": \"job7\"";
  ::chmod(path.c_str(), 0600);
  std::string why;
  CHECK(!read_job_record(dir, "job7", "n", kEndpoint, &why));
  CHECK_THAT(why, Catch::Contains("ignoring " + path) && Catch::Contains("not a record"));
  REQUIRE(write_job_record(dir, sample("job7", "n")) == "");
  ::chmod(path.c_str(), 0644);
  why.clear();
  CHECK(!read_job_record(dir, "job7", "n", kEndpoint, &why));
  CHECK_THAT(why, Catch::Contains("open to other users"));
  // A job id with slashes and dots stays one file inside the directory.
  const std::string odd = job_record_path(dir, "../../etc/x/slurm-12.0", "n", kEndpoint);
  CHECK(fs::path(odd).parent_path() == fs::path(dir));
}

TEST_CASE("the record directory is refused when it is not this user's alone: another user's, open to others, a "
          "symbolic link") {
  const std::string root = mgtest::make_temp_dir();
  const std::string open_dir = root + "/open";
  REQUIRE(::mkdir(open_dir.c_str(), 0700) == 0);
  ::chmod(open_dir.c_str(), 0777);
  CHECK_THAT(prepare_job_record_dir(open_dir), Catch::Contains("open to other users"));
  ::chmod(open_dir.c_str(), 0770);  // the group may write: refused too
  CHECK_THAT(prepare_job_record_dir(open_dir), Catch::Contains("open to other users"));
  // Others may read and enter it (a mkdir under umask 022, review M4): used (the files are 0600).
  ::chmod(open_dir.c_str(), 0755);
  CHECK(prepare_job_record_dir(open_dir) == "");
  const std::string link = root + "/link";
  const std::string ok = root + "/ok";
  REQUIRE(::mkdir(ok.c_str(), 0700) == 0);
  REQUIRE(::symlink(ok.c_str(), link.c_str()) == 0);
  CHECK_THAT(prepare_job_record_dir(link), Catch::Contains("not a directory"));
  // Another user's: as root, a directory given to nobody; otherwise one root owns.
  std::string theirs = "/";
  if (::geteuid() == 0) {
    theirs = root + "/theirs";
    REQUIRE(::mkdir(theirs.c_str(), 0700) == 0);
    REQUIRE(::chown(theirs.c_str(), 65534, 65534) == 0);
  }
  CHECK_THAT(prepare_job_record_dir(theirs), Catch::Contains("belongs to uid") && Catch::Contains("not to this user"));
  // Nothing is written where the directory was refused: the agent keeps no record then.
  CHECK(prepare_job_record_dir(root + "/ok") == "");
}
