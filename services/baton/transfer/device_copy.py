"""KV between a GPU and host memory at PCIe speed: pinned buffers, copies on a stream of their
own, overlapped with the compute.

Why: ``tensor.cpu()`` and ``host_tensor.to("cuda")`` copy through pageable memory, which the
driver stages through a pinned buffer of its own, and both block: the CPU waits for every
kernel queued before the copy, so the compute stream runs dry while it lasts. The chain's
tail ships each layer as the chain finishes it; copied that way, every layer would stall
the next one's compute. Here a copy goes from or into pinned
memory (PyTorch's caching host allocator keeps the buffers for reuse) on a copy stream:

* ``to_host``: device tensors into pinned host memory. The copy waits, on the GPU, for the
  compute queued so far (what wrote the tensors) and runs beside what is queued later;
  ``HostCopy.wait`` blocks only its caller (the tail's shipping thread), not the compute.
* ``to_device``: a cache from the wire (``ReceivedLayer`` pieces, or host ``LayerKV``) joined
  once into pinned memory and copied to the device; the ``DeviceLayer``-s come back at once,
  and storing one into the pool makes the pool's stream wait for its copy, on the GPU, before it
  reads them.

On a CPU nothing moves: ``to_host`` hands host tensors back as they are, ``to_device`` a cache
for a CPU device.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from baton.kv.dense import LayerKV
from baton.kv.landing import LayerStore
from baton.transfer.received import ReceivedLayer, joined


@functools.cache
def copy_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream that carries this device's KV copies (one per device and process)."""
    return torch.cuda.Stream(device)


class HostCopy:
    """Device tensors on their way into pinned host memory (``to_host``)."""

    def __init__(self, tensors: list[torch.Tensor], done: torch.cuda.Event | None) -> None:
        self._tensors = tensors
        self._done = done

    def wait(self) -> list[torch.Tensor]:
        """The host tensors, once their copies are done (blocks the caller only)."""
        if self._done is not None:
            self._done.synchronize()
        return self._tensors


def to_host(tensors: Sequence[torch.Tensor]) -> HostCopy:
    """Start copying ``tensors`` (all on one device) into pinned host memory; returns at once.
    Host tensors are handed back as they are."""
    if not tensors or tensors[0].device.type != "cuda":
        return HostCopy(list(tensors), None)
    device = tensors[0].device
    stream = copy_stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))  # what wrote them comes first
    hosts = []
    with torch.cuda.stream(stream):
        for tensor in tensors:
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            host.copy_(tensor, non_blocking=True)
            tensor.record_stream(stream)  # not reused by the compute until the copy has read it
            hosts.append(host)
        done = torch.cuda.Event()
        done.record(stream)
    return HostCopy(hosts, done)


def layers_to_host(layers: Sequence[LayerKV]) -> list[LayerKV]:
    """A whole cache in (pinned) host memory, waiting for its copies once."""
    flat = to_host([tensor for layer in layers for tensor in (layer.k, layer.v, layer.positions)]).wait()
    return [LayerKV(*flat[3 * index:3 * index + 3]) for index in range(len(layers))]


@dataclass(frozen=True)
class DeviceLayer:
    """One layer of a cache copied to the device (``to_device``), the same reading interface
    as ``LayerKV``. Its tensors may still be arriving: a reader on another stream waits for
    ``ready`` first (``store_into`` does)."""

    k: torch.Tensor
    v: torch.Tensor
    positions: torch.Tensor
    ready: torch.cuda.Event

    @property
    def num_tokens(self) -> int:
        return self.k.shape[0]

    def store_into(self, pool: LayerStore, seq_id: str, layer: int) -> None:
        """Into the pool, once the copy is done: the pool's stream waits for it on the GPU."""
        self.wait_on(torch.cuda.current_stream(self.k.device))
        pool.append(seq_id, layer, self.k, self.v, self.positions)

    def wait_on(self, stream: torch.cuda.Stream) -> None:
        """Make ``stream``'s later work wait for the copy (on the GPU; the CPU goes on), and
        keep the tensors' memory from reuse until that work has read them."""
        stream.wait_event(self.ready)
        for tensor in (self.k, self.v, self.positions):
            tensor.record_stream(stream)


def to_device(layers: Sequence[LayerKV | ReceivedLayer], device: torch.device
              ) -> list[DeviceLayer | LayerKV | ReceivedLayer]:
    """Start copying a host cache to ``device``; returns at once. Keys and values are joined
    once into pinned memory (a received layer's pieces straight from the messages they came
    in), then copied on the copy stream. For a CPU device the layers come back as they are."""
    if device.type != "cuda":
        return list(layers)
    stream = copy_stream(device)
    staged = []
    with torch.cuda.stream(stream):
        for layer in layers:
            tensors = [_pinned(layer, "k"), _pinned(layer, "v"), _pinned(layer, "positions")]
            on_device = [tensor.to(device, non_blocking=True) for tensor in tensors]
            ready = torch.cuda.Event()
            ready.record(stream)
            staged.append(DeviceLayer(*on_device, ready))
    return staged


def _pinned(layer: LayerKV | ReceivedLayer, name: str) -> torch.Tensor:
    """One of a host layer's tensors in pinned memory (one copy)."""
    if isinstance(layer, ReceivedLayer) and name != "positions":
        raw = joined(layer.k_pieces if name == "k" else layer.v_pieces, pin_memory=True)
        return raw.view(layer.dtype).view(layer.num_tokens, layer.num_kv_heads, layer.head_dim)
    tensor = getattr(layer, name)
    pinned = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return pinned.copy_(tensor)
