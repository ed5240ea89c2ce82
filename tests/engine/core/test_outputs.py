"""The output processor by hand (``engine/core/outputs.py``): finish reasons "stop" (a stop id, EOS, a stop
string), "length" (max_tokens, max_model_len), ``min_tokens`` holding a stop back, a speculative step's tokens cut at
the first that ends the request, a prefill chunk's computed tokens, and requests that ended while the step ran.
EOS is token 2; blocks of 4 tokens."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.core.kv_manager import KVManager, KVManagerConfig
from engine.core.outputs import OutputProcessor
from engine.core.requests import Request
from engine.params import SamplingParams
from engine.step import StepItem, StepResult

CFG = EngineConfig.flat(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=12, block_size=4, num_blocks=16)
PROMPT = [10, 11, 12, 13, 14]


class Ends:
    def __init__(self):
        self.finished: list[tuple[str, str]] = []
        self.forked: list[str] = []


def processor(overlap=False, retain_after=frozenset()) -> tuple[OutputProcessor, KVManager, Ends]:
    kv = KVManager(KVManagerConfig(num_blocks=16, kv_block_size=4, dp_size=1, namespace=b"t"))
    ends = Ends()
    out = OutputProcessor(CFG, kv, (2,), overlap, retain_after,
                          lambda r, why: ends.finished.append((r.request_id, why)),
                          lambda r: ends.forked.append(r.request_id))
    return out, kv, ends


def running(kv: KVManager, params: SamplingParams, prompt=PROMPT, output=()) -> Request:
    req = Request("r", list(prompt), params, 0, dp_rank=0, client_id="client", output=list(output))
    assert kv.admit(req, 0, 12) == 0
    req.num_computed = len(req.tokens) - 1
    return req


def step(req: Request, tokens: list[int], spec=False, stopped=None, processor_parts=None):
    out, kv, ends = processor_parts or processor()
    start = req.num_computed
    item = StepItem(request_id=req.request_id, token_ids=[req.tokens[-1]], start=start, sample=True,
                    num_generated=len(req.output), decode=bool(req.output), spec=spec)
    result = StepResult(tokens, [-0.5] * len(tokens), [[(t, -0.5)] for t in tokens])
    (output,) = out.apply([item], {req.request_id: req}, {req.request_id: result}, stopped or {})
    return output, ends


@pytest.mark.parametrize(("params", "output", "token", "reason", "stop_reason"), [
    (SamplingParams(max_tokens=5), [], 7, None, None),
    (SamplingParams(max_tokens=5), [], 2, "stop", None),  # EOS
    (SamplingParams(max_tokens=5, ignore_eos=True), [], 2, None, None),
    (SamplingParams(max_tokens=5, stop_token_ids=(7,)), [], 7, "stop", 7),  # a stop id is named
    (SamplingParams(max_tokens=5, stop_token_ids=(7,), ignore_eos=True), [], 7, "stop", 7),
    (SamplingParams(max_tokens=5, min_tokens=2, stop_token_ids=(7,)), [], 7, None, None),  # 1 < min_tokens
    (SamplingParams(max_tokens=5, min_tokens=2), [], 2, None, None),
    (SamplingParams(max_tokens=5, min_tokens=2, stop_token_ids=(7,)), [3], 7, "stop", 7),  # the 2nd: out
    (SamplingParams(max_tokens=2), [3], 8, "length", None),  # max_tokens
    (SamplingParams(max_tokens=20), [3, 4, 5, 6, 7, 8], 9, "length", None),  # 5 + 7 = max_model_len 12
])
def test_finish_reasons(params, output, token, reason, stop_reason):
    parts = processor()
    req = running(parts[1], params, output=output)
    out, ends = step(req, [token], processor_parts=parts)
    assert (out.finish_reason, out.finished, req.stop_reason) == (reason, reason is not None, stop_reason)
    assert out.new_tokens == [token] and req.output == [*output, token]
    assert ends.finished == ([("r", reason)] if reason else [])
    assert (out.request_id, out.num_prompt_tokens, out.num_output_tokens) == ("client", 5, len(output) + 1)
    assert req.num_computed == len(PROMPT) + len(output)  # plain: the token fed is now computed


def test_a_speculative_step_is_cut_at_its_first_stop_token():
    parts = processor()
    req = running(parts[1], SamplingParams(max_tokens=8, stop_token_ids=(7,)), output=[3])
    out, ends = step(req, [4, 7, 8], spec=True, processor_parts=parts)
    assert out.new_tokens == [4, 7] and req.output == [3, 4, 7] and out.finish_reason == "stop"
    assert out.new_logprobs == [-0.5, -0.5] and req.top_logprobs == [[(4, -0.5)], [(7, -0.5)]]
    assert req.num_computed == 5 + 3  # start 5 + root and accepted drafts (3 tokens came back)
    # 8 tokens are the request's (5 + 3): 2 full blocks committed and cached
    assert parts[1].cached_blocks(0, parts[1].index.hashes(req.tokens[:8] + [0])) == 2


def test_a_stop_string_ends_at_the_token_the_front_found():
    req = running(processor()[1], SamplingParams(max_tokens=8), output=[3])
    out, _ = step(req, [4, 5, 6], spec=True, stopped={"r": (1, "</s>")})
    assert out.new_tokens == [4, 5] and out.finish_reason == "stop" and out.stop_reason == "</s>"


def test_a_prefill_chunk_counts_its_tokens_and_an_ended_request_is_skipped():
    out, kv, ends = processor()
    req = running(kv, SamplingParams(max_tokens=4), prompt=list(range(20, 30)))
    req.num_computed = 0
    chunk = StepItem(request_id="r", token_ids=list(range(20, 28)), start=0, sample=False, num_generated=0,
                     decode=False)
    assert out.apply([chunk], {"r": req}, {}, {}) == []
    assert req.num_computed == 8 and kv.committed_blocks(req) == 2
    req.finish_reason = "abort"  # aborted while its next step ran: its results are dropped
    late = StepItem(request_id="r", token_ids=[28, 29], start=8, sample=True, num_generated=0, decode=False)
    assert out.apply([late], {"r": req}, {"r": StepResult([5], [0.0], [[]])}, {}) == []
    assert req.output == [] and req.num_computed == 8 and ends.finished == []


def test_a_tool_call_end_token_retains_the_kv():
    parts = processor(retain_after=frozenset({7}))
    req = running(parts[1], SamplingParams(max_tokens=5, stop_token_ids=(7,)))
    out, ends = step(req, [7], processor_parts=parts)
    assert out.finish_reason == "stop" and parts[1].requests["r"].retain and ends.finished == [("r", "stop")]


def test_a_forking_request_forks_once_its_shared_prompt_is_computed():
    out, kv, ends = processor()
    req = running(kv, SamplingParams(max_tokens=4, n=2), prompt=list(range(20, 29)))  # 9 tokens: it feeds 8
    req.fork_n, req.num_computed = 2, 0
    first = StepItem(request_id="r", token_ids=list(range(20, 24)), start=0, sample=False, num_generated=0,
                     decode=False)
    out.apply([first], {"r": req}, {}, {})
    assert ends.forked == [] and req.num_computed == 4
    rest = StepItem(request_id="r", token_ids=list(range(24, 28)), start=4, sample=False, num_generated=0,
                    decode=False)
    out.apply([rest], {"r": req}, {}, {})
    assert ends.forked == ["r"] and req.num_computed == 8 and kv.committed_blocks(req) == 2
