"""The fields of a request body that become its ``SamplingParams`` and ``CompressionParams``,
and where its prompt is prefilled. Values go through the same checks as the gRPC API
(``SamplingParams``' own), and a failed one is a BadParameter naming the field."""

from __future__ import annotations

from baton.api.requests import PREFILL_ROUTES
from baton.gateway.http.fields import BadParameter, short
from baton.gateway.http.values import (
    boolean,
    integer,
    is_int,
    is_number,
    json_object,
    number,
    strings,
)
from baton.sampling.params import CompressionParams, SamplingParams

# The fields sampling_params reads, in the order a ValueError's message is searched for the one it names.
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "min_tokens",
                   "stop_token_ids", "stop", "presence_penalty", "frequency_penalty",
                   "repetition_penalty", "logit_bias", "allowed_token_ids", "logprobs")


def sampling_params(body: dict, max_tokens: int, defaults: dict | None = None,
              logprobs: int | None = None, prompt_logprobs: int | None = None) -> SamplingParams:
    defaults = defaults or {}
    stop = strings(body, "stop")
    stop_token_ids = token_ids(body, "stop_token_ids") or []
    top_k = integer(body, "top_k", defaults.get("top_k", 0), minimum=-1)
    try:
        return SamplingParams(temperature=number(body, "temperature", defaults.get("temperature", 1.0)),
                              top_p=number(body, "top_p", defaults.get("top_p", 1.0)),
                              top_k=max(top_k, 0), min_p=number(body, "min_p", defaults.get("min_p", 0.0)),
                              seed=integer(body, "seed", None), max_tokens=max_tokens,
                              min_tokens=integer(body, "min_tokens", 0, minimum=0, maximum=max_tokens),
                              stop=stop, stop_token_ids=stop_token_ids,
                              include_stop_str_in_output=boolean(body, "include_stop_str_in_output", False),
                              ignore_eos=boolean(body, "ignore_eos", False),
                              presence_penalty=number(body, "presence_penalty", 0.0),
                              frequency_penalty=number(body, "frequency_penalty", 0.0),
                              repetition_penalty=number(body, "repetition_penalty",
                                                         defaults.get("repetition_penalty", 1.0)),
                              logit_bias=logit_bias(body),
                              allowed_token_ids=token_ids(body, "allowed_token_ids"),
                              logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                              skip_special_tokens=boolean(body, "skip_special_tokens", True),
                              priority=integer(body, "priority", 0, minimum=-2**31, maximum=2**31 - 1))
    except BadParameter:
        raise
    except ValueError as e:  # the shared checks name the value; find the field they mean
        names = [name for name in SAMPLING_FIELDS if name in str(e)]
        raise BadParameter(names[0] if names else "", str(e)) from None


def token_ids(body: dict, name: str) -> list[int] | None:
    value = body.get(name)
    if value is None:
        return None
    if not (isinstance(value, list) and all(is_int(t) and t >= 0 for t in value)):
        raise BadParameter(name, f"{name} must be a list of token ids (integers >= 0), got "
                                 f"{short(value)}")
    return value


def logit_bias(body: dict) -> dict[int, float]:
    """OpenAI's ``logit_bias``: token ids (as JSON object keys, so strings) to biases."""
    value = body.get("logit_bias") or {}
    if not isinstance(value, dict):
        raise BadParameter("logit_bias", f"logit_bias must be an object, got {short(value)}")
    bias = {}
    for key, amount in value.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise BadParameter("logit_bias", f"logit_bias keys must be token ids, got {key!r}") from None
        if not is_number(amount):
            raise BadParameter("logit_bias", f"logit_bias[{key!r}] must be a number, got {short(amount)}")
        bias[token] = float(amount)
    return bias


def compression_params(body: dict) -> CompressionParams:
    compression = body.get("compression")
    if compression is None:
        return CompressionParams()
    compression = json_object(compression, "compression")
    enabled = compression.get("enabled")
    if enabled is not None and not isinstance(enabled, bool):
        raise BadParameter("compression", f"compression.enabled must be true or false, got {enabled!r}")
    keep_ratio = compression.get("keep_ratio")
    if keep_ratio is not None and not is_number(keep_ratio):
        raise BadParameter("compression", f"compression.keep_ratio must be a number, got {keep_ratio!r}")
    try:
        return CompressionParams(enabled=enabled, keep_ratio=keep_ratio)
    except ValueError as e:
        raise BadParameter("compression", str(e)) from None


def prefill_route(body: dict) -> str:
    route = body.get("prefill_route") or "auto"
    if route not in PREFILL_ROUTES:
        raise BadParameter("prefill_route", f"prefill_route {route!r} is not one of {PREFILL_ROUTES}")
    return route
