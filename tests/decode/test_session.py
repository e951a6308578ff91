"""Decode.Session over real gRPC: many requests on one call stream the monolithic engine's
tokens, one engine step's tokens travel together, a bad request fails alone with its own
status, and cancelling a request or the whole call frees the KV."""

from __future__ import annotations

import asyncio
import queue
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest
from baton.api.v1 import common_pb2, decode_pb2, decode_pb2_grpc
from baton.gateway.decode_session import DecodeSession
from decode_servers import MAX_TOKENS, PROMPT, prefilled_handoff, push

UNSET = common_pb2.FINISH_REASON_UNSPECIFIED


class Session:
    """A Session call driven from a test: commands in through a queue, messages read on a thread."""

    def __init__(self, stub) -> None:
        self.commands: queue.Queue = queue.Queue()
        self.call = stub.Session(iter(self.commands.get, None), timeout=60)
        self.messages: list[decode_pb2.SessionSteps] = []
        self.steps: dict[int, list[decode_pb2.SessionStep]] = {}
        self.changed = threading.Condition()
        self.error: grpc.RpcError | None = None
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        try:
            for message in self.call:
                with self.changed:
                    self.messages.append(message)
                    for step in message.steps:
                        self.steps.setdefault(step.stream, []).append(step)
                    self.changed.notify_all()
        except grpc.RpcError as e:
            self.error = e
        with self.changed:
            self.changed.notify_all()

    def generate(self, stream: int, request_id: str, prompt=PROMPT, **sampling) -> None:
        fields = {"temperature": 0.0, "max_tokens": MAX_TOKENS} | sampling
        self.commands.put(decode_pb2.SessionCommand(stream=stream, generate=decode_pb2.DecodeGenerateRequest(
            request_id=request_id, prompt_token_ids=prompt, sampling=common_pb2.SamplingParams(**fields))))

    def wait_for(self, condition, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        with self.changed:
            while not condition():
                assert time.monotonic() < deadline, "condition not reached in time"
                self.changed.wait(0.1)

    def ended(self, stream: int) -> bool:
        steps = self.steps.get(stream, [])
        return bool(steps) and (not steps[-1].HasField("step") or steps[-1].step.finish_reason != UNSET)

    def tokens(self, stream: int) -> list[int]:
        return [token for step in self.steps[stream] for token in step.step.token_ids]

    def close(self) -> None:
        self.commands.put(None)
        self.reader.join(30)


def wait_until(condition, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def test_requests_on_one_session_stream_the_engines_tokens_a_step_per_message(stub, reference):
    session = Session(stub)
    streams = [1, 2, 3, 4]
    for stream in streams:
        session.generate(stream, f"session-{stream}")
    session.wait_for(lambda: all(session.ended(stream) for stream in streams))
    session.close()
    assert session.error is None  # the caller's commands ended and so did the call, cleanly
    for stream in streams:
        assert session.tokens(stream) == reference
        first, last = session.steps[stream][0].step, session.steps[stream][-1].step
        assert first.request_id == f"session-{stream}"  # named once, as on its own call
        assert last.usage.completion_tokens == len(reference)
    # The four decode together: most messages carry a step of several requests.
    carried = sum(len(session.steps[stream]) for stream in streams)
    assert len(session.messages) < carried / 2


def test_a_session_whose_commands_end_first_ends_after_its_last_request(stub, reference):
    session = Session(stub)
    session.generate(1, "half-closed-1")
    session.generate(2, "half-closed-2")
    session.close()  # no more commands: the call ends once both requests have
    assert not session.reader.is_alive() and session.error is None
    assert session.tokens(1) == session.tokens(2) == reference


def test_a_bad_request_fails_alone_with_the_status_of_its_own_call(stub, reference):
    session = Session(stub)
    session.generate(1, "bad-token", prompt=[1, 2, 300])
    session.generate(2, "good")
    session.commands.put(decode_pb2.SessionCommand(stream=3))  # opens nothing
    session.generate(2, "again")  # stream 2 is open already
    session.wait_for(lambda: session.ended(1) and session.ended(3) and len(session.steps.get(2, [])) > 1
                     and session.ended(2))
    session.close()
    bad = session.steps[1][-1]
    assert bad.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "300" in bad.message
    assert session.steps[3][-1].code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    duplicate = [step for step in session.steps[2] if not step.HasField("step")]
    assert duplicate and "already open" in duplicate[0].message
    assert [t for step in session.steps[2] if step.HasField("step") for t in step.step.token_ids] == reference


def test_an_attach_on_a_session_continues_a_pushed_cache(stub, server, checkpoint, reference):
    handoff, chunks = prefilled_handoff(checkpoint, "session-pushed", PROMPT, MAX_TOKENS)
    session = Session(stub)
    session.commands.put(decode_pb2.SessionCommand(stream=7, attach=decode_pb2.AttachRequest(
        request_id="session-pushed", wait_s=20)))
    # the Attach waits on the pod, holding up nothing else on the session
    session.wait_for(lambda: server.servicer.attaches_waiting == 1)
    session.generate(8, "beside-the-attach")
    session.wait_for(lambda: session.ended(8))
    push(stub, handoff, chunks)
    session.wait_for(lambda: session.ended(7))
    session.close()
    assert session.tokens(7) == reference  # the first token from the push header on
    assert session.tokens(8) == reference


def test_cancelling_a_request_or_the_whole_call_frees_the_kv(stub, server):
    wait_until(lambda: server.worker.load.running_sequences == 0)
    initial = server.worker.load.free_kv_blocks
    session = Session(stub)
    session.generate(1, "long-1", max_tokens=500)
    session.generate(2, "long-2", max_tokens=500)
    session.wait_for(lambda: 1 in session.steps and 2 in session.steps)
    session.commands.put(decode_pb2.SessionCommand(stream=1, cancel=True))
    wait_until(lambda: server.worker.load.running_sequences == 1)
    assert not session.ended(2)  # the other request goes on
    session.call.cancel()  # the gateway went away: what is still open is cancelled
    wait_until(lambda: server.worker.load.free_kv_blocks == initial
               and server.worker.load.running_sequences == 0)
    session.reader.join(10)
    assert session.error is not None and session.error.code() == grpc.StatusCode.CANCELLED


# --- the gateway's end: calls that read like per-request calls ---------------------------------


async def _gateway_end(port: int, server, reference) -> None:
    def request(request_id, prompt=PROMPT, max_tokens=MAX_TOKENS):
        return decode_pb2.DecodeGenerateRequest(request_id=request_id, prompt_token_ids=prompt,
                                                sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens))

    async def tokens_of(call):
        return [token async for message in call for token in message.token_ids]

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        session = DecodeSession(decode_pb2_grpc.DecodeStub(channel))
        got = await asyncio.gather(tokens_of(session.generate(request("gw-1"))),
                                   tokens_of(session.generate(request("gw-2"))))
        assert got == [reference, reference]
        with pytest.raises(grpc.RpcError) as error:
            await tokens_of(session.generate(request("gw-bad", prompt=[1, 2, 300])))
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "300" in error.value.details()
        long = session.generate(request("gw-long", max_tokens=500))
        steps = long.__aiter__()
        await steps.__anext__()
        # the pod publishes its load after it has sent the step's tokens
        deadline = time.monotonic() + 10
        while server.worker.load.running_sequences != 1:
            assert time.monotonic() < deadline, "the running request never showed in the pod's load"
            await asyncio.sleep(0.01)
        long.cancel()
        with pytest.raises(asyncio.CancelledError):
            await steps.__anext__()
        deadline = time.monotonic() + 10
        while server.worker.load.running_sequences:  # the cancel reached the pod
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        assert not session.ended
        session.close()
        deadline = time.monotonic() + 10
        while not session.ended:  # the call's end reaches the session's reader
            assert time.monotonic() < deadline, "the closed session never ended"
            await asyncio.sleep(0.01)
        with pytest.raises(grpc.RpcError) as error:  # an ended session fails what comes after
            await tokens_of(session.generate(request("gw-late")))
        assert error.value.code() == grpc.StatusCode.CANCELLED


def test_the_gateways_session_calls_read_like_per_request_calls(server, reference):
    asyncio.run(_gateway_end(server.port, server, reference))


# A gateway that holds a session open and then stops answering (its node gone, the process
# stopped): the pod's pings go unanswered, and the call and what it holds end within seconds.
_FROZEN_GATEWAY = """
import sys, time, grpc
from baton.api.v1 import common_pb2, decode_pb2, decode_pb2_grpc
channel = grpc.insecure_channel(sys.argv[1])
command = decode_pb2.SessionCommand(stream=1, generate=decode_pb2.DecodeGenerateRequest(
    request_id="frozen", prompt_token_ids=[5, 17, 99], sampling=common_pb2.SamplingParams(
        temperature=0.0, max_tokens=8)))
def commands():
    yield command
    time.sleep(3600)
call = decode_pb2_grpc.DecodeStub(channel).Session(commands())
next(call)
print("streaming", flush=True)
time.sleep(3600)
"""


def test_a_session_whose_gateway_stops_answering_is_ended_by_the_pods_pings(server):
    wait_until(lambda: not server.servicer.sessions)
    gateway = subprocess.Popen([sys.executable, "-c", _FROZEN_GATEWAY, f"127.0.0.1:{server.port}"],
                               stdout=subprocess.PIPE, text=True)
    try:
        assert gateway.stdout.readline().strip() == "streaming"
        assert len(server.servicer.sessions) == 1
        gateway.send_signal(signal.SIGSTOP)  # alive to TCP, deaf to pings
        wait_until(lambda: not server.servicer.sessions, timeout_s=15)
    finally:
        gateway.kill()
        gateway.wait()
