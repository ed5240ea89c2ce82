"""``vllm.grpc.engine`` messages ↔ engine types: request validation and response building (pure functions).

Proto3 scalars have no presence, so several "unset" values are mapped as the SMG gateway means them:
``top_p == 0`` → 1.0, ``n == 0`` → 1, ``repetition_penalty == 0`` → off (1.0), ``max_tokens`` unset → the room left
in ``max_model_len``, ``temperature`` unset → 1.0. The ``constraint`` oneof becomes an
:class:`engine.params.Constraint` (``choice``'s list as a JSON list); whether it compiles is the servicer's check
(``engine/sampling/grammar.py``), before anything is admitted. ``logit_bias`` is honoured (smg never sends it; a direct
gRPC client may). ``top_k`` is ``uint32`` on the wire: its bit pattern is read as
int32, so a client's -1 (sent as 2**32-1) means "off" like 0, and -2 or lower is rejected naming ``top_k``.
Range checks on the sampling fields are :class:`engine.params.SamplingParams`' own; prompt checks (empty, ids
out of range, too long) are the scheduler's. Both name the field, and the servicer maps them to
INVALID_ARGUMENT.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from smg_grpc_proto import vllm_engine_pb2 as pb

from engine.api import Constraint, RequestOutput, SamplingParams


class InvalidRequest(ValueError):
    """A GenerateRequest we cannot serve; the message names the field."""


@dataclass(frozen=True)
class Limits:
    vocab_size: int
    max_model_len: int


def int32_of_uint32(value: int) -> int:
    """The int32 a uint32 wire value was cast from (2**32-1 → -1)."""
    return value - (1 << 32) if value >= 1 << 31 else value


def uint32_of_int32(value: int) -> int:
    """Inverse of :func:`int32_of_uint32`, for clients that send a negative top_k."""
    return value + (1 << 32) if value < 0 else value


def _reject_unsupported(req: pb.GenerateRequest) -> None:
    sp = req.sampling_params
    if req.WhichOneof("input") == "text":
        raise InvalidRequest("text input is not supported: send tokenized.input_ids")
    if req.HasField("mm_inputs") or req.HasField("media_refs") or len(req.extra_mm_inputs):
        raise InvalidRequest("mm_inputs/media_refs: multimodal input is not supported by this text-only model")
    if sp.HasField("prompt_logprobs"):
        raise InvalidRequest("prompt_logprobs is not supported")


def constraint_of(sp: pb.SamplingParams) -> Constraint | None:
    """The request's structured-output constraint (None: unconstrained)."""
    kind = sp.WhichOneof("constraint")
    if kind is None:
        return None
    if kind == "json_object":
        return Constraint("json_object") if sp.json_object else None
    if kind == "choice":
        return Constraint("choice", json.dumps(list(sp.choice.choices)))
    text = getattr(sp, kind)
    if not text.strip():
        raise InvalidRequest(f"sampling_params.{kind} is empty")
    return Constraint(kind, text)


def generate_request(req: pb.GenerateRequest, limits: Limits) -> tuple[list[int], SamplingParams]:
    """Prompt ids and engine SamplingParams of a GenerateRequest; raises InvalidRequest or SamplingError (both
    ValueError subclasses naming the field)."""
    _reject_unsupported(req)
    sp = req.sampling_params
    prompt = list(req.tokenized.input_ids)
    if sp.HasField("truncate_prompt_tokens") and sp.truncate_prompt_tokens > 0:
        prompt = prompt[-sp.truncate_prompt_tokens:]
    if sp.HasField("max_tokens"):
        max_tokens = sp.max_tokens
    else:
        max_tokens = limits.max_model_len - len(prompt)
        if prompt and max_tokens < 1:
            raise InvalidRequest(f"prompt length {len(prompt)} leaves no room for max_tokens within "
                                 f"max_model_len {limits.max_model_len}")
    bad_stop = [t for t in sp.stop_token_ids if t >= limits.vocab_size]
    if bad_stop:
        raise InvalidRequest(f"stop_token_ids must be < vocab_size {limits.vocab_size}, got {bad_stop[:5]}")
    bad_bias = [t for t in sp.logit_bias if not 0 <= t < limits.vocab_size]
    if bad_bias:
        raise InvalidRequest(f"logit_bias token ids must be in [0, {limits.vocab_size}), got {bad_bias[:5]}")
    return prompt, SamplingParams(
        temperature=sp.temperature if sp.HasField("temperature") else 1.0,
        top_k=int32_of_uint32(sp.top_k),
        top_p=sp.top_p if sp.top_p != 0 else 1.0,
        min_p=sp.min_p,
        seed=sp.seed if sp.HasField("seed") else None,
        max_tokens=max_tokens,
        min_tokens=sp.min_tokens,
        stop_token_ids=tuple(sp.stop_token_ids),
        ignore_eos=sp.ignore_eos,
        logprobs=sp.logprobs if sp.HasField("logprobs") else 0,
        stop=tuple(sp.stop),
        include_stop_str_in_output=sp.include_stop_str_in_output,
        skip_special_tokens=sp.skip_special_tokens,
        presence_penalty=sp.presence_penalty,
        frequency_penalty=sp.frequency_penalty,
        repetition_penalty=sp.repetition_penalty if sp.repetition_penalty != 0 else 1.0,
        logit_bias=tuple(sorted(sp.logit_bias.items())),
        constraint=constraint_of(sp),
        n=sp.n or 1,
    )


HAND_OFF_KEY = "switchyard_hand_off"  # marks a prefill worker's hand-off (rpc/hand_off.py)


def kv_hints(req: pb.GenerateRequest) -> tuple[int | None, bool, dict | None]:
    """``(data_parallel_rank or None, retain_kv, hand-off or None)``. ``kv_transfer_params_json`` carries one of two
    things: Switchyard's hint ``{"retain_kv": true}`` (keep this request's blocks past plain LRU when it ends, for
    ``engine.kv_retention_s``: an agent about to come back after a tool call), or a prefill worker's hand-off (an
    object with ``"switchyard_hand_off"``, which smg relays to the decode leg; a decode leg never carries both)."""
    retain, hand_off = False, None
    if req.HasField("kv_transfer_params_json") and req.kv_transfer_params_json.strip():
        try:
            params = json.loads(req.kv_transfer_params_json)
        except json.JSONDecodeError as err:
            raise InvalidRequest(f"kv_transfer_params_json: not JSON ({err})") from None
        if isinstance(params, dict) and HAND_OFF_KEY in params:
            hand_off = params
        elif not isinstance(params, dict) or set(params) - {"retain_kv"}:
            raise InvalidRequest(f"kv_transfer_params_json: {{\"retain_kv\": bool}} or a Switchyard prefill worker's "
                                 f"hand-off, got {req.kv_transfer_params_json[:200]!r}")
        else:
            retain = bool(params.get("retain_kv", False))
    return (req.data_parallel_rank if req.HasField("data_parallel_rank") else None), retain, hand_off


def output_logprobs(logprobs: list[float], tokens: list[int], top: list[list[tuple[int, float]]]) -> pb.OutputLogProbs:
    return pb.OutputLogProbs(
        token_logprobs=logprobs, token_ids=tokens,
        top_logprobs=[pb.TopLogProbs(values=[lp for _, lp in t], token_ids=[i for i, _ in t]) for t in top],
    )


def chunk(outs: list[RequestOutput], want_logprobs: bool) -> pb.GenerateResponse:
    """One stream chunk carrying the new tokens of ``outs`` (consecutive outputs of one request)."""
    tokens = [t for o in outs for t in o.new_tokens]
    msg = pb.GenerateStreamChunk(token_ids=tokens, prompt_tokens=outs[-1].num_prompt_tokens,
                                 completion_tokens=len(tokens), cached_tokens=outs[-1].num_cached_tokens,
                                 index=outs[-1].index)
    if want_logprobs:
        msg.output_logprobs.CopyFrom(output_logprobs([lp for o in outs for lp in o.new_logprobs], tokens,
                                                     [t for o in outs for t in o.new_top_logprobs]))
    return pb.GenerateResponse(chunk=msg)


def complete(last: RequestOutput, all_tokens: list[int], stream: bool,
             logprobs: pb.OutputLogProbs | None, kv_transfer_params_json: str | None = None) -> pb.GenerateResponse:
    """The final message: finish reason and usage; all ids (and logprobs) unless the tokens were streamed; a prefill
    worker's hand-off (``kv_transfer_params_json``)."""
    msg = pb.GenerateComplete(output_ids=[] if stream else all_tokens, finish_reason=last.finish_reason or "abort",
                              prompt_tokens=last.num_prompt_tokens, completion_tokens=len(all_tokens),
                              cached_tokens=last.num_cached_tokens, index=last.index)
    if kv_transfer_params_json is not None:
        msg.kv_transfer_params_json = kv_transfer_params_json
    if last.finish_reason == "stop" and isinstance(last.stop_reason, str):
        msg.matched_stop_str = last.stop_reason
    elif last.finish_reason == "stop" and all_tokens:
        msg.matched_token_id = all_tokens[-1]
    if logprobs is not None and not stream:
        msg.output_logprobs.CopyFrom(logprobs)
    return pb.GenerateResponse(complete=msg)
