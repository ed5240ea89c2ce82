"""Launch-configuration tables of the Triton kernels: data files under ``model/triton/configs/``, looked up by shape.

Two tables, both keyed by shapes only (never by batch size, so a row's result does not depend on its neighbours):

- ``attention.json``: one entry per (kernel, query heads per KV head, head dim) — ``BLOCK_N`` (keys per tile),
  ``BLOCK_R`` (most query rows per program), ``num_warps``, ``num_stages``. MLA's head dim is latent + rope.
- ``moe/E=<experts>,N=<inter>,K=<hidden>,device_name=<device>.json``: vLLM's fused_moe layout, token bucket →
  ``BLOCK_SIZE_M/N/K``, ``GROUP_SIZE_M``, ``num_warps``, ``num_stages`` (``scripts/tune_moe.py`` writes them).

Every shipped entry says ``"source": "untuned default"``: no GPU time has measured them. A tuning run replaces
an entry and records what it measured in ``source``. Shapes without an entry fall back to the rule in the
kernel module, reported with the source ``"untuned default (rule, no table entry)"``.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

CONFIG_DIR = Path(__file__).parent / "configs"
UNTUNED = "untuned default"
NO_ENTRY = "untuned default (rule, no table entry)"
ATTENTION_KERNELS = ("gqa_decode", "gqa_tree", "mla_decode", "mla_tree")


@functools.cache
def _attention_table(path: Path = CONFIG_DIR / "attention.json") -> dict[tuple[str, int, int], dict]:
    if not path.exists():
        return {}
    rows = json.loads(path.read_text())["entries"]
    return {(r["kernel"], r["q_heads_per_kv"], r["head_dim"]): r for r in rows}


def attention_config(kernel: str, q_heads_per_kv: int, head_dim: int) -> dict | None:
    """The table entry (``BLOCK_N, BLOCK_R, num_warps, num_stages, source``) or None."""
    if kernel not in ATTENTION_KERNELS:
        raise ValueError(f"kernel must be one of {ATTENTION_KERNELS}, got {kernel!r}")
    return _attention_table().get((kernel, q_heads_per_kv, head_dim))


def moe_config_path(experts: int, inter: int, hidden: int, device_name: str) -> Path:
    """vLLM's file name for one (E, N, K, device): N is the intermediate size, K the hidden size."""
    return CONFIG_DIR / "moe" / f"E={experts},N={inter},K={hidden},device_name={device_name.replace(' ', '_')}.json"


@functools.cache
def _moe_file(path: Path) -> dict[int, dict] | None:
    if not path.exists():
        return None
    return {int(bucket): cfg for bucket, cfg in json.loads(path.read_text()).items() if bucket.isdigit()}


def moe_config(experts: int, inter: int, hidden: int, tokens: int, device_name: str = "default") -> dict | None:
    """The entry of the bucket nearest ``tokens`` (vLLM's rule: smallest |bucket − tokens|) in the device's file,
    else in ``device_name=default``; None when neither exists. Unlike attention's, MoE tiles follow the row
    count (BLOCK_K sets the summation order, so rounding may differ between buckets)."""
    for name in (device_name, "default"):
        table = _moe_file(moe_config_path(experts, inter, hidden, name))
        if table:
            return table[min(table, key=lambda b: (abs(b - tokens), b))]
    return None
