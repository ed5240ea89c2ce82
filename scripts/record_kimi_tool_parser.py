"""Records what smg's Kimi parsers make of given token sequences, and what smg sends for forced tool calls:
``tests/fixtures/smg_kimik2_parser.json``.

A real worker on the Kimi-format agent checkpoint answers smg's start-up calls through the recording worker
(``tests/support/recording_worker.py``), which answers each chat request with a scripted token sequence (tool-call
sections, bare calls, text before a call, a thought then a call, ...). Every sequence is sent streaming and not,
through smg ``--tool-call-parser kimik2`` with and without ``--reasoning-parser kimi_thinking``; the fixture keeps the
parsed ``content``, ``reasoning_content``, ``tool_calls`` and ``finish_reason`` (streamed deltas reassembled). It also
keeps the structural tag smg sends for ``tool_choice="required"`` and for a named tool, against a worker that reports
``constrained_decoding_start`` ``first_token`` and one that reports ``after_reasoning`` (``server.reasoning_parser``).
With thinking on (the prompt opens a thought) each answer is sent after a thought and its close, and once without.

    .venv/bin/python scripts/record_kimi_tool_parser.py [--out tests/fixtures/smg_kimik2_parser.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from model.tokenizer import load_tokenizer  # noqa: E402
from tests.support.recording_worker import RecordingWorker  # noqa: E402
from tests.support.rpc_helpers import SMG, ServerProcess, smg_gateway  # noqa: E402

CKPT = ROOT / "model" / "zoo" / "tiny_kimi_agent" / "target"
S, E = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["paris", "oslo"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city"], "additionalProperties": False}
ALARM = {"type": "object", "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23}},
         "required": ["hour"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "set_alarm", "description": "An alarm", "parameters": ALARM}}]


def call(name: str, index: int, args: dict) -> str:
    return f"<|tool_call_begin|>functions.{name}:{index}<|tool_call_argument_begin|>{json.dumps(args)}<|tool_call_end|>"


W, A = call("get_weather", 0, {"city": "oslo"}), call("set_alarm", 1, {"hour": 7})
CASES = {  # name → (text, finish reason); "stop" cases end with <|im_end|>
    "section_one_call": (S + W + E, "stop"),
    "section_two_calls": (S + W + A + E, "stop"),
    "section_same_call_twice": (S + W + W + E, "stop"),
    "section_second_call_same_tool_next_index": (S + W + call("get_weather", 1, {"city": "paris"}) + E, "stop"),
    "section_call_index_not_the_tool_position": (S + call("set_alarm", 0, {"hour": 7}) + E, "stop"),
    "section_one_call_cut_by_length": (S + W + E, "length"),
    "section_without_end": (S + W, "stop"),
    "bare_call": (W, "stop"),
    "text_then_section": ("Let me check. " + S + W + E, "stop"),
    "unknown_tool_in_section": (S + call("book_flight", 0, {"to": "oslo"}) + E, "stop"),
    "plain_text": ("It is sunny.", "stop"),
}
THOUGHT = "I call the weather tool.</think>"  # leads each answer when the prompt opens a thought (thinking on)


def ask(oa, stream: bool, thinking: bool, **kw) -> dict:
    """One chat request; the answer as content / reasoning / calls / finish reason (stream deltas reassembled)."""
    msgs = [{"role": "user", "content": "weather in oslo?"}]
    kw["extra_body"] = {"chat_template_kwargs": {"thinking": thinking}}
    if not stream:
        c = oa.chat.completions.create(model="kimi", messages=msgs, tools=TOOLS, max_tokens=200, temperature=0,
                                       **kw).choices[0]
        calls = [{"name": t.function.name, "arguments": t.function.arguments} for t in c.message.tool_calls or []]
        return {"content": c.message.content, "reasoning_content": (c.message.model_extra or {}).get(
            "reasoning_content"), "tool_calls": calls, "finish_reason": c.finish_reason}
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in oa.chat.completions.create(model="kimi", messages=msgs, tools=TOOLS, max_tokens=200, temperature=0,
                                            stream=True, **kw):
        for c in chunk.choices:
            d = c.delta
            content += d.content or ""
            reasoning += (d.model_extra or {}).get("reasoning_content") or ""
            for t in d.tool_calls or []:
                entry = calls.setdefault(t.index, {"name": "", "arguments": ""})
                entry["name"] += (t.function.name or "") if t.function else ""
                entry["arguments"] += (t.function.arguments or "") if t.function else ""
            finish = c.finish_reason or finish
    return {"content": content or None, "reasoning_content": reasoning or None,
            "tool_calls": [calls[i] for i in sorted(calls)], "finish_reason": finish}


def forced_tags(oa, rec: RecordingWorker, end: list[int]) -> dict:
    """The constraint smg sends for ``required`` and a named tool, thinking on and off."""
    out = {}
    for name, kw in (("required", {"tool_choice": "required"}),
                     ("named", {"tool_choice": {"type": "function", "function": {"name": "set_alarm"}}})):
        for thinking in (True, False):
            rec.script = (end, "stop")
            oa.chat.completions.create(model="kimi", messages=[{"role": "user", "content": "hi"}], tools=TOOLS,
                                       max_tokens=50, temperature=0,
                                       extra_body={"chat_template_kwargs": {"thinking": thinking}}, **kw)
            sp = rec.last().sampling_params
            out[f"{name}_thinking_{'on' if thinking else 'off'}"] = {
                "constraint": sp.WhichOneof("constraint"),
                "structural_tag": sp.structural_tag or None,
                "grammar_from_first_token": sp.grammar_from_first_token}
    return out


def main() -> None:
    from openai import OpenAI

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "tests" / "fixtures" / "smg_kimik2_parser.json"))
    ap.add_argument("--model-path", default=str(CKPT), help="a checkpoint with the Kimi agent tokenizer")
    args = ap.parse_args()
    ckpt = Path(args.model_path).resolve()
    tok = load_tokenizer(ckpt)
    end = tok.encode("<|im_end|>")
    doc: dict = {"smg": subprocess.run([str(SMG), "--version"], capture_output=True, text=True).stdout.strip(),
                 "checkpoint": str(ckpt.relative_to(ROOT)) if ckpt.is_relative_to(ROOT) else ckpt.name,
                 "tools": TOOLS, "cases": {}, "forced": {}}
    tmp = Path(tempfile.mkdtemp())
    for worker_parser in (None, "kimi"):
        extra = [f"server.reasoning_parser={worker_parser}"] if worker_parser else []
        srv = ServerProcess(str(ckpt), ["parallel=single", "model=hf", "server.served_model_name=kimi", *extra],
                            tmp / f"server_{worker_parser}.log")
        try:
            srv.wait_ready().close()
            rec = RecordingWorker(srv.target)
            gateways = [("kimik2", []), ("kimik2+kimi_thinking", ["--reasoning-parser", "kimi_thinking"])]
            for label, options in gateways:
                with smg_gateway(rec.target, ckpt, tmp / "smg.log", "--tool-call-parser", "kimik2",
                                 *options) as base:
                    oa = OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
                    start = "after_reasoning" if worker_parser else "first_token"
                    doc["forced"][f"{label}/worker_{start}"] = forced_tags(oa, rec, end)
                    if worker_parser:
                        continue
                    for name, (text, finish) in CASES.items():
                        entry = doc["cases"].setdefault(name, {"text": text, "worker_finish": finish})
                        for thinking, lead in ((False, ""), (True, THOUGHT), (True, "")):
                            rec.script = (tok.encode(lead + text) + (end if finish == "stop" else []), finish)
                            key = f"{label}/thinking_{'on' if thinking else 'off'}" + (
                                "/no_thought_close" if thinking and not lead else "")
                            entry[key] = {"stream": ask(oa, True, thinking), "non_stream": ask(oa, False, thinking)}
            rec.close()
        finally:
            srv.close()
    doc["required_tag"] = doc["forced"]["kimik2/worker_first_token"]["required_thinking_on"]["structural_tag"]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    for name, entry in doc["cases"].items():
        print(name, {k: (len(v["non_stream"]["tool_calls"]), len(v["stream"]["tool_calls"]),
                         v["non_stream"]["finish_reason"]) for k, v in entry.items() if isinstance(v, dict)})


if __name__ == "__main__":
    main()
