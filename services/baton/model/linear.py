"""Linear layers that pick the matmul orientation for the batch: ``Linear`` and ``linear()``.

A decode step multiplies a handful of rows (one per running sequence) by every weight
matrix, and a BLAS's small-M kernels may stream the weight far below the machine's copy
bandwidth. The same product written weight-major, ``(W @ x.T).T``, runs the kernel over
W's rows instead. Which is faster depends on the CPU and its BLAS, so it is measured once
per process (``weight_major_pays``) and the weight-major form is used only where it pays,
for at most ``MAX_ROWS_WEIGHT_MAJOR`` rows (``MAX_ROWS_VOCABULARY`` for a projection of
``VOCABULARY_OUTPUTS`` or more). One row is doubled to two: a [K, 1] right-hand side takes
MKL's matrix-vector path. Both orientations compute the same dot products; only the
summation order differs. CUDA tensors always take ``F.linear`` (cuBLAS picks its kernels).

On a CPU, weights are packed once into oneDNN's blocked layout (``WeightPack``; a bf16 or
fp16 weight as fp32 where oneDNN packs only fp32, ``pack_dtype``), as vLLM's CPU backend
does, because ``F.linear`` re-lays a bf16 weight out on every call. The packed op has no
backward, so a forward that trains takes the plain kernels. On a CPU without AVX512-BF16
(AVX2, or AVX-512 alone) a decode batch (up to ``MAX_FEW_ROWS`` rows) takes baton's ``few_rows_linear``,
which reads the weights faster than oneDNN does there; its fp32 results agree with
``F.linear`` to rounding. The figures: docs/runtime.md ("Memory and kernels on the CPU",
"On CPUs with AVX2 only").
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from baton.kernels import cpu as cpu_kernels
from baton.model.probe import fastest_run_s

MAX_ROWS_WEIGHT_MAJOR = 4
VOCABULARY_OUTPUTS = 8192
MAX_ROWS_VOCABULARY = 64


def weight_major(num_rows: int, num_outputs: int) -> bool:
    """Is ``(W @ x.T).T`` the faster orientation for this many rows (on CPU)?"""
    if num_outputs >= VOCABULARY_OUTPUTS:
        return num_rows <= MAX_ROWS_VOCABULARY
    return num_rows <= MAX_ROWS_WEIGHT_MAJOR


@functools.cache
def weight_major_pays() -> bool:
    """Is the weight-major orientation at least 1.2x faster than ``F.linear`` for 2 rows of a
    ``random-50m``-sized fp32 projection on this CPU? (Fastest of 5 runs each.)"""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 512, generator=generator)
    weight = torch.randn(2816, 512, generator=generator)
    plain = fastest_run_s(lambda: F.linear(x, weight), runs=5)
    weight_major_s = fastest_run_s(lambda: weight_major_linear(x, weight), runs=5)
    return plain >= 1.2 * weight_major_s


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for x: [N, in], weight: [out, in] -> [N, out]."""
    if (x.device.type != "cpu" or x.dim() != 2 or not weight_major(x.shape[0], weight.shape[0])
            or not weight_major_pays()):
        return F.linear(x, weight, bias)
    return weight_major_linear(x, weight, bias)


def weight_major_linear(x: torch.Tensor, weight: torch.Tensor,
                        bias: torch.Tensor | None = None) -> torch.Tensor:
    """``(W @ x.T).T``: the same product as ``F.linear`` for x: [N, in] on a CPU."""
    if x.shape[0] == 1:
        out = (weight @ torch.cat([x, x]).t())[:, :1].t().contiguous()
    else:
        out = (weight @ x.t()).t().contiguous()
    return out if bias is None else out + bias


# oneDNN picks the packed layout for a typical row count; any count may use it afterwards.
PACK_ROWS_HINT = 64
PACKED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@functools.cache
def _packable_dtypes() -> frozenset[torch.dtype]:
    """The dtypes oneDNN packs on this CPU: fp32 everywhere; bf16 and fp16 only with the
    instructions its kernels need (AVX-512 BW/VL/DQ or AVX-NE-CONVERT for bf16, AVX512-FP16
    or AVX-NE-CONVERT for fp16; an AVX2-only CPU refuses the reorder)."""
    if not torch.backends.mkldnn.is_available():
        return frozenset()
    supported = {torch.float32}
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        supported.add(torch.bfloat16)
    if torch.ops.mkldnn._is_mkldnn_fp16_supported():
        supported.add(torch.float16)
    return frozenset(supported & set(PACKED_DTYPES))


def pack_dtype(dtype: torch.dtype) -> torch.dtype | None:
    """The dtype of a weight's packed copy on this CPU: its own where oneDNN packs it; fp32
    for a bf16 or fp16 weight where oneDNN packs only fp32 (an AVX2 CPU); None where nothing
    packs. Widening loses nothing: a product of two bf16 (or fp16) values is exact in fp32 and
    the sums accumulate in fp32, as in bf16 hardware, so the widened product rounded back
    equals F.linear's in that dtype to the order of the sums. On an AVX2 CPU, where torch
    multiplies bf16 at a quarter of fp32's speed, this makes a bf16 model's matmuls as fast as
    an fp32 one's, for one fp32 copy of the weights."""
    packable = _packable_dtypes()
    if dtype in packable:
        return dtype
    if dtype in PACKED_DTYPES and torch.float32 in packable:
        return torch.float32
    return None


def packs(weight: torch.Tensor) -> bool:
    """Does this weight run through a oneDNN-packed copy (CPU, a dtype this CPU packs itself or
    widened, and no gradient wanted: the packed op has no backward)?"""
    return (weight.device.type == "cpu" and pack_dtype(weight.dtype) is not None
            and not (weight.requires_grad and torch.is_grad_enabled()))


class WeightPack:
    """A weight's oneDNN-packed copy (in ``pack_dtype``), made on first use and remade whenever
    the weight changes (moved to another device or dtype, reloaded, or edited in place: the key
    holds its storage and its version counter)."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._packed: torch.Tensor | None = None
        self._dtype: torch.dtype | None = None

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        key = (weight.data_ptr(), weight._version, weight.dtype, weight.shape)
        if key != self._key:
            self._dtype = pack_dtype(weight.dtype)
            with torch.no_grad():
                self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().to(self._dtype),
                                                                       PACK_ROWS_HINT)
            self._key = key
        if self._dtype == x.dtype:
            return torch.ops.mkldnn._linear_pointwise(x, self._packed, bias, "none", [], "")
        wide_bias = None if bias is None else bias.to(self._dtype)
        out = torch.ops.mkldnn._linear_pointwise(x.to(self._dtype), self._packed, wide_bias, "none", [], "")
        return out.to(x.dtype)


def project(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            pack: WeightPack) -> torch.Tensor:
    """x @ weight.T + bias by the fastest route for the weight and the rows: baton's few-rows
    kernel for a decode batch where this CPU has it (AVX2 without AVX-512), else the packed
    copy where ``packs`` says so, else ``linear()``."""
    if cpu_kernels.few_rows_linear_fits(x, weight, bias):
        return cpu_kernels.kernels().few_rows_linear(x, weight, bias)
    if packs(weight):
        return pack.linear(x, weight, bias)
    return linear(x, weight, bias)


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters and names) whose forward uses ``project()``."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.pack = WeightPack()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return project(x, self.weight, self.bias, self.pack)


class FusedLinear:
    """Several linear layers over the same input as one matmul.

    The layers' weights become row slices (views) of one concatenated matrix, so
    memory is not doubled, the Hugging Face parameter names stay, and a later
    ``load_state_dict`` writes through to the fused matrix. Moving the model to
    another device or dtype gives the layers new tensors of their own; the next
    call notices (the first layer's weight is no longer the fused matrix's first
    rows) and fuses them again on their new device.
    Inference only: the views are not leaves of their own for autograd.
    """

    def __init__(self, *layers: nn.Linear) -> None:
        self.layers = layers
        self.sizes = [layer.out_features for layer in layers]
        self.pack = WeightPack()
        self._fuse()

    def _fuse(self) -> None:
        layers = self.layers
        with torch.no_grad():
            self.weight = torch.cat([layer.weight for layer in layers])
            has_bias = [layer.bias is not None for layer in layers]
            assert all(has_bias) or not any(has_bias), "fused layers must agree on bias"
            self.bias = torch.cat([layer.bias for layer in layers]) if has_bias[0] else None
        start = 0
        for layer, size in zip(layers, self.sizes, strict=True):
            layer.weight.data = self.weight[start:start + size]
            if self.bias is not None:
                layer.bias.data = self.bias[start:start + size]
            start += size

    def output(self, x: torch.Tensor) -> torch.Tensor:
        """The layers' outputs side by side: [N, sum of out_features]."""
        if self.layers[0].weight.data_ptr() != self.weight.data_ptr():  # moved since fused
            self._fuse()
        return project(x, self.weight, self.bias, self.pack)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.output(x).split(self.sizes, dim=-1)
