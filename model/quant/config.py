"""``quantization_config`` → a frozen :class:`QuantConfig`, for the two formats users run.

- compressed-tensors ``pack-quantized`` INT4 (Kimi K2-Thinking / K2.5 / K2.6 routed experts): symmetric int,
  strategy ``group``; ``targets`` and ``ignore`` select modules (``re:`` entries are regexes matched from the
  start of the module name, others match the name or, for ``Linear``, the module class).
- ``quant_method: fp8`` (DeepSeek-V3/R1, Kimi-K2-Instruct, Qwen3-MoE FP8): e4m3 weights with
  ``weight_block_size`` block scales, activations quantized at run time (``dynamic``);
  ``modules_to_not_convert`` entries match as HF transformers matches them (a regex from the start of the name
  up to a module boundary, or a suffix); lm_head is never converted.

Anything else raises :class:`QuantConfigError` naming the field and its value.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from model.checkpoint_errors import ConfigError

INT4 = "int4"  # W4A16, compressed-tensors pack-quantized
FP8 = "fp8"  # e4m3 weights, block scales


class QuantConfigError(ConfigError):
    """An unsupported ``quantization_config``; the message names the field and the value."""


@dataclass(frozen=True)
class QuantConfig:
    """What is quantized and how. ``group_size`` (INT4): input columns per scale; ``block`` (FP8): ``(out, in)``
    rows × columns per ``weight_scale_inv`` entry; activations of FP8 layers are quantized per token in
    ``1 × block[1]`` groups where the device has FP8 (W8A8), else left unquantized (W8A16)."""

    method: str  # INT4 | FP8
    group_size: int = 0
    block: tuple[int, int] = (0, 0)
    targets: tuple[str, ...] = ("Linear",)
    ignore: tuple[str, ...] = ()
    name_prefixes: tuple[str, ...] = ("",)  # kimi_k25: names may also carry "language_model."

    @property
    def pack_factor(self) -> int:
        """INT4 values per int32 word."""
        return 8

    def quantizes(self, name: str) -> bool:
        """Whether the linear layer ``name`` (HF module name, e.g. ``model.layers.1.mlp.experts.0.up_proj``) is
        stored quantized."""
        names = [p + name for p in self.name_prefixes]
        if self.method == FP8:
            return not any(_hf_match(n, ig) for ig in self.ignore for n in names) and not name.endswith("lm_head")
        hit = any(_ct_match(n, t) for t in self.targets for n in names)
        return hit and not any(_ct_match(n, ig) for ig in self.ignore for n in names)

    def describe(self) -> str:
        if self.method == INT4:
            return f"INT4 W4A16 (compressed-tensors pack-quantized, symmetric, group {self.group_size})"
        return f"FP8 e4m3, {self.block[0]}x{self.block[1]} block scales, dynamic per-token activations"


def _ct_match(name: str, target: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == "Linear" or name == target  # every layer asked about is a Linear in HF


def _hf_match(name: str, key: str) -> bool:
    return re.match(rf"(?:{key})(?:(?<=\.)|(?=\.|$))", name) is not None or name.endswith(key)


def _need(cond: bool, field: str, value, want: str) -> None:
    if not cond:
        raise QuantConfigError(f"quantization_config.{field}={value!r} is not supported ({want})")


def _compressed_tensors(q: dict) -> QuantConfig:
    fmt = q.get("format")
    _need(fmt == "pack-quantized", "format", fmt, "pack-quantized")
    status = q.get("quantization_status", "compressed")
    _need(status == "compressed", "quantization_status", status, "compressed")
    _need(q.get("kv_cache_scheme") is None, "kv_cache_scheme", q.get("kv_cache_scheme"), "null")
    groups = q.get("config_groups") or {}
    _need(len(groups) >= 1, "config_groups", groups, "at least one group")
    weights, targets = None, []
    for gname, group in groups.items():
        where = f"config_groups.{gname}"
        for act in ("input_activations", "output_activations"):
            _need(group.get(act) is None, f"{where}.{act}", group.get(act), "null: weight-only W4A16")
        fmt_g = group.get("format")
        _need(fmt_g in (None, "pack-quantized"), f"{where}.format", fmt_g, "pack-quantized")
        w = group.get("weights") or {}
        _need(w.get("num_bits") == 4, f"{where}.weights.num_bits", w.get("num_bits"), "4")
        _need(w.get("type", "int") == "int", f"{where}.weights.type", w.get("type"), "int")
        _need(w.get("symmetric", True) is True, f"{where}.weights.symmetric", w.get("symmetric"), "true")
        _need(w.get("strategy") == "group", f"{where}.weights.strategy", w.get("strategy"), "group")
        _need(w.get("actorder") in (None, False), f"{where}.weights.actorder", w.get("actorder"),
              "null: no activation reordering")
        _need(not w.get("dynamic", False), f"{where}.weights.dynamic", w.get("dynamic"), "false")
        _need(w.get("block_structure") is None, f"{where}.weights.block_structure", w.get("block_structure"), "null")
        gs = w.get("group_size")
        _need(isinstance(gs, int) and gs > 0 and gs % 8 == 0, f"{where}.weights.group_size", gs,
              "a positive multiple of 8")
        if weights is not None and gs != weights:
            raise QuantConfigError(f"quantization_config.{where}.weights.group_size={gs!r} differs from another "
                                   f"group's {weights}; one group size per checkpoint is supported")
        weights = gs
        targets += list(group.get("targets") or [])
    return QuantConfig(INT4, group_size=weights, targets=tuple(targets), ignore=tuple(q.get("ignore") or ()))


def _fp8(q: dict) -> QuantConfig:
    fmt = q.get("fmt", "e4m3")
    _need(fmt == "e4m3", "fmt", fmt, "e4m3")
    act = q.get("activation_scheme", "dynamic")
    _need(act == "dynamic", "activation_scheme", act, "dynamic")
    block = q.get("weight_block_size")
    _need(isinstance(block, list | tuple) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block),
          "weight_block_size", block, "[rows, cols] of positive ints; per-tensor FP8 is not implemented")
    ignore = tuple(q.get("modules_to_not_convert") or ())
    return QuantConfig(FP8, block=(block[0], block[1]), ignore=ignore)


def parse_quant(q: dict, name_prefixes: tuple[str, ...] = ("",)) -> QuantConfig:
    """``quantization_config`` (a dict from config.json) → :class:`QuantConfig`; raises QuantConfigError."""
    if not isinstance(q, dict):
        raise QuantConfigError(f"quantization_config={q!r} is not an object")
    method = q.get("quant_method")
    if method == "compressed-tensors":
        cfg = _compressed_tensors(q)
    elif method == "fp8":
        cfg = _fp8(q)
    else:
        raise QuantConfigError(f"quantization_config.quant_method={method!r} is not supported "
                               "(compressed-tensors pack-quantized INT4, fp8 block)")
    cfg = QuantConfig(cfg.method, cfg.group_size, cfg.block, cfg.targets, cfg.ignore, name_prefixes)
    if cfg.quantizes("lm_head"):  # under every prefix the names may carry (kimi_k25: language_model.lm_head)
        raise QuantConfigError("quantization_config.ignore does not list lm_head: a quantized lm_head is not "
                               "supported")
    return cfg
