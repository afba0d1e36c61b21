"""GPTQ checkpoints: bit packing (2/3/4/8, v1 zero points), and what we write reads back exactly."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from llmopt.calibration.samples import CalibConfig, calibration_tokens
from llmopt.calibration.text import CalibText
from llmopt.formats.gptq import gptq_tensors
from llmopt.model import open_model
from llmopt.model.packing import pack_qweight, pack_qzeros, pack_rows, packed_length, unpack_qweight, unpack_qzeros, unpack_rows
from llmopt.quant.gptq import GPTQConfig
from llmopt.quant.pipeline import QuantizeSpec, quantize_model
from llmopt.quant.rtn import RTNConfig
from tests.factories import CORPUS, write_checkpoint


def reference_pack(values: list[int], bits: int) -> list[int]:
    """Packing written the slow, obvious way: one big integer as a little-endian bit stream."""
    stream = 0
    for k, v in enumerate(values):
        stream |= v << (bits * k)
    words = -(-len(values) * bits // 32)
    out = []
    for w in range(words):
        word = (stream >> (32 * w)) & 0xFFFFFFFF
        out.append(word - (1 << 32) if word >= 1 << 31 else word)
    return out


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("rows", [32, 96, 50])
def test_pack_round_trip(bits: int, rows: int) -> None:
    g = torch.Generator().manual_seed(bits * 100 + rows)
    values = torch.randint(0, 1 << bits, (rows, 7), generator=g, dtype=torch.int32)
    packed = pack_rows(values, bits)
    assert packed.dtype == torch.int32 and packed.shape == (packed_length(rows, bits), 7)
    assert torch.equal(unpack_rows(packed, bits, rows), values)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_pack_matches_bit_stream(bits: int) -> None:
    g = torch.Generator().manual_seed(bits)
    values = torch.randint(0, 1 << bits, (64, 1), generator=g, dtype=torch.int32)
    assert pack_rows(values, bits)[:, 0].tolist() == reference_pack(values[:, 0].tolist(), bits)


def test_known_words() -> None:
    assert pack_rows(torch.arange(1, 9).view(8, 1), 4)[0, 0].item() & 0xFFFFFFFF == 0x87654321
    # 3 bits: values 10 and 21 straddle words 0/1 and 1/2 (AutoGPTQ's 3-bit loop)
    v = torch.zeros(32, 1, dtype=torch.int32)
    v[10, 0] = 0b101
    v[21, 0] = 0b011
    w = pack_rows(v, 3)[:, 0].tolist()
    assert w[0] & 0xFFFFFFFF == 0b01 << 30 and w[1] & 1 == 1  # low two bits of value 10 in word 0, high bit in word 1
    assert (w[1] & 0xFFFFFFFF) >> 31 == 1 and w[2] & 0b11 == 0b01  # value 21: bit 0 in word 1, bits 1-2 in word 2


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_qzeros_v1_offset(bits: int) -> None:
    zeros = torch.full((3, 64), 1 << (bits - 1), dtype=torch.int32)
    packed = pack_qzeros(zeros, bits)
    assert packed.shape == (3, packed_length(64, bits))
    if bits == 4:
        assert packed[0, 0].item() == 0x77777777  # sym 4-bit: zero 8 stored as 7
    assert torch.equal(unpack_qzeros(packed, bits, 64), zeros)
    full = torch.randint(1, (1 << bits) + 1, (2, 64), dtype=torch.int32)  # v1 stores 1..2**bits
    assert torch.equal(unpack_qzeros(pack_qzeros(full, bits), bits, 64), full)


def test_qweight_is_packed_along_input() -> None:
    codes = torch.randint(0, 16, (256, 96), dtype=torch.int32)  # [in, out]
    q = pack_qweight(codes, 4)
    assert q.shape == (32, 96)
    assert torch.equal(unpack_qweight(q, 4, 256), codes)


def _calib_tokens(source, n=4, t=48) -> torch.Tensor:
    text = CalibText([CORPUS], "corpus", "0")
    return calibration_tokens(text, source.tokenizer().encode, CalibConfig("corpus", None, n, t, 0))


@pytest.mark.parametrize("bits, group_size", [(2, 32), (3, 32), (4, 32), (8, 32), (4, 48)])
@pytest.mark.parametrize("act_order", [False, True])
def test_checkpoint_reads_back_exactly(tiny_models, tmp_path, bits: int, group_size: int, act_order: bool) -> None:
    """What the pipeline produced == what llmopt's GPTQ reader dequantizes from disk (48: a partial last group)."""
    model_dir = tiny_models("qwen2")  # q/k/v biases: they must be written too
    sym = bits != 3
    cfg = GPTQConfig(bits, group_size, sym, act_order=act_order, zero_min=0 if sym else 1)
    spec = QuantizeSpec(cfg)
    produced = {}

    def keep(result):
        produced.update({k: v.dequantize() for k, v in result.tensors.items()})

    with open_model(model_dir) as src:
        tokens = _calib_tokens(src)
        out = write_checkpoint(src, spec, quantize_model(src, spec, tokens), tmp_path / "q", on_block=keep)
    assert len(produced) == 2 * 7
    with open_model(out) as q, open_model(model_dir) as src:
        assert q.kind == "hf-gptq"
        assert set(q.tensors) == set(src.tensors)  # logical weights, not qweight/qzeros
        for module, expected in produced.items():
            assert torch.equal(q.load(f"{module}.weight"), expected), module
        assert torch.equal(q.load("model.layers.0.self_attn.q_proj.bias"), src.load("model.layers.0.self_attn.q_proj.bias").half().float())
        qt = q.quantized("model.layers.1.mlp.down_proj")
        assert qt.codes.shape == (64, 128) and int(qt.codes.max()) < 1 << bits
        if act_order:
            assert not torch.equal(qt.g_idx, torch.arange(128) // group_size)  # groups follow activation order
        assert qt.scales.shape == (64, -(-128 // group_size))
    config = json.loads((out / "config.json").read_text())
    qc = config["quantization_config"]
    assert (qc["quant_method"], qc["bits"], qc["group_size"], qc["desc_act"], qc["sym"]) == ("gptq", bits, group_size, act_order, sym)
    assert qc["checkpoint_format"] == "gptq"
    assert json.loads((out / "quantize_config.json").read_text()) == qc
    assert config["llmopt"]["version"] and (out / "tokenizer.json").is_file()
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert {"model.layers.0.mlp.up_proj.qweight", "model.layers.0.mlp.up_proj.qzeros", "model.layers.0.mlp.up_proj.scales",
                "model.layers.0.mlp.up_proj.g_idx"} <= keys
        assert "model.layers.0.mlp.up_proj.weight" not in keys
        assert f.get_tensor("model.layers.0.mlp.up_proj.qweight").shape == (64 * bits // 32, 128)
        assert f.get_tensor("model.layers.0.mlp.up_proj.scales").dtype == torch.float16


def test_per_tensor_rtn_and_dense_format(tiny_models, tmp_path) -> None:
    model_dir = tiny_models("llama", tie=True)
    spec = QuantizeSpec(RTNConfig(8, 0, False, zero_min=1), quantize_head=True)
    with open_model(model_dir) as src:
        out = write_checkpoint(src, spec, quantize_model(src, spec), tmp_path / "g")
        dense = write_checkpoint(src, spec, quantize_model(src, spec), tmp_path / "d", fmt="dense")
    with open_model(out) as g, open_model(dense) as d:
        assert d.kind == "hf" and "lm_head.weight" in d.tensors and "lm_head.weight" in g.tensors
        for name in d.tensors:
            assert torch.equal(g.load(name).half(), d.load(name).half()), name
        cfg = json.loads((out / "config.json").read_text())
        assert cfg["tie_word_embeddings"] is False and cfg["quantization_config"]["lm_head"] is True


def test_zero_point_zero_is_refused() -> None:
    from llmopt.quantized_tensor import QuantizedTensor

    qt = QuantizedTensor(torch.zeros(4, 32, dtype=torch.uint8), torch.ones(4, 1), 4, -1, zeros=torch.zeros(4, 1, dtype=torch.int32))
    with pytest.raises(ValueError, match="zero point of 0"):
        gptq_tensors(qt)
