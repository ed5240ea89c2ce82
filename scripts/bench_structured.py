"""Structured output's costs and its DDTree effect, measured on this machine (CPU; docs/sampling.md has the numbers):

1. host milliseconds per step for a grammar's masks — filling one row's bitmask at the committed state, and
   uploading, unpacking and applying a batch's masks — and for the tree round trip (a DDTree of budget 16 built on
   the host under the grammar, every node's mask filled), at the built-in vocabulary (tiny_kimi, 4,096) and at
   163,840 (Kimi K2's; 5,120-word masks, a synthetic raw-byte vocabulary);
2. output tokens per second with DDTree at batch 1 and 8 (tiny_kimi): unconstrained, under a JSON schema (other text,
   other τ), and under a regex that accepts every text (the unconstrained tokens: the grammar's overhead alone);
3. on the forced marker runs of smg's Kimi structural tag (``tool_choice="required"``, two tools, as smg 1.13 sends
   it), the tokens accepted per verify step with grammar-pruned drafts vs the plain tree (``spec_decode.prune_drafts``),
   and the candidates the grammar pruned — a Kimi-style tiktoken checkpoint (model/tiny_tiktoken.py) with a random
   DFlash drafter.

    python scripts/bench_structured.py [--out docs/structured_bench.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.config import EngineConfig  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.params import Constraint, SamplingParams  # noqa: E402
from engine.sampling.grammar import GrammarBackend, unpack_bits  # noqa: E402
from model.loader import load_model  # noqa: E402
from model.tokenizer import load_tokenizer  # noqa: E402
from parallelism.comm import build_groups  # noqa: E402
from parallelism.layout import Layout  # noqa: E402
from spec_decode.config import SpecConfig  # noqa: E402
from spec_decode.speculation import load_speculation  # noqa: E402
from spec_decode.tree import build_tree_grammar  # noqa: E402

ZOO = ROOT / "model" / "zoo" / "tiny_kimi"
REPEATS = 7
SCHEMA = {"type": "object", "properties": {
    "user": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999},
                                              "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                                       "minItems": 1, "maxItems": 3}},
             "required": ["id", "tags"], "additionalProperties": False},
    "name": {"type": "string", "maxLength": 16}, "ok": {"type": "boolean"}},
    "required": ["user", "name", "ok"], "additionalProperties": False}
TOOL_SCHEMAS = {"get_weather": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                                                                 "days": {"type": "integer", "minimum": 1,
                                                                          "maximum": 7}},
                                "required": ["city", "days"], "additionalProperties": False},
                "set_alarm": {"type": "object", "properties": {"hour": {"type": "integer", "minimum": 0,
                                                                        "maximum": 23},
                                                               "label": {"type": "string", "maxLength": 6}},
                              "required": ["hour"], "additionalProperties": False}}


def kimi_tool_tag() -> str:
    """The structural tag smg 1.13 sends for ``tool_choice="required"`` with --tool-call-parser kimik2 (logged)."""
    tags = []
    for i, (name, schema) in enumerate(TOOL_SCHEMAS.items()):
        for begin in (f"<|tool_calls_section_begin|><|tool_call_begin|>functions.{name}:{i}"
                      "<|tool_call_argument_begin|>", f"<|tool_call_begin|>functions.{name}:{i}"
                      "<|tool_call_argument_begin|>"):
            tags.append({"begin": begin, "content": {"type": "json_schema", "json_schema": schema},
                         "end": "<|tool_call_end|>"})
    return json.dumps({"format": {"type": "triggered_tags", "triggers": ["<|tool_calls_section_begin|>",
                                                                         "<|tool_call_begin|>"],
                                  "tags": tags, "at_least_one": True}})


class BigVocab(GrammarBackend):
    """A GrammarBackend over a synthetic raw-byte vocabulary of ``vocab_size`` entries: the 256 bytes, every byte
    pair, then 3-byte strings (a stand-in for K2's 163,840-token vocabulary)."""

    def compiler(self):
        import itertools

        import xgrammar as xgr

        if self._compiler is None:
            vocab = [bytes([b]) for b in range(256)] + [bytes(p) for p in itertools.product(range(256), repeat=2)]
            triples = itertools.product(range(32, 127), repeat=3)
            while len(vocab) < self.vocab_size:
                vocab.append(bytes(next(triples)))
            info = xgr.TokenizerInfo(vocab[:self.vocab_size], xgr.VocabType.RAW, vocab_size=self.vocab_size,
                                     stop_token_ids=list(self.eos_ids))
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
            self.never = self.special = frozenset(info.special_token_ids) - set(self.eos_ids)
        return self._compiler


def mask_costs(backend: GrammarBackend, prefix: bytes, batch: int = 8, reps: int = 20) -> dict:
    """Host ms: one row's fill at a state inside the schema; a batch's upload + unpack + apply on [batch, V] logits;
    a budget-16 DDTree built under the grammar (with every node's mask)."""
    c = Constraint("json_schema", json.dumps(SCHEMA))
    t0 = time.perf_counter()
    backend.compile(c)
    compile_ms = 1e3 * (time.perf_counter() - t0)
    m = backend.matcher(c)
    m.accept_string(prefix.decode())
    masks = torch.full((batch, backend.words), -1, dtype=torch.int32)
    t0 = time.perf_counter()
    for _ in range(reps):
        m.fill_next_token_bitmask(masks, 0)
    fill_ms = 1e3 * (time.perf_counter() - t0) / reps
    for row in range(1, batch):
        masks[row] = masks[0]
    logits = torch.randn(batch, backend.vocab_size)
    t0 = time.perf_counter()
    for _ in range(reps):
        logits.masked_fill(~unpack_bits(masks.clone(), backend.vocab_size), float("-inf"))
    apply_ms = 1e3 * (time.perf_counter() - t0) / reps
    logq = (torch.randn(8, backend.vocab_size, generator=torch.Generator().manual_seed(0)) * 3).log_softmax(-1)
    walk = backend.walk(m)
    tree_masks = torch.zeros(17, backend.words, dtype=torch.int32)
    t0 = time.perf_counter()
    for _ in range(reps // 4):
        _, pruned = build_tree_grammar(logq, 0, 16, walk, tree_masks)
    tree_ms = 1e3 * (time.perf_counter() - t0) / (reps // 4)
    return {"vocab": backend.vocab_size, "mask_words": backend.words, "compile_ms": compile_ms,
            "fill_ms_per_row": fill_ms, f"upload_unpack_apply_ms_batch{batch}": apply_ms,
            "tree_build_ms_budget16": tree_ms, "tree_pruned_candidates": pruned, **new_schema_compile(backend)}


def new_schema_compile(backend: GrammarBackend) -> dict:
    """A second JSON schema's compile (the tokenizer info built already) on the grammar thread, and how fast a Python
    loop on this thread runs meanwhile, relative to alone (1.0: the compile holds no GIL)."""
    other = dict(SCHEMA, properties=dict(SCHEMA["properties"], note={"type": "string", "maxLength": 8}))
    c = Constraint("json_schema", json.dumps(other))

    def spin(seconds: float | None) -> float:
        """Loop iterations per second (each asks whether ``c`` is compiled) for ``seconds``, or until it is."""
        n, t0 = 0, time.perf_counter()
        while not backend.cached(c) and (seconds is None or time.perf_counter() - t0 < seconds):
            n += 1
        return n / (time.perf_counter() - t0)

    alone = spin(0.3)
    t0 = time.perf_counter()
    backend.compile_soon(c)
    beside = spin(None)
    return {"new_schema_compile_ms": 1e3 * (time.perf_counter() - t0), "python_speed_beside_compile": beside / alone}


def engine_for(path: Path, spec: SpecConfig, grammar: GrammarBackend, dtype=torch.float32) -> Engine:
    groups = build_groups(Layout(world_size=1, attn_tp=1, attn_dp=1, moe_tp=1, moe_ep=1))
    model = load_model(path, groups, dtype)
    cfg = EngineConfig.flat(max_num_seqs=8, max_num_batched_tokens=512, max_model_len=512, block_size=16,
                          num_blocks=512, static_steps="on")
    return Engine(model, cfg, speculation=load_speculation(spec, model), tokenizer=load_tokenizer(path),
                  grammar=grammar)


def run(engine: Engine, requests: list[tuple[str, list[int], SamplingParams]]) -> tuple[dict, list, float]:
    out, steps = {rid: [] for rid, _, _ in requests}, []
    t0 = time.perf_counter()
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    while engine.has_work():
        step = engine.step()
        steps.append({o.request_id: len(o.new_tokens) for o in step})
        for o in step:
            out[o.request_id] += o.new_tokens
    return out, steps, time.perf_counter() - t0


ARMS = {"unconstrained": None, "json_schema": Constraint("json_schema", json.dumps(SCHEMA)),
        # accepts every text, so its tokens are the unconstrained ones and its rate isolates the grammar's cost
        "any_text": Constraint("regex", r"[\s\S]*")}


def throughput(grammar: GrammarBackend) -> list[dict]:
    """DDTree tokens/s on tiny_kimi per arm of ARMS, batch 1 and 8: after a warm-up of each, REPEATS rounds that
    alternate the arms (so a busy neighbour on the box slows them alike); the median of each. ``json_schema`` changes
    the text and so τ; ``any_text`` keeps the unconstrained tokens (checked) and measures the overhead alone."""
    spec = SpecConfig("ddtree", budget=16, block_size=9, drafter_path=str(ZOO / "drafter"), tree_temperature=0.33)
    engine = engine_for(ZOO / "target", spec, grammar)
    tok = load_tokenizer(ZOO / "target")
    prompts = [p["ids"] for p in json.loads((ZOO / "eval_prompts.json").read_text())["prompts"][:8]]
    rows = []
    for batch in (1, 8):
        arms = {name: [(f"{batch}-{name}-{i}", prompts[i], SamplingParams(temperature=0.0, max_tokens=64,
                                                                          constraint=c)) for i in range(batch)]
                for name, c in ARMS.items()}
        for reqs in arms.values():
            run(engine, [(f"warm-{r}", p, q) for r, p, q in reqs])
        rates, taus, outs = {a: [] for a in arms}, {a: [] for a in arms}, {}
        for rep in range(REPEATS):
            for name, reqs in arms.items():
                steps0, tokens0 = engine.stats.spec_request_steps, engine.stats.spec_tokens
                out, _, dt = run(engine, [(f"{r}-{rep}", p, q) for r, p, q in reqs])
                rates[name].append(sum(len(v) for v in out.values()) / dt)
                taus[name].append((engine.stats.spec_tokens - tokens0) /
                                  max(engine.stats.spec_request_steps - steps0, 1))
                outs[name] = [out[f"{r}-{rep}"] for r, _, _ in reqs]
        base = sorted(rates["unconstrained"])[REPEATS // 2]
        for name in arms:
            median = sorted(rates[name])[REPEATS // 2]
            rows.append({"batch": batch, "arm": name, "tokens_per_s_median": median,
                         "tokens_per_s_runs": rates[name], "tau": taus[name][-1],
                         "over_unconstrained": median / base,
                         "same_tokens_as_unconstrained": outs[name] == outs["unconstrained"],
                         "sample_text": tok.decode(outs[name][0], skip_special_tokens=True)[:80]})
    engine.shutdown()
    return rows


def forced_markers(tmp: Path) -> list[dict]:
    """τ on the structural tag's forced marker runs (until ``<|tool_call_argument_begin|>`` is out), pruned vs not."""
    from model.tiny_tiktoken import write_tiktoken_checkpoint
    from spec_decode.dflash import DFlashConfig, DFlashDrafter

    ckpt = write_tiktoken_checkpoint(tmp / "kimi")
    config = json.loads((ckpt / "config.json").read_text())
    torch.manual_seed(0)
    drafter_cfg = DFlashConfig(hidden_size=config["hidden_size"], num_layers=1, num_heads=4, num_kv_heads=2,
                               head_dim=16, intermediate_size=64, target_layer_ids=(0, config["num_hidden_layers"] - 1),
                               mask_token_id=config["vocab_size"] - 1, block_size=9)
    DFlashDrafter(drafter_cfg).save(tmp / "drafter")
    tok = load_tokenizer(ckpt)
    grammar = GrammarBackend.for_checkpoint(ckpt, config["vocab_size"], (config["vocab_size"] - 255,))
    prompt = tok.encode("<|im_user|>user<|im_middle|>weather in Oslo?<|im_end|><|im_assistant|>assistant"
                        "<|im_middle|>")
    rows = []
    for prune in (True, False):
        spec = SpecConfig("ddtree", budget=16, block_size=9, drafter_path=str(tmp / "drafter"), prune_drafts=prune)
        engine = engine_for(ckpt, spec, grammar)
        params = SamplingParams(temperature=0.0, max_tokens=160, constraint=Constraint("structural_tag",
                                                                                      kimi_tool_tag()))
        out, steps, _ = run(engine, [("call", prompt, params)])
        tokens = out["call"]
        marker_end = next(i + 1 for i in range(len(tokens))
                          if "<|tool_call_argument_begin|>" in tok.decode(tokens[:i + 1]))
        per_step, done = [], 0
        for step in steps[1:]:  # the first step is the prefill
            if done >= marker_end:
                break
            per_step.append(step.get("call", 0))
            done += step.get("call", 0)
        rows.append({"prune_drafts": prune, "marker_tokens": marker_end, "verify_steps_on_markers": len(per_step),
                     "accepted_per_step_on_markers": marker_end / len(per_step),
                     "pruned_candidates": engine.runner.speculator.spec.pruned,
                     "text": tok.decode(tokens[:marker_end + 12])})
        engine.shutdown()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "docs" / "structured_bench.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    small = GrammarBackend.for_checkpoint(ZOO / "target", 4096, (0,))
    doc = {"machine": f"{torch.get_num_threads()} torch thread(s), CPU", "masks": [
        mask_costs(small, b'{"user": {"id": 12, "tags": ["a"]}, "name": "'),
        mask_costs(BigVocab(ZOO / "target", 163840, (0,)), b'{"user": {"id": 12, "tags": ["a"]}, "name": "')]}
    print(json.dumps(doc["masks"], indent=1), flush=True)
    doc["throughput_ddtree"] = throughput(small)
    print(json.dumps(doc["throughput_ddtree"], indent=1), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        doc["forced_markers"] = forced_markers(Path(tmp))
    print(json.dumps(doc["forced_markers"], indent=1), flush=True)
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
