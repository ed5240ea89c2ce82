"""Records the published EPLB algorithm's balancedness on a set of expert loads, as numbers, for
``tests/parallelism/test_eplb.py`` to hold :func:`parallelism.eplb.rebalance` against.

The published algorithm (DeepSeek's EPLB) ships in the ``sglang`` wheel on PyPI as
``sglang/srt/eplb/eplb_algorithms/deepseek.py`` (MIT). Download the wheel once without its dependencies and point
this script at it; it imports that one file from the wheel (nothing of it is copied into this repository) and writes,
per case, the loads and the published placement's balancedness per layer::

    pip download sglang --no-deps -d /tmp/sglang
    python scripts/record_eplb_fixture.py --wheel /tmp/sglang/sglang-*.whl --out tests/parallelism/eplb_published.json
    python scripts/record_eplb_fixture.py --wheel /tmp/sglang/sglang-*.whl --sweep 200   # worst gaps, small shapes
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import tempfile
import zipfile
from pathlib import Path

import torch

from parallelism.eplb import balancedness

ALGORITHM = "sglang/srt/eplb/eplb_algorithms/deepseek.py"
# (experts, slots, ranks, nodes, groups): no redundancy, one and two spare slots per rank, 32 spare over 256, and
# the hierarchical policy (two nodes) at 64 and 384 experts; then SMALL_SHAPES
SHAPES = [(64, 64, 8, 1, 1), (64, 72, 8, 1, 1), (64, 80, 8, 1, 1), (256, 288, 8, 1, 1), (64, 80, 8, 2, 8),
          (384, 416, 16, 2, 8)]
SKEWS = (0.6, 1.2)  # Zipf exponents of the synthetic loads
SEEDS = (0, 1)
LAYERS = 2
# few slots per rank, where which replicas share a rank decides everything: more loads each
SMALL_SHAPES = [(4, 8, 4, 1, 1), (6, 8, 4, 1, 1), (8, 16, 8, 1, 1)]
SMALL_SEEDS = tuple(range(2, 12))


def synthetic_load(seed: int, layers: int, experts: int, skew: float) -> torch.Tensor:
    """Tokens per expert ``[layers, experts]`` (10,000 per layer): a Zipf shape over a random expert order, times
    ±25 % noise, rounded."""
    gen = torch.Generator().manual_seed(seed)
    order = torch.stack([torch.randperm(experts, generator=gen) for _ in range(layers)]).double() + 1
    shape = order ** -skew * (torch.rand(layers, experts, generator=gen, dtype=torch.float64) * 0.5 + 0.75)
    return (shape * 10_000 / shape.sum(dim=1, keepdim=True)).round()


def published_algorithm(wheel: Path):
    """The ``rebalance_experts`` function of the wheel's EPLB module, imported from a temporary extraction."""
    tmp = Path(tempfile.mkdtemp())
    with zipfile.ZipFile(wheel) as zf:
        zf.extract(ALGORITHM, tmp)
    spec = importlib.util.spec_from_file_location("published_eplb", tmp / ALGORITHM)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.rebalance_experts


def sweep(published, seeds: int) -> None:
    """Prints, per small shape, how far :func:`parallelism.eplb.rebalance` falls below the published algorithm over
    ``seeds`` × 3 synthetic loads (Zipf 0.6, 1.2, 2.0): the worst gap and how many loads lose more than 0.01."""
    from parallelism.eplb import rebalance

    for experts, slots, ranks in [(4, 8, 4), (4, 6, 2), (8, 12, 4), (6, 8, 4), (8, 16, 8), (16, 24, 8)]:
        gaps = []
        for seed in range(seeds):
            for skew in (0.6, 1.2, 2.0):
                load = synthetic_load(seed, 1, experts, skew)
                theirs = balancedness(load, published(load, slots, 1, 1, ranks, False)[0], ranks).item()
                gaps.append(theirs - balancedness(load, rebalance(load, slots, ranks), ranks).item())
        print(f"{experts} experts, {slots} slots, {ranks} ranks: worst {max(gaps):.4f} below the published, "
              f"{sum(g > 0.01 for g in gaps)} of {len(gaps)} loads more than 0.01 below")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wheel", type=Path, required=True, help="the sglang wheel (pip download sglang --no-deps)")
    parser.add_argument("--out", type=Path, default=Path("tests/parallelism/eplb_published.json"))
    parser.add_argument("--sweep", type=int, default=0, help="instead: compare on this many seeds per small shape")
    args = parser.parse_args()
    published = published_algorithm(args.wheel)
    if args.sweep:
        sweep(published, args.sweep)
        return
    cases = []
    runs = [(shape, SEEDS) for shape in SHAPES] + [(shape, SMALL_SEEDS) for shape in SMALL_SHAPES]
    for (experts, slots, ranks, nodes, groups), seeds in runs:
        for skew in SKEWS:
            for seed in seeds:
                load = synthetic_load(seed, LAYERS, experts, skew)
                phy2log, _, _ = published(load, slots, groups, nodes, ranks, nodes > 1 and groups % nodes == 0)
                cases.append(dict(slots=slots, ranks=ranks, nodes=nodes, groups=groups, skew=skew, seed=seed,
                                  load=load.long().tolist(),
                                  published=[round(b, 6) for b in balancedness(load, phy2log, ranks).tolist()]))
    args.out.write_text(json.dumps(dict(source=f"{args.wheel.name}: {ALGORITHM}", cases=cases)) + "\n")
    print(f"{len(cases)} cases → {args.out}")


if __name__ == "__main__":
    main()
