"""Cost model against hand-worked cases, the layout presets, validation against published figures, and the
topology switches (env mapping, NVML link detection on a fake NVML, the CPU fallback)."""

import json
import math
from dataclasses import replace
from types import SimpleNamespace

import pytest
import yaml

from bench.cost.efficiency import EFFICIENCY_FILE, KernelEfficiency, interp_log2, load_efficiency
from bench.cost.formulas import (
    LAYOUTS,
    allreduce_time,
    busiest_group_active_experts,
    collective_time,
    dispatch_time,
    forward_calls,
    memory_fit,
    project,
    project_matrix,
    remote_ranks_per_token,
    rescale_calls,
    step_bytes,
    step_comm,
    step_flops,
)
from bench.cost.hardware import B300_NVLINK5, H200_NVLINK4, HARDWARE, RTX_PRO_6000_PCIE5, Hardware, profile_for_gpu
from bench.cost.shapes import KIMI_K2, KIMI_K2_INT4, ModelShape
from bench.cost.tables import hardware_table, memory_table, projection_table, validate, validation_table
from model.config import parse_config
from parallelism.topology import (
    CPU_FALLBACK,
    TopologyConfig,
    TopologyError,
    apply_env,
    check_dispatcher,
    detect_links,
    nccl_env,
    plan,
)
from tests.support.layouts import layout
from tests.support.paths import REPO_ROOT

REPO = REPO_ROOT
LINK = Hardware(name="test", num_gpus=8, mem_bw=1e12, peak_flops=1e15, mem_capacity=1e11, link="test",
                bus_bw=100e9, a2a_bw=100e9, alpha_s=10e-6)


# ------------------------------------------------------------------------------------ collectives by hand
def test_allreduce_two_ranks_by_hand():
    # 2 ranks, 1 MB, 100 GB/s, alpha 10 us: 10 us + 1e6 * 2(2-1)/2 / 1e11 = 10 us + 10 us
    assert allreduce_time(1e6, 2, 100e9, 10e-6) == pytest.approx(20e-6)
    assert collective_time("all_reduce", 1e6, 2, LINK) == pytest.approx(20e-6)
    # 8 ranks: 10 us + 1e6 * 1.75 / 1e11 = 27.5 us; 3 calls moving 3 MB: 3 x 27.5 us
    assert collective_time("all_reduce", 1e6, 8, LINK) == pytest.approx(27.5e-6)
    assert collective_time("all_reduce", 3e6, 8, LINK, calls=3) == pytest.approx(82.5e-6)
    assert collective_time("all_reduce", 1e6, 1, LINK) == 0.0


def test_other_collectives_by_hand():
    # all-gather of 1 MB per rank over 4 ranks: each rank receives 3 MB -> 10 us + 30 us
    assert collective_time("all_gather", 1e6, 4, LINK) == pytest.approx(40e-6)
    assert collective_time("gather", 1e6, 4, LINK) == pytest.approx(40e-6)
    # reduce-scatter of a 4 MB input over 4 ranks: 10 us + 4e6 * 3/4 / 1e11 = 40 us
    assert collective_time("reduce_scatter", 4e6, 4, LINK) == pytest.approx(40e-6)
    assert collective_time("broadcast", 1e6, 4, LINK) == pytest.approx(20e-6)
    with pytest.raises(ValueError, match="no cost formula"):
        collective_time("send", 1, 2, LINK)


def test_dispatch_remote_ranks_by_hand():
    # p = 8, k = 8: R = 7 * (1 - (7/8)^8) = 4.5947 remote ranks per token
    r = remote_ranks_per_token(8, 8)
    assert r == pytest.approx(7 * (1 - (7 / 8) ** 8)) and r == pytest.approx(4.5947, abs=1e-4)
    assert remote_ranks_per_token(8, 1) == pytest.approx(7 / 8)
    assert remote_ranks_per_token(2, 1) == pytest.approx(0.5)
    # 64 tokens of 14336-byte rows: 10 us + 8 tokens/rank * R * 14336 B / 100 GB/s
    t = dispatch_time(64, 14336, 8, 8, 100e9, 10e-6)
    assert t == pytest.approx(10e-6 + 8 * r * 14336 / 100e9)
    # the counter's view: send buffer = 8 tokens x p(1-(1-1/p)^k) rows; (p-1)/p of it is remote
    send = 8 * 8 * (1 - (7 / 8) ** 8) * 14336
    assert collective_time("all_to_all", send, 8, LINK) == pytest.approx(t)


def test_busiest_expert_group():
    assert busiest_group_active_experts(8, 1, 1, 8) == pytest.approx(1.0)  # one active expert, one group has it
    assert busiest_group_active_experts(384, 8, 1, 1) == pytest.approx(8.0)
    assert busiest_group_active_experts(384, 8, 1, 8) == pytest.approx(2.575, abs=1e-3)  # Monte Carlo: 2.56
    assert busiest_group_active_experts(384, 8, 10_000, 8) == pytest.approx(48.0)
    assert busiest_group_active_experts(384, 8, 0, 8) == 0.0


# ------------------------------------------------------------------------------------- models and layouts
def test_layouts_match_conf_presets():
    for name, lay in LAYOUTS.items():
        assert layout(name) == lay, name


def test_kimi_sizes():
    assert 1.00e12 < KIMI_K2.total_params() < 1.06e12  # "1T total"
    assert 31e9 < KIMI_K2.active_params() < 33e9       # "32B activated"
    assert KIMI_K2.num_moe_layers == 60 and KIMI_K2.mla and KIMI_K2.kv_elems_per_token_layer == 576
    assert KIMI_K2_INT4.expert_weight_bytes == 0.5625


def test_shape_from_config():
    raw = dict(model_type="kimi_k2", vocab_size=1000, hidden_size=64, intermediate_size=128,
               moe_intermediate_size=16, num_hidden_layers=4, num_attention_heads=8, n_routed_experts=16,
               n_shared_experts=1, num_experts_per_tok=4, first_k_dense_replace=1, q_lora_rank=32,
               kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)
    s = ModelShape.from_config(parse_config(raw), expert_weight_bytes=0.5)
    assert (s.num_layers, s.num_dense_layers, s.num_experts, s.top_k, s.kv_lora_rank) == (4, 1, 16, 4, 32)
    assert s.mla and s.expert_weight_bytes == 0.5 and s.weight_bytes == 2.0


def test_calls_follow_the_documented_formula():
    assert forward_calls("tp8", KIMI_K2) == {"attn_tp/all_reduce": 63, "world/all_reduce": 60, "attn_tp/gather": 1}
    assert forward_calls("dp8_ep8", KIMI_K2) == {"world/all_to_all": 240}
    tiny = {"attn_tp/all_reduce": 5, "world/all_reduce": 2, "attn_tp/gather": 1, "world/broadcast": 3}
    assert rescale_calls(tiny, "ep8", measured=(3, 2), target=(61, 60)) == {
        "attn_tp/all_reduce": 63, "world/all_reduce": 60, "attn_tp/gather": 1, "world/broadcast": 3}


def test_step_comm_bytes_for_kimi():
    c = step_comm("ep8", KIMI_K2, batch=1)
    assert c["attn_tp/all_reduce"] == {"calls": 63, "bytes": 63 * 7168 * 2}
    assert c["attn_tp/gather"] == {"calls": 1, "bytes": 163840 // 8 * 2}
    a2a = step_comm("dp8_ep8", KIMI_K2, batch=8)["world/all_to_all"]
    hits = 8 * (1 - (7 / 8) ** 8)
    per_layer = 8 * 8 + hits * (2 * 7168 * 2 + 2 * 8 * 4)  # counts + rows + routing + combine rows, one token
    assert a2a["calls"] == 240 and a2a["bytes"] == pytest.approx(60 * per_layer)


def test_step_comm_bytes_for_kimi_under_mixed_attention():
    """TP2 × DP4 attention, batch 8: a group holds 2 sequences, each TP rank dispatches its 1-token share."""
    c = step_comm("tp2xdp4_ep8", KIMI_K2, batch=8)
    row = 7168 * 2
    assert c["attn_tp/all_reduce"] == {"calls": 63, "bytes": 63 * 2 * row}
    assert c["attn_tp/gather"] == {"calls": 1, "bytes": 2 * 163840 // 2 * 2}
    hits = 8 * (1 - (7 / 8) ** 8)
    assert c["world/all_to_all"]["bytes"] == pytest.approx(60 * (8 * 8 + hits * (2 * row + 2 * 8 * 4)))
    assert c["attn_tp_split/all_gather"] == {"calls": 60, "bytes": 60 * row}
    assert c["attn_tp_split/reduce_scatter"] == {"calls": 60, "bytes": 60 * 2 * row}
    no_shared = step_comm("tp2xdp4_ep8", replace(KIMI_K2, num_shared_experts=0), batch=8)
    assert "attn_tp_split/reduce_scatter" not in no_shared and "attn_tp_split/all_gather" in no_shared


# ---------------------------------------------------------------------------------------------- project
def test_project_hand_worked_interconnect_on_pcie():
    p = project("ep8", RTX_PRO_6000_PCIE5, KIMI_K2_INT4, batch=1, context=2048)
    row = 7168 * 2
    ar = 24e-6 + row * 2 * 7 / 8 / 22e9
    gather = 24e-6 + 163840 // 8 * 2 * 7 / 22e9
    assert p.comm_s == pytest.approx(123 * ar + gather)
    assert p.step_s == pytest.approx(max(p.memory_s, p.compute_s) + p.comm_s)
    assert p.tok_s == pytest.approx(1 / p.step_s) and p.fits


def test_project_properties():
    tp8 = project("tp8", RTX_PRO_6000_PCIE5, KIMI_K2_INT4, 1, 2048)
    ep8 = project("ep8", RTX_PRO_6000_PCIE5, KIMI_K2_INT4, 1, 2048)
    assert tp8.comm_s == pytest.approx(ep8.comm_s)  # same collectives with TP attention
    assert tp8.memory_s < ep8.memory_s              # EP8's busiest rank holds ~2.6 of the 8 active experts
    full = project("tp8", RTX_PRO_6000_PCIE5, KIMI_K2_INT4, 1, 2048, overlap="full")
    assert full.step_s == pytest.approx(max(tp8.memory_s, tp8.comm_s))
    slow = project("tp8", RTX_PRO_6000_PCIE5, KIMI_K2_INT4, 1, 2048, host_overhead_s=0.03)
    assert slow.step_s == pytest.approx(tp8.step_s + 0.03) and slow.bound == "host/launch"
    spec = project("tp8", RTX_PRO_6000_PCIE5, KIMI_K2_INT4, 4, 2048, tokens_per_seq=8, tau=3.0)
    assert spec.tok_s == pytest.approx(12 / spec.step_s) and spec.tok_s_per_user == pytest.approx(3 / spec.step_s)
    measured = {"attn_tp/all_reduce": 63.0, "world/all_reduce": 60.0, "attn_tp/gather": 1.0}
    assert project("tp8", RTX_PRO_6000_PCIE5, KIMI_K2_INT4, 1, 2048, measured).step_s == pytest.approx(tp8.step_s)
    assert project("tp8", RTX_PRO_6000_PCIE5, KIMI_K2, 1, 2048).memory_s > tp8.memory_s  # bf16 experts
    huge = replace(KIMI_K2, name="bf16 on 96 GB")
    assert not project("ep8", RTX_PRO_6000_PCIE5, huge, 1, 2048).fits  # 2 TB of bf16 does not fit in 768 GB
    with pytest.raises(ValueError, match="overlap"):
        project("tp8", LINK, KIMI_K2, 1, 1, overlap="some")


def test_matrix_and_tables():
    ps = project_matrix(batches=(1, 64), context=1024)
    assert len(ps) == len(HARDWARE) * len(LAYOUTS) * 2
    assert all(p.step_s > 0 and math.isfinite(p.tok_s) for p in ps)
    table = projection_table(ps)
    assert table.count("\n") == len(ps) + 1 and "8x B300 NVLink5" in table
    for hw in HARDWARE.values():
        t = hardware_table(hw)
        assert all(r["source"] for r in hw.parameters()), hw.name  # every parameter has a source
        assert "bus_bw" in t


def test_validation_rows_and_docs_in_sync():
    rows = validate()
    named = [r for r in rows if r["ratio"] is not None]
    assert len(named) == 8  # 6 published figures + 2 EP8/TP8 ratios
    for r in named:
        assert r["ratio"] == pytest.approx(r["projected_tok_s"] / r["published_tok_s"])
        assert r["error_pct"] == pytest.approx(100 * (r["ratio"] - 1))
        assert r["floor_tok_s"] >= r["projected_tok_s"] or r["layout"] == "ep8/tp8"  # calibration only slows
    spec = rows[-1]
    assert spec["tau_needed_calibrated"] > spec["tau_needed_floor"] > 0 and spec["tau_for_2_15x_floor"] > 1
    doc = (REPO / "docs" / "cost_model.md").read_text()
    assert validation_table(rows) in doc, "docs/cost_model.md's validation table is stale: python -m bench.cost.tables"
    assert memory_table() in doc, "docs/cost_model.md's memory table is stale: python -m bench.cost.tables"


# ------------------------------------------------------------------------------- measured efficiencies
def test_efficiency_file_entries_name_hardware_and_source(tmp_path):
    eff = load_efficiency()
    hw = eff.data["hardware"]
    assert (hw["name"], hw["sms"], hw["power_limit_w"], hw["copy_gb_s"]) == ("NVIDIA H200", 132, 700, 4264)
    assert eff.data["project_commit"] == "1cb31f7" and "docs/records/gpu_first_run.md" in eff.data["source"]
    for section in ("attention", "moe", "decode_step", "dense_gemm", "power"):
        for row in eff.data[section]["rows"]:
            assert row["hardware"] == "H200" and row["source"] == "docs/records/gpu_first_run.md", (section, row)
    assert {r["tokens"] for r in eff.data["moe"]["rows"]} == {64, 256, 1024, 4096}
    assert {r["batch"] for r in eff.data["decode_step"]["rows"] if r["graphs"]} == {1, 8, 32, 64}
    bad = json.loads(EFFICIENCY_FILE.read_text())
    del bad["moe"]["rows"][0]["source"]
    (tmp_path / "e.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="no hardware or source"):
        load_efficiency(tmp_path / "e.json")


def test_efficiency_rules_by_hand():
    assert interp_log2([(8, 0.35), (64, 0.38)], 16) == pytest.approx(0.36)  # log2 16 is 1/3 of the way
    assert interp_log2([(8, 0.35), (64, 0.38)], 1) == 0.35 and interp_log2([(8, 0.35), (64, 0.38)], 512) == 0.38
    eff = load_efficiency()
    assert eff.attention(8, 1) == 0.35 and eff.attention(8, 16) == pytest.approx(0.36)  # TP8: 8 local heads
    assert eff.attention(64, 64) == 0.17 and eff.attention(16, 8) == pytest.approx(0.115)
    assert eff.attention(32, 8) == pytest.approx(0.115)  # tie between 16 and 64 heads: the lower
    assert eff.attention(64, 64, mla=False) == 0.65
    assert eff.moe(1) == 0.84 and eff.moe(512) == pytest.approx(0.80) and eff.moe(10**5) == 0.47
    assert eff.copy_fraction == pytest.approx(4264 / 4800)
    for r in eff.step_residuals:  # this file's bytes accounting recomputes the measured floors
        assert r["floor_ms"] == pytest.approx(r["measured_floor_ms"], rel=0.02)
    assert [round(r["fraction"], 2) for r in eff.step_residuals] == [0.19, 0.23, 0.15, 0.12]
    assert eff.dense(1) == pytest.approx(0.193, abs=1e-3) and eff.dense(4) == pytest.approx(0.220, abs=1e-3)
    assert KernelEfficiency(eff.data, "kernel").dense(64) == pytest.approx(0.83, abs=0.005)
    with pytest.raises(ValueError, match="dense_rule"):
        KernelEfficiency(eff.data, "fitted")


def test_calibrated_projection_uses_the_file(tmp_path):
    eff = load_efficiency()
    ideal = project("tp8", B300_NVLINK5, KIMI_K2_INT4, 1, 2048)
    cal = project("tp8", B300_NVLINK5, KIMI_K2_INT4, 1, 2048, efficiency=eff)
    assert cal.floor_step_s == pytest.approx(ideal.step_s) and ideal.floor_step_s == pytest.approx(ideal.step_s)
    b = step_bytes("tp8", KIMI_K2_INT4, 1, 2048)
    frac = dict.fromkeys(b, eff.dense(1)) | {"kv_cache": 0.35, "routed_experts": 0.84}
    assert cal.fractions == pytest.approx(frac)
    memory = sum(v / (frac[k] * 4264 / 4800 * 8.0e12) for k, v in b.items())
    assert cal.step_s == pytest.approx(memory + cal.comm_s)
    assert cal.calibration.startswith("NVIDIA H200") and ideal.calibration == "ideal floors"
    changed = json.loads(EFFICIENCY_FILE.read_text())  # a slower measured decode step: a slower dense class
    for row in changed["decode_step"]["rows"]:
        row["step_ms"] *= 2
    (tmp_path / "e.json").write_text(json.dumps(changed))
    slower = project("tp8", B300_NVLINK5, KIMI_K2_INT4, 1, 2048, efficiency=load_efficiency(tmp_path / "e.json"))
    assert slower.step_s > cal.step_s and slower.floor_step_s == pytest.approx(cal.floor_step_s)
    kern = project("tp8", B300_NVLINK5, KIMI_K2_INT4, 1, 2048, efficiency=KernelEfficiency(eff.data, "kernel"))
    for row in changed["moe"]["rows"]:  # half the MoE fraction, kernels-only rule: exactly the MoE part doubles
        row["fraction"] /= 2
    half = project("tp8", B300_NVLINK5, KIMI_K2_INT4, 1, 2048, efficiency=KernelEfficiency(changed, "kernel"))
    assert half.step_s - kern.step_s == pytest.approx(b["routed_experts"] / (0.84 * 4264 / 4800 * 8.0e12))


# ------------------------------------------------------------------------------------- memory per rank
def test_int4_weights_per_rank_by_hand():
    """EP8, Kimi K2.6 INT4: 48 whole experts per MoE layer at 4 bits + a bf16 scale per 32 weights; attention,
    dense MLP, shared expert, embedding and LM head bf16 split over attention TP8; the fp32 router whole."""
    experts = 60 * 48 * 3 * 7168 * 2048 * (0.5 + 2 / 32)                # 71.345 GB
    attention = 61 * ((7168 * 1536 + 7168 * 576)                      # q_a, kv_a (replicated)
                      + (1536 * 64 * 192 + 512 * 64 * 256 + 64 * 128 * 7168) / 8) * 2  # q_b, kv_b, o / TP8
    dense = 3 * 7168 * 18432 / 8 * 2
    shared = 60 * 3 * 7168 * 2048 / 8 * 2
    router = 60 * 384 * 7168 * 4
    vocab = 2 * 163840 / 8 * 7168 * 2
    total = experts + attention + dense + shared + router + vocab
    assert experts == pytest.approx(71_345_111_040) and attention == pytest.approx(3_158_179_840)
    m = memory_fit("ep8", H200_NVLINK4, KIMI_K2_INT4, 0.9)
    assert m["weights"] == pytest.approx(total) and total == pytest.approx(76.51e9, rel=1e-3)
    assert memory_fit("tp8", H200_NVLINK4, KIMI_K2_INT4)["weights"] == pytest.approx(total)  # 1/8 of every expert


def test_fit_decision_and_kv_tokens():
    m = memory_fit("ep8", H200_NVLINK4, KIMI_K2_INT4, 0.9)
    per_token = 61 * (512 + 64) * 2  # MLA latent + rope key, bf16, every layer, replicated over attention TP
    assert m["fits"] and m["kv_room"] == pytest.approx(0.9 * 141e9 - m["weights"])
    assert m["kv_tokens_rank"] == int(m["kv_room"] // per_token) and m["kv_tokens_box"] == m["kv_tokens_rank"]
    dp = memory_fit("dp8_ep8", H200_NVLINK4, KIMI_K2_INT4, 0.9)
    assert dp["weights"] > m["weights"] and dp["kv_tokens_box"] == 8 * dp["kv_tokens_rank"]
    bf16 = memory_fit("ep8", H200_NVLINK4, KIMI_K2, 0.9)  # bf16 experts: ~2 TB over 8 ranks
    assert not bf16["fits"] and bf16["kv_room"] == 0 and bf16["kv_tokens_rank"] == 0
    assert memory_fit("ep8", B300_NVLINK5, KIMI_K2, 0.85)["fits"] is False  # 257 GB > 0.85 x 288 GB
    assert memory_fit("ep8", H200_NVLINK4, KIMI_K2_INT4, 0.5)["fits"] is False  # 76.5 GB > 70.5 GB
    table = memory_table()
    assert table.count("\n") == 2 * len(LAYOUTS) + 1 and "| 8x H200 NVLink4 | tp8 | 76.5 | yes |" in table


# --------------------------------------------------------------------------------------------- topology
def test_nccl_env_mapping():
    assert nccl_env("auto") == {}
    assert nccl_env("pcie") == {"NCCL_P2P_DISABLE": "1", "NCCL_NVLS_ENABLE": "0", "NCCL_SHM_DISABLE": "0"}
    assert nccl_env("nvlink") == {"NCCL_P2P_DISABLE": "0", "NCCL_SHM_DISABLE": "0"}
    assert "NCCL_P2P_LEVEL" not in nccl_env("pcie")  # a distance cutoff: NVLink pairs would still use P2P
    with pytest.raises(TopologyError, match="topology.mode must be one of"):
        nccl_env("infiniband")


def test_topology_conf_files():
    for mode in ("auto", "nvlink", "pcie"):
        assert TopologyConfig(**yaml.safe_load((REPO / "conf" / "topology" / f"{mode}.yaml").read_text())).mode == mode


def test_cpu_fallback():
    links = detect_links()  # this box: no GPU (or no NVML library)
    if links["kind"] != "none":
        pytest.skip("GPUs present")
    assert links["backend"] == "gloo" and links["reason"].startswith(CPU_FALLBACK)
    for mode in ("auto", "nvlink", "pcie"):
        p = plan(mode, links)
        assert p["effective"] == CPU_FALLBACK and p["env"] == {}


class NVMLError(Exception):
    pass


class FakeBox:
    """NVML of a box with ``n`` GPUs; NVLink P2P between all of them when ``nvlink``."""

    NVML_P2P_CAPS_INDEX_READ, NVML_P2P_CAPS_INDEX_NVLINK, NVML_NVLINK_MAX_LINKS = 0, 2, 18

    def __init__(self, n, nvlink):
        self.n, self.nvlink = n, nvlink

    def nvmlInit(self):
        pass

    def nvmlShutdown(self):
        pass

    def nvmlDeviceGetCount(self):
        return self.n

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetName(self, h):
        return b"NVIDIA H200" if self.nvlink else "NVIDIA RTX PRO 6000"

    def nvmlDeviceGetNvLinkState(self, h, link):
        if not self.nvlink:
            raise NVMLError("Not Supported")
        if link >= 18:
            raise NVMLError("Invalid Argument")
        return 1

    def nvmlDeviceGetCurrPcieLinkGeneration(self, h):
        return 5

    def nvmlDeviceGetCurrPcieLinkWidth(self, h):
        return 16

    def nvmlDeviceGetP2PStatus(self, a, b, index):
        if index == self.NVML_P2P_CAPS_INDEX_NVLINK:
            return 0 if self.nvlink else 5
        return 0

    def nvmlDeviceGetTopologyCommonAncestor(self, a, b):
        return 50 if (a < self.n // 2) != (b < self.n // 2) else 40


def test_detect_links_on_fake_boxes():
    nv = detect_links(FakeBox(4, nvlink=True))
    assert nv["kind"] == "nvlink" and nv["backend"] == "nccl" and len(nv["pairs"]) == 6
    assert nv["gpus"][0] == {"index": 0, "name": "NVIDIA H200", "nvlink_active": 18, "pcie_gen": 5, "pcie_width": 16}
    assert nv["pairs"][0]["p2p_nvlink"] == "ok" and nv["pairs"][-1]["common_ancestor"] == "NODE (same NUMA node)"
    pcie = detect_links(FakeBox(4, nvlink=False))
    assert pcie["kind"] == "pcie" and pcie["gpus"][0]["nvlink_active"] == 0
    assert pcie["pairs"][1] == {"a": 0, "b": 2, "p2p_read": "ok", "p2p_nvlink": "not supported",
                                "common_ancestor": "SYS (across CPU sockets)"}
    assert any("nvlink state" in e for e in pcie["errors"])
    assert detect_links(FakeBox(1, nvlink=False))["kind"] == "single_gpu"
    broken = SimpleNamespace(nvmlInit=lambda: (_ for _ in ()).throw(NVMLError("Driver Not Loaded")))
    assert detect_links(broken)["reason"] == f"{CPU_FALLBACK} (NVML unavailable: NVMLError: Driver Not Loaded)"


def test_plans_on_fake_boxes():
    nvl, pcie = detect_links(FakeBox(8, True)), detect_links(FakeBox(8, False))
    forced = plan("pcie", nvl)
    assert forced["effective"].startswith("pcie (emulated") and forced["env"]["NCCL_P2P_DISABLE"] == "1"
    assert plan("auto", nvl)["env"] == {} and plan("auto", pcie)["effective"] == "pcie"
    assert plan("pcie", pcie)["effective"] == "pcie"
    with pytest.raises(TopologyError, match="this box has pcie links"):
        plan("nvlink", pcie)
    env = {"NCCL_P2P_DISABLE": "0", "PATH": "/bin"}
    assert apply_env(forced, env) == nccl_env("pcie") and env["NCCL_P2P_DISABLE"] == "1" and env["PATH"] == "/bin"
    check_dispatcher(plan("nvlink", nvl), "deepep", needs_nvlink=True)
    check_dispatcher(forced, "alltoall", needs_nvlink=False)
    with pytest.raises(TopologyError, match="needs NVLink"):
        check_dispatcher(forced, "deepep", needs_nvlink=True)


def test_prepare_sets_the_env_and_refuses_deepep_off_nvlink():
    """What every script runs before its ranks start: the plan, NCCL's switches, the dispatcher check."""
    from parallelism.layout import Layout
    from parallelism.topology import prepare

    nvl = detect_links(FakeBox(8, True))
    env = {"PATH": "/bin"}
    got = prepare("pcie", Layout(world_size=8, attn_tp=8, moe_ep=8), nvl, env)
    assert env == {"PATH": "/bin", **nccl_env("pcie")} and got["env"] == nccl_env("pcie")
    assert got["effective"].startswith("pcie (emulated") and got["links"] == "8 GPUs with NVLink P2P"
    assert got["gpus"] == ["NVIDIA H200"] * 8 and profile_for_gpu(got["gpus"][0]) is H200_NVLINK4
    assert profile_for_gpu("NVIDIA RTX PRO 6000 Blackwell Server Edition") is RTX_PRO_6000_PCIE5
    assert profile_for_gpu("NVIDIA A100-SXM4-80GB") is None and profile_for_gpu(None) is None
    assert profile_for_gpu("NVIDIA H200 NVL") is None and profile_for_gpu("NVIDIA GB300") is None
    deepep = Layout(world_size=8, attn_dp=8, moe_ep=8, dispatcher="deepep")
    with pytest.raises(TopologyError, match="'deepep' needs NVLink"):
        prepare("pcie", deepep, nvl, {})
    assert prepare("nvlink", deepep, nvl, {})["env"] == nccl_env("nvlink")
    cpu = {"kind": "none", "backend": "gloo", "reason": CPU_FALLBACK, "gpus": [], "pairs": [], "errors": []}
    env = {}
    assert prepare("pcie", deepep, cpu, env)["effective"] == CPU_FALLBACK and env == {}  # DeepEP says why itself
    pcie = detect_links(FakeBox(8, False))
    with pytest.raises(TopologyError, match="this box has pcie links"):
        prepare("nvlink", deepep, pcie, {})
    gloo = prepare("nvlink", deepep, pcie, env, backend="gloo")  # a device=cpu job on a GPU host: no NCCL at all
    assert (gloo["effective"], gloo["env"], env) == ("gloo: NCCL unused", {}, {})



def test_balancedness_loads_the_busiest_ep_rank():
    """Balancedness b (mean ÷ max tokens per EP rank): the busiest rank's routed-expert FLOPs and all-to-all rows
    are 1/b times uniform routing's; everything else, and the allreduce dispatcher's bytes, stay."""
    even, skewed = (step_flops("dp8_ep8", KIMI_K2, 64, 1024, balancedness=b) for b in (1.0, 0.5))
    assert skewed["routed_experts"] == pytest.approx(2 * even["routed_experts"])
    assert {k: v for k, v in skewed.items() if k != "routed_experts"} == {
        k: v for k, v in even.items() if k != "routed_experts"}
    a2a = [step_comm("dp8_ep8", KIMI_K2, 64, balancedness=b)["world/all_to_all"]["bytes"] for b in (1.0, 0.5)]
    assert 1.9 * a2a[0] < a2a[1] < 2 * a2a[0]  # the counts do not grow
    assert step_comm("ep8", KIMI_K2, 64, balancedness=0.5) == step_comm("ep8", KIMI_K2, 64)
    assert project("dp8_ep8", RTX_PRO_6000_PCIE5, KIMI_K2_INT4, 1024, 4096, balancedness=0.7).tok_s < project(
        "dp8_ep8", RTX_PRO_6000_PCIE5, KIMI_K2_INT4, 1024, 4096).tok_s
    with pytest.raises(ValueError, match=r"in \(0, 1\]"):
        step_flops("ep8", KIMI_K2, 8, 1024, balancedness=1.5)
