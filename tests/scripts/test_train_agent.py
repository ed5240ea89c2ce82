"""``scripts/train_tiny_agent.py``'s own parts and the committed ``model/zoo/tiny_kimi_agent`` pair: a rendered
conversation's call section parses back to its calls, which validate; the checkpoint has Kimi's tokenizer format with
the thought pair and the tool-call markers as single tokens, Kimi's stop ids, an 8192-token context, the issue's size
bounds, and a drafter whose mask is a reserved id no grammar allows."""

from __future__ import annotations

import importlib.util
import json
import random
import sys

from bench.agent_tools import TRAIN_NAMES, conversation, render
from model.tokenizer import load_tokenizer
from tests.support.paths import REPO_ROOT

ZOO = REPO_ROOT / "model" / "zoo" / "tiny_kimi_agent"
sys.path.insert(0, str(REPO_ROOT / "scripts"))
_spec = importlib.util.spec_from_file_location("train_tiny_agent", REPO_ROOT / "scripts" / "train_tiny_agent.py")
tta = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tta)


def test_a_rendered_call_section_parses_back_and_validates():
    tools, messages = conversation(random.Random(11), TRAIN_NAMES, thinking=True)
    turn = next(m for m in messages if m.get("tool_calls"))
    text = render(messages, tools)
    calls = tta.parse_calls(text)
    assert calls == [(c["function"]["name"], c["function"]["arguments"]) for c in turn["tool_calls"]]
    assert tta.valid_calls(calls, tools)
    assert not tta.valid_calls([("no_such_tool", "{}")], tools) and not tta.valid_calls([], tools)
    assert "<think>" + turn["reasoning_content"] + "</think>" in text


def test_the_committed_agent_pair_has_kimis_format_and_the_issues_bounds():
    target = ZOO / "target"
    cfg = json.loads((target / "config.json").read_text())
    assert cfg["vocab_size"] <= 4096 and cfg["hidden_size"] <= 256 and cfg["max_position_embeddings"] == 8192
    assert not (target / "tokenizer.json").exists() and (target / "tiktoken.model").exists()
    tok = load_tokenizer(target)
    ids = {name: tok.encode(name) for name in ("<think>", "</think>", "<|tool_calls_section_begin|>",
                                                "<|tool_call_begin|>", "<|tool_call_argument_begin|>",
                                                "<|tool_call_end|>", "<|tool_calls_section_end|>", "<|im_end|>")}
    assert all(len(v) == 1 for v in ids.values()), ids
    stops = json.loads((target / "generation_config.json").read_text())["eos_token_id"]
    assert stops == [tok.encode("[EOS]")[0], ids["<|im_end|>"][0]]
    mask = json.loads((ZOO / "drafter" / "config.json").read_text())["dflash_config"]["mask_token_id"]
    assert tok.decode([mask]).startswith("<|reserved_token_") and mask not in tok.skipped
    log = json.loads((ZOO / "training_log.json").read_text())
    assert 0 <= log["heldout_turns"]["ended_unforced"] <= 1 and log["tokenizer"]["mask_id"] == mask
