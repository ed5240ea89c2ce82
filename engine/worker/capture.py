"""Capture helpers and CUDA-graph coverage, shared by the target's static steps (``engine/worker/cuda_graphs.py``) and
spec_decode's static draft and commit.

:class:`CapturedGraphs` captures a step per key once and replays it; the blockers decide up front why a model
or a shape may not be captured; :class:`GraphCoverage` tallies, per step kind, how many steps replayed a
captured graph and why the others ran eager. "Are CUDA graphs working?" is answered from those numbers
(``GetServerInfo``, bench reports). Capture needs a CUDA device and a graph-safe step (static buffers, no host
synchronisation: the Triton MoE and paged-attention kernels, a graph-safe dispatcher); until a step kind has
that, every step of that kind runs eager with the reason recorded.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import torch

from parallelism.comm import Comm

T = TypeVar("T")


def capture_blocker(model) -> str:
    """Why no forward of ``model`` can be captured, whatever the step: "", or the MoE dispatcher that makes the
    host wait on the device (e.g. the all-to-all reads its row counts), or :func:`kernel_blocker`. Decided up
    front: a capture that fails half-way leaves NCCL and the caching allocator in states PyTorch does not
    always recover from."""
    unsafe = sorted({layer.mlp.dispatcher.name for layer in model.model.layers
                     if hasattr(layer.mlp, "dispatcher") and not layer.mlp.dispatcher.graph_safe})
    if unsafe:
        return f"dispatcher {unsafe[0]!r} is not CUDA-graph safe (it waits on the host)"
    return kernel_blocker(model)


def kernel_blocker(model) -> str:
    """Why ``model``'s kernel set cannot be captured: "" for a graph-safe set (the Triton set, batch-invariant or
    not); the torch references, and the torch batch-invariant set, read sequence lengths and expert row counts on
    the host (``.tolist()``, boolean indexing)."""
    kernels = model.kernels
    if kernels.graph_safe:
        return ""
    if kernels.batch_invariant:
        return ("engine.batch_invariant: the invariant attention reads context lengths on the host "
                "(docs/batch_invariance.md)")
    why = kernels.reasons.get("moe_experts", "torch reference kernels")
    return f"{why}: the torch references wait on the host, capture needs the Triton kernels"


def token_limit_blocker(model, tokens: int) -> str:
    """Why a step of ``tokens`` tokens per rank cannot be captured although the dispatcher is graph-safe: ""
    or the dispatcher whose graph-safe path holds fewer tokens (DeepEP's low-latency buffers are sized for
    ``parallel.deepep_max_decode_tokens``). Decided before capture, the same on every rank, so no rank starts
    a collective inside a capture that another rank refuses."""
    limits = {(d.graph_token_limit, d.name) for d in (getattr(layer.mlp, "dispatcher", None)
                                                      for layer in model.model.layers)
              if d is not None and d.graph_token_limit is not None}
    if not limits:
        return ""
    limit, name = min(limits)
    return (f"{tokens} tokens per rank exceed dispatcher {name!r}'s graph-safe bound of {limit} (from "
            "parallel.deepep_max_decode_tokens, times attn_tp when attention TP ranks split their tokens)"
            ) if tokens > limit else ""


# sampling's temporaries per logit of a sampled row: log_softmax, the banned copy and the filtered logits (fp32),
# the Gumbel noise (fp32) and its int64 hash bits, the top-p sort's values and int64 order
SAMPLING_BYTES_PER_LOGIT = 4 * 3 + 4 + 8 + 4 + 8
MEMORY_RESERVE = 0.1  # of the free memory, kept back for the allocator's fragmentation and NCCL/DeepEP buffers


def static_step_bytes(*, batch: int, tree_size: int, vocab: int, hidden: int, intermediate: int, dtype_bytes: int,
                      feature_width: int = 0, draft_rows: int = 0) -> int:
    """Upper estimate of the device bytes one static step of ``batch × tree_size`` rows (a decode: tree size 1)
    allocates beyond weights and KV (which exist already): the logits ``[B·N, V]`` fp32 and sampling's temporaries
    per logit (they grow as batch × tree size × vocab), the activations (hidden- and intermediate-wide,
    ``dtype_bytes`` each), the drafter features ``[B·N, feature_width]`` and the tree masks; with drafting, the
    draft logits ``[B, draft_rows, V]`` fp32 and their log-softmax (``SpeculationFacts.draft_rows``)."""
    rows = batch * tree_size
    logits = rows * vocab * (4 + SAMPLING_BYTES_PER_LOGIT)
    activations = rows * (8 * hidden + 3 * intermediate + feature_width) * dtype_bytes
    masks = 2 * batch * tree_size * tree_size
    draft = batch * draft_rows * vocab * 4 * 2
    return logits + activations + masks + draft


def memory_blocker(need: int, free: int | None, reserve: float = MEMORY_RESERVE) -> str:
    """Why a static shape needing ``need`` bytes (:func:`static_step_bytes`) is skipped: "" when it fits in
    ``free`` bytes less ``reserve`` of them; ``free`` None (not CUDA) sets no limit."""
    if free is None or need <= free * (1 - reserve):
        return ""
    gib = 2**30
    return (f"needs ~{need / gib:.2f} GiB of buffers, {free / gib:.2f} GiB free on the device (keeping "
            f"{reserve:.0%} back): skipped, its steps run the dynamic path")


def free_device_memory(device: torch.device) -> int | None:
    """Bytes a new buffer on ``device`` can take: free on the device (``torch.cuda.mem_get_info``) plus what
    PyTorch's caching allocator holds unused (earlier captures' leftovers); None off CUDA, where no limit applies."""
    if device.type != "cuda":
        return None
    cached_unused = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return torch.cuda.mem_get_info(device)[0] + cached_unused


def eager_reason(model, static_steps: str) -> str:
    """Why a process whose runner has no static steps replays no graphs (``static_steps``:
    ``engine.static_steps``)."""
    if model.device.type != "cuda":
        return "no CUDA device" if not torch.cuda.is_available() else "model not on a CUDA device"
    return capture_blocker(model) or f"static steps off (engine.static_steps={static_steps})"


@contextmanager
def no_host_sync(enabled: bool = True) -> Iterator[None]:
    """Inside, any operation that makes the host wait on a CUDA device raises (CUDA sync debug mode "error");
    a no-op when not ``enabled`` or without CUDA."""
    if not (enabled and torch.cuda.is_available()):
        yield
        return
    before = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(before)


class GraphCaptureError(RuntimeError):
    """Capturing a step failed although its eager warm-up runs had worked."""


def capture_graph(run: Callable[[], T], pool=None) -> tuple[torch.cuda.CUDAGraph, T]:
    """Two warm-up calls of ``run`` on a side stream (Triton compiles and autotunes outside the capture), then
    one captured into a CUDA graph that shares the memory ``pool``. Returns the graph and ``run``'s outputs:
    static tensors that every replay overwrites. A warm-up that raises propagates (the eager step is broken,
    running it eagerly would fail alike); a failing capture raises :class:`GraphCaptureError`."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, pool=pool):
            outputs = run()
    except Exception as exc:  # noqa: BLE001 - the caller falls back to eager for this shape
        raise GraphCaptureError(f"{type(exc).__name__}: {exc}") from exc
    return graph, outputs


def capturable(device: torch.device) -> bool:
    """Whether graphs can be captured on ``device``: CUDA only."""
    return device.type == "cuda"


def raise_if_any_rank_failed(control: Comm | None, key, failure: str) -> None:
    """With more than one rank, a capture that failed on any rank (``failure`` non-empty there) stops the job on
    every rank with :class:`GraphCaptureError` naming the lowest failing rank. A capture that dies half-way can
    leave a rank's collective state out of step with the others' (DeepEP's low-latency double-buffer index
    flips per call, captured or not; NCCL's), and an eager fallback would then hang or compute garbage. One
    all-gather per newly captured key over ``control`` (gloo: it does not depend on NCCL's state); every rank
    reaches it for the same keys in the same order (the runner prepares draft → verify → commit on every rank,
    idle attention-DP ranks included)."""
    if control is None or control.size == 1:
        return
    failures = control.all_gather_objects(failure)
    rank = next((r for r, f in enumerate(failures) if f), None)
    if rank is not None:
        raise GraphCaptureError(
            f"CUDA-graph capture of {key} failed on rank {control.ranks[rank]}: {failures[rank]}. With "
            f"{control.size} ranks a half-done capture can leave the ranks' collective state apart, so every rank "
            "stops; engine.static_steps=off runs every step eagerly")


class CapturedGraphs:
    """CUDA graphs by key (a step shape, a batch size), each captured on first use into one shared memory pool;
    a key that cannot be captured keeps the reason and runs eagerly from then on.

    Sharing the pool means a graph's static outputs may sit in memory another graph uses for scratch: they are
    valid until the next replay of *any* graph of this object, so a caller consumes (or clones) them first."""

    def __init__(self, blocker: str = "", control: Comm | None = None):
        """``blocker``: why nothing here may be captured even on CUDA (:func:`capture_blocker`);
        ``control``: every rank of the job (``ParallelGroups.control``), see :func:`raise_if_any_rank_failed`."""
        self.captured: dict = {}  # key → (graph, its static outputs)
        self.reasons: dict = {}  # key → why it runs eagerly
        self.pool, self.blocker, self.control = None, blocker, control

    def _capture(self, key, device: torch.device, prepare: Callable[[], None], run: Callable,
                 key_blocker: Callable[[], str] = str) -> str:
        """Captures ``run`` for ``key`` once (``prepare`` loads a padding-only input first); returns "" or why
        ``key`` runs eagerly (``key_blocker()``: why this key alone may not be captured, asked once). Later
        calls return the first answer. The blockers decide alike on every rank; a failed capture runs the key
        eagerly on one rank and stops the job on several (:func:`raise_if_any_rank_failed`)."""
        if key in self.captured or key in self.reasons:
            return self.reasons.get(key, "")
        blocker = (self.blocker or key_blocker()) if capturable(device) else "no CUDA device"
        if blocker:
            self.reasons[key] = blocker
            return blocker
        prepare()
        try:
            captured, failure = capture_graph(run, self.pool), ""
        except GraphCaptureError as exc:
            captured, failure = None, str(exc)
        raise_if_any_rank_failed(self.control, f"{type(self).__name__}[{key!r}]", failure)
        if failure:
            self.reasons[key] = f"capture failed: {failure}"
            return self.reasons[key]
        self.pool = captured[0].pool()
        self.captured[key] = captured
        return ""

    def _replay_or_run(self, key, run: Callable):
        """``(replayed, outputs)``: the replayed graph's static outputs, or ``run()``'s."""
        if key in self.captured:
            graph, outputs = self.captured[key]
            graph.replay()
            return True, outputs
        return False, run()

    def status(self, key) -> tuple[bool, str]:
        """A step of ``key``'s coverage record: ``(replayed, why not)``."""
        return key in self.captured, self.reasons.get(key, "")
