"""The gateway's gRPC channels to the pods: one per pod address, shared by every request,
and each decode pod's session (``baton.gateway.decode_session``)."""

from __future__ import annotations

import asyncio

import grpc

from baton.api.v1 import decode_pb2_grpc, prefill_pb2_grpc
from baton.config import MtlsConfig
from baton.gateway.decode_session import DecodeSession
from baton.security.mtls import Mtls
from baton.serving import CHANNEL_OPTIONS

RETIRED_CHANNEL_GRACE_S = 600.0  # calls on a channel replaced by rotated certificates may end


class Channels:
    """One gRPC channel per pod address, reused by every request (a channel multiplexes),
    mTLS when on; all opened anew once the certificates rotate (calls in flight keep their
    old channel until they end). Used only on the gateway's event loop, which its channels
    belong to."""

    def __init__(self, mtls: Mtls | None = None) -> None:
        self.mtls = mtls or Mtls(MtlsConfig())
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._sessions: dict[str, DecodeSession] = {}
        self._fingerprint = self.mtls.fingerprint()
        self._closing: set[asyncio.Task] = set()

    def _channel(self, address: str) -> grpc.aio.Channel:
        fingerprint = self.mtls.fingerprint()
        if fingerprint != self._fingerprint:
            for channel in self._channels.values():  # closed once their calls end
                task = asyncio.ensure_future(channel.close(grace=RETIRED_CHANNEL_GRACE_S))
                self._closing.add(task)
                task.add_done_callback(self._closing.discard)
            for session in self._sessions.values():
                session.retire()
            self._channels, self._sessions, self._fingerprint = {}, {}, fingerprint
        if address not in self._channels:
            self._channels[address] = self.mtls.channel(address, CHANNEL_OPTIONS, aio=True)
        return self._channels[address]

    def decode(self, address: str) -> decode_pb2_grpc.DecodeStub:
        return decode_pb2_grpc.DecodeStub(self._channel(address))

    def prefill(self, address: str) -> prefill_pb2_grpc.PrefillStub:
        return prefill_pb2_grpc.PrefillStub(self._channel(address))

    def session(self, address: str) -> DecodeSession:
        """The decode pod's session, opened anew when the last one ended (the pod restarted,
        or refused it while loading) or the certificates rotated."""
        stub = self.decode(address)  # first: a rotation retires the sessions
        session = self._sessions.get(address)
        if session is None or session.ended:
            session = self._sessions[address] = DecodeSession(stub)
        return session

    async def close(self) -> None:
        sessions, self._sessions = list(self._sessions.values()), {}
        for session in sessions:
            session.close()
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            await channel.close()
