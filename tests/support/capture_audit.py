"""CUDA-graph capture safety checked on CPU: an interposer that rejects, inside a region, every op a CUDA graph
cannot hold.

On this box every tensor is a CPU tensor, so "on the device" is a tag: inside :func:`audit_region` every tensor
is device-resident (the static buffers, weights and caches made before the region, and whatever ops make inside
it) except host data — tensors made from Python values (``aten.lift_fresh``: ``torch.tensor(...)``, the scalar of
``t[i] = 0.0``) and what ops compute from host data alone. A :class:`TorchDispatchMode` sees every aten op and
applies :data:`RULES`; a few Python-level entry points that never reach the dispatcher on CPU (``torch.tensor``,
``Tensor.tolist``/``numpy``/``cpu``) are wrapped for the region's duration. The rules follow what CUDA rejects,
not what looks suspicious: ``fill_`` with a Python number, ``torch.full``, ``torch.where`` with a Python scalar or
a 0-dim host tensor in a pointwise op launch kernels with the value as an argument and pass.

:func:`audited_capture` stands this in for capture in the engine (as ``tests/support/fake_capture.py`` does, plus the
audit of each captured callable and of the ``ModelRunner.strict_sync`` region); :func:`stub_triton_launches` and
:func:`triton_kernel_set` run the Triton wrappers' torch glue with the launches replaced by no-ops, so a step
audits in milliseconds at tiny widths. What it cannot see: a ``.to(device)`` spelled with a CPU device (the
runtime's device *is* CPU here), and host tensors made outside the region (on CUDA those fail loudly anyway).
docs/gpu_path.md, "Capture-safety audit".
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from tests.support.paths import REPO_ROOT

T = TypeVar("T")
aten = torch.ops.aten
ROOT = REPO_ROOT

RULES = {
    "sync": "reads a device value on the host (.item(), int(), float(), bool(), torch.equal): a host "
            "synchronisation",
    "data-dependent-size": "an output whose size depends on the data (nonzero, boolean-mask indexing, masked_select, "
                           "unique, repeat_interleave without output_size, bincount): a host synchronisation",
    "python-data": "a tensor made from Python data (torch.tensor / as_tensor / asarray of a list or number): host "
                   "memory baked in at capture, or a host→device copy",
    "host-to-device": "a host tensor copied into or used by a device op (copy_, index_put_, indexing, a Python "
                      "scalar assigned to a single element): an unpinned host→device copy",
    "device-to-host": ".tolist() / .numpy() / .cpu() of a device tensor: a device→host copy",
}
_SYNC = {aten._local_scalar_dense.default, aten.equal.default}
_DYNAMIC = {aten.nonzero.default, aten.masked_select.default, aten._unique.default, aten._unique2.default,
            aten.unique_dim.default, aten.unique_consecutive.default, aten.unique_dim_consecutive.default,
            aten.bincount.default, aten.argwhere.default}
_BOOL_INDEXED = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default,
                 aten._index_put_impl_.default}
_LIFT = {aten.lift_fresh.default, aten.lift_fresh_copy.default}
# ops whose 0-dim tensor value CUDA reads with .item() when it is on the device (a sync)
_ITEM_OF_VALUE = {aten.masked_fill.Tensor, aten.masked_fill_.Tensor, aten.index_fill.int_Tensor,
                  aten.index_fill_.int_Tensor}
_FACTORIES = ("tensor", "as_tensor", "asarray", "from_numpy")
_READBACKS = ("tolist", "numpy", "cpu", "__array__")


@dataclass(frozen=True)
class Violation:
    """One op that a CUDA graph cannot hold: the rule it breaks (a key of :data:`RULES`), the op, and the
    innermost project frames that issued it."""

    rule: str
    op: str
    where: str
    region: str = ""

    def __str__(self) -> str:
        return f"[{self.region}] {self.rule}: {self.op} at {self.where}"


class CaptureUnsafe(AssertionError):
    """A region issued ops that cannot be captured; the message lists every distinct one."""

    def __init__(self, violations: list[Violation]):
        self.violations = violations
        lines = list(dict.fromkeys(str(v) for v in violations))
        super().__init__(f"{len(lines)} capture-unsafe op(s):\n  " + "\n  ".join(lines))


def user_frames(depth: int = 3) -> str:
    """The innermost ``depth`` frames in this repository's files (not torch's, not this module's)."""
    frames, frame = [], sys._getframe(1)
    while frame is not None and len(frames) < depth:
        name = frame.f_code.co_filename
        if name.startswith(str(ROOT)) and name != __file__ and "site-packages" not in name:
            frames.append(f"{Path(name).relative_to(ROOT)}:{frame.f_lineno} {frame.f_code.co_name}")
        frame = frame.f_back
    return " ← ".join(frames)


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


class CaptureAudit(TorchDispatchMode):
    """The interposer (see the module docstring); violations accumulate in ``found``."""

    def __init__(self, region: str = "", found: list[Violation] | None = None):
        super().__init__()
        self.region = region
        self.found = [] if found is None else found
        self.host = WeakIdKeyDictionary()  # host data made inside the region → True
        self.in_factory = False  # inside a wrapped torch.tensor call (already reported)
        self.paused = False  # a stood-in graph replay runs its step eagerly: not host work of this region

    def flag(self, rule: str, op: str) -> None:
        if self.paused:
            return
        self.found.append(Violation(rule, op, user_frames(), self.region))

    def is_host(self, t: torch.Tensor) -> bool:
        return t in self.host

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.paused:
            return out
        name = str(func)
        inputs = _tensors((args, kwargs))
        if func in _LIFT:
            if inputs[0].dim() > 0 and not self.in_factory:
                self.flag("python-data", name)
            self._mark(out, True)
            return out
        if func in _SYNC:
            self.flag("sync", name)
        elif func in _DYNAMIC or (func == aten.repeat_interleave.Tensor and kwargs.get("output_size") is None):
            self.flag("data-dependent-size", name)
        elif func in _BOOL_INDEXED and any(t.dtype in (torch.bool, torch.uint8) for t in _tensors(args[1])):
            self.flag("data-dependent-size", f"{name} with a boolean mask")
        elif func in _ITEM_OF_VALUE and not self.is_host(args[-1]):
            self.flag("sync", f"{name} with a device value")
        host = [t for t in inputs if self.is_host(t)]
        device = [t for t in inputs if not self.is_host(t)]
        if host and device and not self._scalar_argument(func, host):
            self.flag("host-to-device", name)
        self._mark(out, bool(host) and not device)
        return out

    @staticmethod
    def _scalar_argument(func, host: list[torch.Tensor]) -> bool:
        """0-dim host tensors in a pointwise op (or fill_) reach a CUDA kernel as a scalar argument, no copy."""
        pointwise = torch.Tag.pointwise in func.tags or func == aten.fill_.Tensor
        return pointwise and all(t.dim() == 0 for t in host)

    def _mark(self, out, host: bool) -> None:
        if host:
            for t in _tensors(out):
                self.host[t] = True


@contextmanager
def _python_entry_points(mode: CaptureAudit) -> Iterator[None]:
    """Wraps the Python-data factories and the readbacks that do not dispatch on CPU, for the region only."""
    def factory(orig, fname):
        def made_from_python(data, *args, **kwargs):
            if isinstance(data, torch.Tensor):
                return orig(data, *args, **kwargs)
            mode.flag("python-data", f"torch.{fname}")
            mode.in_factory = True
            try:
                return orig(data, *args, **kwargs)
            finally:
                mode.in_factory = False
        return made_from_python

    def readback(orig, mname):
        def device_to_host(self, *args, **kwargs):
            if not mode.is_host(self):  # host tensors read back for free
                mode.flag("device-to-host", f"Tensor.{mname}")
            return orig(self, *args, **kwargs)
        return device_to_host

    saved_torch = {n: getattr(torch, n) for n in _FACTORIES}
    saved_methods = {n: torch.Tensor.__dict__.get(n) for n in _READBACKS}
    try:
        for n, f in saved_torch.items():
            setattr(torch, n, factory(f, n))
        for n in _READBACKS:
            setattr(torch.Tensor, n, readback(getattr(torch.Tensor, n), n))
        yield
    finally:
        for n, f in saved_torch.items():
            setattr(torch, n, f)
        for n, m in saved_methods.items():
            if m is None:
                delattr(torch.Tensor, n)
            else:
                setattr(torch.Tensor, n, m)


@contextmanager
def audit_region(region: str = "", found: list[Violation] | None = None) -> Iterator[CaptureAudit]:
    """Inside, every capture-unsafe op is recorded in the yielded audit's ``found`` (and in ``found`` when given);
    nothing raises, so one run lists them all."""
    mode = CaptureAudit(region, found)
    with _python_entry_points(mode), mode:
        yield mode


def check(run: Callable[[], T], region: str = "") -> T:
    """``run()`` under the audit; raises :class:`CaptureUnsafe` listing every violation, else returns its result."""
    with audit_region(region) as audit:
        out = run()
    if audit.found:
        raise CaptureUnsafe(audit.found)
    return out


# ---------------------------------------------------------------------------------------- the engine, audited


def region_name(run: Callable) -> str:
    """``StaticStep(verify, batch=1, tree_size=9)``-style label of the callable a capture is handed."""
    owner = getattr(run, "__self__", None)
    if owner is None:
        return getattr(run, "__qualname__", repr(run))
    shape = getattr(owner, "shape", None)
    if shape is not None:
        return f"{type(owner).__name__}({shape.kind}, batch={shape.batch}, tree_size={shape.tree_size})"
    if hasattr(owner, "tree"):  # StaticCommit
        batch, tree_size = owner.tree.tokens.shape
        return f"StaticCommit(batch={batch}, tree_size={tree_size})"
    return f"{type(owner).__name__}(batch={getattr(owner, 'batch', '?')})"


@dataclass
class AuditLog:
    """What :func:`audited_capture` saw: the regions it audited (in order) and every violation."""

    regions: list[str]
    found: list[Violation]

    def raise_if_unsafe(self) -> None:
        if self.found:
            raise CaptureUnsafe(self.found)


@contextmanager
def audited_capture() -> Iterator[AuditLog]:
    """The engine with capture stood in for (every device capturable; ``capture_graph`` runs the step once, under
    the audit, and replays re-run it eagerly: ``tests/support/fake_capture.py``'s ``ReplayGraph``) and with
    ``ModelRunner.strict_sync``'s region (``no_host_sync``) audited too, but for the replays inside it (the
    captured steps were audited at capture; a failed capture's eager fallback is what the capture audit flags).
    Yields the log."""
    import engine.worker.capture as cg
    import engine.worker.runner as runner
    from tests.support.fake_capture import ReplayGraph

    log = AuditLog([], [])
    active: list[CaptureAudit] = []  # the strict region's audit while it runs

    class Replay(ReplayGraph):
        """A replay re-runs its step eagerly here; on CUDA it runs no Python, so the strict region skips it."""

        def replay(self) -> None:
            for mode in active:
                mode.paused = True
            try:
                super().replay()
            finally:
                for mode in active:
                    mode.paused = False

    def capture(run, pool=None):
        log.regions.append(region_name(run))
        with audit_region(log.regions[-1], log.found):
            outputs = run()
        return Replay(run, outputs), outputs

    @contextmanager
    def strict(enabled: bool = True):
        if not enabled:
            yield
            return
        log.regions.append("ModelRunner strict_sync region")
        with audit_region(log.regions[-1], log.found) as mode:
            active.append(mode)
            try:
                yield
            finally:
                active.remove(mode)

    saved = cg.capturable, cg.capture_graph, runner.no_host_sync
    cg.capturable, cg.capture_graph, runner.no_host_sync = (lambda device: True), capture, strict
    try:
        yield log
    finally:
        cg.capturable, cg.capture_graph, runner.no_host_sync = saved


# ------------------------------------------------------------------------------------- Triton launches stubbed


class _NoLaunch:
    """A Triton kernel whose launch does nothing: ``kernel[grid](*args)`` returns at once."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


@contextmanager
def stub_triton_launches() -> Iterator[None]:
    """Every ``@triton.jit`` kernel of ``model.triton.{attention, moe, norm, invariant_matmul, row_attention}``
    replaced by :class:`_NoLaunch`: the wrappers' torch glue (output allocation, ``moe_align_block_size``, masks,
    per-row key lists, split merging) still runs — it is what a capture has to hold — and the outputs are the
    wrappers' own ``torch.empty`` (shape only)."""
    from triton.runtime.jit import KernelInterface

    from model.triton import attention, invariant_matmul, moe, norm, row_attention

    with ExitStack() as stack:
        for module in (attention, moe, norm, invariant_matmul, row_attention):
            for name, obj in list(vars(module).items()):
                if isinstance(obj, KernelInterface):
                    setattr(module, name, _NoLaunch())
                    stack.callback(setattr, module, name, obj)
        yield


def triton_kernel_set():
    """The Triton :class:`model.kernel_select.KernelSet` (what ``select_kernels`` picks on a GPU), built without
    asking CUDA; use it under :func:`stub_triton_launches` off the GPU."""
    from model.kernel_select import OPS, KernelSet
    from model.triton import attention, moe, norm

    return KernelSet(norm.rms_norm, norm.add_rms_norm, moe.fused_moe, attention.paged_decode_gqa,
                     attention.paged_decode_mla, attention.tree_verify_gqa, attention.tree_verify_mla,
                     reasons=dict.fromkeys(OPS, "triton, launches stubbed (capture audit)"), graph_safe=True,
                     backend="triton")

