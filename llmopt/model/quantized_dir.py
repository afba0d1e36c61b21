"""HF directories whose linears are packed integers: GPTQ ("gptq" format v1, as AutoGPTQ, GPTQModel,
transformers and vLLM read them), AWQ (GEMM, as AutoAWQ, GPTQModel and vLLM read them) and
compressed-tensors pack-quantized (model/compressed_tensors.py).

A packed linear is stored as `qweight`, `qzeros`, `scales` (and `g_idx` for GPTQ); the source lists
it as one logical `<module>.weight` [out, in] and `load` returns it dequantized:

    GPTQ: W[o, i] = (code[i, o] - zero[g, o]) * scale[g, o],  g = g_idx[i],  zero = stored + 1 (v1)
    AWQ:  W[o, i] = (code[i, o] - zero[g, o]) * scale[g, o],  g = i // group_size

`quantized(module)` gives the same weight as a `QuantizedTensor` for readers that keep it packed.
"""

from __future__ import annotations

import re

import json
from pathlib import Path

import torch

from llmopt.errors import InputError
from llmopt.model import compressed_tensors as ct
from llmopt.model.ggml_types import GGMLQuantType
from llmopt.model.hf_dir import HFDirSource
from llmopt.model.packing import (FP8_CODE_BITS, FP8_GRID, FP8_STEP, NVFP4_GRID, PACK_BITS, e8m0_half_scale, fp8_codes,
                                  nvfp4_scales,
                                  unpack_awq, unpack_fp4_pairs, unpack_qweight,
                                  unpack_qzeros, unpack_rows)
from llmopt.model.validate import check_tensors
from llmopt.model.source import ModelSource, TensorInfo, torch_dtype
from llmopt.quantized_tensor import QuantizedTensor


class PackedDirSource(HFDirSource):
    """The shared part: logical `.weight` tensors for packed modules, dequantized on `load`."""

    method = ""  # the quant_method this reads
    label = ""  # its name in messages and tensor kinds (default: the method's, upper case)
    parts: tuple[str, ...] = ()  # the stored tensors of one module, the one that marks a packed module first
    optional: tuple[str, ...] = ("g_idx",)  # parts a module may lack
    vectors: tuple[str, ...] = ("g_idx",)  # 1-D parts

    def __init__(self, path: Path):
        super().__init__(path)
        q = self.quantization_config or {}
        try:
            self.bits = int(q.get("bits", q.get("w_bit", 4)))
            self.group_size = int(q.get("group_size", q.get("q_group_size", 128)))
        except (TypeError, ValueError):
            raise InputError(f"{path}: quantization_config has a bad bits or group_size") from None
        self.dynamic: list = []
        self.check_config(q)
        self.stored = self.unsplit()  # HFDirSource split the float tensors; the packed ones are listed here
        self.modules: dict[str, tuple[int, int]] = {}  # module -> (out, in)
        logical: dict[str, TensorInfo] = {}
        for name, info in self.stored.items():
            module, _, part = name.rpartition(".")
            if self.marks_module(part, info):
                parts = self.module_parts(module)
                for p in parts:
                    stored = self.stored.get(f"{module}.{p}")
                    if stored is None and p not in self.optional:
                        raise InputError(f"{path}: {module}.{p} is missing ({self.name} stores {', '.join(parts)})")
                    if stored is not None and len(stored.shape) != (1 if p in self.vectors else 2):
                        raise InputError(f"{path}: {module}.{p} has shape {list(stored.shape)}, expected "
                                         f"{'1' if p in self.vectors else '2'} dimensions")  # fmt: skip
                out_f, in_f = self.linear_shape(module, info.shape)
                self.modules[module] = (out_f, in_f)
                nbytes = sum(self.stored[f"{module}.{p}"].nbytes for p in parts if f"{module}.{p}" in self.stored)
                logical[f"{module}.weight"] = TensorInfo(f"{module}.weight", name, (out_f, in_f), self.module_kind(module), nbytes)
            elif part not in self.parts:
                logical[name] = info
        self.tensors = logical
        check_tensors(self.arch, {n: t.shape for n, t in logical.items()}, f"{path} ({self.name} {self.bits}-bit)")
        self.split_fused()  # a fused packed linear (Phi-3's qkv_proj) serves its parts by rows
        for part, (stored, lo, hi) in self.fused_rows.items():
            if stored.removesuffix(".weight") in self.modules:
                self.modules[part.removesuffix(".weight")] = (hi - lo, self.modules[stored.removesuffix(".weight")][1])

    @property
    def name(self) -> str:
        return self.label or self.method.upper()

    def marks_module(self, part: str, info: TensorInfo) -> bool:
        """Whether stored tensor `<module>.<part>` marks a quantized module (its first part)."""
        return part == self.parts[0]

    def module_parts(self, module: str) -> tuple[str, ...]:
        """The stored tensors of one quantized module."""
        return self.parts

    def module_kind(self, module: str) -> str:
        """Its storage type, as inspect shows it ("GPTQ4")."""
        return f"{self.name}{self.module_config(module)[0]}"

    def check_config(self, q: dict) -> None:
        """Refuse what this reader cannot read (one line)."""

    def module_config(self, module: str) -> tuple[int, int]:
        """(bits, group_size) of one module."""
        return self.bits, self.group_size

    def linear_shape(self, module: str, qweight_shape: tuple[int, ...]) -> tuple[int, int]:
        raise NotImplementedError

    def quantized(self, module: str) -> QuantizedTensor:
        """One packed linear as codes [out, in], scales and true zero points [out, groups], g_idx (a part
        of a fused linear: its rows)."""
        stored, rows = self.stored_rows(f"{module}.weight")
        qt = self.stored_quantized(stored.removesuffix(".weight"))
        return qt if rows is None else qt.take_rows(rows)

    def stored_quantized(self, module: str) -> QuantizedTensor:
        """One packed linear as the file stores it."""
        raise NotImplementedError

    def raw(self, module: str, part: str) -> torch.Tensor:
        name = f"{module}.{part}"
        return self._handles[self._file_of[name]].get_tensor(self._key.get(name, name))

    def load(self, name: str, dtype: torch.dtype | str | None = "float32") -> torch.Tensor:
        dtype = torch_dtype(dtype)
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module in self.modules:
            w = self.quantized(module).dequantize(torch.float32)
            return w.to(dtype or torch.float16)
        return super().load(name, dtype)

    def load_rows(self, name: str, rows: slice, dtype: torch.dtype | str | None = "float32") -> torch.Tensor:
        if name.endswith(".weight") and name.removesuffix(".weight") in self.modules:  # packed: unpacked whole
            return ModelSource.load_rows(self, name, rows, dtype)
        return super().load_rows(name, rows, dtype)

    def _checked(self, module: str, qt: QuantizedTensor) -> QuantizedTensor:
        index = qt.group_index()
        if int(index.min()) < 0:
            raise InputError(f"{self.path}: {module}.g_idx holds negative group numbers")
        groups = int(index.max()) + 1
        if qt.scales.shape != qt.zeros.shape or qt.scales.shape[0] != qt.shape[0] or groups > qt.scales.shape[1]:
            raise InputError(f"{self.path}: {module}: inconsistent {self.name} tensors (scales "
                             f"{tuple(qt.scales.shape)}, qzeros {tuple(qt.zeros.shape)}, groups used {groups})")  # fmt: skip
        return qt


class GPTQDirSource(PackedDirSource):
    """GPTQ v1 checkpoints, with GPTQModel's per-module `dynamic` overrides of bits and group size:
    `{"+:REGEX": {"bits": 8, "group_size": 64}}`, the first pattern that matches a module's name
    (re.match, as GPTQModel and vLLM apply them); `-:` patterns mark modules left unquantized."""

    kind = "hf-gptq"
    method = "gptq"
    parts = ("qweight", "qzeros", "scales", "g_idx")

    def check_config(self, q: dict) -> None:
        fmt = str(q.get("checkpoint_format", "gptq")).lower()
        dynamic = q.get("dynamic") or {}
        if not isinstance(dynamic, dict) or not all(isinstance(v, dict) for v in dynamic.values()):
            raise InputError(f"{self.path}: quantization_config.dynamic must map patterns to overrides")
        try:
            self.dynamic = [(re.compile(k.removeprefix("+:")), v) for k, v in dynamic.items() if not k.startswith("-:")]
        except re.error as e:
            raise InputError(f"{self.path}: quantization_config.dynamic has a bad pattern ({e})") from None
        for bits in {self.bits, *(int(v.get("bits", self.bits)) for _, v in self.dynamic)}:
            if bits not in PACK_BITS:
                raise InputError(f"{self.path}: GPTQ bits {bits} is not supported (supported: {', '.join(map(str, PACK_BITS))})")
        if fmt not in ("gptq", "gptq_v1"):
            raise InputError(f"{self.path}: GPTQ checkpoint_format {fmt!r} is not supported (only 'gptq', format v1)")

    def module_config(self, module: str) -> tuple[int, int]:
        """(bits, group_size) of one module: the checkpoint's, or its first matching `dynamic` override."""
        for pattern, override in self.dynamic:
            if pattern.match(module):
                return int(override.get("bits", self.bits)), int(override.get("group_size", self.group_size))
        return self.bits, self.group_size

    def linear_shape(self, module: str, qweight_shape: tuple[int, ...]) -> tuple[int, int]:
        g_idx = self.stored.get(f"{module}.g_idx")
        bits = self.module_config(module)[0]
        in_f = g_idx.shape[0] if g_idx is not None else qweight_shape[0] * 32 // bits
        if qweight_shape[0] * 32 != in_f * bits:  # 32 // bits codes per word (3-bit: 32 codes per 3 words)
            raise InputError(f"{self.path}: {module}.qweight has {qweight_shape[0]} rows; {bits}-bit codes of {in_f} inputs "
                             f"take {in_f * bits / 32:g}")  # fmt: skip
        return qweight_shape[1], in_f

    def stored_quantized(self, module: str) -> QuantizedTensor:
        out_f, in_f = self.modules[module]
        bits, group_size = self.module_config(module)
        codes = unpack_qweight(self.raw(module, "qweight"), bits, in_f).t().contiguous()
        zeros = unpack_qzeros(self.raw(module, "qzeros"), bits, out_f)
        if f"{module}.g_idx" in self.stored:
            g_idx = self.raw(module, "g_idx").to(torch.int64)
        else:
            g_idx = torch.arange(in_f) // (in_f if group_size <= 0 else group_size)
        qt = QuantizedTensor(codes=codes, scales=self.raw(module, "scales").t().contiguous(), bits=bits,
                             group_size=group_size, zeros=zeros.t().contiguous(), g_idx=g_idx, grid="int")  # fmt: skip
        return self._checked(module, qt)


class AWQDirSource(PackedDirSource):
    kind = "hf-awq"
    method = "awq"
    parts = ("qweight", "qzeros", "scales")

    def check_config(self, q: dict) -> None:
        version = str(q.get("version", "gemm")).lower()
        if version != "gemm":
            raise InputError(f"{self.path}: AWQ version {version!r} is not supported (only 'gemm')")
        if self.bits != 4:
            raise InputError(f"{self.path}: AWQ bits {self.bits} is not supported (GEMM checkpoints are 4-bit)")

    def linear_shape(self, module: str, qweight_shape: tuple[int, ...]) -> tuple[int, int]:
        return qweight_shape[1] * 8, qweight_shape[0]

    def stored_quantized(self, module: str) -> QuantizedTensor:
        out_f, in_f = self.modules[module]
        codes = unpack_awq(self.raw(module, "qweight"), out_f).t().contiguous()  # [in, out] -> [out, in]
        zeros = unpack_awq(self.raw(module, "qzeros"), out_f).t().contiguous()  # [groups, out] -> [out, groups]
        scales = self.raw(module, "scales").t().contiguous()
        group = in_f if self.group_size <= 0 else self.group_size
        qt = QuantizedTensor(codes=codes, scales=scales, bits=4, group_size=group, zeros=zeros, grid="int")
        return self._checked(module, qt)


class CompressedTensorsDirSource(PackedDirSource):
    """compressed-tensors `pack-quantized` checkpoints (llm-compressor's, llmopt's): per linear `weight_packed`
    int32 [out, in·b/32] (signed q + 2^(b−1), packed along the inputs), `weight_scale` [out, groups],
    `weight_zero_point` [out·b/32, groups] (asymmetric; packed along the outputs), `weight_g_idx` (old
    checkpoints with actorder "group") and `weight_shape` [2]. W = (q − zp)·s = (code − zero)·s, so the
    stored unsigned values are our codes and zeros; a symmetric module gets zero 2^(b−1) on every group.
    `float-quantized` FP8: `weight` float8_e4m3fn [out, in] and `weight_scale` [out, 1], W = weight·scale.
    `nvfp4-pack-quantized`: `weight_packed` uint8 [out, in/2] (E2M1 indices, low nibble first),
    `weight_scale` float8_e4m3fn [out, in/16], `weight_global_scale` float32 [1] (and `input_global_scale`
    [1] for NVFP4's activations, not used here), W = v·(weight_scale / weight_global_scale)."""

    kind = "hf-compressed-tensors"
    method = "compressed-tensors"
    label = "compressed-tensors"
    int_parts = ("weight_packed", "weight_scale", "weight_zero_point", "weight_g_idx", "weight_shape")
    nvfp4_parts = ("weight_packed", "weight_scale", "weight_global_scale")
    input_parts = {ct.FLOAT: "input_scale", ct.NVFP4_PACKED: "input_global_scale"}  # static activation scales
    parts = (*int_parts, "weight_global_scale", *input_parts.values())
    optional = ("weight_zero_point", "weight_g_idx")
    vectors = ("weight_g_idx", "weight_shape", "weight_global_scale", *input_parts.values())
    float_dtypes = (*HFDirSource.float_dtypes, "F8_E4M3")  # float-quantized weights, read with their scales

    def marks_module(self, part: str, info: TensorInfo) -> bool:
        return part == "weight_packed" or part == "weight" and info.dtype == "F8_E4M3"

    def module_parts(self, module: str) -> tuple[str, ...]:
        """Its stored tensors; a static activation scale is required where the scheme has one (llmopt's runtime
        keeps activations in its own dtype, but a file without it is not what its config says)."""
        s = self.scheme(module)
        weights = ("weight", "weight_scale") if self._fp8(module) else self.nvfp4_parts if s.nvfp4 else \
            self.nvfp4_parts[:2] if s.fp4 else self.int_parts  # MXFP4: packed values and E8M0 bytes
        return (*weights, self.input_parts[s.fmt]) if s.static_inputs else weights

    def module_kind(self, module: str) -> str:
        if self._fp8(module):
            return "CT-FP8"
        s = self.scheme(module)
        return ("CT-NVFP4" if s.nvfp4 else "CT-MXFP4") if s.fp4 else f"CT-INT{s.bits}"

    def _fp8(self, module: str) -> bool:
        info = self.stored.get(f"{module}.weight")
        return info is not None and info.dtype == "F8_E4M3"

    def check_config(self, q: dict) -> None:
        self.groups = ct.groups(self.path, q)
        self.schemes: dict[str, ct.WeightScheme] = {}

    def scheme(self, module: str) -> ct.WeightScheme:
        if module not in self.schemes:
            names = {n.rpartition(".")[0] for n in self.stored}
            scheme = ct.scheme_of(module, self.groups, names)
            if scheme is None:
                raise InputError(f"{self.path}: {module} is packed but no config group targets it")
            self.schemes[module] = scheme
        return self.schemes[module]

    def module_config(self, module: str) -> tuple[int, int]:
        s = self.scheme(module)
        return s.bits, s.group_size

    def linear_shape(self, module: str, packed_shape: tuple[int, ...]) -> tuple[int, int]:
        """(out, in) from `weight_shape` (FP8: the weight's own); every part's shape must agree with it."""
        s = self.scheme(module)
        if self._fp8(module) != (s.fmt == ct.FLOAT):
            raise InputError(f"{self.path}: {module} is stored {'float8' if self._fp8(module) else 'packed'} but its "
                             f"config group's weights are {s.kind} {s.bits}-bit ({s.fmt})")  # fmt: skip
        if s.fmt == ct.FLOAT:
            out_f, in_f = packed_shape
            scale = tuple(self.stored[f"{module}.weight_scale"].shape)
            if scale != (out_f, 1):
                raise InputError(f"{self.path}: {module}.weight_scale has shape {list(scale)}; a per-channel scale of "
                                 f"weight [{out_f}, {in_f}] is [{out_f}, 1]")  # fmt: skip
            self._check_parts(module, {"input_scale": (1,)}, "a per-tensor activation scale")
            return out_f, in_f
        if s.fp4:  # no weight_shape: the packed bytes give it
            out_f, in_f = packed_shape[0], packed_shape[1] * 2
            self._check_parts(module, ct.fp4_part_shapes(out_f, in_f, s.group_size),
                              f"weight_packed {list(packed_shape)} ({'NVFP4' if s.nvfp4 else 'MXFP4'})")  # fmt: skip
            return out_f, in_f
        shape = self.raw(module, "weight_shape")
        if shape.numel() != 2:
            raise InputError(f"{self.path}: {module}.weight_shape has {shape.numel()} values, expected 2 (out, in)")
        out_f, in_f = (int(v) for v in shape)
        expected = ct.int_part_shapes(out_f, in_f, s.bits, s.group_size)
        if not s.sym and f"{module}.weight_zero_point" not in self.stored:
            raise InputError(f"{self.path}: {module}.weight_zero_point is missing (its scheme is asymmetric)")
        self._check_parts(module, expected, f"weight_shape [{out_f}, {in_f}] at {s.bits} bits, group {s.group_size}")
        return out_f, in_f

    def _check_parts(self, module: str, expected: dict[str, tuple[int, ...]], given: str) -> None:
        for part, want in expected.items():
            info = self.stored.get(f"{module}.{part}")
            if info is not None and tuple(info.shape) != want:
                raise InputError(f"{self.path}: {module}.{part} has shape {list(info.shape)}; {given} needs {list(want)}")

    def stored_quantized(self, module: str) -> QuantizedTensor:
        out_f, in_f = self.modules[module]
        s = self.scheme(module)
        if s.fmt == ct.FLOAT:  # float8 values as codes, exactly (model/packing.py)
            scales = self.raw(module, "weight_scale").to(torch.float32) / FP8_STEP
            return QuantizedTensor(codes=fp8_codes(self.raw(module, "weight")), scales=scales, bits=FP8_CODE_BITS,
                                   group_size=in_f, grid=FP8_GRID)  # fmt: skip
        if s.nvfp4:  # E2M1 indices as codes, the e4m3 and global scales as the dequantizer combines them
            group_scale = self.raw(module, "weight_scale").to(torch.float32)
            global_scale = self.raw(module, "weight_global_scale").to(torch.float32).reshape(1, 1)
            return QuantizedTensor(codes=unpack_fp4_pairs(self.raw(module, "weight_packed")),
                                   scales=nvfp4_scales(group_scale, global_scale), bits=8, group_size=s.group_size,
                                   grid=NVFP4_GRID, aux={"group_scale": group_scale, "global_scale": global_scale})  # fmt: skip
        if s.fp4:  # MXFP4: the E8M0 bytes are llama.cpp's MXFP4 block exponents, the same grid (quant/grids/fp4.py)
            e = self.raw(module, "weight_scale")
            return QuantizedTensor(codes=unpack_fp4_pairs(self.raw(module, "weight_packed")), scales=e8m0_half_scale(e),
                                   bits=8, group_size=s.group_size, grid=GGMLQuantType.MXFP4.name, aux={"e": e})  # fmt: skip
        codes = unpack_rows(self.raw(module, "weight_packed").t().contiguous(), s.bits, in_f).t().contiguous()
        scales = self.raw(module, "weight_scale")
        if s.sym:
            zeros = torch.full(scales.shape, 1 << (s.bits - 1), dtype=torch.int32)
        else:
            zeros = unpack_rows(self.raw(module, "weight_zero_point"), s.bits, out_f)
        g_idx = self.raw(module, "weight_g_idx").to(torch.int64) if f"{module}.weight_g_idx" in self.stored else None
        qt = QuantizedTensor(codes=codes, scales=scales, bits=s.bits, group_size=s.group_size if s.group_size > 0 else in_f,
                             zeros=zeros, g_idx=g_idx, grid="int")  # fmt: skip
        return self._checked(module, qt)


READERS: dict[str, type[PackedDirSource]] = {"gptq": GPTQDirSource, "awq": AWQDirSource,
                                             "compressed-tensors": CompressedTensorsDirSource}  # fmt: skip


def open_hf_dir(path: Path) -> ModelSource:
    """An HF directory, read as GPTQ, AWQ or compressed-tensors when its config's quantization_config says so."""
    config_path = path / "config.json"
    config = {}
    if config_path.is_file():
        try:
            config = json.loads(config_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            config = {}
    q = config.get("quantization_config") if isinstance(config, dict) else None
    if q is not None and not isinstance(q, dict):
        raise InputError(f"{config_path}: `quantization_config` must be an object, got {type(q).__name__}")
    method = str(q.get("quant_method", "")).lower() if isinstance(q, dict) else ""
    return READERS[method](path) if method in READERS else HFDirSource(path)
