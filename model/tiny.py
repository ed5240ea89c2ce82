"""Tiny random checkpoints written by HF transformers' ``save_pretrained`` (tests, demo, presets).

The configs exercise what the parity tests must cover: group-limited routing with
``topk_group < n_group``, non-negative non-zero correction biases, YaRN with mscale, a vocab not
divisible by 8, dense first layers, shared experts, fewer KV heads than 8 ranks (Qwen3-MoE).
Weights use a wide init (std 0.2) so logits differ clearly between tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

PRESETS = ("tiny_deepseek", "tiny_qwen3_moe", "tiny_agent", "tiny_kimi_k25")
# tiny_kimi_k25: HF's Kimi_K25ForConditionalGeneration (a tiny MoonViT tower and projector around tiny_deepseek),
# written as HF saves it (model.checkpoint_names: language_model.model.blocks.*, lm_head tied by the wrapper)
# tiny_agent: tiny_deepseek with an 8192-token context and a character tokenizer, for agent sessions whose history
# reaches thousands of tokens (scripts/bench_agentic.py)
LONG_CONTEXT = {"tiny_agent": 8192}
SPECIALS = ["<s>", "</s>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]  # ids 0..6; eos = 1
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def _deepseek_config(**overrides):
    from transformers import DeepseekV3Config

    kw = dict(
        vocab_size=203, hidden_size=64, intermediate_size=128, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=8, num_key_value_heads=8, n_routed_experts=16, n_shared_experts=1,
        num_experts_per_tok=4, n_group=4, topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5,
        q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
        max_position_embeddings=512, initializer_range=0.2, eos_token_id=1, bos_token_id=0,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 128, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "beta_fast": 32, "beta_slow": 1},
    )
    kw.update(overrides)
    return DeepseekV3Config(**kw)


def _qwen3_config(**overrides):
    from transformers import Qwen3MoeConfig

    kw = dict(
        vocab_size=203, hidden_size=64, intermediate_size=96, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=8, num_key_value_heads=2, head_dim=16, num_experts=16, num_experts_per_tok=4,
        norm_topk_prob=True, mlp_only_layers=[0], max_position_embeddings=512, initializer_range=0.2,
        eos_token_id=1, bos_token_id=0, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    kw.update(overrides)
    return Qwen3MoeConfig(**kw)


TINY_VISION = dict(patch_size=14, pos_emb_height=8, pos_emb_width=8, pos_emb_time=2, num_attention_heads=2,
                   num_hidden_layers=1, hidden_size=32, intermediate_size=64)


def _kimi_k25(**overrides):
    from transformers import Kimi_K25Config, Kimi_K25ForConditionalGeneration

    text = _deepseek_config(**overrides).to_dict()
    return Kimi_K25ForConditionalGeneration(Kimi_K25Config(text_config=text, vision_config=TINY_VISION,
                                                           projection_hidden_size=TINY_VISION["hidden_size"]))


def _non_negative_biases(layers, first_dense: int) -> None:
    with torch.no_grad():
        for layer in layers[first_dense:]:
            layer.mlp.gate.e_score_correction_bias.uniform_(0.0, 0.2)  # non-negative: HF masks with 0.0


def write_tiny(preset: str, out_dir: str | Path, seed: int = 0, **overrides) -> Path:
    """Writes preset ``preset`` (see PRESETS) to ``out_dir`` with HF ``save_pretrained``; returns the dir."""
    try:
        from transformers import DeepseekV3ForCausalLM, Qwen3MoeForCausalLM
    except ImportError as err:
        raise RuntimeError("writing tiny checkpoints needs transformers (pip install -e '.[test]')") from err
    if preset not in PRESETS:
        raise ValueError(f"unknown tiny preset {preset!r}; known: {PRESETS}")
    torch.manual_seed(seed)
    if preset in LONG_CONTEXT:
        overrides = {"max_position_embeddings": LONG_CONTEXT[preset], **overrides}
    if preset in ("tiny_deepseek", *LONG_CONTEXT):
        model = DeepseekV3ForCausalLM(_deepseek_config(**overrides))
        _non_negative_biases(model.model.layers, model.config.first_k_dense_replace)
    elif preset == "tiny_kimi_k25":
        model = _kimi_k25(**overrides)
        lm = model.model.language_model
        _non_negative_biases(lm.layers, lm.config.first_k_dense_replace)
    else:
        model = Qwen3MoeForCausalLM(_qwen3_config(**overrides))
    out_dir = Path(out_dir)
    model.eval().save_pretrained(out_dir)
    if preset in LONG_CONTEXT:
        write_char_tokenizer(out_dir, model.config.vocab_size, LONG_CONTEXT[preset])
    return out_dir


def write_char_tokenizer(ckpt_dir: str | Path, vocab_size: int = 203, max_length: int = 512) -> None:
    """A character-level tokenizer over exactly ``vocab_size`` ids, built in code (HF ``tokenizers``): ids 0-6
    :data:`SPECIALS` (bos 0, eos 1, as in the tiny configs), then printable ASCII and newline, then two-letter pieces
    that only decoding uses. Writes tokenizer.json and tokenizer_config.json (with a chat template)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models

    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    letters = "etaoinshrdlcumwfgypbvkjxqz"
    pieces = [a + b for a in letters for b in letters]
    vocab = {}
    for tok in SPECIALS + chars + pieces:
        if len(vocab) == vocab_size:
            break
        vocab.setdefault(tok, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    tok.decoder = decoders.Fuse()
    assert tok.get_vocab_size() == vocab_size
    ckpt_dir = Path(ckpt_dir)
    tok.save(str(ckpt_dir / "tokenizer.json"))
    (ckpt_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "add_bos_token": False, "model_max_length": max_length, "chat_template": CHAT_TEMPLATE}, indent=1))


def preset_dir(preset: str, cache_root: str | Path | None = None) -> Path:
    """The directory of a built-in preset, written on first use (atomically) under the cache root
    (``$SWITCHYARD_CACHE`` or ``~/.cache/switchyard``)."""
    import os
    import tempfile

    root = Path(cache_root or os.environ.get("SWITCHYARD_CACHE", Path.home() / ".cache" / "switchyard"))
    target = root / preset
    if not (target / "config.json").exists():
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".{preset}-"))
        write_tiny(preset, tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process won the race
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    return target


def load_hf(ckpt_dir: str | Path):
    """The HF transformers reference model for a checkpoint dir (fp32, eval); a ``kimi_k25`` one is HF's
    ``Kimi_K25ForConditionalGeneration``."""
    from transformers import AutoModelForCausalLM, Kimi_K25ForConditionalGeneration

    kimi_k25 = json.loads((Path(ckpt_dir) / "config.json").read_text()).get("model_type") == "kimi_k25"
    cls = Kimi_K25ForConditionalGeneration if kimi_k25 else AutoModelForCausalLM
    return cls.from_pretrained(ckpt_dir, dtype=torch.float32).eval()
