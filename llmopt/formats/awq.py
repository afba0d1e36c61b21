"""The AWQ checkpoint layout ("gemm", as AutoAWQ wrote it and GPTQModel, transformers and vLLM read it).

Per quantized linear `<module>` (4 bits; no g_idx, so groups are contiguous):
    qweight int32 [in, out/8]       codes packed along the output dim in AWQ's order (model/packing.py)
    qzeros  int32 [groups, out/8]   true zero points, packed the same way
    scales  float16 [groups, out]
`config.json` carries `quantization_config` {quant_method "awq", version "gemm", bits, group_size,
zero_point}; a symmetric grid is stored with every zero point at 8, as GPTQModel does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

import llmopt
from llmopt.errors import OptionError
from llmopt.model.packing import pack_awq
from llmopt.quant.grids.integer import group_count
from llmopt.quant.pipeline import QuantizeSpec
from llmopt.quantized_tensor import QuantizedTensor


class AWQLayout:
    name = "awq"
    bits = (4,)

    def check(self, spec: QuantizeSpec) -> None:
        m = spec.method
        if spec.dynamic:
            raise OptionError("AWQ checkpoints have one bits and group size for every module; per-module bits "
                              "(<target_bpw>) need <fmt> gptq")  # fmt: skip
        if m.bits != 4:
            raise OptionError(f"<bits> {m.bits}: AWQ checkpoints hold 4 bits (use <fmt> gptq or dense for others)")
        if m.group_size == 0:
            raise OptionError("<group_size> 0: AWQ checkpoints keep a scale per group or per row")
        gptq = getattr(m, "gptq", None) or m
        if getattr(gptq, "act_order", False) and not getattr(gptq, "static_groups", False):
            raise OptionError("<act_order> needs <static_groups> in AWQ checkpoints, which keep no g_idx "
                              "(or use <fmt> gptq)")  # fmt: skip

    def parts(self, out_f: int, in_f: int, bits: int, group_size: int,
              spec: QuantizeSpec | None = None) -> list[tuple[str, tuple[int, ...], torch.dtype]]:  # fmt: skip
        if out_f % 8:
            raise OptionError(f"AWQ checkpoints pack 8 output channels a word; a linear has {out_f} (use <fmt> gptq)")
        groups = group_count(in_f, group_size)
        return [("qweight", (in_f, out_f // 8), torch.int32),
                ("qzeros", (groups, out_f // 8), torch.int32),
                ("scales", (groups, out_f), torch.float16)]  # fmt: skip

    def tensors(self, qt: QuantizedTensor) -> dict[str, torch.Tensor]:
        if qt.g_idx is not None:
            raise ValueError("AWQ checkpoints keep no g_idx: groups must be contiguous")
        scales = qt.scales.to(torch.float32)
        zeros = torch.full(scales.shape, 8, dtype=torch.int64) if qt.zeros is None else qt.zeros.to(torch.int64)
        return {
            "qweight": pack_awq(qt.codes.t().contiguous()),
            "qzeros": pack_awq(zeros.t().contiguous()),
            "scales": scales.t().contiguous().to(torch.float16),
        }

    def quantization_config(self, spec: QuantizeSpec, provenance: dict[str, Any],
                            modules: Mapping[str, tuple[int, int]] | None = None) -> dict[str, Any]:  # fmt: skip
        m = spec.method
        return {
            "quant_method": "awq",
            "version": "gemm",
            "bits": m.bits,
            "group_size": m.group_size,
            "zero_point": not m.sym,
            "meta": {"quantizer": [f"llmopt:{llmopt.__version__}"], "method": m.name, "llmopt": provenance},
        }


LAYOUT = AWQLayout()
