"""Qwen2-MoE through the layer-sequential pipeline: GPTQ quantizes each routed expert from the
calibration tokens routed to it, the shared expert from every token; experts no token reached are
rounded to nearest with the warning naming them; the router and the shared expert's one-output gate
stay float; the checkpoint (one quantized linear per expert, as GPTQModel writes Qwen2-MoE) reads back."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors import safe_open

from llmopt.api import quantize
from llmopt.model import open_model
from llmopt.model.decoder import Decoder
from tests.factories import CORPUS
from tests.formats.test_mixtral_checkpoint import _calib
from tests.model.test_qwen2moe import EXPERTS, PER_TOKEN, make_tiny_qwen2moe, reference


@pytest.fixture(scope="module")
def qwen2moe(tmp_path_factory: pytest.TempPathFactory):
    return make_tiny_qwen2moe(tmp_path_factory.mktemp("qwen2moe") / "m")


def test_gptq_checkpoint_end_to_end(qwen2moe, tmp_path, caplog) -> None:
    """GPTQ 4-bit g32: every expert's and the shared expert's gate/up/down packed; per-expert Hessians
    from routed tokens (4 per token), the shared expert's from all of them; experts no token reached
    are RTN's very codes, named in the warning; llmopt reads the checkpoint back, and on text like
    its calibration its logits are closer to the float model's than round-to-nearest's."""
    blocks, n, t = [], 8, 64
    with caplog.at_level(logging.WARNING, logger="llmopt.quant.pipeline"):
        quantize(qwen2moe, tmp_path / "gptq", method="gptq", bits=4, group_size=32, calib=_calib(tmp_path), nsamples=n,
                 seqlen=t, on_block=lambda block, total: blocks.append(block))  # fmt: skip
    reports = {r.name: r for b in blocks for r in b.reports}
    routed = {name.rpartition(".")[0]: r.details["routed_tokens"] for name, r in reports.items() if ".mlp.experts." in name}
    assert len(routed) == 2 * EXPERTS
    for layer in range(2):
        assert sum(routed[f"model.layers.{layer}.mlp.experts.{e}"] for e in range(EXPERTS)) == n * t * PER_TOKEN
    shared = [r for name, r in reports.items() if ".shared_expert." in name]
    assert len(shared) == 2 * 3 and all("routed_tokens" not in r.details for r in shared)  # every token, no routing
    unrouted = sorted(m for m, k in routed.items() if k == 0)
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert all(m.removeprefix("model.layers.").partition(".")[2] in warned for m in unrouted)
    print(f"qwen2moe GPTQ: {len(unrouted)} of {len(routed)} experts without routed tokens (RTN)")

    config = json.loads((tmp_path / "gptq" / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "gptq" and config["num_experts"] == EXPERTS
    assert (config["moe_intermediate_size"], config["shared_expert_intermediate_size"], config["norm_topk_prob"]) == (256, 1024, False)
    with safe_open(str(tmp_path / "gptq" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert {f"model.layers.1.mlp.experts.{e}.down_proj.qweight" for e in range(EXPERTS)} <= names
    assert {f"model.layers.0.mlp.shared_expert.{p}.qweight" for p in ("gate_proj", "up_proj", "down_proj")} <= names
    assert {"model.layers.0.mlp.gate.weight", "model.layers.0.mlp.shared_expert_gate.weight"} <= names  # kept float
    assert "model.layers.0.self_attn.q_proj.bias" in names

    quantize(qwen2moe, tmp_path / "rtn", method="rtn", bits=4, group_size=32)
    with safe_open(str(tmp_path / "gptq" / "model.safetensors"), "pt") as g, \
            safe_open(str(tmp_path / "rtn" / "model.safetensors"), "pt") as r:  # fmt: skip
        for module, k in routed.items():
            same = torch.equal(g.get_tensor(f"{module}.gate_proj.qweight"), r.get_tensor(f"{module}.gate_proj.qweight"))
            assert same == (k == 0), (module, k)
        for layer in range(2):  # the shared expert saw every token: GPTQ's codes, not RTN's
            module = f"model.layers.{layer}.mlp.shared_expert"
            assert not torch.equal(g.get_tensor(f"{module}.down_proj.qweight"), r.get_tensor(f"{module}.down_proj.qweight"))
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(qwen2moe)
    x = torch.tensor([tok(CORPUS[300:900], add_special_tokens=False)["input_ids"][:96]])
    want = reference(qwen2moe)(x).logits[0].detach()
    errors = {}
    for method in ("gptq", "rtn"):
        with open_model(tmp_path / method) as back, torch.no_grad():
            assert back.arch.family.name == "qwen2moe" and back.arch.extra["shared_expert_ffn"] == 1024
            ours = Decoder.from_source(back)(x)[0]
        errors[method] = ((ours - want).norm() / want.norm()).item()
        print(f"qwen2moe {method} 4-bit g32: relative logit error {errors[method]:.3f}")
    assert errors["gptq"] < errors["rtn"]
