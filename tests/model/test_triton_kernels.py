"""Triton kernels against their torch references, on CPU under ``TRITON_INTERPRET=1``.

Every comparison is fp32 at tight tolerance (close, not bit-exact: the kernels sum in another order), at
tiny shapes: ragged context lengths, shuffled non-contiguous block tables, key splits, head and latent dims
that are not powers of two, experts with zero tokens, every token on one expert, rows with no local expert.
Index helpers are checked against hand-worked values (exact). Last, every kernel is compiled ahead of time
for sm_90 and sm_100 in a subprocess, which catches what the interpreter does not (``tl.dot`` shapes, dtypes,
shared-memory budget).
"""

import dataclasses
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
import triton

import tests.support.interpret_triton as interpret_triton  # sets TRITON_INTERPRET before triton is imported
from model import kernels
from model.batch import PaddedContext
from model.config import MLAConfig, MoEConfig
from model.kernel_select import OPS, select_kernels
from model.moe import LocalExperts
from model.tree_mask import ancestor_mask, resolve_tree_mask
from model.triton import cases
from parallelism.layout import ExpertPlacement
from tests.support.paths import REPO_ROOT

interpret_triton.require()


attention = interpret_triton.module("model.triton.attention")
moe = interpret_triton.module("model.triton.moe")
norm = interpret_triton.module("model.triton.norm")

TOL = dict(atol=1e-5, rtol=1e-5)
LENS = [1, 7, 70, 150]  # ragged; 150 keys = 3 key tiles of 64 (GQA) / 5 of 32 (MLA)


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_moe_align_block_size_hand_worked():
    # pairs (row*k + choice): 0→e0, 1→e2, 2→e2, 3→not local, 4→e0, 5→e0; block_m 2 → e0 padded to 4, e2 to 2
    slots = torch.tensor([[0, 2], [2, -1], [0, 0]])
    sorted_ids, expert_ids, num_post = moe.moe_align_block_size(slots, num_experts=3, block_m=2)
    assert sorted_ids.tolist() == [0, 4, 5, 6, 1, 2, 6, 6, 6, 6]  # 6 = sentinel (N*k); size 2*ceil((6+3)/2)
    assert expert_ids.tolist() == [0, 0, 2, -1, -1]
    assert num_post.tolist() == [6]


def test_ancestor_mask_hand_worked():
    parents = torch.tensor([[-1, 0, 1, 0, 3, 4, 5, 6, 7], [-1, 0, 0, 0, 0, 0, 0, 0, 0]])
    mask = ancestor_mask(parents)
    assert mask[0, 8].nonzero().flatten().tolist() == [0, 3, 4, 5, 6, 7, 8]  # depth 6
    assert mask[0, 2].nonzero().flatten().tolist() == [0, 1, 2]
    assert (mask[1].sum(dim=1) == torch.tensor([1] + [2] * 8)).all()
    with pytest.raises(ValueError, match="exactly one"):
        resolve_tree_mask(mask, parents)


@pytest.mark.parametrize("routing", ["spread", "one_expert", "none_local"])
def test_fused_moe_matches_local_experts(routing):
    case = cases.expert_case(40, 3, hidden=24, inter=20, local_experts=4, routing=routing, gen=gen())
    out = moe.fused_moe(**case)
    torch.testing.assert_close(out, kernels.local_experts(**case), **TOL)
    if routing == "none_local":
        assert not out.any()


@pytest.mark.parametrize("counts", [[0, 5, 32], [32, 32, 32], [0, 0, 0], [17, 1, 16]],
                         ids=["empty_partial_full", "all_full", "all_empty", "ragged"])
def test_masked_moe_on_deepep_packed_rows(counts):
    """DeepEP's low-latency layout (3 experts × 32 rows, NaN garbage past each count): the masked grouped GEMM
    equals the reference on every valid row (2 row blocks of 16: full, partial and skipped blocks)."""
    case = cases.packed_expert_case(counts, 32, hidden=24, inter=20, gen=gen(3))
    inp = case["inp"]
    valid = (inp.slots >= 0).flatten()
    want = kernels.local_experts(**case)
    direct = moe.masked_moe(inp.hidden.view(3, 32, 24), inp.packed_counts, case["w_gate_up"], case["w_down"])
    assert direct.shape == (3, 32, 24)
    for got in (direct.view(96, 24), moe.fused_moe(**case)):
        torch.testing.assert_close(got[valid], want[valid], **TOL)
        assert not got[valid].isnan().any()


def test_fused_moe_takes_the_masked_path_for_packed_rows():
    """With ``packed_counts`` set, fused_moe runs the masked GEMM, which reads the counts, not the slots: with
    every slot −1 (the sorted path would compute nothing) the valid rows still come out right."""
    case = cases.packed_expert_case([4, 9], 16, hidden=24, inter=20, gen=gen(4))
    inp = case["inp"]
    valid = (inp.slots >= 0).flatten()
    no_slots = dataclasses.replace(inp, slots=torch.full_like(inp.slots, -1))
    out = moe.fused_moe(no_slots, case["w_gate_up"], case["w_down"])
    torch.testing.assert_close(out[valid], kernels.local_experts(**case)[valid], **TOL)


def test_local_experts_reference_is_the_module():
    """kernels.local_experts is LocalExperts.forward itself (bit-exact), for a rank holding 4 of 8 experts."""
    cfg = MoEConfig(num_experts=8, top_k=3, intermediate_size=20, scoring="softmax", norm_topk_prob=False)
    module = LocalExperts(24, cfg, ExpertPlacement(8, moe_ep=2, moe_tp=1), ep_rank=1, tp_rank=0)
    case = cases.expert_case(40, 3, hidden=24, inter=20, local_experts=4, routing="spread", gen=gen(1))
    module.w_gate_up.copy_(case["w_gate_up"])
    module.w_down.copy_(case["w_down"])
    assert torch.equal(module(case["inp"]), kernels.local_experts(**case))


@pytest.mark.parametrize("inter", [20, 6], ids=["grouped_gemm", "unaligned_per_expert"])
@pytest.mark.parametrize("routing", ["spread", "one_expert", "none_local"])
def test_local_experts_match_a_per_row_sum(inter, routing):
    """Both torch expert paths (grouped GEMM; one expert at a time when rows are not 16-byte aligned) equal
    the definition: Σ over a row's local slots of weight · down(silu(gate) · up)."""
    case = cases.expert_case(40, 3, hidden=24, inter=inter, local_experts=4, routing=routing, gen=gen(2))
    inp, w_gate_up, w_down = case["inp"], case["w_gate_up"], case["w_down"]
    want = torch.zeros_like(inp.hidden)
    for row, (slots, weights) in enumerate(zip(inp.slots.tolist(), inp.weights.tolist(), strict=True)):
        for slot, weight in zip(slots, weights, strict=True):
            if slot >= 0:
                gate, up = (w_gate_up[slot] @ inp.hidden[row]).split(inter)
                want[row] += weight * (w_down[slot] @ (torch.nn.functional.silu(gate) * up))
    torch.testing.assert_close(kernels.local_experts(**case), want, **TOL)


@pytest.mark.parametrize("split_keys", [64, 256])
def test_paged_decode_gqa(split_keys):
    case = cases.gqa_case(LENS, heads=6, kv_heads=2, head_dim=24, block_size=4, gen=gen())
    out = attention.paged_decode_gqa(**case, split_keys=split_keys)
    torch.testing.assert_close(out, kernels.paged_decode_gqa(**case), **TOL)


@pytest.mark.parametrize("split_keys", [64, 256])
def test_paged_decode_mla(split_keys):
    case = cases.mla_case(LENS, heads=4, latent=40, rope=8, block_size=4, gen=gen())
    out = attention.paged_decode_mla(**case, split_keys=split_keys)
    torch.testing.assert_close(out, kernels.paged_decode_mla(**case), **TOL)


def test_mla_decode_kernel_inside_decode_absorbed():
    """W_uk in, the kernel, W_uv out == MLAAttention._absorbed on the same padded cache."""
    heads, dn, dr, dv, latent = 4, 12, 8, 10, 40
    case = cases.mla_case(LENS, heads=heads, latent=latent, rope=dr, block_size=4, gen=gen(2))
    w = torch.randn(heads * (dn + dv), latent, generator=gen(3)) * latent ** -0.5
    q = torch.randn(len(LENS), heads, dn + dr, generator=gen(4))
    w_uk, w_uv = w.view(heads, dn + dv, latent).split([dn, dv], dim=1)
    q_lat = torch.einsum("bhd,hdl->bhl", q[..., :dn], w_uk)
    args = {**case, "q_lat": q_lat, "q_pe": q[..., dn:]}
    ours = torch.einsum("bhl,hvl->bhv", attention.paged_decode_mla(**args), w_uv)

    m = max(LENS)
    valid = torch.arange(m)[None, :] < torch.tensor(LENS)[:, None]
    padded = [torch.stack([torch.nn.functional.pad(
        kernels.gather_paged(cache, case["block_tables"][b], n, 4), (0, 0, 0, m - n)) for b, n in enumerate(LENS)])
        for cache in (case["latent_cache"], case["rope_cache"])]
    layer = SimpleNamespace(mla=MLAConfig(None, latent, dn, dr, dv), heads=heads,
                            kv_b_proj=SimpleNamespace(weight=w), scale=case["scale"])
    from model.attention import MLAAttention

    layer._absorb_weights = lambda: MLAAttention._absorb_weights(layer)
    ctx = PaddedContext(tuple(padded), valid[:, None, :], None)
    torch.testing.assert_close(ours, MLAAttention._absorbed(layer, q[:, None], ctx)[:, 0], **TOL)


def test_tree_verify_gqa():
    case = cases.gqa_case([5, 9, 75], heads=6, kv_heads=2, head_dim=24, block_size=4, gen=gen(), tree=5)
    ref = kernels.tree_verify_gqa(**case)
    torch.testing.assert_close(attention.tree_verify_gqa(**case, split_keys=64), ref, **TOL)
    by_mask = {k: v for k, v in case.items() if k != "parents"}
    mask = ancestor_mask(case["parents"])
    torch.testing.assert_close(attention.tree_verify_gqa(**by_mask, tree_mask=mask), ref, **TOL)


def test_tree_verify_mla():
    case = cases.mla_case([5, 9, 75], heads=4, latent=40, rope=8, block_size=4, gen=gen(), tree=5)
    ref = kernels.tree_verify_mla(**case)
    torch.testing.assert_close(attention.tree_verify_mla(**case, split_keys=64), ref, **TOL)
    by_mask = {k: v for k, v in case.items() if k != "parents"}
    mask = ancestor_mask(case["parents"])
    torch.testing.assert_close(attention.tree_verify_mla(**by_mask, tree_mask=mask), ref, **TOL)


def test_rms_norm_and_residual():
    case = cases.norm_case(6, 40, gen(), residual=False)
    x3 = case["x"].view(2, 3, 40)
    torch.testing.assert_close(norm.rms_norm(x3, case["weight"], case["eps"]),
                               kernels.rms_norm(x3, case["weight"], case["eps"]), **TOL)
    case = cases.norm_case(6, 40, gen(1), residual=True)
    normed, residual = norm.add_rms_norm(**case)
    ref_normed, ref_residual = kernels.add_rms_norm(**case)
    torch.testing.assert_close(normed, ref_normed, **TOL)
    assert torch.equal(residual, ref_residual)


def test_select_kernels_on_cpu_uses_references():
    ks = select_kernels("cpu")
    assert {op: ks.reasons[op] for op in OPS} == dict.fromkeys(OPS, "torch reference: no CUDA device (cpu)")
    assert ks.moe_experts is kernels.local_experts and ks.rms_norm is kernels.rms_norm
    assert not ks.graph_safe  # the references wait on the host: engine.worker.capture.kernel_blocker
    assert select_kernels("cpu", backend="torch").reasons["rms_norm"].startswith("torch reference: requested")
    with pytest.raises(RuntimeError, match="no CUDA device.*torch references"):
        select_kernels("cpu", backend="triton")


def test_every_kernel_compiles_for_sm90_and_sm100():
    """Real Triton compiler and ptxas (shipped with triton), production shapes, no GPU needed; the core set
    (every code path once, ~1 min cold for both targets, seconds with a warm Triton cache). The PTX of the fp32
    configuration has no TF32 MMA (with Triton's default ``input_precision`` it has; see
    ``model.triton.precision.dot_precision``)."""
    if "nvidia" not in triton.backends.backends:
        pytest.skip("this triton build has no NVIDIA backend, so there is no compiler to run")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "model.triton.aot", "--arch", "90", "100", "--core"], env=env,
                          text=True, capture_output=True, cwd=REPO_ROOT, timeout=480)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    assert {r["kernel"].split()[0] for r in rows} == {"gqa", "mla", "moe", "rms_norm"}
    assert {r["arch"] for r in rows} == {"sm_90", "sm_100"}
    assert {"mla split merge", "mla decode split block64"} <= {r["kernel"] for r in rows}
    assert [r for r in rows if not r["ok"]] == []
    # fp32 operands go through IEEE FMA, never TF32 tensor cores (Triton's default; the interpreter ignores it)
    assert any("fp32" in r["kernel"] for r in rows) and [r["kernel"] for r in rows if r["tf32_mma"]] == []


HALF_CASES = [  # (kernel, reference, inputs(generator)) in fp16
    pytest.param(attention.paged_decode_gqa, kernels.paged_decode_gqa,
                 lambda g: cases.gqa_case(LENS, 6, 2, 24, 4, g, dtype=torch.float16), id="paged_decode_gqa"),
    pytest.param(attention.tree_verify_mla, kernels.tree_verify_mla,
                 lambda g: cases.mla_case([5, 9, 75], 4, 40, 8, 4, g, tree=5, dtype=torch.float16),
                 id="tree_verify_mla"),
    pytest.param(moe.fused_moe, kernels.local_experts,
                 lambda g: cases.expert_case(40, 3, 24, 20, 4, "spread", g, dtype=torch.float16), id="fused_moe"),
    pytest.param(cases.valid_rows_only(moe.fused_moe), cases.valid_rows_only(kernels.local_experts),
                 lambda g: cases.packed_expert_case([0, 7, 16, 3], 16, 24, 20, g, dtype=torch.float16),
                 id="masked_moe"),
    pytest.param(norm.add_rms_norm, kernels.add_rms_norm,
                 lambda g: cases.norm_case(6, 40, g, residual=True, dtype=torch.float16), id="add_rms_norm"),
]


@pytest.mark.parametrize("kernel, ref, inputs", HALF_CASES)
def test_half_precision_paths(kernel, ref, inputs):
    """fp16 through the low-precision casts (the interpreter computes bf16 wrongly: triton-lang/triton#11584):
    the kernel is no further from the fp32 truth than twice the fp16 reference (rule in cases.compare)."""
    result = cases.compare(kernel, ref, inputs(gen(5)))
    assert result["ok"], result


@pytest.mark.parametrize("preset", ["tiny_deepseek", "tiny_qwen3_moe"])
def test_model_static_steps_on_the_triton_kernel_set(preset, tiny_ckpts):
    """The whole model wired to the Triton kernels (interpreted): a static decode step and a static tree-verify
    step give the torch references' logits — the path a captured CUDA graph replays."""
    from engine.worker.cuda_graphs import StaticSeq, StaticStep, StepShape
    from engine.worker.kv_cache import KVSpec, PagedKV, PagedKVCache, SeqSlots
    from model.batch import ForwardBatch
    from model.kernel_select import KernelSet, reference_kernels
    from model.loader import load_model
    from parallelism.comm import build_groups
    from parallelism.layout import Layout

    model = load_model(tiny_ckpts[preset], build_groups(Layout()))
    triton_set = KernelSet(norm.rms_norm, norm.add_rms_norm, moe.fused_moe, attention.paged_decode_gqa,
                           attention.paged_decode_mla, attention.tree_verify_gqa, attention.tree_verify_mla)
    cache = PagedKVCache(KVSpec.for_model(model), 12, 4)
    tables = [[1, 2, 3, 4], [5, 6, 7, 8]]
    ids = torch.randint(3, model.cfg.vocab_size, (7,), generator=gen(5))
    model(ForwardBatch(ids, torch.arange(7), [4, 3], PagedKV(cache, [SeqSlots(t, 0, n) for t, n in
                                                                    zip(tables, (4, 3), strict=True)])))
    parents = torch.tensor([-1, 0, 0, 1])
    tree = ancestor_mask(parents[None])[0]
    cases_ = {StepShape(2, 1): [([9], [4], None), ([11], [3], None)],
              StepShape(2, 4): [([9, 3, 4, 5], [4, 5, 5, 6], tree), ([11, 6, 7, 8], [3, 4, 4, 5], tree)]}
    for shape, rows in cases_.items():
        seqs = [StaticSeq(cache.slots(t, start, start + len(tok)), t, start + len(tok), tok, pos, mask)
                for t, start, (tok, pos, mask) in zip(tables, (4, 3), rows, strict=True)]
        step = StaticStep(model, cache, shape, max_blocks=4, scratch_blocks=(0,))
        step.load(seqs)
        want = step.run()[0].clone()
        model.use_kernels(triton_set)
        try:
            got = step.run()[0]
        finally:
            model.use_kernels(reference_kernels())
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_static_draft_on_the_triton_kernel_set(tiny_ckpts, random_drafter):
    """The static draft step (the drafter's block attending through the paged tree-verify kernel) drafts the
    same logits and trees with the Triton kernels (interpreted) as with the torch references."""
    from engine.params import SamplingParams
    from engine.step import SeqWork
    from engine.worker.kv_cache import KVSpec, PagedKVCache
    from model.kernel_select import KernelSet, reference_kernels
    from model.loader import load_model
    from parallelism.comm import build_groups
    from parallelism.layout import Layout
    from spec_decode.config import SpecConfig
    from spec_decode.decoder import SpeculativeDecoder
    from spec_decode.dflash import DFlashDrafter
    from spec_decode.static_draft import StaticDraft

    model = load_model(tiny_ckpts["tiny_deepseek"], build_groups(Layout()))
    cache = PagedKVCache(KVSpec.for_model(model), 12, 4)
    spec = SpeculativeDecoder(model, DFlashDrafter.load(random_drafter),
                      SpecConfig("ddtree", budget=6, block_size=5, drafter_path=random_drafter), cache)
    work = [SeqWork(request_id=str(i), token_ids=[30 + i], start=n, block_table=t, sample=True,
                    params=SamplingParams(), seed=0, num_generated=1, decode=True, spec=True)
            for i, (n, t) in enumerate(((7, [3, 5, 1]), (2, [8, 2])))]
    for w in work:
        spec.add_context(w, torch.randn(w.start, len(spec.feature_layers) * model.cfg.hidden_size, generator=gen(6)), 0)
    draft = StaticDraft(spec, batch=2, max_blocks=3, scratch_blocks=(11, 10))
    draft.load(work)
    want = [t.clone() for t in draft.run()]
    model.use_kernels(KernelSet(norm.rms_norm, norm.add_rms_norm, moe.fused_moe, attention.paged_decode_gqa,
                                attention.paged_decode_mla, attention.tree_verify_gqa, attention.tree_verify_mla))
    try:
        got = draft.run()
    finally:
        model.use_kernels(reference_kernels())
    torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-4)
    assert all(torch.equal(g, w) for g, w in zip(got[1:], want[1:], strict=True))
