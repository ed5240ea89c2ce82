"""One rank's runner on its own (one rank, the tiny DeepSeek checkpoint): a plan's work runs and samples, a prompt
prefilled in chunks leaves the same KV bytes and next token as in one step, a fork's block copy covers the cache,
and a step waits for the KV loads its plan names before it reads their blocks."""

import torch

from engine.params import SamplingParams
from engine.step import NewRequest, StepItem, StepPlan
from engine.worker.kv_loads import HostKV
from engine.worker.runner import ModelRunner
from model.loader import load_model
from parallelism.comm import build_groups
from tests.support.layouts import layout

GREEDY = SamplingParams(temperature=0.0, max_tokens=4)
PROMPT = [5, 9, 13, 2, 7, 11, 3, 8, 6, 4]
BS = 4


def runner_for(path) -> ModelRunner:
    return ModelRunner(load_model(path, build_groups(layout("single"))), num_blocks=16, kv_block_size=BS)


def prefill(runner: ModelRunner, rid: str, blocks: tuple[int, ...], chunks: list[int], step0: int = 0) -> int:
    """Feeds PROMPT to ``rid`` in chunks of the given sizes; returns the sampled token."""
    added, start, out = (NewRequest(request_id=rid, dp_rank=0, prompt=tuple(PROMPT), output=(), params=GREEDY,
                                    seed=0),), 0, None
    for i, n in enumerate(chunks):
        last = start + n == len(PROMPT)
        work = [StepItem(request_id=rid, token_ids=PROMPT[start:start + n], start=start, sample=last,
                         num_generated=0, decode=False)]
        plan = StepPlan(step0 + i, [work], added=added if i == 0 else (), blocks={rid: blocks} if i == 0 else {})
        out = runner.finish(runner.launch_plan(plan))
        start += n
    return out.results[rid].tokens[0]


def test_chunked_and_whole_prefills_leave_the_same_kv_and_token(tiny_ckpts):
    runner = runner_for(tiny_ckpts["tiny_deepseek"])
    whole = prefill(runner, "whole", (0, 1, 2), [len(PROMPT)])
    chunked = prefill(runner, "chunked", (3, 4, 5), [4, 3, 3], step0=1)
    assert whole == chunked
    cache = runner.cache
    for a, b in ((0, 3), (1, 4)):  # full blocks; the last is partial (its tail is never read)
        assert torch.allclose(cache.read_blocks([a]).view(torch.float32), cache.read_blocks([b]).view(torch.float32),
                              atol=1e-5)


def test_a_fork_copy_and_a_named_load_land_before_the_step(tiny_ckpts):
    runner = runner_for(tiny_ckpts["tiny_deepseek"])
    prefill(runner, "a", (0, 1, 2), [len(PROMPT)])
    cache = runner.cache
    runner.launch_plan(StepPlan(1, [[]], copies=((0, 2, 7),)))  # a fork's partial block, every group
    assert cache.checksum(7) == cache.checksum(2)
    source = HostKV({0: cache.read_blocks([0, 1])}, 2 * BS)
    runner.loads.start(5, [9, 10], [0, 1], source)
    runner.launch_plan(StepPlan(2, [[]], loads=(5,)))  # waits for load 5 first
    assert runner.loads.done(5) and [cache.checksum(b) for b in (9, 10)] == [cache.checksum(b) for b in (0, 1)]
