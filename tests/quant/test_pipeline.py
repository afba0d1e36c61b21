"""The layer-sequential pipeline: every linear's Hessian is the one its input has in the final
quantized model (true-sequential order), checked with transformers running our dense output."""

from __future__ import annotations

import pytest
import torch

import llmopt.quant.gptq as gptq
from llmopt.calibration.samples import CalibConfig, calibration_tokens
from llmopt.calibration.text import CalibText
from llmopt.model import open_model
from llmopt.quant.gptq import GPTQConfig
from llmopt.quant.pipeline import QuantizeSpec, quantize_model
from tests.factories import CORPUS, make_tiny_hf, write_checkpoint


def _tokens(src, n=6, t=40):
    return calibration_tokens(CalibText([CORPUS], "corpus", "0"), src.tokenizer().encode, CalibConfig("c", None, n, t, 0))


def _linear_inputs(model, tokens) -> dict[str, torch.Tensor]:
    """What each stage's first linear receives in a transformers model, [tokens, features] float64."""
    inputs: dict[str, list[torch.Tensor]] = {}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        for label, module in ((f"model.layers.{i}.self_attn.q_proj+k_proj+v_proj", layer.self_attn.q_proj),
                              (f"model.layers.{i}.self_attn.o_proj", layer.self_attn.o_proj),
                              (f"model.layers.{i}.mlp.gate_proj+up_proj", layer.mlp.gate_proj),
                              (f"model.layers.{i}.mlp.down_proj", layer.mlp.down_proj)):
            hooks.append(module.register_forward_pre_hook(lambda m, a, label=label: inputs.setdefault(label, []).append(a[0])))
    with torch.no_grad():
        model(tokens)
    for h in hooks:
        h.remove()
    return {label: torch.cat(xs).reshape(-1, xs[0].shape[-1]).double() for label, xs in inputs.items()}


@pytest.mark.parametrize("family,fp_target", [("llama", 0.0), ("qwen2", 0.0), ("llama", 0.25)])
def test_hessians_follow_the_quantized_model(tmp_path, monkeypatch, family, fp_target) -> None:
    """H from the quantized model's inputs; with GPTAQ also the cross term against the source model's."""
    import json

    import transformers

    seen: dict[str, torch.Tensor] = {}
    crosses: dict[str, torch.Tensor] = {}
    real = gptq.gptq_quantize

    def spy(weight, hessian, cfg, name="", cross=None, grid=None):
        seen[name] = hessian.clone()
        if cross is not None:
            crosses[name] = cross.clone()
        return real(weight, hessian, cfg, name, cross, grid)

    monkeypatch.setattr(gptq, "gptq_quantize", spy)
    spec = QuantizeSpec(GPTQConfig(3, 32, True, fp_target=fp_target), batch_size=4)
    # a float16 source, so the float16 embeddings and norms of the checkpoint are exactly the source's
    source_dir = make_tiny_hf(tmp_path / "src", family, dtype=torch.float16)
    with open_model(source_dir) as src:
        tokens = _tokens(src)
        out = write_checkpoint(src, spec, quantize_model(src, spec, tokens), tmp_path / "q")
    assert len(seen) == 2 * 4  # four stages per block: q+k+v, o, gate+up, down
    assert len(crosses) == (8 if fp_target else 0)

    # transformers' model with the weights our GPTQ reader dequantizes (float32, exact)
    config = transformers.AutoConfig.for_model(**{k: v for k, v in json.loads((out / "config.json").read_text()).items()
                                                  if k not in ("quantization_config", "llmopt")})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with open_model(out) as q:
        model.load_state_dict({n: q.load(n, torch.float32) for n in q.tensors}, strict=False)
    inputs = _linear_inputs(model, tokens)
    assert set(inputs) == set(seen)
    for label, x in inputs.items():
        expected = 2 * x.t() @ x / x.shape[0]
        scale = float(expected.abs().max())
        assert torch.allclose(seen[label].double(), expected, atol=1e-4 * scale), label
    if fp_target:
        source = transformers.AutoModelForCausalLM.from_pretrained(source_dir, dtype=torch.float32).eval()
        fp_inputs = _linear_inputs(source, tokens)
        for label, x in inputs.items():
            expected = 2 * (fp_inputs[label] - x).t() @ x / x.shape[0]
            scale = float(seen[label].abs().max())
            assert torch.allclose(crosses[label].double(), expected, atol=1e-4 * scale), label
        assert float(crosses["model.layers.0.self_attn.q_proj+k_proj+v_proj"].abs().max()) == 0  # same inputs in block 0
        assert float(crosses["model.layers.1.mlp.down_proj"].abs().max()) > 1e-3 * float(seen["model.layers.1.mlp.down_proj"].abs().max())


def test_rtn_needs_no_data_and_streams_blocks(tiny_models) -> None:
    from llmopt.quant.rtn import RTNConfig

    with open_model(tiny_models("mistral")) as src:
        results = list(quantize_model(src, QuantizeSpec(RTNConfig(4, 32, False))))
    assert [r.layer for r in results] == [0, 1]
    assert all(len(r.tensors) == 7 and len(r.reports) == 7 for r in results)
    assert all(r.reports[0].metrics["sqnr_db"] > 15 for r in results)


@pytest.mark.parametrize("fp_target", [0.0, 0.25])
def test_bfloat16_forward_quantizes_the_source_weights(tmp_path, monkeypatch, fp_target) -> None:
    """With a bfloat16 calibration forward, GPTQ still gets the source's exact weights, and float32
    Hessians close to the float32 forward's."""
    calls: dict[torch.dtype, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
    real = gptq.gptq_quantize
    source_dir = make_tiny_hf(tmp_path / "src", "llama", dtype=torch.float16)
    with open_model(source_dir) as src:
        tokens = _tokens(src)
        for dt in (torch.float32, torch.bfloat16):
            seen = calls.setdefault(dt, {})

            def spy(weight, hessian, cfg, name="", cross=None, grid=None, seen=seen):
                seen[name] = (weight.clone(), hessian.clone())
                return real(weight, hessian, cfg, name, cross, grid)

            monkeypatch.setattr(gptq, "gptq_quantize", spy)
            spec = QuantizeSpec(GPTQConfig(4, 32, True, fp_target=fp_target), batch_size=4, act_dtype=dt)
            list(quantize_model(src, spec, tokens))
    full, half = calls[torch.float32], calls[torch.bfloat16]
    assert set(full) == set(half) and len(full) == 8
    for name, (w, h) in full.items():
        w_bf, h_bf = half[name]
        assert w_bf.dtype == torch.float32 and torch.equal(w_bf, w), name
        assert h_bf.dtype == torch.float32
        if name.startswith("model.layers.0."):  # later blocks see inputs that earlier rounding choices changed
            assert torch.allclose(h_bf, h, atol=0.05 * float(h.abs().max())), name
