"""KV read straight out of another worker's cache over the Mooncake Transfer Engine: the prefill/decode hand-off
(``docs/disaggregation.md``).

- A prefill worker's ranks each open a :class:`PeerEndpoint` when their first lease is taken and register their KV
  cache's tensors with it once (the regions are fixed for the life of the process: ``PagedKVCache.regions``); each
  answers :class:`~engine.worker.control.LeaseKV` with a :class:`PeerShard`: its endpoint's session, where its
  tensors are, the leased blocks and a digest of each block's bytes.
- A decode worker's load of a :class:`PeerKV` source has each rank read its shard (attention-TP rank ``t`` reads the
  prefill's TP rank ``t`` of the DP group that ran the request; when every byte is replicated over TP ranks, as MLA's
  latent is, the two sides' TP sizes may differ and rank ``t`` reads shard ``t`` mod the prefill's TP size) into a
  registered host buffer, one transfer of every region of the blocks asked for, then checks every block's digest
  before the bytes are written into its cache. A failed read, one not done within the source's ``timeout_s`` (a frozen
  prefill worker: the transport itself only gives up after 30 s without progress) or a digest that does not match
  raises :class:`TransferError` (the load fails softly: the request ends naming why, or computes those tokens,
  counted). A read given up on keeps its staging buffer to itself until the transport ends it, so late bytes land
  nowhere the reader still uses.
"""

from __future__ import annotations

import hashlib
import socket
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

import torch

from engine.worker.kv_cache import PagedKVCache
from engine.worker.kv_store import StoreError


class TransferError(StoreError):
    """A hand-off read that failed; ``reason``: "unreachable" (the prefill worker or its lease is gone), "timeout"
    (not done within the source's ``timeout_s``), "checksum" or "layout"."""

    def __init__(self, reason: str, what: str):
        RuntimeError.__init__(self, f"KV hand-off {reason}: {what}")
        self.reason = reason


def block_digest(row: torch.Tensor) -> str:
    """BLAKE2b-128 (hex) of one block row ``[block_bytes]`` uint8."""
    return hashlib.blake2b(row.numpy().tobytes(), digest_size=16).hexdigest()


@dataclass(frozen=True)
class PeerShard:
    """One prefill rank's share of a hand-off: its endpoint ``session`` (``host:port``), its cache tensors as
    ``(address, bytes per block)`` pairs in ``read_blocks``' order, the leased ``blocks`` and their ``digests``."""

    session: str
    tensors: tuple[tuple[int, int], ...]
    blocks: tuple[int, ...]
    digests: tuple[str, ...]


def runs(blocks: list[int]) -> list[tuple[int, int]]:
    """``(index of its first, length)`` of each run of consecutive ids in ``blocks`` (``[4, 5, 6, 9]`` →
    ``[(0, 3), (3, 1)]``)."""
    out: list[tuple[int, int]] = []
    for i, b in enumerate(blocks):
        if out and blocks[i - 1] == b - 1:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((i, 1))
    return out


def local_host(host: str) -> str:
    """The address a transfer endpoint announces: ``host`` unless it is a wildcard (then this machine's)."""
    return socket.gethostbyname(socket.gethostname()) if host in ("", "0.0.0.0", "::") else host


class PeerEndpoint:
    """One rank's Mooncake transfer engine (``protocol`` "tcp" here; "rdma" where the cluster has it), started on
    first use: the cache's tensors registered for peers to read, and a host buffer registered to read into."""

    def __init__(self, cache: PagedKVCache, host: str, protocol: str):
        from mooncake.engine import TransferEngine  # the test extra's wheel (pyproject.toml)

        self.cache = cache
        self.engine = TransferEngine()
        if self.engine.initialize(local_host(host), "P2PHANDSHAKE", protocol, "") != 0:
            raise TransferError("unreachable", f"the transfer engine did not start on {host} over {protocol}")
        self.session = f"{local_host(host)}:{self.engine.get_rpc_port()}"
        self.tensors = tuple((v.data_ptr(), v.shape[1]) for v in cache.block_views())
        for store in cache.block_views():
            if self.engine.register_memory(store.data_ptr(), store.numel()) != 0:
                raise TransferError("unreachable", "the transfer engine refused to register the KV cache")
        self._buffer = torch.empty(0, dtype=torch.uint8)
        self._reads = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kv-peer-read")  # a frozen peer's read
        # holds one until the transport gives up on it

    def shard(self, blocks: list[int]) -> PeerShard:
        """This rank's share of a lease of ``blocks``."""
        rows = self.cache.read_blocks(blocks)
        return PeerShard(self.session, self.tensors, tuple(blocks), tuple(block_digest(r) for r in rows))

    def _staging(self, nbytes: int) -> torch.Tensor:
        if self._buffer.numel() < nbytes:
            if self._buffer.numel():
                self.engine.unregister_memory(self._buffer.data_ptr())
            self._buffer = torch.empty(nbytes, dtype=torch.uint8)
            if self.engine.register_memory(self._buffer.data_ptr(), nbytes) != 0:
                raise TransferError("unreachable", "the transfer engine refused to register a staging buffer")
        return self._buffer[:nbytes]

    def _transfer(self, session: str, local: list[int], remote: list[int], lengths: list[int],
                  timeout_s: float) -> None:
        """One batched read into the staging buffer, given up on after ``timeout_s`` (the buffer then stays with the
        read until it ends, and the next read registers a fresh one)."""
        future = self._reads.submit(self.engine.batch_transfer_sync_read, session, local, remote, lengths)
        try:
            status = future.result(timeout=timeout_s)
        except FutureTimeout:
            self._abandon(future)
            raise TransferError("timeout", f"reading {len(local)} region(s) from {session} took over {timeout_s} s "
                                "(server.kv_transfer_timeout_s; is the prefill worker stalled?)") from None
        if status != 0:
            raise TransferError("unreachable", f"reading from {session} failed (the prefill worker is gone or its "
                                "lease ended)")

    def _abandon(self, read: Future) -> None:
        stale, self._buffer = self._buffer, torch.empty(0, dtype=torch.uint8)
        read.add_done_callback(lambda _: self.engine.unregister_memory(stale.data_ptr()))

    def read(self, shard: PeerShard, picks: list[int], timeout_s: float) -> torch.Tensor:
        """Blocks ``shard.blocks[i]`` for ``i`` in ``picks`` of the peer: ``[len(picks), block_bytes]`` uint8, each
        checked against its digest, read within ``timeout_s``."""
        widths = [w for _, w in shard.tensors]
        block_bytes = self.cache.block_bytes()
        if sum(widths) != block_bytes:
            raise TransferError("layout", f"the prefill's blocks are {sum(widths)} bytes, this cache's {block_bytes}")
        n = len(picks)
        out = self._staging(n * block_bytes)  # tensor-major: each tensor's n block rows contiguous
        local, remote, lengths = [], [], []
        at = out.data_ptr()
        for address, width in shard.tensors:
            for start, run in runs([shard.blocks[p] for p in picks]):  # consecutive blocks: one transfer
                local.append(at + start * width)
                remote.append(address + shard.blocks[picks[start]] * width)
                lengths.append(run * width)
            at += n * width
        self._transfer(shard.session, local, remote, lengths, timeout_s)
        parts, at = [], 0
        for _, width in shard.tensors:
            parts.append(out[at:at + n * width].view(n, width))
            at += n * width
        rows = torch.cat(parts, dim=1)
        for row, pick in zip(rows, picks, strict=True):
            if block_digest(row) != shard.digests[pick]:
                raise TransferError("checksum", f"block {shard.blocks[pick]} from {shard.session} does not match "
                                    "its digest")
        return rows


@dataclass(frozen=True)
class PeerKV:
    """A KV source in another worker's leased blocks: ``shards[t]`` is attention-TP rank ``t``'s share; ``num_tokens``
    prompt tokens' KV; read over ``protocol`` from an endpoint on ``host``. ``recompute``: when the read fails, the
    request computes the tokens itself (counted) instead of failing. ``namespace``: the digest of the prefill
    engine's cache namespace (``KVTransfers.namespace``); when it is not the reader's, the blocks are indexed apart.
    ``timeout_s``: each rank's read fails ("timeout") when not done by then."""

    num_tokens: int
    shards: tuple[PeerShard, ...]
    host: str = "127.0.0.1"
    protocol: str = "tcp"
    recompute: bool = False
    namespace: str = ""
    timeout_s: float = 30.0

    def read(self, at, blocks: list[int]) -> torch.Tensor:
        # as many shards as this engine's attention-TP ranks, or (KV replicated over them) any number: all the same
        shard = self.shards[at.tp_rank % len(self.shards)]
        return at.peer(self.host, self.protocol).read(shard, blocks, self.timeout_s)
