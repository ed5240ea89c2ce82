"""The engine's configuration as the user sets it (hydra group ``engine``, one flat set of keys), kept by owner:
the scheduler's (:class:`SchedulerConfig`), the KV cache's (:class:`CacheConfig`) and the runner's
(:class:`RunnerConfig`), inside one :class:`EngineConfig` built from the flat keys (:meth:`EngineConfig.flat`) and
validated once, each key by its owner."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

ALLOCATIONS = ("on_demand", "reserve")


class RequestError(ValueError):
    """A request the engine cannot run; the message names the field."""


def _at_least_one(cfg, *names: str) -> None:
    for name in names:
        value = getattr(cfg, name)
        if value is not None and value < 1:
            raise RequestError(f"engine.{name} must be >= 1, got {value}")


@dataclass(frozen=True)
class SchedulerConfig:
    """What the scheduler decides by: limits per attention-DP rank, the context length, admission's rules."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None  # None: the model's context length (vLLM's rule; EngineConfig.for_model)
    # > 0: a prefill takes at most this many tokens of a step's budget (vLLM's long_prefill_token_threshold), so the
    # short prompts behind a long one are admitted and answered while it is still prefilling; 0: no cap
    long_prefill_token_threshold: int = 0
    # a waiting request whose next uncached block a running request is prefilling waits for that block to be
    # committed, then hits it, rather than computing the shared prefix again (SGLang's in-batch prefix caching)
    share_inflight_prefix: bool = True
    # "on_demand": blocks allocated per step for what it writes, recompute preemption when they run out;
    # "reserve": prompt + max_tokens reserved at admission, never preempted
    kv_allocation: str = "on_demand"

    def __post_init__(self) -> None:
        _at_least_one(self, "max_num_seqs", "max_num_batched_tokens", "max_model_len")
        if self.long_prefill_token_threshold < 0:
            raise RequestError(f"engine.long_prefill_token_threshold must be >= 0 (0: no cap), got "
                               f"{self.long_prefill_token_threshold}")
        if self.kv_allocation not in ALLOCATIONS:
            raise RequestError(f"engine.kv_allocation must be one of {ALLOCATIONS}, got {self.kv_allocation!r}")


@dataclass(frozen=True)
class CacheConfig:
    """The KV cache: its blocks, how many (or how much device memory), and what outlives a request."""

    block_size: int = 16
    num_blocks: int = 1024  # per DP rank
    # on CUDA: share of the device's memory the engine may use; num_blocks is then sized from what is free after
    # the weights (engine/worker/kv_budget.py). None: num_blocks as given. Off CUDA num_blocks is always used.
    gpu_memory_utilization: float | None = 0.9
    # full blocks of committed tokens indexed by a chained hash and reused by later requests (docs/kv_cache.md)
    prefix_caching: bool = True
    # a retained request's blocks (a turn that ended in a tool call, or one that asked) outlive plain LRU this long
    kv_retention_s: float = 30.0
    # the host-memory tier under the prefix cache, GiB per attention-DP group (0: off; docs/kv_cache.md, "Host tier")
    host_kv_cache_gb: float = 0.0
    # when a block is copied to the host tier: "evict" (as the device pool evicts it) or "through" (once committed)
    host_kv_write: str = "evict"
    # the KV store shared by workers under the host tier (docs/kv_cache.md, "The shared store"): "none" or "mooncake"
    kv_store: str = "none"
    kv_store_master: str | None = None  # HOST:PORT of mooncake_master
    kv_store_metadata: str | None = None  # the transfer metadata server, e.g. http://HOST:PORT/metadata
    kv_store_gb: float = 1.0  # this worker's contribution to the store's memory, GiB per rank
    kv_store_timeout_s: float = 1.0  # a store call waited for longer is given up (the store is then left alone a while)

    def __post_init__(self) -> None:
        _at_least_one(self, "block_size", "num_blocks")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise RequestError(f"engine.gpu_memory_utilization must be in (0, 1] or null, got "
                               f"{self.gpu_memory_utilization}")
        if self.kv_retention_s < 0:
            raise RequestError(f"engine.kv_retention_s must be >= 0, got {self.kv_retention_s}")
        if self.host_kv_cache_gb < 0:
            raise RequestError(f"engine.host_kv_cache_gb must be >= 0 (0: no host tier), got {self.host_kv_cache_gb}")
        if self.host_kv_write not in ("evict", "through"):
            raise RequestError(f"engine.host_kv_write must be evict or through, got {self.host_kv_write!r}")
        if self.kv_store not in ("none", "mooncake"):
            raise RequestError(f"engine.kv_store must be none or mooncake, got {self.kv_store!r}")
        if self.kv_store == "mooncake" and not (self.kv_store_master and self.kv_store_metadata):
            raise RequestError("engine.kv_store=mooncake needs engine.kv_store_master (HOST:PORT of mooncake_master) "
                               "and engine.kv_store_metadata (e.g. http://HOST:PORT/metadata)")
        if self.kv_store_gb <= 0 or self.kv_store_timeout_s <= 0:
            raise RequestError(f"engine.kv_store_gb and engine.kv_store_timeout_s must be > 0, got "
                               f"{self.kv_store_gb} and {self.kv_store_timeout_s}")


@dataclass(frozen=True)
class RunnerConfig:
    """How each rank runs a step: static shapes, overlap, the numerics, the expert tally and load, warm-up."""

    # decode / tree-verify steps over fixed-shape buffers (engine/worker/cuda_graphs.py): "auto" = on a CUDA device,
    # where they are captured as CUDA graphs; "on" = everywhere (off CUDA they run eagerly); "off" = never
    static_steps: str = "auto"
    warm_up: bool = True  # the scripts run Engine.warm_up (every static shape, captured on CUDA) before serving
    overlap: str = "off"  # "on": the host schedules and stages step n+1 while step n runs (Engine.step)
    # every row's arithmetic independent of what shares its launch (model.kernel_select.batch_invariant_kernels):
    # speculation and batching give plain decoding's tokens bit for bit, in bf16 too; docs/batch_invariance.md
    batch_invariant: bool = False
    # count the distinct experts each MoE layer reads in decode/verify steps (model.expert_tally; GetEngineInfo
    # reports them): a few device ops per MoE layer, captured with the step. The bench turns it on.
    expert_tally: bool = False
    # count the tokens routed to each logical expert per MoE layer in every step (model.expert_load; GetEngineInfo
    # reports them with each layer's balancedness at the current expert placement): docs/eplb.md
    expert_load: bool = False

    def __post_init__(self) -> None:
        if self.static_steps not in ("auto", "on", "off"):
            raise RequestError(f"engine.static_steps must be auto, on or off, got {self.static_steps!r}")
        if self.overlap not in ("on", "off"):
            raise RequestError(f"engine.overlap must be on or off, got {self.overlap!r}")


@dataclass(frozen=True)
class BalancerConfig:
    """Expert load balancing while serving (the ``eplb`` group's ``enabled``, ``window_steps``, ``interval_steps``,
    ``min_gain``, ``layers_per_step``, ``num_nodes``, passed as ``engine.eplb_*``): docs/eplb.md."""

    eplb_enabled: bool = False
    eplb_window_steps: int = 1000  # the load a rebalance sees: the last complete window of this many steps
    eplb_interval_steps: int = 3000  # steps between rebalances
    eplb_min_gain: float = 0.01  # a layer moves only if its predicted balancedness rises by at least this
    eplb_layers_per_step: int = 1  # layers moved between two steps, at most
    eplb_num_nodes: int = 1  # nodes the EP ranks span: > 1 keeps each expert group's replicas on one node

    def __post_init__(self) -> None:
        for name in ("eplb_window_steps", "eplb_interval_steps", "eplb_layers_per_step", "eplb_num_nodes"):
            if getattr(self, name) < 1:
                raise RequestError(f"{name.replace('eplb_', 'eplb.')} must be >= 1, got {getattr(self, name)}")
        if self.eplb_min_gain < 0:
            raise RequestError(f"eplb.min_gain must be >= 0, got {self.eplb_min_gain}")


OWNERS = {"scheduler": SchedulerConfig, "cache": CacheConfig, "runner": RunnerConfig, "balancer": BalancerConfig}
KEY_OWNER = {f.name: owner for owner, cls in OWNERS.items() for f in dataclasses.fields(cls)}  # engine.<key> → owner


@dataclass(frozen=True)
class EngineConfig:
    """The scheduler's, the cache's, the runner's and the expert balancer's configs. Built from the flat keys a user
    types (``engine.max_model_len``, ``engine.prefix_caching``, …) with :meth:`flat`; read by owner
    (``cfg.cache.block_size``)."""

    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    runner: RunnerConfig = field(default_factory=RunnerConfig)
    balancer: BalancerConfig = field(default_factory=BalancerConfig)

    @staticmethod
    def flat(**keys) -> EngineConfig:
        """The config of the hydra group ``engine``'s keys (defaults for the others); an unknown key is named."""
        return EngineConfig().replace(**keys)

    def replace(self, **keys) -> EngineConfig:
        """This config with the flat ``keys`` changed, each in its owner's config."""
        unknown = sorted(set(keys) - set(KEY_OWNER))
        if unknown:
            raise RequestError(f"engine.{unknown[0]} is not an engine setting (known: {', '.join(sorted(KEY_OWNER))})")
        parts = {owner: dataclasses.replace(getattr(self, owner), **{k: v for k, v in keys.items()
                                                                      if KEY_OWNER[k] == owner})
                 for owner in OWNERS}
        return EngineConfig(**parts)

    def keys(self) -> dict:
        """Every flat key and its value, as the user sets them (EngineInfo's ``scheduler`` section)."""
        return {k: getattr(getattr(self, owner), k) for k, owner in KEY_OWNER.items()}

    def for_model(self, context_len: int) -> EngineConfig:
        """This config for a model of ``context_len`` tokens (``max_position_embeddings``): ``max_model_len`` unset
        becomes it; one above it is refused, naming both."""
        length = self.scheduler.max_model_len
        if length is None:
            return self.replace(max_model_len=context_len)
        if length > context_len:
            raise RequestError(f"engine.max_model_len={length} is above the model's context length "
                               f"{context_len} (max_position_embeddings in its config.json); leave it unset or "
                               "lower it")
        return self
