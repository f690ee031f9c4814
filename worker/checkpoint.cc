#include "worker/checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <fmt/format.h>

namespace mg::train {
namespace {

void fsync_or_throw(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw std::runtime_error(fmt::format("checkpoint: cannot open {} to fsync it: {}", path, std::strerror(errno)));
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0) throw std::runtime_error(fmt::format("checkpoint: fsync of {} failed: {}", path, std::strerror(err)));
}

std::int64_t read_int(torch::serialize::InputArchive& ar, const char* key) {
  torch::Tensor t;  // a fresh tensor per key: read() cannot re-seat one that holds storage
  ar.read(key, t);
  return t.item<std::int64_t>();
}

Position load_from_bytes(const std::string& bytes, const torch::Device& device, torch::nn::Module& model,
                         torch::optim::Optimizer& opt) {
  std::istringstream in(bytes);
  torch::serialize::InputArchive ar;
  ar.load_from(in, device);
  model.load(ar);
  torch::serialize::InputArchive opt_ar;
  ar.read("optimizer", opt_ar);
  opt.load(opt_ar);
  Position p;
  p.step = read_int(ar, "step");
  p.epoch = read_int(ar, "epoch");
  p.batch_in_epoch = read_int(ar, "batch_in_epoch");
  for (auto [key, field] : {std::pair{"epoch_offset", &p.epoch_offset}, std::pair{"world", &p.world}}) {
    torch::Tensor t;  // absent from the checkpoints of older mgtrains: 0
    if (ar.try_read(key, t)) *field = t.item<std::int64_t>();
  }
  torch::Tensor rng;
  ar.read("rng", rng);
  at::Generator gen = at::detail::getDefaultCPUGenerator();
  gen.set_state(rng.to(torch::kCPU));  // the archive was mapped to `device`; the generator's state is a CPU tensor
  return p;
}

void write_state(torch::serialize::OutputArchive& ar, torch::nn::Module& model, torch::optim::Optimizer& opt,
                 const Position& pos) {
  model.save(ar);  // parameters and buffers
  torch::serialize::OutputArchive opt_ar;
  opt.save(opt_ar);
  ar.write("optimizer", opt_ar);
  ar.write("step", torch::tensor(pos.step));
  ar.write("epoch", torch::tensor(pos.epoch));
  ar.write("batch_in_epoch", torch::tensor(pos.batch_in_epoch));
  ar.write("epoch_offset", torch::tensor(pos.epoch_offset));
  ar.write("world", torch::tensor(pos.world));
  at::Generator gen = at::detail::getDefaultCPUGenerator();
  ar.write("rng", gen.get_state());
}

}  // namespace

std::string state_bytes(torch::nn::Module& model, torch::optim::Optimizer& opt, const Position& pos) {
  torch::serialize::OutputArchive ar;
  write_state(ar, model, opt, pos);
  std::ostringstream out;
  ar.save_to(out);
  return out.str();
}

Position load_state(const std::string& bytes, const torch::Device& device, torch::nn::Module& model,
                    torch::optim::Optimizer& opt) {
  return load_from_bytes(bytes, device, model, opt);
}

std::string broadcast_bytes(const Comm& comm, int root, std::string bytes) {
  if (!comm.distributed()) return bytes;
  const auto cpu_long = torch::TensorOptions().dtype(torch::kLong);
  c10d::BroadcastOptions from;
  from.rootRank = root;
  auto head = torch::tensor({static_cast<std::int64_t>(bytes.size())}, cpu_long).to(comm.device);
  std::vector<torch::Tensor> h{head};
  wait_work(comm.pg->broadcast(h, from));
  const std::int64_t n = head.to(torch::kCPU).item<std::int64_t>();
  auto buf = comm.rank == root ? torch::from_blob(bytes.data(), {n}, torch::kByte).clone() : torch::empty({n}, torch::kByte);
  buf = buf.to(comm.device);
  std::vector<torch::Tensor> b{buf};
  wait_work(comm.pg->broadcast(b, from));
  if (comm.rank != root) {
    buf = buf.to(torch::kCPU);
    bytes.assign(static_cast<const char*>(buf.data_ptr()), static_cast<std::size_t>(n));
  }
  return bytes;
}

std::string checkpoint_file(const std::string& dir) { return dir + "/checkpoint.pt"; }

void save_checkpoint(const std::string& dir, torch::nn::Module& model, torch::optim::Optimizer& opt, const Position& pos) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) throw std::runtime_error(fmt::format("checkpoint: cannot create directory {}: {}", dir, ec.message()));
  torch::serialize::OutputArchive ar;
  write_state(ar, model, opt, pos);
  const std::string path = checkpoint_file(dir), tmp = path + ".tmp";
  try {
    ar.save_to(tmp);
  } catch (const std::exception& e) {
    std::string what = e.what();
    throw std::runtime_error(fmt::format("checkpoint: cannot write {}: {}", tmp, what.substr(0, what.find('\n'))));
  }
  fsync_or_throw(tmp);
  if (::rename(tmp.c_str(), path.c_str()) != 0)
    throw std::runtime_error(fmt::format("checkpoint: cannot rename {} to {}: {}", tmp, path, std::strerror(errno)));
  fsync_or_throw(dir);
}

std::optional<Position> resume(const std::string& dir, const Comm& comm, torch::nn::Module& model,
                               torch::optim::Optimizer& opt) {
  if (dir.empty()) return std::nullopt;
  const std::string path = checkpoint_file(dir);
  const bool here = std::filesystem::exists(path);
  const auto cpu_long = torch::TensorOptions().dtype(torch::kLong);
  // Who has a checkpoint: [ranks with one, whether rank 0 has one].
  auto who = torch::tensor({here ? 1L : 0L, comm.rank == 0 && here ? 1L : 0L}, cpu_long).to(comm.device);
  comm.allreduce_sum(who);
  who = who.to(torch::kCPU);
  const std::int64_t holders = who[0].item<std::int64_t>(), lead_has = who[1].item<std::int64_t>();
  if (!lead_has) {
    if (holders > 0)
      throw SetupError(fmt::format(
          "rank 0 has no checkpoint at {} but {} other rank(s) have one: rank 0 loads the checkpoint for every rank, so "
          "give rank 0 the checkpoint (a shared --checkpoint-dir) or remove the stale ones",
          path, holders));
    return std::nullopt;
  }
  // Rank 0 reads and parses the file; its bytes travel to every rank (ok flag first).
  std::string bytes, error;
  if (comm.rank == 0) {
    std::ifstream in(path, std::ios::binary);
    std::ostringstream s;
    s << in.rdbuf();
    bytes = s.str();
    if (!in && !in.eof()) error = fmt::format("cannot read {}: {}", path, std::strerror(errno));
    if (error.empty() && bytes.empty()) error = path + " is empty";
  }
  Position pos;
  if (comm.rank == 0 && error.empty()) {
    try {
      pos = load_from_bytes(bytes, comm.device, model, opt);
    } catch (const std::exception& e) {
      std::string what = e.what();
      error = fmt::format("cannot load checkpoint {}: {}", path, what.substr(0, what.find('\n')));
    }
  }
  if (comm.distributed()) {
    auto head = torch::tensor({error.empty() ? 1L : 0L, static_cast<std::int64_t>(bytes.size())}, cpu_long).to(comm.device);
    std::vector<torch::Tensor> v{head};
    comm.pg->broadcast(v)->wait();
    head = head.to(torch::kCPU);
    if (head[0].item<std::int64_t>() == 0)
      throw SetupError(comm.rank == 0 ? error + "; remove it to start afresh, or restore it"
                                      : "rank 0 could not load its checkpoint (see rank 0's error); nothing was resumed");
    const std::int64_t n = head[1].item<std::int64_t>();
    auto buf = comm.rank == 0 ? torch::from_blob(bytes.data(), {n}, torch::kByte).clone() : torch::empty({n}, torch::kByte);
    buf = buf.to(comm.device);
    std::vector<torch::Tensor> b{buf};
    comm.pg->broadcast(b)->wait();
    if (comm.rank != 0) {
      buf = buf.to(torch::kCPU);
      bytes.assign(static_cast<const char*>(buf.data_ptr()), static_cast<std::size_t>(n));
      try {
        pos = load_from_bytes(bytes, comm.device, model, opt);
      } catch (const std::exception& e) {
        std::string what = e.what();
        throw SetupError("cannot load rank 0's checkpoint bytes: " + what.substr(0, what.find('\n')));
      }
    }
    // Every rank checks that all hold the same step.
    auto steps = torch::tensor({pos.step, -pos.step}, cpu_long).to(comm.device);
    std::vector<torch::Tensor> s{steps};
    c10d::AllreduceOptions max;
    max.reduceOp = c10d::ReduceOp::MAX;
    comm.pg->allreduce(s, max)->wait();
    steps = steps.to(torch::kCPU);
    if (steps[0].item<std::int64_t>() != -steps[1].item<std::int64_t>())
      throw SetupError(fmt::format("ranks resumed at different steps ({}..{}); remove the checkpoints and start again",
                                   -steps[1].item<std::int64_t>(), steps[0].item<std::int64_t>()));
  } else if (!error.empty()) {
    throw SetupError(error + "; remove it to start afresh, or restore it");
  }
  return pos;
}

}  // namespace mg::train
