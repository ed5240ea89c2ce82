"""Synthetic agent tools and conversations: seeded tool schemas (nested objects, enums, arrays, optional fields),
arguments drawn from a schema, a user ask that names the tool's purpose and its arguments, and whole OpenAI-format
conversations (a call, the tool's result, a short answer; or a plain answer with no call) with and without a thought.

Two uses: the training data of ``model=tiny_kimi_agent`` (``scripts/train_tiny_agent.py``, tool names from
:data:`TRAIN_NAMES`) and the held-out requests of the tool-call benchmark (``scripts/bench_tool_calls.py``, tool
names from :data:`HELDOUT_NAMES`: verb-noun pairs training never saw, a seeded fifth of them; schemas are drawn per
request either way).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

VERBS = ("get", "set", "find", "create", "delete", "list", "update", "send", "book", "check", "run", "open")
NOUNS = ("weather", "alarm", "file", "ticket", "email", "flight", "meeting", "order", "user", "branch", "invoice",
         "note", "playlist", "reminder", "server", "report")
_ALL_NAMES = tuple(f"{v}_{n}" for v in VERBS for n in NOUNS)
_HELD = frozenset(random.Random(7).sample(_ALL_NAMES, len(_ALL_NAMES) // 5))
TRAIN_NAMES = tuple(n for n in _ALL_NAMES if n not in _HELD)
HELDOUT_NAMES = tuple(n for n in _ALL_NAMES if n in _HELD)
FIELDS = ("city", "name", "label", "path", "query", "priority", "count", "days", "hour", "tags", "mode", "email",
          "size", "owner", "status", "limit", "title", "region", "color", "level")
WORDS = ("paris", "oslo", "alpha", "beta", "main", "docs", "red", "green", "blue", "urgent", "daily", "lisbon",
         "kyoto", "delta", "notes", "build", "quick", "north", "south", "cloud", "river", "stone", "amber", "tiger")
SMALL_TALK = (("hello", "Hello! How can I help?"), ("thanks", "You're welcome."), ("who are you?", "An assistant."),
              ("what can you do?", "I can call the tools listed for this chat."), ("ok", "Okay."),
              ("good morning", "Good morning!"))


@dataclass(frozen=True)
class Tool:
    """An OpenAI function tool: ``name``, ``description``, JSON-schema ``parameters`` (an object)."""

    name: str
    description: str
    parameters: dict

    def openai(self) -> dict:
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


def _leaf_schema(rng: random.Random, depth: int) -> dict:
    kind = rng.choice(("string", "enum", "integer", "number", "boolean", "array", "object") if depth < 1
                      else ("string", "enum", "integer", "boolean"))
    if kind == "string":
        return {"type": "string", "maxLength": rng.choice((8, 12, 16))}
    if kind == "enum":
        return {"type": "string", "enum": rng.sample(WORDS, rng.randint(2, 4))}
    if kind == "integer":
        lo = rng.choice((0, 1))
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.choice((9, 23, 99))}
    if kind == "number":
        return {"type": "number", "minimum": 0, "maximum": 10}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "array":
        return {"type": "array", "items": {"type": "string", "enum": rng.sample(WORDS, 3)}, "minItems": 1,
                "maxItems": 3}
    return _object_schema(rng, depth + 1, rng.randint(1, 2))


def _object_schema(rng: random.Random, depth: int, fields: int) -> dict:
    names = rng.sample(FIELDS, fields)
    props = {n: _leaf_schema(rng, depth) for n in names}
    required = [n for n in names if rng.random() < 0.7] or names[:1]
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def make_tool(name: str, rng: random.Random) -> Tool:
    """A tool named ``name`` with 1-4 parameters (nested objects, enums, arrays, optional fields)."""
    verb, noun = name.split("_", 1)
    return Tool(name, f"{verb.capitalize()} a {noun}", _object_schema(rng, 0, rng.randint(1, 4)))


def make_tools(rng: random.Random, names: tuple[str, ...], lo: int = 2, hi: int = 8) -> list[Tool]:
    """``lo..hi`` distinct tools named from ``names``."""
    return [make_tool(n, rng) for n in rng.sample(names, rng.randint(lo, min(hi, len(names))))]


def sample_value(schema: dict, rng: random.Random):
    """A value valid under ``schema`` (the subset :func:`make_tool` writes); optional fields kept half the time."""
    if "enum" in schema:
        return rng.choice(schema["enum"])
    kind = schema["type"]
    if kind == "string":
        word = rng.choice(WORDS)
        return word[:schema.get("maxLength", 16)]
    if kind == "integer":
        return rng.randint(schema["minimum"], schema["maximum"])
    if kind == "number":
        return round(rng.uniform(schema["minimum"], schema["maximum"]), 1)
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "array":
        return [sample_value(schema["items"], rng) for _ in range(rng.randint(schema["minItems"], schema["maxItems"]))]
    return {k: sample_value(v, rng) for k, v in schema["properties"].items()
            if k in schema["required"] or rng.random() < 0.5}


def ask(tool: Tool, args: dict, by_name: bool = False) -> str:
    """The user's request for a call of ``tool`` with ``args``: its purpose (``by_name``: its name) and the argument
    values in words."""
    return f"{'use ' + tool.name if by_name else tool.description.lower()} with {_words(args)}"


def _words(value) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{k} {_words(v)}" for k, v in value.items()) or "defaults"
    if isinstance(value, list):
        return " and ".join(_words(v) for v in value)
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value)


def call_id(name: str, index: int) -> str:
    """Kimi K2's tool-call id: ``functions.NAME:INDEX``."""
    return f"functions.{name}:{index}"


def render(messages: list[dict], tools: list[dict], add_generation_prompt: bool = False,
           thinking: bool = True) -> str:
    """The agent checkpoint's chat template (``model.tiny_tiktoken.AGENT_TEMPLATE``) as smg renders it: ``tojson`` =
    ``json.dumps`` with its default separators (``tests/e2e/test_kimi_tool_calls.py`` compares with what smg sends)."""
    import jinja2

    from model.tiny_tiktoken import AGENT_TEMPLATE

    env = jinja2.Environment()
    env.filters["tojson"] = json.dumps
    return env.from_string(AGENT_TEMPLATE).render(messages=messages, tools=tools,
                                                  add_generation_prompt=add_generation_prompt, thinking=thinking)


def conversation(rng: random.Random, names: tuple[str, ...], thinking: bool) -> tuple[list[dict], list[dict]]:
    """``(tools, messages)`` of one synthetic agent turn in OpenAI format, ending with the assistant's last message:
    most often a call of one tool (two in one message sometimes), the tool's result, a short answer; sometimes small
    talk answered without a call. Assistant messages carry ``reasoning_content`` when ``thinking``."""
    tools = make_tools(rng, names, 1, 4)
    if rng.random() < 0.15:
        said, answer = rng.choice(SMALL_TALK)
        return [t.openai() for t in tools], [{"role": "user", "content": said},
                                             _assistant(answer, [], "No tool is needed." if thinking else None)]
    chosen = rng.sample(tools, 2 if len(tools) > 1 and rng.random() < 0.2 else 1)
    calls = [(t, sample_value(t.parameters, rng)) for t in chosen]
    asks = " and ".join(ask(t, a, rng.random() < 0.4) for t, a in calls)
    messages: list[dict] = []
    if rng.random() < 0.3:
        messages.append({"role": "system", "content": "You are a helpful agent. Use the tools."})
    messages.append({"role": "user", "content": asks[0].upper() + asks[1:]})
    tool_calls = [{"id": call_id(t.name, i), "type": "function",
                   "function": {"name": t.name, "arguments": json.dumps(a)}} for i, (t, a) in enumerate(calls)]
    thought = f"The user wants to {asks}. I call {' and '.join(t.name for t in chosen)}." if thinking else None
    messages.append(_assistant("", tool_calls, thought))
    for call in tool_calls:
        result = {"ok": True, "result": rng.choice(WORDS)}
        messages.append({"role": "tool", "tool_call_id": call["id"], "content": json.dumps(result)})
    done = ", ".join(f"{t.name} gave {json.loads(m['content'])['result']}"
                     for (t, _), m in zip(calls, messages[-len(calls):], strict=True))
    messages.append(_assistant(f"Done: {done}.", [], "The tools answered." if thinking else None))
    return [t.openai() for t in tools], messages


def _assistant(content: str, tool_calls: list[dict], thought: str | None) -> dict:
    msg: dict = {"role": "assistant", "content": content}
    if tool_calls:
        msg["tool_calls"] = tool_calls
    if thought is not None:
        msg["reasoning_content"] = thought
    return msg
