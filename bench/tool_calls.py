"""The tool-call benchmark (``scripts/bench_tool_calls.py``): held-out tool requests sent through smg's OpenAI chat
endpoint, each once without streaming and once streaming, and what came back scored the way an agent needs it.

A response *succeeds* when smg returned parsed ``tool_calls``, each naming a tool of the request (the named one for
a named ``tool_choice``) with arguments valid under its schema, and the worker did not stop at ``max_tokens``. The
streamed answer is *equal* when its deltas, reassembled by call index, give the same calls as the non-streamed one.
The ``json_schema`` arm sends no tools but ``response_format`` with the wanted tool's parameter schema: it succeeds
when the content is JSON valid under it (not cut at ``max_tokens``). The ``followup`` arm is the turn after a call
(the user's ask, the assistant's call of the wanted tool, its result as a ``role: "tool"`` message, ``tool_choice``
auto): it succeeds unless the answer is *empty* (neither content nor a call, finishing ``stop``) or cut. Requests
sample at ``temperature`` (``top_p`` 0.95 above 0, Kimi's recommended settings) with a seed per request.
"""

from __future__ import annotations

import json
import random
import threading
from dataclasses import dataclass

from bench.agent_tools import HELDOUT_NAMES, ask, make_tools, sample_value

CHOICES = ("required", "named", "auto")
ARMS = (*CHOICES, "json_schema", "followup")
TOP_P = 0.95  # with temperature > 0


@dataclass(frozen=True)
class ToolRequest:
    """One chat request: 2-8 held-out tools, a user ask for one of them (``wanted``), the ``tool_choice``."""

    tools: list[dict]
    user: str
    wanted: str
    choice: str  # "required", "named", "auto", "json_schema" or "followup"
    seed: int = 0
    arguments: str = "{}"  # the wanted call's arguments (the followup arm's past call)

    def body(self, thinking: bool, parallel: bool, max_tokens: int, temperature: float = 0.0) -> dict:
        sampling = {"temperature": temperature, "seed": self.seed, **({"top_p": TOP_P} if temperature > 0 else {})}
        common = {"model": "kimi", "messages": [{"role": "user", "content": self.user}], "max_tokens": max_tokens,
                  **sampling, "extra_body": {"chat_template_kwargs": {"thinking": thinking}}}
        if self.choice == "followup":
            call = {"id": f"functions.{self.wanted}:0", "type": "function",
                    "function": {"name": self.wanted, "arguments": self.arguments}}
            common["messages"] = [*common["messages"], {"role": "assistant", "content": "", "tool_calls": [call]},
                                  {"role": "tool", "tool_call_id": call["id"], "content": '{"status": "done"}'}]
            return {**common, "tools": self.tools, "tool_choice": "auto", "parallel_tool_calls": parallel}
        if self.choice == "json_schema":
            return {**common, "response_format": {"type": "json_schema", "json_schema": {
                "name": self.wanted, "schema": self.schema}}}
        tool_choice = {"type": "function", "function": {"name": self.wanted}} if self.choice == "named" \
            else self.choice
        return {**common, "tools": self.tools, "tool_choice": tool_choice, "parallel_tool_calls": parallel}

    @property
    def schema(self) -> dict:
        return next(t["function"]["parameters"] for t in self.tools if t["function"]["name"] == self.wanted)


def requests(n: int, choice: str, seed: int) -> list[ToolRequest]:
    """``n`` requests over held-out tools (``bench.agent_tools.HELDOUT_NAMES``), seeded."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        tools = make_tools(rng, HELDOUT_NAMES, 2, 8)
        tool = rng.choice(tools)
        args = sample_value(tool.parameters, rng)
        user = ask(tool, args)
        out.append(ToolRequest([t.openai() for t in tools], user[0].upper() + user[1:], tool.name, choice,
                               seed + len(out), json.dumps(args)))
    return out


@dataclass(frozen=True)
class Answer:
    calls: list[tuple[str, str]]  # (name, arguments) in call order
    finish_reason: str | None
    completion_tokens: int
    reasoning: str | None
    content: str | None = None


def succeeded(req: ToolRequest, a: Answer) -> bool:
    """Parsed calls of the request's tools (the named one when named), arguments valid, not cut at max_tokens."""
    import jsonschema

    if req.choice == "followup":
        return not empty(a) and a.finish_reason != "length"
    if req.choice == "json_schema":
        try:
            jsonschema.validate(json.loads(a.content or ""), req.schema)
        except (ValueError, jsonschema.ValidationError):
            return False
        return a.finish_reason != "length"
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in req.tools}
    if not a.calls or a.finish_reason == "length":
        return False
    for name, args in a.calls:
        if name not in schemas or (req.choice == "named" and name != req.wanted):
            return False
        try:
            jsonschema.validate(json.loads(args), schemas[name])
        except (ValueError, jsonschema.ValidationError):
            return False
    return True


def empty(a: Answer) -> bool:
    """An empty turn: it stopped with neither content nor a call (a thought alone does not count)."""
    return a.finish_reason == "stop" and not a.calls and not (a.content or "").strip()


def chat(oa, req: ToolRequest, thinking: bool, parallel: bool, max_tokens: int, stream: bool,
         temperature: float = 0.0) -> Answer:
    """One request through the OpenAI SDK; a streamed answer's deltas reassembled by call index."""
    body = req.body(thinking, parallel, max_tokens, temperature)
    if not stream:
        r = oa.chat.completions.create(**body)
        c = r.choices[0]
        return Answer([(t.function.name, t.function.arguments) for t in c.message.tool_calls or []],
                      c.finish_reason, r.usage.completion_tokens,
                      (c.message.model_extra or {}).get("reasoning_content"), c.message.content)
    calls: dict[int, tuple[str, str]] = {}
    finish, used, reasoning, content = None, 0, "", ""
    for chunk in oa.chat.completions.create(stream=True, stream_options={"include_usage": True}, **body):
        used = chunk.usage.completion_tokens if chunk.usage else used
        for c in chunk.choices:
            reasoning += (c.delta.model_extra or {}).get("reasoning_content") or ""
            content += c.delta.content or ""
            for t in c.delta.tool_calls or []:
                name, args = calls.get(t.index, ("", ""))
                fn = t.function
                calls[t.index] = (name + ((fn.name or "") if fn else ""), args + ((fn.arguments or "") if fn else ""))
            finish = c.finish_reason or finish
    return Answer([calls[i] for i in sorted(calls)], finish, used, reasoning or None, content or None)


def run_cell(oa, reqs: list[ToolRequest], thinking: bool, parallel: bool, max_tokens: int, concurrency: int,
             temperature: float = 0.0) -> list[tuple[Answer, Answer]]:
    """Each request non-streamed then streamed, ``concurrency`` requests in flight; ``(plain, streamed)`` in order."""
    out: list = [None] * len(reqs)
    nxt, lock = [0], threading.Lock()

    def worker() -> None:
        while True:
            with lock:
                i = nxt[0]
                nxt[0] += 1
            if i >= len(reqs):
                return
            out[i] = tuple(chat(oa, reqs[i], thinking, parallel, max_tokens, s, temperature) for s in (False, True))

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def summarize(reqs: list[ToolRequest], answers: list[tuple[Answer, Answer]]) -> dict:
    """The cell's shares (of responses: non-streamed and streamed both count), finish reasons, tokens per call."""
    both = [(r, a) for r, pair in zip(reqs, answers, strict=True) for a in pair]
    ok = [succeeded(r, a) for r, a in both]
    finishes: dict[str, int] = {}
    for _, a in both:
        finishes[str(a.finish_reason)] = finishes.get(str(a.finish_reason), 0) + 1
    calls = sum(len(a.calls) for _, a in both)
    return {"responses": len(both), "valid_tool_calls": round(sum(ok) / len(both), 4),
            "truncated": sum(a.finish_reason == "length" for _, a in both),
            "stream_equal": round(sum(p.calls == s.calls for p, s in answers) / len(answers), 4),
            "finish_reasons": finishes, "calls": calls,
            "tokens_per_call": round(sum(a.completion_tokens for _, a in both) / calls, 2) if calls else None,
            "with_reasoning": sum(bool(a.reasoning) for _, a in both), "empty": sum(empty(a) for _, a in both)}
