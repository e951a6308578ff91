"""The generations one OpenAI request asks for: a prompt (rendered, tokenized, cut to
``truncate_prompt_tokens``) times ``best_of``, each a ``GenerateRequest`` of its own.

Choice ``j`` of prompt ``i`` is choice index ``i * n + j`` in the answer (vLLM's order). With
a seed, choice ``j`` samples with seed + j: each its own stream, the same on every run. Runs
in the executor: rendering a chat template and tokenizing are not for the event loop.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from baton.api.requests import GenerateRequest
from baton.errors import InvalidArgument
from baton.gateway.http.chat_template import ChatTemplate
from baton.gateway.http.fields import BadParameter
from baton.gateway.http.protocol import Completion
from baton.gateway.served_model import ServedModel
from baton.sampling.grammar import GrammarError


@dataclass(frozen=True)
class PlannedGeneration:
    index: int  # of its choice, before best_of picks the n returned
    prompt_index: int
    request: GenerateRequest
    prompt_ids: tuple[int, ...]
    prompt_text: str = ""  # what an echo shows of the prompt; a chat's rendered conversation


def plan_generations(completion: Completion, request_id: str, model: ServedModel,
                     chat_template: ChatTemplate | None) -> list[PlannedGeneration]:
    if completion.chat:
        rendered = _render_chat(completion, chat_template)
        prompts = [model.encode_text(rendered, completion.add_special_tokens)]
        texts: list[str | None] = [rendered]  # what reasoning is read against
    else:
        prompts = [model.encode_text(prompt, completion.add_special_tokens)
                   if isinstance(prompt, str) else prompt for prompt in completion.prompts]
        texts = [prompt if isinstance(prompt, str) else None for prompt in completion.prompts]
    sampling = completion.sampling
    if sampling.structured is not None:  # compiled here once (cached): a bad one is the client's 400
        try:
            model.grammars.compile(sampling.structured)
        except GrammarError as e:
            raise BadParameter(completion.structured_field, f"{completion.structured_field}: {e}") from None
    if completion.bad_words:
        sampling = dataclasses.replace(sampling, bad_words_ids=_bad_words_ids(completion.bad_words, model))
    planned = []
    several = len(prompts) * completion.best_of > 1
    for prompt_index, prompt_ids in enumerate(prompts):
        prompt_text = texts[prompt_index] if prompt_index < len(texts) else None
        if completion.truncate_prompt_tokens is not None:
            prompt_ids = prompt_ids[-completion.truncate_prompt_tokens:]
            prompt_text = prompt_text if completion.chat else None
        if completion.echo and prompt_text is None:
            prompt_text = model.tokenizer.decode(list(prompt_ids))
        prompt_sampling = sampling
        if completion.chat and completion.max_tokens is None:  # up to the model's context
            max_tokens = model.info.max_model_len - len(prompt_ids)
            if max_tokens < 1:
                raise InvalidArgument(f"the conversation is {len(prompt_ids)} tokens, the model's "
                                      f"whole context of {model.info.max_model_len}")
            prompt_sampling = dataclasses.replace(sampling, max_tokens=max_tokens)
        for choice in range(completion.best_of):
            index = prompt_index * completion.best_of + choice
            choice_sampling = prompt_sampling
            if choice and sampling.seed is not None:
                choice_sampling = dataclasses.replace(prompt_sampling, seed=(sampling.seed + choice) % 2**63)
            planned.append(PlannedGeneration(index, prompt_index, GenerateRequest(
                request_id=f"{request_id}-{index}" if several else request_id,
                model=completion.model, token_ids=tuple(prompt_ids), sampling=choice_sampling,
                compression=completion.compression, prefill_route=completion.prefill_route,
                cache_salt=completion.cache_salt), tuple(prompt_ids), prompt_text or ""))
    return planned


def _render_chat(completion: Completion, chat_template: ChatTemplate) -> str:
    """The conversation as the template writes it, with the tools offered (none when the
    request chose "none")."""
    tools = completion.tools
    offered = tools.tools if tools is not None and tools.tool_choice != "none" else None
    return chat_template.render(
        completion.messages, completion.add_generation_prompt and not completion.continue_final_message,
        continue_final_message=completion.continue_final_message,
        template=completion.chat_template, tools=offered, **completion.template_kwargs)


def _bad_words_ids(words: list[str], model: ServedModel) -> list[list[int]]:
    """Each bad word as the model writes it alone and after a space (vLLM's rule)."""
    sequences = []
    for word in words:
        for variant in (word, " " + word.lstrip()):
            ids = list(model.tokenizer.encode(variant))
            if ids and ids not in sequences:
                sequences.append(ids)
    return sequences
