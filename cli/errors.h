// Error types that cross library boundaries; only main() turns them into exit codes.
#pragma once

#include <stdexcept>
#include <string>

namespace mg {

// Bad flags, values or config: exit code 2.
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// The training program or its interpreter cannot be found or run: exit code 127.
struct ProgramNotFound : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// This node cannot take part safely before any worker ran (a record of its job it cannot
// read: launcher/job_record.h): exit code 3, as a rendezvous that refused it.
struct RendezvousError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// The machine cannot give what the run needs (descriptors for the workers): exit code 4.
struct ResourceError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Documented exit codes of mglaunch itself (worker codes pass through unchanged).
namespace exit_code {
inline constexpr int kOk = 0;
inline constexpr int kInternal = 1;
inline constexpr int kUsage = 2;
inline constexpr int kRendezvous = 3;  // refused by or unable to reach the rendezvous
inline constexpr int kResource = 4;    // a resource limit (open descriptors) too low for the run
inline constexpr int kPreflight = 5;   // --preflight found a slow or broken node (ops/preflight.h)
inline constexpr int kNotFound = 127;
inline constexpr int kSignalBase = 128;
}  // namespace exit_code

}  // namespace mg
