"""NVML (``pynvml``, the nvidia-ml-py package) opened in one place, and a CUDA device found in it by UUID.

NVML numbers GPUs by PCI bus order whatever ``CUDA_VISIBLE_DEVICES`` says, so a CUDA index is not an NVML
index: :func:`cuda_handle` looks the device up by the UUID torch reports for it. ``pynvml`` is imported
inside :func:`load`, so importing this module (or the runtime) never loads it; ``load(nvml)`` takes a module
to use instead of ``pynvml`` (the tests pass fakes), and the other functions take the loaded module.
"""

from __future__ import annotations

import os

import torch


def load(nvml=None):
    """``nvml`` (default: ``import pynvml``) after ``nvmlInit``; raises what the import or the init raises
    (ImportError, NVMLError_LibraryNotFound, DriverNotLoaded, ...)."""
    if nvml is None:
        import pynvml as nvml  # the nvidia-ml-py package
    nvml.nvmlInit()
    return nvml


def shutdown(nvml) -> None:
    """``nvmlShutdown``, best effort (at exit an error changes nothing)."""
    try:
        nvml.nvmlShutdown()
    except Exception:  # noqa: BLE001
        pass


def cuda_uuid(device: int) -> str | None:
    """NVML's name (``GPU-<uuid>``) of CUDA ``device``, or None when CUDA cannot say (no CUDA on this box)."""
    if not torch.cuda.is_available():
        return None
    return "GPU-" + str(torch.cuda.get_device_properties(device).uuid)


def cuda_handle(nvml, device: int):
    """The NVML handle of CUDA ``device``: by its UUID when CUDA reports one; otherwise by its entry in
    ``CUDA_VISIBLE_DEVICES`` (an index or a UUID), or the same index when that variable is unset."""
    entry = cuda_uuid(device)
    if entry is None:
        visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
        entry = visible[device] if device < len(visible) else str(device)
    if entry.isdigit():
        return nvml.nvmlDeviceGetHandleByIndex(int(entry))
    return nvml.nvmlDeviceGetHandleByUUID(entry)
