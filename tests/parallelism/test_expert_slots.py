"""The ``eplb`` group's starting placement (``parallelism/expert_slots.py``): from nothing, a recorded load or a
placement file, and an error naming the key for each way it cannot fit."""

import json

import pytest
import torch

from parallelism.eplb import EPLBError, balancedness
from parallelism.expert_slots import EPLBConfig, initial_expert_slots, nodes


def test_nothing_asked_keeps_one_slot_per_expert():
    assert initial_expert_slots(EPLBConfig(), 3, 16, 8) is None


def test_a_recorded_load_is_rebalanced_with_the_redundant_slots(tmp_path):
    load = [[100.0] + [1.0] * 15, [1.0] * 15 + [100.0]]  # one hot expert per layer
    path = tmp_path / "load.json"
    path.write_text(json.dumps({"load": load}))
    slots = initial_expert_slots(EPLBConfig(str(path), redundant_experts=8), 2, 16, 8)
    assert [len(row) for row in slots] == [24, 24]
    assert slots[0].count(0) > 1 and slots[1].count(15) > 1  # the hot expert replicated, per layer
    load, linear = torch.tensor(load), torch.arange(16).repeat(2, 1)
    assert (balancedness(load, torch.tensor(slots), 8) > balancedness(load, linear, 8)).all()


def test_a_placement_file_is_taken_as_written(tmp_path):
    rows = [[(s * 5) % 16 for s in range(16)], list(range(16))]
    path = tmp_path / "placement.json"
    path.write_text(json.dumps({"phy2log": rows}))
    assert initial_expert_slots(EPLBConfig(str(path)), 2, 16, 8) == tuple(tuple(r) for r in rows)


@pytest.mark.parametrize("content, redundant, message", [
    ({"phy2log": [list(range(16))] * 2}, 8, r"holds \[16\] slots per layer; 16 experts \+ eplb.redundant_experts=8 "
                                            "make 24"),
    ({"load": [[1.0] * 16] * 3}, 0, "has 3 MoE layers; the model has 2"),
    ({"load": [[1.0] * 15] * 2}, 0, r"'load' must be \[MoE layers, 16 experts\], got \[2, 15\]"),
    ({"slots": []}, 0, r"holds neither 'phy2log' nor 'load' \(keys: \['slots'\]\)"),
    (None, 12, "eplb.redundant_experts=12 must be a non-negative multiple of parallel.moe_ep=8"),
])
def test_what_does_not_fit_is_named(tmp_path, content, redundant, message):
    path = None
    if content is not None:
        path = tmp_path / "placement.json"
        path.write_text(json.dumps(content))
    with pytest.raises(EPLBError, match=message):
        initial_expert_slots(EPLBConfig(path and str(path), redundant_experts=redundant), 2, 16, 8)


def test_an_unreadable_file_is_named(tmp_path):
    with pytest.raises(EPLBError, match="cannot be read"):
        initial_expert_slots(EPLBConfig(str(tmp_path / "absent.json")), 2, 16, 8)


def test_two_nodes_keep_each_expert_groups_replicas_on_one_node():
    """16 experts in 4 groups, 8 EP ranks over 2 nodes, one redundant slot per rank: every slot of a group's experts
    sits on the ranks of one node (ranks 0-3 or 4-7)."""
    slots = initial_expert_slots(EPLBConfig(redundant_experts=8, num_nodes=2), 1, 16, 8, num_groups=4)[0]
    per_rank = len(slots) // 8
    node_of_group = {}
    for slot, expert in enumerate(slots):
        node = (slot // per_rank) // 4
        assert node_of_group.setdefault(expert // 4, node) == node, (expert, slot)
    assert sorted(set(node_of_group.values())) == [0, 1]


def test_the_node_count_comes_from_the_setting_or_torchrun():
    assert nodes(2, {}) == 2
    assert nodes(None, {"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}) == 2
    assert nodes(None, {}) == 1
    with pytest.raises(EPLBError, match="eplb.num_nodes must be >= 1, got 0"):
        nodes(0, {})
