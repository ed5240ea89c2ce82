"""``bench.gpu.roofline`` on CPU: the floor arithmetic by hand, the op classes, and a dry run of the whole
table at tiny sizes (eager steps, no NVML). The GPU numbers themselves need a GPU run."""

import torch

from bench.gpu import roofline


def test_floor_bytes_hand_worked():
    # 1000 dense bytes; layer 0 touched 3 experts of 10 B, layer 1 none of 20 B; 7 KV bytes per token over
    # contexts 4 and 9 (+1 token each this step): 30 + 0, 7 * (5 + 10) = 105
    assert roofline.floor_bytes(1000, [10, 20], [3, 0], 7, [4, 9]) == dict(dense=1000, experts=30, kv=105,
                                                                           total=1135)


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
    """The whole run at tiny sizes: every (routing, batch, context) row, eager (no CUDA), with its floor from
    the bytes it reports and the copy bandwidth of the run, and the markdown table."""
    out = roofline.run("cpu", budget_s=300, batches=(1, 2), contexts=(8, 24))
    rows, shape = out["rows"], roofline.TINY_SLICE
    assert [(r["routing"], r["batch"], r["context"]) for r in rows] == [
        (g, b, c) for g in ("ep8", "tp8") for c in (8, 24) for b in (1, 2)]
    kv_per_token = (shape.kv_lora + shape.rope) * 4 * (shape.dense_layers + shape.moe_layers)
    for r in rows:
        assert not r["captured"] and r["eager_reason"] == "no CUDA device" and r["power_w"] is None
        assert r["bytes"]["kv"] == kv_per_token * r["batch"] * (r["context"] + 1)
        assert abs(r["floor_ms"] - 1e3 * r["bytes"]["total"] / (out["copy_gb_s"] * 1e9)) < 1e-9
        assert abs(r["fraction"] - r["floor_ms"] / r["step_ms"]) < 1e-9
        local = shape.experts // shape.ep if r["routing"] == "ep8" else shape.experts
        assert len(r["experts_touched"]) == shape.moe_layers
        assert all(0 <= n <= min(local, r["batch"] * shape.top_k) for n in r["experts_touched"])
        assert abs(sum(r["op_classes"].values()) - 1) < 1e-3
    assert any(n > 0 for r in rows for n in r["experts_touched"])
    table = out["table"].splitlines()
    assert len(table) == 2 + len(rows) and table[2].startswith("| ep8 | 1 | 8 | eager |")


def test_roofline_out_of_budget_skips_rows():
    out = roofline.run("cpu", budget_s=0, batches=(1,), contexts=(8,), routings=("ep8",))
    assert out["rows"] == [dict(routing="ep8", batch=1, context=8, skipped="time budget")]
    assert "time budget" in out["table"]
