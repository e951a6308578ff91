"""Real decode servers on port 0 over a tiny random checkpoint, and the references they must
match (the monolithic engine, a single-process prefill), for the decode and prefill tests."""

from __future__ import annotations

import threading
import time

import grpc
import torch
from baton.api.requests import CompressionParams
from baton.api.v1 import common_pb2, decode_pb2, decode_pb2_grpc
from baton.config import (
    DecodeServiceConfig,
    KVCacheConfig,
    KVPoolConfig,
    KVTransportConfig,
    ModelSourceConfig,
    MtlsConfig,
    RoutingConfig,
    SchedulerConfig,
    StreamConfig,
)
from baton.decode.server import create_server
from baton.kv import DenseKV
from baton.model import prefill
from baton.model.loader import load_checkpoint
from baton.routing import InMemoryStore
from baton.sampling.params import SamplingParams
from baton.sarathi.engine import Engine
from baton.transfer import framing
from baton.transfer.codec import encode_kv
from baton.transfer.handoff import KVHandoff
from commands.cli_checkpoint import save_cli_checkpoint

# The prompt and length the decode tests' module-wide reference is generated for (conftest).
PROMPT = [5, 17, 99, 3, 250, 42, 7, 7, 64, 128, 11, 200, 31]
MAX_TOKENS = 12

KV_BLOCK_SIZE = 4
KV_NUM_BLOCKS = 384  # 3 layers x 128 blocks of 4 tokens: a 512-token sequence fits


def make_checkpoint(directory):
    return save_cli_checkpoint(directory)


def start_decode_server(checkpoint, store=None, num_blocks: int = KV_NUM_BLOCKS,
                        metrics_port: int = 0, lease_s: float = 30.0, max_pending_pushes: int = 64,
                        mtls: MtlsConfig | None = None, stream_interval_ms: float = 0.0,
                        step_stall_s: float = 120.0, exit_process=None, kv_transport: str = "grpc",
                        kv_cache: KVCacheConfig | None = None):
    config = DecodeServiceConfig(
        model=ModelSourceConfig(path=str(checkpoint), dtype="float32"),
        kv=KVPoolConfig(block_size=KV_BLOCK_SIZE, num_blocks=num_blocks, unclaimed_lease_s=lease_s,
                        max_pending_pushes=max_pending_pushes),
        routing=RoutingConfig(heartbeat_s=0.2, worker_ttl_s=2.0), mtls=mtls or MtlsConfig(),
        stream=StreamConfig(interval_ms=stream_interval_ms),
        scheduler=SchedulerConfig(step_stall_s=step_stall_s),
        kv_transport=KVTransportConfig(kind=kv_transport), kv_cache=kv_cache or KVCacheConfig())
    config.server.grace_s = 0.5
    config.server.metrics_port = metrics_port
    return create_server(config, store or InMemoryStore(), exit_process)


def decode_stub(port: int) -> tuple[grpc.Channel, decode_pb2_grpc.DecodeStub]:
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    return channel, decode_pb2_grpc.DecodeStub(channel)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


def reference_tokens(checkpoint, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """What the monolithic engine generates greedily in one process."""
    loaded = load_checkpoint(checkpoint, dtype="float32")
    engine = Engine(loaded.model, loaded.tokenizer,
                    kv=KVPoolConfig(block_size=KV_BLOCK_SIZE, num_blocks=KV_NUM_BLOCKS))
    return engine.generate([prompt_ids], greedy(max_tokens))[0].token_ids


def prefilled_handoff(checkpoint, request_id: str, prompt_ids: list[int], max_tokens: int):
    """A single-process prefill of the prompt, ready to push: (handoff, payload chunks)."""
    loaded = load_checkpoint(checkpoint, dtype="float32", with_tokenizer=False)
    kv = DenseKV(loaded.config.num_hidden_layers)
    token_ids = torch.tensor(prompt_ids)
    logits = prefill(loaded.model, token_ids, torch.arange(len(prompt_ids)), kv)
    encoded = encode_kv(kv.complete_layers(), request_id, loaded.model_id, loaded.revision)
    handoff = KVHandoff(encoded.header, tuple(prompt_ids), int(torch.argmax(logits)),
                        greedy(max_tokens), CompressionParams())
    return handoff, list(encoded.chunks(chunk_bytes=4096))


def proto_messages(handoff, chunks):
    """PushKV's messages as plain protobuf, what a generated stub sends (a pod takes these
    as well as the chain's hand-framed ones)."""
    for message in framing.messages(handoff, ([chunk] for chunk in chunks)):
        yield (decode_pb2.PushKVRequest(chunk=b"".join(message.pieces))
               if isinstance(message, framing.Chunk) else message)


def push(stub, handoff, chunks) -> decode_pb2.PushKVResponse:
    return stub.PushKV(proto_messages(handoff, chunks), timeout=30)


def collect(responses) -> tuple[list[int], list[common_pb2.GenerateResponse]]:
    """All streamed token ids and the messages themselves."""
    messages = list(responses)
    return [token for message in messages for token in message.token_ids], messages


class StuckEngine:
    """Once armed, the engine's next step blocks until released."""

    def __init__(self, engine) -> None:
        self.armed = threading.Event()
        self.release = threading.Event()
        self.stuck = threading.Event()
        self.stuck_at = 0.0  # time.monotonic() when the stuck step began to wait
        step = engine.step

        def stuck_step():
            if self.armed.is_set():
                self.stuck_at = time.monotonic()
                self.stuck.set()
                self.release.wait(60)
            return step()

        engine.step = stuck_step
