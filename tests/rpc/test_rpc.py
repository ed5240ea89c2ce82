"""The gRPC service on a real 2-rank server (``scripts/serve.py`` subprocess, loopback) with real clients: streamed
greedy tokens equal HF transformers', every bad input gets INVALID_ARGUMENT naming its field, cancel / deadline /
Abort free the KV (GetLoads back to zero), overflow gets RESOURCE_EXHAUSTED, and the info RPCs, health and
reflection answer."""

import math
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from smg_grpc_proto import vllm_engine_pb2 as pb

from tests.support.patience import patience
from tests.support.rpc_helpers import ServerProcess, hf_greedy, layout_args

PROMPTS = [[5, 17, 3, 99, 150, 7, 64, 31, 8, 202, 11], [2, 4, 6], [200, 1, 77, 90, 13, 45, 46], [9]]
N_TOKENS = 12
CKPT = "tiny_qwen3_moe"
LONG = dict(max_tokens=400, ignore_eos=True, temperature=0.0)


@pytest.fixture(scope="module")
def server(tiny_ckpts, tmp_path_factory):
    log = tmp_path_factory.mktemp("rpc") / "server.log"
    srv = ServerProcess(tiny_ckpts[CKPT], [*layout_args(2), "server.max_num_seqs=2", "server.max_queue=2",
                                           "server.heartbeat_s=0.5"], log)
    client = srv.wait_ready()
    yield srv, client
    client.close()
    srv.close()


def wait_idle(client, timeout: float = 15.0) -> dict:
    """GetLoads until nothing runs, waits or holds KV; returns the last load."""
    deadline = time.monotonic() + patience(timeout)
    while True:
        load = client.loads()
        if load["num_running_reqs"] == 0 and load["num_waiting_reqs"] == 0 and load["kv_usage"] == 0:
            return load
        assert time.monotonic() < deadline, f"KV/requests not released: {load}"
        time.sleep(0.05)


def test_streamed_greedy_matches_hf(server, tiny_ckpts):
    _, client = server
    ref = hf_greedy(tiny_ckpts[CKPT], PROMPTS, N_TOKENS)
    greedy = dict(max_tokens=N_TOKENS, min_tokens=N_TOKENS, temperature=0.0)

    def streamed(prompt):
        s = client.stream(prompt, **greedy)
        deltas = list(s)
        return deltas, s.result

    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # all in flight together: continuous batching
        results = list(pool.map(streamed, PROMPTS))
    for i, (deltas, result) in enumerate(results):
        assert [t for d in deltas for t in d] == ref[i], f"prompt {i}"
        assert all(deltas) and result.finish_reason == "length"
        assert result.prompt_tokens == len(PROMPTS[i]) and result.completion_tokens == N_TOKENS
        assert result.token_ids == ref[i]
    once = client.generate(PROMPTS[0], **greedy)  # non-stream: one Complete with every id
    assert (once.token_ids, once.finish_reason, once.completion_tokens) == (ref[0], "length", N_TOKENS)
    lp = client.stream(PROMPTS[1], logprobs=2, **greedy)
    list(lp)
    assert len(lp.result.logprobs) == N_TOKENS and all(x <= 0 for x in lp.result.logprobs)
    wait_idle(client)


def _raw(client, **fields):
    req = pb.GenerateRequest(request_id=f"raw-{time.monotonic_ns()}", stream=True, **fields)
    return list(client.stub.Generate(req, timeout=patience(30)))


BAD = [
    ("empty prompt", lambda c: c.generate([], max_tokens=4), "prompt is empty"),
    ("token id >= vocab", lambda c: c.generate([1, 203], max_tokens=4), "token ids must be in [0, 203)"),
    ("prompt + max_tokens > max_model_len", lambda c: c.generate([1] * 10, max_tokens=510), "max_model_len 512"),
    ("max_tokens 0", lambda c: c.generate([1], max_tokens=0), "max_tokens must be >= 1"),
    ("no room left", lambda c: c.generate([1] * 512), "max_model_len 512"),
    ("temperature < 0", lambda c: c.generate([1], max_tokens=4, temperature=-0.5), "temperature"),
    ("temperature NaN", lambda c: c.generate([1], max_tokens=4, temperature=math.nan), "temperature"),
    ("top_p > 1", lambda c: c.generate([1], max_tokens=4, top_p=1.5), "top_p"),
    ("top_p < 0", lambda c: c.generate([1], max_tokens=4, top_p=-0.1), "top_p"),
    ("top_k < -1", lambda c: c.generate([1], max_tokens=4, top_k=-2), "top_k must be >= -1"),
    ("min_p > 1", lambda c: c.generate([1], max_tokens=4, min_p=2.0), "min_p"),
    ("min_tokens > max_tokens", lambda c: c.generate([1], max_tokens=4, min_tokens=5), "min_tokens"),
    ("logprobs > 20", lambda c: c.generate([1], max_tokens=4, logprobs=21), "logprobs"),
    ("stop id >= vocab", lambda c: c.generate([1], max_tokens=4, stop_token_ids=[999]), "stop_token_ids"),
    ("text input", lambda c: _raw(c, text="hello"), "text input is not supported"),
    ("structured output", lambda c: _raw(c, tokenized=pb.TokenizedInput(input_ids=[1]),
                                         sampling_params=pb.SamplingParams(max_tokens=2, regex="a+")), "regex"),
    ("unknown abort id", lambda c: c.abort("never-sent"), "request_ids"),
]


def test_bad_inputs_are_invalid_argument_naming_the_field(server):
    _, client = server
    for what, call, words in BAD:
        with pytest.raises(grpc.RpcError) as err:
            call(client)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, f"{what}: {err.value}"
        assert words in err.value.details(), f"{what}: {err.value.details()!r} lacks {words!r}"
    ok = client.generate([1], max_tokens=2, top_k=-1, top_p=0.0)  # -1 and proto3's unset 0 both mean "off"
    assert ok.completion_tokens == 2
    wait_idle(client)


def test_cancel_deadline_and_abort_free_kv(server):
    _, client = server
    s = client.stream(PROMPTS[0], **LONG)
    it = iter(s)
    next(it), next(it)
    assert client.loads()["kv_usage"] > 0
    s.cancel()
    with pytest.raises(grpc.RpcError) as err:
        list(it)
    assert err.value.code() == grpc.StatusCode.CANCELLED
    wait_idle(client)
    client.abort(s.request_id)  # a cancelled id is known: OK (smg sends Abort after cancelling)

    with pytest.raises(grpc.RpcError) as err:
        client.generate(PROMPTS[1], timeout=0.5, **LONG)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_idle(client)

    s = client.stream(PROMPTS[2], **LONG)
    it = iter(s)
    next(it)
    client.abort(s.request_id)
    rest = list(it)
    assert s.result.finish_reason == "abort" and len(rest) < LONG["max_tokens"]
    client.abort(s.request_id)  # finished: OK
    wait_idle(client)


def test_over_capacity_is_resource_exhausted(server):
    _, client = server
    streams = [client.stream(p, **LONG) for p in PROMPTS]  # max_num_seqs 2 running + max_queue 2 waiting
    deadline = time.monotonic() + 15
    while (lambda ld: ld["num_running_reqs"] + ld["num_waiting_reqs"])(client.loads()) < len(streams):
        assert time.monotonic() < deadline, "4 streams never all admitted"
        time.sleep(0.05)
    with pytest.raises(grpc.RpcError) as err:
        client.generate([3, 4], max_tokens=4)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "capacity" in err.value.details()
    for s in streams:
        s.cancel()
    wait_idle(client)
    assert client.generate([3, 4], max_tokens=4).completion_tokens == 4  # room again


def test_health_reflection_and_info(server, tiny_ckpts):
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    srv, client = server
    assert client.health() == "SERVING" and client.health("vllm.grpc.engine.VllmEngine") == "SERVING"
    assert client.health_check() == (True, "ok")
    services = set(ProtoReflectionDescriptorDatabase(client.channel).get_services())
    assert {"vllm.grpc.engine.VllmEngine", "switchyard.v1.EngineInfo", "grpc.health.v1.Health"} <= services

    model = client.model_info()
    assert model["model_path"] == model["tokenizer_path"] == str(Path(tiny_ckpts[CKPT]).resolve())
    assert model["is_generation"] is True and model["vocab_size"] == 203 and model["max_context_length"] == 512
    assert model["served_model_name"] and model["eos_token_ids"] == [1]

    info = client.server_info()
    eng = info["engine"]
    assert info["server_type"] == "vllm-grpc" and info["max_num_seqs"] == 2
    assert eng["layout"] == "attn tp2, moe ep2 (allreduce)" and eng["dispatcher"] == "allreduce"
    assert eng["comm"]["calls"] > 0 and eng["steps"]["total"] > 0  # earlier tests generated
    assert eng["cuda_graphs"]["summary"] == "cuda graphs: off (no CUDA device)"
    assert eng["cuda_graphs"]["replays"] == 0 and eng["cuda_graphs"]["steps"] == eng["steps"]["total"]
    assert eng["spec_decode"]["summary"].startswith("spec-decode acceptance: none yet")
    assert eng["warmup"]["shapes"] == []  # static steps are off on CPU (engine.static_steps=auto)
    assert [r["rank"] for r in eng["ranks"]] == [0, 1] and eng["server"]["capacity"] == 4

    load = client.loads()
    assert load["max_total_num_tokens"] > 0 and load["max_running_requests"] == 2

    with pytest.raises(grpc.RpcError) as err:
        client.tokenizer_files()
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "tokenizer.json" in err.value.details()


def test_spec_decode_server_streams_hf_greedy_and_reports_acceptance(tiny_ckpts, random_drafter, tmp_path):
    """DDTree behind the server: several tokens per step arrive as one delta, still HF's greedy tokens. Static
    steps on: the server warmed up every verify shape (batch 1 and 2) before it said SERVING."""
    ckpt = tiny_ckpts["tiny_deepseek"]
    srv = ServerProcess(ckpt, [*layout_args(2), "spec_decode=ddtree", f"spec_decode.drafter_path={random_drafter}",
                               "spec_decode.block_size=5", "spec_decode.budget=12", "engine.static_steps=on",
                               "server.max_num_seqs=2"], tmp_path / "server.log")
    try:
        client = srv.wait_ready()
        ref = hf_greedy(ckpt, PROMPTS[:2], N_TOKENS)
        for prompt, want in zip(PROMPTS[:2], ref, strict=True):
            s = client.stream(prompt, max_tokens=N_TOKENS, min_tokens=N_TOKENS, temperature=0.0)
            assert [t for d in s for t in d] == want and s.result.completion_tokens == N_TOKENS
        warm = client.engine_info()["warmup"]
        assert [(w["kind"], w["batch"], w.get("tree_size", w.get("tokens"))) for w in warm["shapes"]] == [
            ("verify", 1, 13), ("verify", 2, 13), ("prefill", 1, 511)]
        assert warm["seconds"] > 0
        spec = client.engine_info()["spec_decode"]
        assert spec["enabled"] and spec["method"] == "ddtree" and spec["acceptance_length"] >= 1.0
        wait_idle(client)
    finally:
        srv.close()


def test_overlapped_server_streams_hf_greedy_and_frees_kv(tiny_ckpts, tmp_path):
    """``engine.overlap=on`` with static steps (warmed up) behind the server: concurrent streams still carry HF's
    greedy tokens, and a cancel or an Abort while the next step is already in flight frees the KV."""
    ckpt = tiny_ckpts[CKPT]
    srv = ServerProcess(ckpt, [*layout_args(2), "engine.overlap=on", "engine.static_steps=on", "server.max_num_seqs=4"],
                        tmp_path / "server.log")
    try:
        client = srv.wait_ready()
        ref = hf_greedy(ckpt, PROMPTS, N_TOKENS)
        greedy = dict(max_tokens=N_TOKENS, min_tokens=N_TOKENS, temperature=0.0)
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            results = list(pool.map(lambda p: client.generate(p, **greedy).token_ids, PROMPTS))
        assert results == ref
        s = client.stream(PROMPTS[0], **LONG)
        it = iter(s)
        next(it), next(it)
        s.cancel()
        with pytest.raises(grpc.RpcError):
            list(it)
        s = client.stream(PROMPTS[2], **LONG)
        it = iter(s)
        next(it)
        client.abort(s.request_id)
        assert len(list(it)) < LONG["max_tokens"] and s.result.finish_reason == "abort"
        wait_idle(client)
        assert [w["kind"] for w in client.engine_info()["warmup"]["shapes"]] == ["decode"] * 3 + ["prefill"]
    finally:
        srv.close()
