"""Hydra's values checked against the typed dataclasses they become, before any rank starts.

OmegaConf turns ``true``/``12``/``0.5`` into Python values and leaves anything else a string, so
``engine.prefix_caching=flase`` would reach a ``bool`` field as the (truthy) string ``"flase"``. :func:`typed` checks
each key of a group against its dataclass field's annotation — ``bool``, ``int``, ``float``, ``str``, each optionally
``None`` — and raises :class:`SettingError` in one line naming the key and the value. Cross-group rules live in
:func:`check_across_groups`.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping

SCALARS = (bool, int, float, str)


class SettingError(ValueError):
    """A setting that does not parse or does not fit the others; the message names the key and the value."""


def _expected(annotation) -> tuple[tuple[type, ...], bool] | None:
    """``(scalar types, None allowed)`` of a field annotation; None for anything this check does not cover."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        scalars = tuple(a for a in args if a in SCALARS)
        if len(scalars) != len(args) - (type(None) in args):
            return None
        return scalars, type(None) in args
    return ((annotation,), False) if annotation in SCALARS else None


def _fits(value, kinds: tuple[type, ...]) -> bool:
    if isinstance(value, bool):
        return bool in kinds
    if isinstance(value, int):
        return int in kinds or float in kinds
    return any(isinstance(value, k) for k in kinds if k is not bool)


def field_types(*classes: type) -> dict[str, tuple[tuple[type, ...], bool]]:
    """Field name → its checkable type over ``classes`` (dataclasses)."""
    out = {}
    for cls in classes:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            expected = _expected(hints[f.name])
            if expected is not None:
                out[f.name] = expected
    return out


def typed(values: Mapping, group: str, *classes: type, rename=lambda key: key) -> dict:
    """``values`` (one hydra group's keys) checked against the fields of ``classes`` (``rename(key)``: the field a key
    fills); ints given for float fields become floats. Raises :class:`SettingError` naming ``group.key`` and the
    value."""
    types_ = field_types(*classes)
    out = dict(values)
    for key, value in values.items():
        expected = types_.get(rename(key))
        if expected is None or (value is None and expected[1]):
            continue
        kinds, optional = expected
        if not _fits(value, kinds):
            names = " or ".join("bool (true or false)" if k is bool else k.__name__ for k in kinds)
            raise SettingError(f"{group}.{key}={value!r} is not {'an' if names[0] in 'aeiou' else 'a'} {names}"
                               + (" (or null)" if optional else ""))
        if float in kinds and int not in kinds and isinstance(value, int):
            out[key] = float(value)
    return out


def check_across_groups(layout, device, *, batch_invariant: bool, block_size: int | None, eplb_enabled: bool) -> None:
    """The rules that join two groups, in one place: a KV block size the device's kernels can page (the Triton
    kernels: powers of two), batch invariance not over DeepEP (its kernels combine in their own order), and expert
    rebalancing only where experts are spread over ranks. ``layout``: the ``parallel`` group's
    ``parallelism.layout.Layout``; ``device``: ``model.loader.DeviceConfig``."""
    if batch_invariant and layout.resolved_dispatcher == "deepep":
        raise SettingError("engine.batch_invariant=true with parallel.dispatcher=deepep: DeepEP's kernels combine a "
                           "token's expert outputs in their own order, so rows would not be batch-invariant; use "
                           "parallel.dispatcher=alltoall (ordered under the flag) or turn the flag off")
    if device.type == "cuda" and device.kernels != "torch" and block_size and block_size & (block_size - 1):
        raise SettingError(f"engine.block_size={block_size}: the Triton paged-attention kernels (device=cuda) need a "
                           "power of two (16, 32, 64, ...)")
    if eplb_enabled and layout.moe_ep < 2:
        raise SettingError(f"eplb.enabled=true with parallel.moe_ep={layout.moe_ep}: the expert balancer moves experts "
                           "between expert-parallel ranks, and this layout has one; use a layout with moe_ep > 1 or "
                           "leave eplb.enabled=false")
