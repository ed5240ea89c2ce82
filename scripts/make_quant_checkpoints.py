"""Tiny quantized reference checkpoints, written with the formats' own libraries (never the engine's code).

For each preset: a tiny random model (HF transformers ``save_pretrained``, :mod:`model.tiny`'s configs with
dimensions no test layout cuts through a group), then

- ``<preset>/``: the quantized checkpoint as users get it. INT4: compressed-tensors ``pack-quantized``
  (the package's ``calculate_qparams`` + ``PackedQuantizationCompressor.compress``), routed experts only, the
  Kimi K2-Thinking ``ignore`` list. FP8: every ``*_proj`` linear block-quantized by HF transformers'
  fine-grained FP8 ``Fp8Quantize`` (``weight`` e4m3 + ``weight_scale_inv``), DeepSeek's config fields.
  ``kimi_k25_int4`` is written as Moonshot publishes Kimi K2.5 / K2.6 (``published_kimi_k25``): tensors under
  ``language_model.``, the published ``ignore`` list, a vision tower and projector beside them, two shards.
- ``<preset>-dequant/``: the same weights dequantized by the same libraries (``decompress``,
  ``Fp8Dequantize``) into a plain fp32 checkpoint: the HF reference (HF 5.x does not apply these configs to
  its fused experts, so it cannot run the quantized one).

    python scripts/make_quant_checkpoints.py OUT_DIR [--preset NAME ...]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from model.checkpoint_names import IMAGE_PREFIXES

KIMI_IGNORE = ["lm_head", r"re:.*self_attn.*", r"re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*"]
# Kimi K2.5 / K2.6 as published: regexes only, the vision tower and projector listed too
KIMI_K25_IGNORE = [r"re:.*self_attn.*", r"re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
                   r"re:.*lm_head.*", r"re:.*vision_tower.*", r"re:.*mm_projector.*"]
ROUTED = re.compile(r".*\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")
PROJ = re.compile(r".*_proj(_with_mqa)?\.weight$")
DIMS = dict(moe_intermediate_size=256, intermediate_size=128)  # expert-TP 8 leaves 32 = one INT4 group, 4 FP8 blocks
FP8_BLOCK = 8  # releases use 128; tiny dims cut by TP8 need a small block

# name: (model.tiny preset, format, config.json wrapping)
PRESETS = {
    "kimi_k2_int4": ("tiny_deepseek", "int4", "kimi_k2"),  # Kimi K2-Thinking: DeepSeek-V3 arch, INT4 experts
    "kimi_k25_int4": ("tiny_deepseek", "int4", "kimi_k25"),  # K2.5/K2.6: kimi_k25 wrapper, outer quantization_config
    "qwen3_int4": ("tiny_qwen3_moe", "int4", "qwen3_moe"),
    "deepseek_fp8": ("tiny_deepseek", "fp8", "deepseek_v3"),  # DeepSeek-V3/R1, Kimi-K2-Instruct
    "qwen3_fp8": ("tiny_qwen3_moe", "fp8", "qwen3_moe"),
}


def int4_config(group_size: int, ignore: list[str]) -> dict:
    from compressed_tensors.quantization import QuantizationConfig

    scheme = {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                                 "strategy": "group", "group_size": group_size}}
    cfg = QuantizationConfig(config_groups={"group_0": scheme}, format="pack-quantized", ignore=ignore,
                             quantization_status="compressed")
    return cfg.model_dump(exclude_none=False) | {"quant_method": "compressed-tensors"}


def int4_pack(weight: torch.Tensor, group_size: int) -> tuple[dict, torch.Tensor]:
    """``weight [out, in]`` → (compressed-tensors tensors, the library's dequantized weight)."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams

    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group_size)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    grouped = weight.reshape(weight.shape[0], -1, group_size)
    scale, zp = calculate_qparams(grouped.amin(-1), grouped.amax(-1), args)
    packed = PackedQuantizationCompressor.compress({"weight": weight, "weight_scale": scale,
                                                    "weight_zero_point": zp}, scheme)
    deq = PackedQuantizationCompressor.decompress(dict(packed), scheme)["weight"]
    return {k: v for k, v in packed.items() if k in ("weight_packed", "weight_scale", "weight_shape")}, deq


def fp8_ops(block: int):
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize, Fp8Quantize

    class Holder:  # what the conversion ops read from an HfQuantizer
        quantization_config = FineGrainedFP8Config(weight_block_size=[block, block], activation_scheme="dynamic")
    return Fp8Quantize(Holder()), Fp8Dequantize(Holder())


def fp8_config(block: int, modules_to_not_convert: list[str]) -> dict:
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": [block, block], "modules_to_not_convert": modules_to_not_convert}


def quantize_checkpoint(src: Path, fmt: str, group_size: int = 32, block: int = FP8_BLOCK, qwen: bool = False,
                        ignore: list[str] = KIMI_IGNORE) -> tuple[dict, dict, dict]:
    """``src``'s tensors → (quantized tensors, dequantized tensors, quantization_config)."""
    tensors = load_file(src / "model.safetensors")
    quant, deq = {}, {}
    if fmt == "fp8":
        qop, dqop = fp8_ops(block)
    for name, t in tensors.items():
        pick = ROUTED.match(name) if fmt == "int4" else PROJ.match(name)
        if not pick:
            quant[name] = deq[name] = t
            continue
        module = name[: -len(".weight")]
        if fmt == "int4":
            packed, w = int4_pack(t, group_size)
            quant.update({f"{module}.{k}": v for k, v in packed.items()})
        else:
            out = qop.convert({name: t})
            quant.update(out)
            w = dqop._dequantize_one(out[name], out[f"{module}.weight_scale_inv"], output_dtype=torch.float32)
        deq[name] = w.to(t.dtype).contiguous()
    router = [r"re:.*mlp\.gate$"] if qwen else []  # Qwen3's router is an nn.Linear in HF; DeepSeek's is not
    cfg = int4_config(group_size, ignore + router) if fmt == "int4" else fp8_config(block, ["lm_head", "mlp.gate"])
    return quant, deq, cfg


def published_kimi_k25(text_config: dict, language: dict, quant_config: dict, out: Path, seed: int) -> None:
    """Writes ``out`` in the layout Moonshot publishes Kimi K2.5 / K2.6 in: ``language`` (DeepSeek-V3 names) under
    ``language_model.``, beside a tiny MoonViT tower's and projector's tensors (HF transformers' own
    ``save_pretrained`` of ``Kimi_K25ForConditionalGeneration``, its ``model.mm_projector.*`` spelled
    ``mm_projector.*``), in two shards with ``model.safetensors.index.json``; ``config.json`` wraps
    ``text_config`` with the outer ``quantization_config``."""
    from model.tiny import write_tiny

    hf_dir = write_tiny("tiny_kimi_k25", out / ".vision", seed=seed, **DIMS)
    hf_cfg = json.loads((hf_dir / "config.json").read_text())
    vision = {re.sub(r"^model\.mm_projector\.", "mm_projector.", k): v
              for k, v in load_file(hf_dir / "model.safetensors").items() if k.startswith(IMAGE_PREFIXES)}
    shutil.rmtree(hf_dir)
    (out / "model.safetensors").unlink()
    first = {f"language_model.{k}": v for k, v in language.items() if not re.match(r"model\.layers\.[2-9]", k)}
    second = {f"language_model.{k}": v for k, v in language.items() if f"language_model.{k}" not in first} | vision
    shards = {"model-00001-of-00002.safetensors": first, "model-00002-of-00002.safetensors": second}
    for file, tensors in shards.items():
        save_file({k: v.contiguous() for k, v in tensors.items()}, out / file, metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: f for f, ts in shards.items() for k in sorted(ts)}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    config = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
              "text_config": text_config, "vision_config": hf_cfg["vision_config"],
              "media_placeholder_token_id": hf_cfg["image_token_id"], "quantization_config": quant_config}
    (out / "config.json").write_text(json.dumps(config, indent=2))


def write_preset(name: str, out_root: str | Path, seed: int = 0) -> tuple[Path, Path]:
    """Writes ``out_root/name`` (quantized) and ``out_root/name-dequant`` (HF reference); returns both dirs."""
    from model.tiny import write_tiny

    tiny, fmt, wrap = PRESETS[name]
    out_root = Path(out_root)
    base = write_tiny(tiny, out_root / f".{name}-base", seed=seed, **DIMS)
    ignore = KIMI_K25_IGNORE if wrap == "kimi_k25" else KIMI_IGNORE
    quant, deq, qcfg = quantize_checkpoint(base, fmt, qwen=tiny == "tiny_qwen3_moe", ignore=ignore)
    qdir, ddir = out_root / name, out_root / f"{name}-dequant"
    for d, tensors in ((qdir, quant), (ddir, deq)):
        shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(base, d)
        save_file({k: v.contiguous() for k, v in tensors.items()}, d / "model.safetensors", metadata={"format": "pt"})
    raw = json.loads((base / "config.json").read_text())
    if wrap == "kimi_k25":
        published_kimi_k25(raw, quant, qcfg, qdir, seed)
    else:
        raw["model_type"] = wrap
        raw["quantization_config"] = qcfg
        (qdir / "config.json").write_text(json.dumps(raw, indent=2))
    shutil.rmtree(base)
    return qdir, ddir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="output directory")
    parser.add_argument("--preset", nargs="+", default=list(PRESETS), choices=list(PRESETS))
    args = parser.parse_args()
    for name in args.preset:
        q, d = write_preset(name, args.out)
        print(f"{name}: {q} (reference: {d})")


if __name__ == "__main__":
    main()
