"""The GPTQ checkpoint layout ("gptq" format v1, as AutoGPTQ, GPTQModel, transformers and vLLM read it).

Per quantized linear `<module>`:
    qweight int32 [in·bits/32, out]   codes packed along the input dim (llmopt.model.packing)
    qzeros  int32 [groups, out·bits/32] zero points − 1, packed along the output dim
    scales  float16 [groups, out]
    g_idx   int32 [in]                group of each input column (permuted under act-order)
`config.json` carries `quantization_config` (quant_method "gptq"); `quantize_config.json` repeats it.
"""

from __future__ import annotations

import re

from collections.abc import Mapping
from typing import Any

import torch

import llmopt
from llmopt.errors import OptionError
from llmopt.model.packing import PACK_BITS, pack_qweight, pack_qzeros, packed_length
from llmopt.quant.gptq import GPTQConfig
from llmopt.quant.grids.integer import group_count
from llmopt.quant.pipeline import QuantizeSpec
from llmopt.quantized_tensor import QuantizedTensor


# vLLM fuses these projections into one layer and looks its `dynamic` override up by the fused name.
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def dynamic_overrides(modules: Mapping[str, tuple[int, int]]) -> dict[str, dict[str, int]]:
    """GPTQModel's `dynamic`: one `+:` pattern per parent module and (bits, group_size), naming its
    modules exactly, plus vLLM's fused name when all of a fused group's parts are in it (they then
    share one setting, which a fused kernel needs)."""
    groups: dict[tuple[str, tuple[int, int]], list[str]] = {}
    for module, setting in modules.items():
        parent, _, leaf = module.rpartition(".")
        groups.setdefault((parent, setting), []).append(leaf)
    out: dict[str, dict[str, int]] = {}
    for (parent, (bits, group_size)), leaves in groups.items():
        names = sorted(leaves) + [fused for fused, parts in FUSED.items() if set(parts) <= set(leaves)]
        prefix = re.escape(parent) + r"\." if parent else ""
        out[f"+:^{prefix}({'|'.join(names)})$"] = {"bits": bits, "group_size": group_size if group_size > 0 else -1}
    return out


class GPTQLayout:
    name = "gptq"
    bits = PACK_BITS

    def check(self, spec: QuantizeSpec) -> None:
        for bits in {spec.method.bits, *(b for b, _ in spec.dynamic.values())}:
            if bits not in PACK_BITS:
                raise OptionError(f"<bits> {bits}: GPTQ checkpoints hold {', '.join(map(str, PACK_BITS))} bits "
                                  f"(use <fmt> dense for other widths)")  # fmt: skip

    def parts(self, out_f: int, in_f: int, bits: int, group_size: int,
              spec: QuantizeSpec | None = None) -> list[tuple[str, tuple[int, ...], torch.dtype]]:  # fmt: skip
        groups = group_count(in_f, group_size)
        return [("qweight", (packed_length(in_f, bits), out_f), torch.int32),
                ("qzeros", (groups, packed_length(out_f, bits)), torch.int32),
                ("scales", (groups, out_f), torch.float16),
                ("g_idx", (in_f,), torch.int32)]  # fmt: skip

    def tensors(self, qt: QuantizedTensor) -> dict[str, torch.Tensor]:
        """One quantized linear as GPTQ v1 tensors (qweight, qzeros, scales, g_idx)."""
        out_f, in_f = qt.shape
        scales = qt.scales.to(torch.float32)
        if scales.shape[0] == 1 and out_f > 1:  # per-tensor: the same scale on every row
            scales = scales.expand(out_f, scales.shape[1])
        if qt.zeros is None:
            zeros = torch.full(scales.shape, 1 << (qt.bits - 1), dtype=torch.int64)
        else:
            zeros = qt.zeros.to(torch.int64).expand(scales.shape)
        if int(zeros.min()) < 1:
            raise ValueError("a zero point of 0 cannot be stored in GPTQ format v1 (quantize with zero_min=1)")
        return {
            "qweight": pack_qweight(qt.codes.t().contiguous(), qt.bits),
            "qzeros": pack_qzeros(zeros.t().contiguous(), qt.bits),
            "scales": scales.t().contiguous().to(torch.float16),
            "g_idx": qt.group_index().to(torch.int32),
        }

    def quantization_config(self, spec: QuantizeSpec, provenance: dict[str, Any],
                            modules: Mapping[str, tuple[int, int]] | None = None) -> dict[str, Any]:  # fmt: skip
        m = spec.method
        gptq = m if isinstance(m, GPTQConfig) else getattr(m, "gptq", None)
        return {
            "quant_method": "gptq",
            "bits": m.bits,
            "group_size": m.group_size if m.group_size > 0 else -1,
            "desc_act": bool(gptq and gptq.act_order),
            "sym": m.sym,
            "lm_head": spec.quantize_head,
            "true_sequential": True,
            "static_groups": bool(gptq and gptq.static_groups),
            "damp_percent": gptq.damp if gptq else None,
            "damp_auto_increment": gptq.damp_step if gptq else None,
            "mse": bool(m.mse),
            "checkpoint_format": "gptq",
            **({"dynamic": dynamic_overrides(spec.dynamic)} if spec.dynamic else {}),
            "pack_dtype": "int32",
            "meta": {"quantizer": [f"llmopt:{llmopt.__version__}"], "method": m.name, "llmopt": provenance},
        }


LAYOUT = GPTQLayout()


def gptq_tensors(qt: QuantizedTensor) -> dict[str, torch.Tensor]:
    return LAYOUT.tensors(qt)
