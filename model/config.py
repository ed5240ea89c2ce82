"""HF ``config.json`` → frozen, validated model configs.

Supported ``model_type``: ``deepseek_v3``, ``kimi_k2`` (DeepSeek-V3 architecture), ``kimi_k25``
(its ``text_config``; the wrapper's ``tie_word_embeddings``, when it sets one, decides as in HF transformers; the
tensors sit under ``language_model.``: :mod:`model.checkpoint_names`), ``qwen3_moe``. Quantized checkpoints: see
:mod:`model.quant.config`. Anything else fails with a :class:`ConfigError` naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from model.checkpoint_errors import ConfigError, read_json
from model.checkpoint_names import LANGUAGE_MODEL
from model.quant.config import QuantConfig, QuantConfigError, parse_quant

DEEPSEEK_TYPES = ("deepseek_v3", "kimi_k2")
SUPPORTED_TYPES = (*DEEPSEEK_TYPES, "kimi_k25", "qwen3_moe")


@dataclass(frozen=True)
class RopeConfig:
    dim: int
    theta: float
    kind: str = "default"  # "default" | "yarn"
    factor: float = 1.0
    original_max_position: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True
    interleaved: bool = False  # DeepSeek lays rotary pairs out as (x0, x1), (x2, x3), ...


@dataclass(frozen=True)
class MLAConfig:
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    top_k: int
    intermediate_size: int
    scoring: str  # "sigmoid" (DeepSeek noaux_tc) | "softmax" (Qwen3)
    norm_topk_prob: bool
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    num_shared_experts: int = 0
    correction_bias: bool = False


@dataclass(frozen=True)
class ModelConfig:
    model_type: str  # architecture family: "deepseek_v3" | "qwen3_moe"
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int  # GQA head dim (MLA: unused, see mla)
    intermediate_size: int  # dense MLP layers
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope: RopeConfig
    moe: MoEConfig
    moe_layers: tuple[bool, ...]  # per layer: routed experts (True) or dense MLP
    mla: MLAConfig | None = None
    eos_token_ids: tuple[int, ...] = ()
    quant: QuantConfig | None = None  # None: unquantized
    # kimi_k25: "language_model." before every stored name (model.checkpoint_names); where the weights sit, not
    # what they compute: out of repr, so the KV namespace (engine.worker.kv_budget.kv_shape) ignores it
    weight_prefix: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        if len(self.moe_layers) != self.num_layers:
            raise ConfigError(f"moe_layers has {len(self.moe_layers)} entries for {self.num_layers} layers")
        if self.moe.top_k > self.moe.num_experts:
            raise ConfigError(f"num_experts_per_tok={self.moe.top_k} > experts={self.moe.num_experts}")
        if self.moe.num_experts % self.moe.n_group or self.moe.topk_group > self.moe.n_group:
            raise ConfigError(f"n_group={self.moe.n_group}/topk_group={self.moe.topk_group} do not fit "
                              f"{self.moe.num_experts} experts")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_attention_heads={self.num_heads} not divisible by "
                              f"num_key_value_heads={self.num_kv_heads}")


def _rope(raw: dict, dim: int, interleaved: bool) -> RopeConfig:
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ("default", "yarn"):
        raise ConfigError(f"rope type {kind!r} is not supported (default, yarn)")
    if kind == "default":
        return RopeConfig(dim=dim, theta=theta, interleaved=interleaved)
    return RopeConfig(
        dim=dim, theta=theta, kind="yarn", factor=float(params["factor"]),
        original_max_position=int(params["original_max_position_embeddings"]),
        beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
        mscale=params.get("mscale"), mscale_all_dim=params.get("mscale_all_dim"),
        attention_factor=params.get("attention_factor"), truncate=bool(params.get("truncate", True)),
        interleaved=interleaved,
    )


def _eos(raw: dict) -> tuple[int, ...]:
    eos = raw.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def _deepseek(raw: dict) -> ModelConfig:
    n_layers = raw["num_hidden_layers"]
    first_dense = raw.get("first_k_dense_replace", 0)
    freq = raw.get("moe_layer_freq", 1)
    mla = MLAConfig(
        q_lora_rank=raw.get("q_lora_rank"), kv_lora_rank=raw["kv_lora_rank"],
        qk_nope_head_dim=raw["qk_nope_head_dim"], qk_rope_head_dim=raw["qk_rope_head_dim"],
        v_head_dim=raw["v_head_dim"],
    )
    topk_method = raw.get("topk_method", "noaux_tc")
    if topk_method != "noaux_tc" or raw.get("scoring_func", "sigmoid") != "sigmoid":
        raise ConfigError(f"router topk_method={topk_method!r}/scoring_func={raw.get('scoring_func')!r} "
                          "not supported (noaux_tc + sigmoid)")
    moe = MoEConfig(
        num_experts=raw["n_routed_experts"], top_k=raw["num_experts_per_tok"],
        intermediate_size=raw["moe_intermediate_size"], scoring="sigmoid",
        norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
        n_group=raw.get("n_group") or 1, topk_group=raw.get("topk_group") or 1,
        num_shared_experts=raw.get("n_shared_experts") or 0, correction_bias=True,
    )
    return ModelConfig(
        model_type="deepseek_v3", vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"],
        num_layers=n_layers, num_heads=raw["num_attention_heads"],
        num_kv_heads=raw["num_attention_heads"], head_dim=mla.qk_head_dim,
        intermediate_size=raw["intermediate_size"], rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        max_position_embeddings=raw.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        rope=_rope(raw, mla.qk_rope_head_dim, interleaved=bool(raw.get("rope_interleave", True))),
        moe=moe, moe_layers=tuple(i >= first_dense and i % freq == 0 for i in range(n_layers)), mla=mla,
        eos_token_ids=_eos(raw),
    )


def _qwen3_moe(raw: dict) -> ModelConfig:
    n_layers = raw["num_hidden_layers"]
    if raw.get("use_sliding_window"):
        raise ConfigError("use_sliding_window=true is not supported")
    mlp_only = set(raw.get("mlp_only_layers") or [])
    step = raw.get("decoder_sparse_step", 1)
    n_exp = raw["num_experts"] if "num_experts" in raw else raw["num_local_experts"]
    head_dim = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
    moe = MoEConfig(
        num_experts=n_exp, top_k=raw["num_experts_per_tok"], intermediate_size=raw["moe_intermediate_size"],
        scoring="softmax", norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
    )
    return ModelConfig(
        model_type="qwen3_moe", vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"],
        num_layers=n_layers, num_heads=raw["num_attention_heads"], num_kv_heads=raw["num_key_value_heads"],
        head_dim=head_dim, intermediate_size=raw["intermediate_size"], rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        max_position_embeddings=raw.get("max_position_embeddings", 32768),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        rope=_rope(raw, head_dim, interleaved=False), moe=moe,
        moe_layers=tuple(i not in mlp_only and n_exp > 0 and (i + 1) % step == 0 for i in range(n_layers)),
        eos_token_ids=_eos(raw),
    )


def parse_config(raw: dict, source: str = "config.json", name_prefixes: tuple[str, ...] = ("",)) -> ModelConfig:
    """Parses an HF config dict. ``source`` names the file in error messages; ``name_prefixes``: how the
    quantization config's module names may be prefixed (kimi_k25: ``language_model.``)."""
    model_type = raw.get("model_type")
    if model_type == "kimi_k25":
        if "text_config" not in raw:
            raise ConfigError(f"{source}: model_type 'kimi_k25' without text_config")
        text = dict(raw["text_config"])
        text.setdefault("model_type", "deepseek_v3")
        outer = raw.get("quantization_config")
        if outer and text.get("quantization_config") not in (None, outer):
            raise ConfigError(f"{source}: quantization_config differs from text_config.quantization_config")
        if outer:
            text["quantization_config"] = outer
        if "tie_word_embeddings" in raw:  # the wrapper's value decides, as HF transformers reads it
            text["tie_word_embeddings"] = raw["tie_word_embeddings"]
        cfg = parse_config(text, f"{source}:text_config", ("", LANGUAGE_MODEL))
        return replace(cfg, weight_prefix=LANGUAGE_MODEL)
    if model_type not in SUPPORTED_TYPES:
        raise ConfigError(f"{source}: model_type {model_type!r} is not supported; supported: {SUPPORTED_TYPES}")
    try:
        quant = parse_quant(raw["quantization_config"], name_prefixes) if raw.get("quantization_config") else None
    except QuantConfigError as err:
        raise ConfigError(f"{source}: {err}") from err
    if raw.get("attention_bias"):
        raise ConfigError(f"{source}: attention_bias=true is not supported yet")
    try:
        cfg = _deepseek(raw) if model_type in DEEPSEEK_TYPES else _qwen3_moe(raw)
        return replace(cfg, quant=quant) if quant else cfg
    except KeyError as err:
        raise ConfigError(f"{source}: missing field {err.args[0]!r} for model_type {model_type!r}") from err


def load_config(path: str | Path) -> ModelConfig:
    """Reads ``DIR/config.json`` (or the file itself). The EOS ids are ``config.json``'s, then any more that the
    ``generation_config.json`` beside it names: Kimi K2 ends a turn with ``<|im_end|>``, which only its generation
    config names (vLLM and SGLang stop on both as well)."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.exists():
        raise ConfigError(f"no config.json at {file}")
    cfg = parse_config(read_json(file, ConfigError), str(file))
    generation = file.parent / "generation_config.json"
    if generation.is_file():
        more = [t for t in _eos(read_json(generation, ConfigError)) if t not in cfg.eos_token_ids]
        cfg = replace(cfg, eos_token_ids=cfg.eos_token_ids + tuple(more)) if more else cfg
    return cfg
