"""The row-invariant Triton attention (``model.triton.row_attention``, ``engine.batch_invariant`` on the GPU) on
CPU under ``TRITON_INTERPRET=1``, tiny heads, ``split_keys`` lowered to 64 so that contexts of ≤ 150 keys span
several splits.

Bit-exact (``torch.equal``), fp32 and fp16 (the interpreter computes bf16 wrongly): a decode row alone equals the
same row inside launches of 2, 9 and 17 rows, with another block-table width (grid split count); a tree node at
depth d equals the decode of its token once its ancestors' KV is compacted before it, and equals its row in the
graphs-off padded path (``masked_attention``); a prefill row equals the decode of its token; GQA and MLA (absorbed,
and ``[latent | rope]`` keys through ``masked_attention``). Close (fp32): each op against its ``model.kernels``
reference, at split boundaries. The per-row key lists pass the capture audit. End to end, the tiny MLA and GQA models
on the Triton invariant set (which selects these ops and is graph-safe) give a token the same logits in prefill,
decode and tree verify. (The interpreter runs each ``tl.dot`` tile as a numpy matmul: what is proven is that no
row's tiles, key order or splits depend on its launch or step kind; the GPU's MMA order within a tile is
gpu_check's.)"""

from types import SimpleNamespace

import pytest
import torch

import tests.support.interpret_triton as interpret_triton  # sets TRITON_INTERPRET before triton is imported
from engine.worker.capture import kernel_blocker
from model import kernels
from model.kernel_select import INVARIANT_ATTENTION_OPS, batch_invariant_kernels, reference_kernels
from model.tree_mask import ancestor_mask
from model.triton import cases
from tests.support.capture_audit import check, stub_triton_launches, triton_kernel_set

interpret_triton.require()

for name in ("attention", "moe", "norm", "invariant_matmul"):  # what row_attention and the invariant set import
    interpret_triton.module(f"model.triton.{name}")
ra = interpret_triton.module("model.triton.row_attention")

SK = 64  # keys per split in these tests
DTYPES = (torch.float16, torch.float32)
TOL = dict(atol=1e-5, rtol=1e-5)
BS = 16  # KV block size


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def decode(kind: str, case: dict, **kw) -> torch.Tensor:
    fn = ra.paged_decode_gqa if kind == "gqa" else ra.paged_decode_mla
    return fn(**case, split_keys=SK, **kw)


def make_case(kind: str, lens: list[int], dtype=torch.float32, tree: int = 0, seed: int = 0) -> dict:
    """GQA: 4 heads on 2 KV heads of 16; MLA: 3 heads, latent 24, rope 8 (not powers of two)."""
    if kind == "gqa":
        return cases.gqa_case(lens, heads=4, kv_heads=2, head_dim=16, block_size=BS, gen=gen(seed), tree=tree,
                              dtype=dtype)
    return cases.mla_case(lens, heads=3, latent=24, rope=8, block_size=BS, gen=gen(seed), tree=tree, dtype=dtype)


def rows_of(case: dict, lo: int, hi: int) -> dict:
    per_row = ("q", "q_lat", "q_pe", "block_tables", "context_lens")
    return {k: v[lo:hi] if k in per_row else v for k, v in case.items()}


def queries(case: dict) -> tuple[torch.Tensor, ...]:
    return (case["q"],) if "q" in case else (case["q_lat"], case["q_pe"])


def caches(case: dict) -> tuple[torch.Tensor, torch.Tensor]:
    return (case["k_cache"], case["v_cache"]) if "k_cache" in case else (case["latent_cache"], case["rope_cache"])


def keys_values(kind: str, entries: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Gathered entries ``[B, M, ...]`` → ``masked_attention``'s keys and values (MLA as ``model.attention``)."""
    if kind == "gqa":
        return entries
    latent, rope = entries
    return torch.cat([latent, rope], dim=-1)[:, :, None], latent[:, :, None]


def joined(qs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Query parts → ``masked_attention``'s query (MLA: ``[q_lat | q_pe]``)."""
    return torch.cat(qs, dim=-1)


def gathered(case: dict, b: int, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence ``b``'s entries at ``positions`` ``[M]`` → each cache's ``[1, M, ...]``."""
    row = case["block_tables"][b].long()
    slots = row[positions // BS] * BS + positions % BS
    return tuple(c[slots][None] for c in caches(case))


# ------------------------------------------------------------------------------------------ bit-exact


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_decode_row_alone_equals_its_row_in_every_launch(kind, dtype):
    lens = torch.randint(1, 151, (17,), generator=gen(1)).tolist()
    case = make_case(kind, lens, dtype)
    for n in (2, 9, 17):
        full = decode(kind, rows_of(case, 0, n))
        for r in sorted({0, n // 2, n - 1}):
            assert torch.equal(decode(kind, rows_of(case, r, r + 1))[0], full[r]), (n, r)
        alone = rows_of(case, n - 1, n)
        wide = torch.nn.functional.pad(alone["block_tables"], (0, 7), value=-1)  # more splits in the grid
        assert torch.equal(decode(kind, dict(alone, block_tables=wide))[0], full[n - 1]), n


def compacted(case: dict, b: int, positions: torch.Tensor) -> dict:
    """A one-sequence decode case whose cache holds sequence ``b``'s ``positions`` at positions 0..len-1, in fresh
    blocks after the existing ones (the accepted path, compacted as the commit does)."""
    new = gathered(case, b, positions)
    pad = -len(positions) % BS
    grown = [torch.cat([c, e[0], e[0].new_zeros(pad, *e.shape[2:])]) for c, e in zip(caches(case), new, strict=True)]
    first = caches(case)[0].shape[0] // BS
    table = torch.arange(first, first + (len(positions) + pad) // BS, dtype=torch.int32)[None]
    names = ("k_cache", "v_cache") if "k_cache" in case else ("latent_cache", "rope_cache")
    out = dict(case, **dict(zip(names, grown, strict=True)), block_tables=table,
               context_lens=torch.tensor([len(positions)], dtype=torch.int32))
    out.pop("parents")
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_tree_node_equals_the_decode_at_its_compacted_position(kind, dtype):
    """Two trees of 9 nodes after 58 and 30 past keys (node keys straddle the 64-key split boundary), one launch.
    Node i at depth d = the decode at position past + d with its ancestors' KV compacted before it, and = its row
    in the padded graphs-off path (``masked_attention`` over past + tree mask, a padding row seeing key 0)."""
    n, past = 9, [58, 30]
    case = make_case(kind, [p + n for p in past], dtype, tree=n, seed=2)
    verify = ra.tree_verify_gqa if kind == "gqa" else ra.tree_verify_mla
    tree = verify(**case, split_keys=SK)
    mask = ancestor_mask(case["parents"])
    for b in (0, 1):
        for i in (0, 1, 4, 8):
            path = mask[b, i].nonzero().flatten()  # ancestors and itself, in index (= depth) order
            positions = torch.cat([torch.arange(past[b]), past[b] + path])
            dec = compacted(case, b, positions)
            q = tuple(x[b:b + 1, i] for x in queries(case))
            dec.update(zip(("q",) if kind == "gqa" else ("q_lat", "q_pe"), q, strict=True))
            assert torch.equal(decode(kind, dec)[0], tree[b, i]), (b, i)
        m = past[b] + n
        padded = torch.zeros(1, n + 1, m, dtype=torch.bool)
        padded[0, :n, :past[b]] = True
        padded[0, :n, past[b]:] = mask[b]
        padded[0, n, 0] = True  # a padding query, as PagedKV pads them
        q = torch.cat([joined(tuple(x[b:b + 1] for x in queries(case))), joined(queries(case))[:1, :1] * 0], dim=1)
        k, v = keys_values(kind, gathered(case, b, torch.arange(m)))
        rows = ra.masked_attention(q, k, v, padded, case["scale"], split_keys=SK)
        assert torch.equal(rows[0, :n], tree[b]), b


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_prefill_rows_equal_decodes(kind, dtype):
    """A causal chunk of 17 queries ending at key 130 through ``masked_attention``: row i = the decode of its token
    (context 130 - 17 + i + 1)."""
    n, m = 17, 130
    case = make_case(kind, [m], dtype, seed=3)
    qs = tuple(torch.randn(n, *x.shape[1:], generator=gen(4)).to(dtype) for x in queries(case))
    k, v = keys_values(kind, gathered(case, 0, torch.arange(m)))
    causal = torch.ones(n, m, dtype=torch.bool).tril(diagonal=m - n)[None]
    chunk = ra.masked_attention(joined(qs)[None], k, v, causal, case["scale"], split_keys=SK)[0]
    for i in (0, 1, 8, 16):
        names = ("q",) if kind == "gqa" else ("q_lat", "q_pe")
        dec = dict(case, **{name: x[i:i + 1] for name, x in zip(names, qs, strict=True)},
                   context_lens=torch.tensor([m - n + i + 1], dtype=torch.int32))
        assert torch.equal(decode(kind, dec)[0], chunk[i]), i


@pytest.mark.parametrize("preset", ["tiny_deepseek", "tiny_qwen3_moe"])
def test_a_token_is_the_same_in_prefill_decode_and_tree_verify(preset, tiny_ckpts):
    """The tiny models (MLA, GQA) on the Triton batch-invariant set, fp32: tokens t6, t7, t8's logits are
    bit-identical as rows of a 9-token prefill (``masked_attention``), t8's as a static decode step, and all three
    as nodes 0, 1 and 3 of a static tree verify after 6 tokens (node 2: a sibling of node 1 at position 7)."""
    from engine.worker.cuda_graphs import StaticSeq, StaticStep, StepShape
    from engine.worker.kv_cache import KVSpec, PagedKV, PagedKVCache, SeqSlots
    from model.batch import ForwardBatch
    from model.loader import load_model
    from parallelism.comm import build_groups
    from parallelism.layout import Layout

    model = load_model(tiny_ckpts[preset], build_groups(Layout()))
    model.use_kernels(batch_invariant_kernels(triton_kernel_set()))
    cache = PagedKVCache(KVSpec.for_model(model), 8, 4)
    prefilled, tree_table = [1, 2, 3], [4, 5, 6]
    ids = torch.randint(3, model.cfg.vocab_size, (10,), generator=gen(11))  # t0..t8, then the sibling
    hidden = model(ForwardBatch(ids[:9], torch.arange(9), [9], PagedKV(cache, [SeqSlots(prefilled, 0, 9)])))
    want = model.logits_everywhere(hidden)[6:9]
    model(ForwardBatch(ids[:6], torch.arange(6), [6], PagedKV(cache, [SeqSlots(tree_table, 0, 6)])))

    def static(shape: StepShape, seq: StaticSeq) -> torch.Tensor:
        step = StaticStep(model, cache, shape, max_blocks=3, scratch_blocks=(0,))
        step.load([seq])
        return step.run()[0]

    decode = static(StepShape(1, 1), StaticSeq(cache.slots(prefilled, 8, 9), prefilled, 9, [int(ids[8])], [8]))
    assert torch.equal(decode[0], want[2])
    nodes = [int(ids[i]) for i in (6, 7, 9, 8)]
    tree = ancestor_mask(torch.tensor([[-1, 0, 0, 1]]))[0]
    verify = static(StepShape(1, 4), StaticSeq(cache.slots(tree_table, 6, 10), tree_table, 10, nodes, [6, 7, 7, 8],
                                               tree))
    assert torch.equal(verify[[0, 1, 3]], want)


# ------------------------------------------------------------------------------------------ close to the references


@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_decode_at_split_boundaries(kind):
    """One key, one block, SPLIT_KEYS ± 1, two splits and a bit (fp32, close: another summation order)."""
    case = make_case(kind, [1, BS, SK - 1, SK, SK + 1, 2 * SK + 3], seed=5)
    ref = kernels.paged_decode_gqa if kind == "gqa" else kernels.paged_decode_mla
    torch.testing.assert_close(decode(kind, case), ref(**case), **TOL)


@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_tree_verify_matches_the_reference(kind):
    case = make_case(kind, [5, SK, SK + 2, 2 * SK + 1], tree=5, seed=6)
    got = (ra.tree_verify_gqa if kind == "gqa" else ra.tree_verify_mla)(**case, split_keys=SK)
    want = (kernels.tree_verify_gqa if kind == "gqa" else kernels.tree_verify_mla)(**case)
    torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_masked_attention_matches_the_reference(kind):
    """Two sequences padded to 80 keys: one causal chunk of 6, one tree of 6 after 40 keys with a padding row."""
    case = make_case(kind, [80, 46], seed=7)
    k, v = (torch.cat(t) for t in zip(*(keys_values(kind, gathered(case, b, torch.arange(80))) for b in (0, 1)),
                                      strict=True))
    mask = torch.zeros(2, 6, 80, dtype=torch.bool)
    mask[0] = torch.ones(6, 80, dtype=torch.bool).tril(diagonal=74)
    mask[1, :5, :40] = True
    mask[1, :5, 40:45] = ancestor_mask(cases.random_parents(1, 5, gen(8)))[0]
    mask[1, 5, 0] = True
    q = torch.randn(2, 6, *joined(queries(case)).shape[1:], generator=gen(9))
    got = ra.masked_attention(q, k, v, mask, case["scale"], split_keys=SK)
    torch.testing.assert_close(got, kernels.masked_attention(q, k, v, mask, case["scale"]), **TOL)


# ------------------------------------------------------------------------------------------ graph safety, selection


def test_the_key_lists_and_wrappers_pass_the_capture_audit():
    """The (prefix, extras) preparation and every wrapper's glue (launches stubbed) issue no host sync, no
    host data and no data-dependent size: the paged ops can be captured (the CPU proof;
    tests/support/capture_audit.py)."""
    lens = torch.tensor([70, 9, 33], dtype=torch.int32)
    tree = ancestor_mask(cases.random_parents(3, 9, gen(10)))
    causal = torch.ones(3, 9, 70, dtype=torch.bool).tril(diagonal=61)
    check(lambda: (ra.decode_rows(lens), ra.tree_rows(lens, tree), ra.mask_rows(causal)), "row key lists")
    gqa, mla = make_case("gqa", [70, 9, 33], tree=9), make_case("mla", [70, 9, 33], tree=9)
    with stub_triton_launches():
        check(lambda: ra.tree_verify_gqa(**gqa), "tree_verify_gqa")
        check(lambda: ra.tree_verify_mla(**mla), "tree_verify_mla")
        check(lambda: ra.paged_decode_mla(**{k: v[:, 0] if k.startswith("q") else v for k, v in mla.items()
                                             if k != "parents"}), "paged_decode_mla")


def test_key_lists_hand_worked():
    """Context 7 with a 3-node tree (0 ← 1, 0 ← 2): past 4 keys, then node 0 at 4, 1 at 5, 2 at 6."""
    mask = ancestor_mask(torch.tensor([[-1, 0, 0]]))
    keys = ra.tree_rows(torch.tensor([7]), mask)
    assert keys.prefix.tolist() == [4, 4, 4] and keys.length.tolist() == [5, 6, 6]
    assert [row[:n].tolist() for row, n in zip(keys.extras, (1, 2, 2), strict=True)] == [[4], [4, 5], [4, 6]]
    padded = torch.zeros(1, 3, 7, dtype=torch.bool)
    padded[0, :, :4], padded[0, :, 4:] = True, mask[0]
    keys = ra.mask_rows(padded)  # row 0 sees 0..4 (all prefix); rows 1, 2 a prefix of 5, then 5 / 6
    assert keys.prefix.tolist() == [5, 6, 5] and keys.length.tolist() == [5, 6, 6]
    assert keys.extras[2, :1].tolist() == [6]


def test_the_triton_invariant_set_uses_the_row_kernel_and_is_captured():
    inv = batch_invariant_kernels(triton_kernel_set())
    assert inv.batch_invariant and inv.graph_safe and inv.backend == "triton"
    for op in INVARIANT_ATTENTION_OPS:
        assert getattr(inv, op) is getattr(ra, op), op
        assert inv.reasons[op] == "batch-invariant triton (model.triton.row_attention)"
    assert kernel_blocker(SimpleNamespace(kernels=inv)) == ""
    torch_set = batch_invariant_kernels(reference_kernels())
    assert not torch_set.graph_safe
    assert kernel_blocker(SimpleNamespace(kernels=torch_set)).startswith("engine.batch_invariant: the invariant")


AOT = """
import json, torch
from model.triton import row_attention as ra
from model.triton.aot import Spec, compile_spec
ints = dict(bt_ptr="i32", seq_ptr="i32", prefix_ptr="i32", len_ptr="i32", extras_ptr="i32", o_ptr="fp32",
            lse_ptr="fp32")
fp32 = dict(ints, qa_ptr="fp32", qb_ptr="fp32", ka_ptr="fp32", kb_ptr="fp32", v_ptr="fp32")
for name, g, meta, ptrs in (("gqa bf16", 1, ra.row_meta(8, (128, 0), 128, torch.bfloat16), ints),
                            ("mla bf16", 1, ra.row_meta(16, (512, 64), 512, torch.bfloat16), ints),
                            ("gqa fp32", 4, ra.row_meta(4, (128, 0), 128, torch.float32), fp32)):
    meta = dict(meta, G=g)
    spec = Spec(f"row attention {name}", ra._row_kernel, meta, ptrs, meta.pop("num_warps"), True,
                meta.pop("num_stages"))
    print(json.dumps(compile_spec(spec, 90)))
"""


def test_row_kernel_compiles_for_sm90():
    """The real compiler and ptxas: Qwen3-235B (8 heads per KV head, D 128) and DeepSeek-V3 at TP8 (16 heads,
    latent 512 + rope 64) in bf16, GQA in fp32 (IEEE dot, no TF32)."""
    rows = interpret_triton.compile_rows(AOT)
    assert len(rows) == 3 and [r for r in rows if not r["ok"]] == [], rows
    assert [r["kernel"] for r in rows if r["tf32_mma"]] == []
