"""Reasoning split from the answer: outputs that open <think> themselves (Qwen 3), outputs
that start inside a reasoning the prompt opened (DeepSeek-R1), reasoning cut short, answers
without reasoning; streamed on random splits as it is split whole; and the splitter chosen
from the template, the prompt and enable_thinking."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from baton.gateway.http.chat_template import ChatTemplate
from baton.gateway.http.reasoning import ReasoningSplitter, reasoning_splitter

TEMPLATES = Path(__file__).parent / "chat_templates"
THINKING = (TEMPLATES / "tools_and_thinking.jinja").read_text()


@pytest.mark.parametrize("starts_inside,text,reasoning,answer", [
    (False, "<think>\nLet me count: {1, 2}.\n</think>\n\nTwo.", "\nLet me count: {1, 2}.\n", "Two."),
    (False, "\n<think>ok</think>Yes", "ok", "Yes"),
    (False, "Just an answer.", None, "Just an answer."),
    (False, "  An answer that mentions <think> late.", None, "  An answer that mentions <think> late."),
    (False, "<think>cut short by max_tokens", "cut short by max_tokens", ""),
    (False, "<think></think>\n\nAnswer", None, "Answer"),
    (False, "", None, ""),
    (True, "Hmm, 2 < 3.\n</think>\n\nYes.", "Hmm, 2 < 3.\n", "Yes."),
    (True, "<think>\nThe template opened it too\n</think>Yes.", "\nThe template opened it too\n", "Yes."),
    (True, "still thinking </thi", "still thinking </thi", ""),
    (True, "</think>Straight to it, <think> kept", None, "Straight to it, <think> kept"),
])
def test_split(starts_inside, text, reasoning, answer):
    assert ReasoningSplitter(starts_inside).split(text) == (reasoning, answer)


SAMPLES = [
    (False, "<think>\nFirst, 7 × 6 = 42; the </thin is not a tag.\n</think>\n\nIt is 42. </think>"),
    (False, "  \n<thin is no tag: all answer"),
    (False, "<think>never closed, é ü 🌧"),
    (True, "Thinking first ✓\n</think>\n\n  Then the answer.\n"),
    (True, " <think>doubly opened</think>answer"),
]


@pytest.mark.parametrize("starts_inside,text", SAMPLES)
def test_streamed_equals_whole_on_random_splits(starts_inside, text):
    whole = ReasoningSplitter(starts_inside).split(text)
    rng = random.Random(text)  # seeded: the same splits on every run
    for _ in range(40):  # 5 outputs x 40 splits
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, min(30, len(text) - 1))))
        pieces = [text[start:end] for start, end in zip([0, *cuts], [*cuts, len(text)])]
        splitter = ReasoningSplitter(starts_inside)
        deltas = [delta for piece in pieces for delta in splitter.feed(piece)] + splitter.finish()
        assert all(len(delta) == 1 and next(iter(delta.values())) for delta in deltas)
        reasoning = "".join(delta.get("reasoning_content", "") for delta in deltas)
        answer = "".join(delta.get("content", "") for delta in deltas)
        assert (reasoning or None, answer) == whole, cuts


def test_stream_holds_back_a_partial_tag_only():
    splitter = ReasoningSplitter()
    assert splitter.feed("<thi") == []
    assert splitter.feed("nk>a b </th") == [{"reasoning_content": "a b "}]
    assert splitter.feed("ink>\n") == []
    assert splitter.feed("c") == [{"content": "c"}]
    assert splitter.finish() == []


def test_splitter_follows_the_template_the_prompt_and_enable_thinking():
    template = ChatTemplate(THINKING)
    messages = [{"role": "user", "content": "Hi"}]
    prompt = template.render(messages)
    assert reasoning_splitter(THINKING, prompt).starts_inside is False
    assert reasoning_splitter(THINKING, prompt + "<think>\n").starts_inside is True
    shut = template.render(messages, enable_thinking=False)
    assert shut.rstrip().endswith("</think>")
    assert reasoning_splitter(THINKING, shut, {"enable_thinking": False}) is None
    assert reasoning_splitter(THINKING, prompt, {"enable_thinking": True}) is not None
    plain = (TEMPLATES / "mistral_style.jinja").read_text()
    assert reasoning_splitter(plain, "[INST] Hi [/INST]") is None
    assert reasoning_splitter(None, "Hi") is None
