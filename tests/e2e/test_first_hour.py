"""A new user's first hour: every mistake fails fast with one line naming the file or setting, before any rank
starts where no weights are needed; the server log says what happened to each request, and RPCs this engine does
not serve leave one line, not a traceback.

Checks in-process first (the pure parts, hand-worked values), then the scripts as a user runs them (subprocesses,
each timed), then one running server (single rank) and its log."""

from __future__ import annotations

import logging
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from engine.config import EngineConfig, RequestError
from engine.worker.kv_budget import blocks_for_memory, max_concurrency, size_kv_cache
from model.checkpoint_errors import CheckpointError, check_checkpoint_files, open_shard
from model.config import ConfigError, load_config, parse_config
from model.layout_fit import check_layout_fits, layout_problems
from parallelism.layout import Layout, LayoutError
from tests.support.paths import REPO_ROOT
from tests.support.patience import patience
from tests.support.rpc_helpers import ServerProcess, free_port

ROOT = REPO_ROOT
TARGET = ROOT / "model" / "zoo" / "tiny_kimi" / "target"
sys.path.insert(0, str(ROOT / "scripts"))


def broken_copy(tmp: Path, name: str, file: str, edit) -> Path:
    """The built-in checkpoint with ``file`` rewritten by ``edit(bytes) -> bytes``; other files symlinked."""
    d = tmp / name
    d.mkdir()
    for f in TARGET.iterdir():
        if f.name == file:
            (d / f.name).write_bytes(edit(f.read_bytes()))
        else:
            (d / f.name).symlink_to(f)
    return d


def corrupt(tmp):  # random bytes where the shard was
    return broken_copy(tmp, "corrupt", "model.safetensors", lambda b: os.urandom(200_000))


def truncated(tmp):  # a download cut short: header intact, data missing
    return broken_copy(tmp, "truncated", "model.safetensors", lambda b: b[:1_000_000])


def bad_json(tmp):
    return broken_copy(tmp, "bad_json", "config.json", lambda b: b[: len(b) // 2])


def wrong_type(tmp):
    return broken_copy(tmp, "wrong_type", "config.json", lambda b: b.replace(b'"deepseek_v3"', b'"llama"'))


# ---- in-process ----------------------------------------------------------------------------------------------
def test_corrupt_and_truncated_shards_name_file_and_tensor(tmp_path):
    with pytest.raises(CheckpointError, match=r"corrupt/model\.safetensors: corrupt or not a safetensors file"):
        check_checkpoint_files(corrupt(tmp_path))
    with pytest.raises(CheckpointError, match=r"truncated/model\.safetensors: truncated: tensor '[\w.]+' ends at"):
        check_checkpoint_files(truncated(tmp_path))
    with pytest.raises(CheckpointError, match=r"corrupt/model\.safetensors: not a readable safetensors file"):
        with open_shard(tmp_path / "corrupt" / "model.safetensors"):
            pass  # the loader's own path (under torchrun no launcher checks first)
    assert len(check_checkpoint_files(TARGET)) > 10  # the real one passes


def test_config_json_errors_name_the_file(tmp_path):
    with pytest.raises(ConfigError, match=r"bad_json/config\.json: not valid JSON: .* at line \d+ column \d+"):
        load_config(bad_json(tmp_path))
    with pytest.raises(ConfigError, match=r"wrong_type/config\.json: model_type 'llama' is not supported"):
        load_config(wrong_type(tmp_path))


def test_layout_problems_hand_worked():
    kimi = load_config(TARGET)  # 8 heads (MLA), 16 routed experts of 128, 1 shared expert, dense 768
    assert (kimi.num_heads, kimi.moe.num_experts, kimi.moe.intermediate_size, kimi.intermediate_size) == (8, 16, 128,
                                                                                                          768)
    assert layout_problems(kimi, Layout(world_size=8, attn_tp=8, moe_ep=8)) == []
    assert layout_problems(kimi, Layout(world_size=8, attn_dp=8, moe_tp=2, moe_ep=4)) == []
    three = layout_problems(kimi, Layout(world_size=3, attn_tp=3, moe_ep=3))
    assert [p.split(" ")[0] for p in three] == ["num_attention_heads=8", "n_routed_experts=16", "shared"]
    assert "(attn_tp must divide it: 1, 2, 4, 8)" in three[0]
    assert layout_problems(kimi, Layout(world_size=3, attn_dp=3, moe_tp=3)) == [
        "moe_intermediate_size=128 is not divisible by parallel.moe_tp=3"]
    assert layout_problems(kimi, Layout(world_size=32, attn_dp=32, moe_ep=32)) == [
        "n_routed_experts=16 is not divisible by parallel.moe_ep=32 (moe_ep must divide it: 1, 2, 4, 8, 16)"]
    with pytest.raises(LayoutError, match=r"config\.json does not fit attn tp3, moe ep3"):
        check_layout_fits(kimi, Layout(world_size=3, attn_tp=3, moe_ep=3))


def test_gqa_kv_heads_against_attn_tp():
    qwen = parse_config(dict(  # tiny_qwen3_moe's shape: 8 heads, 2 KV heads, experts of 16, dense 96
        model_type="qwen3_moe", vocab_size=203, hidden_size=64, intermediate_size=96, moe_intermediate_size=16,
        num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2, head_dim=16, num_experts=16,
        num_experts_per_tok=4, mlp_only_layers=[0]))
    for tp in (1, 2, 4, 8):
        assert layout_problems(qwen, Layout(world_size=tp, attn_tp=tp, moe_ep=tp)) == []
    assert layout_problems(qwen, Layout(world_size=6, attn_tp=6, moe_ep=2, moe_tp=3)) == [
        "num_attention_heads=8 is not divisible by parallel.attn_tp=6 (attn_tp must divide it: 1, 2, 4, 8)",
        "moe_intermediate_size=16 is not divisible by parallel.moe_tp=3"]  # KV: 2 divides 6 (replicated); 96 % 6 = 0
    three = layout_problems(qwen, Layout(world_size=3, attn_tp=3, moe_ep=1, moe_tp=3))
    assert "num_key_value_heads=2 and parallel.attn_tp=3: one must divide the other" in three


def test_kv_blocks_from_memory_hand_worked():
    gib, mib = 2**30, 2**20
    # 80 GiB device, 10 GiB taken by weights: 0.9 * 80 - 10 = 62 GiB of 1 MiB blocks
    assert blocks_for_memory(70 * gib, 80 * gib, mib, 0.9) == 62 * 1024
    assert blocks_for_memory(70 * gib, 80 * gib, 3 * mib, 0.9) == 62 * 1024 // 3  # partial blocks dropped
    assert blocks_for_memory(5 * gib, 80 * gib, mib, 0.9) == 0  # more taken than the share: nothing
    assert blocks_for_memory(80 * gib, 80 * gib, mib, 1.0) == 80 * 1024
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        blocks_for_memory(1, 1, 1, 1.5)
    with pytest.raises(RequestError, match=r"engine\.gpu_memory_utilization must be in \(0, 1\]"):
        EngineConfig.flat(gpu_memory_utilization=0.0)
    assert max_concurrency(512, EngineConfig.flat(block_size=16, max_model_len=512)) == 16.0


def test_kv_cache_size_logged_and_kept_off_cuda(caplog):
    from model.loader import load_model
    from parallelism.comm import build_groups

    model = load_model(TARGET, build_groups(Layout()))
    cfg = EngineConfig.flat(num_blocks=64, block_size=16, max_model_len=256)
    with caplog.at_level(logging.INFO, logger="engine.kv"):
        assert size_kv_cache(model, cfg) == cfg  # CPU: engine.num_blocks as given
    assert "KV cache: 64 blocks of 16 tokens" in caplog.text and "from engine.num_blocks" in caplog.text
    assert "maximum concurrency for 256 tokens per request: 4.00x" in caplog.text


def test_output_and_port_checks(tmp_path):
    from preflight import PreflightError, check_bindable, check_writable, one_line

    check_writable("generate.output", str(tmp_path / "out.json"))
    assert not list(tmp_path.iterdir())  # the probe leaves nothing behind
    with pytest.raises(PreflightError, match=r"generate\.output=.*missing/out\.json: directory .*missing does not"):
        check_writable("generate.output", str(tmp_path / "missing" / "out.json"))
    with pytest.raises(PreflightError, match="is a directory"):
        check_writable("generate.output", str(tmp_path))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(PreflightError, match=rf"server\.port={port}: cannot bind 127\.0\.0\.1:{port}"):
            check_bindable("127.0.0.1", port)
    check_bindable("127.0.0.1", 0)
    from torch.multiprocessing import ProcessRaisedException

    err = ProcessRaisedException("\n\n-- Process 1 terminated:\nTraceback (most recent call last):\n  File x\n"
                                 "model.checkpoint_errors.CheckpointError: tensor 'w' in f has shape [2]\n", 1, 123)
    assert one_line(err) == "rank 1: model.checkpoint_errors.CheckpointError: tensor 'w' in f has shape [2]"


def test_client_names_out_of_range_seed():
    from rpc.client import sampling_params

    with pytest.raises(ValueError, match=r"seed=2147483648: the SMG protocol carries seed as int32"):
        sampling_params(seed=2**31)
    assert sampling_params(seed=2**31 - 1).seed == 2**31 - 1


# ---- the scripts, as a user runs them ---------------------------------------------------------------------------
TWO_RANKS = ["parallel.world_size=2", "parallel.attn_tp=2", "parallel.moe_ep=2"]


def run_script(script: str, args: list[str]) -> tuple[int, str, float]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("HYDRA_FULL_ERROR", None)
    t = time.monotonic()
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / script), *args], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=patience(120))
    return out.returncode, out.stdout + out.stderr, time.monotonic() - t


CASES = {  # name: (script, args given tmp, what the one line must say)
    "corrupt shard": ("serve.py", lambda t: [f"model.path={corrupt(t)}", *TWO_RANKS],
                      [r"corrupt/model\.safetensors: corrupt or not a safetensors file \(header length \d+"]),
    "truncated shard": ("serve.py", lambda t: [f"model.path={truncated(t)}", *TWO_RANKS],
                        [r"truncated/model\.safetensors: truncated: tensor '[\w.]+' ends at data byte \d+"]),
    "broken config.json": ("serve.py", lambda t: [f"model.path={bad_json(t)}", *TWO_RANKS],
                           [r"bad_json/config\.json: not valid JSON"]),
    "wrong model_type": ("serve.py", lambda t: [f"model.path={wrong_type(t)}", *TWO_RANKS],
                         [r"wrong_type/config\.json: model_type 'llama' is not supported"]),
    "indivisible heads and experts": (
        "serve.py", lambda t: ["parallel.world_size=3", "parallel.attn_tp=3", "parallel.moe_ep=3"],
        [r"target/config\.json does not fit", r"num_attention_heads=8 is not divisible by parallel\.attn_tp=3",
         r"n_routed_experts=16 is not divisible by parallel\.moe_ep=3"]),
    "KV block size the GPU kernels cannot page": (
        "serve.py", lambda t: ["device=cuda", "engine.block_size=24"],
        [r"engine\.block_size=24: the Triton paged-attention kernels \(device=cuda\) need a power of two"]),
    "batch invariance over DeepEP": (
        "serve.py", lambda t: ["parallel.world_size=2", "parallel.attn_dp=2", "parallel.moe_ep=2",
                               "parallel.dispatcher=deepep", "engine.batch_invariant=true"],
        [r"engine\.batch_invariant=true with parallel\.dispatcher=deepep: DeepEP's kernels combine .* own order"]),
    "max_model_len above the model's context": (
        "serve.py", lambda t: ["engine.max_model_len=2048"],
        [r"engine\.max_model_len=2048 is above the model's context length 1024"]),
    "a reasoning parser the checkpoint has no markers for": (
        "serve.py", lambda t: ["server.reasoning_parser=kimi"],
        [r"server\.reasoning_parser=kimi: the checkpoint's tokenizer has no single token for '<think>'"]),
    "a bool that does not parse": ("serve.py", lambda t: ["engine.prefix_caching=flase"],
                                   [r"engine\.prefix_caching='flase' is not a bool \(true or false\)"]),
    "a misspelt switch of another group": ("serve.py", lambda t: ["eplb.enabled=treu"],
                                           [r"eplb\.enabled='treu' is not a bool"]),
    "expert rebalancing on one expert-parallel rank": (
        "serve.py", lambda t: ["eplb.enabled=true"],
        [r"eplb\.enabled=true with parallel\.moe_ep=1: the expert balancer moves experts between"]),
    "unwritable output": ("generate.py", lambda t: [f"generate.input={ROOT}/model/zoo/tiny_kimi/sample_prompts.json",
                                                    f"generate.output={t}/no/such/dir/out.json", *TWO_RANKS],
                          [r"generate\.output=.*/no/such/dir/out\.json: directory .* does not exist"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_mistake_fails_in_one_line_before_ranks(case, tmp_path):
    script, args, expect = CASES[case]
    rc, out, seconds = run_script(script, [*args(tmp_path), "server.host=127.0.0.1",
                                           f"server.port={free_port()}"] if script == "serve.py" else args(tmp_path))
    lines = [ln for ln in out.splitlines() if ln.strip()]
    assert rc == 1 and len(lines) == 1 and lines[0].startswith("error: "), out[-3000:]
    for pattern in expect:
        assert re.search(pattern, lines[0]), (pattern, lines[0])
    assert seconds < 60, seconds  # a few seconds alone (imports); generous for a shared 2-core box


def test_busy_port_fails_before_ranks(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        rc, out, _ = run_script("serve.py", [*TWO_RANKS, "server.host=127.0.0.1", f"server.port={port}"])
    lines = [ln for ln in out.splitlines() if ln.strip()]
    assert rc == 1 and lines == [f"error: server.port={port}: cannot bind 127.0.0.1:{port} (Address already in use); "
                                 "is another server on it? choose another server.port"], out[-3000:]


def test_debug_brings_the_traceback_back(tmp_path):
    rc, out, _ = run_script("serve.py", [f"model.path={bad_json(tmp_path)}", "debug=true"])
    assert rc == 1 and "Traceback" in out and "ConfigError" in out, out[-3000:]


# ---- one running server -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess(str(TARGET), ["parallel=single", "server.max_num_seqs=1", "server.max_queue=0"],
                        tmp_path_factory.mktemp("srv") / "server.log")
    client = srv.wait_ready()
    yield srv, client
    client.close()
    srv.close()


def log_lines(srv, needle: str, timeout: float = 10.0) -> list[str]:
    """Lines of the server log containing ``needle``, waiting for at least one."""
    deadline = time.monotonic() + timeout
    while True:
        lines = [ln for ln in srv.log_path.read_text().splitlines() if needle in ln]
        if lines or time.monotonic() > deadline:
            return lines
        time.sleep(0.1)


def test_refused_rpcs_leave_one_log_line(server):
    from smg_grpc_proto import vllm_engine_pb2 as pb
    from smg_grpc_proto.generated import common_pb2

    srv, client = server
    with pytest.raises(grpc.RpcError) as err:
        client.stub.Embed(pb.EmbedRequest(), timeout=10)
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED and "Embed" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:  # server.profile_dir is null by default: profiling off
        client.stub.StartProfile(common_pb2.StartProfileRequest(), timeout=10)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "server.profile_dir" in err.value.details()
    assert client.stub.FlushCache(common_pb2.FlushCacheRequest(), timeout=10).success
    [embed] = log_lines(srv, "Embed")
    assert "INFO" in embed and "Embed: UNIMPLEMENTED (generation models only)" in embed
    [profile] = log_lines(srv, "StartProfile")
    assert "StartProfile: FAILED_PRECONDITION (profiling is off" in profile
    assert len(log_lines(srv, "FlushCache: OK")) == 1
    assert "Traceback" not in srv.log_path.read_text()


def test_request_end_and_rejection_lines(server):
    srv, client = server
    client.generate([5, 17, 3], max_tokens=4, temperature=0, request_id="fh-ok")
    with pytest.raises(grpc.RpcError):
        client.generate([5, 17, 3], max_tokens=4, top_p=2.0, request_id="fh-bad")
    long = client.stream([5, 17, 3], max_tokens=400, ignore_eos=True, request_id="fh-long")
    next(iter(long))  # running: the one slot is taken, and max_queue=0
    with pytest.raises(grpc.RpcError) as err:
        client.generate([5, 17, 3], max_tokens=4, request_id="fh-full")
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    long.cancel()
    [ok] = log_lines(srv, "request fh-ok ")
    assert "INFO" in ok and "request fh-ok OK: prompt 3 tokens, output 4 tokens, " in ok and "finish length" in ok
    [bad] = log_lines(srv, "request fh-bad ")
    assert "INVALID_ARGUMENT" in bad and "top_p must be in (0, 1], got 2.0" in bad
    [full] = log_lines(srv, "request fh-full ")
    assert "RESOURCE_EXHAUSTED" in full
    [cancelled] = log_lines(srv, "request fh-long ")
    assert "CANCELLED: prompt 3 tokens" in cancelled
    [kv] = log_lines(srv, "KV cache: ")
    assert "512 blocks of 16 tokens" in kv and "maximum concurrency for 1024 tokens per request: 8.00x" in kv
