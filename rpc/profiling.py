"""``StartProfile`` / ``StopProfile``: ``torch.profiler`` on every rank (``engine/profiling.py``), one Chrome trace per
rank, written under ``server.profile_dir`` only — smg forwards these RPCs without authentication, so a requested
``output_dir`` outside it is INVALID_ARGUMENT, and with ``server.profile_dir`` null profiling is off
(FAILED_PRECONDITION). One log line per call."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import grpc
from smg_grpc_proto.generated import common_pb2

from engine.api import EngineDead, ProfileError, ProfilePlan, trace_path

log = logging.getLogger("rpc.requests")


def confine(root: str, requested: str) -> Path:
    """``requested`` (relative to ``root``, or absolute) resolved, symlinks followed, and created; ValueError naming
    ``output_dir`` when it is not ``root`` or under it."""
    base = Path(root).resolve()
    target = (base / requested).resolve()
    if target != base and base not in target.parents:
        raise ValueError(f"output_dir {requested!r} is outside server.profile_dir ({base})")
    target.mkdir(parents=True, exist_ok=True)
    if target.resolve() != target:  # a symlink raced in while it was created
        raise ValueError(f"output_dir {requested!r} changed while it was created")
    return target


def _optional(request, name: str):
    return getattr(request, name) if request.HasField(name) else None


class ProfileRPCs:
    """Mixed into the servicer (which holds ``engine``: the AsyncEngine, ``profile_dir`` and ``ranks``)."""

    async def _profile_call(self, rpc: str, call, context):
        try:
            return await call
        except EngineDead as err:
            log.info("%s: UNAVAILABLE (engine is dead: %s)", rpc, err)
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"engine is dead: {err}")

    async def StartProfile(self, request: common_pb2.StartProfileRequest, context) -> common_pb2.ProfileResponse:
        if self.profile_dir is None:
            why = "profiling is off: server.profile_dir is null; set it to the directory traces may be written under"
            log.info("StartProfile: FAILED_PRECONDITION (%s)", why)
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, why)
        try:
            trace_dir = confine(self.profile_dir, request.output_dir if request.HasField("output_dir") else "")
            plan = ProfilePlan(trace_dir=str(trace_dir), stamp=time.strftime("profile-%Y%m%d-%H%M%S"),
                               start_step=_optional(request, "start_step"), num_steps=_optional(request, "num_steps"),
                               activities=tuple(request.activities), record_shapes=request.record_shapes,
                               with_stack=request.with_stack)
        except ValueError as err:
            log.info("StartProfile: INVALID_ARGUMENT (%s)", err)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        except OSError as err:
            log.info("StartProfile: FAILED_PRECONDITION (%s)", err)
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"output_dir: {err}")
        try:
            await self._profile_call("StartProfile", self.engine.profile(plan), context)
        except ProfileError as err:
            log.info("StartProfile: not started (%s)", err)
            return common_pb2.ProfileResponse(success=False, message=str(err))
        files = [trace_path(plan, r["rank"]) for r in sorted(self.ranks, key=lambda r: r["rank"])]
        steps = f"{plan.num_steps} steps" if plan.num_steps is not None else "until StopProfile"
        start = f"from step {plan.start_step}" if plan.start_step is not None else "from the next step"
        log.info("StartProfile: OK (%s, %s, into %s)", start, steps, trace_dir)
        return common_pb2.ProfileResponse(success=True, message=f"profiling every rank {start}, {steps}; one trace "
                                                                f"per rank: {', '.join(files)}")

    async def StopProfile(self, request: common_pb2.StopProfileRequest, context) -> common_pb2.ProfileResponse:
        try:
            files = await self._profile_call("StopProfile", self.engine.profile(None), context)
        except ProfileError as err:
            log.info("StopProfile: nothing stopped (%s)", err)
            return common_pb2.ProfileResponse(success=False, message=str(err))
        what = f"wrote {len(files)} traces: {', '.join(files)}" if files else "cancelled before its first step"
        log.info("StopProfile: OK (%s)", what)
        return common_pb2.ProfileResponse(success=True, message=what)
