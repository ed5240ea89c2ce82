"""Sampler: validation, greedy, filters, seeded batch invariance, and distribution checks.

Token choices and filtered logits are compared bit-exactly; log-probs only to float tolerance. The sampler is
deterministic given (seed, step), so the chi-square tests are fixed draws, not flaky ones.
"""

from __future__ import annotations

import math
import re

import pytest
import torch

from engine.params import SamplingError, SamplingParams
from engine.sampling.sampler import (
    GAMMA,
    SamplingBatch,
    coupled_scores,
    draw_scores,
    filter_logits,
    gumbel_noise,
    mix64,
    sample,
)
from tests.support.sampling import advanced, sampling_batch

EOS = (7,)


def batch(params, seeds=None, num_generated=None) -> SamplingBatch:
    n = len(params)
    seeds = seeds if seeds is not None else [p.seed if p.seed is not None else 0 for p in params]
    return sampling_batch(params, seeds, num_generated or [0] * n)


def state_sample(logits, params, seeds=None, num_generated=None, depth=None):
    """Samples ``logits`` rows through a rank's sampling state (its logits processors: min_tokens here), one slot per
    row; ``depth``: tree rows at those depths (``TreeSampling`` offsets ``num_generated`` by them)."""
    from engine.sampling.logits_processors import Rows, SamplingState
    from engine.step import NewRequest

    n = len(params)
    seeds = seeds if seeds is not None else [p.seed if p.seed is not None else 0 for p in params]
    state = SamplingState(logits.shape[-1], EOS, torch.device("cpu"))
    slots = [state.add(NewRequest(request_id=str(i), dp_rank=0, prompt=(), output=(), params=p, seed=s))
             for i, (p, s) in enumerate(zip(params, seeds, strict=True))]
    generated = torch.tensor(num_generated or [0] * n) + (0 if depth is None else depth)
    return state.sample(logits, Rows(slots, torch.tensor(slots), generated))


def splitmix64_ref(state: int, n: int) -> list[int]:
    """Vigna's splitmix64 on unsigned Python ints, outputs reinterpreted as int64."""
    mask, out = (1 << 64) - 1, []
    for _ in range(n):
        state = (state + 0x9E3779B97F4A7C15) & mask
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        z ^= z >> 31
        out.append(z - (1 << 64) if z >= 1 << 63 else z)
    return out


@pytest.mark.parametrize("seed", [0, 1234567, -1, -(2**63), 2**63 - 1])
def test_mix64_is_bit_exact_splitmix64(seed):
    got = mix64(torch.tensor(seed) + torch.arange(1, 6) * GAMMA).tolist()
    assert got == splitmix64_ref(seed % 2**64, 5)
    if seed == 1234567:  # published test vector
        assert got[:2] == [6457827717110365317, 3203168211198807973]


def test_gumbel_noise_is_in_range_and_keyed():
    g = gumbel_noise(torch.tensor([3, 3, 4]), torch.tensor([0, 1, 0]), 1000)
    assert torch.isfinite(g).all()
    assert not torch.equal(g[0], g[1]) and not torch.equal(g[0], g[2])
    # Gumbel(0, 1): mean = Euler–Mascheroni constant, var = pi^2 / 6
    assert abs(g.mean().item() - 0.5772) < 0.05 and abs(g.var().item() - math.pi**2 / 6) < 0.15


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_p", float("nan")),
        ("top_k", -2),
        ("min_p", -0.1),
        ("min_p", 1.1),
        ("max_tokens", 0),
        ("min_tokens", -1),
        ("min_tokens", 17),  # > default max_tokens=16
        ("logprobs", -1),
        ("logprobs", 21),
        ("stop_token_ids", (1, -2)),
        ("stop_token_ids", [1, 2]),
    ],
)
def test_validation_names_the_field(field, value):
    with pytest.raises(SamplingError, match=rf"^{field} must be .*, got {re.escape(repr(value))}$"):
        SamplingParams(**{field: value})
    assert issubclass(SamplingError, ValueError)


def test_validation_message_example():
    with pytest.raises(SamplingError) as e:
        SamplingParams(temperature=float("nan"))
    assert str(e.value) == "temperature must be >= 0 and finite, got nan"


def test_boundary_values_are_accepted():
    SamplingParams(temperature=0.0, top_p=1.0, top_k=-1, min_p=1.0, max_tokens=1, min_tokens=1, logprobs=20)
    SamplingParams(top_k=0, min_p=0.0, top_p=1e-9, logprobs=0, stop_token_ids=(0, 5))


def test_greedy_is_argmax_even_beside_sampled_rows():
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    logits[1, [3, 9]] = 10.0  # tie → lowest id
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0)] + [SamplingParams(top_k=5)] * 4
    out = sample(logits, batch(params, seeds=list(range(6))))
    assert out.tokens[:2].tolist() == [logits[0].argmax().item(), 3]
    all_greedy = sample(logits, batch([SamplingParams(temperature=0.0)] * 6))
    assert torch.equal(all_greedy.tokens, logits.argmax(-1))


def test_seeded_row_is_batch_and_order_invariant():
    torch.manual_seed(1)
    V = 300
    target = torch.randn(V) * 0.5  # flat enough that the draw is far from argmax-determined
    tp = SamplingParams(temperature=0.9, top_p=0.95, seed=42)
    for step in (0, 5, 31):
        alone = sample(target[None], batch([tp], seeds=[42], num_generated=[step])).tokens.item()
        others = [
            SamplingParams(temperature=0.0),
            SamplingParams(top_k=3, seed=1),
            SamplingParams(temperature=2.0, min_p=0.1),
            SamplingParams(top_p=0.5),
            SamplingParams(temperature=0.5, top_k=50, logprobs=4),
            SamplingParams(),
            SamplingParams(seed=42),
        ]
        rows = [torch.randn(V) for _ in others]
        for where in (0, 3, 7):
            params = others[:where] + [tp] + others[where:]
            logits = torch.stack(rows[:where] + [target] + rows[where:])
            seeds = [100 + i for i in range(8)]
            seeds[where] = 42
            steps = [step if i == where else 1000 + i for i in range(8)]
            assert sample(logits, batch(params, seeds=seeds, num_generated=steps)).tokens[where].item() == alone


def test_different_seeds_give_different_sequences():
    logits = torch.zeros(50, 1000)  # flat: every draw is pure noise
    p = SamplingParams()

    def seq(seed):
        return sample(logits, batch([p] * 50, seeds=[seed] * 50, num_generated=list(range(50)))).tokens

    a, b = seq(1), seq(2)
    assert torch.equal(a, seq(1))
    assert (a != b).sum() >= 45
    assert a.unique().numel() >= 45  # steps vary the noise within one request


def test_top_k_1_is_greedy():
    torch.manual_seed(2)
    logits = torch.randn(16, 100)
    out = sample(logits, batch([SamplingParams(top_k=1)] * 16, seeds=list(range(16))))
    assert torch.equal(out.tokens, logits.argmax(-1))


@pytest.mark.parametrize("p", [SamplingParams(top_p=1e-6), SamplingParams(min_p=1.0), SamplingParams(top_p=0.01)])
def test_tight_filters_keep_only_the_top_token(p):
    torch.manual_seed(3)
    logits = torch.randn(16, 100)
    out = sample(logits, batch([p] * 16, seeds=list(range(16)), num_generated=list(range(16))))
    assert torch.equal(out.tokens, logits.argmax(-1))


def kept(logits_row, p: SamplingParams) -> list[int]:
    return torch.isfinite(filter_logits(logits_row[None], batch([p]))[0]).nonzero().flatten().tolist()


def test_filters_hand_worked():
    logits = torch.tensor([0.3, 0.5, 0.05, 0.15]).log()  # sorted ids: 1, 0, 3, 2
    assert kept(logits, SamplingParams(top_p=0.4)) == [1]
    assert kept(logits, SamplingParams(top_p=0.7)) == [0, 1]
    assert kept(logits, SamplingParams(top_p=0.85)) == [0, 1, 3]
    assert kept(logits, SamplingParams(top_p=1.0)) == [0, 1, 2, 3]
    assert kept(logits, SamplingParams(top_k=3)) == [0, 1, 3]
    # top-p runs on the top-k renormalised mass: {0.5, 0.3} → {0.625, 0.375}
    assert kept(logits, SamplingParams(top_k=2, top_p=0.6)) == [1]
    assert kept(logits, SamplingParams(top_k=2, top_p=0.7)) == [0, 1]
    assert kept(logits, SamplingParams(min_p=0.5)) == [0, 1]  # 0.3 >= 0.25, 0.15 < 0.25
    assert kept(logits, SamplingParams(min_p=0.25)) == [0, 1, 3]


def test_vectorised_filters_match_row_by_row():
    torch.manual_seed(4)
    params = [
        SamplingParams(),
        SamplingParams(top_k=10),
        SamplingParams(top_p=0.6),
        SamplingParams(min_p=0.2),
        SamplingParams(top_k=20, top_p=0.9, min_p=0.05),
        SamplingParams(top_k=500),  # > V: off
    ]
    logits = torch.randn(len(params), 200) * 2
    together = filter_logits(logits, batch(params))
    for i, p in enumerate(params):
        assert torch.equal(together[i], filter_logits(logits[i : i + 1], batch([p]))[0])


def test_min_tokens_bans_eos_and_stop_ids_until_reached():
    logits = torch.zeros(4, 10)
    logits[:, 7] = 20.0  # EOS dominates
    logits[:, 3] = 19.0  # then a stop id
    logits[:, 5] = 18.0
    p = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=(3,))
    q = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=(3,), ignore_eos=True)
    s = SamplingParams(min_tokens=2, stop_token_ids=(3,), top_k=2)  # sampled row: only {5, ...} survive top-2
    out = state_sample(logits, [p, p, q, s], seeds=[0, 0, 0, 9], num_generated=[0, 2, 1, 1])
    assert out.tokens.tolist() == [5, 7, 7, out.tokens[3].item()]
    assert out.tokens[3].item() not in (3, 7)
    # log-probs still come from the unmodified logits
    assert torch.allclose(out.logprobs[0], logits[0].log_softmax(-1)[5])


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    stat = ((counts - expected) ** 2 / expected).sum()
    dof = probs.numel() - 1
    return torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat.double() / 2).item()


def test_advanced_batch_draws_what_a_batch_built_later_draws():
    """A tree node at depth d draws output index ``num_generated + d``: offsetting rows built at depth 0 on the
    device gives the tokens of rows built on the host for each depth — min_tokens bans included, lifted exactly
    where a row reaches min_tokens (EOS dominates, so a banned row shows it)."""
    gen = torch.Generator().manual_seed(5)
    params = [SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=(3,)),
              SamplingParams(temperature=1.0, top_p=0.9, min_tokens=4, seed=1),
              SamplingParams(temperature=0.7, top_k=5, min_tokens=2, ignore_eos=True, stop_token_ids=(3,), seed=2),
              SamplingParams(temperature=1.0, seed=3)]
    rows = [p for p in params for _ in range(4)]  # depths 0..3 of each request
    depth = torch.arange(4).repeat(len(params))
    logits = torch.randn(len(rows), 40, generator=gen)
    logits[:, EOS[0]] += 30.0
    logits[:, 3] += 25.0
    for generated in (0, 1):
        seeds = [p.seed or 0 for p in rows]
        later = [generated + int(d) for d in depth]
        want = state_sample(logits, rows, seeds, later).tokens
        got = state_sample(logits, rows, seeds, [generated] * len(rows), depth=depth).tokens
        assert torch.equal(sample(logits, advanced(batch(rows, seeds, [generated] * len(rows)), depth)).tokens,
                           sample(logits, batch(rows, seeds, later)).tokens)
        assert torch.equal(got, want)
        greedy = got[:4].tolist()  # request 0: EOS and the stop id banned while generated + d < 3
        assert [t in (EOS[0], 3) for t in greedy] == [generated + d >= 3 for d in range(4)]



@pytest.mark.parametrize(
    "p, seed",
    [
        (SamplingParams(), 0),
        (SamplingParams(), 12345),
        (SamplingParams(temperature=0.7), 7),
        (SamplingParams(top_k=3), 3),
        (SamplingParams(temperature=1.5, top_p=0.8), 11),
    ],
)
def test_sampling_matches_filtered_softmax(p, seed):
    n = 4000
    logits = torch.tensor([1.0, 0.2, -0.5, 0.8, -1.2])
    out = sample(logits.expand(n, -1), batch([p] * n, seeds=[seed] * n, num_generated=list(range(n))))
    target = filter_logits(logits[None] / p.temperature, batch([p]))[0].softmax(-1).double()
    support = target > 0
    counts = torch.bincount(out.tokens, minlength=5).double()
    assert counts[~support].sum() == 0
    assert chi_square_p(counts[support], target[support]) > 1e-3


def test_chi_square_catches_a_wrong_distribution():
    counts = torch.tensor([1000.0, 1000, 1000, 1000])
    assert chi_square_p(counts, torch.tensor([0.3, 0.25, 0.25, 0.2], dtype=torch.float64)) < 1e-3


def test_logprobs_of_chosen_and_top_n():
    torch.manual_seed(5)
    logits = torch.randn(5, 64) * 3
    params = [SamplingParams(logprobs=2), SamplingParams(logprobs=5, temperature=0.0)] + [SamplingParams()] * 3
    out = sample(logits, batch(params, seeds=list(range(5))))
    ref = logits.log_softmax(-1)
    assert torch.allclose(out.logprobs, ref.gather(1, out.tokens[:, None]).squeeze(1), atol=1e-6)
    assert out.top_ids.shape == out.top_logprobs.shape == (5, 5)
    assert out.top_ids.dtype == torch.int64 and out.top_logprobs.dtype == torch.float32
    assert (out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:]).all()
    assert torch.allclose(out.top_logprobs, ref.gather(1, out.top_ids), atol=1e-6)
    assert torch.equal(out.top_ids[:, 0], logits.argmax(-1))
    none = sample(logits, batch([SamplingParams()] * 5))
    assert none.top_ids.shape == none.top_logprobs.shape == (5, 0)


def test_sampling_rows_reject_ragged_inputs():
    with pytest.raises(ValueError, match="equal lengths"):
        sampling_batch([SamplingParams()] * 2, [0], [0, 0])


@pytest.mark.parametrize("candidates", [500, 64])
def test_coupled_scores_rank_the_draw_first_then_kept_then_removed_tokens(candidates):
    """Drafter-side scores (coupled drafting): their argmax is the sampler's draw, and a processor's -inf stays.
    With every token a candidate, the filters' verdicts are the sampler's: every kept token outranks every removed
    one, and the kept tokens' scores are the draw's, bit for bit; with 64, where neither filter cuts inside them,
    every token past them counts as kept."""
    gen = torch.Generator().manual_seed(4)
    params = [SamplingParams(temperature=t, top_p=p, top_k=k, min_p=m, seed=s)
              for s, (t, p, k, m) in enumerate([(1.0, 0.95, 0, 0.0), (0.6, 1.0, 40, 0.0), (1.0, 0.9, 0, 0.05),
                                                (0.3, 0.8, 100, 0.01), (1.0, 1.0, 0, 0.0)] * 8)]
    sb = batch(params, num_generated=list(range(len(params))))
    logits = torch.randn(len(params), 500, generator=gen) * 3
    logits[0, :10] = -math.inf  # processors' bans stay at -inf
    draws, coupled = draw_scores(logits, sb), coupled_scores(logits, sb, candidates)
    assert torch.equal(coupled.argmax(dim=-1), draws.argmax(dim=-1))
    assert torch.equal(coupled.argmax(dim=-1), sample(logits, sb).tokens)
    assert torch.isneginf(coupled[0, :10]).all() and torch.isfinite(coupled[0, 10:]).all()
    kept = torch.isfinite(draws)
    if candidates == 500:
        lowest_kept = coupled.masked_fill(~kept, math.inf).amin(dim=-1)
        assert (lowest_kept > coupled.masked_fill(kept, -math.inf).amax(dim=-1)).all()
        assert torch.equal(coupled[kept], draws[kept])
    else:  # T=1 without filters: every token kept, scored as the draw
        assert torch.equal(coupled[4::5], draws[4::5])
