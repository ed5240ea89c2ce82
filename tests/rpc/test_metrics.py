"""``/metrics``, GetLoads and StartProfile/StopProfile on a real tp8 server (8 gloo ranks, DFlash with a random
drafter, loopback): during a bounded load the page parses, ``promtool check metrics`` reports only its colon-name lint
(vLLM's names trip it by design), the vLLM counters equal what the clients received, a real Prometheus server
scrapes the colon names and answers PromQL on them, every rank's telemetry arrives (CPU here), and profiling writes
one loadable Chrome trace per rank under ``server.profile_dir`` only. Without a server: the exporter on fake GPU
samples, and the idle reasons of a scenario blocked on KV."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families
from smg_grpc_proto.generated import common_pb2

from tests.support.metrics_doc import assert_documented, doc_rows, undocumented
from tests.support.paths import REPO_ROOT
from tests.support.patience import patience
from tests.support.rpc_helpers import ServerProcess, free_port

COLON_LINT = "metric names should not contain ':'"  # promtool's lint on every vLLM-style name
PROMPTS = [[5, 17, 3, 99, 150, 7, 64, 31], [2, 4, 6], [200, 1, 77, 90, 13], [9, 10, 11, 12, 13, 14]]
SHARED = list(range(20, 60))  # 40 tokens: a repeat hits its first two 16-token blocks


def need(binary: str) -> str:
    """The path of ``binary`` (Debian package ``prometheus``); skipped without it, failed under ``CI=true``."""
    path = shutil.which(binary)
    if path is None:
        why = f"{binary} not installed (apt-get install -y prometheus; .ci/run does)"
        if os.environ.get("CI") == "true":
            pytest.fail(why)
        pytest.skip(why)
    return path


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as resp:
        assert resp.headers["Content-Type"].startswith("text/plain; version=0.0.4"), resp.headers["Content-Type"]
        return resp.read().decode()


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """``{(sample name, sorted labels without model_name/engine): value}`` of a page, through the official parser."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("model_name", "engine")))
            out[(s.name, labels)] = s.value
    return out


@pytest.fixture(scope="module")
def server(tiny_ckpts, random_drafter, tmp_path_factory):
    root = tmp_path_factory.mktemp("metrics")
    srv = ServerProcess(tiny_ckpts["tiny_deepseek"], [
        "parallel=tp8", "spec_decode=dflash", f"model.drafter_path={random_drafter}", "spec_decode.block_size=5",
        "server.max_num_seqs=4", "server.heartbeat_s=0.3", "server.telemetry_interval_s=0.2",
        f"server.profile_dir={root / 'profiles'}"], root / "server.log")
    client = srv.wait_ready()
    yield srv, client, root
    client.close()
    srv.close()


@pytest.fixture(scope="module")
def load(server):
    """A bounded load: four prompts together (one stopped by a stop token), a 40-token prompt twice (a prefix hit),
    then four long requests filling the running slots and a fifth aborted while it waits. Returns what the clients
    received."""
    _, client, _ = server
    first = client.generate(PROMPTS[0], max_tokens=3, temperature=0.0, ignore_eos=True).token_ids
    jobs = [(PROMPTS[0], dict(max_tokens=8, stop_token_ids=[first[1]])),
            *[(p, dict(max_tokens=6 + i, ignore_eos=True)) for i, p in enumerate(PROMPTS[1:])]]

    def run(job):
        prompt, kw = job
        s = client.stream(prompt, temperature=0.0, **kw)
        return prompt, [t for d in s for t in d], s.result

    with ThreadPoolExecutor(len(jobs)) as pool:
        done = [(PROMPTS[0], first, None), *pool.map(run, jobs)]
    done += [run((SHARED, dict(max_tokens=4, ignore_eos=True))) for _ in range(2)]
    def until(what: str, holds) -> None:
        deadline = time.monotonic() + patience(30)
        while not holds(client.loads()):
            assert time.monotonic() < deadline, f"the server never had {what}"
            time.sleep(0.02)

    streams = [client.stream(p, temperature=0.0, max_tokens=48, ignore_eos=True) for p in PROMPTS]
    with ThreadPoolExecutor(len(streams) + 1) as pool:
        futures = [pool.submit(lambda s=s: [t for d in s for t in d]) for s in streams]
        until("four running", lambda loads: loads["num_running_reqs"] == 4)  # every slot (server.max_num_seqs=4)
        waiting = client.stream([7, 7, 7], temperature=0.0, max_tokens=14, ignore_eos=True)
        aborted = pool.submit(lambda: [t for d in waiting for t in d])
        until("a fifth waiting for a slot", lambda loads: loads["num_waiting_reqs"] == 1)
        time.sleep(0.2)
        client.abort(waiting.request_id)
        done += [(p, f.result(), s.result) for p, f, s in zip(PROMPTS, futures, streams, strict=True)]
        done.append(([7, 7, 7], aborted.result(), waiting.result))
    return done


def test_every_sample_and_label_value_on_the_page_is_documented(server, load):
    """docs/metrics.md names every family the loaded server's page carries and every value of its enumerated labels
    (the host tier's, the store's and the PD workers' pages are checked in their own tests)."""
    assert_documented(scrape(server[0].metrics_url))


def test_an_undocumented_label_value_is_caught():
    rows = doc_rows()
    page = ('# TYPE switchyard:kv_blocks gauge\nswitchyard:kv_blocks{dp_rank="0",state="used"} 1.0\n'
            'switchyard:kv_blocks{dp_rank="0",state="borrowed"} 2.0\n# TYPE switchyard:made_up gauge\n'
            'switchyard:made_up 1.0\n')
    assert undocumented(page, rows) == ['switchyard:kv_blocks{state="borrowed"}: value not in its row',
                                        "switchyard:made_up: no row"]


def test_metrics_page_parses_and_counts_exactly_what_was_sent(server, load):
    srv, client, _ = server
    reasons = {"stop": 0, "length": 0, "abort": 0}
    for *_, result in load:
        reasons[result.finish_reason if result is not None else "length"] += 1
    assert reasons["stop"] == 1 and reasons["abort"] == 1, reasons
    got_tokens = [(p, t) for p, t, _ in load if t]
    want = {"prompt": sum(len(p) for p, _ in got_tokens), "generation": sum(len(t) for _, t in got_tokens),
            "first": len(got_tokens), "cached": sum(r.cached_tokens for _, _, r in load if r is not None)}
    assert want["cached"] >= 32
    deadline = time.monotonic() + patience(20)
    while True:  # the last outputs' record reaches the exporter right after the clients see them
        m = samples(scrape(srv.metrics_url))
        if m[("vllm:request_success_total", (("finished_reason", "length"),))] == reasons["length"] \
                or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert m[("vllm:prompt_tokens_total", ())] == want["prompt"]
    assert m[("vllm:generation_tokens_total", ())] == want["generation"]
    assert m[("vllm:prompt_tokens_cached_total", ())] == want["cached"]
    for reason, n in reasons.items():
        assert m[("vllm:request_success_total", (("finished_reason", reason),))] == n, reason
    assert m[("vllm:time_to_first_token_seconds_count", ())] == want["first"]
    assert m[("vllm:e2e_request_latency_seconds_count", ())] == len(load)
    assert m[("vllm:request_queue_time_seconds_count", ())] == len(load)
    assert m[("vllm:inter_token_latency_seconds_count", ())] > 0
    assert m[("vllm:prefix_cache_hits_total", ())] >= 32
    assert m[("vllm:prefix_cache_queries_total", ())] >= m[("vllm:prefix_cache_hits_total", ())]
    assert m[("vllm:num_requests_running", ())] == m[("vllm:num_requests_waiting", ())] == 0
    assert m[("vllm:kv_cache_usage_perc", ())] == 0
    drafts = m[("vllm:spec_decode_num_drafts_total", ())]
    assert drafts > 0 and m[("vllm:spec_decode_num_draft_tokens_total", ())] == 4 * drafts  # DFlash block 5
    assert sum(v for (name, _), v in m.items() if name == "vllm:spec_decode_num_accepted_tokens_per_pos_total") \
        == m[("vllm:spec_decode_num_accepted_tokens_total", ())]
    info = client.engine_info()  # the EngineInfo subscriber of the same records agrees
    assert info["steps"]["total"] == sum(v for (name, _), v in m.items() if name == "switchyard:steps_total")
    # every rank's coverage and telemetry arrive with the step gather: eager reasons per rank, CPU use per rank
    for rank in range(8):
        assert m[("switchyard:eager_steps_total", (("kind", "verify"), ("rank", str(rank)),
                                                   ("reason", "no CUDA device")))] > 0
        assert ("switchyard:cpu_utilisation_ratio", (("rank", str(rank)),)) in m
    assert not any(name.startswith("switchyard:gpu_") for name, _ in m)  # no GPU: power metrics absent
    assert sum(v for (name, _), v in m.items() if name == "switchyard:comm_bytes_total") > 0
    idle = {dict(labels)["reason"]: v for (name, labels), v in m.items() if name == "switchyard:idle_seconds_total"}
    assert set(idle) == {"no_work", "blocked_kv", "admission_limit", "host_bound", "draining"}
    assert idle["no_work"] > 0 and idle["admission_limit"] > 0  # idle between phases; the fifth waited for a slot


def test_promtool_reports_only_the_colon_lint(server, load):
    srv, _, _ = server
    promtool = need("promtool")
    out = subprocess.run([promtool, "check", "metrics"], input=scrape(srv.metrics_url), capture_output=True,
                         text=True, timeout=60)
    lines = [ln for ln in (out.stdout + out.stderr).splitlines() if ln.strip()]
    assert lines and all(ln.endswith(COLON_LINT) for ln in lines), lines
    assert any(ln.startswith("vllm:generation_tokens_total ") for ln in lines)


def test_a_real_prometheus_scrapes_the_colon_names(server, load, tmp_path):
    """Prometheus (127.0.0.1, a temporary config and storage) scrapes ``/metrics`` every second; PromQL on
    ``vllm:generation_tokens_total`` through its HTTP API returns the tokens the clients received."""
    srv, _, _ = server
    prometheus = need("prometheus")
    want = sum(len(t) for _, t, _ in load)
    port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(f"global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: switchyard\n"
                      f"    static_configs:\n      - targets: ['127.0.0.1:{srv.metrics_port}']\n")
    log = open(tmp_path / "prometheus.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([prometheus, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT)
    try:
        query = urllib.parse.urlencode({"query": "vllm:generation_tokens_total"})
        deadline, value = time.monotonic() + patience(60), None
        while value != want:
            assert proc.poll() is None, (tmp_path / "prometheus.log").read_text()[-2000:]
            assert time.monotonic() < deadline, (value, (tmp_path / "prometheus.log").read_text()[-2000:])
            time.sleep(0.5)
            try:
                doc = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/query?{query}", timeout=5))
            except OSError:
                continue
            result = doc["data"]["result"]
            value = float(result[0]["value"][1]) if result else None
        assert result[0]["metric"]["__name__"] == "vllm:generation_tokens_total"
        assert result[0]["metric"]["model_name"] and result[0]["metric"]["engine"] == "0"
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def test_get_loads_fills_every_field_smg_reads(server, load):
    """GetLoads per attention-DP rank (one here): requests, tokens, usage, this rank's throughput and hit rate, and
    SGLang's utilization (the larger of running / max_running and usage / 0.9)."""
    _, client, _ = server
    from smg_grpc_proto import vllm_engine_pb2 as pb

    resp = client.stub.GetLoads(pb.GetLoadsRequest(), timeout=10)
    [r] = resp.loads
    assert r.max_running_requests == 4 and r.max_total_num_tokens > 0 and r.gen_throughput >= 0
    assert 0 < r.cache_hit_rate < 1  # the 40-token repeat hit
    assert r.utilization == pytest.approx(max(r.num_running_reqs / 4, r.token_usage / 0.9))
    assert r.num_total_reqs == r.num_running_reqs + r.num_waiting_reqs


def _trace_files(message: str) -> list[Path]:
    return [Path(p.strip()) for p in message.split(": ", 1)[1].split(",")]


def test_profile_writes_one_loadable_trace_per_rank(server):
    srv, client, root = server
    ok, message = client.start_profile(output_dir="run1", activities=["CPU"])
    assert ok, message
    planned = _trace_files(message)
    client.generate([5, 6, 7, 8], max_tokens=3, temperature=0.0, ignore_eos=True)
    ok, message = client.stop_profile()
    assert ok, message
    files = _trace_files(message)
    assert files == planned and len(files) == 8
    for rank, path in enumerate(files):
        assert path.parent == (root / "profiles" / "run1").resolve() and path.name.endswith(f"rank{rank}.trace.json")
        assert json.loads(path.read_text())["traceEvents"], path
    assert client.stop_profile() == (False, "not profiling: StartProfile first (or its num_steps already ended it)")
    # num_steps ends it by itself after that many steps
    ok, message = client.start_profile(output_dir=str(root / "profiles" / "run2"), num_steps=2)
    assert ok, message
    client.generate([5, 6, 7, 8], max_tokens=4, temperature=0.0, ignore_eos=True)
    deadline = time.monotonic() + patience(30)
    while not all(p.exists() for p in _trace_files(message)):
        assert time.monotonic() < deadline, message
        time.sleep(0.2)
    for bad in ("../outside", "/etc", "run1/../../x"):
        with pytest.raises(grpc.RpcError) as err:
            client.start_profile(output_dir=bad)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "server.profile_dir" in err.value.details()
    assert not (root / "outside").exists() and not (root / "x").exists()
    assert "Traceback" not in srv.log_path.read_text()


# ---------------------------------------------------------------------------------------- without a server
def test_gauges_move_with_the_engine_not_with_the_next_record(tiny_ckpts, tmp_path):
    """One rank, ``server.heartbeat_s=60`` (no idle record for a minute): the first scrape after a cancelled stream's
    Abort returns shows nothing running and its blocks free, and the first after FlushCache returns shows no cached
    block — with no step in between (the step counter has not moved)."""
    srv = ServerProcess(tiny_ckpts["tiny_deepseek"], ["server.heartbeat_s=60"], tmp_path / "server.log")
    try:
        client = srv.wait_ready()
        client.generate(SHARED, max_tokens=2, temperature=0.0, ignore_eos=True)  # cached blocks to flush later
        stream = client.stream(PROMPTS[0], temperature=0.0, max_tokens=400, ignore_eos=True)
        it = iter(stream)
        next(it)
        m = samples(scrape(srv.metrics_url))
        assert m[("vllm:num_requests_running", ())] == 1
        stream.cancel()
        client.abort(stream.request_id)  # what smg sends after it cancels a stream
        m = samples(scrape(srv.metrics_url))
        steps = sum(v for (name, _), v in m.items() if name == "switchyard:steps_total")
        assert m[("vllm:num_requests_running", ())] == 0 and m[("vllm:kv_cache_usage_perc", ())] == 0
        assert m[("switchyard:kv_blocks", (("dp_rank", "0"), ("state", "cached")))] > 0
        assert client.flush_cache()[0]
        m = samples(scrape(srv.metrics_url))
        assert m[("switchyard:kv_blocks", (("dp_rank", "0"), ("state", "cached")))] == 0
        assert sum(v for (name, _), v in m.items() if name == "switchyard:steps_total") == steps
    finally:
        srv.close()


def test_host_tier_hits_reach_metrics_and_engine_info(tiny_ckpts, tmp_path):
    """A 12-block device pool with a host tier: a 70-token prompt, three others that evict it, then the prompt again.
    Its second turn reports 64 cached tokens (four blocks from host), and /metrics and GetEngineInfo say where they
    came from: host hits and bytes loaded and stored; the device pool's own counter saw none of them."""
    args = ["engine.max_model_len=128", "engine.num_blocks=12", "engine.block_size=16", "engine.max_num_seqs=2",
            "engine.host_kv_cache_gb=0.01"]
    srv = ServerProcess(tiny_ckpts["tiny_deepseek"], args, tmp_path / "server.log")
    try:
        client = srv.wait_ready()
        prompt, *others = [[(7 * i + 13 * k) % 200 + 1 for k in range(70)] for i in range(4)]
        first = client.generate(prompt, max_tokens=2, temperature=0.0, ignore_eos=True)
        for other in others:
            client.generate(other, max_tokens=2, temperature=0.0, ignore_eos=True)
        again = client.generate(prompt, max_tokens=2, temperature=0.0, ignore_eos=True)
        assert again.token_ids == first.token_ids and again.cached_tokens == 64
        m = samples(scrape(srv.metrics_url))
        assert m[("switchyard:kv_tier_hit_tokens_total", (("tier", "host"),))] == 64
        assert m[("vllm:external_prefix_cache_hits_total", ())] == 64
        assert m[("vllm:external_prefix_cache_queries_total", ())] >= 64
        loaded = m[("switchyard:kv_tier_bytes_total", (("direction", "load"), ("tier", "host")))]
        stored = m[("switchyard:kv_tier_bytes_total", (("direction", "store"), ("tier", "host")))]
        assert loaded > 0 and stored >= loaded and stored % (loaded // 4) == 0  # whole blocks, four loaded
        assert m[("switchyard:kv_tier_seconds_total", (("direction", "load"), ("tier", "host")))] > 0
        assert m[("vllm:prefix_cache_hits_total", ())] == m[("switchyard:kv_tier_hit_tokens_total",
                                                              (("tier", "device"),))]
        tiers = {t["tier"]: t for t in client.engine_info()["kv"]["tiers"]}
        assert tiers["host"]["hit_tokens"] == 64 and tiers["host"]["load_bytes"] == loaded
        assert client.flush_cache()[0]
        page = scrape(srv.metrics_url)
        assert samples(page)[("switchyard:kv_tier_blocks", (("tier", "host"),))] == 0
        assert_documented(page)
    finally:
        srv.close()


def _stored_events(client) -> tuple[list, threading.Thread]:
    """Every ``KvBlocksStored`` a SubscribeKvEvents stream delivers, collected by a thread until the call ends."""
    call = client.stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(start_sequence_number=0))
    stored = []

    def collect():
        try:
            for batch in call:
                stored.extend(e.stored for e in batch.events if e.WhichOneof("data") == "stored")
        except grpc.RpcError:
            pass
    thread = threading.Thread(target=collect, daemon=True)
    thread.start()
    return stored, call


def test_store_hits_reach_metrics_and_flush_leaves_the_store(tiny_ckpts, tmp_path):
    """One worker with the shared store (a real mooncake_master on loopback): a prompt, FlushCache (the device pool
    empties; the store keeps the blocks), the prompt again — 64 cached tokens, on the store tier. KV events name the
    device pool's blocks DEVICE/LOCAL and the blocks written to the store EXTERNAL/REMOTE; the store's size is not
    this worker's to report."""
    from tests.support.mooncake import start_master

    master = start_master(tmp_path / "master.log")
    args = ["engine.max_model_len=128", "engine.num_blocks=12", "engine.block_size=16", "engine.max_num_seqs=2",
            *[f"engine.{k}={v}" for k, v in master.overrides(gb=0.05).items()]]
    srv = ServerProcess(tiny_ckpts["tiny_deepseek"], args, tmp_path / "server.log")
    try:
        client = srv.wait_ready()
        stored, call = _stored_events(client)
        prompt = [(11 * k) % 200 + 1 for k in range(70)]
        first = client.generate(prompt, max_tokens=2, temperature=0.0, ignore_eos=True)
        deadline = time.monotonic() + 10
        while not any(s.tier == common_pb2.KV_CACHE_TIER_EXTERNAL for s in stored):
            assert time.monotonic() < deadline, stored
            time.sleep(0.05)
        call.cancel()
        by_tier = {t: [list(b.token_ids) for s in stored if s.tier == t for b in s.blocks]
                   for t in (common_pb2.KV_CACHE_TIER_DEVICE, common_pb2.KV_CACHE_TIER_EXTERNAL)}
        blocks = [prompt[i:i + 16] for i in range(0, 64, 16)]
        assert by_tier[common_pb2.KV_CACHE_TIER_DEVICE] == blocks == by_tier[common_pb2.KV_CACHE_TIER_EXTERNAL]
        assert all(s.locality == (common_pb2.KV_CACHE_LOCALITY_REMOTE if s.tier == common_pb2.KV_CACHE_TIER_EXTERNAL
                                  else common_pb2.KV_CACHE_LOCALITY_LOCAL) for s in stored)
        assert client.flush_cache()[0]
        again = client.generate(prompt, max_tokens=2, temperature=0.0, ignore_eos=True)
        assert again.token_ids == first.token_ids and again.cached_tokens == 64
        m = samples(scrape(srv.metrics_url))
        assert m[("switchyard:kv_tier_hit_tokens_total", (("tier", "store"),))] == 64
        assert m[("vllm:external_prefix_cache_hits_total", ())] == 64
        assert m[("switchyard:kv_tier_bytes_total", (("direction", "load"), ("tier", "store")))] > 0
        assert m[("switchyard:kv_tier_bytes_total", (("direction", "store"), ("tier", "store")))] > 0
        assert m[("switchyard:kv_store_errors_total", (("reason", "load_failed"),))] == 0
        assert ("switchyard:kv_tier_blocks", (("tier", "store"),)) not in m
        tiers = {t["tier"]: t for t in client.engine_info()["kv"]["tiers"]}
        assert tiers["store"]["hit_tokens"] == 64 and tiers["store"]["blocks"] is None
        assert_documented(scrape(srv.metrics_url))
    finally:
        srv.close()
        master.kill()


def test_idle_seconds_hand_worked():
    from engine.core.step_record import idle_seconds

    got = idle_seconds(gap_s=2.0, gap_empty_s=1.5, wall_s=1.0, host_s=0.25, blocked="kv", draining=False)
    assert got == {"no_work": 1.5, "blocked_kv": 0.75, "admission_limit": 0.0, "host_bound": 0.75, "draining": 0.0}
    got = idle_seconds(gap_s=2.0, gap_empty_s=3.0, wall_s=1.0, host_s=2.0, blocked="max_num_seqs", draining=True)
    assert got == {"no_work": 0.0, "blocked_kv": 0.0, "admission_limit": 0.0, "host_bound": 1.0, "draining": 2.0}
    assert idle_seconds(gap_s=0.0, gap_empty_s=0.0, wall_s=1.0, host_s=0.1, blocked="", draining=False)[
        "host_bound"] == 0.1


def test_idle_reasons_move_when_requests_wait_for_kv(tiny_ckpts):
    """``engine.kv_allocation=reserve`` on a pool that holds one request at a time: the others wait for blocks, so
    blocked_kv grows while the engine steps; between the turns and after them the heartbeats count no_work; a
    one-slot engine counts admission_limit instead. Through the exporter, as /metrics shows it."""
    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.params import SamplingParams
    from model.loader import load_model
    from parallelism.comm import build_groups
    from parallelism.layout import Layout
    from rpc.metrics import MetricsExporter

    model = load_model(tiny_ckpts["tiny_qwen3_moe"], build_groups(Layout()))
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    idle = {}
    for name, cfg in (("kv", EngineConfig.flat(max_num_seqs=4, max_model_len=32, block_size=4, num_blocks=8,
                                             kv_allocation="reserve")),
                      ("slots", EngineConfig.flat(max_num_seqs=1, max_model_len=32, block_size=4, num_blocks=64))):
        engine, exporter = Engine(model, cfg), MetricsExporter("tiny")
        engine.subscribe(exporter.observe)
        for i in range(3):
            engine.add_request(str(i), [5 + i] * 20, params)  # 20 + 6 tokens: 7 of the 8 blocks
        while engine.has_work():
            engine.step()
        time.sleep(0.05)
        engine.heartbeat()
        m = samples(exporter.text().decode())
        idle[name] = {dict(labels)["reason"]: v for (n, labels), v in m.items() if n == "switchyard:idle_seconds_total"}
        assert m[("vllm:request_success_total", (("finished_reason", "length"),))] == 3
        engine.shutdown()
    assert idle["kv"]["blocked_kv"] > 0 and idle["kv"]["admission_limit"] == 0 and idle["kv"]["no_work"] >= 0.05
    assert idle["slots"]["admission_limit"] > 0 and idle["slots"]["blocked_kv"] == 0
    assert all(v["host_bound"] > 0 for v in idle.values())


def _gpu_record(t: float, energy_mj: dict[int, float], tokens: int, throttle=("sw_power_cap",)):
    from engine.core.step_record import RankLoad, StepRecord, TokenCounts
    from engine.step import StepKind

    gpus = {r: {"gpus": [{"index": r, "power_w": 300.0, "power_limit_w": 1100.0, "energy_mj": e,
                          "sm_clock_mhz": 1980.0, "sm_active_pct": 41.0, "tensor_active_pct": 12.0,
                          "dram_active_pct": 87.0, "throttle_reasons": list(throttle)}]}
            for r, e in energy_mj.items()}
    return StepRecord(step_id=1, kind=StepKind.DECODE, t_end=t, gap_s=0.0, wall_s=0.01, device_ms=4.0,
                      host_ms={"schedule": 0.1, "launch": 1.0, "readback": 8.0, "update": 0.1, "draft": 0.0,
                               "target": 1.0},
                      tokens=TokenCounts(generated=tokens, decoded=tokens), kv=(RankLoad(blocks_total=10),),
                      graphs=({StepKind.DECODE: (True, "")}, {StepKind.DECODE: (False, "a reason")}),
                      comm={("attn_tp", "all_reduce"): (2, 1024)}, telemetry=gpus,
                      idle_s={"host_bound": 0.006})


def test_deferred_waiting_requests_have_their_own_reason():
    """``vllm:num_requests_waiting_by_reason``: of 6 waiting on two DP ranks, 3 put off for a prefix being prefilled
    are ``deferred``, 2 loading their KV are neither (``switchyard:num_requests_loading``), the rest ``capacity``."""
    import dataclasses

    from engine.core.step_record import RankLoad
    from rpc.metrics import MetricsExporter

    e = MetricsExporter("m")
    e.observe(dataclasses.replace(_gpu_record(1.0, {0: 0}, tokens=1),
                                  kv=(RankLoad(waiting=4, deferred=2, loading=1, blocks_total=10),
                                      RankLoad(waiting=2, deferred=1, loading=1, blocks_total=10))))
    m = samples(e.text().decode())
    assert m[("vllm:num_requests_waiting", ())] == 6
    assert m[("switchyard:num_requests_loading", ())] == 2
    assert m[("vllm:num_requests_waiting_by_reason", (("reason", "capacity"),))] == 1
    assert m[("vllm:num_requests_waiting_by_reason", (("reason", "deferred"),))] == 3


def test_exporter_on_fake_gpu_samples():
    """Per-rank power, activity (ratios), SM clock (Hz), throttle reasons, the energy counter from NVML's energy
    readings, joules per output token over the window, device seconds per step; no CPU metrics."""
    from rpc.metrics import MetricsExporter

    e = MetricsExporter("m")
    e.observe(_gpu_record(100.0, {0: 1_000_000, 1: 5_000_000}, tokens=8))
    e.observe(_gpu_record(100.5, {0: 1_030_000, 1: 5_030_000}, tokens=12, throttle=()))  # +30 J per GPU
    m = samples(e.text().decode())
    assert m[("switchyard:gpu_power_watts", (("rank", "1"),))] == 300
    assert m[("switchyard:gpu_sm_active_ratio", (("rank", "0"),))] == pytest.approx(0.41)
    assert m[("switchyard:gpu_tensor_active_ratio", (("rank", "0"),))] == pytest.approx(0.12)
    assert m[("switchyard:gpu_sm_clock_hertz", (("rank", "0"),))] == 1.98e9
    assert m[("switchyard:gpu_energy_joules_total", (("rank", "0"),))] == pytest.approx(30)
    assert m[("switchyard:energy_per_output_token_joules", ())] == pytest.approx(60 / 20)
    assert m[("switchyard:gpu_throttle_reason", (("rank", "0"), ("reason", "sw_power_cap")))] == 0
    assert m[("switchyard:step_device_seconds_count", (("kind", "decode"),))] == 2
    assert m[("switchyard:cuda_graph_replays_total", (("kind", "decode"), ("rank", "0")))] == 2
    assert m[("switchyard:eager_steps_total", (("kind", "decode"), ("rank", "1"), ("reason", "a reason")))] == 2
    assert m[("switchyard:comm_bytes_total", (("group", "attn_tp"), ("op", "all_reduce")))] == 2048
    assert not any(name.startswith("switchyard:cpu_") for name, _ in m)


def test_the_expert_balancers_figures_reach_the_page():
    """A step record's ``eplb`` figures (``ExpertBalancer.figures``): totals as counters, the last window's
    balancedness per MoE layer as a gauge; before the first window, the totals only."""
    from engine.core.step_record import StepRecord
    from rpc.metrics import MetricsExporter

    e = MetricsExporter("m")
    figures = {"balancedness": None, "rebalances": 0, "moved_bytes": 0, "move_seconds": 0.0}
    e.observe(StepRecord(step_id=None, kind=None, t_end=1.0, gap_s=1.0, wall_s=0.0, eplb=figures))
    assert not any(name == "switchyard:eplb_balancedness" for name, _ in samples(e.text().decode()))
    figures = {"balancedness": [0.91, 0.75], "rebalances": 3, "moved_bytes": 4096, "move_seconds": 0.25}
    e.observe(StepRecord(step_id=None, kind=None, t_end=2.0, gap_s=1.0, wall_s=0.0, eplb=figures))
    m = samples(e.text().decode())
    assert m[("switchyard:eplb_balancedness", (("layer", "1"),))] == 0.75
    assert m[("switchyard:eplb_rebalances_total", ())] == 3
    assert m[("switchyard:eplb_moved_bytes_total", ())] == 4096
    assert m[("switchyard:eplb_rebalance_seconds_total", ())] == 0.25


# ------------------------------------------------------------------------------------------ the dashboard
DASHBOARD = REPO_ROOT / "docs" / "grafana_dashboard.json"


def exported_names() -> set[str]:
    """Every sample name the exporter can put on the page: speculation on, a GPU rank and a CPU rank seen."""
    from engine.core.step_record import StepRecord
    from rpc.metrics import MetricsExporter

    e = MetricsExporter("m", draft_positions=4, drafted_per_step=4)
    e.observe(_gpu_record(1.0, {0: 1.0}, tokens=1))
    e.observe(StepRecord(step_id=None, kind=None, t_end=2.0, gap_s=1.0, wall_s=0.0,
                         telemetry={0: {"cpu_total_pct": 50.0, "cpu_pct": [50.0], "process_cpu_pct": 20.0}}))
    return {s.name for family in text_string_to_metric_families(e.text().decode()) for s in family.samples}


def test_grafana_dashboard_is_importable_and_reads_only_exported_metrics(tmp_path):
    """The JSON Grafana imports (checked by structure: Grafana is not installable here): a Prometheus datasource
    variable, unique panel ids, panels inside the 24-column grid without overlapping, every query on a metric the
    exporter exports, the panels the issue asks for, and every query valid PromQL (``promtool check rules``)."""
    import re

    doc = json.loads(DASHBOARD.read_text())
    assert doc["title"] and doc["uid"] and doc["schemaVersion"] >= 30
    variables = {v["name"]: v for v in doc["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    panels = doc["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    cells = set()
    for p in panels:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not mine & cells, f"panel {p['title']!r} overlaps another"
        cells |= mine
    queries = [p for p in panels if p["type"] != "row"]
    assert all(p["targets"] and p["datasource"]["uid"] == "${datasource}" for p in queries)
    names = exported_names()
    exprs = [t["expr"] for p in queries for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"\b(?:vllm|switchyard):[a-z0-9_]+", e)}
    assert used <= names, used - names
    titles = " | ".join(p["title"] for p in panels)
    for metric in ("switchyard:gpu_power_watts", "switchyard:idle_seconds_total", "switchyard:gpu_sm_active_ratio",
                   "vllm:kv_cache_usage_perc", "vllm:prefix_cache_hits_total",
                   "vllm:time_to_first_token_seconds_bucket", "vllm:spec_decode_num_accepted_tokens_total",
                   "vllm:generation_tokens_total"):
        assert metric in used, metric
    assert "300 W" in titles and "τ" in titles
    promtool = need("promtool")
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:query{i}", "expr": e.replace("$__rate_interval", "1m").replace("$model_name", ".*")}
        for i, e in enumerate(exprs)]}]}
    (tmp_path / "rules.yml").write_text(json.dumps(rules))  # JSON is YAML
    out = subprocess.run([promtool, "check", "rules", str(tmp_path / "rules.yml")], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_docs_list_every_metric_and_no_other():
    """docs/metrics.md's tables name exactly the families the exporter defines (counters with ``_total``)."""
    import re

    from rpc.metrics import FAMILIES

    text = (REPO_ROOT / "docs" / "metrics.md").read_text()
    documented = set(re.findall(r"^\| `((?:vllm|switchyard):[a-z0-9_]+)` \|", text, flags=re.M))
    wire = {f.name + ("_total" if f.kind == "counter" else "") for f in FAMILIES.values()}
    assert documented == wire, (documented - wire, wire - documented)


def test_profile_plan_starts_and_ends_on_the_steps_asked(tiny_ckpts, tmp_path):
    """One rank in-process: a plan from step 2 for 2 steps starts before the engine's third step and writes its trace
    after the fourth, by itself; a second plan while one is pending is refused; StopProfile before the start step
    cancels without files; a bad activity names the field."""
    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.params import SamplingParams
    from engine.profiling import ProfileError, ProfilePlan, trace_path
    from model.loader import load_model
    from parallelism.comm import build_groups
    from parallelism.layout import Layout

    model = load_model(tiny_ckpts["tiny_qwen3_moe"], build_groups(Layout()))
    engine = Engine(model, EngineConfig.flat(max_num_seqs=2, max_model_len=64, block_size=4, num_blocks=64))
    plan = ProfilePlan(trace_dir=str(tmp_path), stamp="t", start_step=2, num_steps=2)
    engine.start_profile(plan)
    with pytest.raises(ProfileError, match="already profiling"):
        engine.start_profile(plan)
    engine.add_request("a", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    seen = []
    while engine.has_work():
        engine.step()
        seen.append((engine.stats.steps, engine.profiling.tracing, Path(trace_path(plan, 0)).exists()))
    assert seen[:5] == [(1, False, False), (2, False, False), (3, True, False), (4, False, True), (5, False, True)]
    assert json.loads(Path(trace_path(plan, 0)).read_text())["traceEvents"]
    engine.start_profile(ProfilePlan(trace_dir=str(tmp_path), stamp="u", start_step=100))
    assert engine.stop_profile() == [] and not Path(trace_path(plan, 0)).with_name("u-rank0.trace.json").exists()
    with pytest.raises(ValueError, match="activities"):
        ProfilePlan(trace_dir=str(tmp_path), stamp="v", activities=("TPU",))
    engine.shutdown()
