"""GPTQ checkpoints ("gptq" format v1, as AutoGPTQ, GPTQModel, transformers and vLLM read them) and
dense dequantized HF directories, streamed from the quantization pipeline block by block.

Per quantized linear `<module>`:
    qweight int32 [in·bits/32, out]   codes packed along the input dim (llmopt.model.packing)
    qzeros  int32 [groups, out·bits/32] zero points − 1, packed along the output dim
    scales  float16 [groups, out]
    g_idx   int32 [in]                group of each input column (permuted under act-order)
    bias    float16 [out]             when the layer has one (copied from the source)
Everything else (embeddings, norms, an unquantized head) is written as float16 from the source.
`config.json` carries `quantization_config`; `quantize_config.json` repeats it for older readers.
The tensor plan is known before any block is quantized, so shards stream: each block's results
are written and dropped before the next block runs.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

import llmopt
from llmopt.errors import InputError
from llmopt.formats.atomic import atomic_output_dir
from llmopt.formats.safetensors_stream import PlannedTensor, write_sharded
from llmopt.model.packing import PACK_BITS, pack_qweight, pack_qzeros, packed_length
from llmopt.model.source import ModelSource
from llmopt.quant.int_grid import group_count
from llmopt.quant.pipeline import HEAD, LINEARS, BlockResult, QuantizeSpec
from llmopt.quant.tensor import QuantizedTensor

FORMATS = ("gptq", "dense")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "generation_config.json")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def check_gptq_spec(spec: QuantizeSpec) -> None:
    """Refuse what a GPTQ checkpoint cannot hold, before any work is done."""
    if spec.bits not in PACK_BITS:
        raise InputError(f"--bits {spec.bits}: GPTQ checkpoints hold {', '.join(map(str, PACK_BITS))} bits "
                         f"(use --format dense for other widths)")


def quantization_config(spec: QuantizeSpec, provenance: dict[str, Any]) -> dict[str, Any]:
    cfg = spec.gptq or spec.rtn
    assert cfg is not None
    gptq = spec.gptq
    return {
        "quant_method": "gptq",
        "bits": spec.bits,
        "group_size": spec.group_size if spec.group_size > 0 else -1,
        "desc_act": bool(gptq and gptq.act_order),
        "sym": spec.sym,
        "lm_head": spec.quantize_head,
        "true_sequential": True,
        "static_groups": bool(gptq and gptq.static_groups),
        "damp_percent": gptq.damp if gptq else None,
        "damp_auto_increment": gptq.damp_step if gptq else None,
        "mse": bool(cfg.mse),
        "checkpoint_format": "gptq",
        "pack_dtype": "int32",
        "meta": {"quantizer": [f"llmopt:{llmopt.__version__}"], "method": spec.method, "llmopt": provenance},
    }


def _quantized_modules(source: ModelSource, spec: QuantizeSpec) -> list[str]:
    names = [f"model.layers.{i}.{lin}" for i in range(source.arch.num_layers) for lin in LINEARS]
    return names + ([HEAD] if spec.quantize_head else [])


def _order(name: str) -> tuple[int, int, str]:
    """Embeddings, then blocks in layer order, then the final norm and head: the pipeline's order."""
    m = _LAYER.match(name)
    if m:
        return (1, int(m.group(1)), name)
    return (0 if "embed_tokens" in name else 2, 0, name)


def plan_tensors(source: ModelSource, spec: QuantizeSpec, fmt: str) -> tuple[list[PlannedTensor], dict[str, str]]:
    """Every tensor to write, and for quantized ones the module that produces it."""
    arch = source.arch
    quantized = set(_quantized_modules(source, spec))
    names = [n for n in source.tensors if n.removesuffix(".weight") not in quantized or not n.endswith(".weight")]
    if spec.quantize_head and "lm_head.weight" not in source.tensors:
        names.append("lm_head.weight")  # a tied head gets its own quantized copy
    if arch.tie_word_embeddings and not spec.quantize_head:
        names = [n for n in names if n != "lm_head.weight"]
    plan: list[PlannedTensor] = []
    producer: dict[str, str] = {}
    for module in quantized:
        names.append(f"{module}.weight")
    for name in sorted(set(names), key=_order):
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module in quantized:
            out_f, in_f = _linear_shape(source, module)
            if fmt == "dense":
                plan.append(PlannedTensor(name, (out_f, in_f), torch.float16))
                producer[name] = module
                continue
            groups = group_count(in_f, spec.group_size)
            for part, shape, dtype in (("qweight", (packed_length(in_f, spec.bits), out_f), torch.int32),
                                       ("qzeros", (groups, packed_length(out_f, spec.bits)), torch.int32),
                                       ("scales", (groups, out_f), torch.float16),
                                       ("g_idx", (in_f,), torch.int32)):
                plan.append(PlannedTensor(f"{module}.{part}", shape, dtype))
                producer[f"{module}.{part}"] = module
        else:
            plan.append(PlannedTensor(name, source.tensors[name].shape, torch.float16))
    return plan, producer


def _linear_shape(source: ModelSource, module: str) -> tuple[int, int]:
    if module == HEAD:
        name = "lm_head.weight" if "lm_head.weight" in source.tensors else "model.embed_tokens.weight"
    else:
        name = f"{module}.weight"
    out_f, in_f = source.tensors[name].shape
    return int(out_f), int(in_f)


def gptq_tensors(qt: QuantizedTensor) -> dict[str, torch.Tensor]:
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


class _Results:
    """Pulls block results from the pipeline as the writer asks for their tensors (one block held)."""

    def __init__(self, blocks: Iterator[BlockResult], on_block: Callable[[BlockResult], None] | None):
        self.blocks = blocks
        self.on_block = on_block
        self.held: dict[str, QuantizedTensor] = {}
        self.packed: dict[str, dict[str, torch.Tensor]] = {}

    def get(self, module: str) -> QuantizedTensor:
        while module not in self.held:
            try:
                result = next(self.blocks)
            except StopIteration:
                raise RuntimeError(f"the pipeline produced no result for {module}") from None
            self.held = dict(result.tensors)  # drop the previous block's results
            self.packed.clear()
            if self.on_block:
                self.on_block(result)
        return self.held[module]

    def finish(self) -> None:
        for result in self.blocks:  # a head or trailing results not asked for (none in practice)
            if self.on_block:
                self.on_block(result)


def write_quantized(source: ModelSource, spec: QuantizeSpec, blocks: Iterator[BlockResult], out: Path,
                    fmt: str = "gptq", provenance: dict[str, Any] | None = None, force: bool = False,
                    max_shard_bytes: int = 5 * 10**9, on_block: Callable[[BlockResult], None] | None = None) -> Path:
    """Write the pipeline's results for `source` as a GPTQ (or dense) HF directory at `out`, atomically."""
    if fmt not in FORMATS:
        raise InputError(f"bad --format {fmt!r}; choose one of {', '.join(FORMATS)}")
    provenance = provenance or {}
    plan, producer = plan_tensors(source, spec, fmt)
    results = _Results(blocks, on_block)

    def produce(t: PlannedTensor) -> torch.Tensor:
        module = producer.get(t.name)
        if module is None:
            return source.load(t.name, dtype=torch.float32).to(torch.float16)
        qt = results.get(module)
        if fmt == "dense":
            return qt.dequantize(torch.float32).to(torch.float16)
        if module not in results.packed:
            results.packed[module] = gptq_tensors(qt)
        return results.packed[module][t.name.rpartition(".")[2]]

    with atomic_output_dir(out, force=force) as tmp:
        metadata = {"format": "pt", "producer": f"llmopt {llmopt.__version__}", "source": source.path.name}
        write_sharded(tmp, plan, produce, max_shard_bytes, metadata)
        results.finish()
        config = source.arch.to_hf_config("float16")
        if spec.quantize_head:
            config["tie_word_embeddings"] = False
        config.update(_special_ids(source))
        config["llmopt"] = {"version": llmopt.__version__, "quantized_from": source.path.name, **provenance}
        if fmt == "gptq":
            qcfg = quantization_config(spec, provenance)
            config["quantization_config"] = qcfg
            (tmp / "quantize_config.json").write_text(json.dumps(qcfg, indent=2) + "\n")
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        _copy_tokenizer(source, tmp)
    return out.expanduser().resolve()


def _special_ids(source: ModelSource) -> dict[str, int]:
    tok = source.tokenizer()
    if tok is None:
        return {}
    ids = {f"{k}_token_id": tok.token_id(getattr(tok, f"{k}_token")) for k in ("bos", "eos", "pad")}
    return {k: v for k, v in ids.items() if v is not None}


def _copy_tokenizer(source: ModelSource, directory: Path) -> None:
    """Tokenizer files verbatim from an HF source; rebuilt from metadata for a GGUF source."""
    copied = False
    if source.path.is_dir():
        for name in TOKENIZER_FILES:
            if (source.path / name).is_file():
                shutil.copyfile(source.path / name, directory / name)
                copied = True
    if not copied:
        tok = source.tokenizer()
        if tok is not None:
            tok.save_hf(directory, model_max_length=source.arch.max_position_embeddings)
        (directory / "generation_config.json").write_text(json.dumps(_special_ids(source), indent=2) + "\n")
