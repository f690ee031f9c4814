// The worker's end of the agent's control channel (docs/in-place-recovery.md): connects to
// the abstract Unix socket named in MGLAUNCH_CONTROL_SOCKET, opts in with `hello`, and
// reads `pause` and `assign` on a thread of its own, so a pause reaches a worker blocked
// in a collective. No torch: unit-tested with the launcher's tests.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

namespace mg::train {

// "1" in the environment of a standby node's pre-started worker (mglaunch --prestart-standby):
// no rank yet; it says hello with "standby" and waits for `assign` (docs/in-place-recovery.md).
inline constexpr const char* kStandbyVar = "MGLAUNCH_STANDBY";

// Raised by the channel's thread when a pause arrives; collectives waiting through
// comm's wait_work() give up when it is. The trainer clears it once it holds an assignment.
struct Interrupt {
  std::mutex m;
  std::condition_variable cv;
  std::atomic<bool> fired{false};
  // Run by fire() (the channel's thread) after it set `fired`: the NCCL group aborts its
  // communicators there, because an NCCL wait does not block the CPU and the thread is
  // then stuck in a device synchronisation on a kernel that waits for the lost peer; the
  // abort ends that kernel. Set under `m`; empty for Gloo, whose waits end through `cv`.
  std::function<void()> on_fire;
  void fire();
  void clear();
};

struct Pause {
  int round = 0;
  std::string reason, lost = "peer";  // lost: "host", "worker", or "peer" when the agent did not say
  std::chrono::steady_clock::time_point at;  // when the first pause of this round arrived
};

struct Assignment {
  int round = 0, restart_count = 0;
  std::map<std::string, std::string> env;  // every torchrun variable of the new round
};

class ControlChannel {
 public:
  // Connects to `name` ("@abstract-name"), says hello and waits up to `welcome_timeout`
  // for the agent's welcome. With `standby` the hello says "standby": true (a standby's
  // pre-started worker, MGLAUNCH_STANDBY=1, that waits for its place: wait_assign()).
  // Throws std::runtime_error with a one-line reason.
  ControlChannel(const std::string& name, int local_rank, std::shared_ptr<Interrupt> interrupt,
                 std::chrono::milliseconds welcome_timeout = std::chrono::seconds(10), bool standby = false);
  ~ControlChannel();
  ControlChannel(const ControlChannel&) = delete;
  ControlChannel& operator=(const ControlChannel&) = delete;

  // The pause not yet followed by an assign, waiting up to `timeout` for one; nullopt on
  // timeout or when the agent closed the channel (closed_reason() says why).
  std::optional<Pause> wait_pause(std::chrono::milliseconds timeout);
  // The first assign after the last pause, waiting up to `timeout`; consumes the pause and
  // clears the interrupt. nullopt on timeout or a closed channel.
  std::optional<Assignment> wait_assign(std::chrono::milliseconds timeout);
  // `paused` with the last optimizer step this worker applied (best effort).
  void send_paused(std::int64_t step);
  // Withdraws the opt-in (a hello with "in_place": false on this connection, best effort):
  // a worker that will not recover in place (another rank has no channel) is then stopped
  // by the agent on a failure as any worker, instead of paused and left to fail.
  void withdraw();
  std::string closed_reason();

 private:
  void read_loop();
  void handle(const std::string& line);
  bool send_line(const std::string& line);

  int fd_ = -1;
  int local_rank_ = 0;
  std::shared_ptr<Interrupt> interrupt_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool welcomed_ = false, closed_ = false;
  std::string closed_reason_;
  std::optional<Pause> pause_;
  std::optional<Assignment> assign_;
  std::thread reader_;
};

}  // namespace mg::train
