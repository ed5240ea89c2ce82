"""Proto ↔ engine conversion on its own (``rpc/convert.py``): smg's proto3 "unset" values, the constraint oneof, the
KV hints, and the response messages built from engine outputs."""

import pytest
from smg_grpc_proto import vllm_engine_pb2 as pb

from engine.api import Constraint, RequestOutput
from rpc.convert import (
    InvalidRequest,
    Limits,
    chunk,
    complete,
    constraint_of,
    generate_request,
    int32_of_uint32,
    kv_hints,
    uint32_of_int32,
)

LIMITS = Limits(vocab_size=100, max_model_len=64)


def request(ids=(1, 2, 3), **sampling) -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id="r", tokenized=pb.TokenizedInput(input_ids=list(ids)),
                              sampling_params=pb.SamplingParams(**sampling))


def test_unset_proto3_fields_mean_what_smg_means():
    prompt, p = generate_request(request(), LIMITS)
    assert prompt == [1, 2, 3]
    assert (p.temperature, p.top_p, p.top_k, p.n, p.repetition_penalty, p.max_tokens, p.seed, p.logprobs) == \
        (1.0, 1.0, 0, 1, 1.0, 61, None, 0)  # max_tokens: the room left in max_model_len
    _, p = generate_request(request(temperature=0.0, top_k=uint32_of_int32(-1), max_tokens=5, seed=9, n=2), LIMITS)
    assert (p.temperature, p.top_k, p.max_tokens, p.seed, p.n) == (0.0, -1, 5, 9, 2)
    assert int32_of_uint32(2**32 - 2) == -2 and uint32_of_int32(-2) == 2**32 - 2
    prompt, _ = generate_request(request(ids=range(10), truncate_prompt_tokens=4), LIMITS)
    assert prompt == [6, 7, 8, 9]


def test_bad_requests_are_named():
    with pytest.raises(InvalidRequest, match="stop_token_ids must be < vocab_size 100"):
        generate_request(request(stop_token_ids=[100]), LIMITS)
    with pytest.raises(InvalidRequest, match="logit_bias token ids"):
        generate_request(request(logit_bias={200: 1.0}), LIMITS)
    with pytest.raises(InvalidRequest, match="leaves no room for max_tokens"):
        generate_request(request(ids=range(64)), LIMITS)
    with pytest.raises(InvalidRequest, match="text input is not supported"):
        generate_request(pb.GenerateRequest(request_id="r", text="hi"), LIMITS)
    with pytest.raises(InvalidRequest, match="sampling_params.regex is empty"):
        constraint_of(pb.SamplingParams(regex="  "))


def test_the_constraint_oneof():
    assert constraint_of(pb.SamplingParams()) is None
    assert constraint_of(pb.SamplingParams(json_object=True)) == Constraint("json_object")
    assert constraint_of(pb.SamplingParams(choice=pb.ChoiceConstraint(choices=["a", "b"]))) == \
        Constraint("choice", '["a", "b"]')
    assert constraint_of(pb.SamplingParams(regex="[ab]+")) == Constraint("regex", "[ab]+")


def test_kv_hints():
    assert kv_hints(request()) == (None, False, None)
    req = request()
    req.data_parallel_rank, req.kv_transfer_params_json = 3, '{"retain_kv": true}'
    assert kv_hints(req) == (3, True, None)
    req.kv_transfer_params_json = '{"switchyard_hand_off": 1, "lease": "r#1"}'
    assert kv_hints(req) == (3, False, {"switchyard_hand_off": 1, "lease": "r#1"})
    req.kv_transfer_params_json = '{"remote_host": "x"}'
    with pytest.raises(InvalidRequest, match="a Switchyard prefill worker's hand-off, got"):
        kv_hints(req)


def test_chunks_and_the_final_message():
    outs = [RequestOutput(request_id="r", new_tokens=[5], finished=False, finish_reason=None, num_prompt_tokens=3,
                          num_output_tokens=1, new_logprobs=[-0.5], new_top_logprobs=[[(5, -0.5)]],
                          num_cached_tokens=2),
            RequestOutput(request_id="r", new_tokens=[6, 7], finished=True, finish_reason="stop", num_prompt_tokens=3,
                          num_output_tokens=3, new_logprobs=[-1.0, -2.0], new_top_logprobs=[[], []], stop_reason="END",
                          num_cached_tokens=2)]
    msg = chunk(outs, want_logprobs=True).chunk
    assert (list(msg.token_ids), msg.completion_tokens, msg.cached_tokens, msg.prompt_tokens) == ([5, 6, 7], 3, 2, 3)
    assert list(msg.output_logprobs.token_logprobs) == [-0.5, -1.0, -2.0]
    done = complete(outs[-1], [5, 6, 7], stream=False, logprobs=msg.output_logprobs).complete
    assert (list(done.output_ids), done.finish_reason, done.matched_stop_str, done.completion_tokens) == \
        ([5, 6, 7], "stop", "END", 3)
    streamed = complete(outs[-1], [5, 6, 7], stream=True, logprobs=None).complete
    assert list(streamed.output_ids) == [] and not streamed.HasField("output_logprobs")
