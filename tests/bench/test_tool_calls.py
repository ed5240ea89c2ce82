"""The tool-call benchmark's parts: drawn arguments are valid under their drawn schemas, held-out tool names are
disjoint from training's, and a response is scored a success only with parsed calls of the request's tools (the named
one when named), valid arguments and no cut at ``max_tokens``."""

from __future__ import annotations

import json
import random

import jsonschema

from bench.agent_tools import HELDOUT_NAMES, TRAIN_NAMES, make_tools, sample_value
from bench.tool_calls import Answer, requests, succeeded, summarize


def test_drawn_arguments_validate_and_held_out_names_were_never_trained_on():
    rng = random.Random(0)
    for _ in range(200):
        for tool in make_tools(rng, TRAIN_NAMES, 2, 8):
            jsonschema.validate(sample_value(tool.parameters, rng), tool.parameters)
    assert not set(HELDOUT_NAMES) & set(TRAIN_NAMES) and len(HELDOUT_NAMES) >= 8
    reqs = requests(6, "named", seed=3)
    assert reqs == requests(6, "named", seed=3)  # the same requests in every cell
    assert all(2 <= len(r.tools) <= 8 and r.wanted in {t["function"]["name"] for t in r.tools} for r in reqs)
    assert all(t["function"]["name"] in HELDOUT_NAMES for r in reqs for t in r.tools)


def test_success_needs_parsed_valid_calls_of_the_requests_tools_and_no_truncation():
    req = requests(1, "named", seed=1)[0]
    other = next(t["function"]["name"] for t in req.tools if t["function"]["name"] != req.wanted)
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in req.tools}[req.wanted]
    args = json.dumps(sample_value(schema, random.Random(2)))
    good = Answer([(req.wanted, args)], "tool_calls", 30, None)
    assert succeeded(req, good)
    assert not succeeded(req, Answer([], "stop", 30, None))
    assert not succeeded(req, Answer([(req.wanted, args)], "length", 400, None))
    assert not succeeded(req, Answer([(other, "{}")], "tool_calls", 30, None))  # not the named tool
    assert not succeeded(req, Answer([("no_such_tool", args)], "tool_calls", 30, None))
    assert not succeeded(req, Answer([(req.wanted, args[:-1])], "tool_calls", 30, None))  # arguments not JSON
    cell = summarize([req, req], [(good, good), (good, Answer([], "length", 400, None))])
    assert (cell["responses"], cell["valid_tool_calls"], cell["truncated"], cell["stream_equal"]) == (4, 0.75, 1, 0.5)
    assert cell["finish_reasons"] == {"tool_calls": 3, "length": 1} and cell["tokens_per_call"] == round(490 / 3, 2)


def test_requests_carry_the_sampling_settings_and_json_schema_answers_are_scored_on_their_content():
    req = requests(2, "required", seed=4)[1]
    greedy, hot = req.body(True, True, 100), req.body(True, True, 100, temperature=1.0)
    assert greedy["temperature"] == 0 and "top_p" not in greedy and greedy["seed"] == req.seed == 5
    assert (hot["temperature"], hot["top_p"], hot["seed"]) == (1.0, 0.95, 5)
    js = requests(1, "json_schema", seed=4)[0]
    body = js.body(False, True, 100, temperature=0.6)
    assert "tools" not in body and body["response_format"]["json_schema"]["schema"] == js.schema
    value = json.dumps(sample_value(js.schema, random.Random(0)))
    assert succeeded(js, Answer([], "stop", 20, None, value))
    assert not succeeded(js, Answer([], "stop", 20, None, value[:-1]))  # not JSON
    assert not succeeded(js, Answer([], "length", 100, None, value))


def test_a_followup_feeds_the_call_and_its_result_back_and_fails_only_when_empty_or_cut():
    from bench.tool_calls import empty

    req = requests(1, "followup", seed=2)[0]
    msgs = req.body(True, True, 100, temperature=1.0)["messages"]
    assert [m["role"] for m in msgs] == ["user", "assistant", "tool"]
    call = msgs[1]["tool_calls"][0]
    assert call["function"]["name"] == req.wanted and msgs[2]["tool_call_id"] == call["id"]
    jsonschema.validate(json.loads(call["function"]["arguments"]), req.schema)
    nothing = Answer([], "stop", 3, "I have the result.", "  ")
    assert empty(nothing) and not succeeded(req, nothing)
    assert succeeded(req, Answer([], "stop", 9, None, "It is done."))
    assert succeeded(req, Answer([(req.wanted, "{}")], "tool_calls", 9, None))
    assert not succeeded(req, Answer([], "length", 200, None, "It is"))
