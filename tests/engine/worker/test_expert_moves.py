"""Expert moves on the ranks (``engine/worker/expert_moves.py``): which slot fills which, and the placement version
every step plan carries — a rank whose map was switched a step before the others refuses the step, naming the layer
and both versions. (Moves end to end, bit-exact, under ep8 / dp8_ep8 / tp2_ep4 and the quantized checkpoints:
``tests/e2e/test_expert_placement.py``.)"""

import pytest
import torch

from engine.step import StepPlan
from engine.worker.expert_moves import ExpertMaps, PlacementVersionError, slot_fills, slot_tensors, staging_bytes
from engine.worker.kv_budget import expert_slot_memory
from engine.worker.runner import ModelRunner
from model.loader import load_model
from parallelism.comm import build_groups
from parallelism.layout import Layout


def test_a_changed_slot_is_filled_from_its_own_rank_first_then_from_the_holders_in_turn():
    old = (0, 1, 2, 3, 0, 1)  # 2 ranks x 3 slots: rank 0 holds 0 1 2, rank 1 holds 3 0 1
    new = (1, 0, 2, 3, 3, 2)
    # slot 0 (rank 0) takes expert 1 from its own slot 1; slot 1 takes 0 from its own slot 0; slot 4 (rank 1) takes
    # 3 from its own slot 3; slot 5 takes 2 from rank 0's slot 2 (its only holder)
    assert slot_fills(old, new, 3) == [(0, 1), (1, 0), (4, 3), (5, 2)]
    assert slot_fills(old, old, 3) == []
    # no local copy: the holders of expert 0 (slots 0 and 4) taken in turn by the filled slot's index
    assert slot_fills((0, 1, 2, 0), (0, 1, 0, 0), 1) == [(2, (0, 3)[2 % 2])]


def test_a_rank_whose_map_moved_a_step_early_refuses_the_step(tiny_ckpts):
    model = load_model(tiny_ckpts["tiny_deepseek"], build_groups(Layout()))
    runner = ModelRunner(model, num_blocks=8, kv_block_size=16)
    layers = len(runner.expert_maps.versions)
    assert layers == 2
    runner.expert_maps.versions[1] = 1  # planted: this rank switched MoE layer 1 before the plan says
    with pytest.raises(PlacementVersionError, match="planned for expert placement version 0 of MoE layer 1, this "
                                                    "rank holds version 1"):
        runner.launch_plan(StepPlan(step_id=0, work=[[]], expert_versions=(0, 0)))
    runner.expert_maps.check(())  # a plan that does not track versions (the balancer off) is not checked
    runner.expert_maps.check((0, 1))


def test_a_move_rewrites_weights_and_tables_in_place_to_what_loading_the_new_placement_gives(tiny_ckpts):
    """One rank, 16 experts in 20 slots: MoE layer 0 moved to another placement holds, slot for slot, what a model
    loaded with that placement holds, its routing tables equal that model's, and no tensor moved in memory (a
    captured CUDA graph reads the new values on replay)."""
    ckpt = tiny_ckpts["tiny_deepseek"]
    first = (tuple(range(16)) + (0, 1, 2, 3), tuple(range(16)) + (4, 5, 6, 7))
    second = (tuple(range(15, -1, -1)) + (9, 9, 8, 0),) + first[1:]
    moved = load_model(ckpt, build_groups(Layout(expert_slots=first)))
    loaded = load_model(ckpt, build_groups(Layout(expert_slots=second)))
    maps, want = ExpertMaps(moved, moved.groups), ExpertMaps(loaded, loaded.groups)
    layer, target = maps.layers[0], want.layers[0]
    tables = ("local_slot", "holders", "slot_at_rank", "replica_count", "log2phy")
    addresses = [t.data_ptr() for t in slot_tensors(layer.experts)] + [
        getattr(layer.dispatcher, n).data_ptr() for n in tables]
    assert maps.move(0, second[0], version=1) == 0  # one rank: every fill is a local copy, nothing sent
    assert maps.versions == [1, 0]
    for got, ref in zip(slot_tensors(layer.experts), slot_tensors(target.experts), strict=True):
        assert torch.equal(got, ref)
    for name in tables:
        assert torch.equal(getattr(layer.dispatcher, name), getattr(target.dispatcher, name)), name
    assert layer.experts.global_ids == target.experts.global_ids
    assert addresses == [t.data_ptr() for t in slot_tensors(layer.experts)] + [
        getattr(layer.dispatcher, n).data_ptr() for n in tables]


def test_what_the_slots_and_a_move_cost_is_reported(tiny_ckpts):
    """A move stages at most one MoE layer's every local slot; the start-up line names slots, spares and bytes."""
    model = load_model(tiny_ckpts["tiny_deepseek"], build_groups(Layout(expert_slots=(tuple(range(16)) + (0, 1),) * 2)))
    per_layer = [sum(t.numel() * t.element_size() for t in slot_tensors(m.experts)) for m in ExpertMaps(
        model, model.groups).layers]
    assert staging_bytes(model) == max(per_layer) > 0
    line = expert_slot_memory(model)
    assert line.startswith("18 per rank per MoE layer (16 experts + 2 redundant over 1 EP ranks), ")
    assert f"{sum(per_layer) / 2**20:.1f} MiB" in line
