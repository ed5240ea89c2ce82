"""The topology A/B sweep behind ``scripts/bench_layouts.py``: one layout's servers, closed-loop cells through gRPC, the
cell JSONs and the reports (the script's docstring describes the run)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import torch
from tqdm import tqdm

from bench import REPO
from bench.cost.formulas import preset
from bench.cost.hardware import cpu_box, profile_for_gpu
from bench.cost.shapes import ModelShape
from bench.metrics import RequestRecord, comm_per_output_token, decode_step_time_s, summarize_requests
from bench.report import write_reports
from bench.telemetry import compute_floors, energy_per_token_j, sampler_summary, verdict
from engine.worker.telemetry import TelemetrySampler
from model.config import load_config
from model.expert_tally import touched_per_layer
from parallelism.launch import free_ports
from parallelism.layout import Layout
from rpc.client import Client

log = logging.getLogger("bench")


def make_prompts(vocab: int, context: int, n: int, seed: int) -> list[list[int]]:
    """``n`` deterministic prompts of ``context`` tokens (ids 2..vocab-1: no BOS/EOS specials)."""
    gen = torch.Generator().manual_seed(seed * 100003 + context)
    return torch.randint(2, vocab, (n, context), generator=gen).tolist()


class Server:
    """``scripts/serve.py`` as a subprocess on a loopback port, for one layout and spec mode."""

    def __init__(self, overrides: list[str], log_path: Path, timeout_s: float, cpus: str | None = None,
                 repo: Path = REPO):
        """``cpus``: pin the server's process (and its ranks) to these cores (``taskset -c``); ``repo``: the checkout
        whose ``scripts/serve.py`` runs (another one's code, for a before/after comparison)."""
        self.port, self.metrics_port = free_ports(2)
        pin = ["taskset", "-c", cpus] if cpus is not None else []
        cmd = [*pin, sys.executable, str(repo / "scripts" / "serve.py"), *overrides,
               "server.host=127.0.0.1", f"server.port={self.port}", f"server.metrics_port={self.metrics_port}"]
        self.log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")]))}
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=repo, env=env)
        self.client = Client(f"127.0.0.1:{self.port}")
        try:
            self.client.wait_ready(timeout=timeout_s)
        except TimeoutError:
            self.stop()
            raise RuntimeError(f"server did not become SERVING; see {log_path}") from None

    def stop(self) -> int:
        self.client.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        self.log.close()
        return code


class Gateway:
    """``smg launch`` on loopback over gRPC ``workers`` with ``policy``, or (``pd``) over a prefill and a decode
    worker in its PD mode; ``model_dir`` holds the tokenizer; ``options``: more smg flags (parsers)."""

    def __init__(self, out: Path, name: str, workers: list[Server], policy: str, model_dir: Path,
                 pd: bool = False, options: tuple[str, ...] = ()):
        self.port, metrics = free_ports(2)
        urls = [f"grpc://127.0.0.1:{s.port}" for s in workers]
        route = (["--pd-disaggregation", "--prefill", urls[0], "--decode", urls[1]] if pd
                 else ["--worker-urls", *urls, "--policy", policy])
        self.log = open(out / f"{name}.log", "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [str(Path(sys.executable).parent / "smg"), "launch", *route, "--model-path", str(model_dir),
             "--host", "127.0.0.1", "--port", str(self.port), "--prometheus-host", "127.0.0.1", "--prometheus-port",
             str(metrics), "--block-size", "16", "--log-level", "warn", *options],
            stdout=self.log, stderr=subprocess.STDOUT, cwd=REPO)
        self.url, self.metrics_url = f"http://127.0.0.1:{self.port}", f"http://127.0.0.1:{metrics}/metrics"
        deadline = time.monotonic() + 120
        while True:
            try:
                if json.load(urllib.request.urlopen(f"{self.url}/v1/models", timeout=2)).get("data"):
                    return
            except OSError:
                pass
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.stop()
                raise RuntimeError(f"smg did not come up; see {out / f'{name}.log'}")
            time.sleep(0.5)

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.log.close()


def closed_loop(client: Client, prompts: list[list[int]], concurrency: int, output_len: int, bar) -> list:
    """Runs every prompt with at most ``concurrency`` in flight; returns (RequestRecord, tokens) in order."""
    results: list = [None] * len(prompts)
    next_idx, lock = [0], threading.Lock()

    def worker() -> None:
        while True:
            with lock:
                i = next_idx[0]
                next_idx[0] += 1
            if i >= len(prompts):
                return
            send = time.perf_counter()
            times, tokens, ok, err = [], [], True, ""
            try:
                stream = client.stream(prompts[i], max_tokens=output_len, min_tokens=output_len, temperature=0.0,
                                       ignore_eos=True)
                for delta in stream:
                    if delta:
                        times.append(time.perf_counter())
                        tokens += delta
            except Exception as e:  # noqa: BLE001 - recorded as a failed request
                ok, err = False, str(e)[:200]
            end = time.perf_counter()
            results[i] = (RequestRecord(send, times[0] if times else end, times, end, len(tokens), len(prompts[i]),
                                        ok, err), tokens)
            bar.update(1)

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def cell_tau(before: dict, after: dict) -> float:
    """τ of one cell from the server's cumulative spec counters (1.0 without speculation)."""
    steps = after.get("request_steps", 0) - before.get("request_steps", 0)
    tokens = after.get("committed_tokens", 0) - before.get("committed_tokens", 0)
    return tokens / steps if steps else 1.0


def cell_touched(before: dict, after: dict) -> float | None:
    """Mean distinct experts per MoE layer per decode/verify step between two ``GetEngineInfo`` documents (rank
    0's count: ``engine.expert_tally``); None when the server did not count or ran no such step."""
    b, a = before.get("experts_touched"), after.get("experts_touched")
    return touched_per_layer(b, a) if a and b else None


def cpu_hardware(world_size: int) -> object:
    """A crude profile of this host for the verdict floors (measured here: see docs/NOTES.md)."""
    return cpu_box(num_ranks=world_size, mem_bw_total=5e9, flops_total=50e9, alpha_s=25e-3, bus_bw=1e9)


def floor_hardware(cfg, world_size: int, gpus: list[str]):
    """The box the verdict's floors model: this CPU host for ``device=cpu``, else the profile of its GPUs
    (``bench.cost.hardware.profile_for_gpu``; None for a GPU without one)."""
    if cfg.device.get("type", "cpu") != "cuda":
        return cpu_hardware(world_size)
    return profile_for_gpu(gpus[0] if gpus else None)


# set per server by bench itself (from bench.spec, the sweep's parallel=/topology= choice, the concurrency; the
# expert tally that gives the verdict's memory floor the experts each step touched)
_SET_HERE = ("parallel", "spec_decode", "topology", "model.path", "model.drafter_path", "engine.max_num_seqs",
             "server.max_num_seqs", "engine.expert_tally")


def server_overrides(task: list[str]) -> list[str]:
    """The user's overrides of this job that configure its servers, as ``scripts/serve.py`` takes them: group
    choices (``device=cuda``, ``model=hf``) as given, values (``engine.*``, ``server.*``, ``parallel.*`` such as
    ``parallel.dispatcher=allgather``, ``spec_decode.*``) as ``++key=value`` (serve.yaml and bench.yaml do not
    hold the same keys, and not every spec mode's file has every key), deletions (``~key``) as given. Left
    out: ``bench.*``, ``hydra.*`` and what bench sets per server (:data:`_SET_HERE`)."""
    out = []
    for override in task:
        key = override.lstrip("+~").split("=", 1)[0]
        if override.startswith("~"):
            out.append(override)
        elif key.split(".")[0] in ("bench", "hydra") or key in _SET_HERE:
            continue
        else:
            out.append("++" + override.lstrip("+") if "." in key else override)
    return out


def layout_label(name: str, layout, mode: str) -> str:
    """The layout's name in cell files and reports: the preset, the fields an override changed from it
    (``ep8[dispatcher=alltoall]``), ``@mode`` for a topology other than auto (``tp8@pcie``)."""
    base = preset(name)
    changed = [f"{f.name}={getattr(layout, f.name)}" for f in dataclasses.fields(layout)
               if getattr(layout, f.name) != getattr(base, f.name)]
    return name + (f"[{','.join(changed)}]" if changed else "") + ("" if mode == "auto" else f"@{mode}")


def run_cell(server: Server, cfg, layout, label: str, topology: dict, spec: str, context: int, concurrency: int,
             reference: dict, out_dir: Path, shape: ModelShape, vocab: int, bar) -> dict:
    """One (layout, spec, context, concurrency) cell: ``label`` names the layout in files and reports (the
    preset, with ``@mode`` when ``topology`` is not auto); the cell JSON is written and returned."""
    b = cfg.bench
    n = b.prompts_per_concurrency * concurrency
    prompts = make_prompts(vocab, context, n, b.seed)
    before = server.client.engine_info()
    with TelemetrySampler(interval_s=0.25) as sampler:
        t0 = time.perf_counter()
        done = closed_loop(server.client, prompts, concurrency, b.output_len, bar)
        duration = time.perf_counter() - t0
    after = server.client.engine_info()
    records, tokens = [r for r, _ in done], [t for _, t in done]
    metrics = summarize_requests(records, duration)
    out_tokens = metrics["total_output_tokens"]
    key = f"{spec}/ctx{context}/c{concurrency}"
    ref = reference.setdefault(key, tokens)
    tau = cell_tau(before.get("spec_decode") or {}, after.get("spec_decode") or {})
    step_s = decode_step_time_s((metrics["mean_tpot_ms"] or 0.0) / 1e3, tau)
    telemetry = sampler_summary(sampler)
    hw = floor_hardware(cfg, layout.world_size, topology["gpus"])
    touched = cell_touched(before, after)
    floors = hw and compute_floors(shape, hw, layout, concurrency, context + b.output_len // 2, touched=touched)
    cell = {
        "layout": label, "layout_desc": layout.describe(), "parallel": dataclasses.asdict(layout),
        "topology": topology,
        "spec_decode": spec, "context": context, "concurrency": concurrency, "output_len": b.output_len,
        "num_prompts": n, **metrics, "acceptance_length": tau,
        "comm_per_output_token": comm_per_output_token(before["comm"]["per_op"], after["comm"]["per_op"],
                                                       out_tokens),
        "cuda_graphs": after.get("cuda_graphs"), "telemetry": telemetry,
        # from the server's step records (EngineInfo): why the GPUs were not busier during the cell, and rank 0's
        # device ms per step since start-up (CUDA only)
        "idle_s": {k: v - (before.get("idle_s") or {}).get(k, 0.0) for k, v in (after.get("idle_s") or {}).items()},
        "device_ms_per_step": after["steps"].get("device_ms_per_step"),
        "energy_j_per_output_token": energy_per_token_j(telemetry, out_tokens),
        "telemetry_source": sampler.source,
        "verdict": verdict(step_s, floors, telemetry=telemetry) if step_s > 0 and floors else None,
        "floors_hardware": hw.name if hw else f"no profile for GPU {topology['gpus'][:1]}: no verdict",
        "matches_reference": tokens == ref, "reference_layout": reference.get("_layout"),
    }
    (out_dir / f"cell_{cell['layout']}_{spec}_ctx{context}_c{concurrency}.json").write_text(
        json.dumps(cell, indent=1, default=str))
    return cell


def sweep(cfg, layout: Layout, ckpt: str, name: str, topology: dict, task: list[str], out_dir: Path) -> dict:
    """Every cell of one layout (preset ``name``, possibly changed by ``parallel.*`` overrides in ``task``, the
    job's hydra overrides): one server per spec mode, warm-up, then the cells; the reports are refreshed at the
    end. Returns :func:`bench.report.write_reports`' paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    ref_path = out_dir / "reference_tokens.json"
    reference = json.loads(ref_path.read_text()) if ref_path.exists() else {}
    label = layout_label(name, layout, topology["mode"])
    reference.setdefault("_layout", label)
    mcfg = load_config(ckpt)
    shape = ModelShape.from_config(mcfg, weight_bytes=4, expert_weight_bytes=4, kv_bytes=4, act_bytes=4)
    b = cfg.bench
    specs = list(b.spec)
    total = len(specs) * len(b.context) * len(b.concurrency)
    bar = tqdm(total=len(specs) * (b.warmup + sum(b.prompts_per_concurrency * c * len(b.context)
                                                  for c in b.concurrency)), desc=f"{label} ({total} cells)", unit="req")
    max_c = max(b.concurrency)
    for spec in specs:
        overrides = [*server_overrides(task), f"model.path={ckpt}",
                     f"parallel={name}", f"spec_decode={spec}", f"topology={topology['mode']}",
                     f"engine.max_num_seqs={max(max_c, 1)}", f"server.max_num_seqs={max(max_c, 1)}",
                     "++engine.expert_tally=true"]
        if cfg.model.get("drafter_path"):
            overrides.append(f"++model.drafter_path={cfg.model.drafter_path}")
        server = Server(overrides, out_dir / f"server_{label}_{spec}.log", b.server_timeout_s)
        try:  # warm-up once per server lifetime, at the largest context and concurrency
            warm = make_prompts(mcfg.vocab_size, max(b.context), b.warmup, b.seed + 1)
            closed_loop(server.client, warm, min(max_c, len(warm)) or 1, b.output_len, bar)
            for context in b.context:
                for c in b.concurrency:
                    run_cell(server, cfg, layout, label, topology, spec, context, c, reference, out_dir, shape,
                             mcfg.vocab_size, bar)
        finally:
            code = server.stop()
            log.info("server %s/%s exited with %s", label, spec, code)
    bar.close()
    ref_path.write_text(json.dumps(reference))
    return write_reports(out_dir, shape)
