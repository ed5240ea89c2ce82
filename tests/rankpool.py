"""Fork W gloo ranks once per test module and run many checks inside them.

``pool.run(fn, *args)`` calls ``fn(ctx, *args)`` on every rank (``ctx.rank``, ``ctx.world_size``,
``ctx.groups(layout)`` cached per layout) and returns the per-rank results; a failure on any rank is
re-raised in the parent with that rank's traceback. A rank that dies or hangs fails the call after
``timeout_s`` instead of hanging the suite.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import socket
import traceback

import torch

from parallelism.comm import CommCounter, build_groups, init_distributed
from parallelism.layout import Layout


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    def __init__(self, world_size: int, timeout_s: float = 120.0):
        self.world_size, self.timeout_s = world_size, timeout_s
        ctx = mp.get_context("fork")
        port = free_port()
        self.inboxes = [ctx.Queue() for _ in range(world_size)]
        self.outbox = ctx.Queue()
        self.procs = [ctx.Process(target=_worker, args=(r, world_size, port, self.inboxes[r], self.outbox),
                                  daemon=True) for r in range(world_size)]
        for p in self.procs:
            p.start()

    def run(self, fn, *args) -> list:
        for box in self.inboxes:
            box.put((fn, args))
        results, errors = [None] * self.world_size, []
        for _ in range(self.world_size):
            try:
                rank, ok, value = self.outbox.get(timeout=self.timeout_s)
            except queue.Empty as err:
                dead = [r for r, p in enumerate(self.procs) if not p.is_alive()]
                self.close()
                raise RuntimeError(f"rank pool timed out after {self.timeout_s}s (dead ranks: {dead})") from err
            if ok:
                results[rank] = value
            else:
                errors.append(f"--- rank {rank} ---\n{value}")
        if errors:
            raise AssertionError("failure on ranks:\n" + "\n".join(errors))
        return results

    def close(self) -> None:
        for box, p in zip(self.inboxes, self.procs, strict=True):
            if p.is_alive():
                box.put(None)
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
