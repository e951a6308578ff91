"""NIXL, the second KV data plane (docs/architecture.md, "KV on the wire").

A pusher whose decode pod reads over NIXL sends, in place of a payload's chunks, where
those bytes lie in its own memory (``Regions``: its NIXL agent's metadata for them, their
addresses and lengths, in payload order); the decode pod reads them straight into its
receive buffer with one NIXL READ (UCX moves them: RDMA between hosts that have it, a
cross-memory copy on one host, TCP otherwise) and checks the payload's checksum as it does
for chunks. The pusher keeps its memory registered until the pod has answered the push
(``NixlSource.release``). gRPC stays the control plane: the header, the first token and the
checksum still travel on the PushKV stream, so the same checks run whichever plane carried
the bytes.

Which plane a push takes is settled at registration: a decode pod that reads over NIXL says
so in its routing record (``WorkerInfo.kv_transport``), the gateway passes that on with the
request, and a tail configured for NIXL uses it only for such a pod (gRPC otherwise).

NIXL tells that a transfer ended only when asked (``check_xfer_state``: it offers no event or
descriptor to wait on), so ``NixlReader.read`` asks with a growing back-off, under a deadline.
And an agent serves a peer's read of its memory only while it is asked to make progress: its
own progress thread would do that by spinning a core without pause, which on a pod that
computes is a core lost, so the agents here run none. The pusher makes progress after each
layer it ships and while it waits for the pod's answer (``NixlSource.progress``,
``NixlSource.answer``): a read of a layer ends at the latest when the next one goes out.

The package (``make nixl``: ``nixl`` and ``nixl-cu12`` without their declared dependencies,
which would pull a CUDA build of torch) is optional: without it the plane is unavailable
(``nixl_missing``) and a pod configured for it refuses to start.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import os
import socket
import threading
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from baton.config import KV_TRANSPORTS
from baton.transfer import ucx_devices
from baton.transfer.codec import KVDataLoss, KVMalformed

log = logging.getLogger(__name__)

GRPC, NIXL = KV_TRANSPORTS

MAX_REGIONS = 4096  # per message: a layer is three regions, so far below this
MAX_METADATA_BYTES = 1 << 16
MAX_REMOTE_AGENTS = 64  # pushers a decode pod keeps connections to (each restart is a new one)
POLL_FIRST_S = 20e-6  # the first look at a read's state, doubled up to POLL_LONGEST_S
POLL_LONGEST_S = 1e-3
PROGRESS_S = 1e-3  # how often a pusher waiting for the pod's answer makes progress


def nixl_missing() -> str | None:
    """Why NIXL cannot be used here (None: it can). Only looks: importing it loads its native
    libraries (UCX, abseil, ...) into the process, which a process that never uses NIXL
    should not carry."""
    for package in ("nixl", "nixl_cu12"):
        if importlib.util.find_spec(package) is None:
            return f"the {package} package is not installed; `make nixl` installs it"
    return None


@dataclass(frozen=True)
class Regions:
    """Where the next bytes of a payload lie in the pusher's memory: what a PushKVNixl says."""

    agent_metadata: bytes
    addresses: tuple[int, ...]
    lengths: tuple[int, ...]

    @property
    def num_bytes(self) -> int:
        return sum(self.lengths)

    def check(self) -> None:
        """KVMalformed unless a reader can use these as they are."""
        if not self.agent_metadata or len(self.agent_metadata) > MAX_METADATA_BYTES:
            raise KVMalformed(f"PushKVNixl agent_metadata is {len(self.agent_metadata)} bytes; "
                              f"must be 1..{MAX_METADATA_BYTES}")
        if len(self.addresses) != len(self.lengths):
            raise KVMalformed(f"PushKVNixl has {len(self.addresses)} addresses and "
                              f"{len(self.lengths)} lengths; they go in pairs")
        if not 1 <= len(self.lengths) <= MAX_REGIONS:
            raise KVMalformed(f"PushKVNixl names {len(self.lengths)} regions; must be "
                              f"1..{MAX_REGIONS}")
        if min(self.lengths) < 1:
            raise KVMalformed("PushKVNixl names an empty region")


class NixlAgent:
    """This process's NIXL agent (UCX underneath); its name is new at every start. Given the
    pod's listen ``host``, UCX's network transports stay on the interface that carries it
    (and the node's RDMA ports: ``baton.transfer.ucx_devices``)."""

    def __init__(self, role: str, host: str | None = None) -> None:
        missing = nixl_missing()
        if missing is not None:
            raise RuntimeError(f"kv transport {NIXL!r}: {missing}")
        from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

        self.name = f"baton-{role}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        # Strict: the tail's pushes and a decode pod's reads come from more than one thread.
        # No progress thread: NIXL's spins a core (see the module's docstring).
        config = nixl_agent_config(backends=["UCX"], enable_prog_thread=False,
                                   sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
        with ucx_devices.restricted_to(host) as devices:  # UCX reads them as the agent starts
            self.agent = nixl_agent(self.name, config)
        if devices is not None:
            log.info("NIXL agent %s: UCX network devices %s", self.name, devices)
        self._remotes: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()

    def register(self, views: Sequence[memoryview]):
        """Register these views' memory (for a peer to read, or for a read into them)."""
        return self.agent.register_memory(_descriptors(views), "DRAM")

    def deregister(self, registration) -> None:
        self.agent.deregister_memory(registration)

    def remote(self, metadata: bytes) -> str:
        """Load a pusher's metadata (its connection and the regions it registered); its name.
        The oldest pusher is forgotten once ``MAX_REMOTE_AGENTS`` are known."""
        try:
            name = self.agent.add_remote_agent(metadata)
        except Exception as e:  # noqa: BLE001 - the library raises its own types
            raise KVMalformed(f"PushKVNixl agent_metadata is not a NIXL agent's: {e}") from None
        name = name.decode() if isinstance(name, bytes) else name
        with self._lock:
            self._remotes[name] = None
            self._remotes.move_to_end(name)
            evicted = (self._remotes.popitem(last=False)[0]
                       if len(self._remotes) > MAX_REMOTE_AGENTS else None)
        if evicted is not None:
            try:
                self.agent.remove_remote_agent(evicted)
            except Exception:
                log.debug("forgetting NIXL agent %s failed", evicted, exc_info=True)
        return name


class NixlSource:
    """The regions of one push, registered as they are offered, held until ``release``
    (after the pod answered the push: it may still be reading them until then)."""

    def __init__(self, agent: NixlAgent) -> None:
        self.agent = agent
        self._registrations: list = []
        self._held: list[Sequence[memoryview]] = []

    def offer(self, segments: Sequence[memoryview]) -> Regions:
        views = [segment for segment in segments if len(segment)]
        table = _descriptors(views)
        regions = [(address, length) for address, length, _ in table.tolist()]
        # One registration naming a region twice crashes NIXL when it is deregistered, and
        # layers may share a tensor (the positions, when nothing is pruned): each once.
        distinct = list({region: view for region, view in zip(regions, views)}.values())
        self._registrations.append(registration := self.agent.register(distinct))
        self._held.append(views)  # the memory must outlive the pod's read
        metadata = self.agent.agent.get_partial_agent_metadata(registration, inc_conn_info=True)
        return Regions(metadata, tuple(address for address, _ in regions),
                       tuple(length for _, length in regions))

    def progress(self) -> None:
        """Serve the pod's reads of what was offered so far, as far as they can go now."""
        if self._registrations:
            self.agent.agent.get_new_notifs()  # NIXL's way to make its backends progress

    def answer(self, call) -> object:
        """The push's answer (``call``: its gRPC future), progressing until it comes."""
        done = threading.Event()
        call.add_done_callback(lambda _: done.set())
        while not done.wait(PROGRESS_S):
            self.progress()
        return call.result()

    def release(self) -> None:
        registrations, self._registrations, self._held = self._registrations, [], []
        for registration in registrations:
            try:
                self.agent.deregister(registration)
            except Exception:
                log.warning("deregistering a push's memory from NIXL failed", exc_info=True)


class NixlReader:
    """Reads pushed regions into a receive buffer (the decode pod's side)."""

    def __init__(self, agent: NixlAgent) -> None:
        self.agent = agent
        # Buffers of reads that did not end in time: UCX may still write into them, so they
        # are never handed back to the allocator.
        self._abandoned: list[Sequence[memoryview]] = []

    async def read(self, regions: Regions, targets: Sequence[memoryview], timeout_s: float) -> None:
        """Fill ``targets`` (writable views, ``regions.num_bytes`` in all) with the pusher's
        regions, in order. KVDataLoss when the read fails or does not end in ``timeout_s``."""
        regions.check()
        if sum(len(target) for target in targets) != regions.num_bytes:
            raise KVMalformed(f"PushKVNixl names {regions.num_bytes} bytes; "
                              f"{sum(len(t) for t in targets)} were expected")
        remote = self.agent.remote(regions.agent_metadata)
        local, far = _paired(_descriptors(targets), regions)
        agent = self.agent.agent
        registration = self.agent.register(targets)
        handle = None
        try:
            try:
                handle = agent.initialize_xfer("READ", agent.get_xfer_descs(local, "DRAM"),
                                               agent.get_xfer_descs(far, "DRAM"), remote)
                state = agent.transfer(handle)
            except Exception as e:  # noqa: BLE001 - the library raises its own types
                raise KVDataLoss(f"the NIXL read from {remote} could not start: {e}") from None
            await self._wait(handle, state, remote, regions.num_bytes, timeout_s, targets)
        finally:
            if handle is not None:
                try:
                    handle.release()
                except Exception:
                    log.warning("releasing a NIXL read failed", exc_info=True)
            self.agent.deregister(registration)

    async def _wait(self, handle, state: str, remote: str, num_bytes: int, timeout_s: float,
                    targets: Sequence[memoryview]) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        pause = POLL_FIRST_S
        while state == "PROC":
            if loop.time() >= deadline:
                self._abandoned.append(targets)
                raise KVDataLoss(f"the NIXL read of {num_bytes} bytes from {remote} did not end "
                                 f"within {timeout_s:g} s")
            await asyncio.sleep(pause)
            pause = min(2 * pause, POLL_LONGEST_S)
            state = self.agent.agent.check_xfer_state(handle)
        if state != "DONE":
            raise KVDataLoss(f"the NIXL read of {num_bytes} bytes from {remote} failed ({state})")


def _address(view: memoryview) -> int:
    return np.frombuffer(view, dtype=np.uint8).ctypes.data


def _descriptors(views: Sequence[memoryview]) -> np.ndarray:
    """NIXL's Nx3 descriptors (address, length, device 0) of host memory views."""
    table = np.zeros((len(views), 3), dtype=np.uint64)
    for row, view in enumerate(views):
        table[row, 0], table[row, 1] = _address(view), view.nbytes
    return table


def _paired(local: np.ndarray, regions: Regions) -> tuple[np.ndarray, np.ndarray]:
    """Both sides' descriptors cut at either side's boundaries, so that each local piece
    faces a remote piece of its length (a READ pairs them one to one)."""
    near, far = [], []
    remote = list(zip(regions.addresses, regions.lengths))
    r, r_taken = 0, 0
    for address, length in local[:, :2].tolist():
        taken = 0
        while taken < length:
            remote_address, remote_length = remote[r]
            count = min(length - taken, remote_length - r_taken)
            near.append((address + taken, count, 0))
            far.append((remote_address + r_taken, count, 0))
            taken += count
            r_taken += count
            if r_taken == remote_length:
                r, r_taken = r + 1, 0
    return np.array(near, dtype=np.uint64), np.array(far, dtype=np.uint64)
