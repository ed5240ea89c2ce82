"""Shard-on-load for HF safetensors checkpoints (one file, or shards with ``model.safetensors.index.json``), and
the rank's model as the entry points run it: loaded, placed on its device, calling the kernels chosen there.

Each rank asks the model for the tensors it needs (``CausalLM.checkpoint_plan``) and reads only its
slices through ``safe_open(...).get_slice``. A missing or misshapen tensor, or a quantized dtype, is a
:class:`CheckpointError` naming the tensor and the file.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from model.checkpoint_errors import CheckpointError, check_checkpoint_files, open_shard
from model.checkpoint_names import CheckpointNames
from model.config import load_config
from model.kernel_select import BACKENDS, select_kernels
from model.transformer import CausalLM
from parallelism.comm import ParallelGroups

QUANTIZED_DTYPES = {"F8_E4M3", "F8_E5M2", "F8_E8M0", "I8", "U8", "I32", "F4"}


class SliceSource:
    """TensorSource over a safetensors slice: ``narrow`` reads only the requested rows."""

    def __init__(self, slice_, name: str, file: str):
        self._slice = slice_
        self.shape = tuple(slice_.get_shape())
        self.name, self.file = name, file

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = [slice(None)] * dim + [slice(start, start + length)]
        return self._slice[tuple(index)]

    def read(self) -> torch.Tensor:
        return self._slice[:]


def load_weights(model: CausalLM, ckpt_dir: str | Path) -> int:
    """Fills ``model`` from ``ckpt_dir``; returns the number of tensors read (this rank's plan). The model's names
    are looked up under the checkpoint's spelling (:class:`CheckpointNames`); the vision tower's and projector's
    tensors are not read."""
    ckpt_dir = Path(ckpt_dir)
    names = check_checkpoint_files(ckpt_dir)  # tensor → shard, every header and the index checked
    spelling = CheckpointNames.of(model.cfg.weight_prefix, names)
    plan = [(spelling.stored(name), ct) for name, ct in model.checkpoint_plan()]
    by_file: dict[str, list] = {}
    for name, ct in plan:
        if name not in names:
            raise CheckpointError(f"missing tensor {name!r} in checkpoint {ckpt_dir} "
                                  f"(files: {sorted(set(names.values()))})")
        by_file.setdefault(names[name], []).append((name, ct))
    for file, entries in by_file.items():
        path = ckpt_dir / file
        with open_shard(path) as f:
            for name, ct in entries:
                sl = f.get_slice(name)
                if sl.get_dtype() in QUANTIZED_DTYPES and not ct.quantized:
                    raise CheckpointError(f"tensor {name!r} in {path} has quantized dtype {sl.get_dtype()}, "
                                          "but config.json's quantization_config does not quantize it")
                shape = tuple(sl.get_shape())
                if shape != ct.full_shape:
                    raise CheckpointError(f"tensor {name!r} in {path} has shape {list(shape)}, "
                                          f"expected {list(ct.full_shape)}")
                ct.load(SliceSource(sl, name, str(path)))
    return len(plan)


def load_model(ckpt_dir: str | Path, groups: ParallelGroups, dtype=torch.float32) -> CausalLM:
    """Config + sharded weights of ``ckpt_dir`` for this rank."""
    model = CausalLM(load_config(ckpt_dir), groups, dtype)
    load_weights(model, ckpt_dir)
    return model.eval()


@dataclass(frozen=True)
class DeviceConfig:
    """Where each rank's model runs (the ``device`` config group): ``type`` ``cpu`` or ``cuda`` (rank r on
    ``cuda:<r % device_count>``), ``dtype`` a torch dtype name, ``kernels`` ``auto | triton | torch``
    (:func:`model.kernel_select.select_kernels`)."""

    type: str = "cpu"
    dtype: str = "float32"
    kernels: str = "auto"

    def __post_init__(self):
        if self.type not in ("cpu", "cuda"):
            raise ValueError(f"device.type must be cpu or cuda, got {self.type!r}")
        if not isinstance(getattr(torch, self.dtype, None), torch.dtype):
            raise ValueError(f"device.dtype must name a torch dtype, got {self.dtype!r}")
        if self.kernels not in BACKENDS:
            raise ValueError(f"device.kernels must be one of {BACKENDS}, got {self.kernels!r}")


def load_target(ckpt: str | Path, groups: ParallelGroups, rank: int, device: DeviceConfig) -> CausalLM:
    """The rank's model in ``device.dtype`` on its device, calling the kernels :func:`select_kernels` picks
    there."""
    model = load_model(ckpt, groups, getattr(torch, device.dtype))
    where = torch.device("cpu")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("device=cuda, but torch.cuda.is_available() is False on this machine: use device=cpu")
        where = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(where)
        model.place(where)
    return model.use_kernels(select_kernels(where, device.kernels))
