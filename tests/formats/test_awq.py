"""AWQ GEMM checkpoints: the packing order, what llmopt writes reads back exactly, and the runtime
runs it packed."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from llmopt.calibration.samples import CalibConfig, calibration_tokens
from llmopt.calibration.text import CalibText
from llmopt.model import open_model
from llmopt.model.packing import AWQ_ORDER, pack_awq, unpack_awq
from llmopt.quant.awq import AWQConfig
from llmopt.quant.pipeline import QuantizeSpec, quantize_model
from tests.factories import CORPUS, write_checkpoint


def test_awq_packing_order_and_round_trip() -> None:
    v = torch.randint(0, 16, (3, 32), generator=torch.Generator().manual_seed(0))
    packed = pack_awq(v)
    assert packed.shape == (3, 4) and packed.dtype == torch.int32
    word = int(packed[1, 2]) & 0xFFFFFFFF
    for i, column in enumerate(AWQ_ORDER):  # nibble i holds value AWQ_ORDER[i] of the eight
        assert (word >> (4 * i)) & 0xF == int(v[1, 16 + column])
    assert torch.equal(unpack_awq(packed), v.to(torch.int32))
    with pytest.raises(ValueError):
        pack_awq(torch.full((1, 8), 16))


@pytest.mark.parametrize("sym", [False, True])
def test_checkpoint_reads_back_exactly(tiny_models, tmp_path, sym) -> None:
    spec = QuantizeSpec(AWQConfig(4, 32, sym))
    produced, norms = {}, {}
    with open_model(tiny_models("qwen2")) as src:  # q/k/v biases must be written too
        tokens = calibration_tokens(CalibText([CORPUS], "c", "0"), src.tokenizer().encode, CalibConfig("c", None, 4, 32, 0))

        def keep(block):
            produced.update({k: v.dequantize() for k, v in block.tensors.items()})
            norms.update(block.updated)

        out = write_checkpoint(src, spec, quantize_model(src, spec, tokens), tmp_path / "awq", fmt="awq", on_block=keep)
    assert len(produced) == 14 and set(norms) == {f"model.layers.{i}.{n}.weight" for i in (0, 1)
                                                  for n in ("input_layernorm", "post_attention_layernorm")}
    with open_model(out) as q:
        assert q.kind == "hf-awq"
        for module, w in produced.items():
            assert torch.equal(q.load(f"{module}.weight"), w), module
        for name, w in norms.items():  # the folded norms, not the source's
            assert torch.equal(q.load(name), w.half().float()), name
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert (qc["quant_method"], qc["version"], qc["bits"], qc["group_size"], qc["zero_point"]) == ("awq", "gemm", 4, 32, not sym)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.get_tensor("model.layers.0.mlp.down_proj.qweight").shape == (128, 64 // 8)
        assert f.get_tensor("model.layers.0.mlp.down_proj.qzeros").shape == (4, 64 // 8)
        assert f.get_tensor("model.layers.0.mlp.down_proj.scales").shape == (4, 64)
        assert "model.layers.0.mlp.down_proj.g_idx" not in set(f.keys())


def test_runtime_keeps_awq_packed(tiny_models, tmp_path, llmopt_here) -> None:
    calib = tmp_path / "c.txt"
    calib.write_text(CORPUS)
    r = llmopt_here("quantize", tiny_models("llama"), "--method", "awq", "--group-size", "32", "--calib", calib,
                    "--nsamples", "4", "--seqlen", "32", "-o", tmp_path / "awq", "--json")
    assert r.returncode == 0, r.stderr
    from llmopt.runtime.group_int import GroupIntLinear
    from llmopt.runtime.int4 import PackedInt4Linear
    from llmopt.runtime.weights import load_model

    dense = load_model(str(tmp_path / "awq"), "float32", "cpu", quantized=False).model
    ids = torch.tensor([[5, 17, 99, 3, 250, 41, 7, 8]])
    for dtype, cls, tolerance in (("float32", GroupIntLinear, 1e-3), ("bfloat16", PackedInt4Linear, 0.05)):
        packed = load_model(str(tmp_path / "awq"), dtype, "cpu", quantized=True).model
        assert sum(isinstance(m, cls) for m in packed.modules()) == (14 if cls is PackedInt4Linear else 8)  # (stacked)
        with torch.no_grad():
            a, b = packed(ids).float(), dense(ids)
        assert (a - b).abs().max() < tolerance * b.abs().max()  # float32 math; bfloat16 in the int4 kernel
