"""The output processor: applies a finished step's results to its requests — computed tokens, appended tokens cut
at the first that ends the request (a stop id or EOS once ``min_tokens`` are out, a stop string the front found, a
length limit), committed KV handed to the KV manager — and turns them into :class:`RequestOutput`s.

Stop strings are matched outside the core (``engine/stop_strings.py``, on the engine thread between the readback and
this update): the front passes, per request, the index of the result token that completes one and the string."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from engine.config import EngineConfig
from engine.core.kv_manager import KVManager
from engine.core.requests import Request
from engine.step import RequestOutput, StepItem, StepResult


class OutputProcessor:
    def __init__(self, cfg: EngineConfig, kv: KVManager, eos_token_ids: tuple[int, ...], overlap: bool,
                 retain_after: frozenset[int], finish: Callable[[Request, str], None],
                 fork: Callable[[Request], None]):
        """``retain_after``: token ids that, ending an output, retain its KV (tool calls). ``finish(req, reason)``
        ends a request; ``fork(req)`` splits an ``n > 1`` request whose shared prompt is computed."""
        self.cfg, self.kv, self.eos, self.overlap = cfg, kv, set(eos_token_ids), overlap
        self.retain_after, self.finish, self.fork = retain_after, finish, fork

    def apply(self, items: list[StepItem], fed: dict[str, Request], results: Mapping[str, StepResult],
              stopped: Mapping[str, tuple[int, str]]) -> list[RequestOutput]:
        """``items``: the step's, ``fed``: the requests it fed, ``results``: per sampled request, ``stopped``:
        request id → (index in its result's tokens, stop string) of a stop-string match. A speculative step commits
        its accepted drafts too: their KV is already compacted in place, so ``num_computed`` covers the bonus-rooted
        path."""
        outputs = []
        for w in items:
            req = fed.get(w.request_id)
            if req is None or req.finish_reason is not None:  # ended (stop, abort) while the step ran
                continue
            if not w.sample:
                req.num_computed = max(req.num_computed, w.start + len(w.token_ids))
                self.kv.commit(req, w.start + len(w.token_ids))
                if req.fork_n and req.num_computed >= len(req.feed_tokens):
                    self.fork(req)
                continue
            outputs.append(self._sampled(req, w, results[w.request_id], stopped.get(w.request_id)))
        return outputs

    def _sampled(self, req: Request, w: StepItem, r: StepResult, stop: tuple[int, str] | None) -> RequestOutput:
        written = w.start + (len(r.tokens) if w.spec else len(w.token_ids))  # fed: the root + accepted drafts
        if self.overlap:  # its KV counted when it was scheduled
            req.pending -= 1
        else:  # spec: the root + accepted drafts are in the KV (len(tokens) - 1 drafts + bonus came back)
            req.num_computed = written
        new, reason = 0, None
        for i, token in enumerate(r.tokens):  # a speculative step's tokens are cut at the first that ends the request
            req.output.append(token)
            new += 1
            reason = self._finish_reason(req, token, stop[1] if stop is not None and stop[0] == i else None)
            if reason:
                break
        req.logprobs += r.logprobs[:new]
        req.top_logprobs += r.top[:new]
        # a speculative step cut at a stop commits up to its last kept token (the rest is not the request's)
        self.kv.commit(req, min(written, len(req.tokens)))
        if reason:
            if req.output and req.output[-1] in self.retain_after:
                self.kv.retain(req)
            self.finish(req, reason)
        return RequestOutput(request_id=req.client_id, index=req.index, new_tokens=r.tokens[:new],
                             finished=reason is not None, finish_reason=reason, num_prompt_tokens=len(req.prompt),
                             num_output_tokens=len(req.output), new_logprobs=r.logprobs[:new],
                             new_top_logprobs=r.top[:new], stop_reason=req.stop_reason,
                             num_cached_tokens=req.num_cached)

    def _finish_reason(self, req: Request, token: int, stop_string: str | None) -> str | None:
        """After ``token`` was appended: "stop" (a stop id or EOS once ``min_tokens`` are out, or the stop string it
        completes), "length", or None."""
        p = req.params
        if len(req.output) >= p.min_tokens and (token in p.stop_token_ids or (token in self.eos and not p.ignore_eos)):
            req.stop_reason = token if token in p.stop_token_ids else None
            return "stop"
        if stop_string is not None:
            req.stop_reason = stop_string
            return "stop"
        if len(req.output) >= p.max_tokens or len(req.tokens) >= self.cfg.scheduler.max_model_len:
            return "length"
        return None
