"""Start the ranks of a job: under torchrun use its environment, otherwise spawn them on this machine."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Callable

import torch
import torch.multiprocessing as mp

from parallelism.comm import init_distributed, shutdown_distributed
from parallelism.deepep import release_buffers


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """``n`` distinct loopback ports free now (all bound at once, then released: two calls of a one-port picker can
    return the same port)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


def _rank_main(rank: int, world_size: int, port: int, fn: Callable, args: tuple, backend: str | None = None) -> None:
    backend = backend or backend_for("cuda" if torch.cuda.is_available() else "cpu")
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    else:  # CPU ranks (a device=cpu job on a GPU host creates no CUDA context)
        torch.set_num_threads(1)
    init_distributed(rank, world_size, port, backend)
    try:
        fn(rank, *args)
        release_buffers()  # DeepEP's (a collective): only on a clean exit, which every rank takes alike
    finally:
        shutdown_distributed()


def backend_for(device_type: str) -> str:
    """The process-group backend for tensors on ``device_type``: NCCL for ``cuda``, gloo otherwise (a CPU model
    on a GPU host included: NCCL refuses CPU tensors)."""
    return "nccl" if device_type == "cuda" else "gloo"


def launch(world_size: int, fn: Callable, *args, master_port: int = 0, backend: str | None = None) -> None:
    """Runs ``fn(rank, *args)`` on every rank. A rank that raises fails the whole job (the others are
    terminated), so a dead rank never leaves the job hanging. ``backend``: see :func:`backend_for` (default:
    NCCL when CUDA is available)."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
        if int(os.environ["WORLD_SIZE"]) != world_size:
            raise RuntimeError(f"torchrun WORLD_SIZE={os.environ['WORLD_SIZE']} but the layout needs {world_size}")
        _rank_main(int(os.environ["RANK"]), world_size, int(os.environ.get("MASTER_PORT", 29500)), fn, args, backend)
        return
    if world_size == 1:
        fn(0, *args)
        return
    port = master_port or free_port()
    method = "spawn" if torch.cuda.is_available() else "fork"
    mp.start_processes(_rank_main, args=(world_size, port, fn, args, backend), nprocs=world_size,
                       start_method=method)
