"""Sampling features behind the logits-processor interface, exact on every speculative node.

- Penalties: a rank's sampling state gives what a torch transcription of vLLM's formulas gives on the same logits
  (``vllm/model_executor/layers/utils.py``: repetition over prompt + output, presence / frequency over output counts),
  for plain rows and for tree nodes (history + ancestor path); plain decoding with penalties equals that reference
  run over HF transformers' logits, greedy and seeded (fp32 tiny DeepSeek).
- Grammar-built trees: every node of a tree built under a JSON schema is a path the matcher accepts, its mask is the
  matcher's at that path, the grammar pruned candidates, and with pruning off the tree is the plain one.
- End to end on the trained tiny_kimi pair in bf16 with ``engine.batch_invariant``: plain (static and dynamic),
  DFlash and DDTree give the same tokens — greedy and seeded T=1 — for constrained requests (JSON schema, regex,
  choice, EBNF, json_object), penalised ones and plain ones in one batch, under single, tp8 and dp8_ep8; every
  constrained output parses under its constraint; a preemption storm gives the same tokens (processor state rebuilt
  by replaying the output)."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch

from engine.params import Constraint, SamplingParams
from engine.sampling.logits_processors import Rows, SamplingState, TreeSampling
from engine.sampling.sampler import sample
from engine.step import NewRequest
from tests.engine.test_engine import run_requests
from tests.support.layouts import layout
from tests.support.paths import REPO_ROOT
from tests.support.sampling import sampling_batch
from tests.support.trees import node_paths

ZOO = REPO_ROOT / "model" / "zoo" / "tiny_kimi"
TARGET = ZOO / "target"


# ----------------------------------------------------------------------------------------------- penalties

def test_plain_decoding_with_penalties_equals_the_reference_over_hf_logits(tiny_ckpts):
    """Greedy and seeded T=1 with penalties through the engine (fp32 tiny DeepSeek) equal, token for token, a loop
    that takes HF transformers' logits of each prefix, applies :func:`vllm_penalties` and draws with the same
    counter-based sampler."""
    from engine.config import EngineConfig
    from engine.engine import Engine
    from model.loader import load_model
    from model.tiny import load_hf
    from parallelism.comm import build_groups
    from parallelism.layout import Layout

    path, n = tiny_ckpts["tiny_deepseek"], 16
    model = load_model(path, build_groups(Layout(world_size=1, attn_tp=1, attn_dp=1, moe_tp=1, moe_ep=1)))
    engine = Engine(model, EngineConfig.flat(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128,
                                           block_size=4, num_blocks=128))
    prompt = [5, 17, 3, 99, 150, 7, 64, 31, 8, 202, 11, 5, 17]
    params = [dataclasses.replace(p, max_tokens=n, min_tokens=n, seed=p.seed or 0) for p in PENALISED]
    got = run_requests(engine, [(str(i), prompt, p) for i, p in enumerate(params)])
    engine.shutdown()
    hf = load_hf(path)
    for i, p in enumerate(params):
        out: list[int] = []
        for _ in range(n):
            with torch.no_grad():
                logits = hf(torch.tensor([prompt + out])).logits[0, -1].float()[None]
            logits[0, list(model.cfg.eos_token_ids)] = float("-inf")  # min_tokens
            logits = vllm_penalties(logits, [prompt], [out], [p.presence_penalty], [p.frequency_penalty],
                                    [p.repetition_penalty])
            out.append(int(sample(logits, sampling_batch([p], [p.seed], [len(out)])).tokens[0]))
        assert got[str(i)][0] == out, i


def vllm_penalties(logits, prompt_tokens, output_tokens, presence, frequency, repetition):
    """A transcription of vLLM's ``apply_penalties`` + ``apply_repetition_penalties_torch`` (lists of token lists)."""
    r, v = logits.shape
    prompt_mask = torch.zeros(r, v, dtype=torch.bool)
    counts = torch.zeros(r, v, dtype=torch.int64)
    for i in range(r):
        prompt_mask[i, prompt_tokens[i]] = True
        for t in output_tokens[i]:
            counts[i, t] += 1
    output_mask = counts > 0
    rep = torch.tensor(repetition).unsqueeze(1).repeat(1, v)
    penalties = torch.where(prompt_mask | output_mask, rep, 1.0)
    scaling = torch.where(logits > 0, 1.0 / penalties, penalties)
    logits = logits * scaling
    logits -= torch.tensor(frequency).unsqueeze(1) * counts
    logits -= torch.tensor(presence).unsqueeze(1) * output_mask
    return logits


PENALISED = [SamplingParams(temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.7),
             SamplingParams(temperature=1.0, repetition_penalty=0.8, frequency_penalty=-0.4),
             SamplingParams(temperature=0.0),  # no penalty: its row must not change
             SamplingParams(temperature=1.0, presence_penalty=-1.5, seed=3)]


def test_penalties_equal_vllms_formulas_on_plain_rows_and_tree_nodes():
    gen = torch.Generator().manual_seed(0)
    v = 50
    state = SamplingState(v, (0,), torch.device("cpu"))
    prompts = [torch.randint(0, v, (9,), generator=gen).tolist() for _ in PENALISED]
    outputs = [torch.randint(0, v, (n,), generator=gen).tolist() for n in (4, 0, 3, 7)]
    # half the output replayed at admission (a re-admitted request), the rest committed as a step feeds it
    slots = [state.add(NewRequest(request_id=str(i), dp_rank=0, prompt=tuple(p), output=tuple(o[:len(o) // 2]),
                                  params=sp, seed=i)) for i, (p, o, sp) in enumerate(zip(prompts, outputs, PENALISED,
                                                                                         strict=True))]
    rest = [(s, t) for s, o in zip(slots, outputs, strict=True) for t in o[len(o) // 2:]]
    for proc in state.processors:
        proc.commit([s for s, _ in rest], [t for _, t in rest], torch.tensor([t for _, t in rest]))
    logits = torch.randn(len(slots), v, generator=gen) * 3
    rows = Rows(slots, torch.tensor(slots), torch.tensor([len(o) for o in outputs]))
    want = vllm_penalties(logits, prompts, outputs, *zip(*[(p.presence_penalty, p.frequency_penalty,
                                                            p.repetition_penalty) for p in PENALISED], strict=True))
    got = state.process(logits, rows)
    assert torch.equal(got, want)
    assert torch.equal(got[2], logits[2])
    # tree nodes: node i's history is the request's plus the tokens on its path below the root
    tokens = torch.tensor([[7, 3, 3, 9, 3], [1, 2, 2, 5, 6]])
    parents = [[-1, 0, 1, 0, 2], [-1, 0, 0, 1, 3]]
    depth = torch.tensor([[0, 1, 2, 1, 3], [0, 1, 1, 2, 3]])
    ancestors = torch.zeros(2, 5, 5, dtype=torch.bool)
    for j in range(2):
        for i in range(5):
            k = i
            while k >= 0:
                ancestors[j, i, k] = True
                k = parents[j][k]
    sampler = TreeSampling(state)
    work = [dataclasses.make_dataclass("W", ["slot", "num_generated"])(slots[j], len(outputs[j])) for j in (0, 1)]
    node_rows = sampler.prepare(work, 5)
    tree_logits = torch.randn(10, v, generator=gen) * 3
    paths = [[int(tokens[j, k]) for k in range(5) if ancestors[j, i, k] and depth[j, k] > 0]
             for j in range(2) for i in range(5)]
    ref = vllm_penalties(tree_logits, [prompts[j] for j in (0, 1) for _ in range(5)],
                         [outputs[j] + paths[j * 5 + i] for j in (0, 1) for i in range(5)],
                         *zip(*[(PENALISED[j].presence_penalty, PENALISED[j].frequency_penalty,
                                 PENALISED[j].repetition_penalty) for j in (0, 1) for _ in range(5)], strict=True))
    out = sampler.sample(node_rows, tokens, depth, ancestors, tree_logits)
    nodes = dataclasses.replace(node_rows, num_generated=node_rows.num_generated + depth.reshape(-1))
    sb = sampling_batch([PENALISED[j] for j in (0, 1) for _ in range(5)], [j for j in (0, 1) for _ in range(5)],
                             nodes.num_generated.tolist())
    assert torch.equal(out.tokens, sample(tree_logits, sb, ref).tokens)


# ----------------------------------------------------------------------------------------------- grammar trees

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


def backend():
    from engine.sampling.grammar import GrammarBackend

    return GrammarBackend.for_checkpoint(TARGET, json.loads((TARGET / "config.json").read_text())["vocab_size"], (0,))


@pytest.mark.parametrize("chain", (False, True), ids=("ddtree", "dflash"))
def test_a_grammar_built_tree_holds_only_allowed_paths_with_their_masks(chain):
    from engine.sampling.grammar import unpack_bits
    from model.tokenizer import load_tokenizer
    from spec_decode.tree import build_tree_grammar, build_tree_host, tree_paths

    gb, tok = backend(), load_tokenizer(TARGET)
    c = Constraint("json_schema", json.dumps(SCHEMA))
    m = gb.matcher(c)
    for t in tok.encode('{"name": "'):
        assert m.accept_token(t)
    walk = gb.walk(m)
    v, budget = gb.vocab_size, 24
    logq = (torch.randn(8, v, generator=torch.Generator().manual_seed(1)) * 3).log_softmax(-1)
    masks = torch.zeros(budget + 1 if not chain else 9, gb.words, dtype=torch.int32)
    tree, pruned = build_tree_grammar(logq, 93, budget, walk, masks, chain=chain)
    assert pruned > 0
    want = torch.zeros_like(masks[:1])
    for i, path in node_paths(tree, first=0):
        fresh = gb.matcher(c)
        for t in tok.encode('{"name": "') + path:
            assert fresh.accept_token(t), (i, path)
        fresh.fill_next_token_bitmask(want, 0)
        assert torch.equal(masks[i], want[0]), i
        assert unpack_bits(masks[i:i + 1], v).any()
    if not chain:
        plain = build_tree_host(logq, 93, budget)
        again, _ = build_tree_grammar(logq, 93, budget, walk, masks, prune=False)
        assert tree_paths(again) == tree_paths(plain) and torch.equal(again.tokens, plain.tokens)


# ----------------------------------------------------------------------------------------------- end to end

EBNF = 'root ::= "(" expr ")"\nexpr ::= num | num op expr\nop ::= "+" | "*"\nnum ::= [1-9] [0-9]?'
NESTED = {"type": "object", "properties": {
    "user": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 999},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}, "minItems": 1,
                 "maxItems": 3}}, "required": ["id", "tags"], "additionalProperties": False},
    "ok": {"type": "boolean"}}, "required": ["user", "ok"], "additionalProperties": False}
PATTERN = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                            "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"},
                                            "score": {"type": "number", "minimum": 0, "maximum": 1}},
           "required": ["color", "code", "score"], "additionalProperties": False}
REGEX = r"[A-Z][a-z]{2,8}@[a-z]{3,6}\.(com|org)"
CHOICES = ["yes", "no", "maybe later"]


def constrained_requests(prompts: list[list[int]], max_tokens: int) -> tuple[list, dict]:
    """A batch of 8: JSON schemas greedy and seeded, a regex, choices, EBNF, json_object, a penalised request and
    a plain one; and how to check each constrained output."""
    g = dict(temperature=0.0, max_tokens=max_tokens)
    t1 = dict(temperature=1.0, top_p=0.95, max_tokens=max_tokens)
    specs = [("schema", dict(g, constraint=Constraint("json_schema", json.dumps(NESTED))), NESTED),
             ("pattern", dict(t1, seed=11, constraint=Constraint("json_schema", json.dumps(PATTERN))), PATTERN),
             ("regex", dict(t1, temperature=0.6, top_k=40, min_p=0.02, seed=12, constraint=Constraint("regex", REGEX)),
              REGEX),
             ("choice", dict(t1, seed=13, constraint=Constraint("choice", json.dumps(CHOICES))), CHOICES),
             ("ebnf", dict(t1, seed=14, constraint=Constraint("grammar", EBNF)), EBNF),
             ("object", dict(g, constraint=Constraint("json_object")), None),
             ("penalised", dict(t1, seed=15, repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.6,
                                min_tokens=4), None),
             ("repeat", dict(g, repetition_penalty=1.2), None)]
    reqs = [(name, prompts[i % len(prompts)], SamplingParams(**kw)) for i, (name, kw, _) in enumerate(specs)]
    return reqs, {name: check for name, _, check in specs}


def valid(kind: str, check, text: str) -> bool:
    import jsonschema

    if kind in ("schema", "pattern"):
        jsonschema.validate(json.loads(text), check)
        return True
    if kind == "regex":
        return re.fullmatch(check, text) is not None
    if kind == "choice":
        return text in check
    if kind == "object":
        return isinstance(json.loads(text), dict)
    if kind == "ebnf":
        return re.fullmatch(r"\((?:[1-9][0-9]?[+*])*[1-9][0-9]?\)", text) is not None
    return True


def _arms_job(ctx, lay, requests, arms, cfg):
    """Each arm (SpecConfig, static_steps) on a fresh engine over ``requests``; rank 0 returns
    ``[{rid: (tokens, reason)}]`` per arm and the drafts its grammars pruned."""
    from engine.engine import Engine
    from engine.sampling.grammar import GrammarBackend
    from engine.worker.loop import make_runner, worker_loop
    from model.loader import load_model
    from model.tokenizer import load_tokenizer
    from parallelism.comm import build_groups
    from spec_decode.speculation import load_speculation

    if lay.world_size == 1 and ctx.rank != 0:
        return None
    groups = ctx.groups(lay) if lay.world_size > 1 else build_groups(lay)
    model = load_model(TARGET, groups, torch.bfloat16)
    grammar = GrammarBackend.for_checkpoint(TARGET, model.cfg.vocab_size, tuple(model.cfg.eos_token_ids))
    out = []
    for spec, static in arms:
        speculation = load_speculation(spec, model)
        arm_cfg = cfg.replace(static_steps=static)
        if ctx.rank != 0:
            worker_loop(make_runner(model, arm_cfg, speculation, grammar))
            continue
        engine = Engine(model, arm_cfg, speculation=speculation, tokenizer=load_tokenizer(TARGET), grammar=grammar)
        got = run_requests(engine, requests)
        pruned = engine.runner.speculator.spec.pruned if speculation is not None else 0
        out.append((got, pruned, engine.scheduler.stats().preemptions, engine.scheduler.blocks_in_use()))
        engine.shutdown()
    return out if ctx.rank == 0 else None


def _precompile_job(ctx, lay, pattern: str, hinted: bool):
    """One constrained request on a tp8 engine, announced first with ``Engine.precompile`` or not; rank 0 returns
    the tokens, every other rank the constraint's compilations it ran (all, and on its grammar thread)."""
    from engine.engine import Engine
    from engine.sampling.grammar import GrammarBackend
    from engine.worker.loop import make_runner, worker_loop
    from model.loader import load_model
    from model.tokenizer import load_tokenizer

    model = load_model(TARGET, ctx.groups(lay), torch.bfloat16)
    grammar = GrammarBackend.for_checkpoint(TARGET, model.cfg.vocab_size, tuple(model.cfg.eos_token_ids))
    if ctx.rank != 0:
        compiles, in_background = grammar.compiles, grammar.compiles_in_background
        worker_loop(make_runner(model, cfg(), None, grammar))
        return grammar.compiles - compiles, grammar.compiles_in_background - in_background
    engine = Engine(model, cfg(), tokenizer=load_tokenizer(TARGET), grammar=grammar)
    constraint = Constraint("regex", pattern)
    if hinted:
        engine.precompile(constraint)
    got = run_requests(engine, [("r", prompts()[0][:20], SamplingParams(temperature=0.0, max_tokens=24,
                                                                       constraint=constraint))])
    engine.shutdown()
    return got["r"]


@pytest.mark.engine
def test_precompile_keeps_the_other_ranks_from_compiling_on_their_step_path(pool):
    """Announced, a new constraint compiles on every other rank's grammar thread (the step path only waits for it,
    or finds it done); unannounced, each rank compiles it on its step path. The output matches the constraint."""
    from model.tokenizer import load_tokenizer

    tok = load_tokenizer(TARGET)
    runs = {}
    for hinted, pattern in ((True, r"(def|class) [a-z_]{2,12}\(\):"), (False, r"(def|class) [a-z_]{2,11}\(\):")):
        tokens, *others = pool.run(_precompile_job, layout("tp8"), pattern, hinted)
        text = tok.decode(tokens[0], skip_special_tokens=True)
        assert re.fullmatch(pattern, text), text
        runs[hinted] = others
    assert runs == {True: [(1, 1)] * 7, False: [(1, 0)] * 7}, runs


def arms(full: bool):
    from spec_decode.config import SpecConfig

    drafter = str(ZOO / "drafter")
    ddtree = SpecConfig("ddtree", budget=16, block_size=9, drafter_path=drafter, tree_temperature=0.33)
    every = [(SpecConfig(), "on"), (ddtree, "on"), (SpecConfig("dflash", block_size=9, drafter_path=drafter), "on"),
             (SpecConfig(), "off")]
    return every if full else every[:2]


def cfg(num_blocks: int = 256):
    from engine.config import EngineConfig

    return EngineConfig.flat(max_num_seqs=8, max_num_batched_tokens=128, max_model_len=512, block_size=16,
                           num_blocks=num_blocks, static_steps="on", batch_invariant=True)


def prompts():
    return [p["ids"] for p in json.loads((ZOO / "eval_prompts.json").read_text())["prompts"][:4]]


@pytest.mark.engine
@pytest.mark.parametrize(("preset", "max_tokens", "full"), [("single", 64, True), ("tp8", 24, False),
                                                            ("dp8_ep8", 24, False)])
def test_speculation_gives_plain_constrained_and_penalised_tokens(pool, preset, max_tokens, full):
    from model.tokenizer import load_tokenizer

    requests, checks = constrained_requests(prompts(), max_tokens)
    run = pool.run(_arms_job, layout(preset), requests, arms(full), cfg())[0]
    plain = run[0][0]
    for (got, pruned, _, kv), (spec, static) in zip(run, arms(full), strict=True):
        assert got == plain, (spec.method, static, {k: (got[k], plain[k]) for k in got if got[k] != plain[k]})
        assert kv == 0
        if spec.enabled:
            assert pruned > 0
    tok = load_tokenizer(TARGET)
    for rid, (tokens, reason) in plain.items():
        if reason == "stop" and checks[rid] is not None or rid == "object" and reason == "stop":
            assert valid(rid, checks[rid], tok.decode(tokens, skip_special_tokens=True)), (rid, tok.decode(tokens))
    assert sum(reason == "stop" for rid, (_, reason) in plain.items() if rid in checks and checks[rid]) >= 3


@pytest.mark.engine
def test_preemption_replays_processor_state(pool):
    """A pool too small for the batch: requests are preempted and re-prefilled; their grammar matchers and penalty
    counts are rebuilt by replaying their output, and every token equals the unpressured run's."""
    requests, _ = constrained_requests(prompts(), 48)
    from spec_decode.config import SpecConfig

    drafter = str(ZOO / "drafter")
    ddtree = SpecConfig("ddtree", budget=8, block_size=9, drafter_path=drafter, tree_temperature=0.33)
    roomy = pool.run(_arms_job, layout("single"), requests, [(SpecConfig(), "on")], cfg())[0]
    # requests sharing a prompt would wait for each other's prefill and never press the pool (share_inflight_prefix)
    tight_cfg = cfg(44).replace(share_inflight_prefix=False)
    tight = pool.run(_arms_job, layout("single"), requests, [(SpecConfig(), "on"), (ddtree, "on")], tight_cfg)[0]
    for got, _, preempted, kv in tight:
        assert preempted > 0 and kv == 0
        assert got == roomy[0][0]


# ----------------------------------------------------------------------------------------------- n > 1

def test_samples_to_be_forked_hold_their_running_slots():
    """``max_num_seqs`` counts a request's samples from its admission: with 4 slots, an n=3 request, an n=1 and an
    n=2 one never run more than 4 sequences, n=2 waits until the n=3 group ends, and n=5 is refused."""
    from engine.config import EngineConfig, RequestError
    from engine.core.scheduler import Scheduler
    from engine.step import StepResult

    sched = Scheduler(EngineConfig.flat(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128, block_size=16,
                                      num_blocks=64), 1, 203, (1,))
    for rid, n, max_tokens in (("a", 3, 6), ("c", 1, 4), ("b", 2, 4)):
        sched.add(rid, list(range(10, 40)), SamplingParams(temperature=1.0, max_tokens=max_tokens, n=n,
                                                           ignore_eos=True), 7)
    with pytest.raises(RequestError, match="n=5 is above max_num_seqs=4"):
        sched.add("d", [1, 2, 3], SamplingParams(max_tokens=2, n=5), 0)
    most, b_started_while_a_ran, finished = 0, False, []
    while sched.has_work():
        plan = sched.schedule()
        most = max(most, sched.stats().running)
        running = {w.request_id.split("\x1f")[0] for w in plan.work[0]}
        b_started_while_a_ran |= {"a", "b"} <= running
        out = sched.update(plan, {w.request_id: StepResult([5], [0.0], [[]]) for w in plan.work[0] if w.sample})
        finished += [(o.request_id, o.index) for o in out if o.finished]
    assert most == 4 and not b_started_while_a_ran
    assert sorted(finished) == [("a", 0), ("a", 1), ("a", 2), ("b", 0), ("b", 1), ("c", 0)]
    assert sched.blocks_in_use() == 0


def _n_job(ctx, lay, spec_arms, prompt):
    """``n=4`` seeded at T=1 against four standalone requests seeded s + i, per arm; prefill tokens of each."""
    from engine.engine import Engine
    from engine.worker.loop import make_runner, worker_loop
    from model.loader import load_model
    from parallelism.comm import build_groups
    from spec_decode.speculation import load_speculation

    if lay.world_size == 1 and ctx.rank != 0:
        return None
    groups = ctx.groups(lay) if lay.world_size > 1 else build_groups(lay)
    model = load_model(TARGET, groups, torch.bfloat16)
    out = []
    for spec in spec_arms:
        speculation = load_speculation(spec, model)
        arm_cfg = cfg().replace(prefix_caching=False)
        if ctx.rank != 0:
            worker_loop(make_runner(model, arm_cfg, speculation))
            continue
        engine = Engine(model, arm_cfg, speculation=speculation)
        engine.add_request("n", prompt, SamplingParams(temperature=1.0, top_p=0.9, seed=100, max_tokens=24, n=4))
        forked: dict[int, list[int]] = {}
        while engine.has_work():
            for o in engine.step():
                assert o.request_id == "n"
                forked.setdefault(o.index, []).extend(o.new_tokens)
        prefill = engine.stats.prefill_tokens
        alone = run_requests(engine, [(f"s{i}", prompt, SamplingParams(temperature=1.0, top_p=0.9, seed=100 + i,
                                                                      max_tokens=24)) for i in range(4)])
        out.append((forked, {i: alone[f"s{i}"][0] for i in range(4)}, prefill,
                    engine.stats.prefill_tokens - prefill, engine.scheduler.blocks_in_use()))
        engine.shutdown()
    return out if ctx.rank == 0 else None


@pytest.mark.engine
@pytest.mark.parametrize("preset", ("single", "dp8_ep8"))
def test_n_samples_equal_standalone_seeded_requests_and_prefill_once(pool, preset):
    from spec_decode.config import SpecConfig

    prompt = prompts()[0][:45]  # 44 shared tokens: two full blocks of 16 and a partial one (copied)
    ddtree = SpecConfig("ddtree", budget=16, block_size=9, drafter_path=str(ZOO / "drafter"), tree_temperature=0.33)
    arms = [SpecConfig(), ddtree] if preset == "single" else [ddtree]  # dp8_ep8: the copy on one DP group's ranks
    for forked, alone, prefill, standalone, kv in pool.run(_n_job, layout(preset), arms, prompt)[0]:
        assert forked == alone
        assert prefill == len(prompt) - 1 + 4 and standalone == 4 * len(prompt)
        assert kv == 0


@pytest.mark.engine
def test_overlap_gives_the_same_constrained_and_penalised_tokens(pool):
    """``engine.overlap=on``: constrained rows drain the pipeline (their mask needs the last token on the host),
    penalised rows take their history's in-flight token on the device; both give the tokens of overlap off."""
    from spec_decode.config import SpecConfig

    requests, _ = constrained_requests(prompts(), 32)
    unconstrained = [r for r in requests if r[2].constraint is None]
    runs = {}
    for overlap in ("off", "on"):
        over = cfg().replace(overlap=overlap)
        runs[overlap] = [pool.run(_arms_job, layout("single"), reqs, [(SpecConfig(), "on")], over)[0][0][0]
                         for reqs in (requests, unconstrained)]
    assert runs["on"] == runs["off"]
