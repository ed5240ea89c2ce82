"""Per-request sampling state on a rank and the logits processors behind one interface.

A rank keeps every request of its attention-DP group in a *slot* (:class:`SamplingState`): its sampling settings in
per-slot device tensors (gathered into a :class:`~engine.sampling.sampler.SamplingBatch` per step: the step uploads
slot ids and output indices, not settings), and each logits processor's state. A processor is told when a request
arrives (:meth:`LogitsProcessor.add`, with its prompt and any output to replay: a preempted request re-admitted) and
leaves (:meth:`~LogitsProcessor.remove`), when tokens join a request's history (:meth:`~LogitsProcessor.commit`:
each token a step feeds past what the rank has seen, and the drafts a speculative step accepted), and changes the
logits of the rows that sample (:meth:`~LogitsProcessor.apply`). Slots do not move while a request lives, so there
is no "move" event (vLLM's ``BatchUpdate`` has one because its batch is condensed).

A row is a plain sampling row or a tree node (:class:`Rows`): a node at depth d draws output index
``num_generated + d`` and its history is the request's plus the tokens on its ancestor path (``Rows.path``), so
every processor is exact on every DDTree / DFlash node. Processors, in the order applied: logit bias, min_tokens,
the grammar mask (``engine/sampling/grammar.py``), penalties (vLLM's formulas, ``vllm/model_executor/layers/utils.py``).
Log-probs stay the raw model's (:func:`engine.sampling.sampler.sample`). docs/sampling.md.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from engine.params import SamplingParams
from engine.sampling.sampler import (
    SampleOutput,
    SamplingBatch,
    _int64,
    coupled_scores,
    host_flags,
    sample,
    top_k_of,
)
from engine.staging import to_device
from engine.step import NewRequest, SeqWork, StepResult


@dataclass(frozen=True)
class Rows:
    """The ``R`` rows of a logits tensor as the processors see them: ``slots`` (host) and ``slot_index [R]`` int64
    (device) the request of each row, ``num_generated [R]`` int64 the output index it draws; for tree nodes
    ``path [R, P]`` int64, the tokens of the node's ancestor path below the root (the node's own included), -1
    padding (None: plain rows), and ``masks [R, W]`` int32 grammar bitmasks the tree builder computed for them
    (None: the grammar processor fills them from the committed state)."""

    slots: list[int]
    slot_index: Tensor
    num_generated: Tensor
    path: Tensor | None = None
    masks: Tensor | None = None

    def path_counts(self, vocab: int) -> Tensor | None:
        """``[R, V]`` float32 occurrences of each token on each row's path (None for plain rows)."""
        if self.path is None:
            return None
        ids = torch.where(self.path >= 0, self.path, vocab)
        counts = torch.zeros(ids.shape[0], vocab + 1, dtype=torch.float32, device=ids.device)
        return counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))[:, :vocab]


class LogitsProcessor(Protocol):
    """One sampling feature: state per slot, updated on add / remove / commit, applied to a logits tensor."""

    def add(self, slot: int, req: NewRequest) -> None:
        """``req`` enters ``slot``: its prompt and ``output`` (replayed) are its history so far."""
        ...

    def remove(self, slot: int) -> None: ...

    def tracks(self, slot: int) -> bool:
        """Whether the processor needs ``slot``'s history (:meth:`commit`)."""
        ...

    def commit(self, slots: list[int], tokens: list[int | None], device_tokens: Tensor) -> None:
        """Tokens joined the histories of ``slots`` (in order; repeated slots in history order): host values
        (None: a token still on the device only, an overlapped step's) and ``device_tokens [K]`` int64."""
        ...

    def applies(self, slots: list[int]) -> bool:
        """Host check: whether any of ``slots`` uses the feature (else :meth:`apply` is skipped)."""
        ...

    def apply(self, logits: Tensor, rows: Rows) -> Tensor:
        """``logits [R, V]`` float32 of ``rows`` → the processed logits (no host synchronisation)."""
        ...


class _PerSlot:
    """Device tensors indexed by slot, grown on demand (a new slot past the end doubles them); ``used``: the slots
    whose requests use the feature. Reads no history unless a subclass overrides :meth:`tracks` and :meth:`commit`."""

    def __init__(self, device: torch.device):
        self.device, self.capacity = device, 0
        self.tensors: dict[str, Tensor] = {}
        self.fills: dict[str, object] = {}
        self.used: set[int] = set()

    def tracks(self, slot: int) -> bool:
        return False

    def commit(self, slots: list[int], tokens: list[int | None], device_tokens: Tensor) -> None:
        pass

    def applies(self, slots: list[int]) -> bool:
        return any(s in self.used for s in slots)

    def make(self, name: str, tail: tuple[int, ...], dtype: torch.dtype, fill) -> None:
        self.tensors[name] = torch.full((self.capacity, *tail), fill, dtype=dtype, device=self.device)
        self.fills[name] = fill

    def grow(self, slot: int) -> None:
        if slot < self.capacity:
            return
        new = max(8, 2 * self.capacity, slot + 1)
        for name, t in list(self.tensors.items()):
            fill = self.fills[name]
            bigger = torch.full((new, *t.shape[1:]), fill, dtype=t.dtype, device=self.device)
            bigger[:self.capacity] = t
            self.tensors[name] = bigger
        self.capacity = new

    def __getitem__(self, name: str) -> Tensor:
        return self.tensors[name]

    def set(self, name: str, slot: int, value) -> None:
        t = self.tensors[name]
        t[slot] = to_device(value, t.dtype, self.device) if isinstance(value, list) else value


class LogitBias(_PerSlot):
    """``logit_bias``: each slot's ``(token id, bias)`` pairs, added to its rows' logits (padding: id V, bias 0)."""

    def __init__(self, vocab: int, device: torch.device):
        super().__init__(device)
        self.vocab, self.width = vocab, 0

    def add(self, slot: int, req: NewRequest) -> None:
        pairs = req.params.logit_bias
        if not pairs:
            return
        if len(pairs) > self.width or not self.tensors:
            self.width = max(len(pairs), self.width)
            old = dict(self.tensors)
            self.make("ids", (self.width,), torch.int64, self.vocab)
            self.make("bias", (self.width,), torch.float32, 0.0)
            if "ids" in old:
                self["ids"][:, :old["ids"].shape[1]] = old["ids"]
                self["bias"][:, :old["bias"].shape[1]] = old["bias"]
        self.grow(slot)
        pad = self.width - len(pairs)
        self.set("ids", slot, [t for t, _ in pairs] + [self.vocab] * pad)
        self.set("bias", slot, [b for _, b in pairs] + [0.0] * pad)
        self.used.add(slot)

    def remove(self, slot: int) -> None:
        if slot in self.used:
            self.used.discard(slot)
            self["ids"][slot] = self.vocab
            self["bias"][slot] = 0.0

    def apply(self, logits: Tensor, rows: Rows) -> Tensor:
        ids, bias = self["ids"][rows.slot_index], self["bias"][rows.slot_index]  # [R, K]
        add = torch.zeros(logits.shape[0], self.vocab + 1, dtype=logits.dtype, device=logits.device)
        return logits + add.scatter_add_(1, ids, bias)[:, :self.vocab]


class MinTokens(_PerSlot):
    """``min_tokens``: while a row draws an output index below it, its EOS ids (unless ``ignore_eos``) and stop ids
    are -inf — per row, so a tree node at depth d is banned exactly as plain decoding bans output index
    ``num_generated + d``. Padding: id V."""

    def __init__(self, vocab: int, eos_ids: tuple[int, ...], device: torch.device):
        super().__init__(device)
        self.vocab, self.eos, self.width = vocab, tuple(eos_ids), 0
        self.make("min", (), torch.int64, 0)

    def banned(self, p: SamplingParams) -> list[int]:
        return sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos)))

    def add(self, slot: int, req: NewRequest) -> None:
        p = req.params
        if p.min_tokens <= 0:
            return
        ids = self.banned(p)
        if len(ids) > self.width or "ids" not in self.tensors:
            old = self.tensors.get("ids")
            self.width = max(self.width, len(ids), 1)
            self.make("ids", (self.width,), torch.int64, self.vocab)
            if old is not None:
                self["ids"][:, :old.shape[1]] = old
        self.grow(slot)
        self.set("ids", slot, ids + [self.vocab] * (self.width - len(ids)))
        self["min"][slot] = p.min_tokens
        self.used.add(slot)

    def remove(self, slot: int) -> None:
        if slot in self.used:
            self.used.discard(slot)
            self["min"][slot] = 0

    def apply(self, logits: Tensor, rows: Rows) -> Tensor:
        ids = self["ids"][rows.slot_index]  # [R, K]
        active = (rows.num_generated < self["min"][rows.slot_index])[:, None].expand_as(ids)
        ban = torch.zeros(logits.shape[0], self.vocab + 1, dtype=torch.bool, device=logits.device)
        ban = ban.scatter_(1, ids, active)[:, :self.vocab]
        return logits.masked_fill(ban, -math.inf)


class Penalties(_PerSlot):
    """vLLM's penalties: ``repetition_penalty`` over tokens in the prompt or the output (a positive logit divided,
    by multiplying with 1/penalty, a non-positive one multiplied), then ``frequency_penalty × count`` and
    ``presence_penalty × (count > 0)`` subtracted, counts over the output only. Output counts ``[S, V]`` int32 and
    the prompt's tokens ``[S, V]`` bool live on the device; a tree node adds its path's tokens to the counts."""

    def __init__(self, vocab: int, device: torch.device):
        super().__init__(device)
        self.vocab = vocab

    def add(self, slot: int, req: NewRequest) -> None:
        p = req.params
        if not p.penalized:
            return
        if not self.tensors:
            self.make("counts", (self.vocab,), torch.int32, 0)
            self.make("prompt", (self.vocab,), torch.bool, False)
            for name, fill in (("rep", 1.0), ("freq", 0.0), ("pres", 0.0)):
                self.make(name, (), torch.float32, fill)
        self.grow(slot)
        self["counts"][slot] = torch.bincount(to_device(list(req.output), torch.int64, self.device),
                                              minlength=self.vocab).to(torch.int32)
        self["prompt"][slot] = False
        self["prompt"][slot, to_device(list(req.prompt), torch.int64, self.device)] = True
        self["rep"][slot], self["freq"][slot], self["pres"][slot] = (p.repetition_penalty, p.frequency_penalty,
                                                                     p.presence_penalty)
        self.used.add(slot)

    def remove(self, slot: int) -> None:
        if slot in self.used:
            self.used.discard(slot)
            self["rep"][slot], self["freq"][slot], self["pres"][slot] = 1.0, 0.0, 0.0

    def tracks(self, slot: int) -> bool:
        return slot in self.used

    def commit(self, slots: list[int], tokens: list[int | None], device_tokens: Tensor) -> None:
        keep = [i for i, s in enumerate(slots) if s in self.used]
        if not keep:
            return
        index = to_device(keep, torch.int64, self.device)
        rows = to_device([slots[i] for i in keep], torch.int64, self.device)
        self["counts"].index_put_((rows, device_tokens[index]), torch.ones(len(keep), dtype=torch.int32,
                                                                           device=self.device), accumulate=True)

    def apply(self, logits: Tensor, rows: Rows) -> Tensor:
        return apply_penalties(logits, self["prompt"][rows.slot_index], self.counts(rows), self["rep"][rows.slot_index],
                               self["freq"][rows.slot_index], self["pres"][rows.slot_index])

    def counts(self, rows: Rows) -> Tensor:
        """``[R, V]`` float32 output counts of each row: the slot's, plus a tree node's path."""
        counts = self["counts"][rows.slot_index].float()
        extra = rows.path_counts(self.vocab)
        return counts if extra is None else counts + extra


def apply_penalties(logits: Tensor, prompt_mask: Tensor, output_counts: Tensor, repetition: Tensor,
                    frequency: Tensor, presence: Tensor) -> Tensor:
    """vLLM's formulas on ``logits [R, V]``: ``prompt_mask [R, V]`` bool, ``output_counts [R, V]`` float32, the
    three penalties ``[R]`` float32 (1, 0, 0: no change to the row, bit for bit)."""
    output_mask = output_counts > 0
    penalties = torch.where(prompt_mask | output_mask, repetition[:, None], 1.0)
    logits = logits * torch.where(logits > 0, 1.0 / penalties, penalties)
    logits = logits - frequency[:, None] * output_counts
    return logits - presence[:, None] * output_mask.float()


class GrammarWalk(Protocol):
    """A constrained request's grammar as the speculative tree builder walks it on the host
    (``engine/sampling/grammar.py``)."""

    words: int  # int32 words of one bitmask row

    def fill(self, path: list[int], out: Tensor) -> bool:
        """Writes the bitmask of the tokens allowed after the committed tokens plus ``path`` into ``out [W]`` int32
        (a host tensor); False when ``path`` itself is not allowed (nothing written)."""
        ...

    def ends(self, token: int) -> bool:
        """Whether ``token`` ends the request (a stop token): a tree grows no children under it."""
        ...


class SamplingState:
    """A rank's sampling state: slots, per-slot settings and the logits processors (module docstring).
    ``grammar``: the grammar processor (``engine.sampling.grammar.GrammarMasks``), None without a tokenizer."""

    def __init__(self, vocab: int, eos_ids: tuple[int, ...], device: torch.device,
                 grammar: LogitsProcessor | None = None):
        self.vocab, self.device = vocab, device
        self.settings = _PerSlot(device)
        for name, dtype, fill in (("temperature", torch.float32, 1.0), ("top_k", torch.int64, 0),
                                  ("top_p", torch.float32, 1.0), ("min_p", torch.float32, 0.0),
                                  ("seed", torch.int64, 0)):
            self.settings.make(name, (), dtype, fill)
        self.grammar = grammar
        self.processors: list[LogitsProcessor] = [LogitBias(vocab, device), MinTokens(vocab, eos_ids, device)]
        self.processors += [grammar] if grammar is not None else []
        self.processors.append(Penalties(vocab, device))
        self.params: dict[int, SamplingParams] = {}
        self.seen: dict[int, int] = {}  # slot → tokens of its history the rank has (prompt + output)
        self.free: list[int] = []
        self.transient: list[int] = []  # slots given to SeqWork without one, for one step
        self.next_slot = 0

    # ---- slots -------------------------------------------------------------------------------------------
    def add(self, req: NewRequest) -> int:
        """A request enters: returns its slot."""
        slot = self.free.pop() if self.free else self._new_slot()
        p = req.params
        self.settings.grow(slot)
        for name, value in (("temperature", p.temperature), ("top_k", top_k_of(p)), ("top_p", p.top_p),
                            ("min_p", p.min_p), ("seed", _int64(req.seed))):
            self.settings[name][slot] = value
        self.params[slot], self.seen[slot] = p, len(req.prompt) + len(req.output)
        for proc in self.processors:
            proc.add(slot, req)
        return slot

    def _new_slot(self) -> int:
        self.next_slot += 1
        return self.next_slot - 1

    def remove(self, slot: int) -> None:
        for proc in self.processors:
            proc.remove(slot)
        del self.params[slot], self.seen[slot]
        self.free.append(slot)

    def bind(self, work: list[SeqWork]) -> list[SeqWork]:
        """``work`` with a slot on every item: items built without one (direct runner callers) get a transient slot
        for this step (their settings; no prompt, so no repetition penalty over it), released at the next call."""
        for slot in self.transient:
            self.remove(slot)
        self.transient = []
        if all(w.slot >= 0 for w in work):
            return work
        out = []
        for w in work:
            if w.slot < 0:
                req = NewRequest(request_id=w.request_id, dp_rank=0, prompt=(), output=(), params=w.params,
                                 seed=w.seed)
                slot = self.add(req)
                self.seen[slot] = w.start + len(w.token_ids)  # nothing it feeds is news
                self.transient.append(slot)
                w = _with_slot(w, slot)
            out.append(w)
        return out

    # ---- histories ---------------------------------------------------------------------------------------
    def feed(self, work: list[SeqWork], last_tokens: Tensor | None) -> None:
        """The tokens ``work`` feeds past what its rank has seen join the histories (a decode's last output token,
        a speculative item's root; a re-prefill after preemption replays nothing). A placeholder (``prev_row``) is
        read on the device from ``last_tokens``, the previous step's sampled rows."""
        slots, tokens, refs = [], [], []
        for w in work:
            have, end = self.seen[w.slot], w.start + len(w.token_ids)
            if end <= have:
                continue
            self.seen[w.slot] = end
            if not any(p.tracks(w.slot) for p in self.processors):
                continue
            for pos in range(max(have, w.start), end):
                placeholder = w.prev_row >= 0 and pos == end - 1
                if placeholder:
                    refs.append((len(tokens), w.prev_row))
                slots.append(w.slot)
                tokens.append(None if placeholder else w.token_ids[pos - w.start])
        self._commit(slots, tokens, refs, last_tokens)

    def accepted(self, work: list[SeqWork], results: list[StepResult]) -> None:
        """A speculative step's accepted drafts (each result's tokens but the bonus, fed as the next root) join
        the histories."""
        slots, tokens = [], []
        for w, r in zip(work, results, strict=True):
            drafts = r.tokens[:-1]
            self.seen[w.slot] += len(drafts)
            if drafts and any(p.tracks(w.slot) for p in self.processors):
                slots += [w.slot] * len(drafts)
                tokens += drafts
        self._commit(slots, tokens, [], None)

    def _commit(self, slots: list[int], tokens: list[int | None], refs: list[tuple[int, int]],
                last_tokens: Tensor | None) -> None:
        if not slots:
            return
        device_tokens = to_device([0 if t is None else t for t in tokens], torch.int64, self.device)
        if refs:
            index, rows = zip(*refs, strict=True)
            device_tokens.index_copy_(0, to_device(index, torch.int64, self.device),
                                      last_tokens[to_device(rows, torch.int64, self.device)])
        for proc in self.processors:
            if any(proc.tracks(s) for s in slots):
                proc.commit(slots, tokens, device_tokens)

    # ---- rows ----------------------------------------------------------------------------------------------
    def plain_rows(self, work: list[SeqWork]) -> Rows:
        """The sampling rows of plainly sampled ``work`` (one per item)."""
        slots = [w.slot for w in work]
        return Rows(slots, to_device(slots, torch.int64, self.device),
                    to_device([w.num_generated for w in work], torch.int64, self.device))

    def batch(self, rows: Rows) -> SamplingBatch:
        """The sampler's rows gathered from the slots' settings."""
        s, at = self.settings, rows.slot_index
        return SamplingBatch(temperature=s["temperature"][at], top_k=s["top_k"][at], top_p=s["top_p"][at],
                             min_p=s["min_p"][at], seed=s["seed"][at], num_generated=rows.num_generated,
                             **host_flags([self.params[slot] for slot in rows.slots]))

    def process(self, logits: Tensor, rows: Rows, grammar: bool = True) -> Tensor | None:
        """``logits [R, V]`` float32 through every processor some row uses (None: none applies); ``grammar``
        False leaves the grammar's masks out (a drafter's rows: their trees are built under it on the host)."""
        out = None
        for proc in self.processors:
            if proc.applies(rows.slots) and (grammar or proc is not self.grammar):
                out = proc.apply(logits if out is None else out, rows)
        return out

    def sample(self, logits: Tensor, rows: Rows) -> SampleOutput:
        """Processes and samples ``rows`` of ``logits [R, V]`` (float32), without host synchronisation."""
        return sample(logits, self.batch(rows), self.process(logits, rows))

    def constrained(self, slot: int) -> bool:
        return self.params[slot].constraint is not None


def _with_slot(w: SeqWork, slot: int) -> SeqWork:
    return dataclasses.replace(w, slot=slot)


def draft_output_index(num_generated: Tensor, rows: int) -> Tensor:
    """``num_generated [J]`` → ``[J, rows]``: the output index whose draw drafter row r proposes. Row r (depth
    r + 1) proposes the child of a depth-r node, accepted iff it equals that node's pick, which draws output index
    ``num_generated + r`` (a node at depth d draws ``num_generated + d``; the root's pick is ``num_generated``)."""
    return num_generated[:, None] + torch.arange(rows, device=num_generated.device)


class TreeSampling:
    """:class:`engine.worker.spec_contract.NodeSampler`: the rank's sampling state over the nodes of speculative
    trees."""

    def __init__(self, state: SamplingState):
        self.state = state

    def couple(self, work: list[SeqWork], logits: Tensor, candidates: int) -> tuple[Tensor, Tensor] | None:
        """Coupled drafting: ``work``'s drafter logits ``[J, D', V]`` → ``(scores [J, D', V], temperature [J])``,
        row r of a sampled request scored as the sampler scores the draw of output index
        :func:`draft_output_index` — logit bias, min_tokens and penalties (over the committed history, not the
        draft's path), its temperature and filters, that index's noise, for each row's ``candidates`` best tokens
        (:func:`coupled_scores`); greedy requests' rows are their logits, temperature 0. None (nothing to couple)
        when no request of ``work`` samples. On the device, without host synchronisation."""
        if all(w.params.temperature <= 0 for w in work):
            return None
        j, d, vocab = logits.shape
        dev, state = self.state.device, self.state
        slots = [w.slot for w in work for _ in range(d)]
        index = draft_output_index(to_device([w.num_generated for w in work], torch.int64, dev), d)
        rows = Rows(slots, to_device(slots, torch.int64, dev), index.reshape(-1))
        flat = logits.reshape(j * d, vocab).float()
        processed = state.process(flat, rows, grammar=False)
        scores = coupled_scores(flat if processed is None else processed, state.batch(rows), candidates)
        temperature = state.settings["temperature"][rows.slot_index].view(j, d)[:, 0].clamp(min=0)
        return torch.where(temperature[:, None, None] > 0, scores.view(j, d, vocab), logits), temperature

    def grammar(self, w: SeqWork) -> GrammarWalk | None:
        g = self.state.grammar
        return g.walk(w.slot) if g is not None else None

    def prepare(self, work: list[SeqWork], tree_size: int, masks: Tensor | None = None) -> Rows:
        slots = [w.slot for w in work for _ in range(tree_size)]
        dev = self.state.device
        return Rows(slots, to_device(slots, torch.int64, dev),
                    to_device([w.num_generated for w in work for _ in range(tree_size)], torch.int64, dev),
                    masks=None if masks is None else to_device(masks, torch.int32, dev))

    def sample(self, rows: Rows, tokens: Tensor, depth: Tensor, ancestors: Tensor, logits: Tensor) -> SampleOutput:
        n = tokens.shape[-1]
        j = len(rows.slots) // n
        tokens, depth, ancestors = tokens[:j], depth[:j], ancestors[:j]
        below_root = ancestors & (depth > 0)[:, None, :]  # [J, N, N]: node i's path, its own token included
        path = torch.where(below_root, tokens[:, None, :], -1).reshape(j * n, n)
        node_rows = dataclasses.replace(rows, num_generated=rows.num_generated + depth.reshape(-1), path=path)
        return self.state.sample(logits[:j * n].float(), node_rows)
