"""The paged KV cache on its own: layer groups over one set of blocks, fork copies over every group, and blocks as
byte regions (regions, read out, written in, checksum)."""

import pytest
import torch

from engine.worker.kv_cache import DRAFTER, TARGET, KVCacheSpec, KVSpec, PagedKVCache

TARGET_KV = KVSpec(((4,), (2,)), num_layers=3, dtype=torch.float32)  # MLA-like: latent + rope, 24 B per token-layer
DRAFTER_KV = KVSpec(((1, 2), (1, 2)), num_layers=2, dtype=torch.bfloat16)  # K and V, 8 B per token-layer
BLOCKS, BS = 6, 4


def filled_cache(seed: int = 0) -> PagedKVCache:
    """A two-group cache with random entries everywhere."""
    cache = PagedKVCache(KVCacheSpec.of(TARGET_KV, DRAFTER_KV), BLOCKS, BS)
    gen = torch.Generator().manual_seed(seed)
    for group in cache.groups.values():
        for store in group.stores():
            store.copy_(torch.randn(store.shape, generator=gen).to(store.dtype))
    return cache


def block_rows(cache: PagedKVCache, group: str, block: int) -> list[torch.Tensor]:
    return [store[block * BS:(block + 1) * BS].clone() for store in cache.groups[group].stores()]


def test_the_spec_counts_every_group_once():
    spec = KVCacheSpec.of(TARGET_KV, DRAFTER_KV)
    assert spec.bytes_per_token() == 3 * 6 * 4 + 2 * 4 * 2
    assert PagedKVCache(spec, BLOCKS, BS).block_bytes() == spec.bytes_per_token() * BS
    assert KVCacheSpec.of(TARGET_KV).groups == ((TARGET, TARGET_KV),)


def test_groups_share_the_blocks_and_a_fork_copies_all_of_them():
    cache = filled_cache()
    before = {g: block_rows(cache, g, 1) for g in (TARGET, DRAFTER)}
    untouched = {g: block_rows(cache, g, 2) for g in (TARGET, DRAFTER)}
    cache.copy_blocks([(1, 4)])
    for g in (TARGET, DRAFTER):
        for want, got in zip(before[g], block_rows(cache, g, 4), strict=True):
            assert torch.equal(want, got)
        for want, got in zip(untouched[g], block_rows(cache, g, 2), strict=True):
            assert torch.equal(want, got)


def test_a_declared_group_is_handed_out_and_a_mismatch_is_refused():
    cache = PagedKVCache(KVCacheSpec.of(TARGET_KV, DRAFTER_KV), BLOCKS, BS)
    assert cache.group(DRAFTER, DRAFTER_KV) is cache.groups[DRAFTER]
    with pytest.raises(ValueError, match="'drafter' was built as"):
        cache.group(DRAFTER, KVSpec(((2, 2),) * 2, 2, torch.bfloat16))
    bare = PagedKVCache(TARGET_KV, BLOCKS, BS)  # a target-only cache gains the group over its blocks
    added = bare.group(DRAFTER, DRAFTER_KV)
    assert added.num_blocks == BLOCKS and bare.cache_spec == KVCacheSpec.of(TARGET_KV, DRAFTER_KV)


def test_regions_are_the_blocks_bytes_in_place():
    cache = filled_cache()
    regions = cache.regions([0, 3])
    assert [sum(r.length for r in per_block) for per_block in regions] == [cache.block_bytes()] * 2
    assert len(regions[0]) == 3 * 2 + 2 * 2  # groups × layers × entry kinds
    first = cache.groups[TARGET].layers[0][0]
    assert regions[1][0].address == first.data_ptr() + 3 * BS * 4 * first.element_size()
    assert cache.regions([3]) == regions[1:]  # stable while the process lives
    raw = cache.read_blocks([3])[0]  # the regions' bytes, in order, are what read_blocks gives
    store_bytes = first.view(torch.uint8).view(BLOCKS, -1)[3]
    assert torch.equal(raw[:regions[1][0].length], store_bytes)


def test_blocks_read_out_and_written_into_another_cache_are_bit_identical():
    src, dst = filled_cache(0), filled_cache(1)
    data = src.read_blocks([1, 5])
    assert data.shape == (2, src.block_bytes()) and data.dtype == torch.uint8
    assert dst.checksum(2) != src.checksum(1)
    dst.write_blocks([2, 0], data)
    assert dst.checksum(2) == src.checksum(1) and dst.checksum(0) == src.checksum(5)
    for g in (TARGET, DRAFTER):
        for want, got in zip(block_rows(src, g, 1), block_rows(dst, g, 2), strict=True):
            assert torch.equal(want.view(torch.uint8), got.view(torch.uint8))
    assert dst.checksum(3) == filled_cache(1).checksum(3)  # others untouched


def test_bad_block_ids_and_buffers_are_named():
    cache = filled_cache()
    with pytest.raises(ValueError, match=r"KV blocks \[6\] are outside this cache's 6 blocks"):
        cache.read_blocks([6])
    with pytest.raises(ValueError, match="write_blocks needs uint8"):
        cache.write_blocks([0], torch.zeros(1, 3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="read_blocks needs a uint8 buffer"):
        cache.read_blocks([0], out=torch.zeros(1, cache.block_bytes()))
