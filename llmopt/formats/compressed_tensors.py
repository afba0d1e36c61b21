"""The compressed-tensors checkpoint layout, `pack-quantized` (llm-compressor's format; vLLM's native one).

Per quantized linear `<module>` (4 or 8 bits, contiguous groups or one group per row):
    weight_packed      int32 [out, in·bits/32]   signed q = code − 2^(b−1), stored offset by 2^(b−1) (= our
                                                  code), packed along the input dim, value k at bits b·k
    weight_scale       float16 [out, groups]      (groups 1: strategy "channel")
    weight_zero_point  int32 [out·bits/32, groups] asymmetric only: signed zp = zero − 2^(b−1), stored offset
                                                  (= our zero), packed along the output dim
    weight_shape       int64 [2]                  (out, in), the dtype compressed-tensors itself writes
W = (q − zp)·scale = (code − zero)·scale, so the codes are written without re-rounding.

`--scheme fp8-dynamic` (quant/grids/fp8.py) is written `float-quantized`: `weight` float8_e4m3fn [out, in]
and `weight_scale` float32 [out, 1], W = weight·scale, with activations quantized per token at run time
(`input_activations` dynamic, strategy "token"), vLLM's FP8 W8A8.

`--scheme nvfp4a16` (quant/grids/nvfp4.py) is written `nvfp4-pack-quantized`: `weight_packed` uint8
[out, in/2] (E2M1 indices, column 2k in the low nibble of byte k, 2k+1 in the high one), `weight_scale`
float8_e4m3fn [out, in/16] and `weight_global_scale` float32 [1], W = v·(weight_scale / weight_global_scale),
strategy "tensor_group" (compressed-tensors' NVFP4A16 preset; no `weight_shape`, as the package writes none).
`--scheme mxfp4a16` (the GGUF MXFP4 grid, quant/grids/fp4.py) is written `mxfp4-pack-quantized`: the same
`weight_packed` and `weight_scale` uint8 [out, in/32], the E8M0 byte e of w = 2^(e−127)·v (MXFP4A16 preset).

`config.json`'s `quantization_config` has one `config_groups` entry per (bits, group size) with a `re:`
target naming exactly its modules (several with `--target-bpw`), the head in `ignore` when it stays float.
compressed-tensors ≥ 0.18 refuses `actorder: "group"` (columns in permuted groups, `weight_g_idx`), so
`--act-order` needs `--static-groups` here, written as `actorder: "weight"` (contiguous groups).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

from llmopt.errors import OptionError
from llmopt.model.compressed_tensors import FLOAT, MXFP4_PACKED, NVFP4_PACKED, PACKED, fp4_part_shapes, int_part_shapes
from llmopt.model.packing import pack_fp4_pairs, pack_rows
from llmopt.quant.grids import fp8, nvfp4
from llmopt.quant.grids.fp4 import MXFP4
from llmopt.quant.pipeline import HEAD, QuantizeSpec
from llmopt.quant.rtn import INPUT_ABSMAX
from llmopt.quantized_tensor import QuantizedTensor

QUANT_METHOD = "compressed-tensors"
BITS = (4, 8)  # what vLLM's WNA16 kernels (Marlin, Machete) take from this format
FORMAT_VERSION = "0.20.1"  # the compressed-tensors release this layout was checked against
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def _act_order(spec: QuantizeSpec) -> tuple[bool, bool]:
    """(act_order, static_groups) of the method, or of awq+gptq's GPTQ."""
    gptq = getattr(spec.method, "gptq", None) or spec.method
    return bool(getattr(gptq, "act_order", False)), bool(getattr(gptq, "static_groups", False))


def float_grid(spec: QuantizeSpec) -> str | None:
    """The float grid a `--scheme` rounds every module onto (FP8, NVFP4, MXFP4), or None (integer grids)."""
    if spec.grids is None:
        return None
    name = spec.grid_for(HEAD).name
    return name if name in (fp8.NAME, nvfp4.NVFP4.name, MXFP4.name) else None


def static_inputs(spec: QuantizeSpec) -> bool:
    """Whether the spec measured each linear's input range for static activation scales (`--scheme fp8`, `nvfp4`)."""
    return bool(getattr(spec.method, "observe_inputs", False))


def float_scheme(grid: str, static: bool) -> dict[str, Any]:
    """A float scheme's config group as compressed-tensors' presets state it. FP8 (FP8_DYNAMIC): float8 weights
    per channel, static; activations float8 per token, dynamic, or (`static`) per tensor with a calibrated scale
    (FP8's activations; its weights are per tensor, ours stay per channel). NVFP4A16: FP4 weights in groups of 16
    with e4m3 scales under a per-tensor global scale ("tensor_group"); activations unquantized, or (`static`,
    NVFP4) FP4 per 16 at run time under a calibrated global scale. MXFP4A16: FP4 weights in groups of 32 under an
    E8M0 power-of-two scale byte ("group", scale_dtype uint8); activations unquantized."""
    if grid == MXFP4.name:
        weights = {"num_bits": 4, "type": "float", "symmetric": True, "group_size": MXFP4.block, "strategy": "group",
                   "block_structure": None, "dynamic": False, "observer": "minmax", "observer_kwargs": {},
                   "scale_dtype": "torch.uint8"}  # fmt: skip
        return {"weights": weights, "input_activations": None, "output_activations": None, "format": MXFP4_PACKED}
    if grid == nvfp4.NVFP4.name:
        weights = {"num_bits": 4, "type": "float", "symmetric": True, "group_size": nvfp4.NVFP4.group_size,
                   "strategy": "tensor_group", "block_structure": None, "dynamic": False, "observer": "minmax",
                   "observer_kwargs": {}, "scale_dtype": "torch.float8_e4m3fn"}  # fmt: skip
        acts = {**weights, "dynamic": "local", "observer": "static_minmax"} if static else None
        return {"weights": weights, "input_activations": acts, "output_activations": None, "format": NVFP4_PACKED}
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None, "strategy": "channel",
               "block_structure": None, "dynamic": False, "observer": "minmax", "observer_kwargs": {}}  # fmt: skip
    acts = {**weights, "strategy": "tensor", "observer": "static_minmax"} if static else {**weights, "strategy": "token", "dynamic": True, "observer": None}
    return {"weights": weights, "input_activations": acts, "output_activations": None, "format": FLOAT}


INPUT_SCALES = {fp8.NAME: "input_scale", nvfp4.NVFP4.name: "input_global_scale"}  # a static activation scale's part


def input_scale(grid: str, absmax: torch.Tensor) -> torch.Tensor:
    """The static activation scale of an input whose max |x| is `absmax`, float32 [1], as compressed-tensors'
    observers make it: FP8 absmax / 448 (float32's eps for 0); NVFP4's global scale 448·6 / absmax."""
    absmax = one_per_tensor(absmax, "input range")
    if grid == nvfp4.NVFP4.name:
        return nvfp4.global_scale(absmax).reshape(1)
    scale = absmax / fp8.FP8_MAX
    return torch.where(scale == 0, torch.finfo(torch.float32).eps, scale)


def targets(modules: list[str]) -> str:
    """One `re:` target that matches exactly `modules` (re.match, as compressed-tensors and vLLM apply it):
    the layers that share a set of module paths, alternated."""
    paths: dict[str, set[int]] = {}
    other: list[str] = []
    for module in modules:
        m = _LAYER.match(module)
        if m is None:
            other.append(re.escape(module))
        else:
            paths.setdefault(m.group(2), set()).add(int(m.group(1)))
    by_layers: dict[tuple[int, ...], list[str]] = {}
    for path, layers in paths.items():
        by_layers.setdefault(tuple(sorted(layers)), []).append(re.escape(path))
    parts = [rf"model\.layers\.({'|'.join(map(str, layers))})\.({'|'.join(sorted(ps))})"
             for layers, ps in sorted(by_layers.items())] + sorted(other)  # fmt: skip
    return f"re:^({'|'.join(parts)})$"


def weight_args(bits: int, group_size: int, sym: bool, actorder: str | None) -> dict[str, Any]:
    """A group's `weights` (compressed-tensors' QuantizationArgs): integer, static, group or channel."""
    grouped = group_size > 0
    args: dict[str, Any] = {"num_bits": bits, "type": "int", "symmetric": sym,
                            "group_size": group_size if grouped else None,
                            "strategy": "group" if grouped else "channel", "block_structure": None,
                            "dynamic": False, "observer": "minmax", "observer_kwargs": {}}  # fmt: skip
    if actorder:
        args["actorder"] = actorder
    return args


def one_per_tensor(g: torch.Tensor, what: str) -> torch.Tensor:
    """A per-tensor value as float32 [1] (linears stored as one, as Phi-3's qkv_proj, repeat theirs by rows: the
    stage's linears share one)."""
    g = g.to(torch.float32).reshape(-1)
    if not bool((g == g[0]).all()):
        raise ValueError(f"linears stored as one need one {what}")
    return g[:1].contiguous()


class CompressedTensorsLayout:
    name = QUANT_METHOD
    bits = BITS

    def check(self, spec: QuantizeSpec) -> None:
        if float_grid(spec):
            return
        for bits in sorted({spec.method.bits, *(b for b, _ in spec.dynamic.values())}):
            if bits not in self.bits:
                raise OptionError(f"<bits> {bits}: compressed-tensors checkpoints hold "
                                  f"{' or '.join(map(str, BITS))} bits (use <fmt> gptq or dense for others)")  # fmt: skip
        act_order, static = _act_order(spec)
        if act_order and not static and spec.method.group_size > 0:
            raise OptionError("<act_order> needs <static_groups> in compressed-tensors checkpoints: compressed-tensors "
                              "0.18 removed permuted groups (actorder 'group', g_idx); or use <fmt> gptq")  # fmt: skip

    def parts(self, out_f: int, in_f: int, bits: int, group_size: int,
              spec: QuantizeSpec | None = None) -> list[tuple[str, tuple[int, ...], torch.dtype]]:  # fmt: skip
        grid = float_grid(spec) if spec is not None else None
        if grid:
            inputs = [(INPUT_SCALES[grid], (1,), torch.float32)] if static_inputs(spec) else []
            if grid == fp8.NAME:
                return [("weight", (out_f, in_f), torch.float8_e4m3fn), ("weight_scale", (out_f, 1), torch.float32), *inputs]
            if grid == MXFP4.name:
                dtypes = {"weight_packed": torch.uint8, "weight_scale": torch.uint8}
            else:
                dtypes = {"weight_packed": torch.uint8, "weight_scale": torch.float8_e4m3fn,
                          "weight_global_scale": torch.float32}  # fmt: skip
            shapes = fp4_part_shapes(out_f, in_f, MXFP4.block if grid == MXFP4.name else nvfp4.NVFP4.group_size)
            return [(part, shapes[part], dtype) for part, dtype in dtypes.items()] + inputs
        if group_size > 0 and in_f % group_size:
            raise OptionError(f"<group_size> {group_size} does not divide a linear's {in_f} inputs: compressed-tensors "
                              f"readers (the package, transformers, vLLM) take whole groups only; use a divisor of "
                              f"{in_f} or -1")  # fmt: skip
        shapes = int_part_shapes(out_f, in_f, bits, group_size)
        dtypes = {"weight_packed": torch.int32, "weight_scale": torch.float16, "weight_zero_point": torch.int32,
                  "weight_shape": torch.int64}  # fmt: skip
        if spec is None or spec.method.sym:  # zero points only where the grid is asymmetric
            del dtypes["weight_zero_point"]
        return [(part, shapes[part], dtype) for part, dtype in dtypes.items()]

    def tensors(self, qt: QuantizedTensor) -> dict[str, torch.Tensor]:
        """One quantized linear as pack-quantized tensors; per-tensor parameters repeat on every row."""
        out_f, in_f = qt.shape
        if qt.grid == MXFP4.name:  # the block exponents are compressed-tensors' E8M0 scale bytes (2^(e-127)·v)
            return {"weight_packed": pack_fp4_pairs(qt.codes), "weight_scale": qt.aux["e"].to(torch.uint8).contiguous()}
        if qt.grid in INPUT_SCALES:
            inputs = {INPUT_SCALES[qt.grid]: input_scale(qt.grid, qt.aux[INPUT_ABSMAX])} if INPUT_ABSMAX in qt.aux else {}
            if qt.grid == fp8.NAME:  # exact: scale·2^9 undoes the code's step (quant/grids/fp8.py)
                return {"weight": fp8.values_of(qt.codes), "weight_scale": (qt.scales.to(torch.float32) * fp8.STEP).contiguous(),
                        **inputs}  # fmt: skip
            return {"weight_packed": pack_fp4_pairs(qt.codes),  # the e4m3 group scales and global scale as chosen
                    "weight_scale": qt.aux["group_scale"].to(torch.float8_e4m3fn).contiguous(),
                    "weight_global_scale": one_per_tensor(qt.aux["global_scale"], "NVFP4 global scale"), **inputs}  # fmt: skip
        if qt.g_idx is not None and not torch.equal(qt.group_index(), QuantizedTensor(
                qt.codes, qt.scales, qt.bits, qt.group_size).group_index()):  # fmt: skip
            raise ValueError("compressed-tensors checkpoints keep no g_idx: groups must be contiguous")
        rows = (out_f, qt.scales.shape[1])
        out = {"weight_packed": pack_rows(qt.codes.t(), qt.bits).t().contiguous(),
               "weight_scale": qt.scales.to(torch.float32).expand(rows).to(torch.float16).contiguous()}  # fmt: skip
        if qt.zeros is not None:
            out["weight_zero_point"] = pack_rows(qt.zeros.to(torch.int64).expand(rows), qt.bits)
        out["weight_shape"] = torch.tensor([out_f, in_f], dtype=torch.int64)
        return out

    def quantization_config(self, spec: QuantizeSpec, provenance: dict[str, Any],
                            modules: Mapping[str, tuple[int, int]] | None = None) -> dict[str, Any]:  # fmt: skip
        """One config group per (bits, group size), each naming its modules (`modules`: stored module ->
        its setting; without it, every Linear but the head in one group)."""
        grid = float_grid(spec)
        if grid:
            scheme = float_scheme(grid, static_inputs(spec))
            groups = {"group_0": {"targets": [targets(list(modules))] if modules else ["Linear"], **scheme}}
            return self._config(spec, groups, scheme["format"])
        act_order, static = _act_order(spec)
        actorder = "weight" if act_order and static else None
        settings: dict[tuple[int, int], list[str]] = {}
        for module, setting in (modules or {}).items():
            settings.setdefault(setting, []).append(module)
        groups = {f"group_{i}": {"targets": [targets(names)], "weights": weight_args(*setting, spec.method.sym, actorder),
                                 "input_activations": None, "output_activations": None, "format": PACKED}
                  for i, (setting, names) in enumerate(sorted(settings.items()))}  # fmt: skip
        if not groups:
            groups = {"group_0": {"targets": ["Linear"], "input_activations": None, "output_activations": None,
                                  "weights": weight_args(spec.method.bits, spec.method.group_size, spec.method.sym, actorder),
                                  "format": PACKED}}  # fmt: skip
        return self._config(spec, groups, PACKED)

    def _config(self, spec: QuantizeSpec, groups: dict[str, Any], fmt: str) -> dict[str, Any]:
        return {
            "quant_method": QUANT_METHOD,
            "format": fmt,
            "quantization_status": "compressed",
            "config_groups": groups,
            "ignore": [] if spec.quantize_head else [HEAD],
            "kv_cache_scheme": None,
            "global_compression_ratio": None,
            "sparsity_config": {},
            "transform_config": {},
            "version": FORMAT_VERSION,
        }


LAYOUT = CompressedTensorsLayout()
