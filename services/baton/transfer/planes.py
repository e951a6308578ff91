"""The KV transports, one registry family (``baton.config.KV_TRANSPORTS``): what a pod's
process opens for the bytes of pushed caches besides the PushKV stream itself. ``grpc``
opens nothing (the bytes ride on the stream); ``nixl`` opens this process's NIXL agent (the
bytes stay in the sender's memory for the decode pod to read, over RDMA where the cluster
has it). A new transport is a function here and its name in the declaration.
"""

from __future__ import annotations

from baton.config import KV_TRANSPORTS
from baton.transfer.nixl import NixlAgent


@KV_TRANSPORTS.register("grpc")
def _grpc_plane(role: str, host: str | None) -> None:
    return None


@KV_TRANSPORTS.register("nixl")
def _nixl_plane(role: str, host: str | None) -> NixlAgent:
    return NixlAgent(role, host)  # refuses to start when NIXL is asked for and missing


def open_plane(kind: str, role: str, host: str | None) -> NixlAgent | None:
    """The data plane of transport ``kind`` for a pod of ``role`` listening on ``host``."""
    return KV_TRANSPORTS.get(kind)(role, host)
