"""The shared KV store as one rank sees it (``engine.kv_store=mooncake``): full blocks put and got by key in a Mooncake
store that every worker of the same model and configuration shares (``docs/kv_cache.md``, "The shared store").

- A key is the block's chained prefix hash under a digest of the cache namespace (model and drafter identity, dtype,
  numerics mode, attention layout), and the rank's attention-TP shard: workers of one configuration read what any of
  them wrote; no two configurations share a key.
- A value is the block's bytes over every layer group (``PagedKVCache.read_blocks``' row) followed by a BLAKE2b-128
  digest of them; a block whose digest does not match is refused (:class:`StoreError` "checksum").
- Every call runs on a thread of this client and is waited for at most ``timeout_s``; a call that times out or finds
  the master unreachable marks the store down for :data:`RETRY_S` (lookups then answer "nothing held" at once, puts
  are dropped), with one warning per outage and a count per reason. Puts never block the caller.
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


class StoreError(RuntimeError):
    """A store call that failed; ``reason``: "timeout", "unreachable", "checksum" or "missing"."""

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
    shard: str  # this rank's attention-TP shard, e.g. "tp0of2"


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

    def __init__(self, settings: StoreSettings, block_bytes: int):
        self.settings, self.block_bytes = settings, block_bytes
        self.space = hashlib.blake2b(settings.namespace, digest_size=8).hexdigest()
        self._calls = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-store")
        self._puts = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-store-put")
        self._backlog = 0
        self._client = None
        self.errors: Counter[str] = Counter()
        self.down_until = 0.0
        self.puts = self.put_bytes = 0

    def key(self, block_hash: int) -> str:
        return f"switchyard/{self.space}/{block_hash:032x}/{self.settings.shard}"

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

    def _call(self, what: str, fn):
        """``fn(client)`` on the call thread, waited for at most ``timeout_s``; a failure marks the store down."""
        future = self._calls.submit(lambda: fn(self._connect()))
        try:
            return future.result(timeout=self.settings.timeout_s)
        except FutureTimeout:
            self._failed(StoreError("timeout", f"{what} took more than {self.settings.timeout_s} s"))
        except StoreError as e:
            self._failed(e)
        except Exception as e:  # noqa: BLE001 - the library raises what it raises; the engine goes on
            self._failed(StoreError("unreachable", f"{what}: {e}"))

    def _failed(self, error: StoreError) -> NoReturn:
        self.errors[error.reason] += 1
        if error.reason != "checksum":
            if self.up:
                log.warning("%s; serving without the shared KV store for %.0f s", error, RETRY_S)
            self.down_until = time.monotonic() + RETRY_S
        raise error

    def held(self, hashes: list[int]) -> int:
        """Leading blocks of ``hashes`` the store holds (this rank's shard); 0 while the store is down or on failure."""
        if not hashes or not self.up:
            return 0
        try:
            found = self._call("lookup", lambda c: c.batch_is_exist([self.key(h) for h in hashes]))
        except StoreError:
            return 0
        return next((i for i, f in enumerate(found) if f != 1), len(hashes))  # -1: an error, not held

    def get(self, hashes: list[int]) -> torch.Tensor:
        """The blocks of ``hashes``: ``[len(hashes), block_bytes]`` uint8, each checked; raises :class:`StoreError`
        ("missing" for a block the store dropped since it was looked up)."""
        keys = [self.key(h) for h in hashes]
        values = self._call("get", lambda c: c.get_batch(keys))
        rows = []
        for key, value in zip(keys, values, strict=True):
            try:
                if not value:
                    raise StoreError("missing", f"{key} is no longer in the store")
                rows.append(unseal(value, self.block_bytes, key))
            except StoreError as e:
                self.errors[e.reason] += 1
                raise
        return torch.stack(rows)

    def put(self, hashes: list[int], data: torch.Tensor) -> None:
        """Writes blocks ``data [len(hashes), block_bytes]`` uint8 (host memory) under ``hashes``, in the background;
        dropped while the store is down or too far behind."""
        if not self.up:  # the outage was counted once
            return
        if self._backlog >= MAX_PUT_BACKLOG:
            self.errors["timeout"] += 1
            return
        values = [seal(row) for row in data]
        self._backlog += 1
        self._puts.submit(self._put, hashes, values)

    def _put(self, hashes: list[int], values: list[bytes]) -> None:
        try:
            keys = [self.key(h) for h in hashes]
            rc = self._call("put", lambda c: c.put_batch(keys, values))
            if rc == 0:
                self.puts += len(keys)
                self.put_bytes += sum(len(v) for v in values)
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
