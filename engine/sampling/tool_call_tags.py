"""Forced Kimi tool calls that end the turn.

For ``tool_choice="required"`` or a named tool, smg 1.13 (``--tool-call-parser kimik2``) sends a structural tag of
type ``triggered_tags``: triggers ``<|tool_calls_section_begin|>`` and ``<|tool_call_begin|>``, one tag per tool with
and without the section prefix (``begin`` = ``[section begin]<|tool_call_begin|>functions.NAME:INDEX
<|tool_call_argument_begin|>``, the tool's JSON schema, ``end`` = ``<|tool_call_end|>``), ``at_least_one: true``, no
section end. Under xgrammar that grammar is complete but never terminated after a call: any text may follow until
EOS, so a model that does not stop by itself runs to ``max_tokens``; and a call without the section begin is not
one smg's non-streaming parser returns as ``tool_calls``.

What OpenAI's ``required`` means is that the assistant message *is* the calls. So a forced Kimi tag is compiled as
one section holding one or more of its calls (``stop_after_first``: exactly one) and the section end, after which
only a stop token is allowed: the turn ends there. Anything the tag puts before the calls (a ``sequence`` leading
with a thought) is kept.
"""

from __future__ import annotations

SECTION_BEGIN, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL_BEGIN = "<|tool_call_begin|>"


def forced_calls_end_the_turn(tag: dict) -> dict:
    """``tag`` (a structural tag's JSON) with each forced Kimi ``triggered_tags`` (``at_least_one``, tags opening
    calls) replaced by section begin, one or more of its bare calls, section end; other tags unchanged."""
    return _rewrite(tag)


def _rewrite(node):
    if isinstance(node, list):
        return [_rewrite(x) for x in node]
    if not isinstance(node, dict):
        return node
    if _forced_kimi_calls(node):
        return _section(node)
    return {k: _rewrite(v) for k, v in node.items()}


def _forced_kimi_calls(node: dict) -> bool:
    tags = node.get("tags") or []
    return (node.get("type") == "triggered_tags" and node.get("at_least_one") is True and bool(tags)
            and all(isinstance(t, dict) and CALL_BEGIN in str(t.get("begin", "")) for t in tags))


def _section(node: dict) -> dict:
    calls, seen = [], set()
    for t in node["tags"]:
        bare = {**t, "begin": t["begin"].removeprefix(SECTION_BEGIN)}
        if not bare["begin"].startswith(CALL_BEGIN):
            return node  # not Kimi's call shape: left as sent
        key = repr(sorted(bare.items()))
        if key not in seen:
            seen.add(key)
            calls.append({"type": "tag", **bare} if "type" not in bare else bare)
    return {"type": "sequence", "elements": [
        {"type": "const_string", "value": SECTION_BEGIN},
        {"type": "tags_with_separator", "tags": calls, "separator": "", "at_least_one": True,
         "stop_after_first": bool(node.get("stop_after_first", False))},
        {"type": "const_string", "value": SECTION_END}]}
