"""Token sampling as pure tensor functions: no host sync, no generator state.

Randomness is a counter-based hash of ``(seed, num_generated, token_id)`` (splitmix64 in wrapping int64 torch ops;
``num_generated`` is the output index of the token drawn: the tokens the request has generated before it), so a
seeded request draws the same tokens whatever else is in its batch and in whatever order the batch is formed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from engine.params import SamplingParams
from model import fixed_math

TOP_K_OFF = torch.iinfo(torch.int64).max  # any value >= V disables top-k


def _int64(c: int) -> int:
    """Two's-complement int64 value of a 64-bit pattern."""
    c &= (1 << 64) - 1
    return c - (1 << 64) if c >= 1 << 63 else c


GAMMA = _int64(0x9E3779B97F4A7C15)
_M1 = _int64(0xBF58476D1CE4E5B9)
_M2 = _int64(0x94D049BB133111EB)


@dataclass
class SamplingBatch:
    """Per-row sampling tensors for B requests.

    ``temperature, top_p, min_p [B]`` float32; ``top_k, seed, num_generated [B]`` int64 (top_k ``TOP_K_OFF`` = off;
    num_generated: the output index of the token being drawn). ``num_logprobs`` is the batch's largest
    ``logprobs``; ``needs_sort`` / ``all_greedy`` are host flags that let :func:`sample` skip work (:func:`host_flags`).
    The engine's ranks gather these rows from per-request tensors (``engine.sampling.logits_processors.SamplingState``;
    a tree node at depth d draws output index ``num_generated + d``, ``TreeSampling``). Features that change the
    logits (min_tokens, penalties, logit bias, grammar masks) are logits processors, applied before :func:`sample`.
    """

    temperature: Tensor
    top_k: Tensor
    top_p: Tensor
    min_p: Tensor
    seed: Tensor
    num_generated: Tensor
    num_logprobs: int
    needs_sort: bool
    all_greedy: bool


def top_k_of(p: SamplingParams) -> int:
    """The sampler's top-k of ``p``: :data:`TOP_K_OFF` when off."""
    return p.top_k if p.top_k > 0 else TOP_K_OFF


def host_flags(params: list[SamplingParams]) -> dict:
    """:class:`SamplingBatch`'s host fields for rows of ``params``."""
    sampled = [p for p in params if p.temperature > 0]
    return dict(num_logprobs=max((p.logprobs for p in params), default=0),
                needs_sort=any(p.top_k > 0 or p.top_p < 1 for p in sampled), all_greedy=not sampled)


@dataclass(frozen=True)
class SampleOutput:
    """``tokens [B]`` int64; ``logprobs [B]`` float32 of each chosen token under the unmodified
    ``log_softmax(logits)``; ``top_ids [B, n]`` int64 and ``top_logprobs [B, n]`` float32 (descending) with n the
    batch's largest requested ``logprobs`` (0 gives empty ``[B, 0]`` tensors)."""

    tokens: Tensor
    logprobs: Tensor
    top_ids: Tensor
    top_logprobs: Tensor


def _shr(x: Tensor, s: int) -> Tensor:
    """Logical right shift of int64 bit patterns (torch's ``>>`` is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def mix64(x: Tensor) -> Tensor:
    """splitmix64 finaliser on int64 tensors; multiplication wraps mod 2**64, so results are bit-exact with the
    unsigned reference reinterpreted as signed."""
    x = (x ^ _shr(x, 30)) * _M1
    x = (x ^ _shr(x, 27)) * _M2
    return x ^ _shr(x, 31)


def gumbel_noise(seed: Tensor, num_generated: Tensor, vocab_size: int) -> Tensor:
    """Gumbel(0, 1) noise ``[B, V]`` float32, a pure function of ``(seed[b], num_generated[b], token id)``.

    Row key = ``mix64(mix64(seed) + num_generated * GAMMA)``; token t gets the (t+1)-th splitmix64 output from that key.
    The top 23 bits make ``u = (2b + 1) / 2**24``, exact in float32 and strictly inside (0, 1). On the CPU the logs
    are :func:`model.fixed_math.log` (torch's rounds a tensor's scalar tail apart from its body, so a row's noise would
    depend on the batch); on CUDA ``torch.log`` (one routine per element)."""
    key = mix64(mix64(seed) + num_generated * GAMMA)  # [B]
    ids = torch.arange(1, vocab_size + 1, dtype=torch.int64, device=seed.device)
    bits = mix64(key[:, None] + ids * GAMMA)  # [B, V]
    u = (_shr(bits, 41) * 2 + 1).float() * 2.0**-24
    log = torch.log if u.is_cuda else fixed_math.log
    return -log(-log(u))


def filter_logits(logits: Tensor, sb: SamplingBatch) -> Tensor:
    """Temperature-scaled ``[B, V]`` logits with tokens removed by top-k, then top-p, then min-p set to -inf.

    top-p keeps the smallest highest-probability prefix of the top-k-renormalised distribution whose mass
    reaches ``top_p`` (the top token always survives); min-p drops tokens with ``prob < min_p * max_prob``.
    """
    if sb.needs_sort:
        sorted_l, order = logits.sort(dim=-1, descending=True, stable=True)  # [B, V]
        pos = torch.arange(logits.shape[-1], device=logits.device)
        sorted_l = sorted_l.masked_fill(pos >= sb.top_k[:, None], -math.inf)
        probs = sorted_l.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        top_p = sb.top_p[:, None]
        # top_p == 1 is skipped outright: float cumsum can reach 1 early and would drop tail tokens
        sorted_l = sorted_l.masked_fill((mass_before >= top_p) & (top_p < 1), -math.inf)
        logits = torch.empty_like(logits).scatter_(1, order, sorted_l)
    # prob_i < min_p * prob_max  <=>  logit_i < logit_max + log(min_p); min_p == 0 gives -inf (keep all)
    cutoff = logits.amax(dim=-1, keepdim=True) + sb.min_p.log()[:, None]
    return logits.masked_fill(logits < cutoff, -math.inf)


def draw_scores(processed: Tensor, sb: SamplingBatch) -> Tensor:
    """The Gumbel-max scores ``[B, V]`` of sampled rows: :func:`filter_logits` of ``processed / temperature`` plus
    :func:`gumbel_noise` (removed tokens -inf). Their argmax is :func:`sample`'s draw (rows at temperature 0 are
    scored at temperature 1; :func:`sample` takes their argmax instead)."""
    scaled, noise = _scaled(processed, sb)
    return filter_logits(scaled, sb) + noise


def coupled_scores(processed: Tensor, sb: SamplingBatch, candidates: int) -> Tensor:
    """Drafter-side :func:`draw_scores` ``[B, V]`` without a full sort: ``processed / temperature`` plus the row's
    noise for every token, the filters' verdicts found among each row's ``candidates`` best tokens (top-k, top-p
    over the top-k-renormalised distribution, min-p). Where top-k or top-p cuts inside the candidates the verdicts
    are the sampler's (up to rounding at the edge); where they reach past them, every token past them that min-p
    keeps counts as kept. Removed tokens rank below every kept one, in their own order, instead of at -inf (a
    grammar may allow only those); a processor's -inf stays. Their argmax is the sampler's draw where the verdicts
    agree: a drafter ranking by them proposes the target's draw where their logits agree (docs/sampling.md)."""
    scaled, noise = _scaled(processed, sb)  # [B, V] each
    m = min(candidates, scaled.shape[-1])
    vals, ids = scaled.topk(m, dim=-1)  # [B, M] descending
    pos = torch.arange(m, device=scaled.device)
    masked = vals.masked_fill(pos >= sb.top_k[:, None], -math.inf)
    inside = sb.top_k[:, None] <= m  # top-k cuts within the candidates: the distribution is theirs
    norm = torch.where(inside, masked.logsumexp(dim=-1, keepdim=True), scaled.logsumexp(dim=-1, keepdim=True))
    probs = (masked - norm).exp()
    mass_before = probs.cumsum(dim=-1) - probs
    top_p = sb.top_p[:, None]
    cut = (mass_before >= top_p) & (top_p < 1)  # [B, M]
    rest = ~inside & ~cut[:, -1:]  # [B, 1]: neither filter cut inside the candidates: the tokens past them stay
    keep = torch.zeros_like(scaled, dtype=torch.bool).scatter_(1, ids, torch.isfinite(masked) & ~cut)
    past = torch.ones_like(keep).scatter_(1, ids, torch.zeros_like(ids, dtype=torch.bool))
    keep |= past & rest
    keep &= scaled >= vals[:, :1] + sb.min_p.log()[:, None]
    noisy = scaled + noise
    # tier gap: above the spread of the row's finite values plus the noise's range (2**-24 < u < 1: |g| < 17.4)
    low = scaled.masked_fill(~torch.isfinite(scaled), math.inf).amin(dim=-1, keepdim=True)
    return torch.where(keep, noisy, noisy - (vals[:, :1] - low + 40.0))


def _scaled(processed: Tensor, sb: SamplingBatch) -> tuple[Tensor, Tensor]:
    """``processed / temperature`` (temperature-0 rows at 1) and the rows' noise, ``[B, V]`` each."""
    temp = torch.where(sb.temperature > 0, sb.temperature, 1.0)
    return processed / temp[:, None], gumbel_noise(sb.seed, sb.num_generated, processed.shape[-1])


def sample(logits: Tensor, sb: SamplingBatch, processed: Tensor | None = None) -> SampleOutput:
    """Draw one token per row of ``logits [B, V]`` float32 under ``sb``, without host synchronisation.

    ``processed``: the logits after the logits processors (min_tokens, penalties, bias, grammar masks; default
    ``logits``). Rows with temperature 0 take its argmax (ties → lowest id). Others take the Gumbel-max of
    :func:`filter_logits` over ``processed / temperature`` with :func:`gumbel_noise`, i.e. an exact draw from the
    filtered softmax. Returned log-probs are the raw model's, ``log_softmax(logits)`` (vLLM's default
    ``logprobs_mode``): none of the processing above changes them.
    """
    raw = logits.log_softmax(dim=-1)  # [B, V]
    processed = logits if processed is None else processed
    tokens = processed.argmax(dim=-1)  # [B]
    if not sb.all_greedy:
        tokens = torch.where(sb.temperature > 0, draw_scores(processed, sb).argmax(dim=-1), tokens)
    top_logprobs, top_ids = raw.topk(sb.num_logprobs, dim=-1)  # [B, n]
    return SampleOutput(tokens, raw.gather(1, tokens[:, None]).squeeze(1), top_ids, top_logprobs)
