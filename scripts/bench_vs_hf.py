"""Single-rank decode throughput of this engine vs HF transformers ``generate`` on the same checkpoint,
batch 1 and batch 8, measured side by side in one run and printed as ratios.

    python scripts/bench_vs_hf.py [--prompt-len 32] [--new-tokens 64] [--ckpt DIR]

Without ``--ckpt`` it writes an ~8M-parameter 4-layer DeepSeek-V3 (random weights) with HF
``save_pretrained``. Decode time excludes prefill on both sides: HF's is ``generate(N) - generate(1)``,
ours is the engine's decode-only steps.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.engine import Engine
from engine.params import SamplingParams
from model.loader import load_model
from model.tiny import load_hf, write_tiny
from parallelism.comm import build_groups
from parallelism.layout import Layout

BENCH_MODEL = dict(vocab_size=4096, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                   num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8, n_routed_experts=16,
                   num_experts_per_tok=4, n_group=4, topk_group=2, first_k_dense_replace=1, q_lora_rank=64,
                   kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32)


def hf_decode(hf, prompts: torch.Tensor, new_tokens: int, repeats: int) -> float:
    """Best-of-``repeats`` decode tokens/s of HF generate (greedy, fixed length)."""
    def run(n):
        t0 = time.perf_counter()
        hf.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=n, min_new_tokens=n,
                    do_sample=False)
        return time.perf_counter() - t0
    best = min(run(new_tokens) - run(1) for _ in range(repeats))
    return prompts.shape[0] * (new_tokens - 1) / best


def engine_decode(model, prompts: torch.Tensor, new_tokens: int, repeats: int) -> tuple[float, list]:
    best, tokens = 0.0, None
    cfg = EngineConfig.flat(max_num_seqs=16, max_num_batched_tokens=1024, max_model_len=512, block_size=16,
                          num_blocks=256)
    for _ in range(repeats):
        engine = Engine(model, cfg)
        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
        for i, p in enumerate(prompts.tolist()):
            engine.add_request(str(i), p, params)
        out = {str(i): [] for i in range(prompts.shape[0])}
        while engine.has_work():
            for o in engine.step():
                out[o.request_id] += o.new_tokens
        best = max(best, engine.stats.decode_tokens / engine.stats.decode_s)
        tokens = [out[str(i)] for i in range(prompts.shape[0])]
    return best, tokens


def cold_gemv_bandwidth(mib: int = 128) -> float:
    """Bytes/s of fp32 GEMVs over many distinct 256 KiB weights (cold caches): this box's decode roofline."""
    ws = [torch.randn(256, 256) for _ in range(mib * 4)]
    v = torch.randn(1, 256)
    t0 = time.perf_counter()
    for w in ws:
        torch.nn.functional.linear(v, w)
    return len(ws) * 256 * 256 * 4 / (time.perf_counter() - t0)


def weight_bytes_per_step(hf, batch: int) -> float:
    """fp32 weight bytes a decode step must read: everything but the embedding table and the routed
    experts, plus the expected number of distinct routed experts hit by ``batch`` tokens per MoE layer."""
    c = hf.config
    total = expert = 0
    for name, p in hf.named_parameters():
        if "embed_tokens" in name:
            continue
        if ".experts." in name:
            expert += p.numel()
        else:
            total += p.numel()
    moe_layers = c.num_hidden_layers - c.first_k_dense_replace
    per_expert = expert / (moe_layers * c.n_routed_experts)
    hit = c.n_routed_experts * (1 - (1 - c.num_experts_per_tok / c.n_routed_experts) ** batch)
    return 4 * (total + moe_layers * hit * per_expert)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ckpt", default=None)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tmp = tempfile.TemporaryDirectory()
    ckpt = args.ckpt or str(write_tiny("tiny_deepseek", Path(tmp.name) / "bench", initializer_range=0.02,
                                       **BENCH_MODEL))
    hf = load_hf(ckpt)
    model = load_model(ckpt, build_groups(Layout()))
    n_params = sum(p.numel() for p in hf.parameters())
    print(f"checkpoint {ckpt}: {n_params / 1e6:.1f}M parameters, {hf.config.num_hidden_layers} layers, "
          f"{torch.get_num_threads()} thread(s)")
    bw = cold_gemv_bandwidth()
    print(f"cold fp32 GEMV bandwidth on this box: {bw / 1e9:.1f} GB/s")
    print("| batch | HF decode tok/s | engine decode tok/s | ratio | same greedy tokens | weight-read floor tok/s |")
    print("|---|---|---|---|---|---|")
    gen = torch.Generator().manual_seed(0)
    for batch in (1, 8):
        prompts = torch.randint(2, hf.config.vocab_size, (batch, args.prompt_len), generator=gen)
        ref = hf.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=args.new_tokens,
                          min_new_tokens=args.new_tokens, do_sample=False)[:, args.prompt_len:].tolist()
        hf_tps = hf_decode(hf, prompts, args.new_tokens, args.repeats)
        ours, tokens = engine_decode(model, prompts, args.new_tokens, args.repeats)
        floor = batch * bw / weight_bytes_per_step(hf, batch)
        print(f"| {batch} | {hf_tps:.0f} | {ours:.0f} | {ours / hf_tps:.2f}x | {tokens == ref} | {floor:.0f} |")


if __name__ == "__main__":
    main()
