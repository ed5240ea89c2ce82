"""Stop strings end generation at the token that completes the match (vLLM's rule), alone and under DFlash and
DDTree, with plain decoding's tokens; ``min_tokens`` holds the check back; the engine's max_model_len defaults to the
model's context and refuses more. The trained tiny_kimi pair (its own tokenizer.json), single rank, greedy."""

import json

import pytest

from engine.config import EngineConfig, RequestError
from engine.engine import Engine
from engine.params import SamplingParams
from engine.stop_strings import IncrementalDetokenizer
from model.loader import load_model
from model.tokenizer import load_tokenizer
from parallelism.comm import build_groups
from spec_decode.config import SpecConfig
from spec_decode.speculation import load_speculation
from tests.support.layouts import layout
from tests.support.paths import REPO_ROOT

ZOO = REPO_ROOT / "model" / "zoo" / "tiny_kimi"
CFG = EngineConfig.flat(max_num_seqs=4, max_num_batched_tokens=256, block_size=16, num_blocks=256)
pytestmark = pytest.mark.skipif(not (ZOO / "drafter" / "config.json").exists(), reason="the trained pair is absent")


@pytest.fixture(scope="module")
def pair():
    model = load_model(str(ZOO / "target"), build_groups(layout("single")))
    prompts = [p["ids"] for p in json.loads((ZOO / "eval_prompts.json").read_text())["prompts"][:3]]
    return model, load_tokenizer(ZOO / "target"), prompts


def run(pair, params_of, spec=None):
    """{request id: (tokens, finish_reason, stop_reason)} for each prompt (``params_of(i)`` its params)."""
    model, tok, prompts = pair
    engine = Engine(model, CFG, speculation=load_speculation(spec, model) if spec else None, tokenizer=tok)
    reasons = {}
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params_of(i))
    tokens = {str(i): [] for i in range(len(prompts))}
    while engine.has_work():
        for out in engine.step():
            tokens[out.request_id] += out.new_tokens
            assert out.num_output_tokens == len(tokens[out.request_id])
            if out.finished:
                reasons[out.request_id] = (out.finish_reason, out.stop_reason)
    assert engine.scheduler.blocks_in_use() == 0
    engine.shutdown()
    return {rid: (tokens[rid], *reasons[rid]) for rid in tokens}


def where_it_stops(tok, out: list[int], stop: str, min_tokens: int) -> int:
    """The reference: the first n >= max(min_tokens, 1) whose decoded text shows ``stop`` ending past the text of
    the first n - 1 tokens (whole decodes, not the engine's incremental ones); 0 when it never does."""
    for n in range(max(min_tokens, 1), len(out) + 1):
        before, text = tok.decode(out[:n - 1], skip_special_tokens=True), tok.decode(out[:n], skip_special_tokens=True)
        at = text.find(stop, max(len(before) - len(stop) + 1, 0))
        if at >= 0 and len(text) > len(before):
            return n
    return 0


def spanning_stop(tok, out: list[int]) -> str:
    """A stop string made of the end of one output token and the start of the next (so it spans tokens); never a
    special token's text, which a client that skips special tokens (smg, as OpenAI) does not see, nor a token that
    ends or starts inside a multi-byte character (decoded alone: U+FFFD) — that is not text."""
    for k in range(4, len(out) - 1):
        a, b = (tok.decode([t], skip_special_tokens=True) for t in out[k:k + 2])
        if len(a) >= 2 and len(b) >= 1 and a.strip() and b.strip() and "\ufffd" not in a + b:
            return a[-2:] + b[:2]
    raise AssertionError("no two printable neighbouring tokens")


def test_incremental_text_equals_the_whole_decode(pair):
    _, tok, prompts = pair
    plain = run(pair, lambda i: SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    for i, p in enumerate(prompts):
        out = plain[str(i)][0]
        detok = IncrementalDetokenizer(tok, p, skip_special_tokens=True)
        assert "".join(detok.add(t) for t in out) == tok.decode(out, skip_special_tokens=True)


@pytest.mark.parametrize("method", ["none", "dflash", "ddtree"])
def test_a_stop_string_ends_generation_at_the_token_that_completes_it(pair, method):
    _, tok, _ = pair
    plain = run(pair, lambda i: SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True))
    stops = {rid: spanning_stop(tok, out) for rid, (out, _, _) in plain.items()}
    drafter = str(ZOO / "drafter")
    spec = {"none": None, "dflash": SpecConfig("dflash", drafter_path=drafter),
            "ddtree": SpecConfig("ddtree", budget=16, drafter_path=drafter)}[method]
    got = run(pair, lambda i: SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True,
                                             stop=("never there", stops[str(i)])), spec)
    for rid, (out, _, _) in plain.items():
        n = where_it_stops(tok, out, stops[rid], 0)
        assert n > 0
        assert got[rid] == (out[:n], "stop", stops[rid]), (rid, stops[rid])


def test_min_tokens_holds_the_check_back(pair):
    _, tok, _ = pair
    plain = run(pair, lambda i: SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True))
    out = plain["0"][0]
    stop = tok.decode([out[1]])[-1]  # a character that shows up at once, and likely again later
    got = run(pair, lambda i: SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, min_tokens=20,
                                             stop=(stop,)))["0"]
    n = where_it_stops(tok, out, stop, 20)
    assert got[0] == (out[:n] if n else out) and len(got[0]) >= 20
    assert got[1:] == (("stop", stop) if n else ("length", None))


def test_max_model_len_is_the_models_context_unless_set_lower():
    assert CFG.for_model(1024).scheduler.max_model_len == 1024
    assert EngineConfig.flat(max_model_len=700).for_model(1024).scheduler.max_model_len == 700
    with pytest.raises(RequestError, match="max_model_len=2048 is above the model's context length 1024"):
        EngineConfig.flat(max_model_len=2048).for_model(1024)


def test_stop_strings_without_a_tokenizer_are_refused(pair):
    model, _, prompts = pair
    engine = Engine(model, CFG)
    with pytest.raises(RequestError, match="stop strings need the checkpoint's tokenizer"):
        engine.add_request("x", prompts[0], SamplingParams(stop=("\n",)))
    engine.shutdown()
