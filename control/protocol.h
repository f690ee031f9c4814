// The agent <-> worker control protocol of in-place recovery (docs/in-place-recovery.md):
// newline-delimited JSON objects of at most kMaxMessage bytes, each with a "type". Pure:
// bytes in, lines or messages out, and the agent's messages as ready-to-send lines.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <map>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

namespace mg::control {

inline constexpr int kVersion = 1;
inline constexpr std::size_t kMaxMessage = 64 * 1024;  // bytes of one message, its '\n' excluded
// The variable that names the agent's socket in every worker's environment ("@name").
inline constexpr const char* kSocketVar = "MGLAUNCH_CONTROL_SOCKET";
// Set to "1" in the environment of a worker that a standby node's agent pre-started
// (--prestart-standby): it has no rank yet and waits for `assign` (docs/in-place-recovery.md).
inline constexpr const char* kStandbyVar = "MGLAUNCH_STANDBY";

// Splits a byte stream into lines.
class LineBuffer {
 public:
  struct Lines {
    std::vector<std::string> lines;  // complete lines, in order, without their '\n'
    bool too_long = false;           // a line passed kMaxMessage: the connection must close
  };
  Lines feed(std::string_view data);
  std::size_t pending() const { return partial_.size(); }

 private:
  std::string partial_;  // the start of a line still arriving
};

// What a worker may send.
struct Hello {
  int version = kVersion;
  long long pid = 0;       // the worker's own idea of its pid (informational)
  int local_rank = -1;     // -1: not given
  bool in_place = false;   // the opt-in
  bool standby = false;    // a pre-started worker that waits for `assign` before anything needs a rank
};
struct Paused {
  long long step = -1;  // the last optimizer step the worker applied (-1: not given)
};
// A line the agent refuses: it answers error(message) and closes the connection.
struct Bad {
  std::string message;
};
using FromWorker = std::variant<Hello, Paused, Bad>;
FromWorker parse_from_worker(std::string_view line);

// The agent's messages, each one JSON object and its '\n'.
std::string welcome();
// `lost`: "host" (a node left the job) or "worker" (a worker failed).
std::string pause(int round, std::string_view reason, std::string_view lost);
std::string assign(int round, int restart_count, const std::map<std::string, std::string>& env);
std::string error(std::string_view message);

// "@name" for the abstract socket name `name` (systemd's notation), and back: the address
// to bind or connect to (a leading NUL). Pure.
std::string at_notation(std::string_view name);
std::string abstract_address(std::string_view at_name);

}  // namespace mg::control
