"""Qwen2-MoE (llmopt/model/families/qwen2moe.py, llmopt/model/moe.py): Qwen2's attention with q/k/v
biases, a router picking each token's top 4 of 60 experts (weights not renormalised: norm_topk_prob
false), and a shared expert on every token scaled by sigmoid(shared_expert_gate(x)).

The random model has Qwen/Qwen1.5-MoE-A2.7B's published config scaled down in layers and width:
60 experts, 4 per token, head_dim 128, no GQA (16:16 in the original), the shared expert 4x an
expert's width (5632 = 4 x 1408), rope base 1e6, RMSNorm eps 1e-6.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from llmopt.errors import InputError
from llmopt.model import open_model
from llmopt.model.decoder import Decoder
from tests.factories import make_tokenizer, perturb_norms
from tests.model.test_mixtral import ids, reference

HEAD_DIM, EXPERTS, PER_TOKEN = 128, 60, 4


def make_tiny_qwen2moe(directory: Path, layers: int = 2, hidden: int = 256, expert_ffn: int = 256, seed: int = 0,
                       norm_topk_prob: bool = False) -> Path:  # fmt: skip
    """A random Qwen2-MoE saved by transformers (one safetensors tensor per expert linear), with a BPE tokenizer."""
    directory.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer(directory)
    heads = hidden // HEAD_DIM
    config = transformers.Qwen2MoeConfig(
        hidden_size=hidden, intermediate_size=4 * expert_ffn, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=heads, head_dim=HEAD_DIM, num_experts=EXPERTS, num_experts_per_tok=PER_TOKEN,
        moe_intermediate_size=expert_ffn, shared_expert_intermediate_size=4 * expert_ffn, norm_topk_prob=norm_topk_prob,
        vocab_size=tok.get_vocab_size(), max_position_embeddings=4096, rope_theta=1e6, rms_norm_eps=1e-6,
        use_sliding_window=False, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(seed)
    model = transformers.Qwen2MoeForCausalLM(config)
    with torch.no_grad():  # routers that prefer different experts per token, biases and shared gates that matter
        for layer in model.model.layers:
            layer.mlp.gate.weight.mul_(20.0)
            layer.mlp.shared_expert_gate.weight.mul_(20.0)
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0.0, 0.5)
    perturb_norms(model)
    model.save_pretrained(directory)
    return directory


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_logits_match_transformers(tmp_path, norm_topk_prob: bool) -> None:
    path = make_tiny_qwen2moe(tmp_path / "qwen2moe", norm_topk_prob=norm_topk_prob)
    x = ids(48)
    with open_model(path) as src, torch.no_grad():
        arch = src.arch
        assert arch.family.name == "qwen2moe" and arch.attention_bias
        assert (arch.extra["num_experts"], arch.extra["experts_per_token"]) == (EXPERTS, PER_TOKEN)
        assert (arch.extra["expert_ffn"], arch.extra["shared_expert_ffn"]) == (256, 1024)
        assert src.tensors["model.layers.1.mlp.experts.59.down_proj.weight"].shape == (arch.hidden_size, 256)
        assert src.tensors["model.layers.1.mlp.shared_expert.down_proj.weight"].shape == (arch.hidden_size, 1024)
        assert src.tensors["model.layers.1.mlp.shared_expert_gate.weight"].shape == (1, arch.hidden_size)
        model = Decoder.from_source(src)
        ours = model(x)
        moe = model.layers[0].mlp
        chosen, weights = moe.route(model.layers[0].post_attention_layernorm(model.embed_tokens(x))[0])
    assert len(chosen.unique()) > 2 * PER_TOKEN  # the tokens spread over the experts
    sums = weights.sum(-1)
    assert torch.allclose(sums, torch.ones_like(sums)) == norm_topk_prob  # renormalised only when the config says
    diff = (ours - reference(path)(x).logits).abs().max().item()
    print(f"qwen2moe norm_topk_prob={norm_topk_prob}: max |logit diff| vs transformers {diff:.2e}")
    assert diff < 1e-4, diff


def test_parameter_count_and_expert_tensors(tmp_path) -> None:
    """Every tensor is read: experts, the shared expert and its gate; transformers' fused expert
    parameters are our per-expert linears."""
    path = make_tiny_qwen2moe(tmp_path / "qwen2moe", layers=1)
    ref = reference(path)
    with open_model(path) as src, torch.no_grad():
        assert src.parameter_count == sum(p.numel() for p in ref.parameters())
        experts = ref.model.layers[0].mlp.experts
        f = src.arch.extra["expert_ffn"]
        assert torch.equal(src.load("model.layers.0.mlp.experts.41.gate_proj.weight"), experts.gate_up_proj[41, :f])
        assert torch.equal(src.load("model.layers.0.mlp.experts.41.up_proj.weight"), experts.gate_up_proj[41, f:])
        assert torch.equal(src.load("model.layers.0.mlp.experts.41.down_proj.weight"), experts.down_proj[41])


def _edit_config(path: Path, **changes) -> None:
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, **changes}))


@pytest.mark.parametrize(("changes", "message"), [
    ({"mlp_only_layers": [0]}, r"dense layers in a Qwen2-MoE \(layers \[0\]"),
    ({"decoder_sparse_step": 2}, r"dense layers in a Qwen2-MoE \(layers \[0\]"),
    ({"num_experts_per_tok": 61}, r"experts per token: 61 is out of range"),
    ({"moe_intermediate_size": "big"}, r"expert feed-forward length: expected an integer"),
])  # fmt: skip
def test_bad_configs_are_refused_in_one_line(tmp_path, changes: dict, message: str) -> None:
    path = make_tiny_qwen2moe(tmp_path / "qwen2moe", layers=1)
    _edit_config(path, **changes)
    with pytest.raises(InputError, match=message):
        open_model(path)


def test_missing_shared_expert_is_refused(tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    path = make_tiny_qwen2moe(tmp_path / "qwen2moe", layers=1)
    weights = load_file(path / "model.safetensors")
    del weights["model.layers.0.mlp.shared_expert_gate.weight"]
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(InputError, match=r"shared_expert_gate\.weight"):
        open_model(path)
