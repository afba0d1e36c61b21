"""Quantized HF checkpoints (GPTQ, AWQ, compressed-tensors) and dense dequantized HF directories, written block by block
as the quantization pipeline yields them.

Each quantized linear `<module>` becomes the tensors of its format's layout (formats/gptq.py,
formats/awq.py, formats/compressed_tensors.py; dense: one float16 `.weight`). Everything else (embeddings, norms, an unquantized
head, biases) is written as float16 from the source, or from the pipeline where a method changed
it (AWQ's norms). `config.json` carries the layout's `quantization_config`.

`CheckpointWriter` is a sink: the caller hands it each `BlockResult` (`add`) and then `finish`es.
The tensor plan is known before any block is quantized, so shards stream: each tensor is written
as soon as everything before it is (the tensors of layer i once block i has been added), and a
block's results are dropped once written.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from collections.abc import Mapping
from typing import Any, Protocol

import torch

import llmopt
from llmopt.errors import OptionError
from llmopt.formats import awq, compressed_tensors, gptq
from llmopt.formats.atomic import AtomicDir
from llmopt.formats.safetensors_stream import PlannedTensor, ShardedWriter
from llmopt.model.source import ModelSource
from llmopt.names import CHECKPOINT_FORMATS
from llmopt.quant.pipeline import HEAD, BlockResult, QuantizeSpec, head_weight_name, quantized_modules
from llmopt.quantized_tensor import QuantizedTensor

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "generation_config.json")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class Layout(Protocol):
    """How one format stores a quantized linear."""

    name: str
    bits: tuple[int, ...]  # the bit widths it holds

    def check(self, spec: QuantizeSpec) -> None: ...

    def parts(self, out_f: int, in_f: int, bits: int, group_size: int,
              spec: QuantizeSpec | None = None) -> list[tuple[str, tuple[int, ...], torch.dtype]]: ...  # fmt: skip

    def tensors(self, qt: QuantizedTensor) -> dict[str, torch.Tensor]: ...

    def quantization_config(self, spec: QuantizeSpec, provenance: dict[str, Any],
                            modules: Mapping[str, tuple[int, int]] | None = None) -> dict[str, Any]: ...  # fmt: skip


class Dense:
    """Dequantized float16 weights, no quantization_config: for tools that read no packed format."""

    name = "dense"
    bits = tuple(range(2, 9))

    def check(self, spec: QuantizeSpec) -> None:
        pass

    def parts(self, out_f: int, in_f: int, bits: int, group_size: int,
              spec: QuantizeSpec | None = None) -> list[tuple[str, tuple[int, ...], torch.dtype]]:  # fmt: skip
        return [("weight", (out_f, in_f), torch.float16)]

    def tensors(self, qt: QuantizedTensor) -> dict[str, torch.Tensor]:
        return {"weight": qt.dequantize(torch.float32).to(torch.float16)}

    def quantization_config(self, spec: QuantizeSpec, provenance: dict[str, Any],
                            modules: Mapping[str, tuple[int, int]] | None = None) -> dict[str, Any] | None:  # fmt: skip
        return None


LAYOUTS: dict[str, Layout] = {"gptq": gptq.LAYOUT, "awq": awq.LAYOUT, "compressed-tensors": compressed_tensors.LAYOUT,
                               "dense": Dense()}  # fmt: skip
FORMATS = CHECKPOINT_FORMATS
assert tuple(LAYOUTS) == FORMATS, "llmopt/names.py lists the formats LAYOUTS writes"


def layout(fmt: str) -> Layout:
    if fmt not in LAYOUTS:
        raise OptionError(f"bad <fmt> {fmt!r}; choose one of {', '.join(FORMATS)}")
    return LAYOUTS[fmt]


def zero_min(fmt: str, sym: bool) -> int:
    """The smallest zero point `fmt` can store: GPTQ v1 stores zero − 1, so an asymmetric zero of 0
    would wrap; the integer grid then keeps zeros >= 1 (see grids/integer.py)."""
    return 1 if fmt == "gptq" and not sym else 0


def check_spec(spec: QuantizeSpec, fmt: str) -> None:
    """Refuse what the format cannot hold, before any work is done."""
    layout(fmt).check(spec)


def _order(name: str) -> tuple[int, int, str]:
    """Embeddings, then blocks in layer order, then the final norm and head: the pipeline's order."""
    m = _LAYER.match(name)
    if m:
        return (1, int(m.group(1)), name)
    return (0 if "embed_tokens" in name else 2, 0, name)


def plan_tensors(source: ModelSource, spec: QuantizeSpec, fmt: str) -> tuple[list[PlannedTensor], dict[str, list[str]]]:
    """Every tensor to write, and for quantized ones the modules whose results make it: the module
    itself, or a fused linear's parts (Phi-3's qkv_proj is written as one quantized linear)."""
    arch = source.arch
    quantized = set(quantized_modules(source, spec))
    names = [n for n in source.tensors if n.removesuffix(".weight") not in quantized or not n.endswith(".weight")]
    if spec.quantize_head and "lm_head.weight" not in source.tensors:
        names.append("lm_head.weight")  # a tied head gets its own quantized copy
    if arch.tie_word_embeddings and not spec.quantize_head:
        names = [n for n in names if n != "lm_head.weight"]
    plan: list[PlannedTensor] = []
    producer: dict[str, list[str]] = {}
    for module in quantized:
        names.append(f"{module}.weight")
    parts = layout(fmt).parts
    for name, members in arch.family.stored_names(sorted(set(names), key=_order)).items():
        module = name.removesuffix(".weight")
        modules = [m.removesuffix(".weight") for m in members]
        done = [m for m in modules if m in quantized] if name.endswith(".weight") else []
        if done and (len(done) < len(modules) or len({spec.module_bits(m) for m in modules}) > 1):
            raise OptionError(f"{module} is one linear in {arch.family.name} checkpoints: quantize all of "
                              f"{', '.join(m.rpartition('.')[2] for m in modules)} with the same bits and group size")  # fmt: skip
        shapes = [source.tensors[head_weight_name(source) if m == f"{HEAD}.weight" and done else m].shape for m in members]
        out_f, rest = sum(int(shape[0]) for shape in shapes), tuple(shapes[0][1:])  # a fused tensor: rows stacked
        if done:
            for part, shape, dtype in parts(out_f, int(rest[0]), *spec.module_bits(modules[0]), spec=spec):
                plan.append(PlannedTensor(f"{module}.{part}", shape, dtype))
                producer[f"{module}.{part}"] = modules
        else:
            plan.append(PlannedTensor(name, (out_f, *rest), torch.float16))
    return plan, producer


class CheckpointWriter:
    """A sink for the pipeline's results: a GPTQ, AWQ, compressed-tensors or dense HF directory at `out`, written atomically.

        with CheckpointWriter(source, spec, out, "awq") as writer:
            for block in quantize_model(source, spec, tokens):
                writer.add(block)
            path = writer.finish()
    """

    def __init__(self, source: ModelSource, spec: QuantizeSpec, out: Path, fmt: str = "gptq",
                 provenance: dict[str, Any] | None = None, force: bool = False, max_shard_bytes: int = 5 * 10**9):  # fmt: skip
        check_spec(spec, fmt)
        self.source, self.spec, self.layout = source, spec, layout(fmt)
        self.provenance = provenance or {}
        self.plan, self.producer = plan_tensors(source, spec, fmt)
        self.dir = AtomicDir(out, force, planned_bytes=sum(t.nbytes for t in self.plan))
        metadata = {"format": "pt", "producer": f"llmopt {llmopt.__version__}", "source": source.path.name}
        self.shards = ShardedWriter(self.dir.tmp, self.plan, max_shard_bytes, metadata)
        self.held: dict[str, QuantizedTensor] = {}  # results added but not yet written
        self.updated: dict[str, torch.Tensor] = {}  # float tensors the pipeline changed (AWQ's norms)
        self.layers_added: set[int] = set()
        self.packed: dict[str, dict[str, torch.Tensor]] = {}
        self.unwritten: dict[str, int] = {}  # stored module -> its tensors still to write
        for modules in self.producer.values():
            self.unwritten[modules[0]] = self.unwritten.get(modules[0], 0) + 1
        self.path: Path | None = None

    def add(self, block: BlockResult) -> None:
        """Take one block's results; write every tensor whose turn has come."""
        self.source.check_unchanged()  # the block just read, and the ones this call writes from the source
        self.held.update(block.tensors)
        self.updated.update(block.updated)
        self.layers_added.add(block.layer)
        self._write_ready()

    def _ready(self, name: str) -> bool:
        """A block's own tensors wait for the block: the pipeline may change them (AWQ's norms)."""
        modules = self.producer.get(name)
        if modules is not None:
            return all(m in self.held for m in modules)
        m = _LAYER.match(name)
        return m is None or int(m.group(1)) in self.layers_added

    def _write_ready(self, final: bool = False) -> None:
        while (t := self.shards.next) is not None:
            if not final and not self._ready(t.name):
                return
            modules = self.producer.get(t.name)
            if modules is None:
                tensor = self._float(t.name).to(torch.float16)
            elif not all(m in self.held for m in modules):
                raise RuntimeError(f"{t.name}: the pipeline produced no result for {', '.join(modules)}")
            else:
                module = modules[0]
                if module not in self.packed:  # a fused linear's parts: one quantized linear, rows stacked
                    held = [self.held[m] for m in modules]
                    self.packed[module] = self.layout.tensors(held[0] if len(held) == 1 else QuantizedTensor.stack_rows(held))
                tensor = self.packed[module][t.name.rpartition(".")[2]]
            self.shards.put(tensor)
            if modules is not None:
                self.unwritten[modules[0]] -= 1
                if not self.unwritten[modules[0]]:  # every part of it is written
                    for m in modules:
                        self.held.pop(m)
                    self.packed.pop(modules[0], None)

    def _float(self, name: str) -> torch.Tensor:
        """A float tensor as the source or the pipeline (AWQ's norms) has it; a fused one stacked from its parts."""
        parts = self.source.arch.family.part_names(name)
        if parts is not None and name not in self.source.tensors:
            return torch.cat([self._float(p) for p in parts])
        tensor = self.updated.pop(name, None)
        return tensor if tensor is not None else self.source.load(name, dtype=torch.float32)

    def finish(self) -> Path:
        """Write what is left (norms, head, config, tokenizer) and move the directory into place."""
        self._write_ready(final=True)
        self.shards.close()
        tmp, source = self.dir.tmp, self.source
        config = source.arch.to_hf_config("float16")
        if self.spec.quantize_head:
            config["tie_word_embeddings"] = False
        tok = source.tokenizer()
        config.update(tok.special_ids() if tok is not None else {})
        config["llmopt"] = {"version": llmopt.__version__, "quantized_from": source.path.name, **self.provenance}
        stored = {t.rpartition(".")[0]: self.spec.module_bits(ms[0]) for t, ms in self.producer.items()}
        qcfg = self.layout.quantization_config(self.spec, self.provenance, stored)
        if qcfg is not None:
            config["quantization_config"] = qcfg
            (tmp / "quantize_config.json").write_text(json.dumps(qcfg, indent=2) + "\n")
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        _copy_tokenizer(source, tmp)
        source.check_unchanged()
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
