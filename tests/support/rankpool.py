"""Fork W gloo ranks once per test module and run many checks inside them.

``pool.run(fn, *args)`` calls ``fn(ctx, *args)`` on every rank (``ctx.rank``, ``ctx.world_size``,
``ctx.groups(layout)`` cached per layout) and returns the per-rank results; a failure on any rank is
re-raised in the parent with that rank's traceback. A rank that dies fails the call at once; ranks that stop
making progress (no CPU time used by any of them for ``stall_s``: hung in a collective) fail it then. A loaded
box only makes the call slower: the bound is on stalling, not on how long the work takes.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from multiprocessing.reduction import ForkingPickler

import torch

from parallelism.comm import CommCounter, build_groups, init_distributed
from parallelism.layout import Layout


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PROGRESS_WINDOW_S, PROGRESS_CPU_S = 10.0, 0.5  # progress: the ranks used >= 0.5 CPU-seconds in a 10 s window


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds ``pid`` has used (None where ``/proc`` cannot tell)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # fields 3.. of proc(5); utime, stime are 14, 15
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class RankContext:
    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size
        self._groups = {}

    def groups(self, layout: Layout):
        """Process groups for ``layout`` (built once per layout; counter reset on every call)."""
        if layout not in self._groups:
            self._groups[layout] = build_groups(layout, CommCounter())
        g = self._groups[layout]
        g.counter.reset()
        return g


def _worker(rank: int, world_size: int, port: int, inbox, outbox) -> None:
    torch.set_num_threads(1)
    init_distributed(rank, world_size, port, backend="gloo", timeout_s=120)
    ctx = RankContext(rank, world_size)
    while True:
        job = inbox.get()
        if job is None:
            return
        fn, args = job
        try:
            outbox.put((rank, True, fn(ctx, *args)))
        except BaseException:  # noqa: BLE001 - shipped back to the parent with the traceback
            outbox.put((rank, False, traceback.format_exc()))


class RankPool:
    def __init__(self, world_size: int, stall_s: float = 90.0):
        """``stall_s``: how long the ranks may use no CPU at all (between them) before a call fails as hung."""
        self.world_size, self.stall_s = world_size, stall_s
        ctx = mp.get_context("fork")
        port = free_port()
        self.inboxes = [ctx.Queue() for _ in range(world_size)]
        self.outbox = ctx.Queue()
        self.procs = [ctx.Process(target=_worker, args=(r, world_size, port, self.inboxes[r], self.outbox),
                                  daemon=True) for r in range(world_size)]
        for p in self.procs:
            p.start()

    def run(self, fn, *args) -> list:
        ForkingPickler.dumps((fn, args))  # a job that does not pickle fails here, not silently in a queue's thread
        for box in self.inboxes:
            box.put((fn, args))
        results, errors = [None] * self.world_size, []
        for _ in range(self.world_size):
            try:
                rank, ok, value = self._next_result()
            except RuntimeError as err:  # with what the ranks that did answer said (a failure first, then a hang)
                raise RuntimeError("\n".join([str(err), *errors])) from None
            if ok:
                results[rank] = value
            else:
                errors.append(f"--- rank {rank} ---\n{value}")
        if errors:
            raise AssertionError("failure on ranks:\n" + "\n".join(errors))
        return results

    def _next_result(self) -> tuple[int, bool, object]:
        """The next rank's ``(rank, ok, value)``; raises RuntimeError when a rank died or all of them stalled."""
        last_cpu, last_check = self._cpu() or 0.0, time.monotonic()
        last_progress = last_check
        while True:
            try:
                return self.outbox.get(timeout=1.0)
            except queue.Empty:
                pass
            dead = [r for r, p in enumerate(self.procs) if not p.is_alive()]
            if dead:
                self.close()
                raise RuntimeError(f"rank pool: ranks {dead} died")
            cpu, now = self._cpu(), time.monotonic()
            if now - last_check >= PROGRESS_WINDOW_S:  # working ranks use CPU; waiting ones only a trickle
                if cpu is not None and cpu - last_cpu >= PROGRESS_CPU_S:
                    last_progress = now
                last_cpu, last_check = cpu if cpu is not None else last_cpu, now
            if now - last_progress > self.stall_s:
                self.close()
                raise RuntimeError(f"rank pool stalled: no rank used CPU for {self.stall_s:.0f}s (hung in a "
                                   "collective?)")

    def _cpu(self) -> float | None:
        """CPU seconds all ranks have used so far (None where it cannot be read: ``stall_s`` is then a wall-clock
        bound)."""
        seconds = [cpu_seconds(p.pid) for p in self.procs]
        return None if None in seconds else sum(seconds)

    def close(self) -> None:
        for box, p in zip(self.inboxes, self.procs, strict=True):
            if p.is_alive():
                box.put(None)
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
