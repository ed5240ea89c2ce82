"""The engine on quantized checkpoints: greedy tokens equal HF transformers' on the dequantized copy under
every layout, DDTree and DFlash stay lossless, and serve.py serves one through the SMG gateway."""


import pytest
import torch

from engine.params import SamplingParams
from model.tiny import load_hf
from tests.engine.test_engine import GREEDY, PROMPTS, greedy_job
from tests.engine.test_engine import _engine_job as engine_job
from tests.spec_decode.test_spec_engine import PROMPTS as SPEC_PROMPTS
from tests.spec_decode.test_spec_engine import _job as spec_job
from tests.spec_decode.test_spec_engine import specs
from tests.support.layouts import layout
from tests.support.rpc_helpers import ServerProcess, smg_gateway, with_tokenizer

CKPTS = ("kimi_k25_int4", "qwen3_int4", "deepseek_fp8", "qwen3_fp8")


def hf_tokens(path, prompts, n):
    """HF's greedy continuation through EOS (not banned: these checkpoints do pick EOS, which ``ignore_eos``
    emits and runs past, where ``min_new_tokens`` would pick the runner-up instead)."""
    hf = load_hf(path)
    hf.generation_config.eos_token_id = None
    return [hf.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False)[0, len(p):].tolist() for p in prompts]


@pytest.fixture(scope="module")
def hf_greedy(quant_ckpts):
    return {name: hf_tokens(quant_ckpts[name][1], PROMPTS, GREEDY.max_tokens) for name in CKPTS}


@pytest.mark.parametrize("ckpt", CKPTS)
@pytest.mark.parametrize("preset", ["single", "tp8", "ep8", "dp8_ep8", "tp2_ep4", "tp2xdp4_ep8"])
def test_greedy_matches_hf_on_dequantized_copy(pool, quant_ckpts, hf_greedy, ckpt, preset):
    if preset in ("ep8", "tp2_ep4") and ckpt in ("qwen3_int4", "qwen3_fp8"):
        pytest.skip("two checkpoints per layout keep the module short; the logits test covers every pair")
    (results, blocks, _), = pool.run(engine_job, layout(preset), quant_ckpts[ckpt][0], [greedy_job()])[0]
    for i, ref in enumerate(hf_greedy[ckpt]):
        tokens, reason = results[f"r{i}"]
        assert tokens == ref, f"{ckpt} {preset} prompt {i}: {tokens} != HF {ref}"
    assert blocks == 0


@pytest.mark.parametrize("ckpt", ["kimi_k25_int4", "deepseek_fp8"])
@pytest.mark.parametrize("preset", ["single", "tp8", "dp8_ep8"])
def test_speculation_is_lossless_on_quantized_targets(pool, quant_ckpts, random_drafter, ckpt, preset):
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    (plain, _, b0), (chain, _, b1), (tree, tau_tree, b2) = pool.run(
        spec_job, layout(preset), quant_ckpts[ckpt][0], SPEC_PROMPTS, specs(random_drafter), params)[0]
    assert chain == plain and tree == plain
    assert tau_tree >= 1.0 and b0 == b1 == b2 == 0


def test_serve_through_smg(quant_ckpts, tmp_path):
    """serve.py (one rank) on the Kimi K2.5-style INT4 checkpoint behind ``smg launch``: the OpenAI completion
    equals the server's own greedy answer, which equals HF's greedy tokens on the dequantized copy."""
    from openai import OpenAI
    from tokenizers import Tokenizer

    ckpt = with_tokenizer(quant_ckpts["kimi_k25_int4"][0], tmp_path / "ckpt")
    srv = ServerProcess(str(ckpt), ["parallel=single", "server.served_model_name=tiny"], tmp_path / "server.log")
    client = None
    try:
        client = srv.wait_ready()
        with smg_gateway(srv.target, ckpt, tmp_path / "smg.log", "--disable-retries", "--disable-circuit-breaker",
                         model="tiny") as base:
            tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
            ids = tok.encode("Hello world", add_special_tokens=False).ids
            own = client.generate(ids, max_tokens=8, temperature=0.0)
            assert own.token_ids and (len(own.token_ids) == 8 or own.finish_reason == "stop"), own
            assert own.token_ids == hf_tokens(quant_ckpts["kimi_k25_int4"][1], [ids], 8)[0][:len(own.token_ids)]
            oai = OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
            r = oai.completions.create(model="tiny", prompt="Hello world", max_tokens=8, temperature=0)
            assert r.choices[0].text == tok.decode(own.token_ids, skip_special_tokens=True)
    finally:
        if client is not None:
            client.close()
        srv.close()


@pytest.mark.parametrize("ckpt", ["deepseek_fp8", "kimi_k25_int4"])
def test_bf16_model_decodes(quant_ckpts, ckpt):
    """A bf16 model (the GPU dtype) on a quantized checkpoint decodes through the absorbed MLA path, which reads
    the dequantized ``kv_b_proj`` in the model's dtype (FP8: it is quantized): six tokens, the first one fp32's."""
    from engine.engine import Engine
    from model.loader import load_model
    from parallelism.comm import build_groups
    from parallelism.layout import Layout
    from tests.engine.test_engine import SMALL, run_requests

    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        engine = Engine(load_model(quant_ckpts[ckpt][0], build_groups(Layout()), dtype), SMALL)
        out[dtype] = run_requests(engine, [("a", PROMPTS[0], params), ("b", PROMPTS[2], params)])
        engine.shutdown()
    for rid in ("a", "b"):
        assert len(out[torch.bfloat16][rid][0]) == 6
        assert out[torch.bfloat16][rid][0][0] == out[torch.float32][rid][0][0]


def test_expert_tally_counts_quantized_experts(quant_ckpts):
    """``engine.expert_tally`` (the bench turns it on) hooks quantized expert layers too: a decode step's count per
    MoE layer is between 1 and the experts its rows can route to."""

    from engine.engine import Engine
    from model.loader import load_model
    from parallelism.comm import build_groups
    from parallelism.layout import Layout
    from tests.engine.test_engine import SMALL, run_requests

    model = load_model(quant_ckpts["kimi_k25_int4"][0], build_groups(Layout()), torch.float32)
    engine = Engine(model, SMALL.replace(expert_tally=True))
    run_requests(engine, [("a", PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))])
    counts = engine.runner.tally.snapshot()
    engine.shutdown()
    top_k = model.cfg.moe.top_k
    assert counts["forwards"] and all(f > 0 for f in counts["forwards"])
    assert all(f <= e <= f * top_k for e, f in zip(counts["experts"], counts["forwards"], strict=True)), counts
