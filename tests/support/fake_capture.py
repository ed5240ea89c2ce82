"""CUDA-graph capture stood in for on CPU, to run the engine's capture bookkeeping on gloo ranks.

Inside :func:`faked_capture`, ``engine.worker.capture`` treats every device as capturable and its ``capture_graph``
runs the step once and returns a :class:`ReplayGraph`, whose replay runs the step again eagerly and copies the
results into the first run's outputs — what a real replay does to its static output tensors. So callers that
keep a replay's outputs past the next replay, or read the wrong buffers, see stale values here too. ``fail``
makes every capture on this rank raise ``GraphCaptureError`` after running the step: the fake runs a step's
collectives for real (a real capture only records them), so a failing rank must still take part in them.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch


def copy_outputs(dst, src) -> None:
    """Copies ``src`` into ``dst`` leaf by leaf (tensors, possibly nested in tuples or lists, or None)."""
    if isinstance(dst, torch.Tensor):
        dst.copy_(src)
    elif isinstance(dst, (tuple, list)):
        for a, b in zip(dst, src, strict=True):
            copy_outputs(a, b)
    elif dst is not None:
        raise TypeError(f"static outputs of type {type(dst).__name__} are not tensors")


class ReplayGraph:
    def __init__(self, run, outputs):
        self.run, self.outputs, self.replays = run, outputs, 0

    def pool(self):
        return None

    def replay(self) -> None:
        self.replays += 1
        copy_outputs(self.outputs, self.run())


@contextmanager
def faked_capture(fail: bool = False):
    import engine.worker.capture as cg

    def capture(run, pool=None):
        outputs = run()
        if fail:
            raise cg.GraphCaptureError("RuntimeError: CUDA error: out of memory (in the graph pool)")
        return ReplayGraph(run, outputs), outputs

    saved = cg.capturable, cg.capture_graph
    cg.capturable, cg.capture_graph = (lambda device: True), capture
    try:
        yield
    finally:
        cg.capturable, cg.capture_graph = saved
