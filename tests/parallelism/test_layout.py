"""Layout algebra without processes: validation, rank math, placement, hydra presets."""

import pytest

from parallelism.layout import ExpertPlacement, Layout, LayoutError, divide
from tests.support.layouts import PRESETS, layout


def test_presets_compose():
    got = {p: layout(p) for p in PRESETS}
    assert got["single"].world_size == 1
    assert (got["tp8"].attn_tp, got["tp8"].moe_tp, got["tp8"].resolved_dispatcher) == (8, 8, "allreduce")
    assert (got["ep8"].attn_tp, got["ep8"].moe_ep, got["ep8"].resolved_dispatcher) == (8, 8, "allreduce")
    assert (got["dp8_ep8"].attn_dp, got["dp8_ep8"].moe_ep, got["dp8_ep8"].resolved_dispatcher) == (8, 8, "alltoall")
    assert (got["tp2_ep4"].moe_tp, got["tp2_ep4"].moe_ep) == (2, 4)
    assert (got["tp4_ep2"].moe_tp, got["tp4_ep2"].moe_ep) == (4, 2)
    mixed = got["tp2xdp4_ep8"]
    assert (mixed.attn_tp, mixed.attn_dp, mixed.moe_ep, mixed.resolved_dispatcher) == (2, 4, 8, "alltoall")
    assert mixed.describe() == "attn tp2xdp4, moe ep8 (alltoall)"


def test_override_to_smaller_world():
    assert layout("dp8_ep8", "world_size=4", "attn_dp=4", "moe_ep=4") == Layout(world_size=4, attn_dp=4, moe_ep=4)


@pytest.mark.parametrize("kw, words", [
    (dict(world_size=8, attn_tp=4, attn_dp=1, moe_ep=8), "attn_tp*attn_dp must equal world_size"),
    (dict(world_size=8, attn_tp=8, moe_tp=2, moe_ep=2), "moe_tp*moe_ep must equal world_size"),
    (dict(world_size=8, attn_dp=8, moe_ep=8, dispatcher="allreduce"), "'allreduce' needs tokens replicated"),
    (dict(world_size=8, attn_tp=2, attn_dp=4, moe_ep=8, dispatcher="allreduce"), "'allreduce' needs tokens repl"),
    (dict(world_size=8, attn_tp=8, moe_ep=8, dispatcher="nccl"), "parallel.dispatcher must be one of"),
    (dict(world_size=8, attn_tp=8, moe_ep=8, placement="random"), "parallel.placement must be one of"),
    (dict(world_size=0), "parallel.world_size must be >= 1"),
])
def test_invalid_layouts_name_the_constraint(kw, words):
    with pytest.raises(LayoutError, match=words.replace("*", r"\*").replace("(", r"\(")):
        Layout(**kw)


def test_every_preset_takes_the_deepep_knobs_and_the_backend_follows_the_device():
    from parallelism.launch import backend_for

    for preset in PRESETS:  # plain overrides (no "+"): every preset carries the keys
        lay = layout(preset, "deepep_low_latency=false", "deepep_max_decode_tokens=64")
        assert (lay.deepep_low_latency, lay.deepep_max_decode_tokens) == (False, 64), preset
    assert (backend_for("cuda"), backend_for("cpu")) == ("nccl", "gloo")


def test_hydra_override_rejected_at_config_time():
    with pytest.raises(LayoutError, match="moe_tp\\*moe_ep must equal world_size"):
        layout("tp8", "moe_ep=2")


def test_coords_hand_worked():
    lay = Layout(world_size=8, attn_tp=8, moe_tp=2, moe_ep=4)
    c = lay.coords(5)
    assert (c.attn_tp_rank, c.attn_dp_rank, c.moe_tp_rank, c.moe_ep_rank) == (5, 0, 1, 2)
    lay = Layout(world_size=8, attn_dp=8, moe_ep=8)
    c = lay.coords(3)
    assert (c.attn_tp_rank, c.attn_dp_rank, c.moe_tp_rank, c.moe_ep_rank) == (0, 3, 0, 3)
    with pytest.raises(LayoutError):
        lay.coords(8)


def test_groups_partition_world_and_match_coords():
    lay = Layout(world_size=8, attn_tp=8, moe_tp=2, moe_ep=4)
    g = lay.groups()
    assert g["moe_tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g["moe_ep"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert g["attn_tp"] == [list(range(8))] and g["attn_dp"] == [[r] for r in range(8)]
    for kind, lists in g.items():
        assert sorted(r for ranks in lists for r in ranks) == list(range(8)), kind
    for rank in range(8):
        c = lay.coords(rank)
        assert g["moe_tp"][c.moe_ep_rank][c.moe_tp_rank] == rank
        assert g["moe_ep"][c.moe_tp_rank][c.moe_ep_rank] == rank


def test_placement_linear_and_round_robin():
    lin = ExpertPlacement(num_experts=16, moe_ep=4, moe_tp=2, kind="linear")
    assert lin.local_experts(1) == [4, 5, 6, 7]
    assert lin.ranks_of_slot(lin.replicas(5)[0]) == [2, 3]
    rr = ExpertPlacement(num_experts=16, moe_ep=4, moe_tp=2, kind="round_robin")
    assert rr.local_experts(1) == [1, 5, 9, 13]
    assert [rr.replicas(e) for e in (1, 5, 9, 13)] == [[4], [5], [6], [7]]  # EP rank 1's local slots 0..3
    assert rr.ranks_of_slot(rr.replicas(6)[0]) == [4, 5]


def test_placement_with_replicas_and_its_errors():
    p = ExpertPlacement(num_experts=4, moe_ep=2, moe_tp=1, slots=(0, 1, 2, 3, 0, 3))  # 3 slots per rank
    assert (p.num_slots, p.slots_per_rank) == (6, 3)
    assert p.local_experts(0) == [0, 1, 2] and p.local_experts(1) == [3, 0, 3]
    assert p.replicas(0) == [0, 4] and p.replicas(3) == [3, 5] and p.ranks_of_slot(4) == [1]
    with pytest.raises(LayoutError, match=r"leaves experts \[2\] without a slot"):
        ExpertPlacement(num_experts=4, moe_ep=2, moe_tp=1, slots=(0, 1, 3, 3))
    with pytest.raises(LayoutError, match=r"names experts \[4\] outside 0..3"):
        ExpertPlacement(num_experts=4, moe_ep=2, moe_tp=1, slots=(0, 1, 2, 3, 4, 0))
    with pytest.raises(LayoutError, match="5 is not divisible by 2"):
        ExpertPlacement(num_experts=4, moe_ep=2, moe_tp=1, slots=(0, 1, 2, 3, 0))
    lay = Layout(world_size=2, attn_tp=2, moe_ep=2, expert_slots=((0, 1, 2, 3, 0, 3), (3, 2, 1, 0, 1, 2)))
    assert lay.expert_placement(4, 1).local_experts(0) == [3, 2, 1] and "eplb 6 slots" in lay.describe()
    with pytest.raises(LayoutError, match="the expert placement has 2 MoE layers"):
        lay.expert_placement(4, 2)
    with pytest.raises(LayoutError, match="one count divisible by moe_ep=2"):
        Layout(world_size=2, attn_tp=2, moe_ep=2, expert_slots=((0, 1, 2, 3), (0, 1, 2, 3, 0, 1)))


def test_divide():
    assert divide(12, 4) == 3
    with pytest.raises(LayoutError, match="heads: 12 is not divisible by 5"):
        divide(12, 5, "heads")
