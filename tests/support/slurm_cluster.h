// A real single-machine Slurm cluster for tests: slurmctld and three slurmd (n1..n3, all
// on this host at 127.0.0.1, each on its own port) with no munge (auth/none, cred/none),
// every file in a temporary directory. The daemons are this process's children (in their
// own process groups, killed if we die: PR_SET_PDEATHSIG); the destructor cancels every
// job and stops every daemon it started, even after failed tests.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "support/proc.h"

namespace mgtest {

class SlurmCluster {
 public:
  // The cluster shared by the tests of this process, started on first use. When Slurm is
  // not installed the test skips (fails under CI=true: support/skip.h) in require_programs();
  // nullptr when the cluster did not come up (start_error() says why, with the daemons'
  // logs: the tests fail).
  static SlurmCluster* shared();
  // Every Slurm program the cluster and the tests call (slurm-wlm), or a skip/failure.
  static void require_programs();
  static const std::string& start_error();

  explicit SlurmCluster(int nodes);
  ~SlurmCluster();
  SlurmCluster(const SlurmCluster&) = delete;
  SlurmCluster& operator=(const SlurmCluster&) = delete;

  const std::string& conf() const { return conf_; }
  const std::string& dir() const { return dir_; }
  int nodes() const { return nodes_; }

  // Absolute path of a Slurm client command (srun, sbatch, scontrol, ...).
  static std::string command(const std::string& name);
  // Runs a Slurm client command (name looked up with command()) against this cluster.
  Result run(std::vector<std::string> argv, std::chrono::milliseconds timeout = std::chrono::seconds(60),
             std::map<std::string, std::string> env = {}) const;
  Proc spawn(std::vector<std::string> argv, std::map<std::string, std::string> env = {}) const;

  // `scontrol show job ID` as KEY=VALUE pairs (empty when the job is unknown).
  std::map<std::string, std::string> job(const std::string& id) const;
  // Last lines of the daemons' logs, for failure messages.
  std::string log_tail() const;
  // Every node idle: no job, and nothing of an ended one still completing.
  bool all_nodes_idle() const;

 private:
  std::map<std::string, std::string> client_env(std::map<std::string, std::string> env) const;
  void start(int attempt);  // writes slurm.conf with fresh ports, starts the daemons, waits until idle
  void stop_daemons();      // SIGTERM, then SIGKILL to the group after 15 s; reaps
  void cancel_all_jobs();

  int nodes_;
  std::string dir_, conf_;
  std::vector<pid_t> daemons_;
};

}  // namespace mgtest
