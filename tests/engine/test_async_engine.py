"""The async engine on its own (one rank, the tiny DeepSeek checkpoint, no server): a submitted request streams its
tokens and ends; a closed stream aborts its request and frees its blocks; a bad request, a reused id and one past
capacity are refused at submit; draining travels as a request and the snapshot sees it; stop shuts the engine."""

import asyncio

import pytest

from engine.api import SamplingParams
from engine.async_engine import AsyncEngine, Overloaded
from engine.config import EngineConfig, RequestError
from engine.engine import Engine
from model.loader import load_model
from parallelism.comm import build_groups
from tests.support.layouts import layout

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


async def drain(stream) -> list:
    outs = []
    while True:
        out = await asyncio.wait_for(stream.queue.get(), timeout=60)
        outs.append(out)
        if getattr(out, "finished", True):
            return outs


def test_streams_aborts_refusals_and_draining(tiny_ckpts):
    model = load_model(tiny_ckpts["tiny_deepseek"], build_groups(layout("single")))
    engine = Engine(model, EngineConfig.flat(max_num_seqs=2, max_model_len=64, num_blocks=32, block_size=4))
    front = AsyncEngine(engine, capacity=2, step_timeout_s=60, heartbeat_s=0.2)

    async def main():
        front.start(asyncio.get_running_loop())
        outs = await drain(await front.submit("a", [1, 2, 3], GREEDY))
        assert sum(len(o.new_tokens) for o in outs) == 6 and outs[-1].finish_reason == "length"
        with pytest.raises(RequestError, match="prompt token ids must be in"):
            await front.submit("bad", [10**6], GREEDY)
        long = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
        held = await front.submit("b", [4, 5], long)
        with pytest.raises(RequestError, match="already in use"):
            await front.submit("b", [4, 5], long)
        other = await front.submit("c", [6], long)
        with pytest.raises(Overloaded):
            await front.submit("d", [7], long)
        front.close(held)  # the consumer went away: the request is aborted
        front.abort("c")
        for _ in range(100):
            snap = await front.snapshot()
            if snap.kv["blocks_used"] == 0:
                break
            await asyncio.sleep(0.05)
        assert snap.kv["blocks_used"] == 0 and front.num_streams == 0
        assert (await drain(other))[-1].finish_reason == "abort"
        front.set_draining()
        for _ in range(100):
            if engine.draining:
                break
            await asyncio.sleep(0.05)
        assert engine.draining
        await front.stop()

    asyncio.run(main())
