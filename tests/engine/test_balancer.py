"""Rank 0's expert balancer (``engine/balancer.py``) on a one-rank engine over the tiny DeepSeek checkpoint (2 MoE
layers, 16 experts, top-4): when it has work, the window it reads (tokens x top-k per layer, reset after the read),
its figures, and a rebalance on one EP rank, where every placement is already balanced, so every layer is kept.
Moves (``MoveExperts``, ``SwapExperts``) need EP ranks to move weights between: ``tests/e2e/test_expert_placement.py``
runs them."""

from __future__ import annotations

import pytest
import torch

from engine.balancer import ExpertBalancer
from engine.config import BalancerConfig, EngineConfig
from engine.engine import Engine
from engine.params import SamplingParams
from model.loader import load_model
from parallelism.comm import build_groups
from tests.support.layouts import layout

CFG = BalancerConfig(eplb_enabled=True, eplb_window_steps=2, eplb_interval_steps=4)


@pytest.fixture(scope="module")
def model(tiny_ckpts):
    return load_model(tiny_ckpts["tiny_deepseek"], build_groups(layout("single")))


def counting_engine(model) -> Engine:
    """An engine that counts expert load (``engine.expert_load``) with no balancer of its own: the test drives one."""
    return Engine(model, EngineConfig.flat(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, block_size=4,
                                           num_blocks=32, expert_load=True))


def test_due_follows_the_window_and_interval_and_an_operators_request(model):
    eng = counting_engine(model)
    bal = ExpertBalancer(eng.control, eng.rank, CFG)
    assert [bal.due(s) for s in range(5)] == [False, False, True, True, True]
    bal.last_read = 2  # a window was read before step 2: the next is due at 4, the rebalance too
    assert [bal.due(s) for s in range(2, 5)] == [False, False, True]
    bal.request_rebalance()
    assert bal.due(2)
    assert bal.versions == (0, 0) and bal.figures() == {"balancedness": None, "rebalances": 0, "moved_bytes": 0,
                                                        "move_seconds": 0.0}
    assert bal.run_figures() == {"eplb_rebalances": 0, "eplb_balancedness": [None, None]}


def test_a_window_counts_every_routed_choice_and_a_rebalance_on_one_rank_keeps_every_layer(model):
    eng = counting_engine(model)
    bal = ExpertBalancer(eng.control, eng.rank, CFG)
    assert model.cfg.moe.top_k == 4 and bal.maps.placements().shape == (2, 16)
    eng.add_request("a", list(range(5, 18)), SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    eng.step()  # the 13-token prefill
    eng.step()  # one decode
    bal.before_step(2)
    assert bal.window.shape == (2, 16) and bal.window.sum(1).tolist() == [56.0, 56.0]  # (13 + 1) tokens x 4
    (window,) = bal.stats.windows
    # one EP rank holds every expert: balanced, and its routed choices per step are all of them over 2 steps
    assert window == {"step": 2, "balancedness": [1.0, 1.0], "at_start_placement": [1.0, 1.0],
                      "max_rank_tokens_per_step": [28.0, 28.0]}
    eng.step()
    bal.before_step(3)  # not due: nothing read, the counts keep growing
    assert len(bal.stats.windows) == 1
    eng.step()
    bal.before_step(4)  # a window (2 decodes: 8 choices) and a rebalance, whose gain is 0 on each layer
    assert bal.window.sum(1).tolist() == [8.0, 8.0]
    assert bal.stats.windows[-1]["max_rank_tokens_per_step"] == [4.0, 4.0]
    assert (bal.stats.rebalances, bal.stats.layers_kept, bal.pending, bal.moving) == (1, 2, [], [])
    assert bal.versions == (0, 0) and torch.equal(bal.maps.placements(), bal.initial)
    assert bal.run_figures() == {"eplb_rebalances": 1, "eplb_balancedness": [1.0, 1.0]}
    assert bal.figures()["balancedness"] == [1.0, 1.0]


def test_an_operators_rebalance_with_no_new_counts_uses_the_last_window(model):
    eng = counting_engine(model)
    bal = ExpertBalancer(eng.control, eng.rank, CFG)
    eng.add_request("a", [3, 4, 5], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    eng.step()
    eng.step()
    bal.before_step(2)
    last = bal.window.clone()
    bal.request_rebalance()
    bal.before_step(3)  # no step since the read: the fresh counts are all zero, the last window stays
    assert torch.equal(bal.window, last) and bal.stats.rebalances == 1 and not bal.requested
