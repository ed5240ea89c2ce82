"""The ``deepep`` MoE dispatcher: DeepEP's intranode kernels (one node, NVLink) behind a capability check.

Same job as the ``alltoall`` dispatcher (attention DP, tokens partitioned over the ranks), two DeepEP paths:

- **normal** (prefill, many tokens): ``Buffer.get_dispatch_layout`` + ``Buffer.dispatch`` send each token once
  to every rank that holds at least one of its experts; the receiver gets the rows, each choice's *local*
  expert index (``-1`` when that expert lives elsewhere, weight 0 there) and the weights, i.e. our
  :class:`ExpertInput` as it is. ``Buffer.combine`` sums the returned rows per token **without** weights, so
  our weighted expert outputs go back as they are (the alltoall contract). The CPU waits for the received
  count inside ``dispatch``: not CUDA-graph safe.
- **low latency** (decode, at most ``max_decode_tokens`` tokens on every rank): ``low_latency_dispatch``
  returns rows packed per local expert, ``[E_local, max_decode_tokens * W, H]`` with ``count[e]`` valid rows
  each (one row per (token, expert) pair), and ``low_latency_combine`` applies the routing weights itself.
  The packed rows become an ExpertInput with one choice per row (slot ``e`` or ``-1`` past the count) and
  weight **1**, so the experts return unweighted outputs and the weights are applied once, by DeepEP. Fixed
  shapes and no host synchronisation: CUDA-graph safe.

Mode choice. Every rank must take the same path (the kernels are collective), so an eager step agrees on it
with one tiny ``world/all_reduce`` of the token counts per MoE layer (``max(tokens) <= max_decode_tokens`` →
low latency). While a CUDA graph is being captured the step is a decode step by construction (the graph
runner captures decode and verify shapes only) and the collective is skipped: low latency, or an error if
that is impossible. :func:`deepep_mode` pins a mode for a block, for a caller that already knows it.

Expert numbering. DeepEP assumes expert ``e`` lives on rank ``e // E_local`` at local index ``e % E_local``:
exactly our physical slots (:class:`~parallelism.layout.ExpertPlacement`), so routing ids are renamed to the
physical slot each (token, choice) goes to (:meth:`~parallelism.dispatch_base.Dispatcher.physical`: a
permutation for ``round_robin``, a replica's slot under EPLB) and DeepEP sees ``num_slots`` experts; its local
index is then exactly our local slot. Expert-TP (``moe_tp > 1``) has no DeepEP equivalent and is refused by
:func:`deepep_unavailable`.

API read from github deepseek-ai/DeepEP at dd758ca (package 2.1.0, ``deep_ep.Buffer`` = the legacy V1
interface) and tag v1.2.1 (``deep_ep/buffer.py``); the calls used here are the same in both. The helpers
below the dispatcher are pure torch so the CPU tests can check them; see ``docs/deepep.md``.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from parallelism import nvml
from parallelism.comm import ParallelGroups
from parallelism.dispatch_base import DeepEPUnavailable, Dispatcher, ExpertInput, capturing
from parallelism.layout import ExpertPlacement

FALLBACK = "parallel.dispatcher=alltoall"
MODES = ("normal", "low_latency")
# DeepEP ships tuned intranode dispatch/combine configs (Buffer.get_dispatch_config) for these group sizes.
INTRANODE_WORLD_SIZES = (2, 4, 8)
# Hidden sizes the low-latency kernels are compiled for (SWITCH_HIDDEN in csrc/kernels/launch.cuh at v1.2.1 and
# csrc/kernels/legacy/launch.cuh at 2.x); 2.x adds 3072, which v1.2.1 meets with a host assert.
LOW_LATENCY_HIDDEN = (2048, 2560, 4096, 5120, 6144, 7168, 8192)
LOW_LATENCY_HIDDEN_2X = (*LOW_LATENCY_HIDDEN, 3072)
LOW_LATENCY_MAX_TOPK = 11  # kNumMaxTopK of the low-latency kernels


# ------------------------------------------------------------------------------------------ capability


def deepep_unavailable(groups: ParallelGroups) -> str | None:
    """Why the ``deepep`` dispatcher cannot run for ``groups`` on this machine, or None when it can.

    Checked in order (layout first, so the answer does not depend on the machine when the layout alone rules
    DeepEP out): expert-TP, the group size, ``import deep_ep`` and its API, CUDA, the NCCL backend, one GPU per
    rank, NVLink between every pair of the group's GPUs. Every rank computes the same answer from the same
    inputs, so either all ranks build DeepEP buffers (a collective) or all raise."""
    lay = groups.layout
    if lay.moe_tp > 1:
        return (f"expert-TP (moe_tp={lay.moe_tp}) is not supported: DeepEP sends a token to whole experts, each "
                "on one rank; use moe_tp=1, moe_ep=world_size")
    w = lay.world_size
    if w not in INTRANODE_WORLD_SIZES:
        return (f"world_size={w}: only DeepEP's intranode kernels are wired (one node, NVLink), which have tuned "
                f"configs for {INTRANODE_WORLD_SIZES} ranks")
    try:
        import deep_ep
    except Exception as err:  # noqa: BLE001 - ImportError, or deep_ep's own import-time checks (NCCL, JIT)
        return (f"the deep_ep package does not import ({type(err).__name__}: {err}); build DeepEP from source "
                "with NVSHMEM (docs/deepep.md; the PyPI 'deep-ep' upload is not usable)")
    api = _api_reason(deep_ep)
    if api:
        return api
    if not torch.cuda.is_available():
        return "no CUDA device"
    import torch.distributed as dist

    if not dist.is_initialized() or groups.world.group is None:
        return "torch.distributed is not initialised"
    backend = dist.get_backend(groups.world.group)
    if backend != "nccl":
        return f"the world process group uses {backend!r}; DeepEP runs beside NCCL"
    n = torch.cuda.device_count()
    if n < w:
        return f"{w} ranks but {n} visible GPUs: DeepEP needs one GPU per rank"
    return nvlink_unavailable(list(range(w)))


def _api_reason(deep_ep) -> str | None:
    """The calls this dispatcher makes, with the keywords it passes; the PyPI 1.0.0 snapshot fails here (its
    ``low_latency_dispatch`` has no ``use_fp8`` and always returns FP8)."""
    buf = getattr(deep_ep, "Buffer", None)
    need = ("get_dispatch_layout", "dispatch", "combine", "low_latency_dispatch", "low_latency_combine",
            "clean_low_latency_buffer", "get_low_latency_rdma_size_hint", "get_dispatch_config",
            "get_combine_config", "destroy")
    missing = [m for m in need if not hasattr(buf, m)]
    if buf is None or missing:
        return f"deep_ep at {getattr(deep_ep, '__file__', '?')} lacks Buffer.{', Buffer.'.join(missing) or ''}"
    if "use_fp8" not in inspect.signature(buf.low_latency_dispatch).parameters:
        return (f"deep_ep at {getattr(deep_ep, '__file__', '?')} predates low_latency_dispatch(use_fp8=...) "
                "(the PyPI 1.0.0 snapshot); build a current DeepEP from source")
    return None


def nvlink_unavailable(devices: list[int]) -> str | None:
    """None when every pair of CUDA ``devices`` is NVLink-connected. NVML (``pynvml``) answers when it loads:
    ``nvmlDeviceGetP2PStatus(..., NVML_P2P_CAPS_INDEX_NVLINK)``, as DeepEP's own check does; otherwise
    ``torch.cuda.can_device_access_peer``, which PCIe P2P also passes (weaker, said so in the reason).

    Devices are CUDA indices (``rank % device_count``, as parallelism.launch sets them), found in NVML by
    :func:`parallelism.nvml.cuda_handle`."""
    pairs = [(a, b) for i, a in enumerate(devices) for b in devices[i + 1:]]
    try:
        pynvml = nvml.load()
    except Exception:  # noqa: BLE001 - no NVML: fall back to the CUDA peer-access query
        for a, b in pairs:
            if not torch.cuda.can_device_access_peer(a, b):
                return f"GPU {a} cannot access GPU {b} peer-to-peer (NVML unavailable, so NVLink is unconfirmed)"
        return None
    try:
        handles = {d: nvml.cuda_handle(pynvml, d) for d in devices}
        for a, b in pairs:
            status = pynvml.nvmlDeviceGetP2PStatus(handles[a], handles[b], pynvml.NVML_P2P_CAPS_INDEX_NVLINK)
            if status != pynvml.NVML_P2P_STATUS_OK:
                return f"GPUs {a} and {b} are not connected by NVLink (NVML P2P status {status})"
        return None
    except Exception as err:  # noqa: BLE001 - NVMLError (NotSupported, a MIG or short-UUID entry, ...)
        return f"NVML could not confirm NVLink between GPUs {devices} ({type(err).__name__}: {err})"
    finally:
        nvml.shutdown(pynvml)


def low_latency_hidden_sizes(deep_ep) -> tuple[int, ...]:
    """The hidden sizes ``deep_ep`` (the module, or None for an injected test buffer) compiles low-latency
    kernels for: 2.x (which exports ``topk_idx_t``) adds 3072 to v1.2.1's."""
    return LOW_LATENCY_HIDDEN_2X if hasattr(deep_ep, "topk_idx_t") else LOW_LATENCY_HIDDEN


def low_latency_unsupported(hidden: int, top_k: int, num_experts: int, world_size: int, max_tokens: int,
                            qp_depth: int | None = None,
                            hidden_sizes: tuple[int, ...] = LOW_LATENCY_HIDDEN) -> str | None:
    """Why DeepEP's low-latency kernels cannot take this shape (None: they can). The limits are DeepEP's host
    asserts: a compiled hidden size (``hidden_sizes``: :func:`low_latency_hidden_sizes`), ``top_k <= 11``,
    experts divisible by ranks, ``W * max_tokens`` a multiple of 4 (TMA), and
    ``NVSHMEM_QP_DEPTH >= 2 * (max_tokens + 1)`` (default depth 1024)."""
    depth = qp_depth if qp_depth is not None else int(os.environ.get("NVSHMEM_QP_DEPTH", "1024"))
    if hidden not in hidden_sizes:
        return f"hidden size {hidden} is not one the low-latency kernels are compiled for {hidden_sizes}"
    if not 1 <= top_k <= LOW_LATENCY_MAX_TOPK:
        return f"top_k={top_k} is outside the low-latency kernels' 1..{LOW_LATENCY_MAX_TOPK}"
    if num_experts % world_size:
        return f"{num_experts} experts do not divide over {world_size} ranks"
    if max_tokens < 1 or (world_size * max_tokens) % 4:
        return f"world_size * max_decode_tokens = {world_size}*{max_tokens} must be a positive multiple of 4"
    if depth < 2 * (max_tokens + 1):
        return f"NVSHMEM_QP_DEPTH={depth} < 2 * (max_decode_tokens + 1) = {2 * (max_tokens + 1)}"
    return None


def choose_mode(max_tokens_on_any_rank: int, max_decode_tokens: int, low_latency_ok: bool) -> str:
    """The path every rank takes for one step: low latency when it is available and no rank has more than
    ``max_decode_tokens`` tokens, normal otherwise."""
    return "low_latency" if low_latency_ok and max_tokens_on_any_rank <= max_decode_tokens else "normal"


_PINNED: list[str] = []


@contextmanager
def deepep_mode(mode: str) -> Iterator[None]:
    """Pins the DeepEP path for the block (skipping the per-layer agreement collective). Every rank must pin
    the same mode; ``low_latency`` steps must still fit ``max_decode_tokens`` tokens on each rank."""
    if mode not in MODES:
        raise ValueError(f"deepep mode must be one of {MODES}, got {mode!r}")
    _PINNED.append(mode)
    try:
        yield
    finally:
        _PINNED.pop()


# ------------------------------------------------------------------------------------------ layout helpers


def packed_to_expert_input(packed: torch.Tensor, counts: torch.Tensor) -> ExpertInput:
    """Low-latency dispatch output → ExpertInput, without a host sync.

    ``packed [E_local, R, H]`` (rows ``[0, counts[e])`` of expert ``e`` are valid, the rest is garbage),
    ``counts [E_local]`` → ``hidden [E_local * R, H]`` (a view), ``slots [E_local * R, 1]`` = ``e`` on valid
    rows and ``-1`` elsewhere, ``weights`` all 1: the experts return each row's *unweighted* output and
    ``low_latency_combine`` applies the routing weights. ``packed_counts = counts`` lets the Triton experts
    run a masked grouped GEMM on the packed layout itself (:func:`model.triton.moe.masked_moe`)."""
    e, r, h = packed.shape
    pos = torch.arange(r, device=packed.device)
    valid = pos[None, :] < counts.to(pos.device, torch.int64)[:, None]  # [E_local, R]
    expert = torch.arange(e, device=packed.device)[:, None].expand(e, r)
    slots = torch.where(valid, expert, -1).reshape(e * r, 1)
    weights = torch.ones(e * r, 1, dtype=torch.float32, device=packed.device)
    return ExpertInput(packed.reshape(e * r, h), slots, weights, counts)


def expert_output_to_packed(y: torch.Tensor, packed_shape: tuple[int, int, int]) -> torch.Tensor:
    """Expert outputs ``[E_local * R, H]`` → ``[E_local, R, H]`` contiguous, what ``low_latency_combine`` reads
    (only the valid rows of each expert are read)."""
    return y.reshape(packed_shape).contiguous()


def buffer_bytes(buffer_cls, num_ranks: int, hidden: int, element_size: int, num_experts: int,
                 max_decode_tokens: int, low_latency: bool) -> tuple[int, int]:
    """``(num_nvl_bytes, num_rdma_bytes)`` for one Buffer serving both paths, from DeepEP's own size hints:
    NVLink bytes = the larger of the default dispatch and combine configs' ``get_nvl_buffer_size_hint`` at
    ``hidden * max(element_size, 2)`` bytes per row; RDMA bytes = the larger of their
    ``get_rdma_buffer_size_hint`` (0 within one node) and, with low latency,
    ``get_low_latency_rdma_size_hint(max_decode_tokens, hidden, num_ranks, num_experts)``."""
    hidden_bytes = hidden * max(element_size, 2)
    configs = (buffer_cls.get_dispatch_config(num_ranks), buffer_cls.get_combine_config(num_ranks))
    nvl = max(c.get_nvl_buffer_size_hint(hidden_bytes, num_ranks) for c in configs)
    rdma = max(c.get_rdma_buffer_size_hint(hidden_bytes, num_ranks) for c in configs)
    if low_latency:
        rdma = max(rdma, buffer_cls.get_low_latency_rdma_size_hint(max_decode_tokens, hidden, num_ranks,
                                                                    num_experts))
    return int(nvl), int(rdma)


# ------------------------------------------------------------------------------------------ the dispatcher


@dataclass(frozen=True)
class DeepEPMeta:
    mode: str
    handle: object
    num_tokens: int
    topk_idx: torch.Tensor | None = None      # low latency: DeepEP-numbered ids [T, k]
    topk_weights: torch.Tensor | None = None  # low latency: fp32 [T, k]
    packed_shape: tuple[int, int, int] | None = None


@dataclass
class _SharedBuffer:
    """One DeepEP Buffer per process group, shared by every MoE layer (the layers run one after another, and
    NVSHMEM, behind the low-latency path, initialises once per process)."""

    buffer: object
    low_latency: bool
    hidden: int
    max_decode_tokens: int
    num_experts: int
    idx_dtype: torch.dtype
    last_mode: str = ""


_SHARED: dict[int, _SharedBuffer] = {}


def before_graph_replay() -> None:
    """Call before replaying a graph that holds low-latency DeepEP calls: a normal-mode step since the last
    low-latency one leaves the low-latency buffers to be cleaned, which the replay (no Python) cannot do."""
    for s in _SHARED.values():
        if s.low_latency and s.last_mode == "normal":
            s.buffer.clean_low_latency_buffer(s.max_decode_tokens, s.hidden, s.num_experts)
            s.last_mode = "low_latency"


def release_buffers() -> None:
    """Destroys every DeepEP Buffer this process built. A collective: every rank calls it, on a clean exit
    (``parallelism.launch``); after an error the buffers are left to the OS, since with ``explicitly_destroy``
    their destructor does nothing (DeepEP warns that releasing in the destructor can hang at exit)."""
    for shared in _SHARED.values():
        shared.buffer.destroy()
    _SHARED.clear()


class DeepEPDispatcher(Dispatcher):
    """DeepEP dispatch/combine with the :class:`Dispatcher` contract (see the module docstring).

    ``low_latency`` (default ``parallel.deepep_low_latency``, on) enables the decode path and makes the
    dispatcher graph-safe; ``max_decode_tokens`` (``parallel.deepep_max_decode_tokens``, 128) is its
    per-rank token bound, the same on every rank. ``buffer`` injects a ready Buffer-like object (tests);
    otherwise one ``deep_ep.Buffer`` is created at the first dispatch (a collective: hidden size and dtype are
    known only then) and shared by all layers."""

    name = "deepep"
    needs_partitioned_tokens = True
    needs_nvlink = True

    def __init__(self, groups: ParallelGroups, placement: ExpertPlacement, *, low_latency: bool | None = None,
                 max_decode_tokens: int | None = None, buffer=None):
        super().__init__(groups, placement)
        if placement.moe_tp != 1:
            raise DeepEPUnavailable(f"dispatcher 'deepep' has no expert-TP (moe_tp={placement.moe_tp}); "
                                    f"use {FALLBACK}")
        if low_latency is None:
            low_latency = groups.layout.deepep_low_latency
        if max_decode_tokens is None:
            max_decode_tokens = groups.layout.deepep_max_decode_tokens
        self.low_latency, self.max_decode_tokens = bool(low_latency), int(max_decode_tokens)
        self.graph_safe = self.low_latency  # the normal path waits on the host for the received count
        self.graph_token_limit = self.max_decode_tokens if self.low_latency else None
        self.num_experts, self.num_local = placement.num_slots, placement.slots_per_rank  # DeepEP's "experts"
        self._injected = buffer
        self._shared: _SharedBuffer | None = None
        self._ll_reason: str | None = None
        self.last_mode = ""

    # -- buffer

    def _buffer(self, x: torch.Tensor, top_k: int) -> _SharedBuffer:
        if self._shared is not None:
            return self._shared
        hidden, w = x.shape[1], self.world.size
        deep_ep = None
        if self._injected is None:
            import deep_ep
        ll_reason = low_latency_unsupported(hidden, top_k, self.num_experts, w, self.max_decode_tokens,
                                            hidden_sizes=low_latency_hidden_sizes(deep_ep))
        self._ll_reason = "low-latency path off" if not self.low_latency else ll_reason
        use_ll = self.low_latency and ll_reason is None
        if self._injected is not None:
            self._shared = _SharedBuffer(self._injected, use_ll, hidden, self.max_decode_tokens, self.num_experts,
                                         torch.int64)
            return self._shared
        key = id(self.world.group)
        shared = _SHARED.get(key)
        if shared is None:
            nvl, rdma = buffer_bytes(deep_ep.Buffer, w, hidden, x.element_size(), self.num_experts,
                                     self.max_decode_tokens, use_ll)
            try:
                buf = deep_ep.Buffer(self.world.group, nvl, rdma, low_latency_mode=use_ll,
                                     num_qps_per_rank=self.num_local if use_ll else 1, explicitly_destroy=True)
            except RuntimeError as err:  # NVSHMEM/IBGDA init (low latency), IPC handles, buffer allocation
                raise DeepEPUnavailable(f"deep_ep.Buffer(low_latency_mode={use_ll}) failed on rank "
                                        f"{self.world.rank}: {err}; use {FALLBACK}, or "
                                        "parallel.deepep_low_latency=false for the normal path only") from err
            shared = _SharedBuffer(buf, use_ll, hidden, self.max_decode_tokens, self.num_experts,
                                   getattr(deep_ep, "topk_idx_t", torch.int64))
            _SHARED[key] = shared
        elif (shared.hidden, shared.max_decode_tokens, shared.num_experts, shared.low_latency) != (
                hidden, self.max_decode_tokens, self.num_experts, use_ll):
            raise RuntimeError(
                "one DeepEP buffer per process: it was built for (hidden, max_decode_tokens, experts, low_latency) "
                f"= {(shared.hidden, shared.max_decode_tokens, shared.num_experts, shared.low_latency)}, this layer "
                f"needs {(hidden, self.max_decode_tokens, self.num_experts, use_ll)}")
        self._shared = shared
        return shared

    # -- mode

    def _mode(self, num_tokens: int, shared: _SharedBuffer, device: torch.device) -> str:
        if capturing():
            if not shared.low_latency:
                raise DeepEPUnavailable(f"a CUDA graph needs DeepEP's low-latency path, which is off here "
                                        f"({self._ll_reason})")
            if num_tokens > self.max_decode_tokens:
                raise DeepEPUnavailable(f"a captured step has {num_tokens} tokens on this rank, more than "
                                        f"max_decode_tokens={self.max_decode_tokens}")
            return "low_latency"
        if _PINNED:
            mode = _PINNED[-1]
            if mode == "low_latency" and not shared.low_latency:
                raise DeepEPUnavailable(f"deepep low-latency mode pinned but off ({self._ll_reason})")
            if mode == "low_latency" and num_tokens > self.max_decode_tokens:
                raise ValueError(f"low-latency mode pinned with {num_tokens} tokens > {self.max_decode_tokens}")
            return mode
        if not shared.low_latency:
            return "normal"  # nothing to agree on
        counts = torch.zeros(self.world.size, dtype=torch.int64, device=device)
        counts[self.world.rank] = num_tokens
        most = int(self.world.all_reduce(counts).max())
        return choose_mode(most, self.max_decode_tokens, True)

    # -- dispatch / combine

    def dispatch(self, x, topk_ids, topk_weights):
        if x.dtype != torch.bfloat16:
            raise TypeError(f"dispatcher 'deepep' moves bf16 activations (DeepEP's combine and low-latency kernels "
                            f"take bf16 only), got {x.dtype}: load the model in bf16 or use {FALLBACK}")
        shared = self._buffer(x, topk_ids.shape[1])
        ids = self.physical(topk_ids).to(shared.idx_dtype).contiguous()
        weights = topk_weights.float().contiguous()
        x = x.contiguous()
        mode = self._mode(x.shape[0], shared, x.device)
        self.last_mode = mode
        buf = shared.buffer
        if mode == "normal":
            shared.last_mode = "normal"
            per_rank, per_rdma_rank, per_expert, in_rank, _ = buf.get_dispatch_layout(ids, self.num_experts)
            recv_x, recv_idx, recv_w, _, handle, _ = buf.dispatch(
                x, topk_idx=ids, topk_weights=weights, num_tokens_per_rank=per_rank,
                num_tokens_per_rdma_rank=per_rdma_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
            # recv_idx: DeepEP's local expert index (our slot, thanks to the renaming) or -1
            inp = ExpertInput(recv_x, recv_idx.to(torch.int64), recv_w.float())
            return inp, DeepEPMeta("normal", handle, x.shape[0])
        if shared.last_mode == "normal":
            buf.clean_low_latency_buffer(self.max_decode_tokens, x.shape[1], self.num_experts)
        shared.last_mode = "low_latency"
        packed, counts, handle, _, _ = buf.low_latency_dispatch(x, ids, self.max_decode_tokens, self.num_experts,
                                                                use_fp8=False)
        inp = packed_to_expert_input(packed, counts)
        return inp, DeepEPMeta("low_latency", handle, x.shape[0], ids, weights, tuple(packed.shape))

    def combine(self, y, meta, shared):
        buf = self._shared.buffer
        if meta.mode == "normal":
            out, _, _ = buf.combine(y.contiguous(), meta.handle)
        else:
            out, _, _ = buf.low_latency_combine(expert_output_to_packed(y, meta.packed_shape), meta.topk_idx,
                                                meta.topk_weights, meta.handle)
        return out if shared is None else out + shared
