"""KV that arrives from elsewhere: where a request's blocks come from (:class:`KVSource`, :class:`HostKV`), and one
rank's loads in flight (:class:`RankLoads`), each run on a loader thread off the step path.

A load writes a source's blocks into blocks the scheduler reserved (``engine.core.admission``); the request joins a
step only after rank 0 saw its own share done, and every rank waits for the loads a plan names before that step
touches its cache (``StepPlan.loads``), so a block is never read, or handed to another request, while a load still
writes it.
"""

from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Protocol

import torch

from engine.worker.kv_cache import PagedKVCache


class KVSource(Protocol):
    """Blocks of KV bytes, per rank, in :meth:`PagedKVCache.read_blocks`' layout; picklable (it travels to every
    rank in the load message). ``num_tokens``: the tokens they hold (full blocks, from position 0)."""

    num_tokens: int

    def read(self, rank: int, blocks: list[int]) -> torch.Tensor:
        """Rank ``rank``'s share of source blocks ``blocks``: ``[len(blocks), block_bytes]`` uint8 (host memory)."""
        ...


@dataclass(frozen=True)
class HostKV:
    """A request's leading blocks read out of the ranks' caches into host memory (``Engine.read_prefix_kv``):
    ``per_rank[r]`` is rank ``r``'s ``[num_blocks, block_bytes]`` uint8 (the ranks of the DP group that held them)."""

    per_rank: dict[int, torch.Tensor]
    num_tokens: int

    def read(self, rank: int, blocks: list[int]) -> torch.Tensor:
        return self.per_rank[rank][blocks]


class RankLoads:
    """One rank's KV loads: started by the load message, each on the loader thread; :meth:`wait` before a step that
    names them (a load that failed raises there, naming it)."""

    def __init__(self, cache: PagedKVCache, rank: int):
        self.cache, self.rank = cache, rank
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"kv-load-{rank}")
        self._pending: dict[int, Future] = {}

    def start(self, load_id: int, blocks: list[int], source_blocks: list[int], source: KVSource) -> None:
        """Reads ``source_blocks`` of this rank's share of ``source`` and writes them into ``blocks``, off the step
        thread."""
        self._pending[load_id] = self._pool.submit(self._load, blocks, source_blocks, source)

    def _load(self, blocks: list[int], source_blocks: list[int], source: KVSource) -> None:
        self.cache.write_blocks(blocks, source.read(self.rank, source_blocks))
        if self.cache.device.type == "cuda":
            torch.cuda.synchronize(self.cache.device)

    def done(self, load_id: int) -> bool:
        """Whether load ``load_id`` finished here (or never ran here: this rank is not in its DP group)."""
        f = self._pending.get(load_id)
        return f is None or f.done()

    def wait_any(self, load_ids: tuple[int, ...], timeout_s: float) -> None:
        """Returns when one of ``load_ids`` started here is done, or after ``timeout_s``."""
        pending = [self._pending[i] for i in load_ids if i in self._pending]
        if pending:
            wait(pending, timeout=timeout_s, return_when=FIRST_COMPLETED)

    def wait(self, load_ids: tuple[int, ...]) -> None:
        """Blocks until every load of ``load_ids`` started here is written; raises the first that failed."""
        for load_id in load_ids:
            f = self._pending.pop(load_id, None)
            if f is None:
                continue
            try:
                f.result()
            except Exception as e:
                raise RuntimeError(f"rank {self.rank}: KV load {load_id} failed: {e}") from e
