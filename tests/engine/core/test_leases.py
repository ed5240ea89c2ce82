"""A prefill worker's leases by hand (``engine/core/leases.py``): a finished request's prompt blocks stay referenced
under a key of its own, the rest of its table goes back; a lease ends by its key, by its request id (smg's Abort), or
at its deadline; nothing leaks."""

from __future__ import annotations

from engine.core.kv_manager import KVManager, KVManagerConfig
from engine.core.leases import Leases
from engine.core.requests import Request
from engine.params import SamplingParams


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def admitted(kv: KVManager, rid: str, tokens: list[int]) -> Request:
    req = Request(rid, tokens, SamplingParams(), 0, dp_rank=0)
    assert kv.admit(req, 0, len(tokens) + 4) == 0
    kv.commit(req, len(tokens))
    return req


def test_a_lease_keeps_the_prompt_blocks_until_released_and_gives_back_the_rest():
    clock = Clock()
    kv = KVManager(KVManagerConfig(num_blocks=8, kv_block_size=4, dp_size=1, namespace=b"test"))
    leases = Leases(kv, clock)
    first, second = admitted(kv, "a", list(range(10))), admitted(kv, "a-retry", list(range(100, 110)))
    assert kv.pools[0].num_used == 8  # 14 slots each: 4 blocks
    leases.take(first, 10, lease_s=30.0)
    leases.take(second, 10, lease_s=30.0)
    a, b = leases.fresh["a"], leases.fresh["a-retry"]
    assert len(a.blocks) == 3 and a.num_tokens == 10 and a.key.startswith("a#") and a.key != b.key
    assert kv.pools[0].num_used == 6 and leases.num_blocks == 6  # the reserve block of each went back
    assert leases.release(a.key) == 1 and kv.pools[0].num_used == 3
    assert leases.release("nobody") == 0
    clock.now = 31.0
    leases.expire()
    assert leases.expired == 1 and kv.pools[0].num_used == 0 and not leases.held
    assert kv.pools[0].consistent()
    assert kv.cached_blocks(0, kv.index.hashes(list(range(10)))) == 2  # full blocks stay cached after release


def test_smgs_abort_by_request_id_ends_every_lease_of_it():
    kv = KVManager(KVManagerConfig(num_blocks=8, kv_block_size=4, dp_size=1, namespace=b"test"))
    leases = Leases(kv)
    leases.take(admitted(kv, "r", list(range(6))), 6, lease_s=30.0)
    assert leases.release("r") == 1 and kv.pools[0].num_used == 0 and leases.released == 1
