"""KV blocks a prefill worker keeps for a decode worker to read (``server.kv_role=prefill``; the hand-off:
``docs/disaggregation.md``).

A request added with a lease (``Engine.add_request(lease_s=…)``) does not give its blocks back when it finishes: the
blocks holding its prompt stay referenced under a lease key, ``<request id>#<nonce>`` (smg re-runs a prefill under
the same request id when it retries the decode leg, so each leg's lease is its own), until the decode worker says it
has read them, smg aborts the request, the lease expires, or its pool runs short (:meth:`Leases.reclaim`, oldest
first: smg 1.13 sends an ``n > 1`` request's prefill leg like any other, so a prefill worker cannot tell which leases
no decode worker will read). Rank 0 only: the ranks never see a lease.
"""

from __future__ import annotations

import itertools
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

from engine.core.kv_manager import KVManager
from engine.core.requests import Request


@dataclass(frozen=True)
class Lease:
    """Blocks ``blocks`` of attention-DP rank ``dp_rank`` holding the first ``num_tokens`` prompt tokens of request
    ``request_id``, kept until ``until`` (``time.monotonic``)."""

    key: str
    request_id: str
    dp_rank: int
    blocks: tuple[int, ...]
    num_tokens: int
    until: float


class Leases:
    def __init__(self, kv: KVManager, clock: Callable[[], float] = time.monotonic):
        self.kv, self.clock = kv, clock
        self.held: dict[str, Lease] = {}
        self.fresh: dict[str, Lease] = {}  # request id → the lease its finish just took (for the hand-off blob)
        self._nonce = itertools.count()
        self.expired = self.released = self.reclaimed = 0

    def take(self, req: Request, num_tokens: int, lease_s: float) -> None:
        """``req`` finished: its blocks up to ``num_tokens`` prompt tokens stay referenced for ``lease_s`` seconds;
        the rest of its table goes back to the pool."""
        blocks = self.kv.requests.pop(req.request_id)
        bs = self.kv.cfg.kv_block_size
        keep = -(-num_tokens // bs)
        pool = self.kv.pools[req.dp_rank]
        pool.release(blocks.table[keep:], None)
        key = f"{req.request_id}#{secrets.token_hex(4)}{next(self._nonce)}"
        lease = Lease(key, req.request_id, req.dp_rank, tuple(blocks.table[:keep]), num_tokens, self.clock() + lease_s)
        self.held[key] = self.fresh[req.request_id] = lease

    def release(self, key: str) -> int:
        """Ends lease ``key``, or every lease of request ``key`` (smg's Abort names the request); returns how many."""
        keys = [key] if key in self.held else [k for k, lease in self.held.items() if lease.request_id == key]
        for k in keys:
            self._end(k)
        self.released += len(keys)
        return len(keys)

    def expire(self) -> None:
        """Ends the leases past their time (a decode worker that never read them, or died)."""
        now = self.clock()
        for key in [k for k, lease in self.held.items() if lease.until <= now]:
            self._end(key)
            self.expired += 1

    def reclaim(self, dp_rank: int) -> bool:
        """The pool of attention-DP rank ``dp_rank`` ran short: its oldest unread lease ends and gives its blocks
        back (a decode leg that arrives for it later fails as for an expired lease). False when it holds none."""
        key = next((k for k, lease in self.held.items() if lease.dp_rank == dp_rank), None)
        if key is None:
            return False
        self._end(key)
        self.reclaimed += 1
        return True

    def _end(self, key: str) -> None:
        lease = self.held.pop(key)
        self.kv.pools[lease.dp_rank].release(list(lease.blocks), None)

    @property
    def num_blocks(self) -> int:
        """Blocks held by leases now."""
        return sum(len(lease.blocks) for lease in self.held.values())
