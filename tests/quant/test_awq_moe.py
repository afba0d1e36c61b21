"""AWQ on mixture-of-experts blocks (Mixtral; Qwen2-MoE with its shared expert).

Every expert's gate/up reads the post-attention norm, so one scale serves them all (AutoAWQ's MoE
rule): searched over every expert's gate/up together, each expert's error on its routed tokens, and
folded into the norm; the router and the shared expert's gate read the norm too and are scaled
along (they stay float), so the block computes the same function. Each expert's down is scaled from
its own up, on its own tokens. Experts no calibration token reached get no search and no clip and
are named in the pipeline's warning.
"""

from __future__ import annotations

import logging

import pytest
import torch
from safetensors import safe_open

from llmopt.api import quantize
from llmopt.model import open_model
from llmopt.model.decoder import Decoder
from llmopt.quant.awq import AWQConfig
from llmopt.quant.pipeline import BlockResult, QuantizeSpec, _transform
from llmopt.quant.grids import IntGrid
from tests.factories import CORPUS
from tests.formats.test_mixtral_checkpoint import _calib
from tests.model.test_mixtral import make_tiny_mixtral, reference
from tests.model.test_qwen2moe import make_tiny_qwen2moe

MAKERS = {"mixtral": make_tiny_mixtral, "qwen2moe": make_tiny_qwen2moe}


@pytest.fixture(scope="module", params=sorted(MAKERS))
def moe(request, tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN001, ANN201
    return MAKERS[request.param](tmp_path_factory.mktemp(request.param) / "m")


def _text_ids(path, n: int = 96) -> torch.Tensor:  # noqa: ANN001
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(path)
    return torch.tensor([tok(CORPUS[300:1500], add_special_tokens=False)["input_ids"][:n]])


def test_folded_scales_leave_the_moe_block_unchanged(moe) -> None:
    """Scales only (no clip, no rounding): the norm, the router and the shared expert's gate change,
    the model's logits do not."""
    with open_model(moe) as src, torch.no_grad():
        model = Decoder.from_source(src)
        tokens = _text_ids(moe, 64).reshape(2, 32)
        before = model(tokens)
        spec = QuantizeSpec(AWQConfig(4, 32, clip=False), grids=lambda name: IntGrid(4, False, 32))
        method = spec.method.build()
        experts = src.arch.family.experts
        x = model.embed_tokens(tokens)
        cos, sin = model.rotary(0, tokens.shape[1], x.dtype)
        updated: dict[str, torch.Tensor] = {}
        for layer, block in enumerate(model.layers):
            block.get_submodule(experts.router.rpartition(".")[0]).every_expert = True  # as load_block does
            result = BlockResult(layer, {})
            _transform(block, block, layer, src, spec, method, lambda i: block(x[i:i + 1], cos, sin), len(x), result)
            updated.update(result.updated)
            x = block(x, cos, sin)
        after = model(tokens)
    readers = [experts.router] + ([experts.shared_gate] if experts.shared_gate else [])
    want = {f"model.layers.{i}.{m}.weight" for i in range(2) for m in ["input_layernorm", "post_attention_layernorm", *readers]}
    if experts.shared:  # Qwen2-MoE: no GQA, so o_proj's scales fold into v_proj, its bias included
        want |= {f"model.layers.{i}.self_attn.v_proj.bias" for i in range(2)}
    assert set(updated) == want
    alphas = [v["awq_alpha"] for k, v in method.details.items() if ".experts.0." in k and "awq_alpha" in v]
    assert alphas and all(a >= 0 for a in alphas), method.details  # a real scale was folded, not the identity
    print(f"max |logit change| {float((after - before).abs().max()):.2e} of max |logit| {float(before.abs().max()):.2f}")
    assert (after - before).abs().max().item() < 1e-4


def test_awq_checkpoint_end_to_end(moe, tmp_path, caplog) -> None:
    """AWQ 4-bit g32 (an AWQ checkpoint): every expert quantized, the router written scaled (float), the checkpoint reads
    back and its logits are closer to the float model's than round-to-nearest's; experts no token
    reached are named in the warning and marked as rounded to nearest, and their down is RTN's codes."""
    blocks = []
    with caplog.at_level(logging.WARNING, logger="llmopt.quant.pipeline"):
        quantize(moe, tmp_path / "awq", method="awq", bits=4, group_size=32, calib=_calib(tmp_path), nsamples=8,
                 seqlen=64, on_block=lambda block, total: blocks.append(block))  # fmt: skip
    quantize(moe, tmp_path / "rtn", method="rtn", bits=4, group_size=32, sym=False, fmt="awq")
    with open_model(moe) as src:
        experts = src.arch.family.experts
        count = src.arch.extra["num_experts"]
        router = src.load(f"model.layers.0.{experts.router}.weight")
    reports = {r.name: r for b in blocks for r in b.reports}
    seen = {n.rpartition(".")[0]: r.details["calibration_tokens"] for n, r in reports.items() if f".{experts.module}." in n}
    assert len(seen) == 2 * count
    unrouted = sorted(m for m, k in seen.items() if k == 0)
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert all(m.removeprefix("model.layers.").partition(".")[2] in warned for m in unrouted)
    with safe_open(str(tmp_path / "awq" / "model.safetensors"), "pt") as a, \
            safe_open(str(tmp_path / "rtn" / "model.safetensors"), "pt") as r:  # fmt: skip
        names = set(a.keys())
        assert {f"model.layers.1.{experts.module}.{e}.{experts.down}.qweight" for e in range(count)} <= names
        assert not torch.equal(a.get_tensor(f"model.layers.0.{experts.router}.weight").float(), router.float())
        for module in unrouted:
            assert reports[f"{module}.{experts.gate}"].details["rtn_fallback"] == 1
            assert torch.equal(a.get_tensor(f"{module}.{experts.down}.qweight"), r.get_tensor(f"{module}.{experts.down}.qweight"))
    x = _text_ids(moe)
    want = reference(moe)(x).logits[0].detach()
    errors = {}
    for method in ("awq", "rtn"):
        with open_model(tmp_path / method) as back, torch.no_grad():
            ours = Decoder.from_source(back)(x)[0]
        errors[method] = ((ours - want).norm() / want.norm()).item()
    print(f"{experts.module}: {len(unrouted)} of {len(seen)} experts unrouted; relative logit error 4-bit g32 "
          f"AWQ {errors['awq']:.3f}, RTN {errors['rtn']:.3f}")
    assert errors["awq"] < errors["rtn"]


@pytest.mark.slow  # ~8 s: a Q4_K_M conversion with AWQ and llama.cpp's forward
def test_awq_onto_q4_k_m_runs_in_llama_cpp(tmp_path) -> None:
    """`convert --to gguf --method awq` on Qwen2-MoE: the scaled router and shared-expert gate reach the
    GGUF (float), the experts' stacks are packed from AWQ's codes, and llama.cpp's top-1 is ours."""
    from llmopt.api import convert_to_gguf
    from tests.formats.gguf.llama_cpp_helpers import assert_same_top1, llama_cpp_logits
    from tests.model.test_mixtral import ids

    model = make_tiny_qwen2moe(tmp_path / "m")
    out = tmp_path / "awq.gguf"
    convert_to_gguf(model, out, "Q4_K_M", method="awq", calib=_calib(tmp_path), nsamples=8, seqlen=64)
    x = ids(40)
    with open_model(out) as src, torch.no_grad():
        ours = Decoder.from_source(src)(x)[0]
    # llama.cpp rounds the activations to Q8_K for Q4_K/Q6_K dot products: 0.0123 measured
    assert_same_top1(ours, llama_cpp_logits(out, x[0].tolist()), "qwen2moe AWQ Q4_K_M", atol=0.05)
