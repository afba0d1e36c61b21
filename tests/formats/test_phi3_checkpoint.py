"""Phi-3 through the layer-sequential pipeline: q/k/v (and gate/up) are quantized as the Llama block's
linears on one shared input, then written back fused: a GPTQ/AWQ checkpoint holds `qkv_proj` and
`gate_up_proj` as one packed linear each (as GPTQModel writes Phi-3), a GGUF holds `attn_qkv` on one
grid; every reader serves the parts again, exactly the weights the pipeline produced."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors import safe_open

from llmopt.api import convert_to_gguf, imatrix, quantize
from llmopt.formats.imatrix import read_imatrix
from llmopt.model import open_model
from llmopt.model.decoder import Decoder
from llmopt.quant.awq import AWQConfig
from llmopt.quant.gptq import GPTQConfig
from llmopt.quant.pipeline import QuantizeSpec, quantize_model
from llmopt.quant.rtn import RTNConfig
from llmopt.runtime.group_int import GroupIntLinear
from llmopt.runtime.int4 import PackedInt4Linear
from llmopt.runtime.weights import build_decoder
from tests.factories import CORPUS, write_checkpoint
from tests.model.test_phi3 import ids, make_tiny_phi3

FUSED_PARTS = {"self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"), "mlp.gate_up_proj": ("gate_proj", "up_proj")}


@pytest.fixture(scope="module")
def phi3(tmp_path_factory: pytest.TempPathFactory):
    return make_tiny_phi3(tmp_path_factory.mktemp("phi3") / "phi3", heads=4)  # 384 wide: quick to calibrate


@pytest.mark.parametrize(("fmt", "method"), [("gptq", GPTQConfig(4, 32, True, act_order=True)),
                                             ("awq", AWQConfig(4, 32)), ("dense", RTNConfig(4, 32))],
                         ids=["gptq-act-order", "awq", "rtn-dense"])  # fmt: skip
def test_checkpoint_stores_fused_linears_and_reads_back_the_parts(phi3, tmp_path, fmt: str, method) -> None:
    spec = QuantizeSpec(method, batch_size=2)
    produced: dict[str, torch.Tensor] = {}
    with open_model(phi3) as src:
        blocks = quantize_model(src, spec, ids(4 * 32).view(4, 32))
        out = write_checkpoint(src, spec, blocks, tmp_path / fmt, fmt,
                               on_block=lambda b: produced.update({k: v.dequantize() for k, v in b.tensors.items()}))
    assert len(produced) == 2 * 7  # the Llama block's seven linears per layer
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        stored = set(f.keys())
    leaf = "weight" if fmt == "dense" else "qweight"
    for fused in FUSED_PARTS:
        assert f"model.layers.1.{fused}.{leaf}" in stored
    assert not any(".q_proj." in n or ".gate_proj." in n for n in stored)
    with open_model(out) as q:
        assert q.arch.family.name == "phi3"
        for module, w in produced.items():
            assert torch.equal(q.load(f"{module}.weight").float(), w.half().float() if fmt == "dense" else w), module
        logits = Decoder.from_source(q)(ids(16))
        assert torch.isfinite(logits).all()
        if fmt == "awq":  # the runtime keeps each part packed (rows of the fused packed linear)
            exact = build_decoder(q, torch.float32, torch.device("cpu"), quantized=True)  # bit planes, float32 math
            assert sum(isinstance(m, GroupIntLinear) for m in exact.modules()) == 2 * 4  # q/k/v, gate/up stacked
            with torch.no_grad():
                assert (exact(ids(16)) - logits).abs().max() <= 1e-3 * logits.abs().max()
            runtime = build_decoder(q, torch.bfloat16, torch.device("cpu"), quantized=True)
            assert sum(isinstance(m, PackedInt4Linear) for m in runtime.modules()) == 2 * 7
            with torch.no_grad():
                diff = (runtime(ids(16)).float() - logits).abs().max()
            assert diff < 0.05 * logits.abs().max()  # a bfloat16 model, bfloat16 activations in the int4 kernel


def test_gptq_checkpoint_end_to_end(phi3, tmp_path) -> None:
    """quantize() end to end: a GPTQ v1 config over the fused modules, one g_idx per fused linear.
    (transformers 5 loads GPTQ only with optimum and gptqmodel installed, which this venv has not.)"""
    calib = tmp_path / "c.txt"
    calib.write_text(CORPUS)
    result = quantize(phi3, tmp_path / "gptq", method="gptq", bits=4, group_size=32, calib=str(calib), nsamples=4, seqlen=32)
    qc = json.loads((tmp_path / "gptq" / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "gptq" and qc["bits"] == 4 and result.output
    with safe_open(str(tmp_path / "gptq" / "model.safetensors"), "pt") as f:
        qkv = f.get_slice("model.layers.0.self_attn.qkv_proj.qweight").get_shape()
        g_idx = f.get_slice("model.layers.0.self_attn.qkv_proj.g_idx").get_shape()
    with open_model(phi3) as src:
        h = src.arch.hidden_size
        assert qkv == [h // 8, 3 * h] and g_idx == [h]


def test_gptq_onto_gguf_grids_writes_one_attn_qkv(phi3, tmp_path) -> None:
    """GPTQ onto Q4_K_M's grids: q/k/v are quantized on attn_qkv's type and packed as one tensor;
    the file reads back to the pipeline's weights through the GGUF reader's split."""
    calib = tmp_path / "c.txt"
    calib.write_text(CORPUS)
    out = tmp_path / "gptq.gguf"
    convert_to_gguf(phi3, out, "Q4_K_M", method="gptq", calib=str(calib), nsamples=4, seqlen=32)
    with open_model(out) as q, open_model(phi3) as src:
        assert q.tensors["model.layers.0.self_attn.k_proj.weight"].stored_name == "blk.0.attn_qkv.weight"
        for name in ("model.layers.0.self_attn.v_proj.weight", "model.layers.1.mlp.up_proj.weight"):
            err = (q.load(name) - src.load(name)).abs().mean() / src.load(name).abs().mean()
            assert 0 < err < 0.2, (name, float(err))


def test_imatrix_counts_each_fused_input_once(phi3, tmp_path) -> None:
    """attn_qkv and ffn_up get one entry each, counted over the tokens once, like llama.cpp's."""
    calib = tmp_path / "c.txt"
    calib.write_text(CORPUS)
    out = tmp_path / "imatrix.gguf"
    imatrix(phi3, str(calib), out, chunks=2, ctx_size=32)
    data = read_imatrix(out)
    names = set(data.sums)
    assert {"blk.0.attn_qkv.weight", "blk.0.ffn_up.weight", "blk.1.attn_output.weight"} <= names
    assert not any("attn_q." in n or "ffn_gate" in n for n in names)
    assert data.counts["blk.0.attn_qkv.weight"] == data.counts["blk.0.attn_output.weight"] == 2 * 32
    assert np.all(np.asarray(data.sums["blk.0.ffn_up.weight"]) > 0)
