"""Gemma 3 through the layer-sequential pipeline: the block inputs the pipeline and the imatrix
collector compute one block at a time (the embedding scaled by sqrt(hidden), each layer's rope table
and window, the sandwich norms) are transformers' hidden states, and GPTQ 4-bit runs end to end to a
checkpoint that reads back."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from llmopt.api import quantize
from llmopt.calibration.imatrix import compute_imatrix
from llmopt.model import open_model
from llmopt.model.decoder import Decoder
from tests.factories import CORPUS
from tests.model.test_gemma3 import ids, make_tiny_gemma3, reference


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory):
    return make_tiny_gemma3(tmp_path_factory.mktemp("gemma3") / "g")


def test_imatrix_inputs_are_transformers_activations(gemma3) -> None:
    """Σx² of every linear's input, computed block by block, equals the same sums taken with hooks on
    transformers' whole-model forward (two 40-token chunks: past the 16-token window)."""
    chunks = ids(80, seed=11).view(2, 40)
    with open_model(gemma3) as src:
        ours = compute_imatrix(src, chunks)
    ref = reference(gemma3)
    sums: dict[str, torch.Tensor] = {}
    hooks = []
    for i, layer in enumerate(ref.model.layers):
        for gguf, module in (("attn_q", layer.self_attn.q_proj), ("attn_output", layer.self_attn.o_proj),
                             ("ffn_up", layer.mlp.up_proj), ("ffn_down", layer.mlp.down_proj)):  # fmt: skip
            def hook(_m, args, name=f"blk.{i}.{gguf}.weight") -> None:  # noqa: ANN001
                x = args[0].reshape(-1, args[0].shape[-1]).double()
                sums[name] = sums.get(name, 0) + (x * x).sum(0)

            hooks.append(module.register_forward_pre_hook(hook))
    with torch.no_grad():
        for row in chunks:
            ref(row[None])
    for name, expected in sums.items():
        assert torch.allclose(ours.sums[name], expected, rtol=1e-4, atol=1e-6), name
    assert ours.counts["blk.6.ffn_down.weight"] == 80


def test_gptq_checkpoint_end_to_end(gemma3, tmp_path) -> None:
    """quantize() with GPTQ 4-bit g32 writes a GPTQ v1 checkpoint of every block linear; llmopt reads it
    back (config, packed tensors, Gemma's norms as written), and on text like its calibration its logits
    are closer to the float model's than round-to-nearest's are.
    (transformers 5 loads GPTQ only with optimum and gptqmodel installed, which this venv has not.)"""
    calib = tmp_path / "c.txt"
    calib.write_text(CORPUS)
    result = quantize(gemma3, tmp_path / "gptq", method="gptq", bits=4, group_size=32, calib=str(calib), nsamples=4, seqlen=48)
    config = json.loads((tmp_path / "gptq" / "config.json").read_text())
    qc = config["quantization_config"]
    assert qc["quant_method"] == "gptq" and qc["bits"] == 4 and result.output
    assert config["model_type"] == "gemma3_text" and config["layer_types"][5] == "full_attention"
    with safe_open(str(tmp_path / "gptq" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        q = f.get_slice("model.layers.0.self_attn.q_proj.qweight").get_shape()
    assert q == [576 // 8, 4 * 256] and "model.layers.3.post_feedforward_layernorm.weight" in names
    quantize(gemma3, tmp_path / "rtn", method="rtn", bits=4, group_size=32)
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(gemma3)
    x = torch.tensor([tok(CORPUS[300:900], add_special_tokens=False)["input_ids"][:96]])  # text like the calibration's
    want = reference(gemma3)(x).logits[0].detach()
    errors = {}
    for method in ("gptq", "rtn"):
        with open_model(tmp_path / method) as back, torch.no_grad():
            assert back.arch.family.name == "gemma3" and back.arch.extra["layer_types"] == config["layer_types"]
            ours = Decoder.from_source(back)(x)[0]
        errors[method] = ((ours - want).norm() / want.norm()).item()
        agree = (ours.argmax(-1) == want.argmax(-1)).float().mean().item()
        print(f"gemma3 {method} 4-bit g32: relative logit error {errors[method]:.3f}, top-1 agreement {agree:.2f}")
    assert errors["gptq"] < 0.75 * errors["rtn"]  # GPTQ's calibration (Gemma's block inputs) pays off


def test_awq_folds_into_gemmas_shifted_norms(gemma3, tmp_path) -> None:
    """AWQ divides a norm's output by its scales: for Gemma's (1 + w) norms the stored w becomes
    (1 + w) / s - 1. At 8 bits the quantized model stays close to the float one, which a fold that
    ignored the shift would not (it would rescale the norms' outputs wholesale)."""
    calib = tmp_path / "c.txt"
    calib.write_text(CORPUS)
    quantize(gemma3, tmp_path / "awq", method="awq", bits=8, group_size=32, fmt="gptq", calib=str(calib), nsamples=4, seqlen=48)
    x = ids(48)
    with open_model(tmp_path / "awq") as back, torch.no_grad():
        ours = Decoder.from_source(back)(x)[0]
        folded = back.load("model.layers.0.input_layernorm.weight")
    with open_model(gemma3) as src:
        assert not torch.equal(folded, src.load("model.layers.0.input_layernorm.weight"))  # scales were folded
    want = reference(gemma3)(x).logits[0]
    rel = ((ours - want).norm() / want.norm()).item()
    print(f"gemma3 AWQ 8-bit g32: relative logit error {rel:.4f}")
    assert rel < 0.05, rel
