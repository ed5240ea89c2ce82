"""The MoE align-block-size kernel, the grouped launch order and the launch-config tables, on CPU under
``TRITON_INTERPRET=1``.

The align kernel must equal its torch reference exactly (integer outputs); the fused MoE under each grouped
order is compared with the torch reference at fp32 tolerance (close: fp32 atomics sum in launch order).
GROUP_M only reorders programs for L2 reuse on a GPU — a performance change this CPU box cannot measure.
"""

import json
import subprocess
import sys

import pytest
import torch

import tests.support.interpret_triton as interpret_triton  # sets TRITON_INTERPRET before triton is imported
from model import kernels
from model.triton import cases
from tests.support.paths import REPO_ROOT

interpret_triton.require()


moe = interpret_triton.module("model.triton.moe")
TOL = dict(atol=1e-5, rtol=1e-5)


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _slots(kind: str, rows: int, k: int, experts: int) -> torch.Tensor:
    if kind == "empty_experts":  # experts 0 and 2 get nothing; a third of the pairs are remote
        s = torch.randint(-1, experts, (rows, k), generator=gen(1))
        return torch.where((s == 0) | (s == 2), -1, s)
    if kind == "one_expert":
        return torch.full((rows, k), 3)
    if kind == "none_local":
        return torch.full((rows, k), -1)
    return torch.randint(-1, experts, (rows, k), generator=gen(2))  # "spread"


@pytest.mark.parametrize("kind", ["empty_experts", "one_expert", "none_local", "spread"])
@pytest.mark.parametrize("rows, k, experts, block_m", [(5, 2, 6, 4), (40, 8, 48, 16), (300, 2, 5, 64)],
                         ids=["tiny", "48_experts", "multi_chunk"])
def test_align_kernel_equals_the_torch_reference(kind, rows, k, experts, block_m):
    """Exact: sorted ids (stable within an expert, sentinel padding), block experts, padded length. The
    multi-chunk case has 600 pairs (5 chunks of 128) so the per-expert cursor carries across chunks."""
    slots = _slots(kind, rows, k, experts)
    got = moe.moe_align_block_size(slots, experts, block_m)
    want = moe.align_block_size_reference(slots, experts, block_m)
    for g, w, name in zip(got, want, ("sorted_ids", "expert_ids", "num_post"), strict=True):
        assert g.dtype == w.dtype == torch.int32 and torch.equal(g, w), name


def test_align_kernel_single_expert():
    slots = torch.tensor([[0], [0], [-1], [0]])
    sorted_ids, expert_ids, num_post = moe.moe_align_block_size(slots, num_experts=1, block_m=16)
    # P = round_up(4 pairs + 1 expert × 15, 16) = 32: one used block, one spare past the end
    assert sorted_ids.tolist() == [0, 1, 3] + [4] * 29 and expert_ids.tolist() == [0, -1]
    assert num_post.tolist() == [16]


@pytest.mark.parametrize("group_m", [1, 2, 8])
@pytest.mark.parametrize("routing", ["spread", "one_expert"])
def test_fused_moe_in_grouped_order(group_m, routing):
    """Correctness only: every grouped launch order gives the reference (3 N tiles, 6+ row blocks)."""
    case = cases.expert_case(40, 3, hidden=40, inter=36, local_experts=4, routing=routing, gen=gen(3))
    tiles = moe.MoETiles(16, 16, 16, 4, group_m, 2)
    torch.testing.assert_close(moe.fused_moe(**case, tiles=tiles), kernels.local_experts(**case), **TOL)


def test_moe_tables_are_untuned_defaults_and_are_looked_up():
    from model.triton.launch_tables import CONFIG_DIR, UNTUNED, moe_config

    files = sorted((CONFIG_DIR / "moe").glob("*.json"))
    assert any(f.name == "E=48,N=2048,K=7168,device_name=default.json" for f in files)
    for f in files:
        table = json.loads(f.read_text())
        assert table["_source"] == UNTUNED, f.name
        for bucket, cfg in table.items():
            if bucket.isdigit():
                assert set(cfg) == {"BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M", "num_warps",
                                    "num_stages"}, f.name
    assert moe_config(48, 2048, 7168, 1)["BLOCK_SIZE_M"] == 16
    assert moe_config(48, 2048, 7168, 4000)["BLOCK_SIZE_M"] == 64  # nearest bucket 4096
    assert moe_config(48, 2048, 7168, 100, "NVIDIA_H200") == moe_config(48, 2048, 7168, 96)  # falls back to default
    assert moe_config(5, 7, 9, 1) is None
    t = moe.table_tiles(48, 2048, 7168, 3000, torch.device("cpu"))
    assert (t.block_m, t.group_m, t.num_warps) == (64, 8, 8)


def test_tune_moe_without_a_gpu_says_so():
    if torch.cuda.is_available():
        pytest.skip("this box has a GPU")
    done = subprocess.run([sys.executable, "scripts/tune_moe.py", "--experts", "4", "--inter", "8", "--hidden", "8"],
                          text=True, capture_output=True, cwd=REPO_ROOT, timeout=120)
    assert done.returncode == 2 and "needs a GPU" in done.stderr and "--write-defaults" in done.stderr


# ------------------------------------------------------------------------------------- prefill paths
PREFILL_CASE = dict(hidden=32, inter=24, local_experts=4)  # 16-byte rows in fp16 and fp32, as grouped_mm wants


@pytest.mark.parametrize("dtype, tol", [(torch.float32, TOL), (torch.float16, dict(atol=2e-3, rtol=2e-3))],
                         ids=["fp32", "fp16"])
@pytest.mark.parametrize("routing", ["spread", "one_expert", "none_local"])
def test_grouped_prefill_path_equals_local_experts(routing, dtype, tol):
    """``grouped_moe`` (the align kernel at block 1, ``F.grouped_mm``, ``index_add_``) against the reference:
    spread routing leaves local expert 0 empty and sends half the pairs elsewhere (the sentinel tail),
    one_expert sends every row's first choice to one expert, none_local gives an all-sentinel sort. Close, not
    bit-exact: the routing weight scales the intermediate here, the output in the reference."""
    case = cases.expert_case(40, 3, **PREFILL_CASE, routing=routing, gen=gen(4), dtype=dtype)
    torch.testing.assert_close(moe.grouped_moe(**case), kernels.local_experts(**case), **tol)


def test_moe_path_rule():
    """Below PREFILL_TOKENS rows the sorted kernels; from it grouped_mm on sm_90+ with bf16 16-byte rows, else
    the prefill tiles; given tiles or the ordered combine (batch-invariant mode) always the sorted kernels."""
    w, t, sm90 = torch.empty(4, 32, 24, dtype=torch.bfloat16), moe.PREFILL_TOKENS, (9, 0)
    assert moe.moe_path(t - 1, w, capability=sm90) == "sorted"
    assert moe.moe_path(t, w, capability=sm90) == moe.moe_path(t, w, capability=(10, 0)) == "grouped_mm"
    assert moe.moe_path(t, w, capability=(8, 9)) == "prefill_tiles"
    assert moe.moe_path(t, w.half(), capability=sm90) == "prefill_tiles"  # CUDA grouped_mm is bf16 only
    assert moe.moe_path(t, torch.empty(4, 32, 20, dtype=torch.bfloat16), capability=sm90) == "prefill_tiles"
    assert moe.moe_path(t, w) == "prefill_tiles"  # a CPU tensor: no capability
    assert moe.moe_path(t, w, tiles=moe.MoETiles(16, 64, 64), capability=sm90) == "sorted"
    assert moe.moe_path(t, w, ordered_combine=True, capability=sm90) == "sorted"
    assert (moe.prefill_tiles(torch.bfloat16).block_m, moe.prefill_tiles(torch.bfloat16).block_k) == (128, 64)
    assert moe.prefill_tiles(torch.float32).block_k == 32  # three 4-byte tiles per stage fit sm_80's shared memory


def test_fused_moe_takes_the_prefill_paths(monkeypatch):
    """``fused_moe`` applies the rule (threshold lowered to 8 rows, an sm_90 capability faked): bf16 goes through
    ``grouped_moe`` (its only Triton kernel is the integer align step, which the interpreter gets right), fp32
    through the sorted kernels at the prefill tiles; batch-invariant mode (fixed tiles, ordered combine) stays
    sorted."""
    tim = interpret_triton.module("model.triton.invariant_matmul")
    taken = []

    def spy(*args, **kw):
        taken.append(path := moe_path(*args, **kw))
        return path

    moe_path = moe.moe_path
    monkeypatch.setattr(moe, "moe_path", spy)
    monkeypatch.setattr(moe, "PREFILL_TOKENS", 8)
    monkeypatch.setattr(moe, "_capability", lambda device: (9, 0))
    bf16 = cases.expert_case(40, 3, **PREFILL_CASE, routing="spread", gen=gen(5), dtype=torch.bfloat16)
    torch.testing.assert_close(moe.fused_moe(**bf16), kernels.local_experts(**bf16), atol=2e-2, rtol=2e-2)
    fp32 = cases.expert_case(40, 3, **PREFILL_CASE, routing="spread", gen=gen(6))
    torch.testing.assert_close(moe.fused_moe(**fp32), kernels.local_experts(**fp32), **TOL)
    small = cases.expert_case(7, 3, **PREFILL_CASE, routing="spread", gen=gen(7))
    torch.testing.assert_close(moe.fused_moe(**small), kernels.local_experts(**small), **TOL)
    tim.moe_experts(**fp32)
    assert taken == ["grouped_mm", "prefill_tiles", "sorted", "sorted"]
