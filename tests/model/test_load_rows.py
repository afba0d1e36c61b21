"""`ModelSource.load_rows`: a slab of a tensor's rows, read without loading the rest (the GGUF writer's
slabs), equals those rows of `load`, for every reader and tensor kind."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from llmopt.formats.gguf.writer import plan_gguf, write_gguf
from llmopt.model import open_model
from llmopt.quant.pipeline import QuantizeSpec, quantize_model
from llmopt.quant.rtn import RTNConfig
from tests.factories import write_checkpoint
from tests.formats.gguf.models import make_wide_hf
from tests.model.test_phi3 import make_tiny_phi3

SLICES = [slice(0, 1), slice(3, 10), slice(5, None), slice(250, 10_000)]


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("rows")
    hf = make_wide_hf(root / "hf", "llama", layers=1)
    phi3 = make_tiny_phi3(root / "phi3", layers=1)  # fused qkv_proj / gate_up_proj: parts are row ranges
    out = {"hf": hf, "phi3": phi3}
    spec = QuantizeSpec(RTNConfig(4, 64, False))
    with open_model(hf) as src:  # GPTQ: packed linears unpacked whole, the rest read by rows
        out["gptq"] = write_checkpoint(src, spec, quantize_model(src, spec), root / "gptq")
    for name, src_path, mix in [("f16", hf, "F16"), ("q4_k_m", hf, "Q4_K_M"), ("phi3_q8", phi3, "Q8_0")]:
        with open_model(src_path) as src:
            out[name] = write_gguf(src, root / f"{name}.gguf", plan_gguf(src, mix, has_imatrix=False))
    return out


@pytest.mark.parametrize("kind", ["hf", "phi3", "gptq", "f16", "q4_k_m", "phi3_q8"])
def test_rows_equal_the_loaded_tensors_rows(sources: dict[str, Path], kind: str) -> None:
    with open_model(sources[kind]) as src:
        checked = 0
        for name, info in src.tensors.items():
            if len(info.shape) != 2:
                continue
            whole = src.load(name)
            for rows in SLICES:
                got = src.load_rows(name, rows)
                assert got.dtype == torch.float32 and torch.equal(got, whole[rows]), (name, rows)
            checked += 1
        assert checked >= 7
