"""A request's stream on the decode pod: steps published by the engine's thread reach the
reader on the event loop, merged when they pile up, in order, the failure last."""

from __future__ import annotations

import asyncio
import threading

import pytest
from baton.api.requests import FinishReason, Route
from baton.decode.streams import PushedKVInfo, RequestStream, StreamFailed, merge_steps
from baton.sarathi.request import RequestOutput


def output(tokens, text, finished=False):
    return RequestOutput(request_id="r", new_token_ids=list(tokens), text_delta=text,
                         finish_reason="length" if finished else None)


def test_steps_that_pile_up_reach_the_reader_as_one_message_in_order():
    async def run():
        stream = RequestStream("r", 4, Route("here"))
        loop = asyncio.get_running_loop()

        def engine_thread():
            for i in range(5):
                stream.publish(output([i], f"<{i}>", finished=i == 4), now_s=float(i))
            loop.call_soon_threadsafe(stream.wake)

        thread = threading.Thread(target=engine_thread)
        thread.start()
        step = await asyncio.wait_for(stream.next_steps(), 5)
        thread.join()
        return step

    step = asyncio.run(run())
    assert step.token_ids == (0, 1, 2, 3, 4)
    assert step.text == "<0><1><2><3><4>"
    assert step.finish_reason is FinishReason.LENGTH and step.usage.completion_tokens == 5


def test_a_reader_waits_for_the_wake_and_gets_the_failure_after_the_steps_before_it():
    async def run():
        stream = RequestStream("r", 4, Route("here"))
        reader = asyncio.ensure_future(stream.next_steps())
        await settle()
        assert not reader.done()  # nothing published yet
        stream.publish(output([7], "x"), now_s=0.0)
        stream.fail("the engine failed")
        stream.wake()
        first = await asyncio.wait_for(reader, 5)
        with pytest.raises(StreamFailed, match="engine failed"):
            await stream.next_steps()
        return first

    assert asyncio.run(run()).token_ids == (7,)


def test_merge_of_one_step_is_the_step():
    stream = RequestStream("r", 1, Route("here"))
    stream.publish(output([1], "a"), now_s=0.0)
    (step,) = list(stream._steps)
    assert merge_steps([step]) is step


async def settle() -> None:
    """Let every task that can run do so (no wall-clock time needs to pass)."""
    for _ in range(5):
        await asyncio.sleep(0)


async def hold_after_a_second_step(hold_s: float, second_finishes: bool):
    """A reader holding for ``hold_s`` after the first step, and a second step published
    into the hold; returns what the reader got, whether it was still holding once the
    second step's wake was handled, and how long it waited."""
    stream = RequestStream("r", 4, Route("here"))
    loop = asyncio.get_running_loop()
    stream.publish(output([1], "a"), now_s=0.0)
    stream.wake()
    started = loop.time()
    reader = asyncio.ensure_future(stream.next_steps(hold_until=started + hold_s))
    await settle()
    stream.publish(output([2], "b", finished=second_finishes), now_s=0.1)
    stream.wake()
    await settle()
    holding = not reader.done()
    step = await asyncio.wait_for(reader, 5)
    return step, holding, loop.time() - started


def test_a_holding_reader_takes_the_steps_of_its_hold_as_one_message():
    step, holding, _ = asyncio.run(hold_after_a_second_step(1.0, second_finishes=False))
    assert holding  # a step in the hold does not end it
    assert step.token_ids == (1, 2) and step.text == "ab" and step.finish_reason is None


def test_the_streams_end_cuts_a_hold_short():
    step, holding, waited_s = asyncio.run(hold_after_a_second_step(30.0, second_finishes=True))
    assert not holding and waited_s < 5
    assert step.token_ids == (1, 2) and step.finish_reason is FinishReason.LENGTH


def test_a_pushed_stream_sends_the_headers_first_token_once_and_its_text_once():
    # The header's token goes out with the text shown for it; the engine's outputs repeat
    # that token and text (its own detokenizer, possibly over two outputs): both left out.
    stream = RequestStream("r", 4, Route("here"), PushedKVInfo(1024, 8, 8, 0.25, (0, 2, 4)))
    stream.publish_first(7, "ab", now_s=1.0)
    stream.publish(output([7, 8], "a"), now_s=2.0)
    stream.publish(output([9], "bc"), now_s=3.0)
    stream.publish(output([10], "d", finished=True), now_s=4.0)
    steps = list(stream._steps)
    assert [step.token_ids for step in steps] == [(7,), (8,), (9,), (10,)]
    assert "".join(step.text for step in steps) == "abcd"
    last = steps[-1]
    assert last.usage.completion_tokens == 4 and last.usage.kv_bytes_shipped == 1024
    assert last.timings.prefill_s == 0.25 and last.route.partition == (0, 2, 4)


def test_a_push_waits_for_its_first_token_to_be_taken_and_no_longer():
    async def run():
        stream = RequestStream("r", 4, Route("here"))
        stream.publish_first(7, "x", now_s=0.0)
        waiting = asyncio.ensure_future(stream.first_taken(60.0))
        await asyncio.sleep(0)
        assert not waiting.done()  # nobody has read the token yet
        step = await stream.next_steps()
        await asyncio.wait_for(waiting, 5)  # the read ended the wait, long before its bound
        await asyncio.wait_for(stream.first_taken(60.0), 5)  # once taken, no wait at all
        unread = RequestStream("s", 4, Route("here"))
        unread.publish_first(8, "y", now_s=0.0)
        await asyncio.wait_for(unread.first_taken(0.01), 5)  # no reader: the bound ends it
        return step

    assert asyncio.run(run()).token_ids == (7,)
