"""Streaming a model block by block from disk changes no bit of what the calibrated methods write.

The pipeline (quant/pipeline.py) reads each block's tensors lazily from the files and releases their
pages when the block is done; the whole-model path is the same model with every tensor read into
memory before the first block (`HeldWhole`). On SmolLM2, AWQ, AWQ+GPTQ, GPTQ onto a GGUF grid and GPTQ with
learned rounding give the same codes, scales and folded tensors both ways, compared as the bytes a writer receives.
"""

from __future__ import annotations

import pytest
import torch

from llmopt.model import open_model
from llmopt.model.source import ModelSource
from llmopt.quant.awq import AWQConfig
from llmopt.quant.gptq import GPTQConfig
from llmopt.quant.grids import GRIDS
from llmopt.quant.pipeline import QuantizeSpec, quantize_model
from llmopt.quant.tune import TuneConfig
from tests.quant.smollm2 import short_protocol


class HeldWhole(ModelSource):
    """A source whose every tensor is read into memory up front, in its stored dtype."""

    def __init__(self, source: ModelSource):
        self.__dict__.update(vars(source))
        self._source = source
        self._held = {name: source.load(name, dtype=None) for name in source.tensors}

    def load(self, name: str, dtype: torch.dtype | str | None = "float32") -> torch.Tensor:
        t = self._held[name]
        if dtype is None:
            return t.clone()
        return t.to(getattr(torch, dtype) if isinstance(dtype, str) else dtype, copy=True)

    def tokenizer(self):  # noqa: ANN201
        return self._source.tokenizer()


def flat(prefix: str, value: object, out: dict[str, torch.Tensor]) -> None:
    if isinstance(value, torch.Tensor):
        out[prefix] = value.detach().clone()
    elif isinstance(value, dict):
        for key, v in value.items():
            flat(f"{prefix}.{key}", v, out)
    elif hasattr(value, "__dataclass_fields__"):
        for key, v in vars(value).items():
            flat(f"{prefix}.{key}", v, out)


def written(blocks) -> dict[str, torch.Tensor]:  # noqa: ANN001
    """Every tensor the pipeline hands a writer, by name (codes, scales, zeros, aux, folded norms)."""
    out: dict[str, torch.Tensor] = {}
    for block in blocks:
        flat(str(block.layer), {"tensors": block.tensors, "updated": block.updated}, out)
    return out


SPECS = {
    "awq": lambda: QuantizeSpec(AWQConfig(4, 128, sym=False)),
    "awq+gptq": lambda: QuantizeSpec(AWQConfig(4, 128, sym=False, gptq=GPTQConfig(4, 128, sym=False))),
    # Q4_K where the rows fill its 256-blocks (SmolLM2's down_proj), else Q5_0, llama.cpp's fallback
    "gptq-on-grid": lambda: QuantizeSpec(GPTQConfig(4, 32, sym=False),
                                         grids=lambda name: GRIDS["Q4_K" if name.endswith("down_proj") else "Q5_0"]),
    "gptq+tune": lambda: QuantizeSpec(GPTQConfig(2, 64, sym=False), batch_size=2, tune=TuneConfig(4, None, 2, seed=0)),
}


@pytest.mark.slow
@pytest.mark.parametrize("method", sorted(SPECS))
def test_streamed_equals_the_model_held_whole(smollm2_hf, method: str) -> None:
    with open_model(smollm2_hf) as src:
        _, tokens = short_protocol(src)
        tokens = tokens[:4, :128]
        streamed = written(quantize_model(src, SPECS[method](), tokens))
        held = written(quantize_model(HeldWhole(src), SPECS[method](), tokens))
    assert streamed.keys() == held.keys() and len(streamed) > 30
    for name, t in streamed.items():
        assert torch.equal(t, held[name]), name
