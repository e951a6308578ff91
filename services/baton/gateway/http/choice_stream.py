"""One choice of a streamed answer: its generation's steps turned into OpenAI's chunks.

A chat's choice starts with the assistant role alone and ends with a chunk that carries only
the finish reason; a completion that echoes starts with the prompt (and its log
probabilities). ``max_tokens`` 0 with echo shows the prompt and nothing generated (the one
token the pods generate for it is left out).
"""

from __future__ import annotations

from baton.api.requests import FinishReason, GenerationStep
from baton.gateway.http.answers import FINISH_REASONS, Answer, Choice
from baton.gateway.http.chat_output import ChatOutput
from baton.gateway.http.generation_plan import PlannedGeneration
from baton.gateway.http.protocol import Completion


class ChoiceStream:
    def __init__(self, answer: Answer, completion: Completion, planned: PlannedGeneration,
                 index: int, output: ChatOutput | None = None) -> None:
        self.answer = answer
        self.output = output  # a chat's, unless its text is its content as it comes
        self.completion = completion
        self.planned = planned
        self.index = index
        self.started = False
        self.offset = 0  # characters of text so far (a completion's text_offset)

    def chunks(self, step: GenerationStep) -> list[dict]:
        answer, completion, usage = self.answer, self.completion, self.completion.include_usage
        chunks = []
        if not self.started:
            self.started = True
            if answer.chat:  # the role comes first, alone
                chunks.append(answer.chunk("", None, usage, role=True, index=self.index))
            elif completion.echo:
                chunks.append(self._echo(step))
        token_ids, text, logprobs = step.token_ids, step.text, list(step.logprobs)
        if completion.max_tokens == 0:
            token_ids, text, logprobs = (), "", []
        if self.output is not None and not self.output.plain:
            return chunks + self._read(step, token_ids, text, logprobs)
        # A chat's last chunk carries only the finish reason: content goes before it.
        separate_finish = answer.chat and step.finish_reason is not None
        if token_ids or text or (step.finish_reason and not separate_finish):
            chunks.append(answer.chunk(
                text, None if separate_finish else self._finish(step), usage,
                token_ids=token_ids if completion.return_token_ids else None, index=self.index,
                logprobs=self._logprobs(logprobs) if answer.logprobs else None))
            self.offset += len(text)
        if separate_finish:
            chunks.append(answer.chunk(None, step.finish_reason, usage, index=self.index))
        return chunks

    def _read(self, step: GenerationStep, token_ids, text: str, logprobs: list) -> list[dict]:
        """A chat whose text is read into reasoning and tool calls: its deltas as they come
        out of the reading (a step's token ids and log probabilities on its first chunk)."""
        answer, usage = self.answer, self.completion.include_usage
        deltas = self.output.feed(text)
        if step.finish_reason is not None:
            deltas += self.output.finish()
        if not deltas and (logprobs or (token_ids and self.completion.return_token_ids)):
            deltas = [{}]  # the tokens held back still report their log probabilities
        chunks = []
        for position, delta in enumerate(deltas):
            first = position == 0
            chunks.append(answer.chunk(
                None, None, usage, index=self.index, delta=delta,
                token_ids=token_ids if first and self.completion.return_token_ids else None,
                logprobs=answer.chat_logprobs(logprobs) if first and answer.logprobs else None))
        if step.finish_reason is not None:
            reason = self.output.finish_reason(FINISH_REASONS[step.finish_reason])
            chunks.append(answer.chunk(None, reason, usage, index=self.index))
        return chunks

    def _finish(self, step: GenerationStep) -> FinishReason | None:
        if step.finish_reason is not None and self.completion.max_tokens == 0:
            return FinishReason.LENGTH
        return step.finish_reason

    def _echo(self, step: GenerationStep) -> dict:
        planned, answer = self.planned, self.answer
        logprobs = None
        if answer.logprobs:
            choice = Choice(self.index, step, prompt_ids=planned.prompt_ids,
                            prompt_logprobs=step.prompt_logprobs)
            logprobs = answer.completion_logprobs(choice)
        self.offset += len(planned.prompt_text)
        return answer.chunk(planned.prompt_text, None, self.completion.include_usage,
                            index=self.index, logprobs=logprobs)

    def _logprobs(self, entries: list) -> dict:
        if self.answer.chat:
            return self.answer.chat_logprobs(entries)
        return self.answer.completion_logprobs(Choice(self.index, None), self.offset, entries)
