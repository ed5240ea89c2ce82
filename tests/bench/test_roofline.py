"""``bench.gpu.roofline`` on CPU: the floor arithmetic by hand, the op classes, and a dry run of the whole
table at tiny sizes (eager steps, no NVML). The GPU numbers themselves need a GPU run."""

import pytest
import torch

from bench.cost.floors import floor_bytes
from bench.gpu import roofline


def test_floor_bytes_hand_worked():
    """The one floor arithmetic (``bench.cost.floors``) that the roofline and the bench verdict share: 1000 dense
    bytes; layer 0 touched 3 experts of 10 B, layer 1 none of 20 B; 7 KV bytes per token over contexts 4 and 9
    (+1 token each this step): 30 + 0, 7 * (5 + 10) = 105; a 3-token verify step reads 7 * (7 + 12) = 133."""
    assert floor_bytes({"dense": 1000}, [10, 20], [3, 0], 7, [4, 9]) == dict(dense=1000, routed_experts=30,
                                                                             kv_cache=105)
    assert floor_bytes({"a": 1, "b": 2}, [10], [2.5], 7, [4, 9], new_tokens=3) == dict(a=1, b=2, routed_experts=25,
                                                                                       kv_cache=133)


def test_op_classes():
    names = {"_mla_kernel": "attention", "_merge_kernel": "attention", "_down_kernel": "moe",
             "nvjet_tst_128x8_64x9_1x1_v_bz_TNT": "gemm", "aten::mm": "gemm", "_rms_norm_kernel": "norm",
             "void at::native::vectorized_elementwise_kernel<4>": "copy/elementwise", "aten::topk": "routing",
             "aten::view": "views/alloc (host only)", "triton_poi_fused_0": "other"}
    assert {n: roofline.op_class(n) for n in names} == names
    assert roofline.breakdown({"aten::mm": 3.0, "aten::addmm": 1.0, "aten::topk": 4.0}) == {"gemm": 0.5,
                                                                                         "routing": 0.5}


def test_weight_bytes_count_one_expert_per_moe_layer_and_skip_the_embedding():
    from bench.gpu.fixtures import random_model

    shape = roofline.TINY_SLICE
    model = random_model(torch.device("cpu"), torch.float32, **shape.overrides())
    dense, per_expert = roofline.weight_bytes(model)
    assert per_expert == [3 * shape.hidden * shape.moe_inter * 4] * shape.moe_layers  # gate, up, down; fp32
    total = sum(p.numel() * 4 for p in model.parameters())
    embed = shape.vocab // shape.tp * shape.hidden * 4
    routed = shape.moe_layers * (shape.experts // shape.ep) * per_expert[0]
    assert dense == total - embed - routed


def test_roofline_dry_run_on_cpu():
    """The whole run at tiny sizes: every (routing, batch, context) row, eager (no CUDA), and the markdown table
    (the floor arithmetic of one row: :func:`test_roofline_row_by_hand`)."""
    out = roofline.run("cpu", budget_s=300, batches=(1, 2), contexts=(8, 24))
    rows, shape = out["rows"], roofline.TINY_SLICE
    assert [(r["routing"], r["batch"], r["context"]) for r in rows] == [
        (g, b, c) for g in ("ep8", "tp8") for c in (8, 24) for b in (1, 2)]
    kv_per_token = (shape.kv_lora + shape.rope) * 4 * (shape.dense_layers + shape.moe_layers)
    for r in rows:
        assert not r["captured"] and r["eager_reason"] == "no CUDA device" and r["power_w"] is None
        assert r["bytes"]["kv_cache"] == kv_per_token * r["batch"] * (r["context"] + 1)
        assert r["floor_ms"] > 0 and r["step_ms"] > 0 and r["fraction"] > 0
        local = shape.experts // shape.ep if r["routing"] == "ep8" else shape.experts
        assert len(r["experts_touched"]) == shape.moe_layers
        assert all(0 <= n <= min(local, r["batch"] * shape.top_k) for n in r["experts_touched"])
        assert abs(sum(r["op_classes"].values()) - 1) < 1e-3
    assert any(n > 0 for r in rows for n in r["experts_touched"])
    table = out["table"].splitlines()
    assert len(table) == 2 + len(rows) and table[2].startswith("| ep8 | 1 | 8 | eager |")


def test_roofline_row_by_hand(monkeypatch):
    """One row worked by hand from the TINY_SLICE dims (fp32, 4 B), with the copy bandwidth fixed at 1e9 B/s and
    the step at 2 ms: tp8 routing, batch 1, context 8. tp8 holds all 32 experts, so top-4 of one token touches
    4 distinct experts in each of the 2 MoE layers."""
    monkeypatch.setattr(roofline, "copy_bandwidth", lambda device: 1e9)
    monkeypatch.setattr(roofline, "cuda_time_s", lambda fn, device: 2e-3)
    out = roofline.run("cpu", budget_s=300, batches=(1,), contexts=(8,), routings=("tp8",))
    (row,) = out["rows"]
    # per layer, MLA (4 heads, q_lora 32, kv_lora 32, nope/rope/v 16): q_a 32x64 + q_b (4*32)x32 + kv_a (32+16)x64
    # + kv_b (4*32)x32 + o 64x(4*16) + q_a/kv_a norms 32 + 32 + the layer's 2 norms 64 + 64 = 17600 elements
    attention = 3 * (2048 + 4096 + 3072 + 4096 + 4096 + 64 + 128)
    dense_mlp = 2 * 96 * 64 + 64 * 96  # gate_up, down (I 96)
    # per MoE layer: a router over all 32 experts 32x64 + its correction bias 32; the shared expert (I 32)
    moe = 2 * (32 * 64 + 32 + 2 * 32 * 64 + 64 * 32)
    head = 64 + (1024 // 8) * 64  # final norm, the TP8 rank's LM head
    dense = 4 * (attention + dense_mlp + moe + head)
    experts = 2 * 4 * 4 * (2 * 4 * 64 + 64 * 4)  # 2 layers x 4 touched x fp32 x (gate_up + down at I 32/8 = 4)
    kv = (32 + 16) * 4 * 3 * (8 + 1)  # latent + rope key, fp32, 3 layers, context + this token
    assert (dense, experts, kv) == (383_744, 24_576, 5_184)
    assert row["experts_touched"] == [4, 4]
    assert row["bytes"] == dict(dense=dense, routed_experts=experts, kv_cache=kv, total=413_504)
    assert row["floor_ms"] == pytest.approx(1e3 * 413_504 / 1e9, rel=1e-12)  # 0.413504 ms
    assert row["step_ms"] == pytest.approx(2.0, rel=1e-12)
    assert row["fraction"] == pytest.approx(0.206752, rel=1e-12)
    assert row["tok_s"] == pytest.approx(500, rel=1e-12)
    assert out["copy_gb_s"] == 1.0


def test_timer_off_cuda_is_the_median_wall_time(monkeypatch):
    """:func:`bench.gpu.harness.cuda_time_s` in the CPU dry runs: ``warmup`` untimed calls, then the (upper)
    median of ``iters`` wall times in seconds — here calls of 1, 0.5, 3 and 0.25 s on a fake clock."""
    from types import SimpleNamespace

    from bench.gpu import harness

    calls, clock = [], iter([0.0, 1.0, 1.0, 1.5, 2.0, 5.0, 5.0, 5.25])  # perf_counter around each timed call
    monkeypatch.setattr(harness, "time", SimpleNamespace(perf_counter=lambda: next(clock)))
    assert harness.cuda_time_s(lambda: calls.append(1), iters=4, warmup=2, device="cpu") == 1.0
    assert len(calls) == 6


def test_roofline_out_of_budget_skips_rows():
    out = roofline.run("cpu", budget_s=0, batches=(1,), contexts=(8,), routings=("ep8",))
    assert out["rows"] == [dict(routing="ep8", batch=1, context=8, skipped="time budget")]
    assert "time budget" in out["table"]
