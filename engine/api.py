"""The engine's public API: everything a front (``rpc/``) may use, and nothing else — the async engine and its
typed verbs, request parameters and outputs, the facts, snapshot and step records the engine reports, and the
names of what it measures. ``tests/architecture/test_api_contract.py`` keeps ``rpc/`` to this module."""

from engine.async_engine import AsyncEngine, EngineDead, EngineFailure, Loads, Overloaded, RequestStream
from engine.config import RequestError
from engine.core.kv_manager import NO_PARENT, KvEvent, index_digest, wire_hash
from engine.core.step_record import HOST_PHASES, IDLE_REASONS, LAUNCH_PARTS, RankLoad, StepRecord
from engine.engine import Engine
from engine.kv_transfers import PeerLease
from engine.messages import EngineFacts, EngineSnapshot, FlushResult, HandOffs, KVTier
from engine.params import Constraint, SamplingError, SamplingParams
from engine.profiling import ProfileError, ProfilePlan, trace_path
from engine.reasoning import ReasoningParser
from engine.snapshot import engine_facts
from engine.step import RequestOutput
from engine.worker.kv_peer import PeerKV, PeerShard
from engine.worker.telemetry import THROTTLE_REASONS

__all__ = [
    "HOST_PHASES", "IDLE_REASONS", "LAUNCH_PARTS", "NO_PARENT", "THROTTLE_REASONS",
    "AsyncEngine", "Constraint", "Engine", "EngineDead", "EngineFacts", "EngineFailure", "EngineSnapshot",
    "FlushResult", "HandOffs", "KvEvent", "KVTier", "Loads", "Overloaded", "PeerKV", "PeerLease", "PeerShard",
    "ProfileError", "ProfilePlan", "RankLoad", "ReasoningParser",
    "RequestError", "RequestOutput", "RequestStream", "SamplingError", "SamplingParams", "StepRecord",
    "engine_facts", "index_digest", "trace_path", "wire_hash",
]
