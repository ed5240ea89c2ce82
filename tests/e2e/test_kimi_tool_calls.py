"""Kimi tool calls through the real smg on the bundled agent model, as an agent sends them.

One worker (``model=tiny_kimi_agent``, DDTree, ``server.reasoning_parser=kimi``) behind a recording proxy, smg 1.13
with ``--tool-call-parser kimik2`` in front: without a reasoning parser (thinking off: the prompt closes the thought)
and with ``--reasoning-parser kimi_thinking`` (thinking on: the prompt opens it). For ``tool_choice="required"`` and
a named tool, streaming and not: parsed ``tool_calls`` whose arguments validate against their tool's schema,
``finish_reason: "tool_calls"``, fewer tokens than ``max_tokens``; the streamed deltas reassemble to the same calls;
with thinking on the worker's answer holds the thought's close before the call (the grammar waited for it) and smg
returns the call as ``tool_calls``, not as reasoning. Each request smg sent, replayed to a plain-decoding worker,
gives the same tokens (DDTree is lossless under the forced grammar and under the held-back one). smg renders an agent
history (tools, a call, its result) into the very tokens the model was trained on, and the worker reports its
reasoning parser and ``constrained_decoding_start: "after_reasoning"``.
"""

from __future__ import annotations

import json
import random

import grpc
import jsonschema
import pytest
from smg_grpc_proto import vllm_engine_pb2_grpc as pbg

from bench.agent_tools import TRAIN_NAMES, conversation, render
from bench.tool_calls import ToolRequest, chat
from model.tokenizer import load_tokenizer
from rpc.client import Client
from tests.support.paths import REPO_ROOT
from tests.support.recording_worker import RecordingWorker
from tests.support.rpc_helpers import ServerProcess, smg_gateway

TARGET = REPO_ROOT / "model" / "zoo" / "tiny_kimi_agent" / "target"
BASE = ["parallel=single", "model=tiny_kimi_agent", "server.served_model_name=kimi", "engine.max_model_len=2048",
        "server.reasoning_parser=kimi"]
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["paris", "oslo"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city"], "additionalProperties": False}
ALARM = {"type": "object", "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23},
                                          "label": {"type": "string", "maxLength": 8}},
         "required": ["hour"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": name, "description": text, "parameters": schema}}
         for name, text, schema in (("get_weather", "Get a weather", WEATHER), ("set_alarm", "Set a alarm", ALARM))]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
GATEWAYS = {"kimik2": ([], False), "kimik2+kimi_thinking": (["--reasoning-parser", "kimi_thinking"], True)}
MAX_TOKENS = 400


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("kimi_tools")
    ddtree = ServerProcess(str(TARGET), [*BASE, "spec_decode=ddtree"], tmp / "ddtree.log")
    plain = ServerProcess(str(TARGET), BASE, tmp / "plain.log")
    try:
        ddtree.wait_ready().close()
        plain.wait_ready().close()
        rec = RecordingWorker(ddtree.target)
        yield rec, (ddtree, plain), tmp
        rec.close()
    finally:
        ddtree.close()
        plain.close()


@pytest.fixture(scope="module", params=list(GATEWAYS))
def gateway(request, workers):
    from openai import OpenAI

    rec, pair, tmp = workers
    options, thinking = GATEWAYS[request.param]
    with smg_gateway(rec.target, TARGET, tmp / f"smg_{request.param}.log", "--tool-call-parser", "kimik2",
                     *options) as base:
        yield OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0), thinking, rec, pair


@pytest.mark.parametrize("choice", ("required", "named"))
def test_forced_calls_come_back_as_tool_calls_streaming_or_not(gateway, choice):
    oa, thinking, rec, _ = gateway
    close = load_tokenizer(TARGET).encode("</think>")[0]
    answers = {}
    req = ToolRequest(TOOLS, "Get a weather with city oslo", "set_alarm", choice)
    for stream in (False, True):
        a = chat(oa, req, thinking, True, MAX_TOKENS, stream)
        calls = a.calls
        assert calls and a.finish_reason == "tool_calls", (stream, a)
        assert a.completion_tokens < MAX_TOKENS
        for name, args in calls:
            jsonschema.validate(json.loads(args), SCHEMAS[name])
        if choice == "named":
            assert {name for name, _ in calls} == {"set_alarm"}
        sent = rec.last()
        assert sent.sampling_params.WhichOneof("constraint") == "structural_tag"
        assert (list(sent.tokenized.input_ids)[-1] == close) is not thinking  # off: the prompt closed the thought
        answers[stream] = calls
    assert answers[True] == answers[False]


def test_ddtree_gives_plain_decodings_tokens_under_forced_and_held_back_grammars(gateway):
    """Every forced request smg sent so far, replayed non-streaming to the DDTree worker and to a plain one."""
    _, thinking, rec, (ddtree, plain) = gateway
    close = load_tokenizer(TARGET).encode("</think>")[0]
    sent = [r for r in rec.requests if r.sampling_params.WhichOneof("constraint") == "structural_tag"]
    held_back = 0
    with grpc.insecure_channel(ddtree.target) as spec, grpc.insecure_channel(plain.target) as channel:
        for req in sent:
            again = type(req)()
            again.CopyFrom(req)
            again.stream, again.request_id = False, req.request_id + "-replay"
            outs = [_output(pbg.VllmEngineStub(ch), again) for ch in (spec, channel)]
            assert outs[0] == outs[1], req.request_id
            opens_a_thought = list(req.tokenized.input_ids)[-1] != close
            assert (close in outs[0]) is opens_a_thought  # the grammar waited for the thought's close
            held_back += opens_a_thought
    assert len(sent) >= 4 and (held_back or not thinking)


def test_smg_renders_the_training_format_and_the_worker_reports_after_reasoning(gateway):
    oa, thinking, rec, (ddtree, _) = gateway
    tools, messages = conversation(random.Random(5), TRAIN_NAMES, thinking)
    history = [{k: v for k, v in m.items() if k != "reasoning_content"} for m in messages[:-1]]  # as clients send
    assert any(m.get("tool_calls") for m in history) and history[-1]["role"] == "tool"
    oa.chat.completions.create(model="kimi", messages=history, tools=tools, max_tokens=4, temperature=0,
                               extra_body={"chat_template_kwargs": {"thinking": thinking}})
    tok = load_tokenizer(TARGET)
    assert list(rec.last().tokenized.input_ids) == tok.encode(render(history, tools, True, thinking))
    with Client(ddtree.target) as client:
        info = client.server_info()
    assert (info["engine_reasoning_parser"], info["constrained_decoding_start"]) == ("kimi", "after_reasoning")


def _output(stub, req) -> list[int]:
    return [t for resp in stub.Generate(req, timeout=60) if resp.HasField("complete")
            for t in resp.complete.output_ids]
