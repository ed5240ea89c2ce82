"""One stats record per step (``engine/core/step_record.py``): folding the records gives the figures EngineInfo reported
before the records existed (captured from the engine at 2710802 on the same workloads), and every rank's graph
coverage arrives with the step."""


from engine.config import EngineConfig
from engine.engine import Engine
from engine.params import SamplingParams
from engine.worker.loop import make_runner, worker_loop
from model.loader import load_model
from parallelism.comm import build_groups
from spec_decode.speculation import load_speculation
from tests.spec_decode.test_spec_engine import specs
from tests.support.paths import REPO_ROOT

SHARED = [7, 8, 9, 10, 11, 12, 13, 14]
# phase 1, then phase 2 (its prompts share phase 1's first two blocks; r6 is aborted after 3 steps)
WORKLOADS = [[("r0", SHARED + [1, 2, 3, 4], 16), ("r1", [5, 17, 3, 99, 150], 20), ("r2", [2, 4, 6], 12),
              ("r3", [200, 1, 77, 90, 13, 45, 46], 18)],
             [("r4", SHARED + [30, 31], 10), ("r5", SHARED + [40], 12), ("r6", [50, 51, 52], 30)]]
# share_inflight_prefix off: engine_info_figures.json was recorded before it, when r4 and r5 prefilled side by side
CFG = EngineConfig.flat(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64, block_size=4, num_blocks=20,
                      static_steps="on", share_inflight_prefix=False)


def _run(engine):
    for phase, requests in enumerate(WORKLOADS):
        for rid, prompt, n in requests:
            engine.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
        steps = 0
        while engine.has_work():
            engine.step()
            steps += 1
            if phase == 1 and steps == 3:
                engine.abort_all("r6")


def figures(engine) -> dict:
    """EngineInfo's figures that do not depend on timing."""
    from dataclasses import asdict

    from engine.snapshot import take_snapshot

    doc = asdict(take_snapshot(engine))
    steps = {k: v for k, v in doc["steps"].items() if k in ("total", "kinds", "prefill_tokens", "decode_tokens")}
    spec = {k: doc["spec_decode"][k] for k in ("acceptance_length", "request_steps", "committed_tokens")}
    newer = ("requests_loading", "host_kv_cache_gb", "host_kv_write", "host_slots", "tiers")  # than the figures
    kv = {k: v for k, v in doc["kv"].items() if k != "index_digest" and k not in newer}
    kv["per_dp"] = [{k: v for k, v in r.items() if k != "index_digest"} for r in kv["per_dp"]]
    return {"steps": steps, "cuda_graphs": doc["cuda_graphs"], "spec_decode": spec, "kv": kv, "comm": doc["comm"]}


def figures_job(ctx, lay, path, drafter):
    """Plain decoding with overlap, then DDTree: rank 0 returns each engine's figures."""
    if lay.world_size == 1 and ctx.rank != 0:
        return None
    model = load_model(path, ctx.groups(lay) if lay.world_size > 1 else build_groups(lay))
    out = []
    for spec, overlap in ((specs(drafter)[0], "on"), (specs(drafter)[2], "off")):
        cfg = CFG.replace(overlap=overlap)
        speculation = load_speculation(spec, model)
        if ctx.rank != 0:
            worker_loop(make_runner(model, cfg, speculation))
            continue
        model.groups.counter.reset()
        engine = Engine(model, cfg, speculation=speculation)
        _run(engine)
        out.append(figures(engine))
        engine.shutdown()
    return out


def test_folded_records_give_the_figures_engine_info_gave_before(pool, tiny_ckpts, random_drafter):
    """The figures EngineInfo reports now come from folding the step records; on a fixed workload (plain decoding
    with overlap, then DDTree; prefix hits, preemptions, an abort) they equal what the engine reported before the
    records existed (``tests/support/engine_info_figures.json``, captured from 2710802), under single and
    tp2xdp4_ep8."""
    import json

    from tests.support.layouts import layout

    want = json.loads((REPO_ROOT / "tests" / "support" / "engine_info_figures.json").read_text())
    for preset in ("single", "tp2xdp4_ep8"):
        got = pool.run(figures_job, layout(preset), tiny_ckpts["tiny_deepseek"], random_drafter)[0]
        assert json.loads(json.dumps(got)) == want[preset], preset
