"""Special tokens are structure, not text (``engine/sampling/special_tokens.py``), on both bundled tokenizers: the
Kimi agent's ``tiktoken.model`` (named ``<|…|>`` tokens, ``[EOS]``, ``<think>``) and tiny_kimi's ``tokenizer.json``
(its special added tokens).

- No special id is allowed inside a JSON string, under any vocabulary.
- A "model" that puts all its mass on special tokens at every step gets, under each constraint kind, an answer whose
  special tokens stand only where the grammar places them (a tag's begin or end, the final stop) and whose text is
  valid; thinking first, the only special token the thought takes is its close. Draft-tree masks stay exact.
- What ends a constrained answer: its completion, then an EOS id (``config.json``'s and ``generation_config.json``'s:
  Kimi's ``<|im_end|>``) or a request stop id the tokenizer marks special — nothing else, and nothing earlier.
- Beside them: a length-bounded JSON string holds no raw control character (an xgrammar 0.2.9 gap).
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from engine.params import Constraint, Thought
from engine.sampling.grammar import GrammarBackend, unpack_bits
from engine.sampling.special_tokens import SpecialTokenError, tokens_for_specials
from engine.sampling.thought_gate import ThoughtGate
from model.config import load_config
from model.tokenizer import load_tokenizer
from tests.engine.sampling.test_tool_calls import smg_required_tag
from tests.support.paths import REPO_ROOT
from tests.support.trees import node_paths

AGENT = REPO_ROOT / "model" / "zoo" / "tiny_kimi_agent" / "target"
TINY = REPO_ROOT / "model" / "zoo" / "tiny_kimi" / "target"
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer"},
                                           "note": {"type": "string"}},
          "required": ["city", "days"], "additionalProperties": False}
TAG_MARKERS = {AGENT: ("<|im_system|>", "<|im_middle|>", "<|tool_call_end|>"), TINY: ("<|mask|>", "<|mask|>",
                                                                                    "<|pad|>")}


def forced_tag() -> str:
    """The tag smg 1.13 sends for ``tool_choice="required"`` over two tools whose arguments hold free strings."""
    tag = json.loads(smg_required_tag(["get_weather", "set_alarm"]))
    for t in tag["format"]["tags"]:
        t["content"]["json_schema"] = SCHEMA
    return json.dumps(tag)


def agent():
    cfg = load_config(AGENT)
    return GrammarBackend.for_checkpoint(AGENT, cfg.vocab_size, tuple(cfg.eos_token_ids)), load_tokenizer(AGENT)


@pytest.fixture(scope="module", params=[AGENT, TINY], ids=["tiktoken", "tokenizer_json"])
def vocab(request):
    cfg = load_config(request.param)
    backend = GrammarBackend.for_checkpoint(request.param, cfg.vocab_size, tuple(cfg.eos_token_ids))
    backend.compiler()
    return request.param, backend, load_tokenizer(request.param)


def allowed(backend, m) -> set[int]:
    mask = torch.zeros(1, backend.words, dtype=torch.int32)
    m.fill_next_token_bitmask(mask, 0)
    return set(unpack_bits(mask, backend.vocab_size)[0].nonzero().flatten().tolist())


def test_the_tokenizers_mark_their_control_tokens_and_the_config_names_every_stop(vocab):
    ckpt, backend, tok = vocab
    if ckpt == AGENT:
        assert {"[EOS]", "<|im_end|>", "<|tool_call_begin|>", "<think>", "</think>"} <= set(backend.specials)
        assert backend.eos_ids == (1025, 1026)  # config.json's [EOS], then generation_config.json's <|im_end|>
    else:
        assert set(backend.specials) == {"<|endoftext|>", "<|mask|>", "<|pad|>"} and backend.eos_ids == (0,)


def test_no_special_id_is_allowed_inside_a_json_string(vocab):
    _, backend, tok = vocab
    for c in (Constraint("json_object"), Constraint("json_schema", json.dumps(SCHEMA))):
        m = backend.matcher(c)
        assert all(m.accept_token(t) for t in tok.encode('{"city": "os'))
        inside = allowed(backend, m)
        assert len(inside) > 100 and not inside & (backend.special | set(backend.eos_ids))
        for t in sorted(backend.special | set(backend.eos_ids)):  # walked one by one: each refused
            assert not m.accept_token(t), tok.decode([t])


def specials_first(backend, seed: int, steps: int = 256) -> torch.Tensor:
    """``[steps, V]`` logits of a model that puts all its mass on special tokens (stops included) at every step,
    noise elsewhere, and a lean towards closing strings and objects (so a JSON value ends)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(steps, backend.vocab_size, generator=g) * 2
    logits[:, sorted(backend.special | set(backend.eos_ids))] += 50
    return logits


def generate(backend, tok, m, seed: int) -> list[int]:
    """Greedy over :func:`specials_first` under ``m``'s masks, to a stop token (asserted)."""
    logits = specials_first(backend, seed)
    closers = [i for i in range(backend.vocab_size) if any(ch in tok.decode([i]) for ch in '"})]')
               and i not in backend.special]
    logits[:, closers] += 6
    stops, out = set(m.stop_token_ids), []
    for row in logits:
        keep = torch.zeros(backend.vocab_size, dtype=torch.bool)
        keep[sorted(allowed(backend, m))] = True
        t = int(row.masked_fill(~keep, -torch.inf).argmax())
        out.append(t)
        if t in stops:
            return out
        assert m.accept_token(t), tok.decode(out)
    raise AssertionError(f"no stop in {len(out)} tokens: {tok.decode(out)!r}")


def user_tag(ckpt) -> tuple[str, list[str]]:
    """A structural tag of the user's naming special tokens in its begin and end; the special tokens it places."""
    begin, mid, end = TAG_MARKERS[ckpt]
    tag = {"type": "structural_tag", "format": {"type": "tag", "begin": f"{begin}note{mid}",
                                                "content": {"type": "json_schema", "json_schema": SCHEMA},
                                                "end": end}}
    return json.dumps(tag), [begin, mid, end]


CASES = {  # kind → (constraint text, checks the text between the special tokens)
    "json_schema": (json.dumps(SCHEMA), lambda s: jsonschema.validate(json.loads(s), SCHEMA)),
    "json_object": (None, lambda s: isinstance(json.loads(s), dict) or 1 / 0),
    "regex": (r"[a-z]{1,8}-[0-9]{1,3}", lambda s: re.fullmatch(r"[a-z]{1,8}-[0-9]{1,3}", s) or 1 / 0),
    "grammar": ('root ::= "(" item ("," item)* ")"\nitem ::= [a-z]+',
                lambda s: re.fullmatch(r"\([a-z]+(,[a-z]+)*\)", s) or 1 / 0),
    "choice": (json.dumps(["yes", "no", "maybe so"]), lambda s: s in ("yes", "no", "maybe so") or 1 / 0),
}


@pytest.mark.parametrize("kind", [*CASES, "structural_tag"])
def test_a_model_that_wants_only_special_tokens_gets_valid_answers(vocab, kind):
    ckpt, backend, tok = vocab
    if kind == "structural_tag":
        text, markers = user_tag(ckpt)
        check = lambda s: jsonschema.validate(json.loads(s.removeprefix("note")), SCHEMA)  # noqa: E731
    else:
        (text, check), markers = CASES[kind], []
    c = Constraint(kind, text)
    for seed in range(3):
        out = generate(backend, tok, backend.matcher(c), seed)
        placed = [t for t in out[:-1] if t in backend.special]
        assert placed == [backend.specials[n] for n in markers], tok.decode(out)
        assert out[-1] in backend.eos_ids
        check("".join(tok.decode([t]) for t in out[:-1] if t not in backend.special))


def kimi_calls(tok, out: list[int], backend) -> list[tuple[str, dict]]:
    """The calls in a forced answer's tokens, read by id as smg's kimik2 parser reads its text: section begin, then
    per call ``<|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>ARGS<|tool_call_end|>``, section
    end, stop; raises on anything else."""
    s = backend.specials
    names = {i: n for n, i in s.items()}
    text = "".join(names[t] if t in names else tok.decode([t]) for t in out)
    m = re.fullmatch(r"<\|tool_calls_section_begin\|>((?:<\|tool_call_begin\|>[^<]*<\|tool_call_argument_begin\|>"
                     r"[^<]*<\|tool_call_end\|>)+)<\|tool_calls_section_end\|>(\[EOS\]|<\|im_end\|>)", text)
    assert m, text
    calls = re.findall(r"<\|tool_call_begin\|>functions\.(\w+):(\d)<\|tool_call_argument_begin\|>([^<]*)"
                       r"<\|tool_call_end\|>", m.group(1))
    assert len(calls) == m.group(1).count("<|tool_call_begin|>"), text
    return [(name, json.loads(args)) for name, _, args in calls]


@pytest.mark.parametrize("thinking", [False, True])
def test_forced_kimi_calls_under_a_model_that_wants_only_special_tokens(thinking):
    backend, tok = agent()
    c = Constraint("structural_tag", forced_tag())
    close = backend.specials["</think>"]
    for seed in range(4):
        m = backend.matcher(c)
        if thinking:  # the close is the one special token the thought takes: it is taken at once
            m = ThoughtGate(m, Thought(close, 128), backend.eos_ids, backend.special, backend.words)
        out = generate(backend, tok, m, seed)
        if thinking:
            assert out[0] == close
            out = out[1:]
        for name, args in kimi_calls(tok, out, backend):
            assert name in ("get_weather", "set_alarm")
            jsonschema.validate(args, SCHEMA)


def test_draft_tree_masks_under_the_forced_tag_equal_a_fresh_matchers():
    """A drafter leaning on special tokens, inside a call's free string argument: no node of the tree built under
    the forced tag holds one, and each node's mask is a fresh matcher's at its path (DDTree and DFlash read these)."""
    from spec_decode.tree import build_tree_grammar

    backend, tok = agent()
    c = Constraint("structural_tag", forced_tag())
    prefix = tok.encode('<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0'
                        '<|tool_call_argument_begin|>{"city": "os')
    logq = specials_first(backend, 5, 8).log_softmax(-1)
    for chain, budget in ((False, 32), (True, 8)):
        m = backend.matcher(c)
        assert all(m.accept_token(t) for t in prefix)
        masks = torch.zeros(budget + 1, backend.words, dtype=torch.int32)
        tree, _ = build_tree_grammar(logq, prefix[-1], budget, backend.walk(m), masks, chain=chain)
        toks, valid = tree.tokens.tolist(), tree.valid.tolist()
        for i, path in node_paths(tree):
            fresh = backend.matcher(c)
            assert all(fresh.accept_token(t) for t in prefix + path)
            want = torch.full((1, backend.words), -1, dtype=torch.int32)
            if not fresh.is_terminated():
                fresh.fill_next_token_bitmask(want, 0)
            assert torch.equal(masks[i], want[0]), tok.decode(path)
        placed = {t for t, v in zip(toks[1:], valid[1:], strict=True) if v and t in backend.special}
        assert not placed, tok.decode(sorted(placed))  # the drafter's favourites, none inside the string


def test_what_ends_a_constrained_answer(vocab):
    """Before its completion no stop is allowed; after it, exactly the EOS ids and the request's special stop ids."""
    ckpt, backend, tok = vocab
    special_stop = backend.specials["<|im_user|>" if ckpt == AGENT else "<|pad|>"]
    text_stop = tok.encode("x")[0]
    c = Constraint("json_schema", json.dumps(SCHEMA))
    m = backend.matcher(c, (special_stop, text_stop))
    stops = set(backend.eos_ids) | {special_stop}
    answer = tok.encode('{"city": "oslo", "days": 3}')
    for t in answer:
        assert not allowed(backend, m) & stops
        assert m.accept_token(t)
    assert allowed(backend, m) == stops and set(backend.walk(m).eos) == stops
    plain = backend.matcher(c, (text_stop,))  # an ordinary stop id stays text inside the grammar
    assert all(plain.accept_token(t) for t in tok.encode('{"city": "')) and text_stop in allowed(backend, plain)
    plain = backend.matcher(c, (text_stop,))
    assert all(plain.accept_token(t) for t in answer) and allowed(backend, plain) == set(backend.eos_ids)


def test_structural_tags_name_special_tokens_by_id():
    specials = {"<|a|>": 7, "<|b|>": 8}
    tag = {"type": "tag", "begin": "<|a|>x<|b|>", "content": {"type": "const_string", "value": "y<|a|>"},
           "end": "z<|b|>"}
    tok = lambda i: {"type": "token", "token": i}  # noqa: E731
    assert tokens_for_specials(tag, specials) == {
        "type": "tag", "begin": tok(7), "end": tok(8), "content": {"type": "sequence", "elements": [
            {"type": "const_string", "value": "x"}, tok(8),
            {"type": "sequence", "elements": [{"type": "const_string", "value": "y"}, tok(7)]},
            {"type": "const_string", "value": "z"}]}}
    trig = {"type": "triggered_tags", "triggers": ["<|a|>"], "tags": [dict(tag, begin="<|a|>q")],
            "at_least_one": True}
    assert tokens_for_specials(trig, specials)["type"] == "token_triggered_tags"
    untyped = {"type": "triggered_tags", "triggers": ["<x>"], "tags": [{k: v for k, v in tag.items() if k != "type"}]}
    assert tokens_for_specials(untyped, specials)["tags"][0]["begin"] == tok(7)  # smg's tags name no type
    for bad in ({"type": "triggered_tags", "triggers": ["x<|a|>"], "tags": []},
                {"type": "tags_with_separator", "tags": [], "separator": "<|b|>"}):
        with pytest.raises(SpecialTokenError):
            tokens_for_specials(bad, specials)
    assert tokens_for_specials({"type": "any_text", "excludes": ["<|a|>", "stop"]}, specials)["excludes"] == ["stop"]


def test_a_length_bounded_string_holds_no_control_character():
    """xgrammar 0.2.9 lets raw U+0000-U+001F into a string with ``maxLength`` (not JSON: smg refuses such a call);
    the schema's bound goes to a pattern of plain string characters instead, and still bounds the length."""
    backend, tok = agent()
    schema = {"type": "object", "properties": {"label": {"type": "string", "minLength": 2, "maxLength": 6}},
              "required": ["label"]}
    for c in (Constraint("json_schema", json.dumps(schema)),
              Constraint("structural_tag", json.dumps({"format": {"type": "json_schema", "json_schema": schema}}))):
        m = backend.matcher(c)
        assert all(m.accept_token(t) for t in tok.encode('{"label": "a'))
        assert not allowed(backend, m) & set(range(32))  # the agent's ids 0-255 are its bytes
        assert all(m.accept_token(t) for t in tok.encode('bcdef'))
        assert all(tok.decode([t]).startswith('"') for t in allowed(backend, m))  # six: only the close


def test_free_text_around_special_token_triggers_takes_no_other_special_token():
    """A user's ``triggered_tags`` whose trigger is a special token (xgrammar's ``token_triggered_tags`` underneath):
    its free text allows the trigger and the stops, no other special token; the tag's markers stand where it says."""
    backend, tok = agent()
    tag = {"format": {"type": "triggered_tags", "triggers": ["<|tool_call_begin|>"], "at_least_one": False, "tags": [
        {"begin": "<|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>",
         "content": {"type": "json_schema", "json_schema": SCHEMA}, "end": "<|tool_call_end|>"}]}}
    m = backend.matcher(Constraint("structural_tag", json.dumps(tag)))
    free = {backend.specials["<|tool_call_begin|>"], *backend.eos_ids}
    assert all(m.accept_token(t) for t in tok.encode("Let me see. "))
    assert allowed(backend, m) & backend.special == free & backend.special
    call = '<|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{"city": "oslo", "days": 2}<|tool_call_end|>'
    assert all(m.accept_token(t) for t in tok.encode(call + " Done."))
    assert allowed(backend, m) & backend.special == free & backend.special
