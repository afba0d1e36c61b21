"""Dense HF directories: config.json, sharded safetensors, tokenizer and generation config.

Any `ModelSource` can be written this way (GGUF -> HF is the first user); tensors stream one at a
time from the source into the shards, so peak memory follows the largest tensor.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from llmopt.names import FLOAT_DTYPES

import llmopt
from llmopt.errors import OptionError
from llmopt.formats.atomic import atomic_output_dir
from llmopt.formats.safetensors_stream import ITEMSIZE, PlannedTensor, write_sharded
from llmopt.model.source import ModelSource

DTYPES = {name: getattr(torch, name) for name in FLOAT_DTYPES}


def parse_size(text: str, option: str = "max_shard_size") -> int:
    """'5GB', '500MB', '2GiB', '1000' -> bytes (decimal units as HF uses them, binary with 'i')."""
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
    s = text.strip().upper().replace(" ", "")
    number = s.rstrip("KMGTIB")
    unit = s[len(number):]
    try:
        value = float(number)
    except ValueError:
        value = -1
    if unit not in units or value <= 0:
        raise OptionError(f"bad <{option}> {text!r} (examples: 5GB, 500MB, 2GiB)")
    return int(value * units[unit])


def write_hf_dir(source: ModelSource, out: Path, dtype: str = "float16", max_shard_bytes: int = 5 * 10**9,
                 force: bool = False, on_tensor: Callable[[str, int], None] | None = None) -> Path:
    """Write `source` as a dense HF directory at `out` (atomically). Returns the final path."""
    if dtype not in DTYPES:
        raise OptionError(f"bad <dtype> {dtype!r}; choose one of {', '.join(DTYPES)}")
    torch_dtype = DTYPES[dtype]
    arch = source.arch
    tok = source.tokenizer()
    plan = []
    for name, parts in arch.family.stored_names(source.tensors).items():  # a fused linear: its parts' rows stacked
        shape = tuple(source.tensors[parts[0]].shape)
        plan.append(PlannedTensor(name, (sum(source.tensors[p].shape[0] for p in parts), *shape[1:]), torch_dtype))

    def produce(t: PlannedTensor) -> torch.Tensor:
        source.check_unchanged()
        return source.load_stored(t.name, dtype=torch.float32).to(torch_dtype)

    def done(t: PlannedTensor) -> None:
        if on_tensor:
            on_tensor(t.name, t.nbytes)

    with atomic_output_dir(out, force=force, planned_bytes=sum(t.nbytes for t in plan)) as tmp:
        metadata = {"format": "pt", "producer": f"llmopt {llmopt.__version__}", "source": source.path.name}
        write_sharded(tmp, plan, produce, max_shard_bytes, metadata, done)
        config = arch.to_hf_config(dtype)
        specials = tok.special_ids() if tok is not None else {}
        config.update(specials)
        config["llmopt"] = {"version": llmopt.__version__, "converted_from": source.path.name}
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (tmp / "generation_config.json").write_text(json.dumps(specials, indent=2) + "\n")
        if tok is not None:
            tok.save_hf(tmp, model_max_length=arch.max_position_embeddings)
        source.check_unchanged()
    return out.expanduser().resolve()


def output_bytes(source: ModelSource, dtype: str) -> int:
    return sum(info.numel * ITEMSIZE[DTYPES[dtype]] for info in source.tensors.values())
