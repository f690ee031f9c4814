// mgtrain's entry point after flag parsing: sets up communication for the training mode,
// then runs the training loop or the all-reduce benchmark. No torch in this header: main
// includes it.
#pragma once

#include "worker/options.h"

namespace mg::train {

// Installs the SIGTERM/SIGUSR1 handlers that ask training to checkpoint and stop.
void install_stop_handlers();

// Returns the exit code (0, 1 for a failed benchmark check, 75 when stopped by a
// signal). Throws SetupError (exit 3) and std::exception (exit 1).
int run(const Options& o, const Env& env);

}  // namespace mg::train
