"""The capture-safety audit (tests/support/capture_audit.py): its rules on hand-made ops, every static step kind of the
engine — decode, verify, draft, commit and the strict_sync region, DFlash and DDTree, budgets 8…256, batch 1 and
8 — on the Triton wrappers with launches stubbed, and planted bugs it must catch."""

from __future__ import annotations

import pytest
import torch

from bench.gpu.fixtures import random_model, random_speculator
from engine.blocks import blocks_for
from engine.params import SamplingParams
from engine.step import SeqWork
from engine.worker.runner import ModelRunner
from model.kernel_select import batch_invariant_kernels
from spec_decode.config import SpecConfig
from spec_decode.speculation import speculation_from
from spec_decode.tree import build_tree
from tests.support.capture_audit import (
    CaptureUnsafe,
    audit_region,
    audited_capture,
    check,
    stub_triton_launches,
    triton_kernel_set,
)

BLOCK, CTX = 16, 20
BUDGETS = (8, 16, 32, 64, 128, 256)
PARAMS = (SamplingParams(temperature=0.0, max_tokens=64),
          SamplingParams(temperature=1.0, top_p=0.9, top_k=20, min_tokens=4, max_tokens=64, logprobs=2),
          SamplingParams(temperature=0.7, min_p=0.05, max_tokens=64, seed=3),
          # the logits processors on tree nodes: penalties over the node's path, a logit bias
          SamplingParams(temperature=1.0, repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=0.3,
                         logit_bias=((5, 2.0), (9, -3.0)), max_tokens=64, seed=4))


# ------------------------------------------------------------------------------------------------- the rules

X = torch.zeros(4)
IDX = torch.arange(2)
MASK = torch.tensor([True, False, True])
FLAGGED = {
    "beam_score[0] = 0.0": (lambda: X.__setitem__(0, 0.0), "host-to-device"),
    "x[idx] = 1.0": (lambda: X.__setitem__(IDX, 1.0), "host-to-device"),
    "torch.tensor(list)": (lambda: torch.tensor([1, 2]), "python-data"),
    "torch.as_tensor(list)": (lambda: torch.as_tensor([1, 2]), "python-data"),
    "x[torch.tensor(list)]": (lambda: X[torch.tensor([0, 1])], "host-to-device"),
    ".item()": (lambda: X[0].item(), "sync"),
    "bool(t)": (lambda: bool(X[0] > 0), "sync"),
    "int(t)": (lambda: int(X[0]), "sync"),
    ".tolist()": (lambda: X.tolist(), "device-to-host"),
    ".cpu()": (lambda: X.cpu(), "device-to-host"),
    "nonzero": (lambda: MASK.nonzero(), "data-dependent-size"),
    "where(mask)": (lambda: torch.where(MASK), "data-dependent-size"),
    "x[bool mask]": (lambda: X[:3][MASK], "data-dependent-size"),
    "masked_select": (lambda: X[:3].masked_select(MASK), "data-dependent-size"),
    "unique": (lambda: IDX.unique(), "data-dependent-size"),
    "repeat_interleave": (lambda: IDX.repeat_interleave(IDX), "data-dependent-size"),
    "masked_fill(device value)": (lambda: X.masked_fill(X > 0, X[0]), "sync"),
    "torch.equal": (lambda: torch.equal(X, X), "sync"),
}
ALLOWED = {
    "x.narrow(0, 0, 1).fill_(0.0)": lambda: X.narrow(0, 0, 1).fill_(0.0),
    "x[1:3] = 1.0": lambda: X.__setitem__(slice(1, 3), 1.0),
    "torch.full": lambda: torch.full((3,), float("-inf")),
    "where(mask, 0, x)": lambda: torch.where(MASK, 0, X[:3]),
    "x * 3": lambda: X * 3,
    "x[idx] (device index)": lambda: X[IDX],
    "index_put_ (device values)": lambda: X.index_put_((IDX,), torch.ones(2)),
    "repeat_interleave(output_size=)": lambda: IDX.repeat_interleave(IDX, output_size=1),
    "as_tensor(device tensor)": lambda: torch.as_tensor(X[0], dtype=torch.int64),
    "topk, sort, gather, scatter": lambda: X.topk(2).indices.sort().values.gather(0, IDX).scatter(0, IDX, IDX),
}


@pytest.mark.parametrize("case", FLAGGED)
def test_the_audit_flags_each_rule(case):
    run, rule = FLAGGED[case]
    with audit_region(case) as audit:
        run()
    assert [v.rule for v in audit.found][-1:] == [rule], audit.found
    assert "test_capture_audit.py" in audit.found[-1].where


@pytest.mark.parametrize("case", ALLOWED)
def test_the_audit_passes_what_cuda_graphs_hold(case):
    check(ALLOWED[case], case)


def test_the_audit_lists_every_violation_and_restores_torch():
    factory, tolist = torch.tensor, torch.Tensor.tolist

    def two_bugs():
        X[0] = 0.0
        return X.tolist()

    with pytest.raises(CaptureUnsafe) as err:
        check(two_bugs, "two bugs")
    assert [v.rule for v in err.value.violations] == ["host-to-device", "device-to-host"]
    assert "2 capture-unsafe op(s)" in str(err.value) and "test_capture_audit.py" in str(err.value)
    assert torch.tensor is factory and torch.Tensor.tolist is tolist


def test_the_unfixed_root_assignment_is_flagged_and_the_builder_is_clean():
    """spec_decode/tree.py's ``beam_score[0] = 0.0`` (docs/records/gpu_first_run.md, "What did not" 1) is a
    host→device copy of a Python scalar; the fixed ``build_tree`` passes at every budget."""
    def old_root():
        beam_score = torch.full((8,), float("-inf"))
        beam_score[0] = 0.0  # the assignment build_tree made before the fix
        return beam_score

    with pytest.raises(CaptureUnsafe,
                       match=r"host-to-device: aten.copy_.default at tests/engine/worker/test_capture_audit.py"):
        check(old_root, "old build_tree root")
    logq, root = torch.randn(15, 300).log_softmax(-1), torch.tensor(7)  # made before the region: device buffers
    for budget in BUDGETS:
        check(lambda b=budget: build_tree(logq, root, b), f"build_tree({budget})")


# ------------------------------------------------------------------------------------- every static step kind


def spec_runner(method: str, budget: int, batch: int, invariant: bool = False,
                expert_tally: bool = False, expert_load: bool = False) -> ModelRunner:
    """A tiny random target (Triton wrappers, launches stubbed; ``invariant``: their batch-invariant set) + random
    drafter, static steps at ``batch``."""
    model = random_model(torch.device("cpu"), torch.float32, hidden_size=32, moe_intermediate_size=16,
                         intermediate_size=32, vocab_size=64, num_hidden_layers=2)
    model.use_kernels(batch_invariant_kernels(triton_kernel_set()) if invariant else triton_kernel_set())

    cfg = SpecConfig(method, budget=budget, block_size=BLOCK, drafter_path="random", tree_temperature=0.33)

    def factory(m, cache):
        spec = random_speculator(m, cache, budget, block_size=BLOCK)
        spec.cfg = cfg
        return spec

    per_seq = blocks_for(CTX + 2 + cfg.spec_reserve_slots, BLOCK)
    runner = ModelRunner(model, batch * per_seq, BLOCK, speculation_from(cfg, factory), static_batch_sizes=(batch,),
                         max_model_len=CTX + 2, expert_tally=expert_tally, expert_load=expert_load)
    runner.strict_sync = True  # the region gpu_check's spec_steps runs under CUDA's sync debug mode
    return runner


def run_every_kind(runner: ModelRunner, batch: int) -> dict:
    """Prefill (dynamic), one static decode step, one static speculative step (draft → verify → commit)."""
    per_seq = runner.static.max_blocks  # request b in blocks b*per_seq ..; the scratch blocks come after
    gen = torch.Generator().manual_seed(0)
    seqs = [dict(request_id=str(b), block_table=list(range(b * per_seq, (b + 1) * per_seq)),
                 params=PARAMS[b % len(PARAMS)], seed=b) for b in range(batch)]
    prompts = [torch.randint(2, 64, (CTX,), generator=gen).tolist() for _ in range(batch)]
    def step(work):
        return runner.finish(runner.launch(work)).results

    out = step([SeqWork(**s, token_ids=p, start=0, sample=True, num_generated=0, decode=False)
                for s, p in zip(seqs, prompts, strict=True)])
    out = step([SeqWork(**s, token_ids=out[s["request_id"]].tokens, start=CTX, sample=True, num_generated=1,
                        decode=True) for s in seqs])
    return step([SeqWork(**s, token_ids=out[s["request_id"]].tokens, start=CTX + 1, sample=True, num_generated=2,
                         decode=True, spec=True) for s in seqs])


CASES = [("ddtree", b, n) for b in BUDGETS for n in (1, 8)] + [("dflash", 16, n) for n in (1, 8)]


@pytest.mark.parametrize(("method", "budget", "batch"), CASES)
def test_every_static_step_kind_is_capture_safe(method, budget, batch):
    assert_every_kind_capture_safe(spec_runner(method, budget, batch), batch)


@pytest.mark.parametrize(("method", "budget", "batch"), [("ddtree", 16, 8), ("dflash", 16, 1)])
def test_every_static_step_kind_is_capture_safe_batch_invariant(method, budget, batch):
    """``engine.batch_invariant`` on the Triton set (what a GPU runs: graph-safe, so captured): the row-invariant
    attention's per-row key lists, the fixed-tile GEMMs and the ordered MoE combine, in every static step kind."""
    runner = spec_runner(method, budget, batch, invariant=True)
    assert runner.model.kernels.batch_invariant and runner.model.kernels.graph_safe
    assert_every_kind_capture_safe(runner, batch)


def assert_every_kind_capture_safe(runner: ModelRunner, batch: int) -> None:
    tree_size = runner.speculation.facts.tree_size
    with stub_triton_launches(), audited_capture() as log:
        results = run_every_kind(runner, batch)
    assert log.regions == [f"StaticStep(decode, batch={batch}, tree_size=1)", f"StaticDraft(batch={batch})",
                           f"StaticStep(verify, batch={batch}, tree_size={tree_size})",
                           f"StaticCommit(batch={batch}, tree_size={tree_size})", "ModelRunner strict_sync region"]
    log.raise_if_unsafe()
    assert len(results) == batch and all(1 <= len(r.tokens) <= BLOCK for r in results.values())


def test_the_expert_tally_is_capture_safe_and_counts_decode_and_verify_steps():
    """``engine.expert_tally``'s hooks add only device ops to the captured decode and verify steps, and count
    their forwards but not the prefill's: the tiny target's one MoE layer runs the static decode and the static
    verify twice each here (the stand-in capture runs a step, its replay re-runs it) → 4 forwards, each routing
    2 sequences' rows (× 9 tree nodes for the verify) to at most its 16 experts."""
    runner = spec_runner("ddtree", 8, 2, expert_tally=True)
    with stub_triton_launches(), audited_capture() as log:
        run_every_kind(runner, 2)
    log.raise_if_unsafe()
    snap = runner.tally.snapshot()
    assert snap["forwards"] == [4] and 4 <= snap["experts"][0] <= 4 * 16


def test_the_expert_load_is_capture_safe_and_counts_every_row_of_every_step():
    """``engine.expert_load``'s hooks add only device ops to every captured step kind, and count each routed row once
    per choice: the prefill's ``2 x CTX`` rows once, the static decode's 2 and the static verify's ``2 x tree_size``
    twice each (the stand-in capture runs a step, its replay re-runs it)."""
    runner = spec_runner("ddtree", 8, 2, expert_load=True)
    with stub_triton_launches(), audited_capture() as log:
        run_every_kind(runner, 2)
    log.raise_if_unsafe()
    rows = 2 * CTX + 2 * (2 + 2 * runner.speculation.facts.tree_size)
    assert runner.expert_load.counts.sum(dim=1).tolist() == [rows * runner.model.cfg.moe.top_k]


def test_the_grouped_prefill_path_is_capture_safe(monkeypatch):
    """``moe.grouped_moe``'s torch glue around the align kernel (its outputs made before the region) holds no host
    synchronisation, so a verify step of ``PREFILL_TOKENS`` rows or more still captures; and it is right."""
    from model import kernels
    from model.triton import cases, moe

    case = cases.expert_case(40, 3, 32, 24, 4, "spread", torch.Generator().manual_seed(0))
    aligned = moe.align_block_size_reference(case["inp"].slots, 4, 1)
    monkeypatch.setattr(moe, "moe_align_block_size", lambda slots, experts, block_m: aligned)
    out = check(lambda: moe.grouped_moe(**case), "grouped_moe")
    torch.testing.assert_close(out, kernels.local_experts(**case), atol=1e-5, rtol=1e-5)


PLANTS = {  # step kind → (class whose run() the capture is handed, region label prefix)
    "decode": ("engine.worker.cuda_graphs.StaticStep", "StaticStep(decode"),
    "verify": ("engine.worker.cuda_graphs.StaticStep", "StaticStep(verify"),
    "draft": ("spec_decode.static_draft.StaticDraft", "StaticDraft("),
    "commit": ("spec_decode.static_commit.StaticCommit", "StaticCommit("),
}


@pytest.mark.parametrize("method", ["ddtree", "dflash"])
@pytest.mark.parametrize("kind", PLANTS)
def test_a_planted_tensor_from_a_list_fails_its_step_kind(monkeypatch, kind, method):
    path, label = PLANTS[kind]
    module, cls = path.rsplit(".", 1)
    step_class = getattr(__import__(module, fromlist=[cls]), cls)
    run = step_class.run

    def planted(self):
        out = run(self)
        if getattr(getattr(self, "shape", None), "kind", kind) == kind:
            torch.tensor([0, 1, 2])  # the planted bug
        return out

    monkeypatch.setattr(step_class, "run", planted)
    runner = spec_runner(method, 8, 1)
    with stub_triton_launches(), audited_capture() as log:
        run_every_kind(runner, 1)
    with pytest.raises(CaptureUnsafe) as err:
        log.raise_if_unsafe()
    [bug] = err.value.violations
    assert bug.rule == "python-data" and bug.region.startswith(label) and "planted" in bug.where


def test_the_old_root_assignment_fails_the_ddtree_draft(monkeypatch):
    """The GPU's capture failure, reproduced on CPU: the draft step with the pre-fix root assignment in front of
    the builder fails the audit in its draft region, and only there."""
    import spec_decode.static_draft as sd

    def old_build_tree(logq, root, budget):
        beam_score = torch.full((budget,), float("-inf"), dtype=logq.dtype, device=logq.device)
        beam_score[0] = 0.0  # the root, as spec_decode/tree.py assigned it before the fix
        return build_tree(logq, root, budget)

    monkeypatch.setattr(sd, "build_tree", old_build_tree)
    runner = spec_runner("ddtree", 16, 8)
    with stub_triton_launches(), audited_capture() as log:
        run_every_kind(runner, 8)
    [(rule, op, region, where)] = {(v.rule, v.op, v.region, v.where) for v in log.found}
    assert (rule, op, region) == ("host-to-device", "aten.copy_.default", "StaticDraft(batch=8)")
    assert where.startswith("tests/engine/worker/test_capture_audit.py") and "static_draft.py" in where
