"""The hand-off's transfer (``engine/worker/kv_peer.py``) between two caches in one process over the Mooncake
transfer engine on loopback TCP: blocks read in runs of consecutive ids land bit for bit in ``read_blocks``' layout,
a digest that does not match and a peer that is gone raise :class:`TransferError` naming why; the fingerprint that
pairs two caches ignores the attention-TP size only where every byte is replicated over TP ranks."""

import dataclasses

import pytest
import torch

from engine.kv_transfers import transfer_fingerprint
from engine.worker.kv_cache import KVCacheSpec, KVSpec, PagedKVCache
from engine.worker.kv_peer import PeerEndpoint, TransferError, runs
from tests.support.mooncake import master_binary

SPEC = KVCacheSpec.of(KVSpec(((4,), (2,)), 2, torch.float32, True), KVSpec(((1, 2), (1, 2)), 1, torch.bfloat16, True))


def test_the_fingerprint_ignores_the_tp_size_only_for_kv_replicated_over_tp_ranks():
    split = KVCacheSpec.of(KVSpec(((2, 4), (2, 4)), 2), KVSpec(((1, 2), (1, 2)), 1, torch.bfloat16, True))  # GQA
    mla, gqa, fp = PagedKVCache(SPEC, 4, 4), PagedKVCache(split, 4, 4), transfer_fingerprint
    assert fp(b"m", mla, 1) == fp(b"m", mla, 2) != fp(b"n", mla, 2)
    assert fp(b"m", gqa, 1) != fp(b"m", gqa, 2)
    assert fp(b"m", mla, 1) != fp(b"m", PagedKVCache(SPEC, 4, 8), 1)  # another block size


def test_runs_of_consecutive_block_ids():
    assert runs([4, 5, 6, 9]) == [(0, 3), (3, 1)] and runs([3, 2]) == [(0, 1), (1, 1)] and runs([]) == []


def test_a_peer_reads_leased_blocks_bit_for_bit_and_refuses_what_does_not_match():
    master_binary()  # the wheel and libibverbs: skipped without them, failed under CI=true
    prefill, decode = PagedKVCache(SPEC, 12, 4), PagedKVCache(SPEC, 12, 4)
    prefill.write_blocks(list(range(12)), torch.randint(0, 256, (12, prefill.block_bytes()), dtype=torch.uint8))
    source, reader = PeerEndpoint(prefill, "127.0.0.1", "tcp"), PeerEndpoint(decode, "127.0.0.1", "tcp")
    shard = source.shard([3, 4, 5, 9])
    got = reader.read(shard, [0, 1, 2, 3], 10.0)
    assert torch.equal(got, prefill.read_blocks([3, 4, 5, 9]))
    assert torch.equal(reader.read(shard, [3, 1], 10.0), prefill.read_blocks([9, 4]))
    bad = dataclasses.replace(shard, digests=(shard.digests[0], "0" * 32, *shard.digests[2:]))
    with pytest.raises(TransferError, match="KV hand-off checksum: block 4"):
        reader.read(bad, [0, 1], 10.0)
    gone = dataclasses.replace(shard, session="127.0.0.1:1")
    with pytest.raises(TransferError, match="KV hand-off unreachable"):
        reader.read(gone, [0], 10.0)
