"""Domain objects survive a trip through their protobuf messages (and the wire bytes)."""

from __future__ import annotations

import math

import grpc
import pytest
from baton.api import convert
from baton.api.requests import (
    CompressionParams,
    DecodeRequest,
    FinishReason,
    GenerateRequest,
    GenerationStep,
    ModelInfo,
    PrefillRequest,
    PrefillStarted,
    Route,
    SamplingParams,
    Timings,
    Tokenization,
    Usage,
)
from baton.api.v1 import api_pb2, common_pb2
from baton.kv.pool import KVPoolExhausted
from baton.routing.store import StoreUnavailable, WorkerLoad
from baton.sampling.limits import check_prompt
from baton.transfer.codec import KVDataLoss, KVIncompatible, KVMalformed

SAMPLING = SamplingParams(temperature=0.7, top_k=40, top_p=0.9, seed=1234, max_tokens=17,
                          stop_token_ids=[2, 7], stop=["\n\n", "END"])
COMPRESSION = CompressionParams(enabled=True, keep_ratio=0.45)


def through_the_wire(message):
    """Serialize and parse, as a real peer would see it."""
    return type(message).FromString(message.SerializeToString())


@pytest.mark.parametrize("to_proto, from_proto, value", [
    (convert.sampling_to_proto, convert.sampling_from_proto, SAMPLING),
    (convert.sampling_to_proto, convert.sampling_from_proto, SamplingParams()),
    (convert.compression_to_proto, convert.compression_from_proto, COMPRESSION),
    (convert.compression_to_proto, convert.compression_from_proto, CompressionParams()),
    (convert.compression_to_proto, convert.compression_from_proto, CompressionParams(enabled=False)),
    (convert.generate_request_to_proto, convert.generate_request_from_proto,
     GenerateRequest(request_id="r1", model="m", text="def f(x):", sampling=SAMPLING,
                     compression=COMPRESSION)),
    (convert.generate_request_to_proto, convert.generate_request_from_proto,
     GenerateRequest(token_ids=(5, 6, 7))),
    (convert.prefill_request_to_proto, convert.prefill_request_from_proto,
     PrefillRequest("r2", "m", (1, 2, 3), SAMPLING, COMPRESSION, "10.0.0.7:5000")),
    (convert.decode_request_to_proto, convert.decode_request_from_proto,
     DecodeRequest("r3", (9, 8), SAMPLING, CompressionParams())),
    (convert.step_to_proto, convert.step_from_proto, GenerationStep("r4", (11,), "x")),
    (convert.step_to_proto, convert.step_from_proto,
     GenerationStep("r4", (12, 13), " y", FinishReason.LENGTH, Usage(5, 17, 300, 600, 4096),
                    Timings(0.01, 0.2, 0.15, 0.03, 0.02, 1.5), Route("d:1", "chain-0", (0, 40, 70)))),
    (convert.prefill_started_to_proto, convert.prefill_started_from_proto,
     PrefillStarted("r5", (0, 600, 1024), 0.12)),
    (convert.worker_load_to_proto, convert.worker_load_from_proto, WorkerLoad(10, 64, 3, 2, 900)),
    (convert.model_info_to_proto, convert.model_info_from_proto,
     ModelInfo("baton-pystdlib", "v1", 4096, 2048, 6)),
    (convert.tokenization_to_proto, convert.tokenization_from_proto,
     Tokenization((1, 2), ("de", "f"))),
])
def test_round_trip(to_proto, from_proto, value):
    assert from_proto(through_the_wire(to_proto(value))) == value


def test_models_round_trip():
    models = [ModelInfo("a", "1", 10, 20, 2), ModelInfo("b", "2", 30, 40, 4)]
    assert convert.models_from_proto(through_the_wire(convert.models_to_proto(models))) == models


def test_unset_sampling_fields_take_the_defaults():
    assert convert.sampling_from_proto(common_pb2.SamplingParams()) == SamplingParams()
    explicit_greedy = convert.sampling_from_proto(common_pb2.SamplingParams(temperature=0.0))
    assert explicit_greedy.greedy and explicit_greedy.temperature == 0.0


@pytest.mark.parametrize("fields, named", [
    ({"temperature": -0.5}, "-0.5"), ({"temperature": math.nan}, "nan"), ({"top_p": 0.0}, "0.0"),
    ({"top_p": 1.5}, "1.5"), ({"max_tokens": 0}, "max_tokens must be >= 1, got 0"),
    ({"max_tokens": -3}, "-3"), ({"top_k": -1}, "-1"),
])
def test_bad_sampling_raises_naming_the_value(fields, named):
    with pytest.raises(ValueError, match="must") as error:
        convert.sampling_from_proto(common_pb2.SamplingParams(**fields))
    assert named in str(error.value)
    assert convert.status_for(error.value) == grpc.StatusCode.INVALID_ARGUMENT


def test_a_prompt_is_required():
    with pytest.raises(ValueError, match="prompt"):
        convert.generate_request_from_proto(api_pb2.GenerateRequest(request_id="r"))
    with pytest.raises(ValueError, match="empty"):
        convert.generate_request_from_proto(api_pb2.GenerateRequest(text=""))


def test_check_prompt_names_the_numbers():
    with pytest.raises(ValueError, match=r"\[99\] are outside the vocabulary 0..49"):
        check_prompt((1, 99), SamplingParams(), vocab_size=50, max_model_len=100)
    with pytest.raises(ValueError, match="3 tokens \\+ max_tokens 98 = 101 exceeds .* 100"):
        check_prompt((1, 2, 3), SamplingParams(max_tokens=98), vocab_size=50, max_model_len=100)
    with pytest.raises(ValueError, match="empty"):
        check_prompt((), SamplingParams(), vocab_size=50, max_model_len=100)
    check_prompt((1, 2, 3), SamplingParams(max_tokens=97), vocab_size=50, max_model_len=100)


@pytest.mark.parametrize("error, code", [
    (KVDataLoss("x"), grpc.StatusCode.DATA_LOSS),
    (KVIncompatible("x"), grpc.StatusCode.FAILED_PRECONDITION),
    (KVMalformed("x"), grpc.StatusCode.INVALID_ARGUMENT),
    (KVPoolExhausted(5, 1), grpc.StatusCode.RESOURCE_EXHAUSTED),
    (StoreUnavailable("x"), grpc.StatusCode.UNAVAILABLE),
    (ValueError("x"), grpc.StatusCode.INVALID_ARGUMENT),
    (RuntimeError("x"), grpc.StatusCode.INTERNAL),
])
def test_status_for(error, code):
    assert convert.status_for(error) == code
