"""Checkpoint files checked before any weight is read, each failure one line naming the file (and tensor).

``check_checkpoint_files(dir)`` reads only ``model.safetensors.index.json`` and each shard's
header (8-byte length + JSON; the format is in safetensors' README), so it runs in the launching process in
milliseconds, before a rank starts. ``open_shard`` is ``safe_open`` with the library's bare errors
(``SafetensorError: incomplete metadata``, ``header too large``) turned into a :class:`CheckpointError` naming
the file.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from safetensors import SafetensorError, safe_open

MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit
DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2,
               "U16": 2, "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1}


class ConfigError(ValueError):
    """A model config we cannot serve; the message names the field and the file."""


class CheckpointError(ValueError):
    """A checkpoint that does not match the model or is not readable; the message names the tensor and the file."""


def read_json(file: str | Path, error: type[ValueError] = CheckpointError) -> dict:
    """``file`` parsed as a JSON object; invalid JSON raises ``error`` naming the file, line and column."""
    file = Path(file)
    try:
        raw = json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise error(f"{file}: not valid JSON: {err.msg} at line {err.lineno} column {err.colno}") from None
    except UnicodeDecodeError:
        raise error(f"{file}: not valid JSON: not UTF-8 text") from None
    if not isinstance(raw, dict):
        raise error(f"{file}: expected a JSON object, got {type(raw).__name__}")
    return raw


def shard_header(file: str | Path) -> dict[str, dict]:
    """Tensor name → ``{"dtype", "shape", "data_offsets"}`` of a safetensors file, validated against its size."""
    file = Path(file)
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{file}: truncated or not a safetensors file ({size} bytes, no header)")
        (n,) = struct.unpack("<Q", head)
        if n > min(MAX_HEADER_BYTES, size - 8):
            raise CheckpointError(f"{file}: corrupt or not a safetensors file (header length {n} bytes, "
                                  f"file {size} bytes)")
        text = f.read(n)
    try:
        header = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise CheckpointError(f"{file}: corrupt or not a safetensors file (header is not JSON)") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{file}: corrupt safetensors header (not a JSON object)")
    header.pop("__metadata__", None)
    data = size - 8 - n
    for name, t in header.items():
        try:
            begin, end = (int(x) for x in t["data_offsets"])
            dtype, shape = t["dtype"], [int(d) for d in t["shape"]]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{file}: tensor {name!r}: corrupt header entry {t!r}") from None
        if end > data:
            raise CheckpointError(f"{file}: truncated: tensor {name!r} ends at data byte {end}, the file holds "
                                  f"{data} data bytes ({size} bytes in all)")
        if dtype in DTYPE_BYTES and end - begin != math.prod(shape) * DTYPE_BYTES[dtype]:
            raise CheckpointError(f"{file}: tensor {name!r}: {end - begin} bytes for {dtype} {shape}")
    return header


def check_checkpoint_files(ckpt_dir: str | Path) -> dict[str, str]:
    """Checks the index (if any) and every shard's header; returns tensor name → file name. Raises
    :class:`CheckpointError` on the first problem."""
    ckpt_dir = Path(ckpt_dir)
    index = ckpt_dir / "model.safetensors.index.json"
    if index.exists():
        wmap = read_json(index).get("weight_map")
        if not isinstance(wmap, dict) or not wmap:
            raise CheckpointError(f"{index}: no \"weight_map\" object")
        files = sorted(set(wmap.values()))
        missing = [f for f in files if not (ckpt_dir / f).is_file()]
        if missing:
            raise CheckpointError(f"{index}: names shard(s) missing from {ckpt_dir}: {missing[:5]}")
    else:
        files = sorted(p.name for p in ckpt_dir.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"no *.safetensors files in {ckpt_dir}")
    names: dict[str, str] = {}
    for file in files:
        names.update(dict.fromkeys(shard_header(ckpt_dir / file), file))
    if index.exists():
        absent = [(t, f) for t, f in wmap.items() if names.get(t) != f]
        if absent:
            t, f = absent[0]
            raise CheckpointError(f"{index}: tensor {t!r} is mapped to {f}, which does not hold it "
                                  f"({len(absent)} such)")
    return names


@contextmanager
def open_shard(path: str | Path) -> Iterator:
    """``safe_open(path, "pt")``; a corrupt or truncated file raises :class:`CheckpointError` naming it."""
    try:
        handle = safe_open(str(path), "pt")
    except SafetensorError as err:
        raise CheckpointError(f"{path}: not a readable safetensors file ({err})") from None
    with handle as f:
        yield f
