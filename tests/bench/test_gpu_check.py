# ruff: noqa: E402  (the interpreter switch must precede the imports)
"""``scripts/gpu_check.py`` on a CPU (issues 20, 21, 23): sections chosen by name, per-section budgets, the
console naming what ran and what was skipped, the report outside the checkout by default, and the engine
section's smoke version with the row keys its GPU rows have. The GPU numbers themselves need a GPU run."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton decorates any kernel (bench.gpu.report imports them)

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.gpu import engine_check, hand_off, invariance, report
from tests.support.mooncake import master_binary
from tests.support.paths import REPO_ROOT

REPO = REPO_ROOT
GPU_ONLY = ("moe_timing", "bandwidth", "power", "cuda_graphs", "draft_graphs", "spec_steps", "engine", "invariance",
            "roofline", "quant", "hand_off")


def gpu_check(*args: str, env: dict | None = None, cwd: Path = REPO) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    env.pop("OUT", None)
    return subprocess.run([sys.executable, str(REPO / "scripts/gpu_check.py"), *args], cwd=cwd, env=env, text=True,
                          capture_output=True, timeout=300)


def console(done: subprocess.CompletedProcess) -> dict[str, str]:
    """The final ``gpu_check: HEAD: names`` lines, by head."""
    lines = [line.removeprefix("gpu_check: ") for line in done.stdout.splitlines() if line.startswith("gpu_check: ")]
    return dict(line.split(": ", 1) if ": " in line else (line, "") for line in lines)


def test_default_run_on_cpu_names_what_it_skipped_and_writes_outside_the_checkout(tmp_path):
    """Every section, $OUT unset, cwd the checkout: exit 0; the console lists what ran and each GPU section as
    skipped for want of a device; the report lands in a new directory under the temp dir, none in the checkout.
    correctness is given 0 s here (so it is recorded as skipped: the budget rule) to keep the test fast;
    ``test_sections_correctness_runs_only_that`` runs it."""
    before = set(REPO.iterdir())
    done = gpu_check("--aot", "none", "--budget", "correctness=0", env={"TMPDIR": str(tmp_path)})
    assert done.returncode == 0, done.stderr[-3000:]
    lines = console(done)
    assert lines["ran"] == "environment, kernel_select"
    assert lines["skipped on this machine (no CUDA device)"] == ", ".join(GPU_ONLY)
    assert lines["skipped (budget 0 s (--budget correctness=0))"] == "correctness"
    assert lines["skipped (--aot none)"] == "aot_compile"
    out = Path(lines["report"].split(" (")[0]).parent
    assert out.parent == tmp_path and out.name.startswith("gpu_check_")
    assert set(REPO.iterdir()) == before and not (REPO / "gpu_report").exists()
    rep = json.loads((out / "gpu_report.json").read_text())
    assert rep["correctness"].startswith("skipped: budget 0 s") and rep["section_budgets_s"]["correctness"] == 0
    assert all(rep[name].startswith("skipped: no CUDA device") for name in GPU_ONLY)
    assert rep["summary"]["ran"] == ["environment", "kernel_select"] and rep["summary"]["not_selected"] == []


def test_sections_correctness_runs_only_that(tmp_path):
    """``--sections correctness``: every kernel against its reference (interpreted, fp32 and fp16), exit 0, and
    no other section in the report; the console says which were not selected."""
    done = gpu_check("--sections", "correctness", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    rep = json.loads((tmp_path / "gpu_report.json").read_text())
    assert set(rep) - {"machine", "summary", "verdict", "section_seconds", "section_budgets_s"} == {"correctness"}
    rows = rep["correctness"]
    assert {r["dtype"] for r in rows} == {"float32", "float16"} and all(r["ok"] for r in rows)
    assert len({r["kernel"] for r in rows}) >= 8 and rep["verdict"].startswith("all kernels within tolerance")
    lines = console(done)
    assert lines["ran"] == "correctness" and "environment" in lines["not selected (--sections)"]
    assert "## correctness" in (tmp_path / "gpu_report.md").read_text()


def test_an_unknown_section_or_budget_fails_naming_the_valid_ones(capsys):
    for argv in (["--sections", "correctness,warp_speed"], ["--budget", "warp_speed=3"]):
        with pytest.raises(SystemExit) as exc:
            report.main(argv)
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert "warp_speed" in err and all(name in err for name in report.SECTIONS)


def test_sections_and_budgets_parse_in_run_order():
    assert report.parse_sections(None) == list(report.SECTIONS) == report.parse_sections("all")
    assert report.parse_sections("engine, correctness") == ["correctness", "engine"]  # run order, not given order
    budgets = report.parse_budgets(["engine=12,roofline=0", "power=1.5"])
    assert (budgets["engine"], budgets["roofline"], budgets["power"]) == (12, 0, 1.5)
    assert budgets["correctness"] == report.BUDGETS_S["correctness"]
    gpu = sum(s for name, s in report.BUDGETS_S.items() if name != "aot_compile")  # aot_compile: CPU only
    assert gpu <= report.TOTAL_BUDGET_S <= 450
    assert report.TOTAL_BUDGET_S + report.grace_s(report.BUDGETS_S["roofline"]) < 480  # 8 minutes, last section late


def test_a_section_past_its_hard_limit_is_stopped_and_the_next_one_runs(tmp_path, monkeypatch):
    """A section that overruns its budget + grace becomes an error; the following section still runs; a spent
    --budget-s skips what is left."""
    monkeypatch.setattr(report, "grace_s", lambda budget: 0.0)
    monkeypatch.setitem(report.SECTIONS, "environment", lambda ctx, budget: time.sleep(5))
    monkeypatch.setitem(report.SECTIONS, "kernel_select", lambda ctx, budget: {"budget_given": budget})
    rep = report.Report(tmp_path, 10.0, report.Context())
    t0 = time.monotonic()
    rep.run("environment", 0.3)
    assert time.monotonic() - t0 < 3 and "stopped after" in rep.sections["environment"]["error"]
    rep.run("kernel_select", 50.0)
    assert 0 < rep.sections["kernel_select"]["budget_given"] <= 10.0  # capped by what --budget-s has left
    rep.deadline = time.monotonic() - 1
    rep.run("correctness", 50.0)
    assert rep.sections["correctness"] == "skipped: --budget-s spent"
    s = report.summary(rep.sections, ["environment", "kernel_select", "correctness"])
    assert s["ran"] == ["kernel_select"] and list(s["errors"]) == ["environment"]
    assert s["skipped"] == {"--budget-s spent": ["correctness"]}
    assert json.loads((tmp_path / "gpu_report.json").read_text())["correctness"] == "skipped: --budget-s spent"


def test_engine_section_on_cpu_runs_its_smoke_version_with_the_gpu_rows_keys(tmp_path):
    """``--sections engine`` without a GPU: one prompt, fp32, plain decoding and DDTree 16 through the real
    engine on the trained pair; each row has exactly the keys a GPU row has, DDTree's fp32 tokens equal plain
    decoding's, the HF reference and the slice projection come along."""
    done = gpu_check("--sections", "engine", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    eng = json.loads((tmp_path / "gpu_report.json").read_text())["engine"]
    rows = eng["arms"]
    assert [r["method"] for r in rows] == ["none", "ddtree"]
    assert all(tuple(r) == engine_check.ROW_KEYS for r in rows)
    plain, tree = rows
    assert tree["same_tokens_as_plain"] is True and tree["first_diff"] == [None] and eng["fp32_equal"] is True
    assert tree["tau"] >= 1 and plain["tau"] == 1 and tree["decode_tok_s"] > 0 and plain["x_plain"] == 1
    assert tree["coverage"]["verify"].endswith(f"/{tree['decode_steps']}")
    assert tree["eager_reasons"]["verify"] == "no CUDA device" and tree["gpu_ms_per_step"] is None
    assert plain["kv_blocks_in_use_after"] == 0 == tree["kv_blocks_in_use_after"]
    hf = eng["hf_generate"][0]
    assert hf.get("same_tokens_as_engine_plain") == "1/1" or "transformers not importable" in hf.get("skipped", "")
    assert eng["stored_hf_greedy"]["float32"]["equal"] == "1/1"
    proj = eng["projection"]
    assert proj["slice"].startswith("TINY_SLICE") and proj["rows"][0]["budget"] == 16
    row = proj["rows"][0]
    assert row["projected_speedup"] == pytest.approx(row["tau_from_pair"] * proj["decode_ms"] /
                                                      (row["draft_ms"] + row["verify_ms"]))
    assert "| ddtree 16 block 16, b1, greedy, float32 |" in eng["table"]


def test_invariance_section_without_a_gpu_records_no_gpu_even_when_named(tmp_path):
    done = gpu_check("--sections", "invariance", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    rep = json.loads((tmp_path / "gpu_report.json").read_text())
    assert rep["invariance"].startswith("skipped: no CUDA device") and rep["section_seconds"]["invariance"] < 1


def test_invariance_section_logic_on_cpu_at_tiny_sizes():
    """The section's GPU logic on CPU (:func:`bench.gpu.invariance.cpu_plan`): the flag-on arms give plain decoding's
    tokens and prompt 0 alone its tokens in the batch; every op of the CPU's batch-invariant set has a row per dtype
    (the quantized ones in bf16 only), all row-invariant; plain decoding's cost at both batches, flag off and on."""
    from model.kernel_select import batch_invariant_kernels, select_kernels

    out = invariance.run("cpu", 120.0, invariance.cpu_plan())
    assert out["flag_on_identical"] is True and out["ops_not_invariant"] == []
    tokens = {(r["flag"], r["method"]): r for r in out["tokens"]}
    assert set(tokens) == {(f, m) for f in ("on", "off") for m in ("none", "ddtree")}
    assert tokens["on", "ddtree"]["same_as_plain"] is True and tokens["on", "none"]["same_as_plain"] is None
    ops = batch_invariant_kernels(select_kernels("cpu"))
    want = {(op, dt) for op in invariance.kernel_ops(ops) for dt in ("bfloat16", "float32")
            if dt == "bfloat16" or op not in invariance.BF16_ONLY}
    assert {(r["op"], r["dtype"]) for r in out["ops"]} == want and all(r["invariant"] for r in out["ops"])
    assert [(r["batch"], r["flag"]) for r in out["cost"]] == [(1, "off"), (1, "on"), (2, "off"), (2, "on")]
    assert all(r["decode_tok_s"] > 0 for r in out["cost"]) and all("on_vs_off" in r for r in out["cost"][1::2])


def test_invariance_token_diffs_name_the_first_differing_token():
    plain = [{"g0": [1, 2, 3], "s0": [4, 5]}, {"g0": [1, 2, 3]}]
    got = [{"g0": [1, 2, 3], "s0": [4, 6]}, {"g0": [1, 2, 7]}]
    d = invariance.token_diffs(got, plain)
    assert d["vs_plain"] == {"0/s0": 1, "1/g0": 2} and d["same_as_plain"] is False
    assert d["alone_vs_batch"] == {"g0": 2} and d["same_alone_as_in_batch"] is False
    assert invariance.token_diffs(plain, None) == dict(same_as_plain=None, vs_plain=None, same_alone_as_in_batch=True,
                                                       alone_vs_batch={})


def test_invariance_section_past_its_budget_records_what_it_skipped():
    out = invariance.run("cpu", 0.0, invariance.cpu_plan())
    assert out["flag_on_identical"] is None
    assert all(r.get("skipped") == "time budget" for part in ("tokens", "ops", "cost") for r in out[part])
    failed = report.verdict_of({"invariance": {"flag_on_identical": False}})
    assert failed[1] and "batch_invariant" in failed[0]


def test_the_gpu_plan_compares_every_arm_with_a_plain_arm_run_before_it():
    """On the GPU the arms run in priority order until the budget is spent: each arm's plain-decoding base comes
    earlier (so a cut run still compares what ran), labels are unique, every issue-20 arm is there, and the
    DDTree budgets the projection needs run before it."""
    plan = engine_check.gpu_plan()
    arms = list(plan.arms)
    assert len({a.label for a in arms}) == len(arms)
    for i, arm in enumerate(arms):
        assert arm.base() in arms[:i + 1], arm.label
    first = arms[:plan.projection_after]
    assert {a.budget for a in first if a.method == "ddtree" and a.dtype == "bfloat16"} == set(engine_check.BUDGETS)
    assert any(a.static_steps == "off" for a in first) and any(a.dtype == "float32" for a in first)
    assert {(a.batch, a.temperature, a.dtype) for a in arms} == {(b, t, d) for b in (1, 8) for t in (0.0, 1.0)
                                                                 for d in ("bfloat16", "float32")}
    assert {a.block for a in arms if a.method == "dflash"} == {9}


def test_first_diff():
    assert engine_check.first_diff([1, 2, 3], [1, 2, 3]) is None
    assert engine_check.first_diff([1, 2, 3], [1, 5, 3]) == 1
    assert engine_check.first_diff([1, 2], [1, 2, 3]) == 2


def test_correctness_past_its_budget_skips_the_rest_and_the_verdict_says_so():
    """Checks not started within the budget are rows marked ``skipped`` — not failures, but named in the verdict;
    a row out of tolerance still fails the run."""
    from bench.gpu.kernels import correctness

    rows = correctness(budget_s=0)
    assert rows and all(r["skipped"] == "time budget" for r in rows)
    line, failed = report.verdict_of({"correctness": [*rows[:1], dict(kernel="rms_norm", dtype="float32", ok=True)]})
    assert not failed and "not checked (time budget)" in line and rows[0]["kernel"] in line
    line, failed = report.verdict_of({"correctness": [dict(kernel="rms_norm", dtype="float32", ok=False)]})
    assert failed and "rms_norm float32 out of tolerance" in line
    line, failed = report.verdict_of({"engine": {"fp32_equal": False, "fp32_unequal": ["ddtree 16"]}})
    assert failed and "ddtree 16" in line


def test_moe_prefill_row_and_its_floor_on_cpu():
    """moe_timing's prefill row at tiny sizes (interpreter, wall times): the floor by hand and the row's ratios.
    one_expert routing: 40 rows × 1 local pair, all to expert 0 — 1 expert of (48×32 + 32×24) × 4 B = 9216 B to
    read, 2 × 40 × 3 × 32 × 24 = 184320 FLOPs."""
    from types import SimpleNamespace

    import torch

    from bench.gpu import kernels as gk
    from model.triton import cases

    case = cases.expert_case(40, 3, 32, 24, 4, "one_expert", torch.Generator().manual_seed(0))
    assert gk.moe_floor_s(**case, copy_bw=9216.0, peak=1e9) == 1.0  # bandwidth-bound
    assert gk.moe_floor_s(**case, copy_bw=1e9, peak=184320.0) == 1.0  # compute-bound
    measured = []
    row = gk.moe_prefill_row(case, SimpleNamespace(measure=lambda name, fn: measured.append(name)), 1e9, 1e9)
    assert row["path"] == "sorted" and measured == ["moe prefill 40 tokens (sorted)"]  # 40 rows: below the threshold
    assert row["speedup_vs_per_expert"] == pytest.approx(row["per_expert_ms"] / row["prefill_ms"])
    assert row["fraction_of_floor"] == pytest.approx(row["floor_ms"] / row["prefill_ms"])
    assert row["floor_ms"] == pytest.approx(1e3 * 184320 / 1e9) and row["max_abs_diff_vs_sorted"] < 1e-5


def test_the_hand_off_section_moves_the_kv_intact_and_projects_from_its_rates(tmp_path):
    """``--sections hand_off`` on CPU (``bench/gpu/hand_off.py``, in its own process: a Mooncake transfer engine's
    threads must not be in a process that later forks rank pools): the bytes a second process reads over the
    transfer engine arrive intact, every stage is timed, and the Kimi K2 projection follows from the rates."""
    master_binary()  # the mooncake wheel and its library: skipped without them, failed under CI=true
    done = gpu_check("--sections", "hand_off", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads((tmp_path / "gpu_report.json").read_text())["hand_off"]
    assert got["intact"] and got["mib"] == 64 and all(rate > 0 for rate in got["gb_s"].values())
    assert got["gb_s"]["path"] < min(got["gb_s"]["d2h"], got["gb_s"]["tcp_read"], got["gb_s"]["h2d"])
    kimi = hand_off.PROJECTED_TOKENS * hand_off.KIMI_K2_BYTES_PER_TOKEN
    assert got["projection"]["seconds_at_measured_path"] == pytest.approx(kimi / (got["gb_s"]["path"] * 1e9))
