"""The built-in tiny_kimi pair as the per-step scripts load and drive it (``host_per_step.py``, ``metrics_cost.py``):
the fp32 target on one rank, an optional speculator, and a batch of greedy decodes run to the end."""

from __future__ import annotations

from pathlib import Path

from engine.engine import Engine
from engine.params import SamplingParams
from model.loader import load_model
from parallelism.comm import build_groups
from parallelism.layout import Layout

ZOO = Path(__file__).resolve().parent.parent / "model/zoo/tiny_kimi"


def load_pair(spec: str):
    """``(model, speculation)``: the target on one rank and, unless ``spec == "none"``, its ``dflash`` / ``ddtree``
    speculator (budget 16, block 9, tree temperature 0.33) on the trained drafter."""
    model = load_model(str(ZOO / "target"), build_groups(Layout()))
    if spec == "none":
        return model, None
    from spec_decode.config import SpecConfig
    from spec_decode.speculation import load_speculation

    return model, load_speculation(SpecConfig(spec, budget=16, block_size=9, drafter_path=str(ZOO / "drafter"),
                                              tree_temperature=0.33), model)


def decode_batch(engine: Engine, batch: int, tokens: int) -> None:
    """``batch`` greedy requests of 8-token prompts, ``tokens`` new tokens each (EOS ignored), stepped to the end."""
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    for i in range(batch):
        engine.add_request(str(i), [5 + i, 17, 3, 99, 150, 7, 64, 31], params)
    while engine.has_work():
        engine.step()
