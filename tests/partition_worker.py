#!/usr/bin/env python3
"""A worker of the partition tests (#34, tests/partition_test.cc), standard library only:
every 0.2 s it appends one line to DIR/<host>-<pid>.log (DIR: its only argument)

  <CLOCK_MONOTONIC seconds> <round> <host> <RANK>

where <round> is the round as its workers see it, "<restart count>@<master>#<epoch>": two
rounds of one job that split never share their MASTER_ADDR:MASTER_PORT, and the epoch is
the rendezvous's (MGLAUNCH_EPOCH, "-" where the launcher sets none). The test reads
the files to see which rounds ran when (the clock is the one the test reads: one machine).
It runs until the agent stops it."""
import os
import signal
import socket
import sys
import time


def main():
    out_dir = sys.argv[1]
    env = os.environ
    round_id = "{}@{}:{}#{}".format(env.get("TORCHELASTIC_RESTART_COUNT", "?"), env.get("MASTER_ADDR", "?"),
                                    env.get("MASTER_PORT", "?"), env.get("MGLAUNCH_EPOCH", "-"))
    line_tail = " {} {} {}\n".format(round_id, socket.gethostname(), env.get("RANK", "?"))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    path = os.path.join(out_dir, "{}-{}.log".format(socket.gethostname(), os.getpid()))
    with open(path, "a", buffering=1) as f:
        while True:  # ends when the agent stops it
            f.write("{:.3f}{}".format(time.monotonic(), line_tail))
            time.sleep(0.2)


if __name__ == "__main__":
    main()
