"""Empty turns (``engine/core/turns.py``): a chat answer that stops with nothing after its thought's close is counted
in the stats record and on ``/metrics``; an answer with content, one cut at ``max_tokens`` and a prompt without
thought markers are not."""

from __future__ import annotations

from engine.core.turns import Turn, thought_marker_ids
from model.tokenizer import load_tokenizer
from tests.support.paths import REPO_ROOT

AGENT = REPO_ROOT / "model" / "zoo" / "tiny_kimi_agent" / "target"
OPEN, CLOSE, EOS, END, X = 1046, 1047, 1025, 1026, 120  # the agent's <think>, </think>, [EOS], <|im_end|>, "x"


def test_a_turn_is_empty_when_nothing_but_a_stop_follows_the_close():
    assert thought_marker_ids(load_tokenizer(AGENT)) == (OPEN, CLOSE)
    stops = frozenset((EOS, END))
    cases = [([5, OPEN], [X, CLOSE, END], "stop", True),  # a thought, then nothing
             ([5, OPEN], [X, X, END], "stop", True),  # the thought never closed: no answer either
             ([5, OPEN, CLOSE], [END], "stop", True),  # thinking off, nothing said
             ([5, OPEN], [X, CLOSE, X, END], "stop", False),  # an answer
             ([5, OPEN, CLOSE], [X, X], "length", False),  # cut, not empty
             ([5, OPEN, CLOSE], [END], "abort", False)]
    for prompt, output, finish, empty in cases:
        turn = Turn.of(prompt, (OPEN, CLOSE), stops)
        for t in output:  # token by token, as steps give them
            turn.see([t])
        assert turn.empty(finish) == empty, (prompt, output, finish)
    assert Turn.of([5, 6], (OPEN, CLOSE), stops) is None  # no thought marker: not a chat turn of a thinking model
    assert Turn.of([5, OPEN], None, stops) is None  # a checkpoint without the markers


def test_empty_turns_reach_the_stats_record_and_metrics():
    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.params import SamplingParams
    from model.loader import load_model
    from parallelism.comm import build_groups
    from parallelism.layout import Layout
    from rpc.metrics import MetricsExporter
    from tests.rpc.test_metrics import samples

    model = load_model(AGENT, build_groups(Layout()))
    engine = Engine(model, EngineConfig.flat(max_num_seqs=4, max_model_len=64, block_size=4, num_blocks=64),
                    tokenizer=load_tokenizer(AGENT))
    exporter, ended = MetricsExporter("agent"), {}
    engine.subscribe(exporter.observe)
    engine.subscribe(lambda r: ended.update({e.prompt_tokens: e for e in r.requests.ended}))
    end_now = SamplingParams(temperature=0.0, max_tokens=8, logit_bias=((END, 100.0),))
    answer_first = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=2, logit_bias=((END, 100.0),))
    for rid, prompt, params in (("off_empty", [5, OPEN, CLOSE], end_now),  # prompt lengths tell them apart
                                ("on_never_closed", [5, 6, 7, 8, OPEN], end_now),
                                ("off_answered", [5, 6, OPEN, CLOSE], answer_first),
                                ("no_markers", [5, 6, 7, 8, 9, 10], end_now)):
        engine.add_request(rid, prompt, params)
    while engine.has_work():
        engine.step()
    got = {n: (e.finish_reason, e.empty_turn) for n, e in ended.items()}
    assert got == {3: ("stop", True), 5: ("stop", True), 4: ("stop", False), 6: ("stop", False)}
    m = samples(exporter.text().decode())
    assert m[("switchyard:empty_turns_total", ())] == 2
    engine.shutdown()
