"""``scripts/train_tiny.py`` on toy sizes (seconds): losses finite and falling on a repeated batch, the drafter
round-trips through its z-lab checkpoint layout bit-exactly, the data/prompt helpers keep their contracts,
and the committed ``model/zoo/tiny_kimi`` pair (when present) satisfies the shape the engine relies on."""

import importlib.util
import json
import math
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

from spec_decode.dflash import DFlashDrafter
from tests.support.paths import REPO_ROOT

pytest.importorskip("transformers")

ROOT = REPO_ROOT
_spec = importlib.util.spec_from_file_location("train_tiny", ROOT / "scripts" / "train_tiny.py")
tt = importlib.util.module_from_spec(_spec)
sys.modules["train_tiny"] = tt  # dataclasses resolve annotations through sys.modules
_spec.loader.exec_module(tt)

STDLIB = Path(sysconfig.get_paths()["stdlib"])
FILES = [STDLIB / n for n in ("textwrap.py", "bisect.py", "shlex.py", "colorsys.py")]
TOY_TARGET = tt.TargetShape(hidden_size=32, num_layers=3, num_heads=8, intermediate_size=64, moe_intermediate_size=16,
                            n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, q_lora_rank=16,
                            kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
                            max_position_embeddings=128)
TOY_DRAFTER = tt.DrafterShape(num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=64,
                              block_size=4, target_layer_ids=(0, 1))
SEQ = 48


def _falls(losses: list[float]) -> bool:
    return all(math.isfinite(x) for x in losses) and sum(losses[-2:]) / 2 < 0.9 * sum(losses[:2]) / 2


@pytest.fixture(scope="module")
def toy():
    texts = tt.read_texts(FILES)
    tok = tt.build_tokenizer(texts, 320)
    eos, mask, pad = (tok.token_to_id(s) for s in tt.SPECIAL_TOKENS)
    stream = tt.pack(tok, texts, eos)
    batch = tt.random_chunks(stream, 2, SEQ, torch.Generator().manual_seed(0))
    cfg = tt.target_config(TOY_TARGET, tok.get_vocab_size(), eos, pad)
    target = tt.build_target(cfg, seed=0)
    sched = tt.Schedule(steps=8, budget_s=60, lr=1e-2, warmup=1, log_every=4)
    result = tt.train_target(target, lambda _s: batch, sched)
    return {"tok": tok, "cfg": cfg, "target": target, "batch": batch, "target_result": result, "mask": mask}


def test_tokenizer_specials_and_roundtrip(toy):
    tok = toy["tok"]
    assert [tok.token_to_id(s) for s in tt.SPECIAL_TOKENS] == [0, 1, 2]
    text = "def f(x):\n    return x  # ünïcode\n"
    assert tok.decode(tok.encode(text, add_special_tokens=False).ids) == text


def test_target_loss_falls_and_biases_stay_non_negative(toy):
    assert _falls(toy["target_result"]["losses"]), toy["target_result"]["losses"]
    biases = [layer.mlp.gate.e_score_correction_bias for layer in toy["target"].model.layers[1:]]
    assert all((b >= 0).all() and b.min() == 0 for b in biases)
    assert any(b.max() > 0 for b in biases)  # the balancer moved them


def test_target_config_parses_for_the_engine(toy, tmp_path):
    from model.config import load_config

    toy["target"].save_pretrained(tmp_path)
    cfg = load_config(tmp_path)
    assert cfg.moe.n_group == 4 and cfg.moe.topk_group == 2 and cfg.moe.num_shared_experts == 1
    assert cfg.moe_layers == (False, True, True) and cfg.eos_token_ids == (0,)


def test_drafter_loss_falls_and_reloads_identically(toy, tmp_path):
    target, batch = toy["target"], toy["batch"]
    dcfg = tt.drafter_config(TOY_DRAFTER, toy["cfg"], toy["mask"])
    torch.manual_seed(0)
    drafter = DFlashDrafter(dcfg)
    sched = tt.Schedule(steps=10, budget_s=60, lr=1e-2, warmup=1, weight_decay=0.0, log_every=5)
    result = tt.train_drafter(drafter, target, lambda _s: batch, sched, anchors_per_seq=SEQ, gamma=7.0, seed=0)
    assert _falls(result["losses"]), result["losses"]

    drafter.save(tmp_path)
    again = DFlashDrafter.load(tmp_path)
    assert again.c == drafter.c
    feats, _ = tt.target_outputs(target, batch[:1], dcfg.target_layer_ids)
    anchors = torch.tensor([1, 7, SEQ - dcfg.block_size])
    embed = target.get_input_embeddings()
    with torch.no_grad():
        a = tt.draft_hidden(drafter, embed, batch[0], feats[0], anchors)
        b = tt.draft_hidden(again, embed, batch[0], feats[0], anchors)
    assert torch.equal(a, b)  # same weights, same kernels: bit-exact

    agree = tt.drafter_agreement(again, target, batch, stride=5)
    assert len(agree["per_position"]) == dcfg.block_size - 1 and all(0 <= x <= 1 for x in agree["per_position"])
    taus = tt.chain_tau(again, target, batch[0, :20].tolist(), batch[0, 20:].tolist())
    assert taus and all(1 <= t <= dcfg.block_size for t in taus)


def test_pool_is_prefix_plus_the_targets_greedy_continuation(toy, monkeypatch):
    target, batch = toy["target"], toy["batch"]
    stream = batch.reshape(-1)
    kw = {"n": 5, "total_len": 24, "prefix": (6, 10), "batch": 2}
    pool = tt.build_pool(target, stream, gen=torch.Generator().manual_seed(1), **kw)
    ids, lens = pool["ids"], pool["prefix_len"]
    assert ids.shape == (5, 24) and lens.shape == (5,) and pool["batches"] == 3 and pool["stopped_by"] == "size"
    assert ((6 <= lens) & (lens <= 10)).all() and (lens[0::2][:2] == lens[1::2][:2]).all()  # one length per batch
    for row, n in zip(ids, lens.tolist(), strict=True):
        # the prefix is a real window of the stream ...
        assert any(torch.equal(row[:n], stream[s:s + n]) for s in range(len(stream) - n + 1))
        # ... and the rest is the target's greedy continuation, token by token without a cache
        seq = row[:n].tolist()
        with torch.no_grad():
            while len(seq) < 24:
                seq.append(int(target(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
        assert seq == row.tolist()
    assert tt.greedy_match(target, ids, lens) == 1.0
    again = tt.build_pool(target, stream, gen=torch.Generator().manual_seed(1), **kw)
    assert torch.equal(again["ids"], ids) and torch.equal(again["prefix_len"], lens)  # seeded
    cut = tt.build_pool(target, stream, gen=torch.Generator().manual_seed(1), budget_s=0.0, **kw)
    assert cut["stopped_by"] == "budget" and torch.equal(cut["ids"], ids[:2])  # time-boxed: whole batches only

    sample = tt.mixed_sampler(pool, stream, 3, 1, torch.Generator().manual_seed(2))
    x, lo = sample(0)
    assert x.shape == (4, 24) and lo[3] == 1 and all(any(torch.equal(r, p) for p in ids) for r in x[:3])
    assert lo[:3].tolist() == [int(lens[[torch.equal(r, p) for p in ids].index(True)]) for r in x[:3]]
    # the drafter trains on (ids, lo) batches with every anchor in [lo, T - B]: pool anchors in the continuation
    dcfg = tt.drafter_config(TOY_DRAFTER, toy["cfg"], toy["mask"])
    torch.manual_seed(0)
    drafter = DFlashDrafter(dcfg)
    seen, real = [], tt.draft_logits
    monkeypatch.setattr(tt, "draft_logits", lambda d, t, row, f, a: seen.append((row, a)) or real(d, t, row, f, a))
    batches = [sample(i) for i in range(3)]
    sched = tt.Schedule(steps=3, budget_s=60, lr=1e-2, warmup=1, weight_decay=0.0, log_every=5)
    result = tt.train_drafter(drafter, target, lambda i: batches[i], sched, anchors_per_seq=30, gamma=7.0, seed=0)
    assert result["steps"] == 3 and all(math.isfinite(v) for v in result["losses"])
    assert len(seen) == 12
    rows, firsts = torch.cat([x for x, _ in batches]), torch.cat([lo for _, lo in batches]).tolist()
    for (row, a), want, first in zip(seen, rows, firsts, strict=True):
        assert torch.equal(row, want) and a.min() >= first and a.max() <= 24 - dcfg.block_size
        assert len(a) == min(30, 24 - dcfg.block_size - first + 1) and len(set(a.tolist())) == len(a)
    monkeypatch.undo()
    seqs = [(row.tolist(), n) for row, n in zip(ids, lens.tolist(), strict=True)]
    agree = tt.drafter_agreement(drafter, target, seqs, stride=3)
    expect = sum(len(range(n, 24 - dcfg.block_size + 1, 3)) for n in lens.tolist())
    assert agree["blocks"] == expect and len(agree["per_position"]) == dcfg.block_size - 1


def test_drafter_rejects_the_last_target_layer(toy):
    # HF's hidden_states[N] is post-final-norm; ids must stay below N - 1
    with pytest.raises(ValueError, match="target_layer_ids"):
        tt.drafter_config(tt.DrafterShape(target_layer_ids=(0, 2)), toy["cfg"], toy["mask"])


def test_split_and_prompts(toy):
    root = STDLIB
    files = tt.stdlib_files(root / "json", 200_000)
    train, held = tt.split_files(files, root, 0.25, seed=3)
    assert sorted(train + held) == sorted(files) and not set(train) & set(held)
    assert tt.split_files(files, root, 0.25, seed=3) == (train, held)
    prompts = tt.eval_prompts(toy["tok"], FILES, root, 4, seed=0, lo=16, hi=64)
    assert prompts
    for p in prompts:
        assert 16 <= len(p["ids"]) <= 64 and toy["tok"].encode(p["text"], add_special_tokens=False).ids == p["ids"]


ZOO = ROOT / "model" / "zoo" / "tiny_kimi"


@pytest.mark.skipif(not (ZOO / "target" / "config.json").exists(), reason="no committed tiny_kimi pair")
def test_committed_pair_shape():
    from tokenizers import Tokenizer

    raw = json.loads((ZOO / "target" / "config.json").read_text())
    assert raw["architectures"] == ["DeepseekV3ForCausalLM"] and raw["q_lora_rank"] and raw["kv_lora_rank"]
    assert 1 < raw["n_group"] and raw["topk_group"] < raw["n_group"] and raw["n_routed_experts"] % 8 == 0
    assert raw["n_shared_experts"] == 1 and raw["first_k_dense_replace"] == 1 and raw["num_attention_heads"] % 8 == 0
    tok = Tokenizer.from_file(str(ZOO / "target" / "tokenizer.json"))
    assert raw["vocab_size"] == tok.get_vocab_size() and raw["eos_token_id"] == tok.token_to_id(tt.EOS)
    drafter = json.loads((ZOO / "drafter" / "config.json").read_text())
    assert drafter["dflash_config"]["mask_token_id"] == tok.token_to_id(tt.MASK)
    assert drafter["hidden_size"] == raw["hidden_size"]
    assert max(drafter["dflash_config"]["target_layer_ids"]) < raw["num_hidden_layers"] - 1
    total = sum(f.stat().st_size for f in ZOO.rglob("*") if f.is_file())
    assert total <= 60 * 2**20
    prompts = json.loads((ZOO / "eval_prompts.json").read_text())["prompts"]
    assert len(prompts) >= 16 and all(32 <= len(p["ids"]) <= 128 for p in prompts)
