"""Forced Kimi tool calls end the turn, and constraints wait for the thought's close (host side, no model run).

- The structural tag smg 1.13 sends for ``tool_choice="required"`` (its shape recorded in
  ``tests/fixtures/smg_kimik2_parser.json``) compiles to one section of calls and the section end, then only a stop
  token: bare calls, text before the section, an empty section and (``stop_after_first``) a second call are refused.
- :class:`ThoughtGate`: free text but no stop token inside the thought, only the close after the budget, the grammar
  after the close; rollback restores every state; a tree's node masks equal a fresh matcher's on each path, paths that
  cross the close included.
- :class:`ReasoningParser`: the thought is open when the prompt's last marker is the open one; only a constrained
  request not led by the gateway is gated; a checkpoint without the markers is refused naming the setting.
"""

from __future__ import annotations

import json

import pytest
import torch

from engine.params import Constraint, SamplingParams, Thought
from engine.reasoning import ReasoningParser
from engine.sampling.grammar import GrammarBackend, unpack_bits
from engine.sampling.thought_gate import ThoughtGate
from model.tokenizer import load_tokenizer
from tests.support.paths import REPO_ROOT
from tests.support.trees import node_paths

AGENT = REPO_ROOT / "model" / "zoo" / "tiny_kimi_agent" / "target"
FIXTURE = REPO_ROOT / "tests" / "fixtures" / "smg_kimik2_parser.json"
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "enum": ["paris", "oslo"]},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 7}},
          "required": ["city"], "additionalProperties": False}


@pytest.fixture(scope="module")
def agent():
    cfg = json.loads((AGENT / "config.json").read_text())
    eos = tuple(json.loads((AGENT / "generation_config.json").read_text())["eos_token_id"])
    return GrammarBackend.for_checkpoint(AGENT, cfg["vocab_size"], eos), load_tokenizer(AGENT)


def smg_required_tag(tools: list[str], stop_after_first: bool = False) -> str:
    """The tag smg 1.13 sends for ``tool_choice="required"`` (``kimik2``): two tags per tool, with and without the
    section begin, indexed by the tool's position (the recorded request in the fixture has this shape)."""
    tags = []
    for i, name in enumerate(tools):
        for prefix in ("<|tool_calls_section_begin|>", ""):
            tags.append({"begin": f"{prefix}<|tool_call_begin|>functions.{name}:{i}<|tool_call_argument_begin|>",
                         "content": {"type": "json_schema", "json_schema": SCHEMA}, "end": "<|tool_call_end|>"})
    fmt = {"type": "triggered_tags", "triggers": ["<|tool_calls_section_begin|>", "<|tool_call_begin|>"],
           "tags": tags, "at_least_one": True}
    if stop_after_first:
        fmt["stop_after_first"] = True
    return json.dumps({"format": fmt})


def accepts(backend, tok, constraint: Constraint, text: str) -> tuple[bool, object]:
    m = backend.matcher(constraint)
    return all(m.accept_token(t) for t in tok.encode(text)), m


def allowed_next(backend, m) -> list[int]:
    mask = torch.zeros(1, backend.words, dtype=torch.int32)
    m.fill_next_token_bitmask(mask, 0)
    return unpack_bits(mask, backend.vocab_size)[0].nonzero().flatten().tolist()


def call(name: str, index: int, args: str) -> str:
    return f"<|tool_call_begin|>functions.{name}:{index}<|tool_call_argument_begin|>{args}<|tool_call_end|>"


def test_the_recorded_tag_is_what_the_rewrite_reads():
    recorded = json.loads(FIXTURE.read_text())["required_tag"]
    tag = json.loads(recorded)["format"]
    assert tag["type"] == "triggered_tags" and tag["at_least_one"] is True and "stop_after_first" not in tag
    begins = [t["begin"] for t in tag["tags"]]
    assert any(b.startswith("<|tool_calls_section_begin|><|tool_call_begin|>functions.") for b in begins)
    assert any(b.startswith("<|tool_call_begin|>functions.") for b in begins)


def test_a_forced_kimi_tag_is_one_section_of_calls_then_a_stop(agent):
    backend, tok = agent
    c = Constraint("structural_tag", smg_required_tag(["get_weather", "set_alarm"]))
    section = ("<|tool_calls_section_begin|>" + call("get_weather", 0, '{"city": "oslo"}')
               + call("set_alarm", 1, '{"city": "paris", "days": 3}') + "<|tool_calls_section_end|>")
    ok, m = accepts(backend, tok, c, section)
    assert ok
    assert allowed_next(backend, m) == sorted(backend.eos_ids)  # the turn ends here
    for refused in (call("get_weather", 0, '{"city": "oslo"}'),  # a bare call: smg's non-streaming parser drops it
                    "Sure." + "<|tool_calls_section_begin|>",  # text before the calls
                    "<|tool_calls_section_begin|><|tool_calls_section_end|>",  # no call
                    "<|tool_calls_section_begin|>" + call("get_weather", 1, '{"city": "oslo"}'),  # another index
                    "<|tool_calls_section_begin|>" + call("get_weather", 0, '{"city": "rome"}')):  # outside schema
        assert not accepts(backend, tok, c, refused)[0], refused
    one = Constraint("structural_tag", smg_required_tag(["get_weather", "set_alarm"], stop_after_first=True))
    assert not accepts(backend, tok, one, section)[0]
    ok, m = accepts(backend, tok, one, "<|tool_calls_section_begin|>" + call("set_alarm", 1, '{"city": "oslo"}'))
    nxt = allowed_next(backend, m)  # the section end: its token, or its text spelled from its first byte
    assert ok and tok.encode("<|tool_calls_section_end|>")[0] in nxt
    assert all("<|tool_calls_section_end|>".startswith(tok.decode([t])) for t in nxt), [tok.decode([t]) for t in nxt]


def test_every_answer_the_forced_grammar_allows_is_one_smg_returns_as_tool_calls(agent):
    """The recorded answers (``scripts/record_kimi_tool_parser.py``): each one the forced grammar of the recorded tag
    accepts to the end, a stop included, is one smg 1.13's kimik2 parser returned as ``tool_calls`` with
    ``finish_reason: "tool_calls"``, streaming and not — thinking off, and thinking on behind the thought gate with
    ``kimi_thinking``. Some answers smg would parse are refused (text before the section, no section end): the
    grammar is narrower than the parser, never wider."""
    backend, tok = agent
    fixture = json.loads(FIXTURE.read_text())
    c = Constraint("structural_tag", fixture["forced"]["kimik2/worker_first_token"]["required_thinking_off"][
        "structural_tag"])
    close = tok.encode("</think>")[0]
    allowed = 0
    for name, case in fixture["cases"].items():
        if case["worker_finish"] != "stop":
            continue
        for gate, lead, recorded in ((False, "", "kimik2/thinking_off"),
                                     (True, "I call the weather tool.</think>", "kimik2+kimi_thinking/thinking_on")):
            m = gated(backend, c, close, 128) if gate else backend.matcher(c)
            tokens = tok.encode(lead + case["text"]) + [backend.eos_ids[-1]]
            if not all(m.accept_token(t) for t in tokens):
                continue
            allowed += 1
            for mode in ("non_stream", "stream"):
                parsed = case[recorded][mode]
                assert parsed["tool_calls"] and parsed["finish_reason"] == "tool_calls", (name, recorded, mode)
    assert allowed >= 6  # one call, two calls, the same call twice; each with and without a thought


def test_other_structural_tags_are_compiled_as_sent(agent):
    """A tag that is not a forced Kimi call list keeps xgrammar's meaning: after a triggered tag, free text."""
    backend, tok = agent
    tag = {"format": {"type": "triggered_tags", "triggers": ["<x>"], "tags": [
        {"begin": "<x>", "content": {"type": "json_schema", "json_schema": SCHEMA}, "end": "</x>"}],
        "at_least_one": False}}
    ok, m = accepts(backend, tok, Constraint("structural_tag", json.dumps(tag)), 'hi <x>{"city": "oslo"}</x> bye')
    assert ok and len(allowed_next(backend, m)) > 100


def gated(backend, constraint: Constraint, close: int, budget: int) -> ThoughtGate:
    return ThoughtGate(backend.matcher(constraint), Thought(close, budget), backend.eos_ids, backend.special,
                       backend.words)


def test_the_gate_holds_the_grammar_until_the_close(agent):
    backend, tok = agent
    close = tok.encode("</think>")[0]
    c = Constraint("json_schema", json.dumps(SCHEMA))
    thought = tok.encode("I will answer")
    budget = len(thought) + 3
    g = gated(backend, c, close, budget)
    free = set(allowed_next(backend, g))
    assert not free & (set(backend.eos_ids) | backend.special - {close}) and close in free  # no control token
    assert len(free) > backend.vocab_size // 2
    assert all(g.accept_token(t) for t in thought)
    assert not g.accept_token(backend.eos_ids[0])  # no stop inside the thought
    while g.count < budget:
        assert g.accept_token(tok.encode("x")[0])
    assert allowed_next(backend, g) == [close]  # the budget is spent: the close is forced
    assert g.accept_token(close)
    assert allowed_next(backend, g) == allowed_next(backend, backend.matcher(c))  # the grammar from its start
    answer = tok.encode('{"city": "oslo"}')
    assert all(g.accept_token(t) for t in answer)
    assert sorted(backend.eos_ids) == allowed_next(backend, g)
    g.rollback(len(answer) + 2)  # back across the close, into the thought
    assert g.thinking and g.count == budget - 1
    assert not g.is_terminated() and len(allowed_next(backend, g)) > 100


def test_tree_masks_through_the_gate_equal_a_fresh_matcher_on_each_path(agent):
    from spec_decode.tree import build_tree_grammar

    backend, tok = agent
    close = tok.encode("</think>")[0]
    c = Constraint("json_schema", json.dumps(SCHEMA))
    g = gated(backend, c, close, 2)
    assert g.accept_token(tok.encode("ok")[0])
    logq = (torch.randn(8, backend.vocab_size, generator=torch.Generator().manual_seed(3)) * 3).log_softmax(-1)
    logq[:, close] += 20  # paths that cross the close
    logq[:, tok.encode('{"')[0]] += 4
    budget = 32
    masks = torch.zeros(budget + 1, backend.words, dtype=torch.int32)
    tree, _ = build_tree_grammar(logq, tok.encode("x")[0], budget, backend.walk(g), masks)
    crossed = 0
    for i, path in node_paths(tree):
        crossed += close in path
        fresh = gated(backend, c, close, 2)
        assert all(fresh.accept_token(t) for t in [tok.encode("ok")[0], *path]), path
        want = torch.zeros(1, backend.words, dtype=torch.int32)
        fresh.fill_next_token_bitmask(want, 0)
        assert torch.equal(masks[i], want[0]), path
    assert crossed > 0


def test_a_reasoning_parser_gates_constrained_requests_whose_prompt_is_inside_a_thought(agent, tmp_path):
    _, tok = agent
    parser = ReasoningParser.for_checkpoint("kimi", tok, 128)
    open_, close = tok.encode("<think>")[0], tok.encode("</think>")[0]
    assert (parser.open_id, parser.close_id) == (open_, close)
    inside, closed = [5, open_, 7, close, 9, open_], [5, open_, close]
    assert parser.thought_open(inside) and not parser.thought_open(closed) and not parser.thought_open([5, 6])
    constrained = SamplingParams(constraint=Constraint("json_object"))
    assert parser.gate(inside, constrained, False).thought == Thought(close, 128)
    assert parser.gate(inside, constrained, True).thought is None  # the gateway led the grammar with the thought
    assert parser.gate(closed, constrained, False).thought is None
    assert parser.gate(inside, SamplingParams(), False).thought is None
    from model.tiny_tiktoken import write_tiktoken_checkpoint

    plain = load_tokenizer(write_tiktoken_checkpoint(tmp_path / "plain"))
    with pytest.raises(ValueError, match=r"server.reasoning_parser=kimi: .* no single token for '<think>'"):
        ReasoningParser.for_checkpoint("kimi", plain, 128)
    with pytest.raises(ValueError, match="server.reasoning_parser='qwen3' is not known"):
        ReasoningParser.for_checkpoint("qwen3", tok, 128)
