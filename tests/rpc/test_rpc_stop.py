"""Stop strings served: over gRPC (streamed and not) and through smg with the OpenAI SDK, on the trained tiny_kimi
pair (Python source, so ``"\\n\\n"`` comes up), under plain decoding, DFlash and DDTree: the request ends at the token
that completes the match — the stream's last chunk holds it and nothing follows — ``completion_tokens`` equals the
tokens returned, the tokens equal plain decoding's up to that token, and ``min_tokens`` holds the check back."""

import json

import pytest

from model.tokenizer import load_tokenizer
from tests.engine.test_stop_strings import spanning_stop, where_it_stops
from tests.support.paths import REPO_ROOT
from tests.support.rpc_helpers import ServerProcess, smg_gateway

ZOO = REPO_ROOT / "model" / "zoo" / "tiny_kimi"
TARGET = ZOO / "target"
GREEDY = dict(temperature=0.0, max_tokens=120)
pytestmark = pytest.mark.skipif(not (ZOO / "drafter" / "config.json").exists(), reason="the trained pair is absent")


def prompts() -> list[list[int]]:
    return [p["ids"] for p in json.loads((ZOO / "eval_prompts.json").read_text())["prompts"][:3]]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """One server per speculation mode (a server setting), all started at once."""
    tmp = tmp_path_factory.mktemp("stop")
    procs = {mode: ServerProcess(str(TARGET), ["parallel=single", f"spec_decode={mode}"], tmp / f"{mode}.log")
             for mode in ("none", "dflash", "ddtree")}
    clients = {}
    try:
        clients = {mode: srv.wait_ready() for mode, srv in procs.items()}
        for mode, client in clients.items():
            client.target = procs[mode].target
        yield clients
    finally:
        for c in clients.values():
            c.close()
        for srv in procs.values():
            srv.close()


def test_grpc_stop_strings_end_at_the_matching_token_in_every_mode(servers):
    tok = load_tokenizer(TARGET)
    plain = [servers["none"].generate(p, **GREEDY, ignore_eos=True).token_ids for p in prompts()]
    for mode, client in servers.items():
        for p, out in zip(prompts(), plain, strict=True):
            for stop in ("\n\n", spanning_stop(tok, out)):
                n = where_it_stops(tok, out, stop, 0)
                assert n > 0, (stop, tok.decode(out))
                whole = client.generate(p, **GREEDY, ignore_eos=True, stop=[stop], skip_special_tokens=True)
                stream = client.stream(p, **GREEDY, ignore_eos=True, stop=[stop], skip_special_tokens=True)
                chunks = list(stream)
                for r in (whole, stream.result):
                    assert (r.token_ids, r.finish_reason, r.matched_stop) == (out[:n], "stop", stop), (mode, stop)
                    assert r.completion_tokens == n
                # within one engine step of the match: the chunk holding the matching token is the last
                assert sum(map(len, chunks[:-1])) < n <= sum(map(len, chunks)), (mode, [len(c) for c in chunks])


def test_min_tokens_with_a_stop_string_over_grpc(servers):
    tok = load_tokenizer(TARGET)
    p = prompts()[0]
    out = servers["none"].generate(p, **GREEDY, ignore_eos=True).token_ids
    n = where_it_stops(tok, out, "\n", 20)
    assert 0 < where_it_stops(tok, out, "\n", 0) < 20 <= n  # a newline comes early; min_tokens skips it
    for mode, client in servers.items():
        r = client.generate(p, **GREEDY, ignore_eos=True, stop=["\n"], min_tokens=20, skip_special_tokens=True)
        assert (r.token_ids, r.finish_reason, r.completion_tokens) == (out[:n], "stop", n), mode


@pytest.fixture(scope="module")
def gateway(servers, tmp_path_factory):
    """smg in front of the DDTree server."""
    with smg_gateway(servers["ddtree"].target, TARGET, tmp_path_factory.mktemp("smg") / "smg.log",
                     "--disable-retries") as base:
        yield base


def test_openai_sdk_stop_through_smg(gateway, servers):
    from openai import OpenAI

    tok = load_tokenizer(TARGET)
    client = OpenAI(base_url=f"{gateway}/v1", api_key="none")
    prompt = tok.decode(prompts()[1])
    ids = tok.encode(prompt)
    out = servers["none"].generate(ids, **GREEDY, ignore_eos=True).token_ids
    n = where_it_stops(tok, out, "\n\n", 0)
    assert n > 0
    done = client.completions.create(model="target", prompt=prompt, max_tokens=120, temperature=0, stop=["\n\n"])
    assert done.choices[0].finish_reason == "stop" and done.usage.completion_tokens == n
    assert done.choices[0].text == tok.decode(out[:n], skip_special_tokens=True).split("\n\n")[0]
    chunks = list(client.completions.create(model="target", prompt=prompt, max_tokens=120, temperature=0,
                                            stop=["\n\n"], stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == done.choices[0].text and chunks[-1].usage.completion_tokens == n
    low = client.completions.create(model="target", prompt=prompt, max_tokens=120, temperature=0, stop=["\n"],
                                    extra_body={"min_tokens": 20})
    assert low.usage.completion_tokens >= 20
