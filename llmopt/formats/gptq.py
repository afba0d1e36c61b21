"""GPTQ checkpoints ("gptq" format v1, as AutoGPTQ, GPTQModel, transformers and vLLM read them) and
dense dequantized HF directories, written block by block as the quantization pipeline yields them.

Per quantized linear `<module>`:
    qweight int32 [in·bits/32, out]   codes packed along the input dim (llmopt.model.packing)
    qzeros  int32 [groups, out·bits/32] zero points − 1, packed along the output dim
    scales  float16 [groups, out]
    g_idx   int32 [in]                group of each input column (permuted under act-order)
    bias    float16 [out]             when the layer has one (copied from the source)
Everything else (embeddings, norms, an unquantized head) is written as float16 from the source.
`config.json` carries `quantization_config`; `quantize_config.json` repeats it for older readers.

`CheckpointWriter` is a sink: the caller hands it each `BlockResult` (`add`) and then `finish`es.
The tensor plan is known before any block is quantized, so shards stream: each tensor is written
as soon as everything before it is, and a block's results are dropped once written.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import torch

import llmopt
from llmopt.errors import OptionError
from llmopt.formats.atomic import AtomicDir
from llmopt.formats.safetensors_stream import PlannedTensor, ShardedWriter
from llmopt.model.packing import PACK_BITS, pack_qweight, pack_qzeros, packed_length
from llmopt.model.source import ModelSource
from llmopt.quant.grids.integer import group_count
from llmopt.quant.gptq import GPTQConfig
from llmopt.quant.pipeline import HEAD, BlockResult, QuantizeSpec, head_weight_name, quantized_modules
from llmopt.quantized_tensor import QuantizedTensor

FORMATS = ("gptq", "dense")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "generation_config.json")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def check_format(fmt: str) -> str:
    if fmt not in FORMATS:
        raise OptionError(f"bad <fmt> {fmt!r}; choose one of {', '.join(FORMATS)}")
    return fmt


def zero_min(fmt: str, sym: bool) -> int:
    """The smallest zero point `fmt` can store: GPTQ v1 stores zero − 1, so an asymmetric zero of 0
    would wrap; the integer grid then keeps zeros >= 1 (see grids/integer.py)."""
    return 1 if fmt == "gptq" and not sym else 0


def check_spec(spec: QuantizeSpec, fmt: str) -> None:
    """Refuse what the format cannot hold, before any work is done."""
    check_format(fmt)
    if fmt == "gptq" and spec.method.bits not in PACK_BITS:
        raise OptionError(f"<bits> {spec.method.bits}: GPTQ checkpoints hold {', '.join(map(str, PACK_BITS))} bits "
                          f"(use <fmt> dense for other widths)")  # fmt: skip


def quantization_config(spec: QuantizeSpec, provenance: dict[str, Any]) -> dict[str, Any]:
    m = spec.method
    gptq = m if isinstance(m, GPTQConfig) else None
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
        "pack_dtype": "int32",
        "meta": {"quantizer": [f"llmopt:{llmopt.__version__}"], "method": m.name, "llmopt": provenance},
    }


def _order(name: str) -> tuple[int, int, str]:
    """Embeddings, then blocks in layer order, then the final norm and head: the pipeline's order."""
    m = _LAYER.match(name)
    if m:
        return (1, int(m.group(1)), name)
    return (0 if "embed_tokens" in name else 2, 0, name)


def plan_tensors(source: ModelSource, spec: QuantizeSpec, fmt: str) -> tuple[list[PlannedTensor], dict[str, str]]:
    """Every tensor to write, and for quantized ones the module that produces it."""
    arch = source.arch
    quantized = set(quantized_modules(source, spec))
    names = [n for n in source.tensors if n.removesuffix(".weight") not in quantized or not n.endswith(".weight")]
    if spec.quantize_head and "lm_head.weight" not in source.tensors:
        names.append("lm_head.weight")  # a tied head gets its own quantized copy
    if arch.tie_word_embeddings and not spec.quantize_head:
        names = [n for n in names if n != "lm_head.weight"]
    plan: list[PlannedTensor] = []
    producer: dict[str, str] = {}
    for module in quantized:
        names.append(f"{module}.weight")
    bits, group_size = spec.method.bits, spec.method.group_size
    for name in sorted(set(names), key=_order):
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module in quantized:
            weight = head_weight_name(source) if module == HEAD else name
            out_f, in_f = (int(d) for d in source.tensors[weight].shape)
            if fmt == "dense":
                plan.append(PlannedTensor(name, (out_f, in_f), torch.float16))
                producer[name] = module
                continue
            groups = group_count(in_f, group_size)
            for part, shape, dtype in (("qweight", (packed_length(in_f, bits), out_f), torch.int32),
                                       ("qzeros", (groups, packed_length(out_f, bits)), torch.int32),
                                       ("scales", (groups, out_f), torch.float16),
                                       ("g_idx", (in_f,), torch.int32)):  # fmt: skip
                plan.append(PlannedTensor(f"{module}.{part}", shape, dtype))
                producer[f"{module}.{part}"] = module
        else:
            plan.append(PlannedTensor(name, source.tensors[name].shape, torch.float16))
    return plan, producer


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


class CheckpointWriter:
    """A sink for the pipeline's results: a GPTQ (or dense) HF directory at `out`, written atomically.

        with CheckpointWriter(source, spec, out) as writer:
            for block in quantize_model(source, spec, tokens):
                writer.add(block)
            path = writer.finish()
    """

    def __init__(self, source: ModelSource, spec: QuantizeSpec, out: Path, fmt: str = "gptq",
                 provenance: dict[str, Any] | None = None, force: bool = False, max_shard_bytes: int = 5 * 10**9):  # fmt: skip
        check_spec(spec, fmt)
        self.source, self.spec, self.fmt = source, spec, fmt
        self.provenance = provenance or {}
        self.plan, self.producer = plan_tensors(source, spec, fmt)
        self.dir = AtomicDir(out, force)
        metadata = {"format": "pt", "producer": f"llmopt {llmopt.__version__}", "source": source.path.name}
        self.shards = ShardedWriter(self.dir.tmp, self.plan, max_shard_bytes, metadata)
        self.held: dict[str, QuantizedTensor] = {}  # results added but not yet written
        self.packed: dict[str, dict[str, torch.Tensor]] = {}
        self.unwritten: dict[str, int] = {}  # module -> its tensors still to write
        for module in self.producer.values():
            self.unwritten[module] = self.unwritten.get(module, 0) + 1
        self.path: Path | None = None

    def add(self, block: BlockResult) -> None:
        """Take one block's results; write every tensor whose turn has come."""
        self.held.update(block.tensors)
        self._write_ready()

    def _write_ready(self) -> None:
        while (t := self.shards.next) is not None:
            module = self.producer.get(t.name)
            if module is None:
                tensor = self.source.load(t.name, dtype=torch.float32).to(torch.float16)
            elif module not in self.held:
                return  # its block has not been added yet
            elif self.fmt == "dense":
                tensor = self.held[module].dequantize(torch.float32).to(torch.float16)
            else:
                if module not in self.packed:
                    self.packed[module] = gptq_tensors(self.held[module])
                tensor = self.packed[module][t.name.rpartition(".")[2]]
            self.shards.put(tensor)
            if module is not None:
                self.unwritten[module] -= 1
                if not self.unwritten[module]:  # every part of it is written
                    self.held.pop(module)
                    self.packed.pop(module, None)

    def finish(self) -> Path:
        """Write what is left (norms, head, config, tokenizer) and move the directory into place."""
        self._write_ready()
        if self.shards.next is not None:
            raise RuntimeError(f"{self.shards.next.name}: the pipeline produced no result for "
                               f"{self.producer.get(self.shards.next.name)}")  # fmt: skip
        self.shards.close()
        tmp, source = self.dir.tmp, self.source
        config = source.arch.to_hf_config("float16")
        if self.spec.quantize_head:
            config["tie_word_embeddings"] = False
        tok = source.tokenizer()
        config.update(tok.special_ids() if tok is not None else {})
        config["llmopt"] = {"version": llmopt.__version__, "quantized_from": source.path.name, **self.provenance}
        if self.fmt == "gptq":
            qcfg = quantization_config(self.spec, self.provenance)
            config["quantization_config"] = qcfg
            (tmp / "quantize_config.json").write_text(json.dumps(qcfg, indent=2) + "\n")
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        _copy_tokenizer(source, tmp)
        self.path = self.dir.commit()
        return self.path

    def __enter__(self) -> CheckpointWriter:
        return self

    def __exit__(self, exc_type: type | None, *exc: object) -> None:
        self.shards._close_file()
        if self.path is None:  # failed, or left without finish(): nothing under the final name
            self.dir.discard()


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
        specials = tok.special_ids() if tok is not None else {}
        (directory / "generation_config.json").write_text(json.dumps(specials, indent=2) + "\n")
