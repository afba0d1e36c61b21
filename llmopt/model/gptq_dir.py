"""GPTQ checkpoints (AutoGPTQ / GPTQModel / transformers "gptq" format v1) read as logical weights.

A quantized linear is stored as `qweight`, `qzeros`, `scales`, `g_idx` (and `bias`); this source
lists it as one `<module>.weight` [out, in] and `load` returns it dequantized:

    W[o, i] = (code[i, o] - zero[g, o]) * scale[g, o],   g = g_idx[i],   zero = stored + 1 (v1)

`quantized(module)` gives the same weight as a `QuantizedTensor` (codes, scales, true zero points,
g_idx) for readers that keep weights packed.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from llmopt.errors import InputError
from llmopt.model.hf_dir import HFDirSource
from llmopt.model.packing import PACK_BITS, unpack_qweight, unpack_qzeros
from llmopt.model.source import ModelSource, TensorInfo
from llmopt.quantized_tensor import QuantizedTensor

PARTS = ("qweight", "qzeros", "scales", "g_idx")


def is_gptq_config(config: dict) -> bool:
    q = config.get("quantization_config") or {}
    return isinstance(q, dict) and str(q.get("quant_method", "")).lower() == "gptq"


class GPTQDirSource(HFDirSource):
    """An HF directory whose linears are GPTQ-packed; tensors are listed and loaded as dense weights."""

    kind = "hf-gptq"

    def __init__(self, path: Path):
        super().__init__(path)
        q = self.quantization_config or {}
        self.bits = int(q.get("bits", 4))
        self.group_size = int(q.get("group_size", 128))
        fmt = str(q.get("checkpoint_format", "gptq")).lower()
        if self.bits not in PACK_BITS:
            raise InputError(f"{path}: GPTQ bits {self.bits} is not supported (supported: {', '.join(map(str, PACK_BITS))})")
        if fmt not in ("gptq", "gptq_v1"):
            raise InputError(f"{path}: GPTQ checkpoint_format {fmt!r} is not supported (only 'gptq', format v1)")
        self.stored = self.tensors
        self.modules: dict[str, tuple[int, int]] = {}  # module -> (out, in)
        logical: dict[str, TensorInfo] = {}
        for name, info in self.stored.items():
            module, _, part = name.rpartition(".")
            if part in PARTS:
                if part == "qweight":
                    out_f = info.shape[1]
                    in_f = self.stored[f"{module}.g_idx"].shape[0] if f"{module}.g_idx" in self.stored \
                        else info.shape[0] * 32 // self.bits
                    self.modules[module] = (out_f, in_f)
                    nbytes = sum(self.stored[f"{module}.{p}"].nbytes for p in PARTS if f"{module}.{p}" in self.stored)
                    logical[f"{module}.weight"] = TensorInfo(f"{module}.weight", name, (out_f, in_f), f"GPTQ{self.bits}", nbytes)
                continue
            logical[name] = info
        self.tensors = logical

    def quantized(self, module: str) -> QuantizedTensor:
        """One packed linear as codes [out, in], scales and true zero points [out, groups], g_idx [in]."""
        out_f, in_f = self.modules[module]

        def raw(part: str) -> torch.Tensor:
            return self.load_stored(f"{module}.{part}")

        codes = unpack_qweight(raw("qweight"), self.bits, in_f).t().contiguous()
        zeros = unpack_qzeros(raw("qzeros"), self.bits, out_f)
        scales = raw("scales")
        if f"{module}.g_idx" in self.stored:
            g_idx = raw("g_idx").to(torch.int64)
        else:
            gs = in_f if self.group_size <= 0 else self.group_size
            g_idx = torch.arange(in_f) // gs
        if tuple(scales.shape) != tuple(zeros.shape) or scales.shape[1] != out_f or int(g_idx.max()) >= scales.shape[0]:
            raise InputError(f"{self.path}: {module}: inconsistent GPTQ tensors (scales {tuple(scales.shape)}, "
                             f"qzeros {tuple(zeros.shape)}, groups used {int(g_idx.max()) + 1})")
        return QuantizedTensor(codes=codes, scales=scales.t().contiguous(), bits=self.bits, group_size=self.group_size,
                               zeros=zeros.t().contiguous(), g_idx=g_idx, grid="int")  # fmt: skip

    def load_stored(self, name: str) -> torch.Tensor:
        return self._handles[self._file_of[name]].get_tensor(name)

    def load(self, name: str, dtype: torch.dtype | None = torch.float32) -> torch.Tensor:
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module in self.modules:
            w = self.quantized(module).dequantize(torch.float32)
            return w.to(dtype or torch.float16)
        return super().load(name, dtype)


def open_hf_dir(path: Path) -> ModelSource:
    """An HF directory, read as GPTQ when its config says so."""
    config_path = path / "config.json"
    if config_path.is_file():
        try:
            config = json.loads(config_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            config = {}
        if isinstance(config, dict) and is_gptq_config(config):
            return GPTQDirSource(path)
    return HFDirSource(path)
