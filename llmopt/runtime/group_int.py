"""GPTQ and AWQ layers the int4 kernel does not take (a float32 model's; 2, 3 and 8 bits; group sizes outside
32..256), kept as their codes instead of dequantized: W = (q - z) s per group, the checkpoint's bits per
weight. Built on the CPU and moved to the model's device (on CUDA the product compiles for the GPU; not yet
run on one).

The codes are held in bit planes of 8, 4 or 2 bits (3 bits: a 2-bit and a 1-bit plane), each packing
a group of 32 inputs as Q4_0 packs its nibbles: byte i of a p-bit plane holds inputs i + 4p·t at bit p·t.
Reading a field is a mask and an exact power-of-two scale (AVX-512 has no byte shift), so the
decode product (`group_int_gemv`, compiled by inductor like the GGUF products, gguf_gemv.bind_product)
sums q·x per group of 32 and scales per quantization group without building W; prefill's tiles rebuild
W's rows as the source dequantizes them, (q - z)·s in float32 (QuantizedTensor.dequantize: bit for bit).
An act-order layer (g_idx, a column permutation) holds its columns sorted by group and permutes its input
to match, one gather of the activations per call. Input widths that are no multiple of 32 are
dequantized instead (runtime/weights.py).
"""

from __future__ import annotations

import torch

from llmopt.quantized_tensor import QuantizedTensor
from llmopt.runtime.gguf_gemv import bit_field
from llmopt.runtime.gguf_linear import FieldLinear, lane_rows

GROUP = 32  # inputs per packed group
PLANES = {2: (2,), 3: (2, 1), 4: (4,), 8: (8,)}  # bits -> the bit planes that hold them, low bits first


def _group_size(qt: QuantizedTensor) -> int:
    return qt.shape[1] if qt.group_size <= 0 else qt.group_size


def input_order(qt: QuantizedTensor) -> torch.Tensor | None:
    """The columns sorted by group (act-order's g_idx), None where they are in group order already."""
    g = qt.group_index()
    if torch.equal(g, torch.arange(qt.shape[1]) // _group_size(qt)):
        return None
    return torch.sort(g, stable=True).indices


def kept(qt: QuantizedTensor) -> bool:
    """Whether GroupIntLinear holds this layer: whole groups of 32 inputs, each quantization group `group_size`
    columns (in order, or any order: act-order), a zero point per group (GPTQ, AWQ), a bit count it packs."""
    in_f = qt.shape[1]
    gs = _group_size(qt)
    return (qt.bits in PLANES and qt.zeros is not None and qt.mins is None and in_f % GROUP == 0
            and gs % GROUP == 0 and in_f % gs == 0
            and torch.equal(torch.sort(qt.group_index()).values, torch.arange(in_f) // gs))


def pack_plane(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes [out, in] (values below 2^bits) -> one plane [out, in / 32, 4·bits] uint8 (see the module)."""
    width = 4 * bits  # bytes per group of 32
    parts = q.to(torch.int32).reshape(q.shape[0], -1, GROUP // width, width)  # [out, G, t, i]: input t·width + i
    shifts = (bits * torch.arange(GROUP // width, dtype=torch.int32)).reshape(-1, 1)
    return (parts << shifts).sum(2).to(torch.uint8)


def plane_parts(plane: torch.Tensor, bits: int) -> list[torch.Tensor]:
    """A plane [..., G, 4·bits, L] -> its 8 / bits fields as float, each [..., G, 4·bits, L]: field t holds
    inputs t·4·bits + i."""
    return [bit_field(plane, bits, t) for t in range(8 // bits)]


def _codes(planes: list[torch.Tensor], bits: int) -> list[torch.Tensor]:
    """The codes of every group of 32 as float, in runs of inputs: [..., G, width, L] each, run u holding inputs
    u·width + i. 3 bits: runs of 4, the 2-bit plane's fields halved to meet the 1-bit plane's (no
    concatenation: inductor compiled that to a loop 40x slower)."""
    first = PLANES[bits][0]
    parts = plane_parts(planes[0], first)
    if len(planes) == 1:
        return parts
    high = plane_parts(planes[1], 1)  # 8 runs of 4 inputs
    return [parts[u // 2][..., 4 * (u % 2):4 * (u % 2) + 4, :] + 4 * h for u, h in enumerate(high)]


def group_int_gemv(x: torch.Tensor, bits: int, per: int, scales: torch.Tensor, zeros: torch.Tensor,
                   *planes: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """x [in] times GroupIntLinear's W: planes [B, G, 4p, L], scales and zeros [B, G / per, L]. Each group's
    Σ q·x first, then (Σ q·x - z Σ x)·s per quantization group of `per` groups of 32."""
    groups = planes[0].shape[1]
    codes = _codes(list(planes), bits)
    xg = x.reshape(groups, len(codes), -1, 1)  # [G, run, input]
    inner = 0
    for u, q in enumerate(codes):
        inner = inner + (q * xg[:, u]).sum(2)  # [B, G, L]
    n, _, lanes = inner.shape
    inner = inner.reshape(n, -1, per, lanes).sum(2)  # [B, G / per, L]
    xsum = x.reshape(-1, per * GROUP).sum(-1, keepdim=True)  # [G / per, 1]
    return ((inner - zeros.float() * xsum) * scales.float()).sum(1).reshape(-1)


class GroupIntLinear(FieldLinear):
    """A GPTQ/AWQ layer of 2, 3, 4 or 8 bits held as bit planes, float scales and integer zero points (see
    the module), LANES rows interleaved. An act-order layer holds its columns sorted by group and the order
    (`order`), and takes its input in that order: its `rows` are W's columns in that order too."""

    gemv = staticmethod(group_int_gemv)
    shared = ("order",)

    def __init__(self, qt: QuantizedTensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = qt.shape
        self.bits = qt.bits
        scales = qt.scales if qt.scales.dtype in (torch.float16, torch.bfloat16) else qt.scales.float()
        self.per = self.in_features // GROUP // scales.shape[1]
        order = input_order(qt)
        self.register_buffer("order", order)
        codes, low = qt.codes.to(torch.int32), PLANES[qt.bits][0]
        if order is not None:
            codes = codes[:, order]
        self.register_rows("plane", pack_plane(codes & ((1 << low) - 1), low))
        self.register_rows("plane_hi", pack_plane(codes >> low, 1) if len(PLANES[qt.bits]) > 1 else None)
        self.register_rows("scales", scales)
        zeros = qt.zeros.to(torch.int32)  # (a GPTQ v1 zero of 256 at 8 bits does not fit a byte)
        self.register_rows("zeros", zeros.to(torch.uint8 if int(zeros.max()) < 256 else torch.int16))
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x if self.order is None else x.index_select(-1, self.order))

    def fields(self) -> tuple:
        planes = (self.plane,) if self.plane_hi is None else (self.plane, self.plane_hi)
        return (self.bits, self.per, self.scales, self.zeros, *planes)

    def rows(self, index: slice | torch.Tensor) -> torch.Tensor:
        planes = [lane_rows(p, index)[..., None] for p in (self.plane, self.plane_hi) if p is not None]
        q = torch.stack(_codes(planes, self.bits), dim=-3).reshape(planes[0].shape[0], -1)  # [n, in]
        per_column = self.per * GROUP
        z = lane_rows(self.zeros, index).float().repeat_interleave(per_column, dim=1)
        s = lane_rows(self.scales, index).float().repeat_interleave(per_column, dim=1)
        return (q - z) * s

