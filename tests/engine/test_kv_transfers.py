"""Rank 0's KV transfers (``engine/kv_transfers.py``) on a one-rank engine over the tiny DeepSeek checkpoint (the
control plane's world-size-1 path: rank 0 runs every message itself): blocks read out of the cache, a source's
shape checked, KV from elsewhere loaded on the loader thread and its request fed after, the host tier's stores and
loads, and the per-tier counters. The PD lease's hand-off needs the transfer engine between two workers:
``tests/rpc/test_hand_off.py``."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig, RequestError
from engine.engine import Engine
from engine.params import SamplingParams
from engine.worker.kv_loads import HostKV
from model.loader import load_model
from parallelism.comm import build_groups
from tests.support.layouts import layout

PROMPT = list(range(5, 18))  # 13 tokens: 3 full blocks of 4 a prefix hit may cover (never the last token's)
GREEDY = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tiny_ckpts):
    return load_model(tiny_ckpts["tiny_deepseek"], build_groups(layout("single")))


def engine(model, **over) -> Engine:
    return Engine(model, EngineConfig.flat(**{"max_num_seqs": 4, "max_num_batched_tokens": 64, "max_model_len": 64,
                                              "block_size": 4, "num_blocks": 32} | over))


def run(eng: Engine, rid: str, prompt: list[int] = PROMPT, **kw) -> list[int]:
    eng.add_request(rid, prompt, GREEDY, **kw)
    tokens = []
    while eng.has_work():
        tokens += [t for out in eng.step() if out.request_id == rid for t in out.new_tokens]
    return tokens


def test_read_prefix_gives_the_cached_full_blocks_and_check_refuses_another_shape(model):
    eng = engine(model)
    run(eng, "a")
    kv = eng.transfers.read_prefix(PROMPT)
    width = eng.rank.runner.cache.block_bytes()
    assert kv.num_tokens == 12 and list(kv.per_rank) == [0]
    assert kv.per_rank[0].dtype == torch.uint8 and kv.per_rank[0].shape == (3, width)
    eng.transfers.check(kv)
    bad = HostKV({0: torch.zeros(3, width + 1, dtype=torch.uint8)}, 12)
    with pytest.raises(RequestError, match=f"do not fit this engine's KV cache \\({width} bytes per block on rank 0"):
        eng.transfers.check(bad)
    assert eng.transfers.origin(kv) == ""


def test_kv_from_elsewhere_is_loaded_then_fed_and_gives_the_cold_tokens(model):
    source = engine(model)
    cold = run(source, "a")
    kv = source.transfers.read_prefix(PROMPT)
    eng = engine(model)
    warm = run(eng, "b", kv=kv)
    t = eng.transfers
    assert warm == cold and not t.loading and not t.sources and t.failed_loads == 0
    # 12 tokens loaded, the 13th computed: the device pool hit nothing (the load is not a prefix hit)
    (device,) = t.tiers()
    assert (device.tier, device.hit_tokens, device.queried_tokens) == ("device", 0, 13)
    assert eng.scheduler.blocks_in_use() == 0


def test_blocks_evicted_to_the_host_tier_are_loaded_back_on_a_hit(model):
    # 5 device blocks. After "a": 2 empty, PROMPT's 3 full blocks cached (a table is freed tail first, so its tail
    # is evicted first). "other" takes 4: the 2 empty, then PROMPT's blocks 2 and 1, which go to the host tier.
    # "b" hits block 0 on the device, blocks 1 and 2 in the host tier (loaded), and evicts 2 of other's blocks.
    eng = engine(model, num_blocks=5, max_model_len=20, host_kv_cache_gb=0.001)
    cold = run(eng, "a")
    run(eng, "other", prompt=list(range(100, 113)))
    assert run(eng, "b") == cold
    device, host = eng.transfers.tiers()
    block = eng.rank.runner.cache.block_bytes()
    assert (device.hit_tokens, device.queried_tokens) == (4, 39)
    assert (host.tier, host.hit_tokens, host.load_bytes, host.store_bytes) == ("host", 8, 2 * block, 4 * block)
    assert not eng.transfers.loading and eng.transfers.failed_loads == 0 and eng.scheduler.blocks_in_use() == 0


def test_flush_cache_empties_the_host_tier_too(model):
    eng = engine(model, host_kv_cache_gb=0.001, host_kv_write="through")
    run(eng, "a")
    assert eng.flush_cache().flushed
    run(eng, "b")
    _, host = eng.transfers.tiers()
    assert host.hit_tokens == 0 and host.store_bytes > 0
