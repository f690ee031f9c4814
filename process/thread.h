// Helper threads that take no signals. A process-directed signal goes to any thread that
// does not block it; the agent serves its signals on its io thread (Asio's signal_set) and,
// at its end, blocks and ignores them there. A helper thread that left them unblocked could
// take one while no handler is installed (after the signal_set is gone) and die of its
// default action: the agent would end with 128+S of a second signal instead of the first
// one's code (#35). Asio's own threads block every signal the same way.
#pragma once

#include <signal.h>

#include <thread>
#include <utility>

namespace mg {

// Starts `f` on a new thread with every signal blocked (the mask is inherited from the
// creating thread, blocked only around the creation, so no signal reaches the new thread
// even before its first instruction).
template <class F>
std::thread signal_free_thread(F&& f) {
  sigset_t all, old;
  sigfillset(&all);
  ::pthread_sigmask(SIG_BLOCK, &all, &old);
  std::thread t(std::forward<F>(f));
  ::pthread_sigmask(SIG_SETMASK, &old, nullptr);
  return t;
}

}  // namespace mg
