"""The shared KV store as one rank sees it (``engine.kv_store=mooncake``): full blocks put and got by key in a Mooncake
store that every worker of the same model and configuration shares (``docs/kv_cache.md``, "The shared store").

- A block is stored in up to two parts, each a key and a value: the bytes of its replicated layer groups (MLA's
  latent, the drafter: the same on every attention-TP rank, ``KVSpec.replicated``), written by attention-TP rank 0
  alone and read by every rank (key suffix ``rep``), and the bytes of its sharded groups, one value per rank (suffix
  ``tp{rank}of{size}``). Without attention TP a block is one value.
- A key is the block's chained prefix hash under a digest of the cache namespace (model and drafter identity, dtype,
  numerics mode, attention layout) and the part's suffix: workers of one configuration read what any of them wrote;
  no two configurations share a key.
- A value is the part's bytes (``PagedKVCache.read_blocks``' row, those columns) followed by a BLAKE2b-128 digest of
  them; a part whose digest does not match is refused (:class:`StoreError` "checksum").
- Every call runs on a thread of this client and is waited for at most ``timeout_s``; a call that times out or finds
  the master unreachable (right after the master dies the library answers :data:`RPC_FAIL` at once; later calls hang
  until the timeout: both count) marks the store down for :data:`RETRY_S` (lookups then answer "nothing held" at
  once, puts are dropped), with one warning per outage and a count per reason. Puts never block the caller.
"""

from __future__ import annotations

import hashlib
import logging
import socket
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import NoReturn

import torch

log = logging.getLogger(__name__)

RETRY_S = 5.0  # how long a store that failed is left alone before it is tried again
MAX_PUT_BACKLOG = 256  # puts queued past this are dropped (counted as "timeout")
DIGEST = 16
SETUP_BUFFER_BYTES = 16 << 20  # the client's local transfer buffer
RPC_FAIL = -900  # Mooncake's ErrorCode::RPC_FAIL: the master did not answer


class StoreError(RuntimeError):
    """A store call that failed; ``reason``: "timeout", "unreachable", "checksum", "missing" or "rejected" (a put the
    master refused, e.g. a full store: counted, the store stays up)."""

    def __init__(self, reason: str, what: str):
        super().__init__(f"KV store {reason}: {what}")
        self.reason = reason


@dataclass(frozen=True, kw_only=True)
class StoreSettings:
    master: str  # HOST:PORT of mooncake_master
    metadata: str  # the transfer metadata server, e.g. http://HOST:PORT/metadata
    segment_gb: float  # this client's contribution to the store's memory
    timeout_s: float
    namespace: bytes  # the prefix cache's namespace
    tp_rank: int = 0  # this rank's place in its attention-TP group
    tp_size: int = 1


@dataclass(frozen=True)
class Part:
    """One stored part of a block: key suffix ``suffix``, the row's ``columns`` ``[bytes]`` int64, and whether this
    rank writes it (``writer``)."""

    suffix: str
    columns: torch.Tensor
    writer: bool


def block_parts(replicated: torch.Tensor, tp_rank: int, tp_size: int) -> tuple[Part, ...]:
    """How a block row whose replicated bytes are ``replicated [block_bytes]`` bool is stored by this rank: its
    replicated part (written by TP rank 0), then its own shard (module docstring)."""
    own = f"tp{tp_rank}of{tp_size}"
    if tp_size == 1:
        return (Part(own, torch.arange(len(replicated)), True),)
    rep, sharded = replicated.nonzero().flatten(), (~replicated).nonzero().flatten()
    return tuple(p for p in (Part("rep", rep, tp_rank == 0), Part(own, sharded, True)) if len(p.columns))


def seal(data: torch.Tensor) -> bytes:
    """One block's row ``[block_bytes]`` uint8 as a store value: its bytes, then their digest."""
    raw = data.numpy().tobytes()
    return raw + hashlib.blake2b(raw, digest_size=DIGEST).digest()


def unseal(value: bytes, block_bytes: int, key: str) -> torch.Tensor:
    """The block row of a store value, its digest checked (:class:`StoreError` "checksum" when it does not match)."""
    raw, digest = value[:-DIGEST], value[-DIGEST:]
    if len(raw) != block_bytes or hashlib.blake2b(raw, digest_size=DIGEST).digest() != digest:
        raise StoreError("checksum", f"{key}: {len(raw)} bytes whose digest does not match (want {block_bytes})")
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


class KVStore:
    """One rank's client of the shared store (connected on first use)."""

    def __init__(self, settings: StoreSettings, replicated: torch.Tensor):
        """``replicated [block_bytes]`` bool: the block bytes of replicated layer groups
        (``PagedKVCache.replicated_bytes``)."""
        self.settings, self.block_bytes = settings, len(replicated)
        self.parts = block_parts(replicated, settings.tp_rank, settings.tp_size)
        self.space = hashlib.blake2b(settings.namespace, digest_size=8).hexdigest()
        self._calls = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-store")
        self._puts = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-store-put")
        self._backlog = 0
        self._client = None
        self.errors: Counter[str] = Counter()
        self.down_until = 0.0
        self.outage = False  # a failure was reported and no call has succeeded since
        self.puts = 0  # blocks this client wrote its parts of
        self.group_put_bytes = 0  # bytes its attention-TP group wrote with them (its shards × ranks, replicas once)

    def key(self, block_hash: int, part: Part | None = None) -> str:
        """The store key of ``part`` (default: the first, the replicated one under attention TP) of a block."""
        return f"switchyard/{self.space}/{block_hash:032x}/{(part or self.parts[0]).suffix}"

    def _keys(self, hashes: list[int]) -> list[str]:
        """Every part's key of each block, block by block."""
        return [self.key(h, p) for h in hashes for p in self.parts]

    @property
    def up(self) -> bool:
        return time.monotonic() >= self.down_until

    # ---- calls ---------------------------------------------------------------------------------------------
    def _connect(self):
        if self._client is None:
            from mooncake.store import MooncakeDistributedStore  # the test extra's wheel (pyproject.toml)

            client = MooncakeDistributedStore()
            s = self.settings
            host = s.master.rsplit(":", 1)[0]
            loopback = host.startswith("127.") or host == "localhost"
            local = host if loopback else socket.gethostbyname(socket.gethostname())
            rc = client.setup(local, s.metadata, int(s.segment_gb * 2**30), SETUP_BUFFER_BYTES, "tcp", "", s.master)
            if rc != 0:
                raise StoreError("unreachable", f"setup against master {s.master} returned {rc}")
            self._client = client
        return self._client

    def connect(self) -> None:
        """Connects now (at start-up) and says whether the master answered; a failure marks the store down as a
        failed call does (one warning), and the next call after the pause tries again."""
        started = time.monotonic()
        try:
            self._call("connect", lambda client: None)
        except StoreError:
            return
        log.info("shared KV store: master %s answered in %.2f s (metadata %s). A Mooncake line 'GET .../metadata ... "
                 "http=404 ... metadata not found' just before is its client looking up its own segment before "
                 "registering it: expected once per client", self.settings.master, time.monotonic() - started,
                 self.settings.metadata)

    def _call(self, what: str, fn):
        """``fn(client)`` on the call thread, waited for at most ``timeout_s``; a failure marks the store down, and
        the first success after an outage says the store is back."""
        future = self._calls.submit(lambda: fn(self._connect()))
        try:
            result = future.result(timeout=self.settings.timeout_s)
            if self.outage:
                self.outage = False
                log.info("shared KV store at %s answers again: serving with it", self.settings.master)
            return result
        except FutureTimeout:
            self._failed(StoreError("timeout", f"{what} took more than {self.settings.timeout_s} s"))
        except StoreError as e:
            self._failed(e)
        except Exception as e:  # noqa: BLE001 - the library raises what it raises; the engine goes on
            self._failed(StoreError("unreachable", f"{what}: {e}"))

    def _failed(self, error: StoreError) -> NoReturn:
        self.errors[error.reason] += 1
        if error.reason != "checksum":
            if self.up and not self.outage:
                log.warning("%s; serving without the shared KV store, trying again every %.0f s", error, RETRY_S)
            self.outage = True
            self.down_until = time.monotonic() + RETRY_S
        raise error

    def held(self, hashes: list[int]) -> int:
        """Leading blocks of ``hashes`` the store holds (every part this rank reads); 0 while the store is down or on
        failure."""
        if not hashes or not self.up:
            return 0
        try:
            found = self._call("lookup", lambda c: c.batch_is_exist(self._keys(hashes)))
            failed = next((f for f in found if f < 0), None)  # 1 held, 0 not, negative: the library's error code
            if failed is not None:
                self._failed(StoreError("unreachable", f"lookup answered error {failed}"))
        except StoreError:
            return 0
        first_missing = next((i for i, f in enumerate(found) if f != 1), len(found))
        return first_missing // len(self.parts)

    def get(self, hashes: list[int]) -> torch.Tensor:
        """The blocks of ``hashes``: ``[len(hashes), block_bytes]`` uint8, every part checked; raises
        :class:`StoreError` ("missing" for a part the store dropped since it was looked up)."""
        keys = self._keys(hashes)
        values = self._call("get", lambda c: c.get_batch(keys))
        rows = torch.empty(len(hashes), self.block_bytes, dtype=torch.uint8)
        for i, (key, value) in enumerate(zip(keys, values, strict=True)):
            part = self.parts[i % len(self.parts)]
            try:
                if not value:
                    raise StoreError("missing", f"{key} is no longer in the store")
                rows[i // len(self.parts), part.columns] = unseal(value, len(part.columns), key)
            except StoreError as e:
                self.errors[e.reason] += 1
                raise
        return rows

    def put(self, hashes: list[int], data: torch.Tensor) -> None:
        """Writes blocks ``data [len(hashes), block_bytes]`` uint8 (host memory) under ``hashes``, in the background;
        dropped while the store is down or too far behind."""
        if not self.up:  # the outage was counted once
            return
        if self._backlog >= MAX_PUT_BACKLOG:
            self.errors["timeout"] += 1
            return
        mine = [p for p in self.parts if p.writer]
        if not mine:  # another rank of the group writes every part of this rank's blocks
            return
        keys = [self.key(h, p) for h in hashes for p in mine]
        values = [seal(row[p.columns]) for row in data for p in mine]
        group_bytes = len(hashes) * sum(
            (len(p.columns) + DIGEST) * (1 if p.suffix == "rep" else self.settings.tp_size) for p in mine)
        self._backlog += 1
        self._puts.submit(self._put, keys, values, len(hashes), group_bytes)

    def _put(self, keys: list[str], values: list[bytes], blocks: int, group_bytes: int) -> None:
        def write(client) -> int:  # counted on the call thread, so a lookup queued behind it sees the count
            rc = client.put_batch(keys, values)
            if rc == 0:
                self.puts += blocks
                self.group_put_bytes += group_bytes
            return rc

        try:
            rc = self._call("put", write)
            if rc == RPC_FAIL:
                self._failed(StoreError("unreachable", f"put answered error {rc}"))
            if rc != 0:
                self.errors["rejected"] += 1
        except StoreError:
            pass
        finally:
            self._backlog -= 1

    def close(self) -> None:
        """Leaves the store (bounded like any call: a store that hangs does not hold up the engine's exit)."""
        self._puts.shutdown(wait=False, cancel_futures=True)
        if self._client is not None:
            try:
                self._call("close", lambda c: c.close())
            except StoreError:
                pass
        self._calls.shutdown(wait=False, cancel_futures=True)
