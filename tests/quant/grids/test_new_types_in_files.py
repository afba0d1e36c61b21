"""GGUF files holding IQ1_S, IQ1_M, Q1_0 and Q2_0 tensors as llmopt writes them: llmopt reads the IQ1 ones
back (loading, `inspect`, `convert`, the runtime's quantized path) as exactly the grids' values; Q1_0 and
Q2_0, which the `gguf` package cannot dequantize, are llama.cpp's own dequantization of the file's bytes."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from llmopt.errors import InputError
from llmopt.formats.gguf.writer import plan_gguf, write_gguf
from llmopt.model import open_model
from llmopt.quant.grids import quantize
from tests.formats.gguf.models import make_wide_hf
from tests.quant.grids.ggml_reference import ggml_dequantize

OVERRIDES = [("attn_q", "IQ1_S"), ("attn_k", "IQ1_M"), ("ffn_gate", "IQ1_S"), ("ffn_up", "IQ1_M")]


def _write(root: Path, overrides: list[tuple[str, str]]) -> tuple[Path, Path, dict[str, torch.Tensor]]:
    hf = make_wide_hf(root / "hf", "llama", layers=2)
    g = torch.Generator().manual_seed(0)
    with open_model(hf) as src:
        plan = plan_gguf(src, "Q8_0", has_imatrix=True, overrides=overrides)
        importance = {t.gguf_name: torch.rand(t.shape[-1], generator=g) ** 3 * 5 for t in plan.tensors
                      if t.gguf_name.startswith("blk.") and len(t.shape) == 2}  # fmt: skip
        out = write_gguf(src, root / "model.gguf", plan, importance=importance)
    return hf, out, importance


@pytest.fixture(scope="module")
def iq1_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[str, torch.Tensor]]:
    return _write(tmp_path_factory.mktemp("iq1"), OVERRIDES)


def _types(path: Path) -> dict[str, str]:
    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}


def test_iq1_tensors_read_back_as_the_grids_values(iq1_file) -> None:
    """Loading dequantizes each IQ1 tensor to the values of our grid's codes for its HF weight (rows are
    independent, so llama.cpp's Q/K row order does not change them)."""
    hf, path, importance = iq1_file
    types = _types(path)
    assert {"IQ1_S", "IQ1_M"} <= set(types.values())
    with open_model(hf) as src, open_model(path) as written:
        family = src.arch.family
        checked = 0
        for name in src.tensors:
            gguf_name = family.hf_to_gguf_name(name)
            if types.get(gguf_name) not in ("IQ1_S", "IQ1_M"):
                continue
            w = src.load(name, torch.float32)
            ours = quantize(types[gguf_name], w, importance[gguf_name]).dequantize()
            assert torch.equal(written.load(name, torch.float32), ours), name
            checked += 1
    assert checked == 8  # attn_q, attn_k, ffn_gate, ffn_up of both layers


def test_runtime_keeps_iq1_quantized_with_the_dequantized_logits(iq1_file) -> None:
    from llmopt.runtime.gguf_lattice import LatticeLinear
    from llmopt.runtime.weights import load_model

    _, path, _ = iq1_file
    kept = load_model(str(path), "float32", "cpu", quantized=True).model
    dense = load_model(str(path), "float32", "cpu", quantized=False).model
    held = [m for m in kept.modules() if isinstance(m, LatticeLinear)]
    assert {m.qtype.name for m in held} >= {"IQ1_S", "IQ1_M"}
    ids = torch.randint(0, 300, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = kept(ids), dense(ids)
    assert (a - b).abs().max() <= 1e-3 * b.abs().max()


def test_inspect_and_convert_read_iq1(iq1_file, llmopt_cli, tmp_path: Path) -> None:
    _, path, _ = iq1_file
    result = llmopt_cli("inspect", path, "--json")
    assert result.returncode == 0, result.stderr
    assert {"IQ1_S", "IQ1_M"} <= set(json.loads(result.stdout)["types"])
    out = tmp_path / "hf"
    result = llmopt_cli("convert", path, "--to", "hf", "-o", out, "--dtype", "float32")
    assert result.returncode == 0, result.stderr
    with open_model(out) as converted, open_model(path) as written:
        for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.up_proj.weight"):
            assert torch.equal(converted.load(name, torch.float32), written.load(name, torch.float32))


@pytest.mark.parametrize("type_name", ["Q1_0", "Q2_0"])
def test_low_bit_file_holds_llama_cpps_values_and_our_readers_read_them(tmp_path: Path, type_name: str) -> None:
    """Q1_0 / Q2_0 (ffn_down): the file's bytes read by llama.cpp's own dequantizer are our grid's values,
    and so are what llmopt's reader (`load`) and the runtime's quantized linear read back (the `gguf`
    package has no dequantizer for either, nor Q2_0's type id: model/dequantize.py and ggml_types.py
    have); llama.cpp runs the file with our logits."""
    from llmopt.model.gguf_header import read_gguf
    from llmopt.runtime.weights import load_model
    from tests.formats.gguf.llama_cpp_helpers import assert_same_top1, llama_cpp_logits

    hf, path, _ = _write(tmp_path, [("ffn_down", type_name)])
    raw = {t.name: t for t in read_gguf(path).tensors}["blk.1.ffn_down.weight"]
    assert raw.tensor_type.name == type_name
    with open_model(hf) as src:
        w = src.load("model.layers.1.mlp.down_proj.weight", torch.float32)
    theirs = ggml_dequantize(type_name, np.asarray(raw.data).reshape(w.shape[0], -1))
    assert np.array_equal(theirs, quantize(type_name, w).dequantize().numpy())
    with open_model(path) as written:
        assert np.array_equal(written.load("model.layers.1.mlp.down_proj.weight").numpy(), theirs)
    model = load_model(str(path), "float32", "cpu", quantized=True).model
    (layer,) = [m for n, m in model.named_modules()
                if "layers.1." in n and getattr(getattr(m, "qtype", None), "name", None) == type_name]
    x = torch.randn(3, w.shape[1])
    assert torch.allclose(layer(x), x @ torch.from_numpy(theirs).T, rtol=1e-5, atol=1e-4)
    tokens = torch.randint(0, 300, (64,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.no_grad():
        ours = model(torch.tensor([tokens]))[0]
    # llama.cpp multiplies the Q8_0 tensors by Q8_0-rounded activations (differences ~0.03), and this small
    # random model's logits are flat: a quarter of the positions are clear of a near-tie
    assert_same_top1(ours, llama_cpp_logits(path, tokens), f"{type_name} file", atol=0.05, min_clear=0.25)