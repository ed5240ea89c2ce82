"""The engine's configuration as the user sets it (hydra group ``engine``), validated once."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

ALLOCATIONS = ("on_demand", "reserve")


class RequestError(ValueError):
    """A request the engine cannot run; the message names the field."""


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None  # None: the model's context length (vLLM's rule; for_model)
    block_size: int = 16
    num_blocks: int = 1024  # per DP rank
    # decode / tree-verify steps over fixed-shape buffers (engine/worker/cuda_graphs.py): "auto" = on a CUDA device,
    # where they are captured as CUDA graphs; "on" = everywhere (off CUDA they run eagerly); "off" = never
    static_steps: str = "auto"
    # on CUDA: share of the device's memory the engine may use; num_blocks is then sized from what is free after
    # the weights (engine/worker/kv_budget.py). None: num_blocks as given. Off CUDA num_blocks is always used.
    gpu_memory_utilization: float | None = 0.9
    warm_up: bool = True  # the scripts run Engine.warm_up (every static shape, captured on CUDA) before serving
    overlap: str = "off"  # "on": the host schedules and stages step n+1 while step n runs (Engine.step)
    # every row's arithmetic independent of what shares its launch (model.kernel_select.batch_invariant_kernels):
    # speculation and batching give plain decoding's tokens bit for bit, in bf16 too; docs/batch_invariance.md
    batch_invariant: bool = False
    # count the distinct experts each MoE layer reads in decode/verify steps (model.expert_tally; GetEngineInfo
    # reports them): a few device ops per MoE layer, captured with the step. The bench turns it on.
    expert_tally: bool = False
    # full blocks of committed tokens indexed by a chained hash and reused by later requests (docs/kv_cache.md)
    prefix_caching: bool = True
    # a waiting request whose next uncached block a running request is prefilling waits for that block to be
    # committed, then hits it, rather than computing the shared prefix again (SGLang's in-batch prefix caching)
    share_inflight_prefix: bool = True
    # "on_demand": blocks allocated per step for what it writes, recompute preemption when they run out;
    # "reserve": prompt + max_tokens reserved at admission, never preempted
    kv_allocation: str = "on_demand"
    # a retained request's blocks (a turn that ended in a tool call, or one that asked) outlive plain LRU this long
    kv_retention_s: float = 30.0

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size", "num_blocks"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise RequestError(f"engine.{name} must be >= 1, got {getattr(self, name)}")
        if self.static_steps not in ("auto", "on", "off"):
            raise RequestError(f"engine.static_steps must be auto, on or off, got {self.static_steps!r}")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise RequestError(f"engine.gpu_memory_utilization must be in (0, 1] or null, got "
                               f"{self.gpu_memory_utilization}")
        if self.overlap not in ("on", "off"):
            raise RequestError(f"engine.overlap must be on or off, got {self.overlap!r}")
        if self.kv_allocation not in ALLOCATIONS:
            raise RequestError(f"engine.kv_allocation must be one of {ALLOCATIONS}, got {self.kv_allocation!r}")
        if self.kv_retention_s < 0:
            raise RequestError(f"engine.kv_retention_s must be >= 0, got {self.kv_retention_s}")

    def for_model(self, context_len: int) -> SchedulerConfig:
        """This config for a model of ``context_len`` tokens (``max_position_embeddings``): ``max_model_len`` unset
        becomes it; one above it is refused, naming both."""
        if self.max_model_len is None:
            return dataclasses.replace(self, max_model_len=context_len)
        if self.max_model_len > context_len:
            raise RequestError(f"engine.max_model_len={self.max_model_len} is above the model's context length "
                               f"{context_len} (max_position_embeddings in its config.json); leave it unset or "
                               "lower it")
        return self
