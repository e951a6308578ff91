"""Driving an engine to the end of a batch of prompts, for callers that own it (the CLI,
tests, benchmarks): ``Engine.generate``. A served engine is driven by its pod's loop thread
instead."""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf

from baton.sampling.params import SamplingParams
from baton.sarathi.request import GenerationResult


def generate_all(engine, prompts: SequenceOf, params: SamplingParams | SequenceOf[SamplingParams] | None
                 ) -> list[GenerationResult]:
    """Every prompt (text or token ids) generated, batched continuously; results in prompt
    order. ``params``: one for all, or one per prompt."""
    per_prompt = _params_per_prompt(prompts, params)
    prompt_ids = {}
    for prompt, sampling_params in zip(prompts, per_prompt):
        ids = engine.prompt_ids(prompt)
        prompt_ids[engine.add_request(ids, sampling_params)] = ids
    order = list(prompt_ids)
    token_ids: dict[str, list[int]] = {rid: [] for rid in order}
    texts: dict[str, list[str]] = {rid: [] for rid in order}
    reasons: dict[str, str] = {}
    while len(reasons) < len(order):
        for output in engine.step():
            if output.request_id in token_ids:
                token_ids[output.request_id] += output.new_token_ids
                texts[output.request_id].append(output.text_delta)
                if output.finished:
                    reasons[output.request_id] = output.finish_reason
    return [GenerationResult(rid, prompt_ids[rid], token_ids[rid], "".join(texts[rid]), reasons[rid])
            for rid in order]


def _params_per_prompt(prompts, params) -> list[SamplingParams]:
    if params is None or isinstance(params, SamplingParams):
        return [params or SamplingParams()] * len(prompts)
    if len(params) != len(prompts):
        raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
    return list(params)
