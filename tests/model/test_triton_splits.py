"""Key splits of the paged attention kernels and the merge, on CPU under ``TRITON_INTERPRET=1``.

A sequence of context c uses ``cdiv(c, SPLIT_KEYS)`` splits of whole key tiles; these tests check the kernels
against the torch references at the split boundaries (fp32, close: the kernels sum in another order), at a
131072-key context with tiny heads, and that a row's output is bit-identical whatever batch it is computed in
(exact: the batch-invariance contract).
"""


import pytest
import torch

import tests.support.interpret_triton as interpret_triton  # sets TRITON_INTERPRET before triton is imported
from model import kernels
from model.triton import cases
from tests.support.paths import REPO_ROOT

interpret_triton.require()


attention = interpret_triton.module("model.triton.attention")
S = attention.SPLIT_KEYS
TOL = dict(atol=1e-5, rtol=1e-5)
BOUNDARY_LENS = [1, 16, S - 1, S, S + 1, 2 * S + 3]  # 16 = one KV block


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_split_counts_follow_the_context_only():
    lens = torch.tensor(BOUNDARY_LENS)
    assert attention.splits_per_sequence(lens).tolist() == [1, 1, 1, 1, 2, 3]
    tables = torch.zeros(9, 8192, dtype=torch.int32)  # 131072 keys of 16-slot blocks
    assert attention.split_grid(tables, 16) == attention.split_grid(tables[:1], 16) == 131072 // S
    assert 131072 // S >= 2 * 132, "batch 1 at 131072 keys must give ≥ 2 programs per H200 SM"


@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_decode_at_split_boundaries(kind):
    if kind == "gqa":
        case = cases.gqa_case(BOUNDARY_LENS, heads=4, kv_heads=2, head_dim=16, block_size=16, gen=gen())
        got, want = attention.paged_decode_gqa(**case), kernels.paged_decode_gqa(**case)
    else:
        case = cases.mla_case(BOUNDARY_LENS, heads=3, latent=24, rope=8, block_size=16, gen=gen())
        got, want = attention.paged_decode_mla(**case), kernels.paged_decode_mla(**case)
    torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_tree_verify_across_a_split_boundary(kind):
    """Trees of 5 nodes whose keys straddle a split boundary (S − 2 … S + 2) or end on it."""
    lens = [5, S, S + 2, S + 3, 2 * S + 1]
    if kind == "gqa":
        case = cases.gqa_case(lens, heads=4, kv_heads=2, head_dim=16, block_size=16, gen=gen(1), tree=5)
        got, want = attention.tree_verify_gqa(**case), kernels.tree_verify_gqa(**case)
    else:
        case = cases.mla_case(lens, heads=3, latent=24, rope=8, block_size=16, gen=gen(1), tree=5)
        got, want = attention.tree_verify_mla(**case), kernels.tree_verify_mla(**case)
    torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_decode_at_131072_keys(kind):
    """One sequence of 131072 keys (512 splits) beside a short one, tiny heads, 64-slot blocks."""
    lens = [131072, 3]
    if kind == "gqa":
        case = cases.gqa_case(lens, heads=2, kv_heads=1, head_dim=16, block_size=64, gen=gen(2))
        got, want = attention.paged_decode_gqa(**case), kernels.paged_decode_gqa(**case)
    else:
        case = cases.mla_case(lens, heads=2, latent=16, rope=16, block_size=64, gen=gen(2))
        got, want = attention.paged_decode_mla(**case), kernels.paged_decode_mla(**case)
    torch.testing.assert_close(got, want, **TOL)


def _rows(case: dict, idx: list[int]) -> dict:
    """The sub-batch ``idx`` of a case: per-row tensors indexed, caches and scalars shared."""
    per_row = ("q", "q_lat", "q_pe", "block_tables", "context_lens", "parents")
    return {k: v[idx] if k in per_row else v for k, v in case.items()}


@pytest.mark.parametrize("kind", ["gqa_decode", "mla_decode", "gqa_tree", "mla_tree"])
def test_a_row_is_bit_identical_alone_and_among_2_9_17_rows(kind):
    """Row 0 (3 splits of 64 keys) alone, then among 2, 9 and 17 rows of ragged lengths (it also sits last
    among 9): the same split count, and the same output bit for bit."""
    lens = [150, *torch.randint(5, 120, (15,), generator=gen(3)).tolist(), 200]
    gqa, tree = kind.startswith("gqa"), 5 if kind.endswith("tree") else 0
    if gqa:
        case = cases.gqa_case(lens, heads=4, kv_heads=2, head_dim=16, block_size=16, gen=gen(4), tree=tree)
        fn = attention.tree_verify_gqa if tree else attention.paged_decode_gqa
    else:
        case = cases.mla_case(lens, heads=3, latent=24, rope=8, block_size=16, gen=gen(4), tree=tree)
        fn = attention.tree_verify_mla if tree else attention.paged_decode_mla
    alone = fn(**_rows(case, [0]), split_keys=64)[0]
    for idx in ([0, 1], list(range(9)), list(range(1, 9)) + [0], list(range(17))):
        sub = _rows(case, idx)
        assert attention.splits_per_sequence(sub["context_lens"], 64)[idx.index(0)] == 3
        grid = attention.split_grid(sub["block_tables"], 16, 64)
        assert grid == attention.split_grid(case["block_tables"][:1], 16, 64) == 4  # the table's width: 13 blocks of 16
        assert torch.equal(fn(**sub, split_keys=64)[idx.index(0)], alone), f"row 0 among {len(idx)} rows"


def test_attention_launch_table_is_untuned_and_fits_the_splits():
    """Every shipped entry is marked untuned; its tile divides SPLIT_KEYS; the wrappers read it (a missing
    shape falls back to the rule, labelled as such)."""
    import json

    from model.triton.launch_tables import CONFIG_DIR, NO_ENTRY, UNTUNED

    rows = json.loads((CONFIG_DIR / "attention.json").read_text())["entries"]
    keys = [(r["kernel"], r["q_heads_per_kv"], r["head_dim"]) for r in rows]
    assert len(set(keys)) == len(keys) and ("mla_decode", 16, 576) in keys and ("gqa_tree", 8, 128) in keys
    assert {r["source"] for r in rows} == {UNTUNED}
    assert all(S % r["BLOCK_N"] == 0 and r["num_warps"] in (1, 2, 4, 8, 16) for r in rows)
    assert attention.launch_config("mla_decode", 16, 576)["source"] == UNTUNED
    assert attention.launch_config("gqa_decode", 3, 24)["source"] == NO_ENTRY
    with pytest.raises(ValueError, match="power of two"):
        attention.paged_decode_gqa(**cases.gqa_case([3], 2, 1, 16, block_size=12, gen=gen()))


def test_a_tuning_config_overrides_the_table_and_tune_attention_rewrites_one_entry():
    """``config=`` (what ``scripts/tune_attention.py`` times) reaches the kernel: every candidate's result is the
    reference's; the tuner replaces one shape's entry and keeps the rest; without a GPU it says so."""
    import importlib.util
    import subprocess
    import sys

    root = REPO_ROOT
    spec = importlib.util.spec_from_file_location("tune_attention", root / "scripts" / "tune_attention.py")
    tuner = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tuner)
    candidates, replace_entry = tuner.candidates, tuner.replace_entry

    case = cases.gqa_case([S + 5, 40], 4, 2, 16, 16, gen(), tree=3)
    want = kernels.tree_verify_gqa(**case)
    tried = [c for c in candidates(S) if c["num_stages"] == 2 and c["num_warps"] == 4]
    assert {c["BLOCK_N"] for c in tried} == {16, 32, 64, 128} and all(S % c["BLOCK_N"] == 0 for c in tried)
    for config in tried[::3]:
        torch.testing.assert_close(attention.tree_verify_gqa(**case, config=config), want, **TOL)
    with pytest.raises(ValueError, match="multiple of BLOCK_N 96"):  # the override, not the table, reaches launch
        attention.tree_verify_gqa(**case, config=dict(tried[0], BLOCK_N=96))
    table = {"_doc": "d", "entries": [dict(kernel="gqa_tree", q_heads_per_kv=2, head_dim=16, BLOCK_N=64, BLOCK_R=64,
                                           num_warps=4, num_stages=2, source="untuned default"),
                                      dict(kernel="mla_decode", q_heads_per_kv=8, head_dim=576, BLOCK_N=32,
                                           BLOCK_R=32, num_warps=4, num_stages=2, source="untuned default")]}
    new = replace_entry(table, "gqa_tree", 2, 16, tried[0], "measured: test")
    assert new["_doc"] == "d" and new["entries"][0] == table["entries"][1]
    assert new["entries"][1] == dict(kernel="gqa_tree", q_heads_per_kv=2, head_dim=16, **tried[0],
                                     source="measured: test")
    if torch.cuda.is_available():
        return
    done = subprocess.run([sys.executable, "scripts/tune_attention.py"], text=True, capture_output=True, cwd=root,
                          timeout=120)
    assert done.returncode == 2 and "needs a GPU" in done.stderr
