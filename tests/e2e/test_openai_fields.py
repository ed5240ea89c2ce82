"""The OpenAI field table (``docs/openai_params.md``, "Every sampling field through smg 1.13") kept true: each row's
field is sent through the real smg to a recording proxy in front of the real worker, with the OpenAI SDK, on chat
completions and completions, and what arrived in the ``GenerateRequest`` must be what the row says (honoured, renamed
to what it names, dropped). The day smg changes, this fails."""

import json
import re

import pytest
from google.protobuf import json_format

from tests.support.paths import REPO_ROOT
from tests.support.recording_worker import RecordingWorker
from tests.support.rpc_helpers import ServerProcess, smg_gateway, with_tokenizer

MODEL = "tiny"
SCHEMA = {"type": "object"}
# table field → (request body fragment, what the worker's SamplingParams hold when it arrives; a row whose field
# arrives as another kind of field says "renamed": RENAMED)
PROBES = {
    "`temperature`": ({"temperature": 0.3}, {"temperature": 0.3}),
    "`top_p`": ({"top_p": 0.7}, {"topP": 0.7}),
    "`max_completion_tokens`": ({"max_completion_tokens": 5}, {"maxTokens": 5}),
    "`n`": ({"n": 2, "seed": 1}, {"n": 2, "seed": 1}),
    "`stop`": ({"stop": ["zz"]}, {"stop": ["zz"]}),
    "`presence_penalty`": ({"presence_penalty": 0.5}, {"presencePenalty": 0.5}),
    "`frequency_penalty`": ({"frequency_penalty": 0.5}, {"frequencyPenalty": 0.5}),
    "`logit_bias`": ({"logit_bias": {"5": 10}}, {"logitBias": {"5": 10.0}}),
    "`seed`": ({"seed": 7}, {"seed": 7}),
    "`logprobs` (chat: with `top_logprobs`)": ({"logprobs": 2}, {"logprobs": 2}),
    "`response_format` `json_object`": ({"response_format": {"type": "json_object"}},
                                        {"jsonSchema": '{"type":"object"}'}),
    "`response_format` `json_schema`": ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": SCHEMA}}}, {"jsonSchema": '{"type":"object"}'}),
    "`top_k`": ({"top_k": 5}, {"topK": 5}),
    "`min_p`": ({"min_p": 0.1}, {"minP": 0.1}),
    "`repetition_penalty`": ({"repetition_penalty": 1.2}, {"repetitionPenalty": 1.2}),
    "`min_tokens`": ({"min_tokens": 2}, {"minTokens": 2}),
    "`ignore_eos`": ({"ignore_eos": True}, {"ignoreEos": True}),
    "`stop_token_ids`": ({"stop_token_ids": [9]}, {"stopTokenIds": [9]}),
    "`skip_special_tokens` (`false`)": ({"skip_special_tokens": False}, {"skipSpecialTokens": None}),
    "`spaces_between_special_tokens` (`false`)": ({"spaces_between_special_tokens": False},
                                                  {"spacesBetweenSpecialTokens": None}),
    "`include_stop_str_in_output`": ({"include_stop_str_in_output": True}, {"includeStopStrInOutput": True}),
    "`regex`": ({"regex": "a+"}, {"regex": "a+"}),
    "`ebnf`": ({"ebnf": 'root ::= "a"'}, {"grammar": 'root ::= "a"'}),
    "`guided_choice`": ({"guided_choice": ["a", "b"]}, {"choice": {"choices": ["a", "b"]}}),
    "`guided_regex`": ({"guided_regex": "a+"}, {"regex": "a+"}),
    "`guided_json`": ({"guided_json": SCHEMA}, {"jsonSchema": '{"type":"object"}'}),
    "`guided_grammar`": ({"guided_grammar": 'root ::= "a"'}, {"grammar": 'root ::= "a"'}),
    "`structured_outputs`": ({"structured_outputs": {"regex": "a+"}}, {"regex": "a+"}),
    "`json_schema` (top level, a JSON string)": ({"json_schema": json.dumps(SCHEMA)},
                                                 {"jsonSchema": json.dumps(SCHEMA)}),
}
RENAMED = {"`response_format` `json_object`", "`ebnf`"}
OPENAI_ARGS = {"temperature", "top_p", "max_completion_tokens", "n", "stop", "presence_penalty", "frequency_penalty",
               "logit_bias", "seed", "logprobs", "response_format"}


def table() -> dict[str, tuple[str, str]]:
    """The doc's rows: field → (chat, completions)."""
    text = (REPO_ROOT / "docs" / "openai_params.md").read_text()
    section = text.split("## Every sampling field through smg 1.13", 1)[1].split("\n\n| field |", 1)[1]
    rows = {}
    for line in section.split("\n\n", 1)[0].splitlines()[1:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and not set(cells[0]) <= {"-"}:
            rows[cells[0]] = (cells[1], cells[2])
    return rows


def arrived(field: str, sp: dict, want: dict, baseline: dict) -> str:
    """honoured / renamed / dropped, of a request's SamplingParams (proto JSON) against the probe of ``field``;
    "other: …" when something else arrived."""
    changed = {k: v for k, v in sp.items() if baseline.get(k) != v} | {k: None for k in baseline if k not in sp}
    if not changed:
        return "dropped"
    if changed == want:
        return "renamed" if field in RENAMED else "honoured"
    return f"other: {changed}"


@pytest.fixture(scope="module")
def gateway(tiny_ckpts, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fields")
    ckpt = with_tokenizer(tiny_ckpts["tiny_deepseek"], tmp / "ckpt")
    srv = ServerProcess(str(ckpt), ["parallel=single", f"server.served_model_name={MODEL}"], tmp / "server.log")
    client = recorder = None
    try:
        client = srv.wait_ready()
        recorder = RecordingWorker(srv.target)
        with smg_gateway(recorder.target, ckpt, tmp / "smg.log", "--disable-retries", "--disable-circuit-breaker",
                         model=MODEL) as base:
            yield base, recorder
    finally:
        if recorder is not None:
            recorder.close()
        if client is not None:
            client.close()
        srv.close()


def send(base: str, recorder: RecordingWorker, endpoint: str, body: dict) -> dict:
    """The SamplingParams (proto JSON) of ``body`` sent through smg to ``endpoint`` with the OpenAI SDK."""
    from openai import OpenAI

    oa = OpenAI(base_url=f"{base}/v1", api_key="unused")
    kwargs = {k: v for k, v in body.items() if k in OPENAI_ARGS}
    extra = {k: v for k, v in body.items() if k not in OPENAI_ARGS}
    if endpoint == "completions" and "max_completion_tokens" in kwargs:
        kwargs["max_tokens"] = kwargs.pop("max_completion_tokens")
    if endpoint == "chat" and kwargs.get("logprobs"):
        kwargs["logprobs"], kwargs["top_logprobs"] = True, kwargs["logprobs"]
    before = len(recorder.requests)
    if endpoint == "chat":
        if "max_completion_tokens" not in kwargs:
            kwargs["max_tokens"] = 3
        oa.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi there"}], extra_body=extra,
                                   **kwargs)
    else:
        kwargs.setdefault("max_tokens", 3)
        oa.completions.create(model=MODEL, prompt="hi there", extra_body=extra, **kwargs)
    assert len(recorder.requests) == before + 1, "smg sent no GenerateRequest"
    return json_format.MessageToDict(recorder.last().sampling_params)


def test_every_row_of_the_field_table_is_what_arrives(gateway):
    base, recorder = gateway
    rows = table()
    assert set(rows) == set(PROBES), "the table and the probes name the same fields"
    baselines = {e: send(base, recorder, e, {}) for e in ("chat", "completions")}
    wrong = []
    for field, (body, want) in PROBES.items():
        for endpoint, said in zip(("chat", "completions"), rows[field], strict=True):
            if said == "n/a":
                continue
            got = arrived(field, send(base, recorder, endpoint, body), want, baselines[endpoint])
            if got != said:
                wrong.append(f"{field} on {endpoint}: the table says {said}, smg sent {got}")
    assert not wrong, "\n".join(wrong)


def test_the_table_parser_reads_the_rows():
    rows = table()
    assert rows["`ebnf`"] == ("renamed", "renamed") and rows["`max_completion_tokens`"] == ("honoured", "n/a")
    assert all(re.fullmatch(r"honoured|renamed|dropped|n/a", c) for pair in rows.values() for c in pair), rows
