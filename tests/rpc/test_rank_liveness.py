"""Naming the rank that failed (``rpc/rank_liveness.py``): real processes that exited (a zombie child), stopped, and
still run, read from /proc."""

import os
import signal
import subprocess
import sys
import time

from rpc.rank_liveness import gone_ranks, process_state


def test_exited_and_stopped_ranks_are_named_running_ones_not():
    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(3)]
    try:
        dead, stopped, running = procs
        os.kill(dead.pid, signal.SIGKILL)  # not reaped yet: a zombie, as a dead sibling rank looks to rank 0
        os.kill(stopped.pid, signal.SIGSTOP)
        for _ in range(100):
            if process_state(dead.pid) == "Z" and process_state(stopped.pid) in ("T", "t"):
                break
            time.sleep(0.05)
        ranks = [{"rank": 0, "pid": os.getpid(), "host": "h"}, {"rank": 1, "pid": dead.pid, "host": "h"},
                 {"rank": 2, "pid": stopped.pid, "host": "h"}, {"rank": 3, "pid": running.pid, "host": "h"},
                 {"rank": 4, "pid": dead.pid, "host": "elsewhere"}]
        assert gone_ranks(ranks, "h") == f"rank 1 (pid {dead.pid}) exited, rank 2 (pid {stopped.pid}) is stopped"
        dead.wait()  # reaped: no such process at all
        assert process_state(dead.pid) == "" and gone_ranks(ranks[:2], "h") == f"rank 1 (pid {dead.pid}) exited"
        assert gone_ranks(ranks[3:4], "h") == ""
    finally:
        for p in procs:
            p.kill()
            p.wait()
