// RecordFields: what a node's record of an agent-hosted job names of it (launcher/job_record.h),
// as the rendezvous link knows it (rdzv::Link, rdzv::ClientMachine).
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace mg::rdzv {

// ClientMachine's job_hosts(), job_voters(), job_voters_epoch(), job_self_voter(),
// job_voter_hosts() and job_epoch() at one moment.
struct RecordFields {
  std::vector<std::pair<std::string, int>> hosts;
  int voters = 0;
  int voters_epoch = 0;
  bool self_voter = true;
  std::vector<std::pair<std::string, int>> voter_hosts;
  int epoch = 0;  // job_epoch(): the newest this node was told, the record's (review s41-b L3)
};

}  // namespace mg::rdzv
