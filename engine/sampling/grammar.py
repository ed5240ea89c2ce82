"""Structured output with xgrammar: the checkpoint's tokenizer as xgrammar's ``TokenizerInfo``, compiled grammars
cached by the constraint text, and the grammar logits processor (one matcher per constrained request per rank).

Where the matchers live: on every rank of the request's attention-DP group, replayed from the same committed tokens
(the plan's fed tokens and the accepted drafts every rank reads back). Rank 0 does not ship mask bits: a K2 row is
5,120 int32 words (20 KB) per sampled row and per tree node, and the draft tree is built where the draft is made —
on every rank of the group, as the DDTree is already. A constraint compiles once per process (cached by its text,
so an agent's tool list compiles once): rank 0 compiles it before admission, off the engine thread, which is where a
constraint that does not compile is refused; the other ranks start compiling it on their grammar thread when rank 0
receives the request (:meth:`GrammarBackend.compile_soon`, sent by ``Engine.precompile``), so that no rank compiles
on its step path. docs/sampling.md.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
from torch import Tensor

from engine.params import Constraint
from engine.sampling.logits_processors import Rows
from engine.sampling.special_tokens import SpecialTokenError, tokens_for_specials, xgrammar_text
from engine.sampling.thought_gate import ThoughtGate
from engine.sampling.tool_call_tags import forced_calls_end_the_turn
from engine.staging import to_device
from engine.step import NewRequest

log = logging.getLogger(__name__)

CACHE_ENTRIES = 256  # compiled grammars kept per process
JSON_MAX_WHITESPACE = 1  # longest run of whitespace a JSON value may hold (xgrammar's max_whitespace_cnt)


class ConstraintError(ValueError):
    """A constraint that does not compile; the message names the field and says why."""


def _message(err: Exception) -> str:
    """xgrammar's error text without its ``[time] file.cc:line: Check failed: ...`` prefix."""
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return re.sub(r"^\[[0-9:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?", "", text)


def vocab_of_checkpoint(ckpt_dir: Path, vocab_size: int) -> tuple[list[bytes], bool, dict[str, int]]:
    """``(vocab as raw bytes by id, add_prefix_space, special name → id)`` of the checkpoint's tokenizer (the one
    ``model.tokenizer.load_tokenizer`` reads), for xgrammar's ``RAW`` vocabulary type: a ``tiktoken.model``'s ranks
    as they are, a ``tokenizer.json``'s tokens decoded from the way its model stores them (byte-level, byte fallback
    or raw: xgrammar's own decoding). Each special token's text is :func:`xgrammar_text` (no text can match it; a
    structural tag's ``token`` element can) and an unnamed reserved id's is empty (xgrammar never allows it)."""
    from model.tokenizer import TiktokenTokenizer, load_tokenizer

    tok = load_tokenizer(ckpt_dir)
    if tok is None:
        raise ValueError(f"{ckpt_dir} has no tokenizer.json, tiktoken.model or *.tiktoken: structured output needs it")
    if isinstance(tok, TiktokenTokenizer):
        vocab: list[bytes] = [b""] * vocab_size
        for token, rank in tok.ranks.items():
            if rank < vocab_size:
                vocab[rank] = token
        named = {name: i for name, i in tok.special.items() if i in tok.skipped}
        prefix = False
    else:
        vocab, prefix = _decoded(tok, vocab_size)
        named = dict(tok.special)
    specials = {name: i for name, i in named.items() if i < vocab_size}
    for name, i in specials.items():
        vocab[i] = xgrammar_text(name)
    return vocab, prefix, specials


def _decoded(tok, vocab_size: int) -> tuple[list[bytes], bool]:
    """A ``tokenizer.json``'s vocabulary as raw bytes (decoded by xgrammar from its stored form) and whether its
    tokenizer prepends a space."""
    import xgrammar as xgr

    encoded = [""] * vocab_size
    for token, i in tok.tok.get_vocab(with_added_tokens=True).items():
        if i < vocab_size:
            encoded[i] = token
    spec = json.loads(tok.tok.to_str())
    decoders = [spec.get("decoder") or {}]
    decoders += decoders[0].get("decoders", []) if decoders[0].get("type") == "Sequence" else []
    types = {d.get("type") for d in decoders}
    kind, prefix = "RAW", False
    if "ByteLevel" in types:
        kind = "BYTE_LEVEL"
    elif "ByteFallback" in types:
        kind = "BYTE_FALLBACK"
        prefix = any(d.get("type") in ("Metaspace", "Prepend") for d in decoders + [spec.get("normalizer") or {}])
    info = xgr.TokenizerInfo(encoded, getattr(xgr.VocabType, kind), vocab_size=vocab_size, stop_token_ids=[0],
                             add_prefix_space=prefix)  # read for its decoding only (the stop id is unused)
    return list(info.decoded_vocab), prefix


class GrammarBackend:
    """xgrammar for one checkpoint: its ``TokenizerInfo`` (``vocab_size`` = the model's, the config's EOS ids as stop
    tokens, so a completed grammar allows EOS and the request ends there) and a compiler whose results are cached by
    :class:`~engine.params.Constraint`. Thread-safe: the server compiles off the engine thread. JSON's whitespace
    runs are bounded (:data:`JSON_MAX_WHITESPACE`, in JSON schemas, ``json_object`` and a structural tag's JSON that
    sets no bound of its own): with free whitespace a model may emit whitespace until ``max_tokens`` and never close
    the value (what the tiny models here do; vLLM's ``disable_any_whitespace`` answers the same failure)."""

    _shared: dict[tuple, GrammarBackend] = {}

    def __init__(self, ckpt_dir: str | Path, vocab_size: int, eos_ids: tuple[int, ...]):
        self.ckpt_dir, self.vocab_size, self.eos_ids = Path(ckpt_dir), vocab_size, tuple(eos_ids)
        self.words = math.ceil(vocab_size / 32)
        self._lock = threading.Lock()  # the cache and the work under way (held briefly)
        self._building = threading.Lock()  # building the tokenizer info (seconds at a large vocabulary)
        self._compiler = None
        self._cache: OrderedDict[Constraint, object] = OrderedDict()
        self._pending: dict[Constraint | None, Future] = {}  # compile_soon's work under way
        self._thread: ThreadPoolExecutor | None = None
        self.compiles = 0  # compilations run (cache misses)
        self.compiles_in_background = 0  # of them, run on the grammar thread (compile_soon)
        self.specials: dict[str, int] = {}  # special token name → id (structure, never text), known once built
        self.special: frozenset[int] = frozenset()  # their ids and the reserved ones: banned inside a thought
        self.never: frozenset[int] = frozenset()  # ids no grammar allows (empty text: reserved), known once built

    @classmethod
    def for_checkpoint(cls, ckpt_dir: str | Path, vocab_size: int, eos_ids: tuple[int, ...]) -> GrammarBackend:
        """One backend per checkpoint per process (a forked child gets its own: a grammar thread does not survive a
        fork)."""
        key = (os.getpid(), str(Path(ckpt_dir).resolve()), vocab_size, tuple(eos_ids))
        if key not in cls._shared:
            cls._shared[key] = cls(ckpt_dir, vocab_size, eos_ids)
        return cls._shared[key]

    def compiler(self):
        import xgrammar as xgr

        with self._building:
            if self._compiler is None:
                vocab, prefix, self.specials = vocab_of_checkpoint(self.ckpt_dir, self.vocab_size)
                info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=self.vocab_size,
                                         stop_token_ids=list(self.eos_ids), add_prefix_space=prefix)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1)
                self.never = frozenset(info.special_token_ids) - set(self.eos_ids)
                self.special = self.never | frozenset(self.specials.values())
            return self._compiler

    def cached(self, c: Constraint) -> bool:
        with self._lock:
            return c in self._cache

    def under_way(self, c: Constraint) -> bool:
        """Compiled, or being compiled on the grammar thread: :meth:`compile` will not compile it in its caller."""
        with self._lock:
            return c in self._cache or c in self._pending

    def compile_soon(self, c: Constraint | None = None) -> None:
        """Starts compiling ``c`` (None: only building the tokenizer info, the first compile's larger part) on this
        backend's grammar thread, unless it is compiled or under way; :meth:`compile` then waits for that work instead
        of repeating it. xgrammar compiles outside the GIL, so the rank's step loop runs on meanwhile."""
        with self._lock:
            if c in self._cache or c in self._pending or (c is None and self._compiler is not None):
                return
            if self._thread is None:
                self._thread = ThreadPoolExecutor(1, thread_name_prefix="grammar")
            work = self._thread.submit(self.compiler) if c is None else \
                self._thread.submit(self._compile_and_cache, c, True)
            self._pending[c] = work
        work.add_done_callback(lambda _: self._forget(c))

    def _forget(self, c: Constraint | None) -> None:
        with self._lock:
            self._pending.pop(c, None)

    def compile(self, c: Constraint):
        """``c``'s compiled grammar (cached; waits for :meth:`compile_soon`'s work on it); raises
        :class:`ConstraintError` naming the field."""
        with self._lock:
            if c in self._cache:
                self._cache.move_to_end(c)
                return self._cache[c]
            pending = self._pending.get(c)
        if pending is not None and not pending.cancel():  # queued behind other work: compiled here instead
            return pending.result()
        return self._compile_and_cache(c)

    def _compile_and_cache(self, c: Constraint, background: bool = False):
        compiler = self.compiler()
        try:
            compiled = self._compile(compiler, c)
        except ConstraintError:
            raise
        except Exception as err:  # noqa: BLE001 - xgrammar raises RuntimeError (and others) with the reason
            raise ConstraintError(f"{c.field} does not compile: {_message(err)}") from None
        with self._lock:
            self.compiles += 1
            self.compiles_in_background += background
            self._cache[c] = compiled
            while len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, compiler, c: Constraint):
        if c.kind == "json_schema":
            schema = json.dumps(_length_as_pattern(json.loads(c.text)))  # a JSONDecodeError names the position
            return compiler.compile_json_schema(schema, strict_mode=True, max_whitespace_cnt=JSON_MAX_WHITESPACE)
        if c.kind == "json_object":
            return compiler.compile_json_schema('{"type": "object"}', max_whitespace_cnt=JSON_MAX_WHITESPACE)
        if c.kind == "regex":
            return compiler.compile_regex(c.text)
        if c.kind == "grammar":
            return compiler.compile_grammar(c.text)
        if c.kind == "choice":
            choices = json.loads(c.text)
            if not choices or not all(isinstance(x, str) for x in choices):
                raise ConstraintError(f"{c.field} must list at least one string, got {c.text[:200]}")
            return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(x) for x in choices))
        if c.kind == "structural_tag":
            try:
                tag = tokens_for_specials(forced_calls_end_the_turn(json.loads(c.text)), self.specials)
            except SpecialTokenError as err:
                raise ConstraintError(f"{c.field}: {err}") from None
            return compiler.compile_structural_tag(json.dumps(_bounded_whitespace(tag)))
        raise ConstraintError(f"{c.field}: unknown constraint kind")

    def matcher(self, c: Constraint, stop_token_ids: tuple[int, ...] = ()):
        """A matcher of ``c`` whose completion ends at an EOS id or at one of the request's ``stop_token_ids`` that
        the tokenizer marks special (an ordinary token stays text inside the grammar)."""
        import xgrammar as xgr

        compiled = self.compile(c)
        extra = [t for t in dict.fromkeys(stop_token_ids) if t in self.special and t not in self.eos_ids]
        return xgr.GrammarMatcher(compiled, override_stop_tokens=[*self.eos_ids, *extra] if extra else None)

    def walk(self, matcher) -> MatcherWalk:
        return MatcherWalk(matcher, self.words, tuple(matcher.stop_token_ids), self.never)


def _bounded_whitespace(node):
    """A structural tag with :data:`JSON_MAX_WHITESPACE` on each of its JSON-schema formats that sets no bound."""
    if isinstance(node, list):
        return [_bounded_whitespace(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: _bounded_whitespace(v) for k, v in node.items()}
    if out.get("type") == "json_schema" and "json_schema" in out:
        out["json_schema"] = _length_as_pattern(out["json_schema"])
        if out.get("max_whitespace_cnt") is None:
            out["max_whitespace_cnt"] = JSON_MAX_WHITESPACE
    return out


def _length_as_pattern(schema):
    """``schema`` with each plain string that bounds its length (``minLength``/``maxLength``; no pattern, format,
    enum or const) given that bound as a ``pattern`` of plain JSON string characters: xgrammar 0.2.9 compiles such a
    string to a class that excludes only the quote, the backslash, CR and LF, so raw control characters (U+0000 to
    U+001F) get in: not JSON, and smg's parser refuses the call."""
    if isinstance(schema, list):
        return [_length_as_pattern(x) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _length_as_pattern(v) for k, v in schema.items()}
    bounded = "minLength" in out or "maxLength" in out
    if out.get("type") == "string" and bounded and not {"pattern", "format", "enum", "const"} & out.keys():
        low, high = int(out.pop("minLength", 0)), out.pop("maxLength", None)
        out["pattern"] = r'^[^"\\\x00-\x1f]' + f"{{{low},{'' if high is None else int(high)}}}$"
    return out


class MatcherWalk:
    """:class:`engine.sampling.logits_processors.GrammarWalk` over a request's matcher: accept a path, fill, roll
    back."""

    def __init__(self, matcher, words: int, eos_ids: tuple[int, ...], never: frozenset[int] = frozenset()):
        self.matcher, self.words, self.eos, self.never = matcher, words, frozenset(eos_ids), never

    def fill(self, path: list[int], out: Tensor) -> bool:
        m, taken = self.matcher, 0
        if self.never.intersection(path):  # a reserved id: rejected (without xgrammar's warning per call)
            return False
        for token in path:
            if not m.accept_token(token):
                m.rollback(taken)
                return False
            taken += 1
        if m.is_terminated():
            out.fill_(-1)
        else:
            m.fill_next_token_bitmask(out[None], 0)
        m.rollback(taken)
        return True

    def ends(self, token: int) -> bool:
        return token in self.eos


class GrammarMasks:
    """The grammar logits processor: each constrained slot's xgrammar matcher, advanced by its committed tokens;
    a row's mask allows the tokens the grammar allows next (the tree builder's node masks for tree rows)."""

    def __init__(self, backend: GrammarBackend, device: torch.device):
        self.backend, self.device, self.words = backend, device, backend.words
        self.matchers: dict[int, object] = {}
        self.fill_s = 0.0  # host seconds filling plain rows' masks (the bench reads it)

    def add(self, slot: int, req: NewRequest) -> None:
        c = req.params.constraint
        if c is None:
            return
        started, ahead = time.perf_counter(), self.backend.under_way(c)
        m = self.backend.matcher(c, req.params.stop_token_ids)
        if req.params.thought is not None:
            m = ThoughtGate(m, req.params.thought, self.backend.eos_ids + req.params.stop_token_ids,
                            self.backend.special, self.words)
        if not ahead:  # every rank of the group waits for this one at the next collective
            log.warning("request %s: its %s compiled on the step path (%.1f ms; Engine.precompile announces it)",
                        req.request_id, c.field, 1e3 * (time.perf_counter() - started))
        for token in req.output:  # a preempted request's output, replayed
            if not m.accept_token(token):
                log.error("request %s: its output does not follow its %s; left unconstrained", req.request_id,
                          c.field)
                return
        self.matchers[slot] = m

    def remove(self, slot: int) -> None:
        self.matchers.pop(slot, None)

    def tracks(self, slot: int) -> bool:
        return slot in self.matchers

    def commit(self, slots: list[int], tokens: list[int | None], device_tokens: Tensor) -> None:
        for slot, token in zip(slots, tokens, strict=True):
            m = self.matchers.get(slot)
            if m is None or m.is_terminated():
                continue
            if token is None:
                raise RuntimeError("a constrained request's token was not on the host (constrained rows drain overlap)")
            if not m.accept_token(token):
                log.error("slot %d: token %d is outside its grammar; left unconstrained", slot, token)
                del self.matchers[slot]

    def applies(self, slots: list[int]) -> bool:
        return any(s in self.matchers for s in slots)

    def walk(self, slot: int) -> MatcherWalk | None:
        m = self.matchers.get(slot)
        return None if m is None or m.is_terminated() else self.backend.walk(m)

    def fill(self, slots: list[int]) -> Tensor:
        """``[R, W]`` int32 host masks at each slot's committed state (-1: every token, for unconstrained rows)."""
        t0 = time.perf_counter()
        masks = torch.full((len(slots), self.words), -1, dtype=torch.int32)
        for row, slot in enumerate(slots):
            m = self.matchers.get(slot)
            if m is not None and not m.is_terminated():
                m.fill_next_token_bitmask(masks, row)
        self.fill_s += time.perf_counter() - t0
        return masks

    def apply(self, logits: Tensor, rows: Rows) -> Tensor:
        masks = rows.masks if rows.masks is not None else to_device(self.fill(rows.slots), torch.int32,
                                                                     logits.device)
        return logits.masked_fill(~unpack_bits(masks, logits.shape[-1]), -math.inf)


def unpack_bits(masks: Tensor, vocab: int) -> Tensor:
    """``[R, W]`` int32 bitmasks (bit b of word w: token 32w + b) → ``[R, vocab]`` bool, on their device."""
    shifts = torch.arange(32, dtype=torch.int32, device=masks.device)
    return ((masks[:, :, None] >> shifts) & 1).bool().reshape(masks.shape[0], -1)[:, :vocab]
